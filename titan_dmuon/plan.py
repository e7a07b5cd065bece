"""Who owns what: a deterministic ownership plan, identical on every rank.

The plan is pure data computed from parameter names and shapes only, so every
rank derives the same plan without communicating; `validate_across_ranks`
then proves it with one small all-gather of a digest.

Ranks are positions in a (replicate R) x (shard N) mesh, numbered
``r * N + s`` (a 1-D mesh is R = 1). The global owner (r, s) of a matrix runs
Newton–Schulz for it; in every replicate group the rank at shard index s keeps
the full weight ("shard owner") and broadcasts it in forward.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan_dmuon.muon_math import NS_STEPS, Block, block_rows, ns_flops


def full_shape(shape: Sequence[int], tp_dim: int | None, tp_size: int) -> tuple[int, ...]:
    """The whole matrix of a tensor-parallel shard of ``shape`` split along ``tp_dim`` over ``tp_size``
    ranks (``shape`` itself when ``tp_dim`` is None)."""
    return tuple(n * tp_size if d == tp_dim else n for d, n in enumerate(shape))


@dataclass(frozen=True, kw_only=True)
class MatrixSpec:
    """One dedicated weight as every rank sees it: name, shape, layer unit, NS row blocks.

    A weight is a ``(rows, cols)`` matrix or a stack ``(E, rows, cols)`` of E
    independent matrices (MoE experts); ``blocks`` are the row blocks of each matrix.
    """

    fqn: str
    shape: tuple[int, ...]
    unit: int
    blocks: tuple[Block, ...]
    tp_dim: int | None = None
    """Tensor parallelism: the dim of the full matrix that the tp ranks split (``shape`` is then
    this rank's TP-local shard, what DMuon broadcasts and reduces; ``blocks`` are rows of the full
    matrix, which Newton–Schulz orthogonalises)."""
    tp_size: int = 1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def full_shape(self) -> tuple[int, ...]:
        """The whole matrix (or stack): ``shape`` with the tensor-parallel dim times ``tp_size``."""
        return full_shape(self.shape, self.tp_dim, self.tp_size)

    @property
    def matrices(self) -> int:
        """Matrices in the stack (1 for a 2-D weight)."""
        return self.shape[0] if len(self.shape) == 3 else 1

    def ns_flops(self, ns_steps: int = NS_STEPS) -> int:
        return self.matrices * sum(ns_flops(block_rows(b), self.full_shape[-1], ns_steps) for b in self.blocks)


@dataclass(frozen=True, kw_only=True)
class PlanEntry(MatrixSpec):
    """A matrix with its owner (global rank r * N + s) and its NS cost.

    Under tensor parallelism the owner is a data-parallel coordinate: the T ranks (owner, tp =
    0..T-1) hold the T shards, and ``tp_home`` is the tp rank that assembles the matrix and runs
    its Newton–Schulz."""

    owner: int
    ns_flops: int
    tp_home: int = 0


@dataclass(frozen=True, kw_only=True)
class OwnershipPlan:
    replicate_size: int
    shard_size: int
    entries: tuple[PlanEntry, ...]
    local_load: tuple[int, ...] = ()  # per rank: NS FLOPs of experts it updates in place (not dedicated)

    @property
    def world_size(self) -> int:
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
            load[e.owner] += e.ns_flops
        return load

    @property
    def numel_per_shard_rank(self) -> list[int]:
        """Elements of full weights each shard index keeps between steps."""
        held = [0] * self.shard_size
        for e in self.entries:
            held[self.shard_owner(e)] += e.numel
        return held

    @property
    def total_numel(self) -> int:
        return sum(e.numel for e in self.entries)

    @property
    def imbalance(self) -> float:
        """max/mean NS FLOPs over ranks (1.0 is perfect balance)."""
        load = self.ns_flops_per_rank
        mean = sum(load) / len(load)
        return max(load) / mean if mean else 1.0

    def digest(self) -> str:
        payload = json.dumps(
            [self.replicate_size, self.shard_size, list(self.local_load)]
            + [[e.fqn, e.shape, e.unit, e.blocks, e.owner, e.tp_dim, e.tp_size, e.tp_home] for e in self.entries]
        )
        return hashlib.sha256(payload.encode()).hexdigest()

    def describe(self) -> str:
        load = self.ns_flops_per_rank
        lines = [
            f"OwnershipPlan: {len(self.entries)} dedicated weights, {self.total_numel:,} elements, "
            f"mesh replicate={self.replicate_size} x shard={self.shard_size}, "
            f"NS FLOPs max/mean={self.imbalance:.3f}"
        ]
        owned = [0] * self.world_size
        for e in self.entries:
            owned[e.owner] += 1
        for rank in range(self.world_size):
            lines.append(f"  rank {rank}: {owned[rank]} matrices, {load[rank]:.3e} NS FLOPs")
        return "\n".join(lines)


def build_plan(
    specs: Sequence[MatrixSpec],
    *,
    replicate_size: int,
    shard_size: int,
    ns_steps: int = NS_STEPS,
    initial_load: Sequence[int] | None = None,
) -> OwnershipPlan:
    """Assign each weight to one rank, longest-processing-time first by NS FLOPs.

    ``initial_load`` is NS work each rank has already (MoE experts that stay on
    the rank that holds them), so dedicated weights even out the total. Ties go
    to the lowest rank and the specs are visited in a fixed order (cost, then
    position), so the result depends only on names and shapes.

    The least-loaded rank comes off a heap of ``(load, rank)``: its smallest tuple is the lowest
    load, then the lowest rank, the rank a scan of every rank picks, in O(log R) instead of O(R)
    per weight (46,848 experts on 8192 ranks: a scan took half a minute).
    """
    costs = [s.ns_flops(ns_steps) for s in specs]
    load = list(initial_load) if initial_load is not None else [0] * (replicate_size * shard_size)
    if len(load) != replicate_size * shard_size:
        raise ValueError(f"initial_load has {len(load)} entries for {replicate_size * shard_size} ranks")
    owners = [0] * len(specs)
    least_loaded = [(rank_load, rank) for rank, rank_load in enumerate(load)]
    heapq.heapify(least_loaded)
    for i in sorted(range(len(specs)), key=lambda i: (-costs[i], i)):
        rank_load, rank = least_loaded[0]
        owners[i] = rank
        heapq.heapreplace(least_loaded, (rank_load + costs[i], rank))
    homes = _tp_homes(specs, owners, costs)
    entries = tuple(
        PlanEntry(fqn=s.fqn, shape=s.shape, unit=s.unit, blocks=s.blocks, tp_dim=s.tp_dim, tp_size=s.tp_size,
                  owner=o, ns_flops=c, tp_home=h)
        for s, o, c, h in zip(specs, owners, costs, homes)
    )
    return OwnershipPlan(
        replicate_size=replicate_size, shard_size=shard_size, entries=entries,
        local_load=tuple(initial_load) if initial_load is not None else (),
    )


def _tp_homes(specs: Sequence[MatrixSpec], owners: list[int], costs: list[int]) -> list[int]:
    """Per tensor-parallel matrix, the tp rank that runs its Newton–Schulz: within each data-parallel
    owner's matrices, layer by layer, longest first to the least-loaded tp rank (the load carried over
    the layers), so each step chunk's and the whole step's NS are balanced over the TP group."""
    homes = [0] * len(specs)
    load: dict[int, list[int]] = {}
    for i in sorted(range(len(specs)), key=lambda i: (specs[i].unit, -costs[i], i)):
        if specs[i].tp_dim is None:
            continue
        ranks = load.setdefault(owners[i], [0] * specs[i].tp_size)
        homes[i] = min(range(len(ranks)), key=lambda t: (ranks[t], t))
        ranks[homes[i]] += costs[i]
    return homes


def validate_across_ranks(
    plan: OwnershipPlan, groups: Sequence[dist.ProcessGroup], device: torch.device
) -> None:
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
