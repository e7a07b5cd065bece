"""The Muon update of an owner group's weights on one member: its blocks, the group's sums between.

A weight the plan gives an owner group (``plan.OwnerGroup``) is kept in blocks along its long side; the
member that runs Newton–Schulz for a block holds its gradient and momentum. The update: momentum on the
block, Newton–Schulz of the whole matrix by ``group_math.group_newton_schulz`` with the group's all-reduces
(``runtime/owner_group_comm.py``), then weight decay and the update scaled for the whole matrix
(``adjusted_lr``). Equally shaped matrices of the same group share one call (one all-reduce per step of
the iteration for all of them), in batches under the one-owner path's memory cap (``member_batches``).

NCCL: the step calls ``update_grouped`` job by job and, in a job, param group by param group in the
optimizer's order (``step_schedule``); here the batches go in the order of their first weight's name.
Every member of two groups therefore issues their sums in one order that does not depend on what it owns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_dmuon.math.group_newton_schulz import (
    group_newton_schulz,
    member_batch_elements,
    member_workspace_elements,
    widest_block,
)
from titan_dmuon.math.ns_methods import MAX_STACK_BYTES, workspace_elements
from titan_dmuon.math.update_rules import adjusted_lr, scalar
from titan_dmuon.runtime.members import Member


@dataclass(eq=False)
class GroupedWeight:
    """A weight of an owner group on a member that runs Newton–Schulz: its registered parameter (this
    member's block: its optimizer state's key), the block's gradient, and its record."""

    param: torch.Tensor
    grad: torch.Tensor
    member: Member


def batch_order(weights: list[GroupedWeight]) -> list[list[GroupedWeight]]:
    """``weights`` (of one param group, in one job) by (group, shape), each batch by name, the batches by
    their first weight's name: the same batches in the same order on every member of each group."""
    batches: dict[tuple, list[GroupedWeight]] = {}
    for weight in sorted(weights, key=lambda w: w.member.fqn):
        batches.setdefault((weight.member.group.ranks, weight.member.shape), []).append(weight)
    return list(batches.values())


def member_batches(batch: list[GroupedWeight], ns_method: str, steps: int) -> list[list[GroupedWeight]]:
    """``batch`` in pieces whose workspace on this member (its bf16 stack, its iterates, each matrix's
    short x short Gram workspace and one block's fp32 temporary: ``member_batch_elements``) stays within
    what the one-owner path allows a batch at ``MAX_STACK_BYTES`` (``workspace_elements`` of the matrices
    it stacks)."""
    member = batch[0].member
    per_batch = member_batch_size(member.shape, member.group.size, ns_method, steps)
    return [batch[first : first + per_batch] for first in range(0, len(batch), per_batch)]


def member_batch_size(shape: tuple[int, int], group_size: int, ns_method: str, steps: int) -> int:
    """How many equally shaped matrices of one group a member stacks per batch (``member_batches``; also
    what ``titan_dmuon.sizing`` counts a member's step temporaries by): as many as keep their
    ``member_batch_elements`` within the one-owner path's batch at ``MAX_STACK_BYTES``, cut by the widest
    block (every member cuts alike: the same all-reduces on each); at least one."""
    short, long = min(shape), max(shape)
    width = widest_block(long, group_size)
    one_owner = max(1, MAX_STACK_BYTES // (2 * short * long)) * workspace_elements(short, long, "torch", steps)
    per_matrix = member_workspace_elements(short, width, ns_method, steps)
    return max(1, (one_owner - member_batch_elements(short, width, 0, ns_method, steps)) // per_matrix)


def update_grouped(owner_update, group: dict, weights: list[GroupedWeight], comm) -> None:
    """Muon on this member's blocks of ``weights`` with ``group``'s options (``owner_update``: the ``OwnerUpdate``
    whose state, method and figures they use; ``comm``: the ``OwnerGroupComm``), batch by batch."""
    lr = scalar(group["lr"])
    momentum, nesterov = group["momentum"], group["nesterov"]
    for whole in batch_order(weights):
        member = whole[0].member
        for batch in member_batches(whole, owner_update.ns_method, group["ns_steps"]):
            param = batch[0].param
            held = [_update_stack(owner_update, batch, momentum, nesterov)]
            with owner_update.figures.timing(param.device):
                orthogonal = group_newton_schulz(
                    held.pop(),  # (handed over, no name left here: freed once the first step replaced it)
                    shape=member.shape,
                    group_size=member.group.size,
                    all_reduce=comm.all_reduce(member),
                    steps=group["ns_steps"],
                    coefficients=group["ns_coefficients"],
                    eps=group["eps"],
                    ns_method=owner_update.ns_method,
                    overwrite=True,
                )
                owner_update.figures.matrices += len(batch)
            _apply(batch, orthogonal, lr, group, member.shape)
            del orthogonal  # (before the next batch's stack: one batch's blocks alive at a time)


def _apply(batch: list[GroupedWeight], orthogonal: torch.Tensor, lr: float, group: dict, shape) -> None:
    """Weight decay and the update (``adjusted_lr`` of the whole matrix) on each block of ``batch``."""
    scale = adjusted_lr(lr, group["adjust_lr_fn"], shape)
    params = [w.param for w in batch]
    torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
    for target, update in zip(params, orthogonal):
        target.add_(update, alpha=-scale)


def _update_stack(owner_update, batch: list[GroupedWeight], momentum: float, nesterov: bool) -> torch.Tensor:
    """The batch's momentum updated and its Newton–Schulz inputs in one bf16 stack, one block's fp32
    temporary at a time. The caller keeps no name for it: ``group_newton_schulz`` iterates it in place and
    drops it once its first step has replaced it (``member_workspace_elements`` counts it so)."""
    param = batch[0].param
    stack = torch.empty((len(batch), *param.shape), dtype=torch.bfloat16, device=param.device)
    for k, weight in enumerate(batch):
        buffer = owner_update.momentum_buffer(weight.param)
        buffer.lerp_(weight.grad, 1 - momentum)
        stack[k].copy_(weight.grad.lerp(buffer, momentum) if nesterov else buffer)
    return stack
