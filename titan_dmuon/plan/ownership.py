"""Who owns what: a deterministic ownership plan, identical on every rank.

The plan is pure data computed from parameter names and shapes only, so every rank derives the same plan
without communicating; ``validate_across_ranks`` then proves it with one small all-gather of a digest.
Ranks are positions in a (replicate R) x (shard N) mesh, numbered ``r * N + s``. The global owner (r, s)
of a matrix runs Newton–Schulz for it; in every replicate group the rank at shard index s keeps the full
weight ("shard owner") and broadcasts it in forward. With owner groups (``plan/owner_groups.py``) a weight
may instead be owned by k ranks of one replicate row, each keeping one block along the long side.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan_dmuon.math.group_newton_schulz import block_bounds, group_ns_flops
from titan_dmuon.math.ns_methods import NS_STEPS
from titan_dmuon.plan.owner_groups import (
    Candidate,
    GroupOptions,
    gram_elements,
    member_comm_seconds,
    place_groups,
    sizings,
)
from titan_dmuon.plan.specs import LocalTPExperts, MatrixSpec, OwnerGroup, PlanEntry


@dataclass(frozen=True, kw_only=True)
class OwnershipPlan:
    """Who owns what: each dedicated weight's owner on the (replicate R) x (shard N) mesh, built by
    ``build_plan`` from names and shapes alone, identical on every rank."""

    replicate_size: int
    """R: replica groups (1 without HSDP)."""
    shard_size: int
    """N: ranks in a shard group."""
    entries: tuple[PlanEntry, ...]
    """Every dedicated weight with its owner (global rank ``r * N + s``) and Newton–Schulz FLOPs."""
    local_load: tuple[int, ...] = ()
    """Per rank: Newton–Schulz FLOPs of the experts it updates in place (not dedicated)."""
    local_tp_experts: tuple[LocalTPExperts, ...] = ()
    """TP-split experts kept in place, per rank, with their Newton–Schulz homes."""
    groups: GroupOptions | None = None
    """How owner groups were chosen (None: off)."""

    @property
    def world_size(self) -> int:
        """Ranks of the data-parallel mesh: R x N."""
        return self.replicate_size * self.shard_size

    def shard_owner(self, entry: PlanEntry) -> int:
        """Shard index whose rank holds the full weight in every replicate group."""
        return entry.owner % self.shard_size

    def replicate_owner(self, entry: PlanEntry) -> int:
        """Replicate index of the one rank that runs Newton–Schulz."""
        return entry.owner // self.shard_size

    @property
    def ns_flops_per_rank(self) -> list[int]:
        """Each rank's Newton–Schulz work per step: dedicated weights it owns, plus its local experts."""
        load = list(self.local_load) or [0] * self.world_size
        for e in self.entries:
            if e.group is None:
                load[e.owner] += e.ns_flops
            else:  # each member its share
                for rank, flops in zip(e.group.ranks, e.group.member_flops):
                    load[rank] += flops
        return load

    @property
    def numel_per_shard_rank(self) -> list[int]:
        """Elements of dedicated weights (of a group member: its block) each shard index keeps between steps."""
        held = [0] * self.shard_size
        for e in self.entries:
            if e.group is None:
                held[self.shard_owner(e)] += e.numel
            else:
                for i, rank in enumerate(e.group.ranks):
                    held[rank % self.shard_size] += e.block_numel(i)
        return held

    def gram_elements_per_rank(self, ns_steps: int = NS_STEPS, ns_method: str = "torch") -> list[int]:
        """Per global rank, the elements its owner groups' all-reduces carry per step (the packed fp32
        Gram matrix at each all-reduce, and the norm), as each member gives them to the all-reduce."""
        out = [0] * self.world_size
        for e in self.entries:
            if e.group is not None:
                short, long = min(e.shape), max(e.shape)
                for rank in e.group.ranks:
                    out[rank] += gram_elements(short, long, e.group.size, ns_steps, ns_method)
        return out

    def ns_seconds_per_rank(self, options: GroupOptions | None = None, ns_steps: int = NS_STEPS) -> list[float]:
        """Each rank's Newton–Schulz time per step: its FLOPs at ``options.ns_tflops`` and its groups'
        sums (``GroupOptions.all_reduce_seconds``), by ``options`` (default: the plan's, else
        ``GroupOptions()``'s rates)."""
        options = options or self.groups or GroupOptions()
        comm = self.group_seconds_per_rank(options, ns_steps)
        return [f / options.flops_per_second() + c for f, c in zip(self.ns_flops_per_rank, comm)]

    def group_seconds_per_rank(self, options: GroupOptions | None = None, ns_steps: int = NS_STEPS) -> list[float]:
        """Each rank's time in its owner groups' all-reduces per step (``member_comm_seconds``): the part of
        ``ns_seconds_per_rank`` that is not FLOPs, for callers that count the FLOPs per rank their own way
        (``titan_dmuon.sizing``: TP homes, experts kept in place)."""
        options = options or self.groups or GroupOptions()
        seconds = [0.0] * self.world_size
        for e in self.entries:
            if e.group is not None:
                for rank in e.group.ranks:
                    seconds[rank] += member_comm_seconds(min(e.shape), max(e.shape), e.group.size, options, ns_steps)
        return seconds

    @property
    def total_numel(self) -> int:
        """Elements of every dedicated weight (P_M of the design's formulas, TP-local under tensor parallelism)."""
        return sum(e.numel for e in self.entries)

    @property
    def imbalance(self) -> float:
        """max/mean NS FLOPs over ranks (1.0 is perfect balance)."""
        load = self.ns_flops_per_rank
        mean = sum(load) / len(load)
        return max(load) / mean if mean else 1.0

    def digest(self) -> str:
        """A hash of the whole plan: ``validate_across_ranks`` compares it between ranks."""
        payload = json.dumps(
            [self.replicate_size, self.shard_size, list(self.local_load)]
            + [
                [e.fqn, e.shape, e.unit, e.blocks, e.col_blocks, e.owner, e.tp_dim, e.tp_size, e.tp_homes]
                + ([list(e.group.ranks), list(e.group.bounds), e.group.long_dim] if e.group else [])
                for e in self.entries
            ]
            + [
                [x.fqn, x.rank, x.first, x.spec.shape, x.spec.col_blocks, x.spec.tp_dim, x.tp_homes]
                for x in self.local_tp_experts
            ]
        )
        return hashlib.sha256(payload.encode()).hexdigest()

    def local_tp_experts_of(self, rank: int) -> list[LocalTPExperts]:
        """The TP-split experts data-parallel rank ``rank`` keeps in place (none without tensor parallelism)."""
        return [x for x in self.local_tp_experts if x.rank == rank]

    @property
    def local_tp_numel(self) -> int:
        """TP-local elements of the TP-split experts kept in place, summed over every data-parallel rank
        (each replica's too): what the TP groups exchange for them in the step."""
        return sum(x.spec.numel // x.spec.shape[0] * len(x.tp_homes) for x in self.local_tp_experts)

    def describe(self) -> str:
        """The plan in a few lines: weights, elements, mesh, NS balance, and per rank its matrices and NS FLOPs."""
        load = self.ns_flops_per_rank
        lines = [
            f"OwnershipPlan: {len(self.entries)} dedicated weights, {self.total_numel:,} elements, "
            f"mesh replicate={self.replicate_size} x shard={self.shard_size}, "
            f"NS FLOPs max/mean={self.imbalance:.3f}"
        ]
        owned = [0] * self.world_size
        for e in self.entries:
            for rank in e.group.ranks if e.group else (e.owner,):
                owned[rank] += 1
        grouped = [e for e in self.entries if e.group is not None]
        if grouped:
            lines[0] += f", {len(grouped)} in owner groups"
        if self.groups is not None:
            lines.append(f"  {self.groups.describe()}")
        for rank in range(self.world_size):
            lines.append(f"  rank {rank}: {owned[rank]} matrices, {load[rank]:.3e} NS FLOPs")
        for e in grouped:
            side = "rows" if e.group.long_dim == 0 else "columns"
            lines.append(f"  group {e.fqn} {e.shape}: ranks {list(e.group.ranks)}, {side} {list(e.group.bounds)}")
        return "\n".join(lines)


def build_plan(
    specs: Sequence[MatrixSpec],
    *,
    replicate_size: int,
    shard_size: int,
    ns_steps: int = NS_STEPS,
    initial_load: Sequence[int] | None = None,
    local_tp_specs: Sequence[MatrixSpec] = (),
    groups: GroupOptions | None = None,
) -> OwnershipPlan:
    """Assign each weight to one rank, longest-processing-time first by NS FLOPs.

    ``initial_load`` is NS work each rank has already (MoE experts that stay on
    the rank that holds them), so dedicated weights even out the total. Ties go
    to the lowest rank and the specs are visited in a fixed order (cost, then
    position), so the result depends only on names and shapes.

    The least-loaded rank comes off a heap of ``(load, rank)``: its smallest tuple is the lowest
    load, then the lowest rank, the rank a scan of every rank picks, in O(log R) instead of O(R)
    per weight (46,848 experts on 8192 ranks: a scan took half a minute).

    ``local_tp_specs``: TP-split 3-D expert weights that stay where FSDP2 shards them on dim 0
    (ceil(E/N) whole experts per shard index, in every replica): each data-parallel rank's experts
    get NS homes in its TP group, balanced with the dedicated matrices that rank owns.

    ``groups`` (enabled): owner groups where they pay (``owner_groups.choose_sizes``), placed first on
    aligned slots (``place_groups``); the other weights then go as above, every load counted in
    FLOP-equivalents (a member's FLOPs plus its all-reduces' time). None, or disabled: one owner each.
    """
    costs = [s.ns_flops(ns_steps) for s in specs]
    load = list(initial_load) if initial_load is not None else [0] * (replicate_size * shard_size)
    if len(load) != replicate_size * shard_size:
        raise ValueError(f"initial_load has {len(load)} entries for {replicate_size * shard_size} ranks")
    groups = groups.stated() if groups is not None and groups.enabled else None
    owner_groups = _owner_groups(specs, costs, load, replicate_size, shard_size, ns_steps, groups) if groups else {}
    owners = [0] * len(specs)
    for i, group in owner_groups.items():
        owners[i] = group.ranks[0]
    for i, rank in _least_loaded_owners(costs, [i for i in range(len(specs)) if i not in owner_groups], load).items():
        owners[i] = rank
    # every matrix of the TP exchange: (data-parallel rank, unit, cost, key: where its home goes, tp size)
    matrices = []
    for i, s in enumerate(specs):
        if s.tp_replicated:  # one home for the whole weight: it alone gets the summed gradient and keeps momentum
            matrices.append((owners[i], s.unit, costs[i], ("dedicated", i, 0), s.tp_size))
        elif s.tensor_parallel:
            cost = costs[i] // s.matrices
            matrices += [(owners[i], s.unit, cost, ("dedicated", i, e), s.tp_size) for e in range(s.matrices)]
    local_chunks = []
    for j, s in enumerate(local_tp_specs):
        experts, per_rank = s.shape[0], -(-s.shape[0] // shard_size)  # FSDP2's dim-0 chunks (torch.chunk)
        for rank in range(replicate_size * shard_size):
            first = (rank % shard_size) * per_rank
            count = max(0, min(per_rank, experts - first))
            local_chunks.append((j, rank, first, count))
            matrices += [
                (rank, s.unit, s.ns_flops(ns_steps) // experts, ("local", len(local_chunks) - 1, e), s.tp_size)
                for e in range(count)
            ]
    homes = _tp_homes(matrices)
    entries = tuple(
        PlanEntry(
            fqn=s.fqn,
            shape=s.shape,
            unit=s.unit,
            blocks=s.blocks,
            col_blocks=s.col_blocks,
            tp_dim=s.tp_dim,
            tp_size=s.tp_size,
            groupable=s.groupable,
            owner=o,
            ns_flops=c,
            tp_homes=_entry_homes(s, i, homes),
            group=owner_groups.get(i),
        )
        for i, (s, o, c) in enumerate(zip(specs, owners, costs))
    )
    local = tuple(
        LocalTPExperts(
            fqn=local_tp_specs[j].fqn,
            rank=rank,
            first=first,
            spec=local_tp_specs[j],
            tp_homes=tuple(homes["local", k, e] for e in range(count)),
        )
        for k, (j, rank, first, count) in enumerate(local_chunks)
        if count
    )
    return OwnershipPlan(
        replicate_size=replicate_size,
        shard_size=shard_size,
        entries=entries,
        local_load=tuple(initial_load) if initial_load is not None else (),
        local_tp_experts=local,
        groups=groups,
    )


def _least_loaded_owners(costs: Sequence[int], indices: Sequence[int], load: list[int]) -> dict[int, int]:
    """{index: rank}: ``indices`` by cost (largest first, then position), each to the least-loaded rank
    (the lowest on a tie) off a heap of (load, rank); ``load`` grows by each cost."""
    owners = {}
    least_loaded = [(rank_load, rank) for rank, rank_load in enumerate(load)]
    heapq.heapify(least_loaded)
    for i in sorted(indices, key=lambda i: (-costs[i], i)):
        rank_load, rank = least_loaded[0]
        owners[i] = rank
        load[rank] += costs[i]
        heapq.heapreplace(least_loaded, (rank_load + costs[i], rank))
    return owners


def _owner_groups(
    specs: Sequence[MatrixSpec],
    costs: list[int],
    load: list[int],
    replicate_size: int,
    shard_size: int,
    ns_steps: int,
    options: GroupOptions,
) -> dict[int, OwnerGroup]:
    """The owner groups of the sizing (``owner_groups.sizings``) whose busiest rank is least loaded once
    placed, groups first and then the other weights (tried with no groups first, then the sizings with the
    fewest all-reduces; the first on a tie; one whose mean or largest member cannot beat the best so far
    is not placed; a sizing must shorten the one-owner plan's busiest rank by more than ``min_gain``);
    ``load`` (per rank, FLOP-equivalents) grows by the groups' members."""
    candidates = [Candidate(index=i, short=min(s.shape), long=max(s.shape)) for i, s in enumerate(specs) if s.may_group]
    shapes = {c.index: c for c in candidates}
    best = None
    world = replicate_size * shard_size
    if not candidates:
        return {}
    alone = list(load)
    _least_loaded_owners(costs, range(len(specs)), alone)
    if (1 - options.min_gain) * max(alone) <= sum(alone) / world:
        return {}  # (no plan's busiest rank is under the mean, and groups only add work: none can gain min_gain)
    options_tried = sizings(candidates, costs, shard_size=shard_size, options=options, steps=ns_steps)
    if not options_tried:
        return {}
    for sizes, loads in [({}, {})] + options_tried[::-1]:  # fewest all-reduces first
        total = (
            sum(load)
            + sum(c for i, c in enumerate(costs) if i not in sizes)
            + sum(k * loads[i] for i, k in sizes.items())
        )
        if best is not None and max(-(-total // world), max(loads.values(), default=0)) >= best[0]:
            continue  # (its busiest rank cannot beat the best so far: the mean, or its largest member)
        trial = list(load)
        placed = place_groups(sizes, loads, load=trial, replicate_size=replicate_size, shard_size=shard_size)
        after_groups = list(trial)
        _least_loaded_owners(costs, [i for i in range(len(specs)) if i not in sizes], trial)
        if best is None:  # (one owner each: a sizing must beat it by more than min_gain)
            best = ((1 - options.min_gain) * max(trial), sizes, placed, after_groups)
        elif max(trial) < best[0]:
            best = (max(trial), sizes, placed, after_groups)
    _, sizes, placed, after_groups = best  # (one owner each, unless a sizing is strictly better)
    load[:] = after_groups
    out = {}
    for i, ranks in placed.items():
        short, long, k = shapes[i].short, shapes[i].long, sizes[i]
        bounds = block_bounds(long, k)
        out[i] = OwnerGroup(
            ranks=ranks,
            bounds=bounds,
            long_dim=0 if specs[i].shape[0] > specs[i].shape[1] else 1,
            member_flops=tuple(
                group_ns_flops(short, long, hi - lo, k, ns_steps) for lo, hi in zip(bounds[:-1], bounds[1:])
            ),
        )
    return out


def _entry_homes(spec: MatrixSpec, index: int, homes: dict[tuple, int]) -> tuple[int, ...]:
    """Per matrix of a dedicated weight, its home (one home for all matrices of a replicated weight)."""
    if not spec.tensor_parallel:
        return ()
    return tuple(homes["dedicated", index, 0 if spec.tp_replicated else e] for e in range(spec.matrices))


def _tp_homes(matrices: list[tuple[int, int, int, tuple, int]]) -> dict[tuple, int]:
    """Per matrix of the TP exchange (``(data-parallel rank, unit, NS FLOPs, key, tp size)``; an expert
    counts as one matrix), the tp rank that runs its Newton–Schulz: within each data-parallel rank's
    matrices, layer by layer, longest first to the least-loaded tp rank (the load carried over the
    layers), so each step chunk's and the whole step's NS are balanced over the TP group."""
    homes: dict[tuple, int] = {}
    load: dict[int, list[int]] = {}
    for rank, _, cost, key, tp_size in sorted(matrices, key=lambda m: (m[1], -m[2], m[0], m[3])):
        ranks = load.setdefault(rank, [0] * tp_size)
        homes[key] = min(range(len(ranks)), key=lambda t: (ranks[t], t))
        ranks[homes[key]] += cost
    return homes


def validate_across_ranks(plan: OwnershipPlan, groups: Sequence[dist.ProcessGroup], device: torch.device) -> None:
    """Raise on every rank if any rank derived a different plan.

    One small all-gather per mesh dimension. Each gather also carries "a
    mismatch was seen so far", so after the last one every rank of a 1-D or
    2-D mesh reaches the same verdict: an error everywhere, never a hang.
    """
    digest = int(plan.digest()[:15], 16)
    seen_mismatch = False
    groupings: list[list[int]] = []
    for group in groups:
        mine = torch.tensor([digest, int(seen_mismatch)], dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine, group=group)
        digests = [int(t[0].item()) for t in gathered]
        seen_mismatch |= any(int(t[1].item()) for t in gathered) or len(set(digests)) > 1
        if len(set(digests)) > 1:
            by_plan: dict[int, list[int]] = {}
            for rank, d in zip(dist.get_process_group_ranks(group), digests):
                by_plan.setdefault(d, []).append(rank)
            groupings = sorted(by_plan.values())
    if seen_mismatch:
        raise RuntimeError(
            "DMuon ownership plans differ across ranks"
            + (f" (global ranks grouped by plan: {groupings})" if groupings else "")
            + ". Every rank must call dedicate_params with the same model structure, the same "
            f"parameters in the same order and the same mesh. This rank's plan:\n{plan.describe()}"
        )
