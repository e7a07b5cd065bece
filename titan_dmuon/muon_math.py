"""The Muon update as pure functions, pinned to ``torch.optim.Muon`` (torch 2.14).

Nothing here communicates. The runtime decides *where* these run (on the one
owner of each matrix); this module decides *what* they compute, so that a
DMuon step and a single-process ``torch.optim.Muon`` step agree bit for bit
on the same gradient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
NS_STEPS = 5
ADJUST_LR_FNS = (None, "original", "match_rms_adamw", "spectral_unclamped")


def newton_schulz(
    matrices: torch.Tensor,
    *,
    steps: int = NS_STEPS,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
) -> torch.Tensor:
    """Quintic Newton–Schulz orthogonalisation of a batch ``(B, rows, cols)``.

    Runs in bf16 like ``torch.optim.Muon``; one batched call per shape instead
    of one call per matrix (on CPU the result is bitwise the same as the
    per-matrix loop, checked in tests/test_muon_math.py).
    """
    if matrices.ndim != 3:
        raise ValueError(f"newton_schulz expects (batch, rows, cols), got {tuple(matrices.shape)}")
    a, b, c = coefficients
    x = matrices.bfloat16()
    transposed = x.size(-2) > x.size(-1)
    if transposed:
        x = x.mT
    norms = torch.linalg.vector_norm(x.flatten(1), dim=1).clamp(min=eps)
    x = x / norms[:, None, None]
    for _ in range(steps):
        gram = x @ x.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x.mT if transposed else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """Learning rate scaled for a (rows, cols) matrix, as ``torch.optim.Muon`` does."""
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr_fn == "spectral_unclamped":
        return lr * math.sqrt(rows / cols)
    raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")


def momentum_update(
    grad: torch.Tensor, momentum_buffer: torch.Tensor, *, momentum: float, nesterov: bool
) -> torch.Tensor:
    """Advance the momentum buffer in place and return the matrix to orthogonalise."""
    momentum_buffer.lerp_(grad, 1 - momentum)
    return grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer


Block = tuple[tuple[int, int], ...]  # row ranges (start, stop) whose rows form one matrix


def row_blocks(shape: Sequence[int], split_rows=None) -> list[Block]:
    """Blocks of rows orthogonalised separately; one block unless a split is given.

    ``split_rows`` is either row counts of consecutive blocks, e.g. ``[q, k, v]``,
    or, for interleaved layouts, one list of ``(start, stop)`` row ranges per
    block. The blocks must cover every row exactly once. A fused q/k/v weight
    split this way gets the same update as separate q, k, v weights.
    """
    rows = shape[0]
    if split_rows is None:
        return [((0, rows),)]
    split_rows = list(split_rows)
    if all(isinstance(r, int) for r in split_rows):
        if any(r <= 0 for r in split_rows) or sum(split_rows) != rows:
            raise ValueError(f"split_rows {split_rows}: row counts must be positive and sum to {rows}")
        starts = [0]
        for r in split_rows:
            starts.append(starts[-1] + r)
        return [((a, b),) for a, b in zip(starts[:-1], starts[1:])]
    blocks = [tuple((int(a), int(b)) for a, b in block) for block in split_rows]
    covered = sorted(r for block in blocks for r in block)
    position = 0
    for start, stop in covered:
        if start != position or stop <= start:
            raise ValueError(f"split_rows blocks must cover rows 0..{rows} exactly once; got {covered}")
        position = stop
    if position != rows:
        raise ValueError(f"split_rows blocks must cover rows 0..{rows} exactly once; got {covered}")
    return blocks


def block_rows(block: Block) -> int:
    return sum(stop - start for start, stop in block)


def _take_rows(matrix: torch.Tensor, block: Block) -> torch.Tensor:
    if len(block) == 1:
        return matrix[block[0][0] : block[0][1]]
    return torch.cat([matrix[start:stop] for start, stop in block])


def muon_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    blocks: Sequence[Sequence[Block]],
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_steps: int,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
    adjust_lr_fn: str | None = None,
) -> int:
    """Apply one Muon step to full matrices in place; returns the number of NS matrices.

    ``blocks[i]`` lists the row blocks of ``params[i]`` orthogonalised
    separately. Blocks of equal shape share one batched Newton–Schulz call.
    """
    updates = [
        momentum_update(g, buf, momentum=momentum, nesterov=nesterov)
        for g, buf in zip(grads, momentum_buffers)
    ]
    by_shape: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for i, (update, param_blocks) in enumerate(zip(updates, blocks)):
        for b, block in enumerate(param_blocks):
            by_shape.setdefault((block_rows(block), update.shape[1]), []).append((i, b))
    orthogonal: dict[tuple[int, int], torch.Tensor] = {}
    for members in by_shape.values():
        stacked = torch.stack([_take_rows(updates[i], blocks[i][b]) for i, b in members])
        result = newton_schulz(stacked, steps=ns_steps, coefficients=ns_coefficients, eps=eps)
        for k, key in enumerate(members):
            orthogonal[key] = result[k]
    for i, (param, param_blocks) in enumerate(zip(params, blocks)):
        param.mul_(1 - lr * weight_decay)
        for b, block in enumerate(param_blocks):
            update = orthogonal[(i, b)]
            scale = adjusted_lr(lr, adjust_lr_fn, update.shape)
            offset = 0
            for start, stop in block:
                param[start:stop].add_(update[offset : offset + stop - start], alpha=-scale)
                offset += stop - start
    return sum(len(members) for members in by_shape.values())


def ns_flops(rows: int, cols: int, steps: int = NS_STEPS) -> int:
    """Multiply-add FLOPs of Newton–Schulz on one (rows, cols) matrix; the plan's cost."""
    small, large = min(rows, cols), max(rows, cols)
    # per step: X X^T (s*s*l), poly = b A + c A A (s^3), poly X (s*s*l); x2 for multiply-add
    return 2 * steps * (2 * small * small * large + small**3)
