"""The sizing's model: per-rank memory, traffic and Newton–Schulz of each configuration, from the plans
``build_plan`` makes for the job's weights (one owner per weight, and with owner groups: the plan that
runs by default), and the Z2/Z3 recommendation on the plan that runs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from titan_dmuon.math.group_newton_schulz import GRAM_REDUCE_BYTES
from titan_dmuon.plan import cost_model
from titan_dmuon.plan.owner_groups import GroupOptions
from titan_dmuon.sizing.plans import StagePlan, plan_stage
from titan_dmuon.sizing.recommend import recommend
from titan_dmuon.sizing.records import (
    NS_BYTES,
    STEP_COUNT_BYTES,
    Layout,
    Memory,
    PlanFigures,
    Precision,
    Sizing,
    Stage,
    Traffic,
    Weight,
)
from titan_dmuon.sizing.stage_weights import StageWeights, chunk_rows, dedication_mode, layer_groups, local_shape
from titan_dmuon.sizing.step_memory import group_temporaries, rank_workspaces


# ---- the model, split and sharded --------------------------------------------------------------------------
def split_stages(weights: Sequence[Weight], pp: int) -> list[list[Weight]]:
    """Contiguous layers per stage, the earlier stages taking one more when they do not divide
    evenly; weights before the first layer (embeddings) go to the first stage, the rest (final
    norm, head) to the last."""
    layers = sorted({w.layer for w in weights if w.layer is not None})
    if pp > max(1, len(layers)):
        raise ValueError(f"{pp} pipeline stages for a model of {len(layers)} layers: at most one stage per layer")
    bounds, start = [], 0
    for s in range(pp):
        count = len(layers) // pp + (s < len(layers) % pp)
        bounds.append(set(layers[start : start + count]))
        start += count
    first_layer = next((i for i, w in enumerate(weights) if w.layer is not None), len(weights))
    stages: list[list[Weight]] = [[] for _ in range(pp)]
    for i, w in enumerate(weights):
        if w.layer is not None:
            stages[next(k for k, b in enumerate(bounds) if w.layer in b)].append(w)
        else:
            stages[0 if i < first_layer else pp - 1].append(w)
    return stages


@dataclass(frozen=True, kw_only=True)
class _Sharded:
    """FSDP2-managed weights on ``shards`` ranks (dim 0, padded to equal chunks; 1 rank: DDP's replicas)."""

    padded: int  # elements of each rank's padded shards (the same on every rank)
    unpadded: list[int]  # elements per shard index, without padding (what AdamW's moments take)
    count: int  # parameters (AdamW's step counts)

    @classmethod
    def of(cls, shapes: Sequence[tuple[int, ...]], shards: int) -> _Sharded:
        padded, unpadded = 0, [0] * shards
        for shape in shapes:
            rest = math.prod(shape[1:])
            rows = chunk_rows(shape[0], shards)
            padded += rows[0] * rest
            for s, r in enumerate(rows):
                unpadded[s] += r * rest
        return cls(padded=padded, unpadded=unpadded, count=len(shapes))


def _two_adjacent(sizes: Sequence[int]) -> int:
    """The most two consecutive layers hold (Z3: the running layer and the one being gathered)."""
    if len(sizes) < 2:
        return sum(sizes)
    return max(a + b for a, b in zip(sizes, sizes[1:]))


# ---- one stage -------------------------------------------------------------------------------------------
def _size_stage(
    index: int,
    weights: Sequence[Weight],
    layout: Layout,
    precision: Precision,
    options: GroupOptions,
    keep_whole: Sequence[str],
    cache: dict,
) -> Stage:
    stage = StageWeights.of(weights, layout)
    one_owner = _plan_figures(stage, plan_stage(stage, None, keep_whole), precision, options, cache)
    runs = one_owner
    if options.enabled:
        grouped = plan_stage(stage, options, keep_whole)
        if grouped.grouped:
            runs = _plan_figures(stage, grouped, precision, options, cache)
    traffic, floor, tp_exchange = _stage_traffic(stage, one_owner.plan, precision)
    return Stage(
        index=index,
        memory={**_fsdp_memory(stage, precision), **runs.memory},
        traffic={**traffic, **runs.traffic},
        floor=floor,
        tp_exchange=tp_exchange,
        runs=runs,
        one_owner=one_owner,
        dedicated_numel=sum(stage.numel(w) for w in stage.dedicated),
        local_expert_numel=sum(stage.numel(w) for w in stage.local),
    )


def _plan_figures(
    stage: StageWeights, planned: StagePlan, precision: Precision, options: GroupOptions, cache: dict
) -> PlanFigures:
    """``planned``'s figures; ``cache``: the workspace's meta runs, shared by the job's plans and stages."""
    per_rank = cost_model.owner_group_elements_of_ranks(planned.plan)
    mean = sum(per_rank, Fraction(0)) / len(per_rank)
    return PlanFigures(
        plan=planned.plan,
        ns_per_rank=planned.ns_per_rank(),
        ns_seconds=planned.ns_seconds(options),
        largest_ns=planned.largest_whole(stage),
        memory=_dmuon_memory(stage, planned, precision, cache),
        traffic=_dmuon_traffic(stage, planned, precision),
        group_traffic=Traffic(elements=mean, bytes=mean * GRAM_REDUCE_BYTES),
        group_traffic_max=Traffic(elements=max(per_rank), bytes=max(per_rank) * GRAM_REDUCE_BYTES),
    )


def _shards(layout: Layout) -> int:
    return 1 if layout.ddp else layout.shard  # FSDP2's shard ranks (DDP: whole replicas)


def _sharded(stage: StageWeights, weights: Sequence[Weight]) -> _Sharded:
    return _Sharded.of([_expert_region_shape(w, stage.layout) for w in weights], _shards(stage.layout))


def _gathered_numel(stage: StageWeights, w: Weight) -> int:
    return math.prod(_expert_region_shape(w, stage.layout, gathered=True))


def _adamw(weights: _Sharded, s: int, pb: int) -> int:
    """AdamW's two moments of the unpadded shard, and a step count per parameter."""
    return 2 * weights.unpadded[s] * pb + weights.count * STEP_COUNT_BYTES


def _gathered(stage: StageWeights, weights: Sequence[Weight], reshard: bool, precision: Precision) -> int:
    """FSDP2's all-gathered weights (the root's, and two layers or every layer) and one layer's reduce buffer."""
    if stage.layout.ddp:
        return 0
    root, layers = layer_groups(weights, lambda w: _gathered_numel(stage, w))
    weights_peak = root + (_two_adjacent(layers) if reshard and stage.layout.pp == 1 else sum(layers))
    return weights_peak * precision.compute + max(layers, default=0) * precision.reduce


def _fsdp_memory(stage: StageWeights, precision: Precision) -> dict[str, Memory]:
    """Bytes per rank of FSDP2 + AdamW on every weight (the largest rank of each figure)."""
    pb, shards = precision.param, _shards(stage.layout)
    everything = _sharded(stage, stage.all)
    unreduced = sum(_gathered_numel(stage, w) for w in stage.all) * precision.reduce if stage.layout.pp > 1 else 0
    return {
        name: Memory(
            params=everything.padded * pb,
            grads=everything.padded * pb,
            optimizer_state=max(_adamw(everything, s, pb) for s in range(shards)),
            unreduced_grads=unreduced,
            gathered_peak=_gathered(stage, stage.all, reshard, precision),
        )
        for name, reshard in (("FSDP2 + AdamW, Z2", False), ("FSDP2 + AdamW, Z3", True))
    }


def _dmuon_memory(stage: StageWeights, planned: StagePlan, precision: Precision, cache: dict) -> dict[str, Memory]:
    """Bytes per rank of DMuon-Z2 and -Z3 on ``planned`` (the largest rank of each figure, as
    memory_table.py reports): a weight whole on its shard owner in every replica row and, with its
    gradient and momentum, on its global owner; an owner group's member its block of each."""
    layout, plan = stage.layout, planned.plan
    pb, cb, rb = precision.param, precision.compute, precision.reduce
    ranks, dp_shard, shards = plan.world_size, plan.shard_size, _shards(layout)
    pipelined = layout.pp > 1
    rest, moments = _sharded(stage, stage.others + stage.local), _sharded(stage, stage.others)
    local = _sharded(stage, stage.local)
    held = [0] * ranks  # elements of dedicated weights (or blocks) each rank keeps: shard owners, in every replica
    owned = [0] * ranks  # ... of which it is the global owner: their gradients and momentum
    for e in plan.entries:
        members = e.group.ranks if e.group is not None else (e.owner,)
        for i, rank in enumerate(members):
            numel = e.block_numel(i) if e.group is not None else e.numel
            owned[rank] += numel
            for r in range(plan.replicate_size):
                held[r * dp_shard + rank % dp_shard] += numel
    units = stage.unit_sizes()
    workspaces = rank_workspaces(stage, plan, shards, cache)
    temporaries = group_temporaries(plan)
    unreduced_rest = sum(_gathered_numel(stage, w) for w in stage.others + stage.local) * rb
    memory = {}
    for name, reshard in (("DMuon-Z2", False), ("DMuon-Z3", True)):
        z3 = reshard and not pipelined and not layout.ddp
        memory[name] = Memory(
            params=rest.padded * pb + max(held) * pb,
            grads=rest.padded * pb + max(owned) * pb,
            optimizer_state=max(
                _adamw(moments, (g % dp_shard) % shards, pb)
                + local.unpadded[(g % dp_shard) % shards] * pb
                + owned[g] * pb
                for g in range(ranks)
            ),
            buffers_between_steps=(units[0] if units else 0) * cb,
            buffers_peak=(_two_adjacent(units) if z3 else sum(units)) * cb,  # Z2, pipelining: every layer
            unreduced_grads=unreduced_rest + sum(units) * rb if pipelined else 0,
            gathered_peak=_gathered(stage, stage.others + stage.local, reshard, precision) + max(units, default=0) * rb,
            workspace=max(workspaces),
            group_temporaries=max(temporaries),
        )
    return memory


def _stage_traffic(stage: StageWeights, plan, precision: Precision):
    """Elements and bytes per rank per step of the dedicated weights under FSDP2 (and naive FSDP2 + Muon),
    the floor, and DMuon's TP exchange (included in DMuon's figures; ``plan``: its experts kept in place)."""
    layout = stage.layout
    pipelined = layout.pp > 1
    numel = sum(stage.numel(w) for w in stage.dedicated)
    traffic = {
        name: _fsdp_traffic(layout, numel, reshard=reshard and not pipelined, precision=precision)
        for name, reshard in (("FSDP2 + AdamW, Z2", False), ("FSDP2 + AdamW, Z3", True))
    }
    mode = dedication_mode(layout, reshard_after_forward=True)
    n = mode.mesh.shard_size
    if layout.replicate == 1 and layout.tp == 1 and not pipelined and n > 1:
        step = Fraction(n - 1, n) * numel
        for name, key in (("naive FSDP2 + Muon, Z2", "naive_fsdp_z2"), ("naive FSDP2 + Muon, Z3", "naive_fsdp_z3")):
            elements = cost_model.baseline_elements_per_rank(key, shard_size=n, numel=numel)
            traffic[name] = Traffic(
                elements=elements, bytes=(elements - step) * precision.compute + step * precision.reduce
            )
    world = mode.mesh.world_size
    floor = 2 * Fraction(world - 1, world) * numel  # reduce the gradients (reduce dtype), gather the weights back
    tp = (
        cost_model.tensor_parallel_elements_per_rank(
            layout.tp, numel=numel, data_parallel_ranks=world, local_expert_numel=plan.local_tp_numel
        )
        if layout.tp > 1
        else Fraction(0)
    )
    return (
        traffic,
        Traffic(elements=floor, bytes=floor / 2 * (precision.reduce + precision.compute)),
        Traffic(elements=tp, bytes=tp * NS_BYTES),
    )


def _dmuon_traffic(stage: StageWeights, planned: StagePlan, precision: Precision) -> dict[str, Traffic]:
    """DMuon-Z2's and -Z3's elements and bytes per rank per step on ``planned``: the cost model's, as the
    ledger tests hold the runtime to (``design_elements_per_rank``), the owner groups' all-reduces
    included (fp32, the mean over the ranks)."""
    layout, plan = stage.layout, planned.plan
    pipelined = layout.pp > 1
    numel = sum(stage.numel(w) for w in stage.dedicated)
    units = stage.unit_sizes()
    groups = cost_model.owner_group_elements_per_rank(plan)
    traffic = {}
    for name, reshard in (("DMuon-Z2", False), ("DMuon-Z3", True)):
        mode = dedication_mode(layout, reshard_after_forward=reshard)
        kept = units[-1] if (mode.reshard_after_forward and not pipelined and units) else 0
        elements = cost_model.dmuon_elements_per_rank(
            mode, numel=numel, kept_unit_numel=kept, deferred=pipelined, local_tp_numel=plan.local_tp_numel
        )
        traffic[name] = Traffic(
            elements=elements + groups,
            bytes=_dmuon_bytes(mode, numel, kept, pipelined, plan.local_tp_numel, precision)
            + groups * GRAM_REDUCE_BYTES,
        )
    return traffic


def _expert_region_shape(w: Weight, layout: Layout, gathered: bool = False) -> tuple[int, ...]:
    """The TP-local shape FSDP2 shards on dim 0 (under expert parallelism: the rank's E/ep experts,
    sharded over the rest of the region; ``gathered``: what its all-gather gives in forward)."""
    shape = local_shape(w, layout)
    if w.experts and layout.ep > 1:  # E / (N T) whole experts per rank: FSDP2's N shards of E / T
        return (-(-shape[0] // (layout.ep if gathered else layout.tp)),) + shape[1:]
    return shape


def _dmuon_bytes(mode, numel: int, kept: int, deferred: bool, local_tp: int, precision: Precision) -> Fraction:
    """The cost model's elements as bytes: broadcasts in the compute dtype, reduces in the reduce
    dtype, HSDP's post-step broadcast of the master weight in the parameter dtype, the TP exchange
    in bf16 (Newton–Schulz's inputs and outputs)."""
    n, r = mode.mesh.shard_size, mode.mesh.replicate_size
    step = Fraction(n - 1, n)
    broadcasts = (2 if mode.reshard_after_forward and not deferred else 1) * step * numel - step * kept
    total = broadcasts * precision.compute + step * numel * precision.reduce
    if r > 1:
        total += Fraction(r - 1, r) * Fraction(numel, n) * (precision.reduce + precision.param)
    if mode.tp is not None:
        total += NS_BYTES * cost_model.tensor_parallel_elements_per_rank(
            mode.tp.size, numel=numel, data_parallel_ranks=n * r, local_expert_numel=local_tp
        )
    return total


def _fsdp_traffic(layout: Layout, numel: int, *, reshard: bool, precision: Precision) -> Traffic:
    """FSDP2 on the same weights: all-gather in forward (and again in backward when it reshards),
    reduce-scatter, and under HSDP an all-reduce of each shard across the replicas; DDP: an all-reduce."""
    if layout.ddp:
        elements = 2 * Fraction(layout.replicate - 1, layout.replicate) * numel
        return Traffic(elements=elements, bytes=elements * precision.reduce)
    n, r = layout.shard, layout.replicate
    step = Fraction(n - 1, n) * numel
    gathers = (2 if reshard else 1) * step
    across = 2 * Fraction(r - 1, r) * Fraction(numel, n)
    return Traffic(
        elements=gathers + step + across, bytes=gathers * precision.compute + (step + across) * precision.reduce
    )


# ---- the whole job ---------------------------------------------------------------------------------------
def size_job(
    weights: Sequence[Weight],
    layout: Layout,
    *,
    precision: Precision = Precision(),
    device_memory: float = 80e9,
    activation_share: float = 0.5,
    groups: GroupOptions = GroupOptions(),
    keep_whole: Sequence[str] = (),
) -> Sizing:
    """The figures of every pipeline stage, and Z2 or Z3 for ``device_memory`` bytes per rank of
    which ``activation_share`` is left to activations. ``groups``: owner groups as ``dedicate_params``
    plans them (its default: on; a figure left None is an H200's, as nothing is measured here; ``enabled``
    False: one owner per weight); ``keep_whole``: regexes of weights that keep one owner (QK-clip's)."""
    if layout.shard < 1 or layout.replicate < 1 or layout.tp < 1 or layout.pp < 1 or layout.ep < 1:
        raise ValueError(f"every degree must be >= 1, got {layout}")
    if layout.ep > 1 and (layout.shard * layout.tp) % layout.ep:
        raise ValueError(f"expert parallelism {layout.ep} must divide shard x tp = {layout.shard * layout.tp}")
    options, cache = groups.stated(), {}
    stages = [
        _size_stage(i, ws, layout, precision, options, keep_whole, cache)
        for i, ws in enumerate(split_stages(weights, layout.pp))
    ]
    muon = sum(w.numel for w in weights if w.muon)
    recommendation, reasons = recommend(stages, layout, device_memory, activation_share)
    return Sizing(
        layout=layout,
        precision=precision,
        stages=stages,
        muon_numel=muon,
        other_numel=sum(w.numel for w in weights) - muon,
        recommendation=recommendation,
        groups=options,
        reasons=reasons,
    )
