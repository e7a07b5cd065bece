"""The ownership plan as ``build_plan`` built it before its heap, written independently of
``titan_dmuon.plan.ownership``: for every weight, longest first, a scan of every rank for the least-loaded
one (O(M x R)). ``tests/unit/test_plan.py`` compares the plans with it; ``benchmarks/plan_scale.py``
times it as the "before" column."""

from __future__ import annotations

from collections.abc import Sequence

from titan_dmuon.math.ns_methods import NS_STEPS
from titan_dmuon.plan.ownership import OwnershipPlan
from titan_dmuon.plan.specs import MatrixSpec, PlanEntry


def reference_owners(costs: Sequence[int], world_size: int, initial_load: Sequence[int] | None = None) -> list[int]:
    """Longest processing time first: weights by cost, largest first (equal costs in list order), each
    to the rank with the least load so far, the lowest such rank on a tie."""
    load = list(initial_load) if initial_load is not None else [0] * world_size
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    owners = [-1] * len(costs)
    for i in order:
        best = 0
        for rank in range(1, world_size):
            if load[rank] < load[best]:
                best = rank
        owners[i] = best
        load[best] += costs[i]
    return owners


def reference_tp_homes(specs: Sequence[MatrixSpec], owners: Sequence[int], costs: Sequence[int]) -> list[int]:
    """Per tensor-parallel weight, its NS home among its owner's tp ranks: layer by layer, largest first
    (equal costs in list order), to the tp rank with the least load so far, the lowest on a tie."""
    homes = [0] * len(specs)
    tp_load: dict[int, list[int]] = {}
    for i in sorted(range(len(specs)), key=lambda i: (specs[i].unit, -costs[i], i)):
        if specs[i].tp_dim is None:
            continue
        ranks = tp_load.setdefault(owners[i], [0] * specs[i].tp_size)
        best = 0
        for t in range(1, len(ranks)):
            if ranks[t] < ranks[best]:
                best = t
        homes[i] = best
        ranks[best] += costs[i]
    return homes


def reference_build_plan(
    specs: Sequence[MatrixSpec],
    *,
    replicate_size: int,
    shard_size: int,
    ns_steps: int = NS_STEPS,
    initial_load: Sequence[int] | None = None,
) -> OwnershipPlan:
    """The whole plan from ``reference_owners`` and ``reference_tp_homes``."""
    costs = [s.ns_flops(ns_steps) for s in specs]
    owners = reference_owners(costs, replicate_size * shard_size, initial_load)
    homes = reference_tp_homes(specs, owners, costs)
    entries = tuple(
        PlanEntry(
            fqn=s.fqn,
            shape=s.shape,
            unit=s.unit,
            blocks=s.blocks,
            col_blocks=s.col_blocks,
            tp_dim=s.tp_dim,
            tp_size=s.tp_size,
            owner=owner,
            ns_flops=cost,
            tp_homes=(home,) if s.tp_dim is not None else (),
        )
        for s, owner, cost, home in zip(specs, owners, costs, homes)
    )
    return OwnershipPlan(
        replicate_size=replicate_size,
        shard_size=shard_size,
        entries=entries,
        local_load=tuple(initial_load) if initial_load is not None else (),
    )
