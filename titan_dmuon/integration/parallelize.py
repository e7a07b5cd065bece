"""Parallelizing TorchTitan decoders (llama3, qwen3) with dedicated Muon weights.

Order, as TorchTitan's own ``parallelize_llama``: SPMD-annotate parameters
(default backends), activation checkpointing, then data parallelism. DMuon
slots in before FSDP2: the attention and MLP projections are dedicated on the
data-parallel mesh and every ``fully_shard`` call ignores them.

Mesh choice: FSDP (dp_shard > 1) -> 1-D shard mesh; HSDP (dp_replicate > 1 and
dp_shard > 1) -> 2-D (dp_replicate, dp_shard); DDP (dp_replicate > 1 only)
-> 1-D replicate mesh, broadcast/reduce like DMuon-Z2 (the all-reduce floor).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from titan_dmuon.integration import cpu
from titan_dmuon.runtime import canonical_fqn, dedicate_params

DEFAULT_MUON_PARAMS = (
    r"\.attention\.(qkv_linear\.)?w(q|k|v|o|qkv)\.weight$",
    r"\.feed_forward\.w[123]\.weight$",
)


@dataclass(frozen=True, kw_only=True)
class DedicationSettings:
    muon_params: tuple[str, ...] = DEFAULT_MUON_PARAMS
    reshard_after_forward: bool | None = None  # None: mirror FSDP's setting


@dataclass(frozen=True, kw_only=True)
class DMuonParallelize:
    """The model spec's ``parallelize_fn`` once DMuon is set up (``setup.finalize``).

    What it does depends on the optimizer config (``name``, ``muon_params``,
    ``reshard_after_forward``), and TorchTitan applies command-line overrides by
    building a NEW config after the config function returned; TorchTitan then
    calls this with the parallelism settings only. So nothing is read at setup
    time: DMuonTrainer binds the optimizer config it is about to build
    (``bind``) just before TorchTitan calls this.
    """

    base_fn: Callable
    """The model's own parallelize_fn: used when the optimizer is not "dmuon"."""
    dedication: DedicationSettings | None = None
    bound: bool = False

    def bind(self, optimizer_config) -> DMuonParallelize:
        dedication = None
        if optimizer_config.name == "dmuon":
            dedication = DedicationSettings(
                muon_params=tuple(optimizer_config.muon_params),
                reshard_after_forward=optimizer_config.reshard_after_forward,
            )
        return dataclasses.replace(self, dedication=dedication, bound=True)

    def __call__(self, model: nn.Module, **kwargs) -> nn.Module:
        if not self.bound:
            raise RuntimeError(
                "this parallelize_fn reads the optimizer config, which DMuonTrainer binds when it is built: "
                "build the config with config.build() (a DMuonTrainer.Config)"
            )
        if self.dedication is None:
            return parallelize_without_dmuon(model, base_fn=self.base_fn, **kwargs)
        return parallelize_with_dmuon(model, settings=self.dedication, **kwargs)


def parallelize_with_dmuon(
    model: nn.Module,
    *,
    parallel_dims,
    training,
    parallelism,
    compile_config,
    ac_config,
    dump_folder: str,
    settings: DedicationSettings,
) -> nn.Module:
    """TorchTitan ``parallelize_fn`` for dense decoders with DMuon."""
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed.fsdp import disable_fsdp_gradient_division, get_fsdp_reshard_after_forward_policy
    from torchtitan.distributed.full_dtensor import resolve_fsdp_mesh, validate_config

    check_supported(parallelism=parallelism, compile_config=compile_config, training=training)
    if any(getattr(block, "moe_enabled", False) for block in model.layers.values()):
        raise NotImplementedError("DMuon supports dense decoders; this model has MoE layers (expert weights are 3-D)")
    spmd = parallelism.spmd_backend in ("full_dtensor", "spmd_types")
    if spmd:
        validate_config(parallel_dims, model)
        model.parallelize(parallel_dims)
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)

    fsdp_reshard = get_fsdp_reshard_after_forward_policy(parallelism.fsdp_reshard_after_forward, pp_enabled=False)
    ddp_like = parallel_dims.dp_shard == 1 and parallel_dims.dp_replicate > 1
    reshard = settings.reshard_after_forward
    if reshard is None:
        reshard = False if ddp_like else fsdp_reshard
    mp_policy = MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        cast_forward_inputs=False,
    )
    handle = dedicate_params(
        model,
        muon_parameters(model, settings.muon_params),
        dedication_mesh(parallel_dims, spmd),
        reshard_after_forward=reshard,
        mp_policy=mp_policy,
        units=list(model.layers.values()),
        split_rows=fused_qkv_blocks(model),
        gradient_divide_factor=1.0,  # TorchTitan normalises the loss by the global token count
    )

    _draw_dedicated_weights_in_full(handle)

    if spmd:
        dp_mesh, dp_mesh_dims = resolve_fsdp_mesh(parallel_dims)
    else:
        names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        dp_mesh, dp_mesh_dims = parallel_dims.get_mesh(names), None
    fsdp = {"mesh": dp_mesh, "mp_policy": mp_policy, "ignored_params": handle.ignored_params}
    if dp_mesh_dims is not None:
        fsdp["dp_mesh_dims"] = dp_mesh_dims
    # the same units as TorchTitan's apply_fsdp_to_decoder for dense models
    last_reshard = parallelism.fsdp_reshard_after_forward == "always"
    if model.enable_weight_tying:
        fully_shard([m for m in (model.tok_embeddings, model.norm, model.lm_head) if m is not None], **fsdp, reshard_after_forward=last_reshard)
    else:
        if model.tok_embeddings is not None:
            fully_shard(model.tok_embeddings, **fsdp, reshard_after_forward=fsdp_reshard)
        if model.norm is not None and model.lm_head is not None:
            fully_shard([model.norm, model.lm_head], **fsdp, reshard_after_forward=last_reshard)
    for block in model.layers.values():
        fully_shard(block, **fsdp, reshard_after_forward=fsdp_reshard)
    fully_shard(model, **fsdp)
    disable_fsdp_gradient_division(model)
    if not cpu.accelerator_present():
        cpu.force_sum_reductions(model)
    return model


def _draw_dedicated_weights_in_full(handle) -> None:
    """TorchTitan initialises weights after sharding, on every rank, drawing fused weights
    in their full stock shape. While a module initialises, non-owners hold a full-size
    scratch copy of its dedicated weights, so every rank consumes the same random numbers
    (TorchTitan's initialisers then run unchanged and ranks stay in step) and owners keep
    the values. Transient memory: one weight at a time."""
    for module in handle.owning_modules:
        init_states = module.init_states

        def init_in_full(*args, _init=init_states, _module=module, **kwargs):
            with handle.full_size_placeholders(_module):
                return _init(*args, **kwargs)

        module.init_states = init_in_full


def parallelize_without_dmuon(model: nn.Module, *, base_fn, **kwargs) -> nn.Module:
    """TorchTitan's own parallelize_fn, plus the gloo fix on a CPU machine."""
    model = base_fn(model, **kwargs)
    if not cpu.accelerator_present():
        cpu.force_sum_reductions(model)
    return model


def check_supported(*, parallelism, compile_config, training) -> None:
    """DMuon's TorchTitan limits, checked before any process group exists (and again here)."""
    unsupported = {
        "parallelism.tensor_parallel_degree": parallelism.tensor_parallel_degree,
        "parallelism.pipeline_parallel_degree": parallelism.pipeline_parallel_degree,
        "parallelism.context_parallel_degree": parallelism.context_parallel_degree,
        "parallelism.expert_parallel_degree": parallelism.expert_parallel_degree,
    }
    for key, degree in unsupported.items():
        if degree != 1:
            raise NotImplementedError(
                f"{key} = {degree}: optimizer.name = 'dmuon' supports data parallelism only "
                "(FSDP, HSDP, DDP); set it to 1 or use optimizer.name = 'AdamW'"
            )
    if compile_config.enable:
        raise NotImplementedError("compile.enable = true is not supported with optimizer.name = 'dmuon' yet")
    if training.enable_cpu_offload:
        raise NotImplementedError("training.enable_cpu_offload = true is not supported with optimizer.name = 'dmuon'")


def muon_parameters(model: nn.Module, patterns) -> list[nn.Parameter]:
    compiled = [re.compile(p) for p in patterns]
    chosen = []
    for name, param in model.named_parameters():
        fqn = canonical_fqn(name)
        if any(p.search(fqn) for p in compiled):
            if param.ndim != 2:
                raise ValueError(f"optimizer.muon_params matched {fqn!r} of shape {tuple(param.shape)}; Muon needs 2-D weights")
            chosen.append(param)
    if not chosen:
        raise ValueError(f"optimizer.muon_params {list(patterns)} matched no parameter of the model")
    return chosen


def fused_qkv_blocks(model: nn.Module) -> dict[nn.Parameter, list[list[tuple[int, int]]]]:
    """Row blocks (q, k, v) of every fused wqkv weight, in TorchTitan's grouped layout.

    FusedQKVLinear stores rows as [kv group][hpk q heads, 1 k head, 1 v head][head_dim];
    the q rows of all groups, in order, are exactly the unfused wq (likewise k, v).
    """
    from torchtitan.models.common.attention import FusedQKVLinear

    blocks = {}
    for module in model.modules():
        if isinstance(module, FusedQKVLinear):
            hd, hpk, r = module.head_dim, module.heads_per_kv, module.r_dim
            weight = module.wqkv.weight
            groups = weight.shape[0] // (r * hd)
            starts = [g * r * hd for g in range(groups)]
            blocks[weight] = [
                [(s, s + hpk * hd) for s in starts],
                [(s + hpk * hd, s + (hpk + 1) * hd) for s in starts],
                [(s + (hpk + 1) * hd, s + r * hd) for s in starts],
            ]
    return blocks


def dedication_mesh(parallel_dims, spmd: bool):
    shard_name = "dp_shard" if spmd else "fsdp"
    replicate, shard = parallel_dims.dp_replicate, parallel_dims.dp_shard
    if replicate > 1 and shard > 1:
        return parallel_dims.get_mesh(["dp_replicate", shard_name])
    if shard > 1:
        return parallel_dims.get_mesh(shard_name)
    if replicate > 1:
        return parallel_dims.get_mesh("dp_replicate")
    return parallel_dims.world_mesh
