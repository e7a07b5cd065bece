"""The Muon update as pure functions, pinned to ``torch.optim.Muon`` (torch 2.14): momentum, Newton–Schulz
by blocks, NorMuon, the learning-rate adjustment and the decoupled weight decay.

Nothing here communicates: the runtime decides *where* this runs. Two modes: ``"exact"`` runs every
matrix through ``torch.optim.Muon``'s own functional update (bitwise a single-process step on any
kernel); ``"batched"`` (the default) orthogonalises equally shaped matrices in one call, equal up to GEMM
rounding (``benchmarks/ns_deviation.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from titan_dmuon.math.exact_update import exact_step
from titan_dmuon.math.matrix_blocks import (
    Block,
    block_rows,
    matrix_at,
    tile_ranges,
    whole_columns,
)
from titan_dmuon.math.ns_methods import (
    NS_COEFFICIENTS,
    NS_EPS,
    NS_STEPS,
    Scratch,
    check_method,
    fresh,
    normalised,
    ns_input_scale,
    ns_torch_dtype,
    orthogonalise_wide_,
    scratch_like,
    stack_batches,
)
from titan_dmuon.math.update_rules import adjusted_lr, apply_normuon, scalar, second_moment_shape

NS_MODES = ("batched", "exact")


# How a Newton–Schulz batch is run: ``runner(orthogonalise_wide_, stack, kwargs)`` returns its result.
NSRunner = Callable[[Callable[..., torch.Tensor], torch.Tensor, dict], torch.Tensor]


def _call(fn: Callable[..., torch.Tensor], x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """The default ``NSRunner``: the call itself."""
    return fn(x, **kwargs)


def converted(tile: torch.Tensor, dtype: torch.dtype, scratch: Scratch) -> torch.Tensor:
    """``tile`` in ``dtype`` (itself where it has it), in a ``scratch`` buffer laid out as ``tile.to(dtype)``
    is (what ``add_`` would make of it): a dense matrix keeps its layout, a slice becomes contiguous."""
    if tile.dtype == dtype:
        return tile
    if tile.ndim == 2 and not tile.is_contiguous() and tile.mT.is_contiguous():
        return scratch_like(scratch, "converted", tile, dtype).copy_(tile)
    return scratch("converted", tuple(tile.shape), dtype, tile.device).copy_(tile)


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
    ns_method: str = "torch",
    col_blocks: Sequence[Sequence[Block] | None] | None = None,
    ns_dtype: str = "bfloat16",
    normuon_beta2: float | None = None,
    second_moments: Sequence[torch.Tensor] | None = None,
    scratch: Scratch = fresh,
    ns_runner: NSRunner | None = None,
) -> int:
    """Apply one Muon step in place; returns the number of matrices orthogonalised.

    A parameter is a ``(rows, cols)`` matrix or a stack ``(E, rows, cols)`` of
    E independent matrices (MoE experts). ``blocks[i]`` lists the row blocks of
    each of ``params[i]``'s matrices, ``col_blocks[i]`` its column blocks (None:
    whole columns), orthogonalised separately: every (row block, column block)
    pair of every matrix is one Newton–Schulz matrix, its learning rate scaled
    for its own shape (``adjusted_lr``), as if it were a separate weight.
    ``ns_mode="exact"`` runs each through ``torch.optim.Muon``'s functional
    update (bitwise torch.optim.Muon); ``"batched"`` lets blocks with the same
    shape up to transposition share one batched call, one shape group at a
    time, stacked straight into ``ns_dtype``, so at most one group's stack is
    alive at once, orthogonalised by ``ns_method``. ``normuon_beta2``: NorMuon
    (``normuon``) on each Newton–Schulz matrix's output, its second moment in
    ``second_moments[i]`` (``second_moment_shape``, updated in place); the exact
    mode applies it to torch.optim.Muon's own Newton–Schulz output.
    ``lr`` may be a 0-dim tensor, as torch.optim.Muon's (read as its value).
    The batched mode's temporaries (Nesterov input, stacks, Newton–Schulz, NorMuon) are ``scratch``'s;
    ``ns_runner(orthogonalise_wide_, stack, kwargs)`` runs each batch's Newton–Schulz (default: a call;
    ``optim/ns_graphs.py``: a CUDA graph's replay).
    """
    check_method(ns_method, ns_coefficients)
    dtype = ns_torch_dtype(ns_dtype)
    cols_of = [
        tuple(col_blocks[i]) if col_blocks is not None and col_blocks[i] else whole_columns(p.shape)
        for i, p in enumerate(params)
    ]
    if normuon_beta2 is not None:
        _check_second_moments(params, cols_of, second_moments)
    variant = dict(col_blocks=cols_of, normuon_beta2=normuon_beta2, second_moments=second_moments)
    if ns_mode == "exact":
        if ns_method != "torch":
            raise ValueError(
                f"ns_mode 'exact' is torch.optim.Muon's own update: ns_method must be 'torch', got {ns_method!r}"
            )
        if dtype is not torch.bfloat16:
            raise ValueError(
                f"ns_mode 'exact' is torch.optim.Muon's own update, in bf16: ns_dtype must be "
                f"'bfloat16', got {ns_dtype!r}"
            )
        return exact_step(
            params,
            grads,
            momentum_buffers,
            blocks,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_coefficients=ns_coefficients,
            eps=eps,
            adjust_lr_fn=adjust_lr_fn,
            **variant,
        )
    if ns_mode != "batched":
        raise ValueError(f"ns_mode must be one of {NS_MODES}, got {ns_mode!r}")
    if not params:
        return 0
    lr = scalar(lr)
    torch._foreach_lerp_(list(momentum_buffers), list(grads), 1 - momentum)
    groups: dict[
        tuple[int, int], list[tuple[int, int, int, int]]
    ] = {}  # (short, long) -> (param, matrix, block, column block)
    for i, (param, param_blocks) in enumerate(zip(params, blocks)):
        for e in range(param.shape[0] if param.ndim == 3 else 1):
            for b, block in enumerate(param_blocks):
                rows = block_rows(block)
                for c, col_block in enumerate(cols_of[i]):
                    cols = block_rows(col_block)
                    groups.setdefault((min(rows, cols), max(rows, cols)), []).append((i, e, b, c))
    torch._foreach_mul_(list(params), 1 - lr * weight_decay)
    for (short, long), group in groups.items():
        for batch in stack_batches(group, short, long, ns_method, ns_steps):
            _orthogonalise_batch(
                batch,
                short,
                long,
                params,
                grads,
                momentum_buffers,
                blocks,
                lr=lr,
                momentum=momentum,
                nesterov=nesterov,
                ns_steps=ns_steps,
                ns_coefficients=ns_coefficients,
                eps=eps,
                adjust_lr_fn=adjust_lr_fn,
                ns_method=ns_method,
                dtype=dtype,
                scratch=scratch,
                ns_runner=ns_runner or _call,
                **variant,
            )
    return sum(len(group) for group in groups.values())


def _check_second_moments(params, cols_of, second_moments) -> None:
    """NorMuon needs one second moment per parameter, shaped by ``second_moment_shape``."""
    if second_moments is None or len(second_moments) != len(params):
        raise ValueError("normuon_beta2 needs second_moments: one tensor per parameter (second_moment_shape)")
    for p, moment, cols in zip(params, second_moments, cols_of):
        expected = second_moment_shape(p.shape, cols)
        if tuple(moment.shape) != expected:
            raise ValueError(
                f"a NorMuon second moment of shape {tuple(moment.shape)} for a weight of shape "
                f"{tuple(p.shape)} with {len(cols)} column block(s): expected {expected}"
            )


def _orthogonalise_batch(
    members,
    short,
    long,
    params,
    grads,
    momentum_buffers,
    blocks,
    *,
    lr,
    momentum,
    nesterov,
    ns_steps,
    ns_coefficients,
    eps,
    adjust_lr_fn,
    ns_method,
    dtype,
    col_blocks,
    normuon_beta2,
    second_moments,
    scratch,
    ns_runner,
) -> None:
    """One batch of equally shaped blocks: Nesterov input, stack in the iteration dtype (float16:
    each block normalised in float32 first), Newton–Schulz, NorMuon, update; every temporary a
    ``scratch`` buffer (one block's fp32 input at a time)."""
    device = params[members[0][0]].device
    stack = scratch("ns_stack", (len(members), short, long), dtype, device)
    scale = ns_input_scale(ns_method)
    for k, (i, e, b, c) in enumerate(members):
        rows, cols = blocks[i][b], col_blocks[i][c]
        buffer = gather_tile(matrix_at(momentum_buffers[i], e), rows, cols, scratch, "momentum_tile")
        update = buffer
        if nesterov:
            grad = gather_tile(matrix_at(grads[i], e), rows, cols, scratch, "grad_tile")
            update = torch.lerp(grad, buffer, momentum, out=scratch("nesterov", tuple(grad.shape), grad.dtype, device))
        wide = update.mT if update.shape[0] > update.shape[1] else update
        if dtype is torch.bfloat16:
            stack[k].copy_(wide)
        else:
            stack[k].copy_(
                normalised(wide, eps, scale, out=scratch("normalised", tuple(wide.shape), torch.float32, device))
            )
    orthogonal = ns_runner(
        orthogonalise_wide_,
        stack,
        dict(
            ns_method=ns_method,
            steps=ns_steps,
            coefficients=tuple(ns_coefficients),
            eps=eps,
            normalise=dtype is torch.bfloat16,
            scratch=scratch,
        ),
    )
    for k, (i, e, b, c) in enumerate(members):
        param, block, col_block = matrix_at(params[i], e), blocks[i][b], col_blocks[i][c]
        rows, cols = block_rows(block), block_rows(col_block)
        update = orthogonal[k].mT if rows > cols else orthogonal[k]
        if normuon_beta2 is not None:
            update = apply_normuon(update, second_moments[i], e, block, c, normuon_beta2, scratch=scratch)
        step = adjusted_lr(lr, adjust_lr_fn, (rows, cols))
        for matrix_rows, matrix_cols, tile_rows, tile_cols in tile_ranges(block, col_block):
            param[matrix_rows, matrix_cols].add_(
                converted(update[tile_rows, tile_cols], param.dtype, scratch), alpha=-step
            )


def gather_tile(matrix: torch.Tensor, rows: Block, cols: Block, scratch: Scratch, name: str) -> torch.Tensor:
    """``take_tile`` with its copies in ``scratch`` buffers, laid out as ``take_tile``'s (its rows gathered
    first, then its columns; one range of either stays a view), so elementwise kernels see the same strides."""
    taken = matrix[rows[0][0] : rows[0][1]]
    if len(rows) > 1:
        taken = scratch(f"{name}_rows", (block_rows(rows), matrix.shape[-1]), matrix.dtype, matrix.device)
        put_rows_from(taken, matrix, rows)
    if len(cols) == 1:
        return taken if cols[0] == (0, matrix.shape[-1]) else taken[:, cols[0][0] : cols[0][1]]
    out = scratch(name, (taken.shape[0], block_rows(cols)), matrix.dtype, matrix.device)
    put_rows_from(out.T, taken.T, cols)
    return out


def put_rows_from(out: torch.Tensor, matrix: torch.Tensor, block: Block) -> None:
    """``take_rows(matrix, block)`` copied into ``out``."""
    offset = 0
    for start, stop in block:
        out[offset : offset + stop - start].copy_(matrix[start:stop])
        offset += stop - start


def orthogonalise(
    matrices: Sequence[torch.Tensor],
    *,
    ns_mode: str = "batched",
    steps: int = NS_STEPS,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
    ns_method: str = "torch",
    ns_dtype: str = "bfloat16",
    scratch: Scratch = fresh,
    consume: Callable[[int, torch.Tensor], None] | None = None,
    ns_runner: NSRunner | None = None,
) -> list[torch.Tensor] | None:
    """Newton–Schulz of whole 2-D matrices (e.g. assembled from tensor-parallel shards), in ``ns_dtype``.

    ``"exact"``: each through ``torch.optim.Muon``'s own Newton–Schulz, which casts its input to bf16
    first, so a matrix given as the bf16 of Muon's input gets bitwise Muon's result. ``"batched"``:
    equally shaped matrices (up to transposition) share batched calls, by ``ns_method`` (float16: each
    normalised in float32 before it is rounded), their temporaries ``scratch``'s. The inputs may be
    overwritten. With ``consume``, each result goes to ``consume(i, result)`` once its batch is done
    (a ``scratch`` buffer until the next batch) and nothing is returned. ``ns_runner``: as ``muon_step``'s."""
    check_method(ns_method, coefficients)
    dtype = ns_torch_dtype(ns_dtype)
    out: list[torch.Tensor | None] = [None] * len(matrices)

    def done(i: int, result: torch.Tensor) -> None:
        if consume is None:  # (kept past the next batch: a kept ``scratch`` buffer would be overwritten)
            out[i] = result if scratch is fresh else result.clone()
        else:
            consume(i, result)

    if ns_mode == "exact":
        if ns_method != "torch" or dtype is not torch.bfloat16:
            raise ValueError(
                f"ns_mode 'exact' is torch.optim.Muon's own update: ns_method must be 'torch' and "
                f"ns_dtype 'bfloat16', got {ns_method!r}, {ns_dtype!r}"
            )
        from torch.optim._muon import _zeropower_via_newtonschulz

        for i, m in enumerate(matrices):
            done(i, _zeropower_via_newtonschulz(m, tuple(coefficients), steps, eps))
        return out if consume is None else None
    if ns_mode != "batched":
        raise ValueError(f"ns_mode must be one of {NS_MODES}, got {ns_mode!r}")
    groups: dict[tuple[int, int], list[int]] = {}
    for i, m in enumerate(matrices):
        groups.setdefault((min(m.shape), max(m.shape)), []).append(i)
    scale = ns_input_scale(ns_method)
    for (short, long), group in groups.items():
        for chosen in stack_batches(group, short, long, ns_method, steps):
            wide = [matrices[i].mT if matrices[i].shape[0] > matrices[i].shape[1] else matrices[i] for i in chosen]
            stack = scratch("ns_stack", (len(chosen), short, long), dtype, wide[0].device)
            for k, matrix in enumerate(wide):
                stack[k].copy_(
                    matrix
                    if dtype is torch.bfloat16
                    else normalised(
                        matrix, eps, scale, out=scratch("normalised", (short, long), torch.float32, matrix.device)
                    )
                )
            result = (ns_runner or _call)(
                orthogonalise_wide_,
                stack,
                dict(
                    ns_method=ns_method,
                    steps=steps,
                    coefficients=tuple(coefficients),
                    eps=eps,
                    normalise=dtype is torch.bfloat16,
                    scratch=scratch,
                ),
            )
            for k, i in enumerate(chosen):
                done(i, result[k].mT if matrices[i].shape[0] > matrices[i].shape[1] else result[k])
    return out if consume is None else None
