"""The Muon step of tensor-parallel weights: the owner's rule run where tensor parallelism puts each part.

A TP-split weight is held in shards by the T ranks of its TP group, and Newton–Schulz needs the whole
matrix. ``TensorParallelStep`` runs ``OwnerUpdate``'s rule in three stages per batch of weights, the
data moved between them by ``TensorParallelNewtonSchulz`` (``tensor_parallel.py``: the all-to-alls):

1. ``send``: the momentum on this rank's shards, and their bf16 Newton–Schulz inputs to each matrix's
   home (a replicated weight's momentum and input live on its home only, the one rank with its summed
   gradient: ``GradientReducer``);
2. ``orthogonalise``: on each home, Newton–Schulz of the matrices assembled there (NorMuon on each result,
   ``OwnerUpdate.home_rule``), the results sent back in the Newton–Schulz dtype;
3. ``apply``: weight decay and each block's update on this rank's shards.

``step_schedule.py`` decides when each stage of each batch runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_dmuon.runtime.comm import CommLabel, comm_source
from titan_dmuon.runtime.owner_update import SECOND_MOMENT, OwnerUpdate
from titan_dmuon.runtime.tensor_parallel import Exchange, TensorParallelNewtonSchulz


@dataclass(eq=False)
class TPItem:
    """A weight in the step's tensor-parallel exchange: the registered parameter (the optimizer
    state's key), what this rank updates of it (the TP shard, or its local experts' shards), the
    gradient of that, and its matrices (one per expert, with the blocks of the full matrix)."""

    param: torch.Tensor
    weight: torch.Tensor
    grad: torch.Tensor
    matrices: list


class TensorParallelStep:
    """One handle's TP weights through the owner's rule, a batch of them at a time."""

    def __init__(self, exchange: TensorParallelNewtonSchulz, rule: OwnerUpdate) -> None:
        self.exchange, self.rule = exchange, rule

    def send(self, group: dict, items: list[TPItem]) -> Exchange:
        """Momentum and Newton–Schulz inputs of ``items`` (the same list on every rank of the TP
        group), sent to their homes."""
        me, inputs, matrices = self.exchange.tp.rank, [], []
        for item in items:
            matrices += item.matrices
            if item.matrices[0].dim is None and item.matrices[0].home != me:
                inputs += [None] * len(item.matrices)
                continue
            inputs += self.rule.momentum_inputs(group, item.param, item.grad, slice(0, len(item.matrices)),
                                                item.matrices)
        return self.exchange.send_to_homes(matrices, inputs)

    def orthogonalise(self, group: dict, items: list[TPItem], sent: Exchange) -> Exchange:
        """Newton–Schulz of the matrices homed here (assembled from their shards) and the rule's work
        on each result (``items``: what ``sent`` sent); results sent back."""
        figures = self.rule.figures
        with figures.timing(sent.sent.device):
            back = self.exchange.orthogonalise_at_homes(sent, self.rule.orthogonalise_fn(group),
                                                        dtype=self.rule.result_dtype, rule=self.rule.home_rule(items))
        figures.matrices += back.ns_matrices
        return back

    def apply(self, group: dict, items: list[TPItem], back: Exchange) -> None:
        """Weight decay and each block's update (scaled for the block of the full matrix) on this rank's shards."""
        updates = iter(self.exchange.received(back))
        for item in items:
            self.rule.apply_shards(group, item.weight, item.matrices, updates, tp_rank=self.exchange.tp.rank)


def merged_second_moments(state: dict, params: list, handles: list) -> dict[int, torch.Tensor]:
    """NorMuon's second moments of tensor-parallel weights as a checkpoint holds them: whole on every rank
    of the TP group, by ``id(param)``. Each home keeps the rows of the matrices it orthogonalises (its
    experts of a stack, the whole of a matrix it homes) and the other ranks' copies are stale there, so
    each rank contributes its homes' rows and zeros, and one SUM all-reduce on the TP group per weight
    (checkpoints only) gives every rank the same whole value: DCP writes it once and loads it into any
    layout (a weight's rows are its full matrix's). ``params``: in the same order on every rank of a TP
    group (the optimizer's param groups); weights TP replicates keep theirs on their home only."""
    merged = {}
    for p in params:
        moment = state.get(p, {}).get(SECOND_MOMENT)
        found = _tp_homes_of(p, handles)
        if moment is None or found is None:
            continue
        tp, homes = found
        local = moment.to_local() if isinstance(moment, DTensor) else moment
        mine = torch.tensor([home == tp.rank for home in homes], dtype=local.dtype, device=local.device)
        summed = local * (mine.view(-1, *([1] * (local.ndim - 1))) if local.ndim == 3 else mine[0])
        with comm_source(CommLabel.CHECKPOINT):
            dist.all_reduce(summed, group=tp.group)
        merged[id(p)] = (DTensor.from_local(summed, moment.device_mesh, moment.placements, run_check=False,
                                            shape=moment.shape, stride=moment.stride())
                         if isinstance(moment, DTensor) else summed)
    return merged


def _tp_homes_of(p: torch.Tensor, handles: list):
    """(the TP group, each local matrix's home) of a TP-split weight: a dedicated one's, or the local
    experts of a stack FSDP2 keeps; None for anything else (and for weights TP replicates)."""
    for handle in handles:
        tp = handle.mode.tp
        if tp is None:
            continue
        member = handle.member_of(p)
        if member is not None:
            return (tp, member.entry.tp_homes) if member.entry.tp_dim is not None else None
        experts = handle.local_expert_of(p)
        if experts is not None and experts.tp_dim is not None and experts.fqn in handle.local_tp_experts:
            return tp, handle.local_tp_experts[experts.fqn].tp_homes
    return None
