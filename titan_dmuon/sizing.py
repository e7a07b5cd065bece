"""Sizing a DMuon job before it runs: the seeds' Z2/Z3 decision tree as figures.

For a model (its weights' names and shapes) and a layout (replicate R x shard N x tensor T x
pipeline P, expert parallelism E), per rank:

* memory of FSDP2 + AdamW, DMuon-Z2 and DMuon-Z3: parameters, gradients, optimizer state, DMuon's
  packed buffers (between steps and at their peak), FSDP2's gathered weights (an estimate), and the
  total without activations;
* communication per step of the Muon targets against the floor (an all-reduce of their gradients
  over the data-parallel ranks), from ``titan_dmuon.cost_model``;
* Newton–Schulz work per rank from the ownership plan ``build_plan`` makes (max, mean, max/mean)
  and its critical path at a given TFLOP/s;
* which of Z2/Z3 to run, and why.

    python -m titan_dmuon.sizing --model llama3 --flavor 8B --world 64
    python -m titan_dmuon.sizing --model deepseek_v3 --flavor 671B --shard 64 --ep 64 --pp 8
    python -m titan_dmuon.sizing --config train_configs/llama3_8b.toml

The figures follow the runtime: a dedicated weight lives whole (parameter dtype) on its shard
owner in every replica group; its gradient and momentum on its one global owner; each layer's
weights are broadcast into one packed buffer in the compute dtype, which Z2 keeps from forward to
backward (every layer: P_M per rank at the end of forward) and Z3 frees (two layers at a time,
the running one and the prefetched one); between steps the first layer's buffer is alive (its
broadcast for the next forward starts at the end of the step). FSDP2's weights are dim-0 shards
padded to ceil(rows / N) rows; AdamW keeps two moments and a step count. ``tests/test_sizing.py``
holds these figures to what ``benchmarks/memory_table.py`` measures on the CPU-sized cases.

Model weights come from ``titan_dmuon.integration.model_shapes`` (shape tables without TorchTitan,
or TorchTitan's model on the meta device), imported only by ``main``; the rest is TorchTitan-free.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import torch

from titan_dmuon import cost_model
from titan_dmuon.group_plan import H200_BF16_TFLOPS  # (Newton–Schulz runs below it: times are lower bounds)
from titan_dmuon.muon_math import Block, block_rows, ns_flops
from titan_dmuon.plan import MatrixSpec, OwnershipPlan, build_plan
from titan_dmuon.runtime.mode import DedicationMode, MeshInfo, TensorParallelInfo

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
CONFIGURATIONS = ("FSDP2 + AdamW, Z2", "FSDP2 + AdamW, Z3", "DMuon-Z2", "DMuon-Z3")
STEP_COUNT_BYTES = 4  # AdamW's per-parameter step count: a float32 scalar tensor (torch.optim.AdamW's and DMuon's)
NS_BYTES = 2  # Newton–Schulz runs in bf16: what the TP exchange sends to the homes and back


@dataclass(frozen=True, kw_only=True)
class Weight:
    """One parameter of the model, as the sizing needs it."""

    fqn: str
    shape: tuple[int, ...]
    muon: bool  # a Muon target (dedicated, or a routed-expert stack updated where it lives)
    layer: int | None  # its transformer layer (one DMuon unit per layer); None: embeddings, final norm, head
    blocks: tuple[Block, ...] | None = None  # Newton–Schulz row blocks (fused q/k/v); None: the whole matrix
    tp_dim: int | None = None  # the dim tensor parallelism splits; None: every TP rank holds it whole

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def experts(self) -> int:
        """Experts in a 3-D stack (0 for any other weight)."""
        return self.shape[0] if len(self.shape) == 3 else 0


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Data-parallel replicate R x shard N (HSDP when both > 1, DDP when N = 1 < R), tensor
    parallelism T, pipeline stages P, expert parallelism E (inside the shard x tensor ranks)."""

    replicate: int = 1
    shard: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.replicate * self.shard * self.tp * self.pp

    @property
    def ddp(self) -> bool:
        return self.shard == 1 and self.replicate > 1

    def describe(self) -> str:
        kind = "DDP" if self.ddp else "HSDP" if self.replicate > 1 else "FSDP"
        parts = [f"replicate {self.replicate} x shard {self.shard} ({kind})"]
        parts += [f"{name} {n}" for name, n in (("TP", self.tp), ("PP", self.pp), ("EP", self.ep)) if n > 1]
        return ", ".join(parts) + f": {self.world} ranks"


@dataclass(frozen=True, kw_only=True)
class Precision:
    """Bytes per element: master weights, gradients and optimizer state (``param``), forward and
    backward weights (``compute``: FSDP2's ``mp_policy.param_dtype``), gradient reduction (``reduce``)."""

    param: int = 4
    compute: int = 2
    reduce: int = 4


@dataclass(frozen=True, kw_only=True)
class Memory:
    """Bytes per rank (the largest rank of each figure)."""

    params: int
    grads: int
    optimizer_state: int
    buffers_between_steps: int = 0  # DMuon's packed buffers alive between steps (the first layer's)
    buffers_peak: int = 0  # DMuon's packed buffers at their peak (the counter ``peak_buffer_bytes``)
    unreduced_grads: int = 0  # pipelining: the stage's dedicated gradients held unreduced over the micro-batches
    gathered_peak: int = 0  # FSDP2's all-gathered weights and one layer's reduce buffers (estimate)

    @property
    def persistent(self) -> int:
        return self.params + self.grads + self.optimizer_state + self.buffers_between_steps

    @property
    def peak(self) -> int:
        """Everything above at once, activations and Newton–Schulz workspace not included."""
        return (self.params + self.grads + self.optimizer_state + self.buffers_peak + self.unreduced_grads
                + self.gathered_peak)


@dataclass(frozen=True, kw_only=True)
class Traffic:
    """Elements (the design's unit) and bytes per rank per step for the dedicated Muon targets."""

    elements: Fraction
    bytes: Fraction


@dataclass(frozen=True, kw_only=True)
class Stage:
    """One pipeline stage's figures (the whole model without pipelining)."""

    index: int
    memory: dict[str, Memory]
    traffic: dict[str, Traffic]
    floor: Traffic
    tp_exchange: Traffic
    plan: OwnershipPlan
    ns_per_rank: list[int]  # Newton–Schulz FLOPs of each rank of the stage (R x N x T)
    largest_ns: int  # the largest Newton–Schulz job one rank runs whole (a matrix, a dedicated stack)
    dedicated_numel: int
    local_expert_numel: int


@dataclass(frozen=True, kw_only=True)
class Sizing:
    layout: Layout
    precision: Precision
    stages: list[Stage]
    muon_numel: int
    other_numel: int
    recommendation: str
    reasons: list[str] = field(default_factory=list)

    def heaviest(self, configuration: str) -> Stage:
        """The stage whose ranks need the most memory under ``configuration``."""
        return max(self.stages, key=lambda s: s.memory[configuration].peak)

    @property
    def ns_max(self) -> int:
        return max(max(s.ns_per_rank) for s in self.stages)

    @property
    def ns_mean(self) -> float:
        return sum(sum(s.ns_per_rank) for s in self.stages) / sum(len(s.ns_per_rank) for s in self.stages)


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
        bounds.append(set(layers[start:start + count]))
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
    mesh = MeshInfo(mesh=None, shard_group=None, shard_size=shard, shard_rank=0, replicate_group=None,
                    replicate_size=replicate, replicate_rank=0, device=torch.device("cpu"))
    tp = TensorParallelInfo(mesh=None, group=None, size=layout.tp, rank=0) if layout.tp > 1 else None
    return DedicationMode(mesh=mesh, reshard_after_forward=reshard_after_forward and not layout.ddp, tp=tp)


def _stays_local(w: Weight, layout: Layout) -> bool:
    """The runtime's rule (``DedicationMode.experts_stay_local``, "auto"): experts stay where FSDP2 or
    expert parallelism keeps them whole when there are at least as many as data-parallel ranks."""
    return bool(w.experts) and (layout.ep > 1 or
                                _dedication_mode(layout, reshard_after_forward=True).experts_stay_local(w.experts))


def _spec(w: Weight, layout: Layout, unit: int) -> MatrixSpec:
    local = _local_shape(w, layout)
    full = w.shape[-2:]
    blocks = w.blocks or (((0, full[0]),),)
    split = layout.tp > 1 and not (w.experts and layout.ep > 1)
    return MatrixSpec(fqn=w.fqn, shape=local, unit=unit, blocks=blocks,
                      tp_dim=w.tp_dim if split else None, tp_size=layout.tp if split else 1)


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
        return cls(layout=layout, all=list(weights), dedicated=[w for w in weights if w.muon and w not in local],
                   local=local, others=[w for w in weights if not w.muon])

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
    return Stage(index=index, memory=memory, traffic=traffic, floor=floor, tp_exchange=tp_exchange, plan=plan,
                 ns_per_rank=ns, largest_ns=largest, dedicated_numel=sum(stage.numel(w) for w in stage.dedicated),
                 local_expert_numel=sum(stage.numel(w) for w in stage.local))


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
    plan = build_plan(specs, replicate_size=mesh.replicate_size, shard_size=dp_shard,
                      initial_load=initial if ns_local else None, local_tp_specs=local_tp_specs)
    largest = max([e.ns_flops // (len(e.tp_homes) if e.tensor_parallel and not e.tp_replicated else 1)
                   for e in plan.entries] + [_one_expert(w) for w in stage.local], default=0)
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
        memory[name] = Memory(params=everything.padded * pb, grads=everything.padded * pb,
                              optimizer_state=max(adamw(everything, s) for s in range(shards)),
                              unreduced_grads=unreduced_all, gathered_peak=gathered(stage.all, reshard))
    held = [0] * ranks  # elements of whole dedicated weights each rank keeps: shard owners, in every replica
    owned = [0] * ranks  # ... of which it is the global owner: their gradients and momentum
    for e in plan.entries:
        owned[e.owner] += e.numel
        for r in range(mesh.replicate_size):
            held[r * dp_shard + plan.shard_owner(e)] += e.numel
    units = stage.unit_sizes()
    unreduced_rest = sum(gathered_numel(w) for w in stage.others + stage.local) * rb
    for name, reshard in (("DMuon-Z2", False), ("DMuon-Z3", True)):
        z3 = reshard and not pipelined and not layout.ddp
        memory[name] = Memory(
            params=rest.padded * pb + max(held) * pb,
            grads=rest.padded * pb + max(owned) * pb,
            optimizer_state=max(adamw(moments, (g % dp_shard) % shards) + local.unpadded[(g % dp_shard) % shards] * pb
                                + owned[g] * pb for g in range(ranks)),
            buffers_between_steps=(units[0] if units else 0) * cb,
            buffers_peak=(_two_adjacent(units) if z3 else sum(units)) * cb,
            unreduced_grads=unreduced_rest + sum(units) * rb if pipelined else 0,
            gathered_peak=gathered(stage.others + stage.local, reshard) + max(units, default=0) * rb)
    return memory


def _stage_traffic(stage: _StageWeights, plan: OwnershipPlan, precision: Precision):
    """Elements and bytes per rank per step of the dedicated weights: each configuration, the floor,
    and DMuon's TP exchange (included in DMuon's figures)."""
    layout = stage.layout
    pipelined = layout.pp > 1
    numel = sum(stage.numel(w) for w in stage.dedicated)
    units = stage.unit_sizes()
    traffic = {name: _fsdp_traffic(layout, numel, reshard=reshard and not pipelined, precision=precision)
               for name, reshard in (("FSDP2 + AdamW, Z2", False), ("FSDP2 + AdamW, Z3", True))}
    mode = _dedication_mode(layout, reshard_after_forward=True)
    n = mode.mesh.shard_size
    if layout.replicate == 1 and layout.tp == 1 and not pipelined and n > 1:
        step = Fraction(n - 1, n) * numel
        for name, key in (("naive FSDP2 + Muon, Z2", "naive_fsdp_z2"), ("naive FSDP2 + Muon, Z3", "naive_fsdp_z3")):
            elements = cost_model.baseline_elements_per_rank(key, shard_size=n, numel=numel)
            traffic[name] = Traffic(elements=elements,
                                    bytes=(elements - step) * precision.compute + step * precision.reduce)
    for name, reshard in (("DMuon-Z2", False), ("DMuon-Z3", True)):
        mode = _dedication_mode(layout, reshard_after_forward=reshard)
        kept = units[-1] if (mode.reshard_after_forward and not pipelined and units) else 0
        traffic[name] = Traffic(
            elements=cost_model.dmuon_elements_per_rank(mode, numel=numel, kept_unit_numel=kept, deferred=pipelined,
                                                        local_tp_numel=plan.local_tp_numel),
            bytes=_dmuon_bytes(mode, numel, kept, pipelined, plan.local_tp_numel, precision))
    world = mode.mesh.world_size
    floor = 2 * Fraction(world - 1, world) * numel  # reduce the gradients (reduce dtype), gather the weights back
    tp = (cost_model.tensor_parallel_elements_per_rank(layout.tp, numel=numel, data_parallel_ranks=world,
                                                       local_expert_numel=plan.local_tp_numel)
          if layout.tp > 1 else Fraction(0))
    return (traffic, Traffic(elements=floor, bytes=floor / 2 * (precision.reduce + precision.compute)),
            Traffic(elements=tp, bytes=tp * NS_BYTES))


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
        for home in (e.tp_homes[:1] if e.tp_replicated else e.tp_homes):
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
            mode.tp.size, numel=numel, data_parallel_ranks=n * r, local_expert_numel=local_tp)
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
    return Traffic(elements=gathers + step + across,
                   bytes=gathers * precision.compute + (step + across) * precision.reduce)


# ---- the whole job ---------------------------------------------------------------------------------------
def size_job(
    weights: Sequence[Weight], layout: Layout, *, precision: Precision = Precision(),
    device_memory: float = 80e9, activation_share: float = 0.5,
) -> Sizing:
    """The figures of every pipeline stage, and Z2 or Z3 for ``device_memory`` bytes per rank of
    which ``activation_share`` is left to activations."""
    if layout.shard < 1 or layout.replicate < 1 or layout.tp < 1 or layout.pp < 1 or layout.ep < 1:
        raise ValueError(f"every degree must be >= 1, got {layout}")
    if layout.ep > 1 and (layout.shard * layout.tp) % layout.ep:
        raise ValueError(f"expert parallelism {layout.ep} must divide shard x tp = {layout.shard * layout.tp}")
    stages = [_size_stage(i, ws, layout, precision) for i, ws in enumerate(split_stages(weights, layout.pp))]
    muon = sum(w.numel for w in weights if w.muon)
    recommendation, reasons = _recommend(stages, layout, device_memory, activation_share)
    return Sizing(layout=layout, precision=precision, stages=stages, muon_numel=muon,
                  other_numel=sum(w.numel for w in weights) - muon, recommendation=recommendation, reasons=reasons)


def _recommend(stages: list[Stage], layout: Layout, device_memory: float, share: float) -> tuple[str, list[str]]:
    """The decision tree, on the figures: Z2 saves one broadcast of the Muon targets per step and
    keeps every layer's gathered weights from forward to backward; take it only where that fits."""
    z2 = max(stages, key=lambda s: s.memory["DMuon-Z2"].peak)
    z3 = max(stages, key=lambda s: s.memory["DMuon-Z3"].peak)
    budget = (1 - share) * device_memory
    if layout.pp > 1:
        return "either (the same under pipelining)", [
            "with pipelining DMuon keeps each layer's weights gathered over the micro-batches and reduces once per "
            "step, whatever reshard_after_forward says: Z2 and Z3 move and hold the same"]
    if layout.ddp:
        return "DMuon-Z2 (DDP)", ["under DDP every rank holds the whole model anyway; DMuon runs Z2 there"]
    if layout.shard * layout.replicate == 1:
        return "either (one data-parallel rank)", ["one data-parallel rank: nothing is broadcast or reduced"]
    extra = z2.memory["DMuon-Z2"].peak - z3.memory["DMuon-Z3"].peak
    saved = z3.traffic["DMuon-Z3"].bytes - z2.traffic["DMuon-Z2"].bytes
    fits = z2.memory["DMuon-Z2"].peak <= budget
    reasons = [
        f"Z2 keeps every layer's gathered Muon weights from forward to backward: {_gb(extra)} more per rank at its "
        f"peak than Z3 (P_M in the compute dtype, not P_M / N)",
        f"Z3 broadcasts them again in backward: {_gb(saved)} more per rank per step than Z2 "
        f"({float(z3.traffic['DMuon-Z3'].elements / z3.floor.elements):.2f}x the floor against "
        f"{float(z2.traffic['DMuon-Z2'].elements / z2.floor.elements):.2f}x)",
        f"Z2's peak without activations, {_gb(z2.memory['DMuon-Z2'].peak)}, is "
        + ("within" if fits else "over") + f" {_gb(budget)} ({1 - share:.0%} of {_gb(device_memory)}, the rest "
        "left to activations)",
    ]
    if fits:
        return "DMuon-Z2", reasons + ["so Z2: it fits, and moves the least (measure the step time before keeping it)"]
    z3_peak = z3.memory["DMuon-Z3"].peak
    if z3_peak > budget:  # (Z3 is the smaller, and over the same budget: say so, with what would fit)
        return "DMuon-Z3", reasons + [
            f"Z3's peak without activations, {_gb(z3_peak)}, is over {_gb(budget)} too: neither fits this layout; "
            "more data-parallel ranks, tensor or pipeline parallelism, or a device with more memory",
            "so Z3, the smaller of the two"]
    return "DMuon-Z3", reasons + [
        f"Z3's peak without activations, {_gb(z3_peak)}, is within {_gb(budget)}",
        "so Z3; if Z3 runs out of memory, look at activations (activation checkpointing) and gradient accumulation "
        "first: Z3's buffers are two layers"]


# ---- the report ------------------------------------------------------------------------------------------
def _gb(nbytes: float, unit: float | None = None) -> str:
    """Bytes in GB, or in MB where the figures (``unit``: the largest of them) stay below 1 GB."""
    if (unit if unit is not None else nbytes) >= 1e9:
        return f"{nbytes / 1e9:,.2f} GB"
    return f"{nbytes / 1e6:,.2f} MB"


def _flop(flops: float) -> str:
    return f"{flops / 1e12:,.1f} TFLOP" if flops >= 1e11 else f"{flops / 1e9:,.3f} GFLOP"


def _count(x: float) -> str:
    return f"{x / 1e9:,.3f}B" if x >= 1e8 else f"{x / 1e6:,.3f}M"


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:,.1f} ms" if seconds >= 1e-3 else f"{1e6 * seconds:,.1f} us"


def render(sizing: Sizing, *, title: str, tflops: float = H200_BF16_TFLOPS) -> str:
    """The report ``python -m titan_dmuon.sizing`` prints."""
    return "\n".join([*_header(sizing, title), *_memory_table(sizing), *_traffic_table(sizing),
                      *_newton_schulz_lines(sizing, tflops), "", f"Recommendation: {sizing.recommendation}",
                      *(f"- {reason}" for reason in sizing.reasons)])


def _header(sizing: Sizing, title: str) -> list[str]:
    names = {4: "fp32", 2: "bf16"}
    p = sizing.precision
    return [f"{title}; {sizing.layout.describe()}",
            f"Muon targets {_count(sizing.muon_numel)} elements, other weights {_count(sizing.other_numel)}; weights, "
            f"gradients and optimizer state in {names[p.param]}, compute {names[p.compute]}, reduce {names[p.reduce]}"]


def _memory_table(sizing: Sizing) -> list[str]:
    staged = sizing.layout.pp > 1
    stage_of = {c: sizing.heaviest(c) for c in CONFIGURATIONS}
    out = ["", "Memory per rank (GB = 1e9 bytes, MB = 1e6; the largest rank"
           + (", of the heaviest pipeline stage" if staged else "")
           + "; activations and Newton–Schulz workspace not included)", "",
           "| | " + " | ".join(CONFIGURATIONS) + " |", "|---" * (len(CONFIGURATIONS) + 1) + "|"]
    rows = [("parameters", lambda m: m.params), ("gradients", lambda m: m.grads),
            ("optimizer state", lambda m: m.optimizer_state),
            ("DMuon buffers between steps", lambda m: m.buffers_between_steps),
            ("DMuon buffers, peak", lambda m: m.buffers_peak)]
    if staged:
        rows.append(("gradients held over the micro-batches (estimate)", lambda m: m.unreduced_grads))
    rows += [("FSDP2's gathered weights + a layer's reduce buffer (estimate)", lambda m: m.gathered_peak),
             ("**persistent**: parameters, gradients, state, buffers between steps", lambda m: m.persistent),
             ("**peak without activations**", lambda m: m.peak)]
    unit = max(stage_of[c].memory[c].peak for c in CONFIGURATIONS)
    for label, get in rows:
        out.append(f"| {label} | " + " | ".join(_gb(get(stage_of[c].memory[c]), unit) for c in CONFIGURATIONS) + " |")
    if staged:
        out += ["", "heaviest stage: " + ", ".join(f"{c} stage {stage_of[c].index}" for c in CONFIGURATIONS)]
    return out


def _traffic_table(sizing: Sizing) -> list[str]:
    stage = max(sizing.stages, key=lambda s: s.dedicated_numel)
    names = {4: "fp32", 2: "bf16"}
    p = sizing.precision
    unit = max(t.bytes for t in stage.traffic.values())
    out = ["", "Communication per rank per step of the dedicated Muon targets "
           f"({_count(stage.dedicated_numel)} elements"
           + (" in the largest pipeline stage" if sizing.layout.pp > 1 else "") + "; elements as a bandwidth-optimal "
           f"algorithm moves them, titan_dmuon.cost_model; bytes with weights sent in {names[p.compute]}, gradients in "
           f"{names[p.reduce]})", "", "| | elements | x floor | bytes |", "|---|---|---|---|",
           f"| floor: an all-reduce of their gradients over the data-parallel ranks | {_count(stage.floor.elements)} "
           f"| 1.000 | {_gb(stage.floor.bytes, unit)} |"]
    for name in ("FSDP2 + AdamW, Z2", "FSDP2 + AdamW, Z3", "naive FSDP2 + Muon, Z2", "naive FSDP2 + Muon, Z3",
                 "DMuon-Z2", "DMuon-Z3"):
        if name in stage.traffic:
            t = stage.traffic[name]
            ratio = f"{float(t.elements / stage.floor.elements):.3f}" if stage.floor.elements else "-"
            out.append(f"| {name} | {_count(t.elements)} | {ratio} | {_gb(t.bytes, unit)} |")
    if sizing.layout.tp > 1:
        out.append("| of which DMuon's TP exchange (both modes, on the TP group) | "
                   f"{_count(stage.tp_exchange.elements)} "
                   f"| | {_gb(stage.tp_exchange.bytes, unit)} |")
    out.append("")
    if stage.local_expert_numel:
        out.append("Routed experts kept where FSDP2 / expert parallelism holds them "
                   f"({_count(stage.local_expert_numel)} "
                   "elements in this stage): each rank updates its own; they move what they move under FSDP2 + AdamW. ")
    out.append("FSDP2's traffic for the other weights (embeddings, norms, head) is the same in every row.")
    return out


def _newton_schulz_lines(sizing: Sizing, tflops: float) -> list[str]:
    rate = tflops * 1e12
    largest = max(s.largest_ns for s in sizing.stages)
    mean = sizing.ns_mean
    return ["", "Newton–Schulz per step (ns_method 'torch', 5 steps; owners from build_plan"
            + (", per pipeline stage" if sizing.layout.pp > 1 else "") + "):", "",
            f"- busiest rank {_flop(sizing.ns_max)}, mean {_flop(mean)}, max/mean "
            f"{sizing.ns_max / mean if mean else 1.0:.3f}",
            f"- critical path at {tflops:g} TFLOP/s: {_ms(sizing.ns_max / rate)} (the busiest rank); floor "
            f"{_ms(largest / rate)} (the largest job one rank runs whole, {_flop(largest)}: no plan goes below it)",
            "- FSDP2 + AdamW runs none; naive FSDP2 + Muon runs every matrix on every rank"]


# ---- the command -----------------------------------------------------------------------------------------
def _layout(args, job_layout: Layout | None) -> Layout:
    given = {k: getattr(args, k) for k in ("replicate", "shard", "tp", "pp", "ep") if getattr(args, k) is not None}
    base = job_layout or Layout()
    values = {k: given.get(k, getattr(base, k)) for k in ("replicate", "shard", "tp", "pp", "ep")}
    if args.world is not None and "shard" not in given:
        rest = values["replicate"] * values["tp"] * values["pp"]
        if args.world % rest:
            raise SystemExit(f"--world {args.world} is not a multiple of replicate x tp x pp = {rest}")
        values["shard"] = args.world // rest
    layout = Layout(**values)
    if args.world is not None and layout.world != args.world:
        raise SystemExit(f"--world {args.world} but replicate x shard x tp x pp = {layout.world}")
    return layout


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m titan_dmuon.sizing", description=__doc__.split("\n\n")[0])
    source = parser.add_argument_group("the model (one of)")
    source.add_argument("--model", help="TorchTitan model name: llama3, deepseek_v3, qwen3, kimi_k2_7")
    source.add_argument("--flavor",
                        help="its flavor in TorchTitan's model registry, e.g. 8B, 70B, 405B, 671B, debugmodel")
    source.add_argument("--config", metavar="FILE.toml",
                        help="a TOML job (its model, muon_params, degrees and dtypes); other --section.key value "
                             "arguments override it as with run_train.sh")
    source.add_argument("--source", choices=("auto", "table", "torchtitan"), default="auto",
                        help="--model's weights from the shape tables (no TorchTitan needed) or TorchTitan's model on "
                             "the meta device; auto: the table where there is one")
    layout = parser.add_argument_group("the layout (a --config's [parallelism] unless given)")
    layout.add_argument("--world", type=int, help="ranks in all; the shard degree is what the others leave")
    for name, help_text in (("replicate", "data-parallel replicas R (HSDP; with --shard 1: DDP)"),
                            ("shard", "data-parallel shard ranks N"), ("tp", "tensor-parallel degree"),
                            ("pp", "pipeline stages"), ("ep", "expert-parallel degree (inside shard x tp)")):
        layout.add_argument(f"--{name}", type=int, help=help_text)
    figures = parser.add_argument_group("figures")
    figures.add_argument("--tflops", type=float, default=H200_BF16_TFLOPS,
                         help="Newton–Schulz TFLOP/s per rank for the critical path (default: the H200's bf16 matmul "
                              "peak, so the times are lower bounds)")
    figures.add_argument("--device-memory", type=float, default=80.0,
                         help="GB per rank for the recommendation (default 80)")
    figures.add_argument("--activation-share", type=float, default=0.5,
                         help="share of --device-memory left to activations when deciding Z2/Z3 (default 0.5)")
    figures.add_argument("--param-dtype", default=None,
                         help="master weights, gradients, optimizer state (default fp32)")
    figures.add_argument("--compute-dtype", default=None,
                         help="forward/backward weights (default bf16; a --config's training.mixed_precision_param)")
    figures.add_argument("--reduce-dtype", default=None,
                         help="gradient reduction (default fp32; a --config's training.mixed_precision_reduce)")
    args, overrides = parser.parse_known_args(argv)
    if overrides and not args.config:
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    from titan_dmuon.integration import model_shapes

    job_layout, compute_dtype, reduce_dtype = None, "bfloat16", "float32"
    if args.config:
        job = model_shapes.from_toml(args.config, overrides, world_size=args.world)
        weights, title = job.weights, job.description
        job_layout, compute_dtype, reduce_dtype = job.layout, job.compute_dtype, job.reduce_dtype
    elif args.model and args.flavor:
        tabled = model_shapes.table_key(args.model, args.flavor) is not None
        use_table = args.source == "table" or (args.source == "auto" and tabled)
        if use_table:
            if not tabled:
                parser.error(f"no shape table for {args.model} {args.flavor}; tables: "
                             + ", ".join(f"{n} {f}" for n, f in model_shapes.SHAPE_TABLES))
            weights = model_shapes.from_table(args.model, args.flavor)
            title = f"{args.model} {args.flavor} (shape table)"
        else:
            weights = model_shapes.registry_weights(args.model, args.flavor)
            title = f"{args.model} {args.flavor} (TorchTitan's model registry, meta device)"
    else:
        parser.error("give --model and --flavor, or --config")
    if job_layout is None and args.world is None and args.shard is None:
        parser.error("give the layout: --world, or --shard (with --replicate, --tp, --pp, --ep as needed)")
    precision = Precision(param=DTYPE_BYTES[args.param_dtype or "float32"],
                          compute=DTYPE_BYTES[args.compute_dtype or compute_dtype],
                          reduce=DTYPE_BYTES[args.reduce_dtype or reduce_dtype])
    sizing = size_job(weights, _layout(args, job_layout), precision=precision, device_memory=args.device_memory * 1e9,
                      activation_share=args.activation_share)
    print(render(sizing, title=title, tflops=args.tflops))


if __name__ == "__main__":
    main(sys.argv[1:])
