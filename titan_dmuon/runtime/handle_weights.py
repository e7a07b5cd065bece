"""A handle's dedicated weights in other forms: in full on every rank, a TP shard as its full matrix
and back, and the form they would have without DMuon while an initialiser runs.

Mixed into ``DedicatedParams`` (``handle.py``), whose ``mode``, ``plan``, ``_members``,
``members_of``, ``wait_for_replicate_broadcasts`` and ``weights_changed`` it uses; the methods
are the handle's own public names. The conversions are ``tensor_parallel.py``'s, the
initialisation ``initialise.py``'s, on this handle's mode.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from titan_dmuon.runtime import initialise, tensor_parallel
from titan_dmuon.runtime.comm import CommLabel, comm_source
from titan_dmuon.runtime.members import Member, pieces_of


class HandleWeights:
    """Every dedicated weight where it is not kept: exports, checkpoints, initialisation."""

    @torch.no_grad()
    def full_tensors(self) -> dict[str, torch.Tensor]:
        """Every dedicated weight in full on every rank (a collective; for export and tests)."""
        self.wait_for_replicate_broadcasts()
        mesh = self.mode.mesh
        out = {}
        for m in self._members:
            like = m.param
            full = like.detach().clone() if m.holds_full else torch.empty(m.shape, dtype=like.dtype, device=like.device)
            for piece in pieces_of(m, self.plan):  # (an owner group's weight: each block from its holder)
                part = piece.of(full)
                if piece.index is not None and piece.index == m.block:
                    part.copy_(m.param.detach())
                if mesh.shard_size > 1:
                    landing = part if part.is_contiguous() else part.contiguous()
                    with comm_source(CommLabel.EXPORT):
                        dist.broadcast(landing, group_src=piece.shard_owner, group=mesh.shard_group)
                    if landing is not part:
                        part.copy_(landing)
            out[m.fqn] = self.tp_full(m, full)
        return out

    def tp_full(self, member: Member, shard: torch.Tensor) -> torch.Tensor:
        """``tensor_parallel.tp_full`` on this handle's TP group (a collective)."""
        return tensor_parallel.tp_full(self.mode.tp, member, shard)

    def tp_local(self, member: Member, full: torch.Tensor) -> torch.Tensor:
        """``tensor_parallel.tp_local``: this rank's TP-local shard of a full value of ``member``."""
        return tensor_parallel.tp_local(self.mode.tp, member, full)

    def as_sharded(self, member: Member, local: torch.Tensor) -> torch.Tensor:
        """A TP shard (``tensor_parallel.as_sharded``), or an owner group's block
        (``OwnerGroupComm.as_sharded``), as a DTensor of the full matrix, for DCP."""
        if member.block is not None:
            return self.owner_groups.as_sharded(member, local)
        return tensor_parallel.as_sharded(self.mode.tp, member, local)

    def initialising(self, module: nn.Module, *, sharded: bool, shard_dim=None, layout=None):
        """While ``module`` initialises its dedicated weights, give each the form it would have in
        the same model without DMuon, so that the initialiser draws the same random numbers
        (``initialise.initialising``):

        * ``sharded`` (FSDP2 or HSDP): a DTensor laid out as FSDP2 shards it, ``Shard(d)`` on
          the dedication mesh (``Replicate()`` across HSDP replicas), ``d = shard_dim(member)``
          (default 0, FSDP2's default); each rank draws its own shard exactly as FSDP2's would;
        * not sharded (DDP): the full weight on every rank.

        On exit the owners keep the assembled full weight (one all-gather per sharded weight:
        a collective, at the same point on every rank) and the other ranks their 0-element
        placeholders. Transient memory: one full weight per rank at a time.

        ``layout(member) -> (mesh, placements)`` overrides the DTensor layout of the full matrix
        (tensor parallelism: FSDP2's layout over the data-parallel and tp dims); each holder then
        keeps its TP-local shard.
        """
        return initialise.initialising(
            self.members_of(module),
            self.mode,
            sharded=sharded,
            shard_dim=shard_dim,
            layout=layout,
            on_written=self.weights_changed,
        )
