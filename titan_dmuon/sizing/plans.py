"""A stage's ownership plans as the runtime would make them: ``build_plan`` on the stage's specs with the
experts kept in place as initial load, one owner per weight and with owner groups (``GroupOptions``: the
runtime's default, priced at an H200's stated figures where nothing is measured), and each rank's
Newton–Schulz from a plan: FLOPs, time (with its groups' all-reduces), the largest job one rank runs whole.
The planner is ``titan_dmuon.plan``'s; nothing here decides an owner."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from titan_dmuon.plan.owner_groups import GroupOptions
from titan_dmuon.plan.ownership import OwnershipPlan, build_plan
from titan_dmuon.sizing.stage_weights import StageWeights, chunk_rows, dedication_mode, matrix_spec, one_expert


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """A plan of a stage, with the Newton–Schulz work each rank has outside it (experts kept in place)."""

    plan: OwnershipPlan
    local: dict[tuple[int, int], int]  # NS FLOPs of experts kept in place, per (data-parallel rank, TP rank)
    tp: int

    @property
    def grouped(self) -> bool:
        return any(e.group is not None for e in self.plan.entries)

    def ns_per_rank(self) -> list[int]:
        """Newton–Schulz FLOPs of each (data-parallel rank, TP rank): a weight on its owner, each member of
        an owner group its block's share, under TP each matrix on its home, experts where they are kept."""
        load = dict(self.local)
        for e in self.plan.entries:
            if e.group is not None:
                for rank, flops in zip(e.group.ranks, e.group.member_flops):
                    load[(rank, 0)] = load.get((rank, 0), 0) + flops
            elif not e.tp_homes:
                load[(e.owner, 0)] = load.get((e.owner, 0), 0) + e.ns_flops
            else:
                per_matrix = e.ns_flops // len(e.tp_homes) if not e.tp_replicated else e.ns_flops
                for home in e.tp_homes[:1] if e.tp_replicated else e.tp_homes:
                    load[(e.owner, home)] = load.get((e.owner, home), 0) + per_matrix
        for x in self.plan.local_tp_experts:
            per_expert = x.spec.ns_flops() // x.spec.shape[0]
            for home in x.tp_homes:
                load[(x.rank, home)] = load.get((x.rank, home), 0) + per_expert
        return [load.get((g, t), 0) for g in range(self.plan.world_size) for t in range(self.tp)]

    def ns_seconds(self, options: GroupOptions) -> list[float]:
        """Each (data-parallel rank, TP rank)'s Newton–Schulz time per step: its FLOPs at ``ns_tflops`` and
        its owner groups' all-reduces (``OwnershipPlan.group_seconds_per_rank``: the plan's own pricing,
        which ``benchmarks/plan_scale.py`` prints)."""
        rate = options.flops_per_second()
        comm = self.plan.group_seconds_per_rank(options)
        flops = self.ns_per_rank()
        return [flops[i] / rate + (comm[i // self.tp] if i % self.tp == 0 else 0.0) for i in range(len(flops))]

    def largest_whole(self, stage: StageWeights) -> int:
        """The largest Newton–Schulz job one rank runs whole (a matrix, under TP a home's share, an expert):
        no plan that keeps it on one rank makes the step's Newton–Schulz shorter."""
        return max(
            [
                e.ns_flops // (len(e.tp_homes) if e.tensor_parallel and not e.tp_replicated else 1)
                for e in self.plan.entries
                if e.group is None
            ]
            + [one_expert(w) for w in stage.local],
            default=0,
        )


def plan_stage(stage: StageWeights, groups: GroupOptions | None, keep_whole: Sequence[str] = ()) -> StagePlan:
    """``build_plan``'s plan of the dedicated weights, balanced against the experts each rank updates in
    place (as ``dedicate_params`` counts them); ``groups`` as ``dedicate_params``'s ``owner_groups``
    (None: one owner per weight)."""
    layout = stage.layout
    mesh = dedication_mode(layout, reshard_after_forward=True).mesh
    ranks, dp_shard = mesh.world_size, mesh.shard_size
    units = stage.units()
    specs = [matrix_spec(w, layout, units.get(w.layer, len(units)), keep_whole) for w in stage.dedicated]
    ns_local: dict[tuple[int, int], int] = {}
    local_tp_specs = []
    for w in stage.local:
        if layout.ep > 1:  # whole experts on each rank of the expert region (shard x tensor ranks)
            counts = chunk_rows(w.experts, layout.shard * layout.tp)
            for g in range(ranks):
                for t in range(layout.tp):
                    ns_local[g, t] = ns_local.get((g, t), 0) + one_expert(w) * counts[(g % dp_shard) * layout.tp + t]
        elif layout.tp > 1:  # TP-split experts kept in place: NS homes in each rank's TP group (the plan's)
            local_tp_specs.append(matrix_spec(w, layout, units.get(w.layer, len(units))))
        else:  # FSDP2's dim-0 shards: ceil(E/N) whole experts per shard index, in every replica
            counts = chunk_rows(w.experts, dp_shard)
            for g in range(ranks):
                ns_local[g, 0] = ns_local.get((g, 0), 0) + one_expert(w) * counts[g % dp_shard]
    initial = [sum(ns_local.get((g, t), 0) for t in range(layout.tp)) for g in range(ranks)]
    plan = build_plan(
        specs,
        replicate_size=mesh.replicate_size,
        shard_size=dp_shard,
        initial_load=initial if ns_local else None,
        local_tp_specs=local_tp_specs,
        groups=groups,
    )
    return StagePlan(plan=plan, local=ns_local, tp=layout.tp)


def named_like(fqn: str) -> str:
    """A weight's name with its layer index as ``*``: the weights of every layer read as one line."""
    return re.sub(r"(^|\.)layers\.\d+\.", r"\1layers.*.", fqn)


def groups_formed(plan: OwnershipPlan) -> list[tuple[str, int, int]]:
    """(weights' name with ``*`` for the layer, group size k, how many weights) of the plan's owner groups."""
    counts: dict[tuple[str, int], int] = {}
    for e in plan.entries:
        if e.group is not None:
            key = (named_like(e.fqn), e.group.size)
            counts[key] = counts.get(key, 0) + 1
    return [(name, k, n) for (name, k), n in counts.items()]


def why_whole(entry) -> str:
    """Words for why ``MatrixSpec.may_group`` (the planner's rule) refuses a weight a group."""
    if entry.tensor_parallel:
        return "tensor parallelism: its Newton–Schulz home is one TP rank"
    if len(entry.shape) != 2:
        return "a stack of experts"
    if len(entry.blocks) > 1 or entry.col_blocks:
        return "several Newton–Schulz blocks (fused q/k/v)"
    return "kept whole: a rule reads the whole matrix (QK-clip)"


def kept_whole(plan: OwnershipPlan) -> list[tuple[str, str, int]]:
    """(weights' name with ``*`` for the layer, why, how many) of the weights no group may take."""
    counts: dict[tuple[str, str], int] = {}
    for e in plan.entries:
        if not e.may_group:
            reason = why_whole(e)
            key = (named_like(e.fqn), reason)
            counts[key] = counts.get(key, 0) + 1
    return [(name, why, n) for (name, why), n in counts.items()]
