"""Owner groups at run time: their process groups, their weights' update, their weights as DTensors.

A weight the plan gives an owner group (``plan.OwnerGroup``) is kept in blocks along its long side:
in every replicate row, the rank at each of the group's shard indices keeps one block (and, in the
row that runs its Newton–Schulz, that block's gradient and momentum). ``OwnerGroups`` gives, for each
group this rank is in, the sum over its members (a ring of point-to-point sends on the shard group:
``ring_all_reduce``) and the 1-D device mesh DCP sees the weight on.

The update (``update_grouped``, what ``OwnerUpdate`` runs for such weights): momentum on this
member's block, Newton–Schulz of the whole matrix by ``group_math.group_newton_schulz`` with the
group's all-reduces, then weight decay and the update scaled for the whole matrix (``adjusted_lr``).
Equally shaped matrices of the same group share one call (one all-reduce per step for all of them).

NCCL: every member issues its groups' sums in one global order (the batches sorted by the first
weight's name, the weights by name, within each job of the step, whose order every rank follows), so
two ranks that share two groups never wait on each other crosswise; each round's send and receive go
out together (``batch_isend_irecv``) from the current stream, which waits for them (no host sync); the
buffers are the sum's own tensor and a scratch chunk, both alive until the stream has waited.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from titan_dmuon.group_math import AllReduce, group_newton_schulz
from titan_dmuon.muon_math import adjusted_lr, scalar
from titan_dmuon.runtime.comm import CommLabel, CommStats, comm_source
from titan_dmuon.runtime.members import Member
from titan_dmuon.runtime.mode import MeshInfo


def slot_of(member: Member, shard_size: int) -> tuple[int, ...]:
    """The shard indices of ``member``'s owner group (the same slot in every replicate row)."""
    return tuple(rank % shard_size for rank in member.group.ranks)


def ring_all_reduce(tensor: torch.Tensor, members: Sequence[int], me: int, group: dist.ProcessGroup,
                    stats: CommStats) -> None:
    """Sum ``tensor`` in place over ``members`` (ranks of ``group`` in ring order; this rank is
    ``members[me]``) by point-to-point sends on ``group``: a reduce-scatter then an all-gather of k chunks,
    2 (k - 1) rounds of one send to the next member and one receive from the previous, each chunk summed
    in ring order once and then copied, so every member ends with the same bits. Counted under
    ``CommLabel.GROUP_GRAM`` as the design counts an all-reduce (2 (k - 1) / k of it per member on
    average; the ledger counts each send).

    No process group of its own: a group made by its members alone (``new_group`` with local
    synchronisation) advances torch's group counter on them only, and every later group made by all
    ranks would then get different names on different ranks (a hang)."""
    k = len(members)
    if k == 1:
        return
    flat = tensor.view(-1)
    width = -(-flat.numel() // k)
    chunks = [flat[i * width : (i + 1) * width] for i in range(k)]
    scratch = torch.empty(width, dtype=flat.dtype, device=flat.device)
    following = dist.get_global_rank(group, members[(me + 1) % k])
    preceding = dist.get_global_rank(group, members[(me - 1) % k])

    def exchange(send: torch.Tensor, receive: torch.Tensor) -> None:
        ops = [dist.P2POp(dist.isend, send, following, group), dist.P2POp(dist.irecv, receive, preceding, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    with comm_source(CommLabel.GROUP_GRAM):
        for step in range(k - 1):  # reduce-scatter: this member ends with chunk me + 1 summed
            received = chunks[(me - step - 1) % k]
            exchange(chunks[(me - step) % k], scratch[: received.numel()])
            received.add_(scratch[: received.numel()])
        for step in range(k - 1):  # all-gather
            exchange(chunks[(me + 1 - step) % k], chunks[(me - step) % k])
    stats.add(CommLabel.GROUP_GRAM.value, k, 2 * flat.numel(), 2 * flat.numel() * flat.element_size())
    stats.add_launch(CommLabel.GROUP_GRAM.value)


class OwnerGroups:
    """This rank's owner groups: per slot of shard indices it is in, the sum over its members (on the
    shard group, ``ring_all_reduce``) and the device mesh DCP sees their weights on (its row's ranks;
    only its coordinates are read, so it has no process group)."""

    def __init__(self, mesh: MeshInfo, stats: CommStats) -> None:
        self.mesh, self.stats = mesh, stats
        self._meshes: dict[tuple[int, ...], DeviceMesh] = {}

    def all_reduce(self, member: Member) -> AllReduce:
        """The sum over ``member``'s group, as ``group_math`` calls it."""
        members = slot_of(member, self.mesh.shard_size)
        me, group, stats = members.index(self.mesh.shard_rank), self.mesh.shard_group, self.stats

        def all_reduce(tensor: torch.Tensor) -> None:
            ring_all_reduce(tensor, members, me, group, stats)

        return all_reduce

    def as_sharded(self, member: Member, local: torch.Tensor) -> DTensor:
        """This member's block (of the weight, or of its momentum) as a DTensor of the whole matrix,
        ``Shard`` along the long side on its row's group (DCP: each replicate row's copy of a block is
        the same chunk, written once)."""
        full = torch.Size(member.shape)
        return DTensor.from_local(local, self.device_mesh(member), (Shard(member.group.long_dim),), run_check=False,
                                  shape=full, stride=torch.empty(full, device="meta").stride())

    def device_mesh(self, member: Member) -> DeviceMesh:
        """The 1-D device mesh of ``member``'s group in this rank's row (made once, without a process group:
        DTensor and DCP read only this rank's coordinate on it)."""
        slot = slot_of(member, self.mesh.shard_size)
        if slot not in self._meshes:
            ranks = self.mesh.mesh.mesh
            row = ranks if ranks.ndim == 1 else ranks[self.mesh.replicate_rank]
            self._meshes[slot] = DeviceMesh(self.mesh.device.type, torch.tensor([int(row[s]) for s in slot]),
                                            _init_backend=False)
        return self._meshes[slot]


@dataclass(eq=False)
class GroupedWeight:
    """A weight of an owner group on a member that runs Newton–Schulz: its registered parameter (this
    member's block: its optimizer state's key), the block's gradient, and its record."""

    param: torch.Tensor
    grad: torch.Tensor
    member: Member


def update_grouped(rule, group: dict, weights: list[GroupedWeight], owner_groups: OwnerGroups) -> None:
    """Muon on this member's blocks of ``weights`` with ``group``'s options (``rule``: the
    ``OwnerUpdate`` whose state, method and figures they use), batched by group and shape."""
    if group["ns_mode"] == "exact":
        raise ValueError("ns_mode 'exact' is torch.optim.Muon's own update on one owner, and a weight here is "
                         "split over an owner group: dedicate with owner_groups=None, or use ns_mode 'batched'")
    batches: dict[tuple, list[GroupedWeight]] = {}
    for weight in sorted(weights, key=lambda w: w.member.fqn):
        batches.setdefault((weight.member.group.ranks, weight.member.shape), []).append(weight)
    lr = scalar(group["lr"])
    momentum, nesterov = group["momentum"], group["nesterov"]
    for batch in batches.values():  # (first weights' names in order: the same order on every member)
        member = batch[0].member
        inputs = []
        for weight in batch:
            buffer = rule.momentum_buffer(weight.param)
            buffer.lerp_(weight.grad, 1 - momentum)
            inputs.append(weight.grad.lerp(buffer, momentum) if nesterov else buffer)
        with rule.figures.timing(batch[0].param.device):
            orthogonal = group_newton_schulz(
                torch.stack(inputs).bfloat16(), shape=member.shape, group_size=member.group.size,
                all_reduce=owner_groups.all_reduce(member), steps=group["ns_steps"],
                coefficients=group["ns_coefficients"], eps=group["eps"], ns_method=rule.ns_method)
            rule.figures.matrices += len(batch)
        scale = adjusted_lr(lr, group["adjust_lr_fn"], member.shape)
        params = [w.param for w in batch]
        torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        for param, update in zip(params, orthogonal):
            param.add_(update, alpha=-scale)
