"""TorchTitan Python configs for benchmarks/gpu_check.py: llama3 1B on one GPU, DMuon vs AdamW.

    MODULE=benchmarks.gpu_configs CONFIG=llama3_1b_dmuon NGPU=1 ./run_train.sh

TorchTitan ships the 1B model but no 1B job; these start from its 8B job with the
1B model, the local debug tokenizer and dataset (nothing is downloaded), one rank.
"""

from titan_dmuon.integration.assets import ensure_debug_assets as _ensure_debug_assets


def _llama3_1b():
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_8b

    root = _ensure_debug_assets()
    config = llama3_8b()
    config.model_spec = model_registry("1B")
    config.hf_assets_path = f"{root}/tokenizer"
    config.dataloader.dataset = "c4_test"
    config.dataloader.dataset_path = f"{root}/text"
    config.training.local_batch_size = 1
    config.training.seq_len = 2048
    config.training.steps = 4
    config.training.disable_cuda_graphs = True  # the same for both: DMuon turns capture off
    config.checkpoint.enable = False
    config.metrics.log_freq = 1
    config.metrics.enable_tensorboard = False  # (the 8B job's; nothing here reads it)
    config.profiler.enable_profiling = False  # (the 8B job's trace every 100 steps)
    config.parallelism.data_parallel_shard_degree = -1
    config.parallelism.data_parallel_replicate_degree = 1
    config.parallelism.tensor_parallel_degree = 1
    return config


def llama3_1b_adamw():
    return _llama3_1b()


def llama3_1b_dmuon():
    from titan_dmuon import with_dmuon

    return with_dmuon(_llama3_1b(), lr=3e-4, adjust_lr_fn="match_rms_adamw", adamw_lr=3e-4)
