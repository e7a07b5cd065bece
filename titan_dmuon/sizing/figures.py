"""The sizing's model: per-rank memory, traffic and Newton–Schulz of each configuration, from the plan
``build_plan`` makes for the job's weights, and the Z2/Z3 recommendation."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch

from titan_dmuon.math.matrix_blocks import block_rows, row_blocks
from titan_dmuon.math.muon_update import muon_step
from titan_dmuon.math.ns_methods import NS_STEPS, ns_flops
from titan_dmuon.optim.step_schedule import pipeline_chunks
from titan_dmuon.optim.workspace import Workspace
from titan_dmuon.plan import cost_model
from titan_dmuon.plan.ownership import OwnershipPlan, build_plan
from titan_dmuon.plan.specs import MatrixSpec
from titan_dmuon.runtime.mode import DedicationMode, MeshInfo, TensorParallelInfo
from titan_dmuon.sizing.recommend import recommend
from titan_dmuon.sizing.records import (
    NS_BYTES,
    STEP_COUNT_BYTES,
    Layout,
    Memory,
    Precision,
    Sizing,
    Stage,
    Traffic,
    Weight,
)


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


def _local_shape(w: Weight, layout: Layout) -> tuple[int, ...]:
    """This rank's TP-local shape (expert parallelism keeps experts whole: TP folds into it)."""
    if layout.tp == 1 or w.tp_dim is None or (w.experts and layout.ep > 1):
        return w.shape
    return tuple(-(-n // layout.tp) if d == w.tp_dim else n for d, n in enumerate(w.shape))


def _rows(total: int, chunks: int) -> list[int]:
    """torch.chunk's rows per chunk (ceil-sized, the last ones fewer or none): FSDP2's dim-0 shards."""
    size = -(-total // chunks)
    return [max(0, min(size, total - i * size)) for i in range(chunks)]


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
            rows = _rows(shape[0], shards)
            padded += rows[0] * rest
            for s, r in enumerate(rows):
                unpadded[s] += r * rest
        return cls(padded=padded, unpadded=unpadded, count=len(shapes))


def _layer_groups(weights: Sequence[Weight], numel) -> tuple[int, list[int]]:
    """Elements of the weights outside layers, and of each layer in order (``numel(weight)``)."""
    root, layers = 0, {}
    for w in weights:
        if w.layer is None:
            root += numel(w)
        else:
            layers[w.layer] = layers.get(w.layer, 0) + numel(w)
    return root, [layers[k] for k in sorted(layers)]


def _two_adjacent(sizes: Sequence[int]) -> int:
    """The most two consecutive layers hold (Z3: the running layer and the prefetched one)."""
    if len(sizes) < 2:
        return sum(sizes)
    return max(a + b for a, b in zip(sizes, sizes[1:]))


# ---- one stage -------------------------------------------------------------------------------------------
def _dedication_mode(layout: Layout, *, reshard_after_forward: bool) -> DedicationMode:
    """The runtime's mode for the cost model: sizes only (no process groups are needed to count)."""
    replicate, shard = (1, layout.replicate) if layout.ddp else (layout.replicate, layout.shard)
    mesh = MeshInfo(
        mesh=None,
        shard_group=None,
        shard_size=shard,
        shard_rank=0,
        replicate_group=None,
        replicate_size=replicate,
        replicate_rank=0,
        device=torch.device("cpu"),
    )
    tp = TensorParallelInfo(mesh=None, group=None, size=layout.tp, rank=0) if layout.tp > 1 else None
    return DedicationMode(mesh=mesh, reshard_after_forward=reshard_after_forward and not layout.ddp, tp=tp)


def _stays_local(w: Weight, layout: Layout) -> bool:
    """The runtime's rule (``DedicationMode.experts_stay_local``, "auto"): experts stay where FSDP2 or
    expert parallelism keeps them whole when there are at least as many as data-parallel ranks."""
    return bool(w.experts) and (
        layout.ep > 1 or _dedication_mode(layout, reshard_after_forward=True).experts_stay_local(w.experts)
    )


def _spec(w: Weight, layout: Layout, unit: int) -> MatrixSpec:
    local = _local_shape(w, layout)
    full = w.shape[-2:]
    blocks = w.blocks or (((0, full[0]),),)
    split = layout.tp > 1 and not (w.experts and layout.ep > 1)
    return MatrixSpec(
        fqn=w.fqn,
        shape=local,
        unit=unit,
        blocks=blocks,
        tp_dim=w.tp_dim if split else None,
        tp_size=layout.tp if split else 1,
    )


@dataclass(frozen=True, kw_only=True)
class _StageWeights:
    """A stage's weights as DMuon splits them, on the layout."""

    layout: Layout
    all: list[Weight]
    dedicated: list[Weight]  # Muon targets with one owner each
    local: list[Weight]  # routed-expert stacks updated where FSDP2 / expert parallelism keeps them
    others: list[Weight]  # AdamW's, under FSDP2

    @classmethod
    def of(cls, weights: Sequence[Weight], layout: Layout) -> _StageWeights:
        local = [w for w in weights if w.muon and _stays_local(w, layout)]
        return cls(
            layout=layout,
            all=list(weights),
            dedicated=[w for w in weights if w.muon and w not in local],
            local=local,
            others=[w for w in weights if not w.muon],
        )

    def numel(self, w: Weight) -> int:
        return math.prod(_local_shape(w, self.layout))

    def unit_sizes(self) -> list[int]:
        """Elements of each layer's packed buffer (its dedicated weights, TP-local), in layer order."""
        return _layer_groups(self.dedicated, self.numel)[1]


def _size_stage(index: int, weights: Sequence[Weight], layout: Layout, precision: Precision) -> Stage:
    stage = _StageWeights.of(weights, layout)
    plan, ns, largest = _plan_stage(stage)
    memory = _stage_memory(stage, plan, precision)
    traffic, floor, tp_exchange = _stage_traffic(stage, plan, precision)
    return Stage(
        index=index,
        memory=memory,
        traffic=traffic,
        floor=floor,
        tp_exchange=tp_exchange,
        plan=plan,
        ns_per_rank=ns,
        largest_ns=largest,
        dedicated_numel=sum(stage.numel(w) for w in stage.dedicated),
        local_expert_numel=sum(stage.numel(w) for w in stage.local),
    )


def _plan_stage(stage: _StageWeights) -> tuple[OwnershipPlan, list[int], int]:
    """``build_plan``'s plan of the dedicated weights, balanced against the experts each rank updates
    in place (as ``dedicate_params`` counts them); Newton–Schulz FLOPs per rank; the largest job."""
    layout = stage.layout
    mesh = _dedication_mode(layout, reshard_after_forward=True).mesh
    ranks, dp_shard = mesh.world_size, mesh.shard_size
    units = {layer: u for u, layer in enumerate(sorted({w.layer for w in stage.dedicated if w.layer is not None}))}
    specs = [_spec(w, layout, units.get(w.layer, len(units))) for w in stage.dedicated]
    ns_local: dict[tuple[int, int], int] = {}
    local_tp_specs = []
    for w in stage.local:
        if layout.ep > 1:  # whole experts on each rank of the expert region (shard x tensor ranks)
            counts = _rows(w.experts, layout.shard * layout.tp)
            for g in range(ranks):
                for t in range(layout.tp):
                    ns_local[g, t] = ns_local.get((g, t), 0) + _one_expert(w) * counts[(g % dp_shard) * layout.tp + t]
        elif layout.tp > 1:  # TP-split experts kept in place: NS homes in each rank's TP group (the plan's)
            local_tp_specs.append(_spec(w, layout, units.get(w.layer, len(units))))
        else:  # FSDP2's dim-0 shards: ceil(E/N) whole experts per shard index, in every replica
            counts = _rows(w.experts, dp_shard)
            for g in range(ranks):
                ns_local[g, 0] = ns_local.get((g, 0), 0) + _one_expert(w) * counts[g % dp_shard]
    initial = [sum(ns_local.get((g, t), 0) for t in range(layout.tp)) for g in range(ranks)]
    plan = build_plan(
        specs,
        replicate_size=mesh.replicate_size,
        shard_size=dp_shard,
        initial_load=initial if ns_local else None,
        local_tp_specs=local_tp_specs,
    )
    largest = max(
        [e.ns_flops // (len(e.tp_homes) if e.tensor_parallel and not e.tp_replicated else 1) for e in plan.entries]
        + [_one_expert(w) for w in stage.local],
        default=0,
    )
    return plan, _ns_per_rank(plan, ns_local, ranks, layout.tp), largest


def _stage_memory(stage: _StageWeights, plan: OwnershipPlan, precision: Precision) -> dict[str, Memory]:
    """Bytes per rank of each configuration (the largest rank of each figure, as memory_table.py reports)."""
    layout = stage.layout
    pb, cb, rb = precision.param, precision.compute, precision.reduce
    mesh = _dedication_mode(layout, reshard_after_forward=True).mesh
    ranks, dp_shard = mesh.world_size, mesh.shard_size
    shards = 1 if layout.ddp else layout.shard  # FSDP2's shard ranks (DDP: whole replicas)
    pipelined = layout.pp > 1

    def sharded(weights: Sequence[Weight]) -> _Sharded:
        return _Sharded.of([_expert_region_shape(w, layout) for w in weights], shards)

    def gathered_numel(w: Weight) -> int:
        return math.prod(_expert_region_shape(w, layout, gathered=True))

    def adamw(weights: _Sharded, s: int) -> int:  # two moments of the unpadded shard, a step count per parameter
        return 2 * weights.unpadded[s] * pb + weights.count * STEP_COUNT_BYTES

    def gathered(weights: Sequence[Weight], reshard: bool) -> int:
        """FSDP2's all-gathered weights (the root's, and two layers or every layer) and one layer's reduce buffer."""
        if layout.ddp:
            return 0
        root, layers = _layer_groups(weights, gathered_numel)
        weights_peak = root + (_two_adjacent(layers) if reshard and not pipelined else sum(layers))
        return weights_peak * cb + max(layers, default=0) * rb

    everything, rest = sharded(stage.all), sharded(stage.others + stage.local)
    moments, local = sharded(stage.others), sharded(stage.local)
    unreduced_all = sum(gathered_numel(w) for w in stage.all) * rb if pipelined else 0
    memory = {}
    for name, reshard in (("FSDP2 + AdamW, Z2", False), ("FSDP2 + AdamW, Z3", True)):
        memory[name] = Memory(
            params=everything.padded * pb,
            grads=everything.padded * pb,
            optimizer_state=max(adamw(everything, s) for s in range(shards)),
            unreduced_grads=unreduced_all,
            gathered_peak=gathered(stage.all, reshard),
        )
    held = [0] * ranks  # elements of whole dedicated weights each rank keeps: shard owners, in every replica
    owned = [0] * ranks  # ... of which it is the global owner: their gradients and momentum
    for e in plan.entries:
        owned[e.owner] += e.numel
        for r in range(mesh.replicate_size):
            held[r * dp_shard + plan.shard_owner(e)] += e.numel
    units = stage.unit_sizes()
    workspaces = _rank_workspaces(stage, plan, ranks, dp_shard, shards)
    unreduced_rest = sum(gathered_numel(w) for w in stage.others + stage.local) * rb
    for name, reshard in (("DMuon-Z2", False), ("DMuon-Z3", True)):
        z3 = reshard and not pipelined and not layout.ddp
        memory[name] = Memory(
            params=rest.padded * pb + max(held) * pb,
            grads=rest.padded * pb + max(owned) * pb,
            optimizer_state=max(
                adamw(moments, (g % dp_shard) % shards) + local.unpadded[(g % dp_shard) % shards] * pb + owned[g] * pb
                for g in range(ranks)
            ),
            buffers_between_steps=(units[0] if units else 0) * cb,
            buffers_peak=(_two_adjacent(units) if z3 else sum(units)) * cb,
            unreduced_grads=unreduced_rest + sum(units) * rb if pipelined else 0,
            gathered_peak=gathered(stage.others + stage.local, reshard) + max(units, default=0) * rb,
            workspace=max(workspaces),
        )
    return memory


def _stage_traffic(stage: _StageWeights, plan: OwnershipPlan, precision: Precision):
    """Elements and bytes per rank per step of the dedicated weights: each configuration, the floor,
    and DMuon's TP exchange (included in DMuon's figures)."""
    layout = stage.layout
    pipelined = layout.pp > 1
    numel = sum(stage.numel(w) for w in stage.dedicated)
    units = stage.unit_sizes()
    traffic = {
        name: _fsdp_traffic(layout, numel, reshard=reshard and not pipelined, precision=precision)
        for name, reshard in (("FSDP2 + AdamW, Z2", False), ("FSDP2 + AdamW, Z3", True))
    }
    mode = _dedication_mode(layout, reshard_after_forward=True)
    n = mode.mesh.shard_size
    if layout.replicate == 1 and layout.tp == 1 and not pipelined and n > 1:
        step = Fraction(n - 1, n) * numel
        for name, key in (("naive FSDP2 + Muon, Z2", "naive_fsdp_z2"), ("naive FSDP2 + Muon, Z3", "naive_fsdp_z3")):
            elements = cost_model.baseline_elements_per_rank(key, shard_size=n, numel=numel)
            traffic[name] = Traffic(
                elements=elements, bytes=(elements - step) * precision.compute + step * precision.reduce
            )
    for name, reshard in (("DMuon-Z2", False), ("DMuon-Z3", True)):
        mode = _dedication_mode(layout, reshard_after_forward=reshard)
        kept = units[-1] if (mode.reshard_after_forward and not pipelined and units) else 0
        traffic[name] = Traffic(
            elements=cost_model.dmuon_elements_per_rank(
                mode, numel=numel, kept_unit_numel=kept, deferred=pipelined, local_tp_numel=plan.local_tp_numel
            ),
            bytes=_dmuon_bytes(mode, numel, kept, pipelined, plan.local_tp_numel, precision),
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


def _expert_region_shape(w: Weight, layout: Layout, gathered: bool = False) -> tuple[int, ...]:
    """The TP-local shape FSDP2 shards on dim 0 (under expert parallelism: the rank's E/ep experts,
    sharded over the rest of the region; ``gathered``: what its all-gather gives in forward)."""
    shape = _local_shape(w, layout)
    if w.experts and layout.ep > 1:  # E / (N T) whole experts per rank: FSDP2's N shards of E / T
        return (-(-shape[0] // (layout.ep if gathered else layout.tp)),) + shape[1:]
    return shape


def _one_expert(w: Weight) -> int:
    """One expert's Newton–Schulz FLOPs (each runs whole on one rank, or under TP on one home)."""
    return sum(ns_flops(block_rows(b), w.shape[-1]) for b in (w.blocks or (((0, w.shape[-2]),),)))


def _ns_per_rank(plan: OwnershipPlan, local: dict[tuple[int, int], int], ranks: int, tp: int) -> list[int]:
    """Newton–Schulz FLOPs of each (data-parallel rank, TP rank): dedicated weights on their owner
    (under TP, each matrix on its home), experts where they are kept."""
    load = dict(local)
    for e in plan.entries:
        if not e.tp_homes:
            load[(e.owner, 0)] = load.get((e.owner, 0), 0) + e.ns_flops
            continue
        per_matrix = e.ns_flops // len(e.tp_homes) if not e.tp_replicated else e.ns_flops
        for home in e.tp_homes[:1] if e.tp_replicated else e.tp_homes:
            load[(e.owner, home)] = load.get((e.owner, home), 0) + per_matrix
    for x in plan.local_tp_experts:
        per_expert = x.spec.ns_flops() // x.spec.shape[0]
        for home in x.tp_homes:
            load[(x.rank, home)] = load.get((x.rank, home), 0) + per_expert
    return [load.get((g, t), 0) for g in range(ranks) for t in range(tp)]


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
) -> Sizing:
    """The figures of every pipeline stage, and Z2 or Z3 for ``device_memory`` bytes per rank of
    which ``activation_share`` is left to activations."""
    if layout.shard < 1 or layout.replicate < 1 or layout.tp < 1 or layout.pp < 1 or layout.ep < 1:
        raise ValueError(f"every degree must be >= 1, got {layout}")
    if layout.ep > 1 and (layout.shard * layout.tp) % layout.ep:
        raise ValueError(f"expert parallelism {layout.ep} must divide shard x tp = {layout.shard * layout.tp}")
    stages = [_size_stage(i, ws, layout, precision) for i, ws in enumerate(split_stages(weights, layout.pp))]
    muon = sum(w.numel for w in weights if w.muon)
    recommendation, reasons = recommend(stages, layout, device_memory, activation_share)
    return Sizing(
        layout=layout,
        precision=precision,
        stages=stages,
        muon_numel=muon,
        other_numel=sum(w.numel for w in weights) - muon,
        recommendation=recommendation,
        reasons=reasons,
    )


def workspace_bytes(calls: Sequence[Sequence[tuple[tuple[int, ...], Sequence]]]) -> int:
    """Bytes of the Muon step's workspace (``optim/workspace.py``, ns_method 'torch', bf16) on a rank whose
    step runs ``calls``: per ``OwnerUpdate.update`` call, the (shape, row blocks) of each weight it updates
    whole (a stack of experts 3-D); each call's batches run once on the meta device, into one workspace."""
    workspace = Workspace()
    for matrices in calls:
        chosen = [(shape, blocks) for shape, blocks in matrices if math.prod(shape)]
        params = [torch.empty(shape, device="meta") for shape, _ in chosen]
        muon_step(
            params,
            [torch.empty_like(p) for p in params],
            [torch.empty_like(p) for p in params],
            [blocks or row_blocks(shape[-2:]) for shape, blocks in chosen],
            lr=0.0,
            weight_decay=0.0,
            momentum=0.95,
            nesterov=True,
            ns_steps=NS_STEPS,
            scratch=workspace,
        )
    return workspace.nbytes()


def workspace_bound(weights: Sequence[Weight]) -> int:
    """The workspace on any rank, at most: every Muon weight's batches in one call. A buffer is as large
    as the largest batch of any shape class asks (``MAX_STACK_BYTES`` caps a batch), so a rank that
    updates fewer weights needs no more; tensor parallelism's exchange buffers are not counted."""
    return workspace_bytes([[(w.shape, w.blocks) for w in weights if w.muon and len(w.shape) in (2, 3)]])


def _rank_workspaces(stage: _StageWeights, plan: OwnershipPlan, ranks: int, dp_shard: int, shards: int) -> list[int]:
    """Each rank's workspace, its step's calls as ``step_schedule`` makes them: the dedicated weights it
    owns, a chunk of layers per call (``pipeline_chunks``), then its experts of the stacks that stay where
    FSDP2 shards them, in one call (``workspace_bytes``); tensor-parallel weights (their exchange and
    homes' buffers) are not counted."""
    chunks = pipeline_chunks(sorted({e.unit for e in plan.entries}))
    out, known = [], {}  # (ranks with the same calls have the same workspace)
    for g in range(ranks):
        calls = [
            [
                (tuple(e.shape), e.blocks)
                for e in plan.entries
                if e.owner == g and e.unit in chunk and not e.tensor_parallel
            ]
            for chunk in chunks
        ]
        calls.append(
            [
                ((_rows(w.shape[0], shards)[(g % dp_shard) % shards], *w.shape[1:]), w.blocks)
                for w in stage.local
                if stage.layout.tp == 1 or w.tp_dim is None
            ]
        )
        key = tuple(tuple((shape, tuple(blocks or ())) for shape, blocks in call) for call in calls)
        if key not in known:
            known[key] = workspace_bytes(calls)
        out.append(known[key])
    return out
