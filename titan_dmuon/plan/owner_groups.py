"""Owner groups in the plan: which weights get one, of how many ranks, and which ranks.

A weight may be owned by k ranks of its shard group, each keeping one block along its long side
(``math/group_newton_schulz.py``). k is chosen by a cost model: a member's time is its FLOPs (``group_ns_flops``) at the
device's Newton–Schulz throughput plus its group's all-reduces (``gram_all_reduces`` of the packed fp32
Gram matrix, the norm riding with the first), each priced alpha + bytes / beta: a latency and the bus
bandwidth of the links the group spans (``GroupOptions.all_reduce_seconds``). Groups sit on aligned slots
of consecutive shard indices (k divides N), inside a node when k divides the node size.

The search (``sizings``): for each threshold T among the loads a member could have, every groupable
weight whose one-owner load exceeds ``margin`` x T takes the smallest k whose busiest member fits in T;
each distinct outcome is placed and the one whose busiest rank is least loaded kept (one owner each
unless a sizing is strictly better). A weight below the mean is split too where that balances the
ranks (8 ranks, one 65536 x 64 and one 8192 x 64 matrix: both over all 8). ``tests/test_owner_groups.py``
holds its result within BEST_PLAN_BOUND of an exhaustive search over every weight's k on small jobs.

The figures (``GroupOptions``): given, or left None and measured on the job's own device when DMuon is
built (``runtime/device_profile.py``, agreed on every rank); where a plan is made without a device
(``sizing``, ``benchmarks/plan_scale.py``, ``build_plan`` called directly) a None is an H200's stated
figure (``H200``). Deterministic from names, shapes, ranks and these figures; plain numbers in and out
(``plan.py`` builds the plan's records from them).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from titan_dmuon.math.group_newton_schulz import (
    GRAM_REDUCE_BYTES,
    gram_all_reduces,
    group_ns_flops,
    has_blocks,
    packed_numel,
    widest_block,
)
from titan_dmuon.math.ns_methods import NS_STEPS

# An H200 node's figures, stated (not measured here), the default where a plan is made without a device:
# bf16 dense matmul ~770-800 TFLOP/s at 8192^3 (shared/notes/gpu-readiness.md); NCCL all-reduce bus
# bandwidth inside a node (NVLink 4, 450 GB/s per direction, NCCL reaching ~80 %) and across nodes (one
# 400 Gb/s NIC per GPU: 50 GB/s, ~90 %); NCCL's small-message all-reduce latency on NVLink and over the network.
H200_BF16_TFLOPS = 790.0
INTRA_NODE_GBPS = 360.0
NIC_GBPS = 45.0
INTRA_NODE_LATENCY_US = 15.0
NIC_LATENCY_US = 30.0
# The plan's figures that may be measured (None: measure at build time, else the H200's), with their defaults
MEASURABLE = {
    "ns_tflops": H200_BF16_TFLOPS,
    "intra_node_gbps": INTRA_NODE_GBPS,
    "nic_gbps": NIC_GBPS,
    "latency_us": INTRA_NODE_LATENCY_US,
    "nic_latency_us": NIC_LATENCY_US,
}


@dataclass(frozen=True, kw_only=True)
class GroupOptions:
    """How the plan chooses owner groups (``build_plan(..., groups=GroupOptions())``). A figure left None
    is measured on the job's device when DMuon is built (``dedicate_params``), or an H200's where a plan is
    made without a device (``H200``)."""

    enabled: bool = True
    """False: one owner per weight (today's plans, exactly)."""
    node_size: int = 8
    """Ranks per node (consecutive global ranks): groups of k dividing it stay on the node's links."""
    ns_tflops: float | None = None
    """Newton–Schulz throughput per rank, TFLOP/s."""
    intra_node_gbps: float | None = None
    """All-reduce bus bandwidth per rank inside a node, GB/s."""
    nic_gbps: float | None = None
    """All-reduce bus bandwidth per rank between nodes (its NIC), GB/s."""
    latency_us: float | None = None
    """Latency of one all-reduce inside a node, microseconds."""
    nic_latency_us: float | None = None
    """Latency of one all-reduce across nodes, microseconds."""
    margin: float = 1.0
    """A weight is split only when its one-owner NS time exceeds margin x the threshold tried."""
    max_size: int | None = None
    """Largest group (default: the shard group)."""
    min_gain: float = 0.05
    """Groups are kept only when they shorten the one-owner plan's busiest rank by more than this fraction:
    a nearly balanced job keeps one owner per weight (and its plan does not turn on a measured figure's
    last digit)."""
    source: str = ""
    """Where the figures came from ("measured on ..." once measured); printed with the plan."""

    def __post_init__(self) -> None:
        for key in ("node_size",):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key} = {value!r}: expected an integer >= 1 (ranks per node)")
        for key in ("ns_tflops", "intra_node_gbps", "nic_gbps"):
            value = getattr(self, key)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf
            ):
                raise ValueError(f"{key} = {value!r}: expected a finite number > 0, or None (measured)")
        for key in ("latency_us", "nic_latency_us"):
            value = getattr(self, key)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf
            ):
                raise ValueError(f"{key} = {value!r}: expected a finite number >= 0, or None (measured)")
        if isinstance(self.margin, bool) or not isinstance(self.margin, (int, float)) or not self.margin >= 0:
            raise ValueError(f"margin = {self.margin!r}: expected a number >= 0")
        if isinstance(self.min_gain, bool) or not isinstance(self.min_gain, (int, float)) or not 0 <= self.min_gain < 1:
            raise ValueError(f"min_gain = {self.min_gain!r}: expected a number in [0, 1)")
        if self.max_size is not None and (not isinstance(self.max_size, int) or self.max_size < 1):
            raise ValueError(f"max_size = {self.max_size!r}: expected an integer >= 1, or None (the shard group)")

    def unmeasured(self) -> list[str]:
        """The figures left None (to measure)."""
        return [key for key in MEASURABLE if getattr(self, key) is None]

    def stated(self) -> GroupOptions:
        """These options with every figure left None set to the H200's (``MEASURABLE``)."""
        missing = {key: MEASURABLE[key] for key in self.unmeasured()}
        if not missing:
            return self
        return dataclasses.replace(self, **missing, source=self.source or "an H200's stated figures")

    def describe(self) -> str:
        """The figures the plan was priced with, on one line."""
        o = self.stated()
        return (
            f"owner groups priced at {o.ns_tflops:.4g} TFLOP/s Newton-Schulz; all-reduce {o.latency_us:.4g} us + "
            f"bytes / {o.intra_node_gbps:.4g} GB/s in a node of {o.node_size}, {o.nic_latency_us:.4g} us + "
            f"bytes / {o.nic_gbps:.4g} GB/s across nodes ({o.source or 'given'})"
        )

    def flops_per_second(self) -> float:
        """``ns_tflops`` in FLOP/s."""
        return self.stated().ns_tflops * 1e12

    def all_reduce_seconds(self, nbytes: float, group_size: int, count: int = 1) -> float:
        """``count`` all-reduces of ``nbytes`` in all over an aligned group of ``group_size`` ranks: each
        alpha (its latency), and 2 (k - 1) / k of the bytes per rank at beta, the bus bandwidth: inside a
        node its links; over whole nodes the node's NICs together, at most as fast as the node's links;
        otherwise one NIC."""
        o, k, n = self.stated(), group_size, self.node_size
        if k == 1:
            return 0.0
        if n % k == 0:
            rate, latency = o.intra_node_gbps, o.latency_us
        elif k % n == 0:
            rate, latency = min(o.intra_node_gbps, n * o.nic_gbps), o.nic_latency_us
        else:
            rate, latency = o.nic_gbps, o.nic_latency_us
        return count * latency * 1e-6 + 2 * (k - 1) / k * nbytes / (1e9 * rate)


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
    """One member's time in its group's sums (``GroupOptions.all_reduce_seconds``: each all-reduce's
    latency, and the bytes of all of them at the bandwidth)."""
    return options.all_reduce_seconds(
        gram_elements(short, long, group_size, steps) * GRAM_REDUCE_BYTES,
        group_size,
        gram_all_reduces(short, long, group_size, steps),
    )


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
    return [
        k for k in range(2, cap + 1) if shard_size % k == 0 and (node % k == 0 or k % node == 0) and has_blocks(long, k)
    ]


def sizings(
    candidates: Sequence[Candidate],
    costs: Sequence[int],
    *,
    shard_size: int,
    options: GroupOptions,
    steps: int = NS_STEPS,
) -> list[tuple[dict[int, int], dict[int, int]]]:
    """The group sizes worth trying, each ({weight index: group size >= 2}, {weight index: its busiest
    member's load}); the plan keeps the one whose busiest rank is least loaded once placed.

    ``costs``: every weight's one-owner NS FLOPs (the plan's). For each threshold T (every busiest-member load a
    candidate could have, below the largest cost), every candidate whose one-owner load exceeds
    ``margin`` x T takes the smallest k whose busiest member fits in T (the least-loaded k where none
    does), if that beats its one owner: one sizing per distinct outcome, in increasing T. Weights under
    the mean are split too, where a threshold below the mean asks for it: with few large weights on many
    ranks, splitting only the largest leaves the others' owners the busiest."""
    loads: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (short, long) -> [(k, busiest member's load)]
    for c in candidates:
        if (c.short, c.long) not in loads:
            loads[c.short, c.long] = [
                (k, member_load(c.short, c.long, k, options, steps)) for k in group_sizes(shard_size, c.long, options)
            ]
    largest = max((costs[c.index] for c in candidates), default=0)
    # (a threshold at or above every cost splits nothing; there are at most distinct shapes x sizes)
    thresholds = sorted({load for options_k in loads.values() for _, load in options_k if load < largest})
    out: list[tuple[dict[int, int], dict[int, int]]] = []
    for threshold in thresholds:
        sizes, chosen = {}, {}
        for c in candidates:
            by_k = loads[c.short, c.long]
            if not by_k or costs[c.index] <= options.margin * threshold:
                continue
            fits = [kl for kl in by_k if kl[1] <= threshold]
            k, load = fits[0] if fits else min(by_k, key=lambda kl: (kl[1], kl[0]))
            if load < costs[c.index]:
                sizes[c.index], chosen[c.index] = k, load
        if sizes and all(sizes != seen for seen, _ in out):
            out.append((sizes, chosen))
    return out


def place_groups(
    sizes: dict[int, int],
    loads: dict[int, int],
    *,
    load: list[int],
    replicate_size: int,
    shard_size: int,
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
