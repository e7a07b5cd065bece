"""Owner groups at run time: their process groups, their weights' update, their weights as DTensors.

A weight the plan gives an owner group (``plan.OwnerGroup``) is kept in blocks along its long side:
in every replicate row, the rank at each of the group's shard indices keeps one block (and, in the
row that runs its Newton–Schulz, that block's gradient and momentum). ``OwnerGroups`` gives, for each
group this rank is in, the sum over its members (a ring of point-to-point sends on the shard group:
``ring_all_reduce``) and the 1-D device mesh DCP sees the weight on.

The update (``update_grouped``, what ``OwnerUpdate`` runs for such weights): momentum on this
member's block, Newton–Schulz of the whole matrix by ``group_newton_schulz.group_newton_schulz`` with the
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

from titan_dmuon.math.group_newton_schulz import AllReduce, group_newton_schulz
from titan_dmuon.plan.owner_groups import GroupOptions
from titan_dmuon.math.muon_update import adjusted_lr, scalar
from titan_dmuon.runtime.comm import CommLabel, CommStats, comm_source
from titan_dmuon.runtime.members import Member
from titan_dmuon.runtime.mode import MeshInfo


def slot_of(member: Member, shard_size: int) -> tuple[int, ...]:
    """The shard indices of ``member``'s owner group (the same slot in every replicate row)."""
    return tuple(rank % shard_size for rank in member.group.ranks)


def ring_orders(group_size: int, rings: int) -> list[list[int]]:
    """The member positions of each ring: one ring in member order, or (``rings`` ranks per node, whole
    nodes) one ring per rank of a node, each node's ranks rotated by the ring's index, so that ring c
    crosses from each node to the next at a different rank (its own network link)."""
    if rings == 1:
        return [list(range(group_size))]
    return [[node * rings + (i + c) % rings for node in range(group_size // rings) for i in range(rings)]
            for c in range(rings)]


def ring_all_reduce(tensor: torch.Tensor, members: Sequence[int], me: int, group: dist.ProcessGroup,
                    stats: CommStats, rings: int = 1) -> None:
    """Sum ``tensor`` in place over ``members`` (ranks of ``group``; this rank is ``members[me]``) by
    point-to-point sends on ``group``: ``rings`` rings (``ring_orders``) in lockstep, each a reduce-scatter
    then an all-gather of its part of the tensor in k chunks, 2 (k - 1) rounds of one send to the next
    member and one receive from the previous per ring (all of a round in one ``batch_isend_irecv``). Each
    chunk is summed in ring order once and then copied, so every member ends with the same bits. Counted
    under ``CommLabel.GROUP_GRAM`` as the design counts an all-reduce (2 (k - 1) / k of it per member on
    average; the ledger counts each send).

    No process group of its own: a group made by its members alone (``new_group`` with local
    synchronisation) advances torch's group counter on them only, and every later group made by all
    ranks would then get different names on different ranks (a hang)."""
    k = len(members)
    if k == 1:
        return
    flat = tensor.view(-1)
    orders = ring_orders(k, rings)
    part = -(-flat.numel() // len(orders))
    plans = []
    for c, order in enumerate(orders):
        mine = flat[c * part : (c + 1) * part]
        width = -(-mine.numel() // k)
        position = order.index(me)
        plans.append((
            [mine[i * width : (i + 1) * width] for i in range(k)],
            position,
            dist.get_global_rank(group, members[order[(position + 1) % k]]),
            dist.get_global_rank(group, members[order[(position - 1) % k]]),
            torch.empty(width, dtype=flat.dtype, device=flat.device),
        ))

    def exchange(pairs) -> None:  # (send, receive) per ring
        ops = []
        for (_, _, following, preceding, _), (send, receive) in zip(plans, pairs):
            ops += [dist.P2POp(dist.isend, send, following, group), dist.P2POp(dist.irecv, receive, preceding, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    with comm_source(CommLabel.GROUP_GRAM):
        for step in range(k - 1):  # reduce-scatter: in each ring this member ends with chunk position + 1 summed
            targets = [chunks[(p - step - 1) % k] for chunks, p, _, _, _ in plans]
            exchange([(chunks[(p - step) % k], scratch[: t.numel()])
                      for (chunks, p, _, _, scratch), t in zip(plans, targets)])
            for (_, _, _, _, scratch), t in zip(plans, targets):
                t.add_(scratch[: t.numel()])
        for step in range(k - 1):  # all-gather
            exchange([(chunks[(p + 1 - step) % k], chunks[(p - step) % k]) for chunks, p, _, _, _ in plans])
    stats.add(CommLabel.GROUP_GRAM.value, k, 2 * flat.numel(), 2 * flat.numel() * flat.element_size())
    stats.add_launch(CommLabel.GROUP_GRAM.value)


class OwnerGroups:
    """This rank's owner groups: per slot of shard indices it is in, the sum over its members (on the
    shard group, ``ring_all_reduce``) and the device mesh DCP sees their weights on (its row's ranks;
    only its coordinates are read, so it has no process group)."""

    def __init__(self, mesh: MeshInfo, stats: CommStats, options: GroupOptions) -> None:
        self.mesh, self.stats, self.options = mesh, stats, options
        self._meshes: dict[tuple[int, ...], DeviceMesh] = {}

    def all_reduce(self, member: Member) -> AllReduce:
        """The sum over ``member``'s group, as ``math/group_newton_schulz.py`` calls it."""
        members = slot_of(member, self.mesh.shard_size)
        me, group, stats = members.index(self.mesh.shard_rank), self.mesh.shard_group, self.stats
        rings = self.options.rings(len(members))

        def all_reduce(tensor: torch.Tensor) -> None:
            ring_all_reduce(tensor, members, me, group, stats, rings)

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


def check_whole_matrix_rules(param_groups: list[dict], handles: list, *, ns_dtype: str,
                             normuon_beta2: float | None) -> None:
    """ValueError (on every rank: the plan and the options are the same everywhere) when a weight of an
    owner group is to get a rule that needs its whole matrix on one rank: ``ns_mode`` "exact" (a param
    group's), NorMuon's per-row statistics, or the float16 iteration (the group's Newton–Schulz runs in
    bf16)."""
    rules = [(lambda g: g["ns_mode"] == "exact", "ns_mode 'exact' is torch.optim.Muon's own update on one owner",
              "or use ns_mode 'batched'")]
    if normuon_beta2 is not None:
        rules.append((lambda g: True, "NorMuon (normuon_beta2) normalises each row of the whole orthogonalised "
                      "matrix on one owner", "or leave normuon_beta2 unset"))
    if ns_dtype != "bfloat16":
        rules.append((lambda g: True, f"ns_dtype {ns_dtype!r} iterates on one owner (an owner group's "
                      "Newton–Schulz runs in bfloat16)", "or use ns_dtype 'bfloat16'"))
    for group in param_groups:
        if not group.get("use_muon"):
            continue
        for applies, rule, other in rules:
            if not applies(group):
                continue
            for p in group["params"]:
                member = next((m for h in handles if (m := h.member_of(p)) is not None), None)
                if member is not None and member.group is not None:
                    raise ValueError(
                        f"{rule}, and the plan split {member.fqn!r} over an owner group of {member.group.size} "
                        "ranks: dedicate with owner_groups=None (TorchTitan: optimizer.owner_groups = false, which "
                        f"these settings imply there), {other}")


def update_grouped(rule, group: dict, weights: list[GroupedWeight], owner_groups: OwnerGroups) -> None:
    """Muon on this member's blocks of ``weights`` with ``group``'s options (``rule``: the
    ``OwnerUpdate`` whose state, method and figures they use), batched by group and shape."""
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
