"""DMuon versions of the jobs in train_configs/, for TorchTitan's own entry point:

    torchrun --nproc_per_node 2 -m torchtitan.train --module titan_dmuon --config llama3_debugmodel_dmuon \\
        [--training.steps 4 --optimizer.lr 0.02 ...]

(or ``MODULE=titan_dmuon CONFIG=llama3_debugmodel_dmuon ./run_train.sh``). Each
function mirrors the TOML file of the same job, setting for setting (the tests
compare them), and calls ``with_dmuon`` as a user's own registry function would.
The debug jobs make their tokenizer and dataset under ./assets/debug if missing
(nothing is downloaded).

TorchTitan imports its trainer before this module, so importing it switches on
the CPU accommodations on a machine without an accelerator (integration/cpu.py).
Helpers are imported under private names: TorchTitan offers every public
callable here as a ``--config``.
"""

from __future__ import annotations

import dataclasses as _dataclasses

from titan_dmuon.integration import cpu as _cpu

_cpu.enable()  # before anything below touches TorchTitan's device choice

from torchtitan.distributed.activation_checkpoint import FullAC as _FullAC  # noqa: E402
from torchtitan.distributed.activation_checkpoint import SelectiveAC as _SelectiveAC  # noqa: E402
from torchtitan.models.llama3.config_registry import llama3_8b as _llama3_8b  # noqa: E402
from torchtitan.models.llama3.config_registry import llama3_70b as _llama3_70b  # noqa: E402
from torchtitan.models.llama3.config_registry import llama3_debugmodel as _llama3_debugmodel  # noqa: E402

from titan_dmuon.integration.assets import ensure_debug_assets as _ensure_debug_assets  # noqa: E402
from titan_dmuon.integration.config.python_config import with_dmuon as _with_dmuon  # noqa: E402

_DEBUG_ASSETS = "./assets/debug"
_DEBUG_DMUON = dict(  # train_configs/debug_model*.toml [optimizer]
    lr=0.05,
    weight_decay=0.1,
    momentum=0.95,
    nesterov=True,
    ns_steps=5,
    adamw_lr=8e-4,
    adamw_betas=(0.9, 0.95),
    adamw_eps=1e-8,
    adamw_weight_decay=0.1,
)
_CLUSTER_DMUON = dict(  # train_configs/llama3_*b.toml [optimizer], less lr / adamw_lr
    adjust_lr_fn="match_rms_adamw",
    weight_decay=0.1,
    momentum=0.95,
    nesterov=True,
    ns_steps=5,
    adamw_betas=(0.9, 0.95),
    adamw_eps=1e-8,
    adamw_weight_decay=0.1,
)


def llama3_debugmodel_dmuon():
    """The main job (debug_model.toml): llama3 debug model, DMuon-Z3, 2 ranks on a CPU machine."""
    return _with_dmuon(_debug_job(), **_DEBUG_DMUON, reshard_after_forward=True)


def llama3_debugmodel_dmuon_z2():
    """debug_model_z2.toml: DMuon-Z2, mirroring FSDP2 without resharding."""
    return _with_dmuon(_debug_job(fsdp_reshard_after_forward="never"), **_DEBUG_DMUON)


def llama3_debugmodel_dmuon_hsdp():
    """debug_model_hsdp.toml: DMuon-Z3 on HSDP, 2 replicas x 2 shards (4 ranks)."""
    job = _debug_job(data_parallel_replicate_degree=2, data_parallel_shard_degree=2)
    return _with_dmuon(job, **_DEBUG_DMUON, reshard_after_forward=True)


def llama3_debugmodel_dmuon_pp():
    """debug_model_pp.toml: DMuon with pipeline parallelism 2 (Interleaved1F1B) x FSDP 2 (4 ranks)."""
    job = _debug_job(
        data_parallel_shard_degree=2,
        pipeline_parallel_degree=2,
        pipeline_parallel_schedule="Interleaved1F1B",
        pipeline_parallel_microbatch_size=1,
    )
    return _with_dmuon(job, **_DEBUG_DMUON)


def llama3_debugmodel_dmuon_ft():
    """debug_model_ft.toml: the main job in TorchFT replica groups (2 groups; each run_train.sh is one,
    --fault_tolerance.replica_id R). Requires torchft: pip install -e '.[ft]'."""
    from torchtitan.experiments.torchft.config.job_config import FaultTolerance
    from torchtitan.experiments.torchft.trainer import FaultTolerantTrainer

    job = _debug_job()
    _set(job.checkpoint, enable=True, interval=1000)  # TorchFT transfers what the checkpointer registers
    config = FaultTolerantTrainer.Config(
        **{f.name: getattr(job, f.name) for f in _dataclasses.fields(job)},
        fault_tolerance=FaultTolerance(
            enable=True,
            group_size=2,
            replica_id=0,
            min_replica_size=1,
            process_group="gloo",
            process_group_timeout_ms=10000,
        ),
    )
    return _with_dmuon(config, **_DEBUG_DMUON, reshard_after_forward=True)


def llama3_8b_dmuon():
    """llama3_8b.toml: Llama 3 8B, DMuon on HSDP 4 x 8 (32 GPUs); see the file for Z2 vs Z3."""
    config = _llama3_8b()
    config.dump_folder = "./outputs"
    config.hf_assets_path = "./assets/hf/Llama-3.1-8B"
    _set(config.lr_scheduler, warmup_steps=200, decay_ratio=0.8, decay_type="cosine", min_lr_factor=0.1)
    # DMuon's hooks run every step; TorchTitan's default CUDA-graph capture would skip them
    _set(config.training, local_batch_size=1, seq_len=8192, max_norm=1.0, steps=1000, disable_cuda_graphs=True)
    _set(config.dataloader, dataset="c4", dataset_path="./data/c4")
    _set(
        config.parallelism,
        data_parallel_replicate_degree=4,
        data_parallel_shard_degree=8,
        fsdp_reshard_after_forward="default",
    )
    config.activation_checkpoint = _SelectiveAC.Config()
    _set(config.checkpoint, enable=True, folder="checkpoint", interval=500)
    _set(config.metrics, log_freq=10, enable_tensorboard=True)
    return _with_dmuon(config, lr=3e-4, adamw_lr=3e-4, **_CLUSTER_DMUON)


def llama3_70b_dmuon():
    """llama3_70b.toml: Llama 3 70B, DMuon-Z3 on HSDP 8 x 8 (64 GPUs; no TP, unlike TorchTitan's 70B)."""
    config = _llama3_70b()
    config.dump_folder = "./outputs"
    config.hf_assets_path = "./assets/hf/Llama-3.1-70B"
    _set(config.lr_scheduler, warmup_steps=2000, decay_ratio=0.8, decay_type="cosine", min_lr_factor=0.1)
    _set(config.training, local_batch_size=1, seq_len=8192, max_norm=1.0, steps=10000, disable_cuda_graphs=True)
    _set(config.dataloader, dataset="c4", dataset_path="./data/c4")
    _set(
        config.parallelism,
        data_parallel_replicate_degree=8,
        data_parallel_shard_degree=8,
        tensor_parallel_degree=1,
        fsdp_reshard_after_forward="default",
    )
    config.activation_checkpoint = _FullAC.Config()
    _set(config.checkpoint, enable=True, folder="checkpoint", interval=500)
    _set(config.metrics, log_freq=10, enable_tensorboard=True)
    return _with_dmuon(config, lr=1.5e-4, adamw_lr=1.5e-4, reshard_after_forward=True, **_CLUSTER_DMUON)


def qwen3_moe_debug_dmuon():
    """debug_model_moe.toml: TorchTitan's qwen3 MoE debug model, DMuon-Z3, 2 ranks on a CPU machine
    (experts stay on FSDP2's dim-0 shards; each rank runs Muon on its own)."""
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    config = _local_assets(qwen3_moe_debug())
    _set(config.lr_scheduler, warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0)
    _set(config.training, local_batch_size=2, seq_len=128, max_norm=1.0, steps=10)
    _set(config.parallelism, data_parallel_shard_degree=-1)
    config.activation_checkpoint = None
    _set(config.checkpoint, enable=False, folder="checkpoint", interval=5)
    _set(config.metrics, log_freq=1)
    config.debug.seed = 0
    return _with_dmuon(config, **{**_DEBUG_DMUON, "lr": 0.02}, reshard_after_forward=True)


def qwen3_30b_a3b_dmuon():
    """qwen3_30b_a3b.toml: Qwen3 30B-A3B, DMuon-Z3 on FSDP2 over 64 ranks (experts local)."""
    from torchtitan.models.qwen3.config_registry import qwen3_30b_a3b

    return _moe_cluster_job(qwen3_30b_a3b(), "Qwen3-30B-A3B", lr=3e-4, steps=10000, ep=1)


def deepseek_v3_16b_dmuon():
    """deepseek_v3_16b.toml: DeepSeek-V3 16B, DMuon-Z3 with expert parallelism 8 (64 ranks)."""
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_16b

    return _moe_cluster_job(deepseek_v3_16b(), "deepseek-moe-16b-base", lr=2.2e-4, steps=1000, ep=8)


def moonlight_16b_a3b_dmuon():
    """moonlight_16b_a3b.toml: Moonlight 16B-A3B, DMuon-Z3 with expert parallelism 8 (TorchTitan's
    kimi_k2_7 configs import torchvision: pip install -e '.[kimi]')."""
    from torchtitan.models.kimi_k2_7.config_registry import moonlight_16b_a3b

    return _moe_cluster_job(moonlight_16b_a3b(), "Moonlight-16B-A3B", lr=3e-4, steps=10000, ep=8)


def _moe_cluster_job(config, hf_name: str, *, lr: float, steps: int, ep: int):
    config.dump_folder = "./outputs"
    config.hf_assets_path = f"./assets/hf/{hf_name}"
    # DMuon's hooks run every step; TorchTitan's default CUDA-graph capture would skip them
    _set(config.training, local_batch_size=4, seq_len=4096, max_norm=1.0, steps=steps, disable_cuda_graphs=True)
    _set(config.dataloader, dataset="c4", dataset_path="./data/c4")
    _set(config.parallelism, data_parallel_shard_degree=-1, expert_parallel_degree=ep)
    config.activation_checkpoint = _FullAC.Config()
    _set(config.checkpoint, enable=True, folder="checkpoint", interval=500)
    _set(config.metrics, log_freq=10, enable_tensorboard=True)
    return _with_dmuon(
        config, lr=lr, adjust_lr_fn="match_rms_adamw", weight_decay=0.1, adamw_lr=lr, adamw_weight_decay=0.1
    )


def _local_assets(config):
    _ensure_debug_assets(_DEBUG_ASSETS)  # local files: Hugging Face looks nothing up for them
    config.dump_folder = "./outputs"
    config.hf_assets_path = f"{_DEBUG_ASSETS}/tokenizer"
    _set(config.dataloader, dataset="c4_test", dataset_path=f"{_DEBUG_ASSETS}/text")
    return config


def _debug_job(**parallelism):
    """TorchTitan's llama3 debug config sized for a CPU machine, on the local tokenizer and dataset."""
    _ensure_debug_assets(_DEBUG_ASSETS)  # local files: Hugging Face looks nothing up for them
    config = _llama3_debugmodel()
    config.dump_folder = "./outputs"
    config.hf_assets_path = f"{_DEBUG_ASSETS}/tokenizer"
    _set(config.lr_scheduler, warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0)
    _set(config.training, local_batch_size=2, seq_len=256, max_norm=1.0, steps=20)
    _set(config.dataloader, dataset="c4_test", dataset_path=f"{_DEBUG_ASSETS}/text")
    _set(
        config.parallelism,
        **{
            "data_parallel_replicate_degree": 1,
            "data_parallel_shard_degree": -1,
            "fsdp_reshard_after_forward": "default",
            **parallelism,
        },
    )
    config.activation_checkpoint = _SelectiveAC.Config()
    _set(config.checkpoint, enable=False, folder="checkpoint", interval=10)
    _set(config.metrics, log_freq=1, enable_tensorboard=False)
    config.debug.seed = 0  # same initial weights and data order on every run
    return config


def _set(section, **values) -> None:
    for key, value in values.items():
        setattr(section, key, value)
