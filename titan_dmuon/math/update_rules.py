"""The pieces of the Muon update every path shares: the learning-rate adjustment by shape, momentum, NorMuon's
rule and its second moment's shape, and which settings the exact mode refuses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from titan_dmuon.math.matrix_blocks import (
    Block,
    matrix_at,
    put_rows,
    take_rows,
)
from titan_dmuon.math.ns_methods import (
    Scratch,
    fresh,
    scratch_like,
)

ADJUST_LR_FNS = (None, "original", "match_rms_adamw", "spectral_unclamped")


# NorMuon (Li et al., "NorMuon: Making Muon more efficient and scalable", arXiv 2510.05491, Algorithm 1):
# Ô = O / (sqrt(v) + eps) row by row.
NORMUON_EPS = 1e-8


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


def exact_mode_refusal(adjust_lr_fn: str | None) -> str | None:
    """Why ``ns_mode="exact"`` cannot run ``adjust_lr_fn`` on this torch, or None. The exact mode is
    ``torch.optim.Muon``'s own update, whose learning-rate rule must be ``adjusted_lr``'s:
    "spectral_unclamped" came in torch 2.14, and torch 2.11-2.13's functional update silently
    scales by 1 for a name it does not know (checked by behaviour, not by version)."""
    from torch.optim._muon import _adjust_lr

    if _adjust_lr(1.0, adjust_lr_fn, torch.Size((4, 1))) == adjusted_lr(1.0, adjust_lr_fn, (4, 1)):
        return None
    return (
        f"one that torch {torch.__version__}'s torch.optim.Muon knows with ns_mode 'exact' "
        f"({adjust_lr_fn!r} needs torch >= 2.14), or ns_mode 'batched'"
    )


def momentum_update(
    grad: torch.Tensor, momentum_buffer: torch.Tensor, *, momentum: float, nesterov: bool
) -> torch.Tensor:
    """Advance the momentum buffer in place and return the matrix to orthogonalise."""
    momentum_buffer.lerp_(grad, 1 - momentum)
    return grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer


def second_moment_shape(shape: Sequence[int], col_blocks: Sequence[Block] | None = None) -> tuple[int, ...]:
    """NorMuon's second moment of a weight of ``shape`` (a matrix or a stack of experts): one value per
    row of each Newton–Schulz matrix, i.e. per row and column block (``(..., rows, column blocks)``)."""
    return (*shape[:-1], len(col_blocks) if col_blocks else 1)


def normuon(
    orthogonal: torch.Tensor,
    second_moment: torch.Tensor,
    beta2: float,
    eps: float = NORMUON_EPS,
    *,
    scratch: Scratch = fresh,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NorMuon's rule on an orthogonalised update O ``(..., rows, cols)`` and its second moment v
    ``(..., rows)``: ``v' = beta2 v + (1 - beta2) mean_cols(O²)``; ``Ô = O / (sqrt(v') + eps)`` row by
    row, rescaled to O's Frobenius norm (a zero O gives a zero Ô). Returns (Ô, v'), in float32; the
    caller keeps v'. Over whole rows of the matrix Newton–Schulz orthogonalised, never a shard's part of
    one (which is what makes it exact: dion computes it per local shard). Its O-sized temporaries are
    ``scratch``'s (Ô is one of them)."""
    o = scratch_like(scratch, "normuon_o", orthogonal).copy_(orthogonal)
    squares = torch.mul(o, o, out=scratch_like(scratch, "normuon_squares", o))
    moment = beta2 * second_moment.float() + (1 - beta2) * squares.mean(-1)
    scaled = torch.div(o, (moment.sqrt() + eps).unsqueeze(-1), out=squares)
    ratio = torch.linalg.vector_norm(o, dim=(-2, -1), keepdim=True) / torch.linalg.vector_norm(
        scaled, dim=(-2, -1), keepdim=True
    ).clamp(min=torch.finfo(torch.float32).tiny)
    return scaled.mul_(ratio), moment


def apply_normuon(
    update: torch.Tensor,
    second_moment: torch.Tensor,
    e: int,
    rows: Block,
    c: int,
    beta2: float,
    *,
    scratch: Scratch = fresh,
) -> torch.Tensor:
    """NorMuon on one Newton–Schulz matrix's output: its rows' second moments (matrix ``e``, column
    block ``c`` of ``second_moment``) read, advanced and written back; returns Ô (a ``scratch`` buffer)."""
    column = matrix_at(second_moment, e)[:, c]
    update, moment = normuon(update, take_rows(column, rows), beta2, scratch=scratch)
    put_rows(column, rows, moment)
    return update


def scalar(value):
    """A hyperparameter as a Python number (a 0-dim tensor's value)."""
    return value.item() if isinstance(value, torch.Tensor) else value


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
