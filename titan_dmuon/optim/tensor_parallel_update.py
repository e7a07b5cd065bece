"""The Muon step of tensor-parallel weights: the owner's rule run where tensor parallelism puts each part.

A TP-split weight is held in shards by the T ranks of its TP group, and Newton–Schulz needs the whole
matrix. ``TensorParallelStep`` runs ``OwnerUpdate``'s rule in three stages per batch of matrices, the
data moved between them by ``TensorParallelNewtonSchulz`` (``tensor_parallel.py``: the all-to-alls):

1. ``_send``: the momentum on this rank's shards, and their bf16 Newton–Schulz inputs to each matrix's
   home (a replicated weight's momentum and input live on its home only, the one rank with its summed
   gradient: ``GradientReducer``);
2. ``_orthogonalise``: on each home, Newton–Schulz of the matrices assembled there (timed from when
   their shards are there; NorMuon on each result, ``OwnerUpdate.home_rule``), the results sent back in
   the Newton–Schulz dtype;
3. ``_apply``: weight decay and each block's update on this rank's shards.

The schedule hands it each job's weights (``submit``) and the batches go through as a pipeline: batch
k+1's shards are sent before batch k's Newton–Schulz, and batch k's results are applied after batch
k+1's Newton–Schulz. On an accelerator the all-to-alls run in issue order on the handle's reduce
stream, each after an event recorded once its inputs are written, so the Newton–Schulz of batch k
runs while batch k+1's shards travel to their homes and batch k-1's results travel back (in the
other order, NS(k), back(k), send(k+1), NS(k+1), send(k+1) would queue behind back(k), which waits
for NS(k), and NS(k+1) for send(k+1): no transfer beside any Newton–Schulz).

Memory. A batch holds at most ``MAX_EXCHANGE_BYTES`` of exchange bytes (``exchange_bytes``: a matrix's
full bf16 size, T copies of a replicated one's; a matrix larger than that alone), so no buffer of a
batch is larger than the cap on any rank of the TP group, and at most three batches are alive at
once. While batch k is orthogonalised: batch k+1's send and receive buffers (at most 1/T + 1 cap),
batch k's assembled matrices, their Newton–Schulz inputs where a row block is gathered, and the
results (at most 3 caps; its received shards are dropped once assembled), batch k-1's results on
their way back (at most 1 + 1/T caps). So the step's transient memory is at most 6 x
``MAX_EXCHANGE_BYTES`` whatever the chunk of layers (no more while batch k+1's inputs are made: its
fp32 momentum of at most 2/T caps, its inputs and send buffer 2/T), plus what Newton–Schulz itself
holds on one batch (its bf16 stack, X Xᵀ, the polynomial and the next X: about 4 copies of the batch,
of its ``ns_methods.MAX_STACK_BYTES`` stacks one at a time). Uncapped, a chunk of up to a third of
the layers went through as one exchange, about five bf16 copies of its TP matrices alive at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_dmuon.optim.whole_update import SECOND_MOMENT, OwnerUpdate, second_moment_shape_of, zero_second_moment
from titan_dmuon.plan.specs import TPMatrix
from titan_dmuon.runtime.comm import CommLabel, comm_source
from titan_dmuon.runtime.tensor_parallel import Exchange, TensorParallelNewtonSchulz

MAX_EXCHANGE_BYTES = 64 * 2**20  # of one exchange's matrices (exchange_bytes), as MAX_STACK_BYTES caps NS stacks


def exchange_bytes(matrix: TPMatrix, tp_size: int) -> int:
    """What a matrix counts toward its batch's cap: its largest buffer on any rank of the TP group, in
    bf16: the full matrix (T shards of ``matrix.shape``, assembled on its home) or, replicated, T copies
    of it (sent back from its home, one to each rank): T x its elements either way."""
    return 2 * tp_size * matrix.numel


@dataclass(eq=False)
class TPItem:
    """A weight in the step's tensor-parallel exchange: the registered parameter (the optimizer
    state's key), what this rank updates of it (the TP shard, or its local experts' shards), the
    gradient of that, and its matrices (one per expert, with the blocks of the full matrix)."""

    param: torch.Tensor
    weight: torch.Tensor
    grad: torch.Tensor
    matrices: list


@dataclass(eq=False)
class _Part:
    """Matrices ``first`` to ``stop`` of an item (experts of a stack; a matrix's only one)."""

    item: TPItem
    first: int
    stop: int

    @property
    def matrices(self) -> list:
        return self.item.matrices[self.first : self.stop]

    @property
    def weight(self) -> torch.Tensor:
        weight = self.item.weight
        return weight[self.first : self.stop] if weight.ndim == 3 else weight


@dataclass(eq=False)
class _Batch:
    """One exchange's matrices (of one param group), the exchange in flight, and what runs once they
    are applied (after a job's last batch: its units are sent on)."""

    group: dict
    parts: list[_Part]
    then: Callable[[], None] | None = None
    exchange: Exchange | None = None
    slot: int = 0  # which of the workspace's two sets of exchange buffers it uses


class TensorParallelStep:
    """One handle's TP weights through the owner's rule, a batch at a time, pipelined."""

    def __init__(self, exchange: TensorParallelNewtonSchulz, owner_update: OwnerUpdate) -> None:
        self.exchange, self.owner_update = exchange, owner_update
        self._sent: _Batch | None = None  # its shards on their way to their homes
        self._back: _Batch | None = None  # its results on their way back
        self._batches_sent = 0  # a batch's exchange buffers are the rule's workspace's, in slot count % 2

    def submit(self, work: list[tuple[dict, list[TPItem]]], then: Callable[[], None]) -> None:
        """A job's TP weights by param group (the same on every rank of the TP group): each batch is
        sent at once and the one sent before it orthogonalised; ``then()`` runs once all of them are
        applied (after every earlier job's ``then``)."""
        batches = [_Batch(group, parts) for group, items in work for parts in self._batches(items)]
        if not batches:
            self.finish()
            then()
            return
        batches[-1].then = then
        for batch in batches:
            self._send(batch)
            if self._sent is not None:
                self._advance()
            self._sent = batch

    def finish(self) -> None:
        """Every batch submitted is orthogonalised and applied, in order."""
        if self._sent is not None:
            self._advance()
        if self._back is not None:
            self._apply(self._back)
            self._back = None

    def _advance(self) -> None:
        """The batch sent earliest is orthogonalised; the one before it, back by then, applied."""
        batch, self._sent = self._sent, None
        self._orthogonalise(batch)
        if self._back is not None:
            self._apply(self._back)
        self._back = batch

    def _batches(self, items: list[TPItem]) -> list[list[_Part]]:
        """``items``' matrices in order, in batches of at most MAX_EXCHANGE_BYTES (a stack of experts
        may be split between two); the same on every rank of the TP group (from the matrices' shapes)."""
        size, batches, parts, used = self.exchange.tp.size, [], [], 0
        for item in items:
            first = 0
            for k, matrix in enumerate(item.matrices):
                cost = exchange_bytes(matrix, size)
                if used and used + cost > MAX_EXCHANGE_BYTES:
                    if k > first:
                        parts.append(_Part(item, first, k))
                    batches.append(parts)
                    parts, used, first = [], 0, k
                used += cost
            if len(item.matrices) > first:
                parts.append(_Part(item, first, len(item.matrices)))
        return batches + ([parts] if parts else [])

    def _send(self, batch: _Batch) -> None:
        """Momentum and Newton–Schulz inputs of ``batch``, sent to their homes."""
        me, inputs, matrices, workspace = self.exchange.tp.rank, [], [], self.owner_update.workspace
        batch.slot, self._batches_sent = self._batches_sent % 2, self._batches_sent + 1
        computed = [p for p in batch.parts if not (p.matrices[0].dim is None and p.matrices[0].home != me)]
        sizes = [len(p.matrices) * p.matrices[0].numel for p in computed]
        flat = workspace("tp_inputs", (sum(sizes),), torch.bfloat16, self.exchange.streams.device)
        offset = 0
        for part in batch.parts:
            matrices += part.matrices
            if part not in computed:
                inputs += [None] * len(part.matrices)  # (a replicated weight: its momentum lives on its home)
                continue
            count, shape = len(part.matrices), part.matrices[0].shape
            out = flat[offset : offset + count * part.matrices[0].numel].view(count, *shape)
            offset += out.numel()
            inputs += self.owner_update.momentum_inputs(
                batch.group, part.item.param, part.item.grad, slice(part.first, part.stop), part.item.matrices, out=out
            )
        batch.exchange = self.exchange.send_to_homes(matrices, inputs, scratch=workspace, slot=batch.slot)

    def _orthogonalise(self, batch: _Batch) -> None:
        """Newton–Schulz of the matrices homed here, timed from when their shards are here (the wait
        is the transfer's: on an accelerator the timer's start event is queued after it)."""
        figures, newton_schulz = self.owner_update.figures, self.owner_update.orthogonalise_fn(batch.group)

        def timed(matrices: list[torch.Tensor], consume) -> None:
            with figures.timing(matrices[0].device):
                newton_schulz(matrices, consume)

        sent, batch.exchange = batch.exchange, None
        owners = [(part.item, k) for part in batch.parts for k in range(part.first, part.stop)]
        batch.exchange = self.exchange.orthogonalise_at_homes(
            sent,
            timed,
            dtype=self.owner_update.result_dtype,
            rule=self.owner_update.home_rule(owners),
            scratch=self.owner_update.workspace,
            slot=batch.slot,
        )
        figures.matrices += batch.exchange.ns_matrices

    def _apply(self, batch: _Batch) -> None:
        """Weight decay and each block's update (scaled for the block of the full matrix) on this rank's shards."""
        updates = iter(self.exchange.received(batch.exchange))
        for part in batch.parts:
            self.owner_update.apply_shards(
                batch.group, part.weight, part.matrices, updates, tp_rank=self.exchange.tp.rank
            )
        batch.exchange = None
        if batch.then is not None:
            batch.then()


def merged_second_moments(state: dict, params: list, handles: list) -> dict[int, torch.Tensor]:
    """NorMuon's second moments of tensor-parallel weights as a checkpoint holds them: whole on every rank
    of the TP group, by ``id(param)``. Each home keeps the rows of the matrices it orthogonalises (its
    experts of a stack, the whole of a matrix it homes) and the other ranks' copies are stale there, so
    each rank contributes its homes' rows and zeros, and one SUM all-reduce on the TP group per weight
    (checkpoints only) gives every rank the same whole value: DCP writes it once and loads it into any
    layout (a weight's rows are its full matrix's). ``params``: the weights whose state the plan keeps on
    this rank, in the same order on every rank of a TP group (the optimizer's param groups); weights TP
    replicates keep theirs on their home only. Which all-reduces run is decided by the plan alone: a rank
    that holds no second moment (yet: a load that dropped it, or no step) sends zeros, as a rank whose
    collectives depended on its own state would leave its TP peers waiting (a hang on NCCL)."""
    merged = {}
    for p in params:
        found = _tp_homes_of(p, handles)
        if found is None:
            continue
        moment = state.get(p, {}).get(SECOND_MOMENT)
        if moment is None:
            moment = zero_second_moment(p, second_moment_shape_of(handles, p))
        tp, homes = found
        local = moment.to_local() if isinstance(moment, DTensor) else moment
        mine = torch.tensor([home == tp.rank for home in homes], dtype=local.dtype, device=local.device)
        summed = local * (mine.view(-1, *([1] * (local.ndim - 1))) if local.ndim == 3 else mine[0])
        with comm_source(CommLabel.CHECKPOINT):
            dist.all_reduce(summed, group=tp.group)
        merged[id(p)] = (
            DTensor.from_local(
                summed,
                moment.device_mesh,
                moment.placements,
                run_check=False,
                shape=moment.shape,
                stride=moment.stride(),
            )
            if isinstance(moment, DTensor)
            else summed
        )
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
