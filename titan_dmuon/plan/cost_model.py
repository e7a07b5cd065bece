"""The design's communication per step, in the units of the design (elements per rank).

A broadcast, reduce, all-gather (output S), reduce-scatter (input S) or all-to-all
(S per rank) over n ranks moves (n-1)/n * S elements per rank, an all-reduce 2(n-1)/n * S.
``CommLedger`` counts what was issued; these are the figures it is compared with.
"""

from __future__ import annotations

from fractions import Fraction

from titan_dmuon.math.ns_methods import NS_STEPS
from titan_dmuon.plan.owner_groups import gram_elements

BASELINES = ("naive_fsdp_z2", "naive_fsdp_z3", "ddp_muon", "alltoall_z2", "alltoall_z3")


def dedication_shard_size(*, data_parallel_shard: int, context_parallel: int = 1) -> int:
    """N of every figure here: the ranks whose gradients of a dedicated weight are summed on its owner
    before the replicate stage. Context-parallel ranks hold the same weights and see other parts of
    each sequence, so they sum with the data-parallel shards: N = dp_shard x cp (TorchTitan's FSDP mesh
    under CP), and Newton–Schulz still runs once per matrix in the job. TorchTitan's own CP collectives
    (its attention's all-gather of k and v over the cp ranks, their gradients reduce-scattered back)
    come on top with any optimizer; DMuon adds none (QK-clip's capture gathers k once more)."""
    return data_parallel_shard * context_parallel


def dmuon_elements_per_rank(
    mode,
    *,
    numel: int,
    kept_unit_numel: int = 0,
    deferred: bool = False,
    local_tp_numel: int = 0,
) -> Fraction:
    """DMuon's own elements per rank per step (per micro-batch with gradient sync on) for the
    Muon targets, under ``mode`` (a ``DedicationMode``), on a shard group of N ranks.

    Z2 broadcasts once and reduces once: 2(N-1)/N * numel; Z3 re-broadcasts for backward:
    3(N-1)/N * numel, less the unit kept from forward to backward (the last one forward runs,
    ``DedicatedParams.kept_unit_numel``). ``deferred``: gradient sync off over the micro-batches
    and one reduce at the end (pipelining): the weights stay gathered, so one broadcast and one
    reduce per step whatever the micro-batches, Z2 or Z3. HSDP (R replicas) adds a
    replicate-group reduce and a post-step broadcast; each involves only the R owners of a
    matrix, so averaged over all R*N ranks each costs (R-1)/R * numel / N per rank. Tensor
    parallelism (``mode.tp``; ``numel`` TP-local) adds the step's all-to-alls on the TP group
    (``tensor_parallel_elements_per_rank``; ``local_tp_numel``: experts kept in place that TP
    splits, ``OwnershipPlan.local_tp_numel``); TorchTitan's own TP collectives are not DMuon's."""
    n, r = mode.mesh.shard_size, mode.mesh.replicate_size
    if kept_unit_numel and (deferred or not mode.reshard_after_forward):
        raise ValueError("kept_unit_numel applies to Z3 (reshard_after_forward=True) with gradient sync on only")
    passes = 3 if mode.reshard_after_forward and not deferred else 2
    total = passes * Fraction(n - 1, n) * numel - Fraction(n - 1, n) * kept_unit_numel
    if r > 1:
        total += 2 * Fraction(r - 1, r) * Fraction(numel, n)
    if mode.tp is not None:
        total += tensor_parallel_elements_per_rank(
            mode.tp.size, numel=numel, local_expert_numel=local_tp_numel, data_parallel_ranks=n * r
        )
    return total


def tensor_parallel_elements_per_rank(
    tp_size: int, *, numel: int, data_parallel_ranks: int, local_expert_numel: int = 0
) -> Fraction:
    """The Muon step's TP-group traffic (tensor parallelism over T ranks), per rank averaged over all
    R*N*T ranks. ``numel``: the TP-local elements of the dedicated Muon targets (a stack of experts
    counts all its experts). Each matrix (full size T * n) goes once in the job from its T shards to
    its NS home and back: (T-1) * n elements each way, so 2(T-1)/T^2 x the full elements each rank
    owns, on average 2(T-1)/T * numel / (R*N). A weight TP replicates (n elements held whole by each
    tp rank, each with a partial gradient) costs the same: its gradient is reduced to its home at
    the end of backward ((T-1) * n) and the orthogonalised matrix comes back ((T-1) * n). Experts
    FSDP2 keeps in place, split by TP (``local_expert_numel``: TP-local elements summed over every
    data-parallel rank that holds them, each replica's too), go to their homes and back in the TP
    group of each data-parallel rank: 2(T-1)/T * local_expert_numel / (R*N)."""
    t = tp_size
    return 2 * Fraction(t - 1, t) * Fraction(numel + local_expert_numel, data_parallel_ranks)


def owner_group_elements_per_rank(plan, *, ns_steps: int = NS_STEPS, ns_method: str = "torch") -> Fraction:
    """The owner groups' all-reduces per step (``OwnershipPlan``; none without groups), averaged over all
    R*N ranks: each member of a k-rank group all-reduces the packed fp32 Gram matrix (s (s+1)/2
    elements) at every step of the standard iteration, or at Gram Newton–Schulz's restarts + 1, and its
    squared norm (1 element), each 2(k-1)/k x its elements per member. The forward broadcasts and the
    backward reduces move the same elements as one owner's (each block from or to its member)."""
    return (
        sum(owner_group_elements_of_ranks(plan, ns_steps=ns_steps, ns_method=ns_method), Fraction(0)) / plan.world_size
    )


def owner_group_elements_of_ranks(plan, *, ns_steps: int = NS_STEPS, ns_method: str = "torch") -> list[Fraction]:
    """``owner_group_elements_per_rank`` rank by rank (global rank r * N + s): each member's 2(k-1)/k x the
    elements it gives its groups' all-reduces; 0 on a rank in no group."""
    out = [Fraction(0)] * plan.world_size
    for e in plan.entries:
        if e.group is not None:
            k = e.group.size
            moved = 2 * Fraction(k - 1, k) * gram_elements(min(e.shape), max(e.shape), k, ns_steps, ns_method)
            for rank in e.group.ranks:
                out[rank] += moved
    return out


def design_elements_per_rank(
    handle, *, deferred: bool = False, ns_steps: int = NS_STEPS, ns_method: str = "torch"
) -> Fraction:
    """``dmuon_elements_per_rank`` for a ``DedicatedParams`` handle (Z3 counts the kept last layer
    once the first step has shown which layer runs last), plus its owner groups' all-reduces
    (``owner_group_elements_per_rank``, at the optimizer's ``ns_steps`` and ``ns_method``)."""
    kept = 0 if deferred else handle.kept_unit_numel
    return dmuon_elements_per_rank(
        handle.mode,
        numel=handle.plan.total_numel,
        kept_unit_numel=kept,
        deferred=deferred,
        local_tp_numel=handle.plan.local_tp_numel,
    ) + owner_group_elements_per_rank(handle.plan, ns_steps=ns_steps, ns_method=ns_method)


def baseline_elements_per_rank(configuration: str, *, shard_size: int, numel: int) -> Fraction:
    """The Muon targets' elements per rank per step for what DMuon is compared with:
    naive FSDP2 + Muon (FSDP2's traffic plus an all-gather of the full gradient in the step:
    3 or 4 (N-1)/N), DDP + Muon (an all-reduce: 2(N-1)/N) and the all-to-all designs
    (TorchTitan's DistMuon, dion: FSDP2's traffic plus two all-to-alls of P/N: + 2(N-1)/N^2)."""
    n, p = shard_size, numel
    step = Fraction(n - 1, n) * p
    if configuration == "naive_fsdp_z2":
        return 3 * step
    if configuration == "naive_fsdp_z3":
        return 4 * step
    if configuration == "ddp_muon":
        return 2 * step
    if configuration in ("alltoall_z2", "alltoall_z3"):
        return (2 if configuration == "alltoall_z2" else 3) * step + 2 * Fraction(n - 1, n * n) * p
    raise ValueError(f"unknown configuration {configuration!r}; expected one of {BASELINES}")
