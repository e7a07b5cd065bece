"""Parallelizing TorchTitan models with dedicated Muon weights.

DMuon runs the model family's own ``parallelize_fn`` (TorchTitan's
``parallelize_llama``, ``parallelize_qwen3``, ``parallelize_deepseekv3``, ...)
unchanged and steps in at its first ``fully_shard`` call. By then TorchTitan
has SPMD-annotated the parameters, applied expert parallelism, wrapped
activation checkpointing and compiled the blocks, and nothing is sharded yet:
DMuon dedicates the Muon targets there, on the data-parallel mesh, and every
``fully_shard`` call of the family then ignores them. FSDP2's units, its
mixed precision, reshard policy, MoE expert placement (Shard(0)/Shard(1),
expert-FSDP mesh), symmetric memory and prefetching stay exactly TorchTitan's.

Mesh: FSDP (dp_shard > 1) -> 1-D shard mesh; HSDP (dp_replicate > 1 and
dp_shard > 1) -> 2-D (dp_replicate, dp_shard); DDP (dp_replicate > 1 only)
-> 1-D replicate mesh, broadcast/reduce like DMuon-Z2 (the all-reduce floor).
Context parallelism: the shard dim is dp_shard x cp (TorchTitan's FSDP mesh
under CP; ``dedication_mesh``).

Experts (3-D): where TorchTitan shards them on dim 0 (whole experts per rank:
at most as many FSDP ranks as experts, or expert parallelism) they stay with
FSDP2 and each rank runs Muon on its own experts; otherwise (more FSDP ranks
than experts, or DDP) each expert weight is dedicated to one owner.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from titan_dmuon.integration import cpu
from titan_dmuon.integration.distributed import context_parallel
from titan_dmuon.integration.distributed.degrees import ParallelDegrees, dedication_mesh
from titan_dmuon.integration.models.attention_clip import record_sequence_shards
from titan_dmuon.integration.names import DEFAULT_MUON_PARAMS, DMUON
from titan_dmuon.options import whole_matrix_rules
from titan_dmuon.plan.owner_groups import GroupOptions
from titan_dmuon.runtime import DedicatedParams, canonical_fqn, dedicate_params
from titan_dmuon.runtime.owner_group_comm import join_owner_groups

# QK-clip rescales q/k rows per head on their owner: with it on, attention projections keep one owner
ATTENTION_PARAMS = r"\.attention\."


@dataclass(frozen=True, kw_only=True)
class DedicationSettings:
    muon_params: tuple[str, ...] = DEFAULT_MUON_PARAMS
    reshard_after_forward: bool | None = None  # None: mirror FSDP's setting
    owner_groups: GroupOptions | None = None  # None: one owner per weight
    keep_whole: tuple[str, ...] = ()  # regexes of Muon targets that keep one owner (a rule reads them whole)
    ns_blocks: str = "matrix"  # "heads": attention projections orthogonalised per head (attention_heads.py)

    @staticmethod
    def of(optimizer_config) -> DedicationSettings:
        """What the dedication reads of DMuon's optimizer config: owner groups unless turned off or a rule
        needs each whole matrix on one rank (``ns_mode`` "exact": torch.optim.Muon's own update; NorMuon's
        per-row statistics; float16 iteration, which the group's Newton–Schulz does not run), attention
        weights kept whole under QK-clip, the Newton–Schulz blocks of the attention projections."""
        groups = None
        needs_whole = whole_matrix_rules(
            ns_mode=optimizer_config.ns_mode,
            ns_dtype=optimizer_config.ns_dtype,
            normuon_beta2=optimizer_config.normuon_beta2,
        )
        if optimizer_config.owner_groups and not needs_whole:
            groups = GroupOptions(
                node_size=optimizer_config.owner_group_node_size, ns_tflops=optimizer_config.owner_group_ns_tflops
            )
        return DedicationSettings(
            muon_params=tuple(optimizer_config.muon_params),
            reshard_after_forward=optimizer_config.reshard_after_forward,
            owner_groups=groups,
            keep_whole=(ATTENTION_PARAMS,) if optimizer_config.qk_clip_threshold is not None else (),
            ns_blocks=optimizer_config.ns_blocks,
        )


@dataclass(frozen=True, kw_only=True)
class DMuonParallelize:
    """The model spec's ``parallelize_fn`` once DMuon is set up (``finalize.finalize``).

    What it does depends on the optimizer config (``name``, ``muon_params``,
    ``reshard_after_forward``), and TorchTitan applies command-line overrides by
    building a NEW config after the config function returned; TorchTitan then
    calls this with the parallelism settings only. So nothing is read at setup
    time: DMuonTrainer binds the optimizer config it is about to build
    (``bind``) just before TorchTitan calls this.
    """

    base_fn: Callable
    """The model's own parallelize_fn (DMuon runs it, stepping in at its first fully_shard)."""
    dedication: DedicationSettings | None = None
    bound: bool = False
    parts: list = dataclasses.field(default_factory=list, compare=False)
    """The handles of the model parts (pipeline stages) this rank dedicated so far: each part's plan
    balances Newton–Schulz over the ranks with the earlier parts' load counted in."""

    def bind(self, optimizer_config) -> DMuonParallelize:
        dedication = None
        if optimizer_config.name == DMUON:
            dedication = DedicationSettings.of(optimizer_config)
        return dataclasses.replace(self, dedication=dedication, bound=True, parts=[])

    def __call__(self, model: nn.Module, **kwargs) -> nn.Module:
        if not self.bound:
            raise RuntimeError(
                "this parallelize_fn reads the optimizer config, which DMuonTrainer binds when it is built: "
                "build the config with config.build() (a DMuonTrainer.Config)"
            )
        if self.dedication is None:
            return parallelize_without_dmuon(model, base_fn=self.base_fn, **kwargs)
        model = parallelize_with_dmuon(
            model, base_fn=self.base_fn, settings=self.dedication, earlier_parts=self.parts, **kwargs
        )
        self.parts.extend(DedicatedParams.of(model))
        return model


def parallelize_with_dmuon(
    model: nn.Module,
    *,
    parallel_dims,
    training,
    parallelism,
    compile_config,
    ac_config,
    dump_folder: str,
    base_fn,
    settings: DedicationSettings,
    earlier_parts: list = (),
) -> nn.Module:
    """TorchTitan ``parallelize_fn``: the family's own ``base_fn`` with DMuon's dedication (the config
    was checked before, ``validation.validate_dmuon``; DMuonTrainer runs it on the config it builds).
    ``earlier_parts``: handles of the other model parts (pipeline stages) this rank holds."""
    degrees = ParallelDegrees.of(parallel_dims)
    dedication = PendingDedication(
        model,
        parallel_dims=parallel_dims,
        degrees=degrees,
        training=training,
        parallelism=parallelism,
        settings=settings,
        earlier_parts=list(earlier_parts),
    )
    with _ignoring_dedicated_weights(dedication):
        model = base_fn(
            model,
            parallel_dims=parallel_dims,
            training=training,
            parallelism=parallelism,
            compile_config=compile_config,
            ac_config=ac_config,
            dump_folder=dump_folder,
        )
    if not dedication.started:
        raise RuntimeError(
            f"{type(model).__name__}'s parallelize function applied no fully_shard: DMuon dedicates its weights "
            "at the first one (TorchTitan's apply_fsdp_to_decoder); use optimizer.name = 'AdamW' for this model"
        )
    if dedication.handle is not None:
        _initialise_as_titan_would(dedication.handle, degrees=degrees, parallel_dims=parallel_dims)
    record_sequence_shards(model, parallel_dims, parallelism)
    if not cpu.accelerator_present():
        cpu.force_sum_reductions(model)
        context_parallel.bind_context_parallel_attention(model, parallel_dims, parallelism)
    return model


class PendingDedication:
    """Dedicates the Muon targets once, when TorchTitan is about to shard the model."""

    def __init__(
        self,
        model: nn.Module,
        *,
        parallel_dims,
        degrees: ParallelDegrees,
        training,
        parallelism,
        settings: DedicationSettings,
        earlier_parts: list,
    ) -> None:
        self.model, self.parallel_dims, self.training, self.parallelism = model, parallel_dims, training, parallelism
        self.degrees = degrees
        self.settings = settings
        self.earlier_parts = earlier_parts
        self.handle = None
        self.started = False  # the first fully_shard was called

    def ignored_params(self) -> set:
        """The weights every fully_shard of this model ignores (dedicating them at the first call)."""
        if not self.started:
            self.started = True
            self.handle = self._dedicate()
        return self.handle.ignored_params if self.handle is not None else set()

    def _dedicate(self):
        """The handle for this model (part), or None for a pipeline stage with no Muon target (e.g.
        only the token embedding): it trains with AdamW alone."""
        from torchtitan.config import TORCH_DTYPE_MAP
        from torchtitan.distributed.fsdp import get_fsdp_reshard_after_forward_policy

        dims, degrees, model = self.parallel_dims, self.degrees, self.model
        fsdp_reshard = get_fsdp_reshard_after_forward_policy(
            self.parallelism.fsdp_reshard_after_forward, pp_enabled=degrees.pipelined
        )
        reshard = self.settings.reshard_after_forward
        if reshard is None:
            reshard = False if degrees.ddp else fsdp_reshard
        targets = muon_parameters(model, self.settings.muon_params)
        if not targets:  # (it still joins the owner groups' process groups, which every rank of the world makes)
            join_owner_groups(
                dedication_mesh(dims, degrees, self.parallelism.spmd_backend != "partial_dtensor"),
                self.settings.owner_groups,
            )
            return None
        names_of = {id(p): canonical_fqn(n) for n, p in model.named_parameters()}
        tp_mesh, tp_dims = None, None
        if degrees.tp > 1:
            tp_mesh = dims.get_mesh("tp")
            tp_dims = {p: tensor_parallel_dim(names_of[id(p)], p) for p in targets}
        return dedicate_params(
            model,
            targets,
            dedication_mesh(dims, degrees, self.parallelism.spmd_backend != "partial_dtensor"),
            reshard_after_forward=reshard,
            mp_policy=MixedPrecisionPolicy(
                param_dtype=TORCH_DTYPE_MAP[self.training.mixed_precision_param],
                reduce_dtype=TORCH_DTYPE_MAP[self.training.mixed_precision_reduce],
                cast_forward_inputs=False,
            ),
            **self._splits(targets),
            gradient_divide_factor=1.0,  # TorchTitan normalises the loss by the global token count
            expert_sharding=expert_sharding(model, degrees),
            initial_load=[sum(load) for load in zip(*(h.plan.ns_flops_per_rank for h in self.earlier_parts))] or None,
            tp_mesh=tp_mesh,
            tp_shard_dims=tp_dims,
            owner_groups=self.settings.owner_groups,
            keep_whole=[p for p in targets if any(re.search(k, names_of[id(p)]) for k in self.settings.keep_whole)],
        )

    def _splits(self, targets: list) -> dict:
        """``dedicate_params``' ``split_rows`` and ``split_cols`` for the Muon targets: a fused wqkv's q, k
        and v, or (``ns_blocks = "heads"``) each head's blocks of the attention projections."""
        target_ids = {id(t) for t in targets}
        rows, cols = fused_qkv_blocks(self.model, self.degrees.tp), {}
        if self.settings.ns_blocks == "heads":
            from titan_dmuon.integration.models.attention_heads import head_blocks

            heads = head_blocks(self.model, self.degrees.tp)
            rows, cols = {**rows, **heads.split_rows}, heads.split_cols
        return {
            "split_rows": {p: b for p, b in rows.items() if id(p) in target_ids},
            "split_cols": {p: b for p, b in cols.items() if id(p) in target_ids},
        }


def tensor_parallel_dim(fqn: str, param) -> int | None:
    """The tensor dim of a TP-local Muon target that TorchTitan's tensor parallelism splits, read from its
    SPMD annotation (spmd_types backend): 0 for column-wise linears (wq/wk/wv/wqkv, w1, w3, shared
    experts' w1/w3), 1 for row-wise ones; 1 (w1_EFD, w3_EFD) or 2 (w2_EDF) for routed experts without
    expert parallelism; None for a weight every tp rank holds whole (the router, MLA's wq_a/wkv_a;
    routed experts under expert parallelism, split on dim 0 only: whole experts per rank)."""
    from spmd_types.runtime import get_partition_spec

    spec = get_partition_spec(param) if hasattr(param, "_partition_spec") else None
    # (dim 0 of an expert stack is the expert dim: expert parallelism splits it into whole experts)
    sharded = [d for d, entry in enumerate(spec or ()) if entry is not None and not (param.ndim == 3 and d == 0)]
    if not sharded:
        return None
    if len(sharded) != 1 or isinstance(spec[sharded[0]], tuple):
        raise NotImplementedError(
            f"{fqn!r} has tensor-parallel layout {spec}: DMuon's tensor parallelism takes weights split along "
            "one dim by the tp mesh (TorchTitan's column- and row-wise parallel linears) or held whole by every "
            "tp rank; leave this weight off optimizer.muon_params"
        )
    return sharded[0]


@contextlib.contextmanager
def _ignoring_dedicated_weights(dedication: PendingDedication):
    """Every ``fully_shard`` TorchTitan's modules call dedicates first (once), then ignores the
    dedicated weights. (TorchTitan's ``apply_fsdp_to_decoder`` cannot exclude parameters.)"""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    def fully_shard(module, *args, ignored_params=None, **kwargs):
        ignored = set(ignored_params or ()) | dedication.ignored_params()
        return torch_fully_shard(module, *args, ignored_params=ignored, **kwargs)

    callers = [
        m
        for name, m in list(sys.modules.items())
        if name.startswith("torchtitan.") and getattr(m, "fully_shard", None) is torch_fully_shard
    ]
    for module in callers:
        module.fully_shard = fully_shard
    try:
        yield
    finally:
        for module in callers:
            module.fully_shard = torch_fully_shard


def expert_sharding(model: nn.Module, degrees: ParallelDegrees) -> str:
    """``dedicate_params``'s ``expert_sharding`` for TorchTitan: under DDP every rank would hold
    every expert, so each is dedicated; under expert parallelism experts are whole on their EP
    rank and stay there (when TorchTitan keeps them whole: at most as many expert-FSDP x EP ranks
    as experts); otherwise TorchTitan's own choice between dim-0 and dim-1 shards decides: it keeps
    whole experts (dim 0) while its FSDP mesh has at most as many ranks as there are experts, and
    that mesh is dp x tp under tensor parallelism (spmd_types: FSDP2's storage mesh); without it
    DMuon's own rule is the same (``DedicationMode.experts_stay_local``)."""
    experts = routed_expert_counts(model)
    if not experts:
        return "auto"
    if degrees.ep > 1:
        if degrees.expert_region_ranks > min(experts):
            raise NotImplementedError(expert_parallel_limit(degrees.expert_region_ranks, min(experts)))
        return "local"
    if not degrees.sharded:
        return "dedicated"
    if degrees.tp > 1:
        return "local" if min(experts) >= degrees.storage_ranks else "dedicated"
    return "auto"


def expert_parallel_limit(efsdp_ep: int, experts: int) -> str:
    """Why DMuon refuses expert parallelism over more ranks than experts, and the fix. (Raising
    expert_parallel_degree does not help: TorchTitan's expert-FSDP x EP ranks are always
    data_parallel_shard x context x tensor parallel ranks.)"""
    return (
        f"expert parallelism with {efsdp_ep} expert-FSDP x EP ranks and {experts} experts: TorchTitan then "
        "splits each expert across ranks (Shard(1)), and DMuon needs whole experts per rank under expert "
        "parallelism; lower data_parallel_shard_degree (raising data_parallel_replicate_degree keeps the world "
        f"size) so that at most {experts} ranks share the experts"
    )


def routed_expert_counts(model: nn.Module) -> list[int]:
    """The number of routed experts of each MoE layer (empty for a dense model)."""
    return [m.routed_experts.inner_experts.num_experts for m in model.modules() if hasattr(m, "routed_experts")]


def _initialise_as_titan_would(handle, *, degrees: ParallelDegrees, parallel_dims) -> None:
    """TorchTitan initialises weights after parallelizing, on every rank, on FSDP2's DTensor
    shards (or DDP's full replicas). While a module initialises, its dedicated weights take
    that form (``DedicatedParams.initialising``), so TorchTitan's initialisers run unchanged,
    every rank draws exactly the random numbers it draws without DMuon, and for the same
    ``[debug] seed`` DMuon starts from TorchTitan's own initial model. Owners keep the values.
    Dedicated experts are the ones FSDP2 would shard on dim 1 (more FSDP ranks than experts)."""
    layout = (
        _fsdp_tp_layout(parallel_dims, tp=degrees.tp, dedication=handle.mesh) if handle.mode.tp is not None else None
    )
    sharded = degrees.sharded
    for module in handle.owning_modules:
        init_states = module.init_states

        def init_like_titan(*args, _init=init_states, _module=module, **kwargs):
            with handle.initialising(
                _module, sharded=sharded, shard_dim=lambda m: 1 if len(m.entry.shape) == 3 else 0, layout=layout
            ):
                return _init(*args, **kwargs)

        module.init_states = init_like_titan


def _fsdp_tp_layout(parallel_dims, *, tp: int, dedication):
    """``layout`` for ``DedicatedParams.initialising`` under tensor parallelism: the DTensor FSDP2 makes
    of a TP-local weight (TorchTitan's dense storage mesh: replicate x shard x tp), so initialisers
    draw the random numbers they draw without DMuon. FSDP2 shards dim 0 of the TP shard (dim 1 of an
    expert stack: TorchTitan shards experts on dim 1 exactly when DMuon dedicates them): a strided
    shard of the full weight when tensor parallelism split that dim too; a weight tensor parallelism
    replicates is Replicate() on the tp dim. Under context parallelism FSDP2 shards over dp_shard x cp
    as one flattened dim ahead of tp (its ``_build_spmd_sharding_spec``): the ``dedication`` mesh, the
    same ranks in the same order."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    from torchtitan.distributed.full_dtensor import resolve_fsdp_mesh

    mesh, _ = resolve_fsdp_mesh(parallel_dims)
    if parallel_dims.cp > 1:
        mesh = DeviceMesh._concatenate([dedication, mesh["tp"]])

    def layout(member):
        dim = member.entry.tp_dim
        fsdp_dim = 1 if len(member.entry.shape) == 3 else 0
        placements = []
        for name in mesh.mesh_dim_names:
            if name == "tp":
                placements.append(Replicate() if dim is None else Shard(dim))
            elif name in ("dp_shard", "fsdp"):
                placements.append(_StridedShard(fsdp_dim, split_factor=tp) if dim == fsdp_dim else Shard(fsdp_dim))
            else:
                placements.append(Replicate())
        return mesh, tuple(placements)

    return layout


def parallelize_without_dmuon(model: nn.Module, *, base_fn, **kwargs) -> nn.Module:
    """TorchTitan's own parallelize_fn, plus the CPU accommodations on a CPU machine."""
    model = base_fn(model, **kwargs)
    if not cpu.accelerator_present():
        cpu.force_sum_reductions(model)
        context_parallel.bind_context_parallel_attention(model, kwargs["parallel_dims"], kwargs["parallelism"])
    return model


def muon_parameters(model: nn.Module, patterns) -> list[nn.Parameter]:
    """The trainable parameters ``optimizer.muon_params`` selects (frozen ones stay with FSDP2).
    The list was checked against the whole model at config time (``validation``); a pipeline stage
    may hold none of them."""
    compiled = [re.compile(p) for p in patterns]
    chosen = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        fqn = canonical_fqn(name)
        if any(p.search(fqn) for p in compiled):
            if param.ndim not in (2, 3):
                raise ValueError(
                    f"optimizer.muon_params matched {fqn!r} of shape {tuple(param.shape)}; Muon needs 2-D weights "
                    "or 3-D expert weights (experts, rows, cols)"
                )
            chosen.append(param)
    return chosen


def fused_qkv_blocks(model: nn.Module, tp: int = 1) -> dict[nn.Parameter, list[list[tuple[int, int]]]]:
    """Row blocks (q, k, v) of every fused wqkv weight, in TorchTitan's grouped layout, as rows of
    the full matrix.

    FusedQKVLinear stores rows as [kv group][hpk q heads, 1 k head, 1 v head][head_dim];
    the q rows of all groups, in order, are exactly the unfused wq (likewise k, v). Column-wise
    tensor parallelism over ``tp`` ranks gives each rank whole kv groups (the weight it holds is
    its ``1/tp`` of the rows), so the full matrix has ``tp`` times the groups of the local one.
    """
    from torchtitan.models.common.attention import FusedQKVLinear

    blocks = {}
    for module in model.modules():
        if isinstance(module, FusedQKVLinear):
            hd, hpk, r = module.head_dim, module.heads_per_kv, module.r_dim
            weight = module.wqkv.weight
            groups = weight.shape[0] * tp // (r * hd)
            starts = [g * r * hd for g in range(groups)]
            blocks[weight] = [
                [(s, s + hpk * hd) for s in starts],
                [(s + hpk * hd, s + (hpk + 1) * hd) for s in starts],
                [(s + (hpk + 1) * hd, s + r * hd) for s in starts],
            ]
    return blocks
