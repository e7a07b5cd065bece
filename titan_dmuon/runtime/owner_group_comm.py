"""Owner groups' transport: their process groups, made once and warmed up, the sums on them, their DCP meshes.

Each group size k the plan uses gets one process group per aligned slot of k consecutive shard indices in
every replicate row of every copy of the dedication mesh in the world (a pipeline stage's, a tensor-parallel
rank's, ...), all made by ``dist.new_group`` on every rank of the world in one order: sizes ascending, then
the copies as the device mesh's layout lists them, rows, slots (``slot_groups``). new_group is a collective
of the whole world that numbers groups by a counter; a group made by its members alone would advance the
counter on them only, and every later group made by all ranks would get different names (a hang). When
the dedication mesh is a slice of the world, the sizes are the union over the world (one all-reduce of a
flag per size at build time): another copy's plan (another pipeline stage's) may use sizes this one does not;
then every rank of the world takes part, once per model part: ``dedicate_params``, or ``join_owner_groups``
for a part that dedicates nothing (TorchTitan's pipeline stage with only the token embedding).

The warm-up: right after they are made, every rank issues one all-reduce of one number on each group it is
in, sizes ascending (the order every rank follows), so that each communicator exists before the first sum
(on NCCL, communicators start lazily at their first collective unless the default group was bound to a
device; a resume's first step may run the sums before any other collective of theirs).

A sum is ``dist.all_reduce`` (SUM) on the group's own process group: NCCL does the transfer and the
reduction in one kernel, issued from the current stream, which waits for it (no host sync); the tensor is
the caller's, alive until the stream has waited. Every member issues its groups' sums in one global order
(``optim/grouped_update.py``), so two groups that share ranks never wait on each other crosswise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from titan_dmuon.math.group_newton_schulz import AllReduce
from titan_dmuon.runtime.comm import CommLabel, CommStats, comm_source
from titan_dmuon.runtime.members import Member
from titan_dmuon.runtime.mode import MeshInfo


def slot_of(member: Member, shard_size: int) -> tuple[int, ...]:
    """The shard indices of ``member``'s owner group (the same slot in every replicate row)."""
    return tuple(rank % shard_size for rank in member.group.ranks)


def mesh_copies(mesh: MeshInfo) -> list[torch.Tensor]:
    """Every copy of the dedication mesh in the world, each (R, N) global ranks, in the order the device
    mesh's layout lists them (the same on every rank): the mesh itself when it spans the world."""
    ranks = mesh.mesh.mesh.reshape(mesh.replicate_size, mesh.shard_size)
    if ranks.numel() == dist.get_world_size():
        return [ranks]
    layout, root = getattr(mesh.mesh, "_layout", None), getattr(mesh.mesh, "_get_root_mesh", None)
    if layout is None or root is None:
        raise RuntimeError(
            "owner groups on a dedication mesh that is a slice of the world need torch's DeviceMesh layout "
            f"(torch >= 2.10; this is {torch.__version__}) to make their process groups on every rank: "
            "upgrade torch, or dedicate with owner_groups=None"
        )
    full = layout.remap_to_tensor(root()._rank_map)
    return [copy.reshape(mesh.replicate_size, mesh.shard_size) for copy in full]


def agreed_sizes(mesh: MeshInfo, sizes: set[int], copies: int) -> list[int]:
    """The group sizes every copy's plan uses, ascending: this plan's when the mesh spans the world (every
    rank holds the same plan: ``validate_across_ranks``), else the union over the world (an all-reduce MAX
    of a flag per size, on every rank of the world)."""
    if copies == 1:
        return sorted(sizes)
    flags = torch.zeros(mesh.shard_size + 1, dtype=torch.int32, device=mesh.device)
    for k in sizes:
        flags[k] = 1
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [k for k, flag in enumerate(flags.tolist()) if flag]


def slot_groups(mesh: MeshInfo, sizes: set[int]) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """The process groups of this rank's slots, keyed by their ranks in the plan's numbering (r N + s); made
    by every rank of the world in one order (the module's notes), then warmed up."""
    copies = mesh_copies(mesh)
    mine = dist.get_rank()
    out: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for k in agreed_sizes(mesh, sizes, len(copies)):
        for copy in copies:
            for row in range(mesh.replicate_size):
                for start in range(0, mesh.shard_size, k):
                    ranks = [int(r) for r in copy[row, start : start + k]]
                    group = dist.new_group(ranks=ranks)
                    if mine in ranks:
                        out[tuple(row * mesh.shard_size + s for s in range(start, start + k))] = group
    warm_up(out, mesh.device)
    return out


def warm_up(groups: dict[tuple[int, ...], dist.ProcessGroup], device: torch.device) -> None:
    """One all-reduce of one number on each of ``groups`` (this rank's), smallest groups first (then by
    their ranks): every communicator starts here, on every member, in an order every rank follows."""
    probe = torch.zeros(1, device=device)
    with comm_source(CommLabel.GROUP_WARM_UP):
        for ranks in sorted(groups, key=lambda r: (len(r), r)):
            dist.all_reduce(probe, group=groups[ranks])


class OwnerGroupComm:
    """This rank's owner groups: per group, the sum over its members (``dist.all_reduce`` on its process
    group, made once: ``slot_groups``) and the device mesh DCP sees its weights on (its row's ranks; only
    its coordinates are read, so it has no process group of its own)."""

    def __init__(self, mesh: MeshInfo, stats: CommStats, sizes: set[int]) -> None:
        self.mesh, self.stats = mesh, stats
        self.groups = slot_groups(mesh, sizes)
        self._meshes: dict[tuple[int, ...], DeviceMesh] = {}

    def all_reduce(self, member: Member) -> AllReduce:
        """The sum over ``member``'s group, as ``math/group_newton_schulz.py`` calls it."""
        group, stats, k = self.groups[member.group.ranks], self.stats, member.group.size

        def all_reduce(tensor: torch.Tensor) -> None:
            with comm_source(CommLabel.GROUP_GRAM):
                dist.all_reduce(tensor, group=group)
            stats.add(CommLabel.GROUP_GRAM.value, k, 2 * tensor.numel(), 2 * tensor.numel() * tensor.element_size())
            stats.add_launch(CommLabel.GROUP_GRAM.value)

        return all_reduce

    def as_sharded(self, member: Member, local: torch.Tensor) -> DTensor:
        """This member's block (of the weight, or of its momentum) as a DTensor of the whole matrix,
        ``Shard`` along the long side on its row's group (DCP: each replicate row's copy of a block is
        the same chunk, written once)."""
        full = torch.Size(member.shape)
        return DTensor.from_local(
            local,
            self.device_mesh(member),
            (Shard(member.group.long_dim),),
            run_check=False,
            shape=full,
            stride=torch.empty(full, device="meta").stride(),
        )

    def device_mesh(self, member: Member) -> DeviceMesh:
        """The 1-D device mesh of ``member``'s group in this rank's row (made once, without a process group:
        DTensor and DCP read only this rank's coordinate on it)."""
        slot = slot_of(member, self.mesh.shard_size)
        if slot not in self._meshes:
            ranks = self.mesh.mesh.mesh
            row = ranks if ranks.ndim == 1 else ranks[self.mesh.replicate_rank]
            self._meshes[slot] = DeviceMesh(
                self.mesh.device.type, torch.tensor([int(row[s]) for s in slot]), _init_backend=False
            )
        return self._meshes[slot]


def needs_comm(options, sizes: set[int], mesh: MeshInfo) -> bool:
    """Whether this rank makes (or joins) the owner groups' process groups: groups on (``options``) and
    groups in its plan, or a dedication mesh that is a slice of the world (another copy may have some)."""
    return options is not None and options.enabled and (bool(sizes) or mesh.world_size < dist.get_world_size())


def join_owner_groups(mesh: DeviceMesh, options) -> None:
    """For a rank whose model part dedicates nothing (a pipeline stage with no Muon target): the world's
    collectives that making the owner groups' process groups takes, with no sizes of its own. When the
    dedication mesh is a slice of the world, every rank of the world calls ``dedicate_params`` or this,
    the same number of times (once per model part)."""
    info = MeshInfo.from_mesh(mesh)
    if needs_comm(options, set(), info):
        OwnerGroupComm(info, CommStats(), set())


def plan_group_sizes(entries: Sequence) -> set[int]:
    """The owner-group sizes a plan's entries use."""
    return {e.group.size for e in entries if e.group is not None}
