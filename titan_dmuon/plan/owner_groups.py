"""Owner groups in the plan: which weights get one, of how many ranks, and which ranks.

A weight whose Newton–Schulz alone would exceed the mean per-rank load by ``margin`` (or any weight
when the shard ranks outnumber the weights) may be owned by k ranks of its shard group, each keeping
one block along its long side (``math/group_newton_schulz.py``). k is chosen by a cost model: a member's time is its
FLOPs (``group_ns_flops``) at ``ns_tflops`` plus the group's all-reduces (``gram_all_reduces`` of the
packed fp32 Gram matrix, and the norm) at the bus bandwidth of the link the group spans. Groups sit on
aligned slots of consecutive shard indices (k divides N), inside a node when k divides the node size.

Deterministic from names, shapes, ranks and these options; plain numbers in and out (``plan.py``
builds the plan's records from them).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from titan_dmuon.math.group_newton_schulz import (
    GRAM_REDUCE_BYTES,
    has_blocks,
    widest_block,
    gram_all_reduces,
    group_ns_flops,
    packed_numel,
)
from titan_dmuon.math.ns_methods import NS_STEPS

# The H200's bf16 dense matmul, measured ~770-800 TFLOP/s at 8192^3 (shared/notes/gpu-readiness.md).
H200_BF16_TFLOPS = 790.0
# NCCL all-reduce bus bandwidth per rank inside an H200 node (NVLink 4, 450 GB/s per direction; NCCL's
# rings reach ~80 % of it), and each GPU's network link (one 400 Gb/s NIC per GPU: 50 GB/s, ~90 % of it).
INTRA_NODE_GBPS = 360.0
NIC_GBPS = 45.0


@dataclass(frozen=True, kw_only=True)
class GroupOptions:
    """How the plan chooses owner groups (``build_plan(..., groups=GroupOptions())``)."""

    enabled: bool = True
    """False: one owner per weight (today's plans, exactly)."""
    node_size: int = 8
    """Ranks per node (consecutive global ranks): groups of k dividing it stay on the node's links."""
    ns_tflops: float = H200_BF16_TFLOPS
    """Newton–Schulz throughput per rank, TFLOP/s."""
    intra_node_gbps: float = INTRA_NODE_GBPS
    """All-reduce bus bandwidth per rank inside a node, GB/s."""
    nic_gbps: float = NIC_GBPS
    """Network bandwidth per rank between nodes (its NIC), GB/s."""
    margin: float = 1.0
    """A weight is split when its one-owner NS time exceeds margin x the mean per-rank time."""
    max_size: int | None = None
    """Largest group (default: the shard group)."""

    def __post_init__(self) -> None:
        for key in ("node_size",):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key} = {value!r}: expected an integer >= 1 (ranks per node)")
        for key in ("ns_tflops", "intra_node_gbps", "nic_gbps"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{key} = {value!r}: expected a finite number > 0")
        if isinstance(self.margin, bool) or not isinstance(self.margin, (int, float)) or not self.margin >= 0:
            raise ValueError(f"margin = {self.margin!r}: expected a number >= 0")
        if self.max_size is not None and (not isinstance(self.max_size, int) or self.max_size < 1):
            raise ValueError(f"max_size = {self.max_size!r}: expected an integer >= 1, or None (the shard group)")

    def flops_per_second(self) -> float:
        """``ns_tflops`` in FLOP/s."""
        return self.ns_tflops * 1e12

    def all_reduce_seconds(self, nbytes: float, group_size: int) -> float:
        """A sum of ``nbytes`` over an aligned group of ``group_size`` ranks as ``grouped_update.ring_all_reduce``
        runs it, 2 (k - 1) / k of it per rank: inside a node, one ring on the node's links; over whole nodes,
        one ring per rank of a node, each crossing between nodes at a different rank (its own NIC), so the
        node's NICs carry the crossings together, at most as fast as the node's links."""
        k, n = group_size, self.node_size
        if k == 1:
            return 0.0
        if n % k == 0:
            rate = self.intra_node_gbps
        elif k % n == 0:
            rate = min(self.intra_node_gbps, n * self.nic_gbps)
        else:
            rate = self.nic_gbps
        return 2 * (k - 1) / k * nbytes / (1e9 * rate)

    def rings(self, group_size: int) -> int:
        """The rings ``ring_all_reduce`` runs a group's sum on: one per rank of a node over whole nodes."""
        return self.node_size if group_size > self.node_size and group_size % self.node_size == 0 else 1


@dataclass(frozen=True)
class Candidate:
    """A weight the plan may split: its matrix (short, long side) and how many matrices it holds."""

    index: int
    short: int
    long: int


def gram_elements(short: int, long: int, group_size: int, steps: int = NS_STEPS, ns_method: str = "torch") -> int:
    """Elements one group member contributes to its group's all-reduces per step for one matrix: the
    packed fp32 Gram matrix ``gram_all_reduces`` times, and the squared norm (1)."""
    if group_size == 1:
        return 0
    return gram_all_reduces(short, long, group_size, steps, ns_method=ns_method) * packed_numel(short) + 1


def member_comm_seconds(short: int, long: int, group_size: int, options: GroupOptions, steps: int = NS_STEPS) -> float:
    """One member's time in its group's sums (``GroupOptions.all_reduce_seconds``)."""
    return options.all_reduce_seconds(gram_elements(short, long, group_size, steps) * GRAM_REDUCE_BYTES, group_size)


def member_load(short: int, long: int, group_size: int, options: GroupOptions, steps: int = NS_STEPS) -> int:
    """The busiest member's time in FLOP-equivalents (its FLOPs, plus its all-reduces' time at
    ``ns_tflops``): the unit the plan balances when groups are on."""
    widest = widest_block(long, group_size)
    comm = member_comm_seconds(short, long, group_size, options, steps) * options.flops_per_second()
    return group_ns_flops(short, long, widest, group_size, steps) + int(comm)


def group_sizes(shard_size: int, long: int, options: GroupOptions) -> list[int]:
    """Sizes a group may have: k >= 2 dividing the shard group (aligned slots), inside a node (k divides
    the node size) or whole nodes (the node size divides k), at most ``max_size``, with k non-empty
    blocks of the long side (``has_blocks``)."""
    cap = min(shard_size, long, options.max_size or shard_size)
    node = options.node_size
    return [k for k in range(2, cap + 1)
            if shard_size % k == 0 and (node % k == 0 or k % node == 0) and has_blocks(long, k)]


def sizings(
    candidates: Sequence[Candidate], costs: Sequence[int], *, world_size: int, shard_size: int,
    base_load: int, options: GroupOptions, steps: int = NS_STEPS,
) -> list[tuple[dict[int, int], dict[int, int]]]:
    """The group sizes worth trying, each ({weight index: group size >= 2}, {weight index: its busiest
    member's load}); the plan keeps the one whose busiest rank is least loaded once placed.

    ``costs``: every weight's one-owner NS FLOPs (the plan's); ``base_load``: NS FLOPs the ranks have
    already (experts kept in place, other handles). A candidate is split when its one-owner time exceeds
    ``margin`` x the mean per-rank time (or the mean itself when the shard ranks outnumber the weights:
    ranks would idle). For each threshold T (every busiest-member load a candidate could have, from half
    the mean up), each
    split weight takes the smallest k whose busiest member fits in T (the least-loaded k where none
    does), if that beats its one owner: one sizing per distinct outcome, in increasing T."""
    mean = (sum(costs) + base_load) / world_size
    margin = min(options.margin, 1.0) if shard_size > len(costs) else options.margin
    split = [c for c in candidates if costs[c.index] > margin * mean]
    loads: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (short, long) -> [(k, busiest member's load)]
    for c in split:
        if (c.short, c.long) not in loads:
            loads[c.short, c.long] = [(k, member_load(c.short, c.long, k, options, steps))
                                      for k in group_sizes(shard_size, c.long, options)]
    # (a threshold below half the mean only adds members and all-reduces: the busiest rank is at least the mean)
    thresholds = sorted({load for options_k in loads.values() for _, load in options_k if load >= mean / 2})
    out: list[tuple[dict[int, int], dict[int, int]]] = []
    for threshold in thresholds:
        sizes, chosen = {}, {}
        for c in split:
            fits = [k for k, load in loads[c.short, c.long] if load <= threshold]
            k, load = min(loads[c.short, c.long], key=lambda kl: (kl[1], kl[0])) if not fits else \
                next(kl for kl in loads[c.short, c.long] if kl[0] == fits[0])
            if load < costs[c.index]:
                sizes[c.index], chosen[c.index] = k, load
        if sizes and all(sizes != seen for seen, _ in out):
            out.append((sizes, chosen))
    return out


def place_groups(
    sizes: dict[int, int], loads: dict[int, int], *, load: list[int], replicate_size: int, shard_size: int,
) -> dict[int, tuple[int, ...]]:
    """{weight index: its members' global ranks} for ``sizes``: largest member load first (then index),
    each on the aligned slot of k consecutive shard indices (in one replicate row) whose busiest rank
    is least loaded (the lowest slot on a tie); ``load`` (per global rank) grows by each member's
    ``loads[index]``. One lazy min-heap of slots per size: loads only grow, so a popped slot whose
    stored key is stale is pushed back with its current one."""
    heaps: dict[int, list[tuple[int, int]]] = {}
    placed: dict[int, tuple[int, ...]] = {}
    for index in sorted(sizes, key=lambda i: (-loads[i], i)):
        k = sizes[index]
        if k not in heaps:
            starts = [r * shard_size + s for r in range(replicate_size) for s in range(0, shard_size, k)]
            heaps[k] = [(max(load[start : start + k]), start) for start in starts]
            heapq.heapify(heaps[k])
        heap = heaps[k]
        while True:
            key, start = heap[0]
            current = max(load[start : start + k])
            if current == key:
                break
            heapq.heapreplace(heap, (current, start))
        ranks = tuple(range(start, start + k))
        for rank in ranks:
            load[rank] += loads[index]
        heapq.heapreplace(heap, (max(load[start : start + k]), start))
        placed[index] = ranks
    return placed

