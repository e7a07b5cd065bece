"""The Muon step of tensor-parallel weights: the owner's rule run where tensor parallelism puts each part.

A TP-split weight is held in shards by the T ranks of its TP group, and Newton–Schulz needs the whole
matrix. ``TensorParallelStep`` runs ``OwnerUpdate``'s rule in three stages per batch of weights, the
data moved between them by ``TensorParallelNewtonSchulz`` (``tensor_parallel.py``: the all-to-alls):

1. ``send``: the momentum on this rank's shards, and their bf16 Newton–Schulz inputs to each matrix's
   home (a replicated weight's momentum and input live on its home only, the one rank with its summed
   gradient: ``GradientReducer``);
2. ``orthogonalise``: on each home, Newton–Schulz of the matrices assembled there, the results sent back;
3. ``apply``: weight decay and each row block's update on this rank's shards.

``step_schedule.py`` decides when each stage of each batch runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_dmuon.runtime.owner_update import OwnerUpdate
from titan_dmuon.runtime.tensor_parallel import Exchange, TensorParallelNewtonSchulz


@dataclass(eq=False)
class TPItem:
    """A weight in the step's tensor-parallel exchange: the registered parameter (the optimizer
    state's key), what this rank updates of it (the TP shard, or its local experts' shards), the
    gradient of that, its matrices (one per expert) and the full matrix's columns (the lr rule)."""

    param: torch.Tensor
    weight: torch.Tensor
    grad: torch.Tensor
    matrices: list
    full_cols: int


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
            inputs += self.rule.momentum_inputs(group, item.param, item.grad, slice(0, len(item.matrices)))
        return self.exchange.send_to_homes(matrices, inputs)

    def orthogonalise(self, group: dict, sent: Exchange) -> Exchange:
        """Newton–Schulz of the matrices homed here (assembled from their shards); results sent back."""
        figures = self.rule.figures
        with figures.timing(sent.sent.device):
            back = self.exchange.orthogonalise_at_homes(sent, self.rule.orthogonalise_fn(group))
        figures.matrices += back.ns_matrices
        return back

    def apply(self, group: dict, items: list[TPItem], back: Exchange) -> None:
        """Weight decay and each row block's update (scaled for the full block) on this rank's shards."""
        updates = iter(self.exchange.received(back))
        for item in items:
            self.rule.apply_shards(group, item.weight, item.matrices, updates, full_cols=item.full_cols,
                                   tp_rank=self.exchange.tp.rank)
