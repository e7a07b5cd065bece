"""Initialising dedicated weights as the same model without DMuon would: the same random numbers.

An initialiser (TorchTitan's ``init_weights``/``init_states``) draws a weight's values on the form
the weight has: FSDP2's DTensor shard on each rank, or DDP's full replica. Dedicated weights live
in full on their owners and as 0-element placeholders elsewhere, so while a module initialises
``initialising`` registers a stand-in of the form FSDP2 (or DDP) would give the weight; each rank
draws exactly what it would draw without DMuon, and on exit the owners keep the assembled values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from titan_dmuon.runtime.members import Member
from titan_dmuon.runtime.mode import DedicationMode
from titan_dmuon.runtime.tensor_parallel import tp_local


@contextlib.contextmanager
def initialising(
    members: Sequence[Member],
    mode: DedicationMode,
    *,
    sharded: bool,
    shard_dim: Callable[[Member], int] | None = None,
    layout: Callable | None = None,
    on_written: Callable[[], None],
) -> Iterator[None]:
    """While the block initialises ``members`` (the dedicated weights of one module), each is a
    stand-in of the form it would have without DMuon (see ``DedicatedParams.initialising``); on a
    normal exit the owners copy in the values drawn (their TP-local shard under tensor parallelism)
    and ``on_written()`` runs; on an error the weights are left as they were."""
    stand_ins = [_stand_in(m, mode, sharded=sharded, shard_dim=shard_dim, layout=layout) for m in members]
    for m, stand_in in zip(members, stand_ins):
        m.module._parameters[m.name] = stand_in
    completed = False
    try:
        yield
        completed = True
    finally:
        for m, stand_in in zip(members, stand_ins):
            m.module._parameters[m.name] = m.param
            if completed:
                _keep_on_owner(m, stand_in, mode)
    if completed:
        on_written()


def _stand_in(member: Member, mode: DedicationMode, *, sharded: bool, shard_dim, layout) -> nn.Parameter:
    """The weight as FSDP2 (``sharded``, or an explicit ``layout``) or DDP would hold it."""
    full = torch.Size(member.entry.full_shape)
    like = member.param
    if layout is None and not sharded:
        data = torch.empty(full, dtype=like.dtype, device=like.device)
    else:
        mesh, placements = layout(member) if layout is not None else _fsdp_layout(member, mode, shard_dim)
        local_shape, _ = compute_local_shape_and_global_offset(full, mesh, placements)
        local = torch.empty(local_shape, dtype=like.dtype, device=like.device)
        data = DTensor.from_local(
            local, mesh, placements, run_check=False, shape=full, stride=torch.empty(full, device="meta").stride()
        )
    return nn.Parameter(data, requires_grad=like.requires_grad)


def _fsdp_layout(member: Member, mode: DedicationMode, shard_dim) -> tuple:
    """FSDP2's layout on the dedication mesh: ``Shard(d)`` (d = ``shard_dim(member)``, default 0,
    FSDP2's default), ``Replicate()`` across HSDP's replicas."""
    dim = shard_dim(member) if shard_dim is not None else 0
    placements = (Replicate(), Shard(dim)) if mode.mesh.hsdp else (Shard(dim),)
    return mode.mesh.mesh, placements


@torch.no_grad()
def _keep_on_owner(member: Member, stand_in: nn.Parameter, mode: DedicationMode) -> None:
    """The owners keep the value drawn (assembled from the shards: a collective on every rank)."""
    value = stand_in.data
    full = value.full_tensor() if isinstance(value, DTensor) else value
    if member.holds_full:
        member.param.copy_(tp_local(mode.tp, member, full))
    elif member.block is not None:  # an owner group's member: its block
        lo, hi = member.group.bounds[member.block : member.block + 2]
        member.param.copy_(full[lo:hi] if member.group.long_dim == 0 else full[:, lo:hi])
