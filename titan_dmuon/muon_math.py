"""The Muon update as pure functions, pinned to ``torch.optim.Muon`` (torch 2.14).

Nothing here communicates. The runtime decides *where* these run (on the one
owner of each matrix); this module decides *what* they compute. Two modes:

* ``"exact"``: every matrix (every row block of a fused weight, every expert)
  goes through ``torch.optim.Muon``'s own functional update, one 2-D matrix at
  a time, so a DMuon step is bitwise a single-process ``torch.optim.Muon`` step
  on the same gradient, on any CPU or GPU kernel.
* ``"batched"`` (the default): equally shaped matrices are orthogonalised in
  one batched call. The same arithmetic, but a batched GEMM may round
  differently from the per-matrix one (oneDNN and cuBLAS pick kernels by batch
  size and shape): equal to ``torch.optim.Muon`` up to GEMM rounding, a few
  bf16 ulps of the Newton–Schulz output (``benchmarks/ns_deviation.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
NS_STEPS = 5
ADJUST_LR_FNS = (None, "original", "match_rms_adamw", "spectral_unclamped")
NS_MODES = ("batched", "exact")
# Newton–Schulz batches stack at most this many bf16 bytes (the iteration needs ~3 such stacks of
# workspace): big matrices go a few at a time, small ones all at once. The batch size changes the
# result only through GEMM rounding (a kernel may pick another algorithm for another batch size).
MAX_STACK_BYTES = 32 * 2**20


def newton_schulz(
    matrices: torch.Tensor,
    *,
    steps: int = NS_STEPS,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
) -> torch.Tensor:
    """Quintic Newton–Schulz orthogonalisation of a batch ``(B, rows, cols)``.

    Runs in bf16 like ``torch.optim.Muon``; one batched call per shape instead
    of one call per matrix: the same operations, rounded as the batched GEMM
    kernel rounds them (not always bitwise the per-matrix call).
    """
    if matrices.ndim != 3:
        raise ValueError(f"newton_schulz expects (batch, rows, cols), got {tuple(matrices.shape)}")
    x = matrices.bfloat16()
    transposed = x.size(-2) > x.size(-1)
    if transposed:
        x = x.mT
    x = _newton_schulz_wide_(x.clone() if x is matrices or x._base is matrices else x, steps, coefficients, eps)
    return x.mT if transposed else x


def _newton_schulz_wide_(x: torch.Tensor, steps: int, coefficients: tuple[float, float, float], eps: float) -> torch.Tensor:
    """Newton–Schulz on a bf16 batch with rows <= cols; normalises ``x`` in place (as torch.optim.Muon)."""
    a, b, c = coefficients
    norms = torch.linalg.vector_norm(x.flatten(1), dim=1).clamp(min=eps)
    x.div_(norms[:, None, None])
    for _ in range(steps):
        gram = x @ x.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x


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
    return (f"one that torch {torch.__version__}'s torch.optim.Muon knows with ns_mode 'exact' "
            f"({adjust_lr_fn!r} needs torch >= 2.14), or ns_mode 'batched'")


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
    ns_mode: str = "batched",
) -> int:
    """Apply one Muon step in place; returns the number of matrices orthogonalised.

    A parameter is a ``(rows, cols)`` matrix or a stack ``(E, rows, cols)`` of
    E independent matrices (MoE experts). ``blocks[i]`` lists the row blocks of
    each of ``params[i]``'s matrices, orthogonalised separately. Every block
    of every matrix is one Newton–Schulz matrix. ``ns_mode="exact"`` runs each
    through ``torch.optim.Muon``'s functional update (bitwise torch.optim.Muon);
    ``"batched"`` lets blocks with the same shape up to transposition share one
    batched call, one shape group at a time, stacked straight into bf16, so at
    most one group's stack is alive at once.
    """
    if ns_mode == "exact":
        return _exact_step(
            params, grads, momentum_buffers, blocks, lr=lr, weight_decay=weight_decay, momentum=momentum,
            nesterov=nesterov, ns_steps=ns_steps, ns_coefficients=ns_coefficients, eps=eps, adjust_lr_fn=adjust_lr_fn,
        )
    if ns_mode != "batched":
        raise ValueError(f"ns_mode must be one of {NS_MODES}, got {ns_mode!r}")
    if not params:
        return 0
    torch._foreach_lerp_(list(momentum_buffers), list(grads), 1 - momentum)
    groups: dict[tuple[int, int], list[tuple[int, int, int]]] = {}  # (short, long) -> (param, matrix, block)
    for i, (param, param_blocks) in enumerate(zip(params, blocks)):
        cols = param.shape[-1]
        for e in range(param.shape[0] if param.ndim == 3 else 1):
            for b, block in enumerate(param_blocks):
                rows = block_rows(block)
                groups.setdefault((min(rows, cols), max(rows, cols)), []).append((i, e, b))
    torch._foreach_mul_(list(params), 1 - lr * weight_decay)
    for (short, long), group in groups.items():
        for batch in _stack_batches(group, short, long):
            _orthogonalise_batch(
                batch, short, long, params, grads, momentum_buffers, blocks,
                lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, ns_coefficients=ns_coefficients,
                eps=eps, adjust_lr_fn=adjust_lr_fn,
            )
    return sum(len(group) for group in groups.values())


def _stack_batches(items: list, short: int, long: int) -> list[list]:
    """``items`` (equally shaped (short, long) matrices) in batches whose bf16 stack is at most
    MAX_STACK_BYTES (Newton–Schulz needs ~3 such stacks of workspace)."""
    per_batch = max(1, MAX_STACK_BYTES // (short * long * 2))
    return [items[first : first + per_batch] for first in range(0, len(items), per_batch)]


def _exact_step(params, grads, momentum_buffers, blocks, *, lr, weight_decay, momentum, nesterov, ns_steps,
                ns_coefficients, eps, adjust_lr_fn) -> int:
    """torch.optim.Muon's own functional update, one 2-D matrix at a time.

    A row block that is one contiguous range of rows is a view of the weight
    (contiguous, like a separate weight); an interleaved block (TorchTitan's
    fused wqkv) is gathered into a contiguous matrix and written back. Either
    way ``torch.optim._muon.muon`` sees exactly the 2-D weight, gradient and
    momentum a model with separate weights would give it."""
    from torch.optim._muon import muon as torch_muon

    refusal = exact_mode_refusal(adjust_lr_fn)
    if refusal is not None:
        raise ValueError(f"adjust_lr_fn = {adjust_lr_fn!r}: expected {refusal}")
    count = 0
    for param, grad, buffer, param_blocks in zip(params, grads, momentum_buffers, blocks):
        for e in range(param.shape[0] if param.ndim == 3 else 1):
            matrices = (_matrix(param, e), _matrix(grad, e), _matrix(buffer, e))
            for block in param_blocks:
                weight, gradient, momentum_buffer = (_contiguous_rows(m, block) for m in matrices)
                torch_muon(
                    [weight], [gradient], [momentum_buffer], lr=lr, weight_decay=weight_decay, momentum=momentum,
                    nesterov=nesterov, ns_coefficients=tuple(ns_coefficients), ns_steps=ns_steps, eps=eps,
                    adjust_lr_fn=adjust_lr_fn, has_complex=False,
                )
                for target, updated in ((matrices[0], weight), (matrices[2], momentum_buffer)):
                    if not _shares_memory(target, updated):
                        _put_rows(target, block, updated)
                count += 1
    return count


def _contiguous_rows(matrix: torch.Tensor, block: Block) -> torch.Tensor:
    """The block's rows as one contiguous matrix: a view where they are contiguous, else a copy."""
    rows = _take_rows(matrix, block)
    return rows if rows.is_contiguous() else rows.contiguous()


def _put_rows(matrix: torch.Tensor, block: Block, rows: torch.Tensor) -> None:
    offset = 0
    for start, stop in block:
        matrix[start:stop].copy_(rows[offset : offset + stop - start])
        offset += stop - start


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _orthogonalise_batch(
    members, short, long, params, grads, momentum_buffers, blocks, *, lr, momentum, nesterov, ns_steps,
    ns_coefficients, eps, adjust_lr_fn,
) -> None:
    """One batch of equally shaped blocks: Nesterov input, bf16 stack, Newton–Schulz, update."""
    stack = torch.empty((len(members), short, long), dtype=torch.bfloat16, device=params[members[0][0]].device)
    for k, (i, e, b) in enumerate(members):
        grad = _take_rows(_matrix(grads[i], e), blocks[i][b])
        buffer = _take_rows(_matrix(momentum_buffers[i], e), blocks[i][b])
        update = grad.lerp(buffer, momentum) if nesterov else buffer  # one block's fp32 temporary at a time
        stack[k].copy_(update.mT if update.shape[0] > update.shape[1] else update)
    orthogonal = _newton_schulz_wide_(stack, ns_steps, ns_coefficients, eps)
    del stack
    for k, (i, e, b) in enumerate(members):
        param, block = _matrix(params[i], e), blocks[i][b]
        rows = block_rows(block)
        update = orthogonal[k].mT if rows > param.shape[1] else orthogonal[k]
        scale = adjusted_lr(lr, adjust_lr_fn, (rows, param.shape[1]))
        offset = 0
        for start, stop in block:
            param[start:stop].add_(update[offset : offset + stop - start], alpha=-scale)
            offset += stop - start


def _matrix(tensor: torch.Tensor, index: int) -> torch.Tensor:
    return tensor[index] if tensor.ndim == 3 else tensor


def ns_flops(rows: int, cols: int, steps: int = NS_STEPS) -> int:
    """Multiply-add FLOPs of Newton–Schulz on one (rows, cols) matrix; the plan's cost."""
    small, large = min(rows, cols), max(rows, cols)
    # per step: X X^T (s*s*l), poly = b A + c A A (s^3), poly X (s*s*l); x2 for multiply-add
    return 2 * steps * (2 * small * small * large + small**3)


def orthogonalise(
    matrices: Sequence[torch.Tensor],
    *,
    ns_mode: str = "batched",
    steps: int = NS_STEPS,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
) -> list[torch.Tensor]:
    """Newton–Schulz of whole bf16 2-D matrices (e.g. assembled from tensor-parallel shards), in bf16.

    ``"exact"``: each through ``torch.optim.Muon``'s own Newton–Schulz, which casts its input to bf16
    first, so a matrix given as the bf16 of Muon's input gets bitwise Muon's result. ``"batched"``:
    equally shaped matrices (up to transposition) share batched calls. The inputs may be overwritten."""
    if ns_mode == "exact":
        from torch.optim._muon import _zeropower_via_newtonschulz

        return [_zeropower_via_newtonschulz(m, tuple(coefficients), steps, eps) for m in matrices]
    if ns_mode != "batched":
        raise ValueError(f"ns_mode must be one of {NS_MODES}, got {ns_mode!r}")
    out: list[torch.Tensor | None] = [None] * len(matrices)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, m in enumerate(matrices):
        groups.setdefault((min(m.shape), max(m.shape)), []).append(i)
    for (short, long), group in groups.items():
        for chosen in _stack_batches(group, short, long):
            stack = torch.stack([matrices[i].mT if matrices[i].shape[0] > matrices[i].shape[1] else matrices[i]
                                 for i in chosen]).bfloat16()
            result = _newton_schulz_wide_(stack, steps, coefficients, eps)
            for k, i in enumerate(chosen):
                out[i] = result[k].mT if matrices[i].shape[0] > matrices[i].shape[1] else result[k]
    return out


def local_block_rows(block: Block, *, tp_dim: int | None, tp_rank: int, local_rows: int) -> list[tuple[int, int, int]]:
    """A full-matrix row block as seen by one tensor-parallel shard: ``(local_start, local_stop,
    offset)`` ranges of the shard's rows, ``offset`` being where they sit in the block's rows. A
    column-wise shard (``tp_dim`` 0) holds rows ``[tp_rank * local_rows, (tp_rank + 1) * local_rows)``
    of the full matrix; a row-wise one (``tp_dim`` 1) and a replicated matrix (None) every row."""
    if tp_dim is None or tp_dim == 1:
        out, offset = [], 0
        for start, stop in block:
            out.append((start, stop, offset))
            offset += stop - start
        return out
    first, last = tp_rank * local_rows, (tp_rank + 1) * local_rows
    out, offset = [], 0
    for start, stop in block:
        lo, hi = max(start, first), min(stop, last)
        if lo < hi:
            out.append((lo - first, hi - first, offset + lo - start))
        offset += stop - start
    return out
