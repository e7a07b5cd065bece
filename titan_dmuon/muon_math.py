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

Three Newton–Schulz methods (``ns_method``; the exact mode runs only the first):

* ``"torch"`` (the default): ``torch.optim.Muon``'s quintic, one coefficient triple for every step.
* ``"polar_express"``: the Polar Express schedule (a minimax-optimal polynomial per step,
  ``polar_express_schedule``), with its safety scaling; the same iteration as "torch" otherwise.
* ``"gram"``: the same polynomials as "polar_express", computed by Gram Newton–Schulz (the
  iteration carried on the small Gram matrix X Xᵀ, restarted before every odd step,
  its symmetric products computed by blocks) on the matrices where that takes fewer FLOPs
  (``uses_gram``), by the "polar_express" iteration on the others.

Every method keeps ``torch.optim.Muon``'s conventions: bf16, the input divided by its Frobenius
norm (clamped at ``eps``: a zero matrix gives a zero update), a tall matrix orthogonalised as its
transpose. ``ns_dtype="float16"`` iterates in float16 instead (10 mantissa bits to bf16's 7, for
values bounded by 1), the input normalised in float32 first (its range is float32's, float16's is not).

Two variants an owner of the whole matrix computes exactly (``normuon``: NorMuon's per-row second
moment, over whole rows; blocks of rows and of columns, ``row_blocks``/``column_blocks``: per-head
Newton–Schulz).
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
NS_METHODS = ("torch", "polar_express", "gram")
# The Newton–Schulz iteration's dtype: torch.optim.Muon's bf16, or float16 (the original DMuon's default,
# Step 3.5 Flash's): both 2 bytes; float16 has 3 more mantissa bits and a range of 6e-5 to 65504, which
# the iteration's values (bounded by the polynomials' coefficients once the input is normalised) keep.
NS_DTYPES = ("bfloat16", "float16")
# NorMuon (Li et al., "NorMuon: Making Muon more efficient and scalable", arXiv 2510.05491, Algorithm 1):
# Ô = O / (sqrt(v) + eps) row by row.
NORMUON_EPS = 1e-8
# Polar Express (Amsel, Persson, Musco, Gower, "The Polar Express: Optimal Matrix Sign Methods and Their
# Application to the Muon Algorithm", arXiv 2505.16932, Algorithm 1): the degree-5 odd polynomials
# a x + b x^3 + c x^5 whose composition is the minimax approximation of sign(x) on [1e-3, 1] (the paper's
# lower bound for bf16 inputs, its Section 4.3), one per step. The last is the limit the list reaches,
# (15, -10, 3) / 8: steps beyond the list repeat it, as the paper's code does.
POLAR_EXPRESS_COEFFICIENTS = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
# The paper's safety factor for bf16 (its Section 4.4 and Algorithm 1): every polynomial but the list's
# last becomes p(x / 1.01), so a singular value that round-off pushed slightly above the interval cannot
# grow step after step, and the input is divided by 1.01 times its Frobenius norm.
POLAR_EXPRESS_SAFETY = 1.01
# Gram Newton–Schulz (Zhang, Amsel, Chen, Dao, Dao-AILab/gram-newton-schulz, 2026) restarts its Gram
# iteration (X <- Q X, R <- X Xᵀ, Q <- I) to stay stable in half precision; its default, one restart before
# step 2 of 5 (counting from 0), is tuned for float16. In bf16 (3 mantissa bits fewer) that left singular
# values up to 2 on ill-conditioned and low-rank inputs (benchmarks/ns_accuracy.py, the "restarts" rows);
# restarts before every odd step (``gram_restarts``: segments [0], [1, 2], [3, 4], ...; a segment's product
# of polynomials is rounded to bf16 relative to its largest entries, and the first polynomial alone spans a
# factor ~8 between singular values) keep them within a few bf16 ulps of the polynomials' band, closer
# than restarts before steps 2 and 4, which cost the same FLOPs.
# A symmetric product (X Xᵀ, or two polynomials in the same Gram matrix) computes its upper-left,
# upper-right and lower-right blocks, the first and last recursively, while the blocks keep at least this
# many rows: 3/4 of the GEMM FLOPs at one level, 5/8 at two; small matrices keep one GEMM.
SYMMETRIC_MIN_BLOCK = 512
SYMMETRIC_MAX_LEVELS = 2
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
    ns_method: str = "torch",
    ns_dtype: str = "bfloat16",
) -> torch.Tensor:
    """Newton–Schulz orthogonalisation of a batch ``(B, rows, cols)`` by ``ns_method``, in ``ns_dtype``.

    Runs in bf16 like ``torch.optim.Muon`` (or in float16, normalised in float32 first); one batched
    call per shape instead of one call per matrix: the same operations, rounded as the batched GEMM
    kernel rounds them (not always bitwise the per-matrix call).
    """
    if matrices.ndim != 3:
        raise ValueError(f"newton_schulz expects (batch, rows, cols), got {tuple(matrices.shape)}")
    check_method(ns_method, coefficients)
    dtype = ns_torch_dtype(ns_dtype)
    transposed = matrices.size(-2) > matrices.size(-1)
    if dtype is not torch.bfloat16:
        x = normalised(matrices.mT if transposed else matrices, eps, ns_input_scale(ns_method)).to(dtype)
        x = _orthogonalise_wide_(x, ns_method=ns_method, steps=steps, coefficients=coefficients, eps=eps,
                                 normalise=False)
        return x.mT if transposed else x
    x = matrices.bfloat16()
    if transposed:
        x = x.mT
    x = x.clone() if x is matrices or x._base is matrices else x
    x = _orthogonalise_wide_(x, ns_method=ns_method, steps=steps, coefficients=coefficients, eps=eps)
    return x.mT if transposed else x


def ns_torch_dtype(ns_dtype: str) -> torch.dtype:
    """The torch dtype of an ``ns_dtype`` name (``NS_DTYPES``); ValueError for another."""
    if ns_dtype not in NS_DTYPES:
        raise ValueError(f"ns_dtype must be one of {NS_DTYPES}, got {ns_dtype!r}")
    return getattr(torch, ns_dtype)


def normalised(matrices: torch.Tensor, eps: float = NS_EPS, scale: float = 1.0) -> torch.Tensor:
    """Each matrix of ``(..., rows, cols)`` divided by ``scale`` times its Frobenius norm, clamped at
    ``eps`` (zero stays zero), in float32: what a float16 iteration starts from, normalised before it
    is rounded to float16 (a momentum's entries may lie far below float16's smallest normal number, 6e-5,
    or above its largest, 65504; float32 holds both, and after the division every entry is at most 1)."""
    x = matrices.float()
    norms = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    if scale != 1.0:
        norms = norms * scale
    return x / norms.clamp(min=eps)


def check_method(ns_method: str, coefficients=NS_COEFFICIENTS) -> None:
    """ValueError unless ``ns_method`` is known and ``coefficients`` (torch's own) fit it."""
    if ns_method not in NS_METHODS:
        raise ValueError(f"ns_method must be one of {NS_METHODS}, got {ns_method!r}")
    if ns_method != "torch" and tuple(coefficients) != NS_COEFFICIENTS:
        raise ValueError(f"ns_coefficients {tuple(coefficients)} apply to ns_method 'torch' only; "
                         f"{ns_method!r} has its own per-step schedule")


def polar_express_schedule(steps: int) -> tuple[tuple[float, float, float], ...]:
    """The (a, b, c) of each of ``steps`` Polar Express steps, safety-scaled as the paper's Algorithm 1
    (all but the list's last polynomial: p(x / s) = a/s x + b/s^3 x^3 + c/s^5 x^5); steps beyond the
    list repeat its last polynomial."""
    s = POLAR_EXPRESS_SAFETY
    scaled = [(a / s, b / s**3, c / s**5) for a, b, c in POLAR_EXPRESS_COEFFICIENTS[:-1]]
    scaled.append(POLAR_EXPRESS_COEFFICIENTS[-1])
    return tuple(scaled[:steps]) + (scaled[-1],) * max(0, steps - len(scaled))


def ns_schedule(ns_method: str, steps: int = NS_STEPS, coefficients=NS_COEFFICIENTS) -> tuple[tuple[float, ...], ...]:
    """The polynomial (a, b, c) of each step of ``ns_method`` ("torch": ``coefficients`` every step)."""
    check_method(ns_method, coefficients)
    return (tuple(coefficients),) * steps if ns_method == "torch" else polar_express_schedule(steps)


def ns_input_scale(ns_method: str) -> float:
    """What the input's Frobenius norm is multiplied by before dividing by it (Polar Express: its safety)."""
    return 1.0 if ns_method == "torch" else POLAR_EXPRESS_SAFETY


def _orthogonalise_wide_(x: torch.Tensor, *, ns_method: str, steps: int, coefficients, eps: float,
                         normalise: bool = True) -> torch.Tensor:
    """``ns_method`` on a batch with rows <= cols in its iteration dtype: bf16, which it normalises in
    place ("torch": as torch.optim.Muon, ``coefficients`` every step and no input scale), or, with
    ``normalise=False``, already normalised (``normalised``: float16 inputs)."""
    schedule = ns_schedule(ns_method, steps, coefficients)
    if normalise:
        _normalise_(x, eps, ns_input_scale(ns_method))
    if ns_method == "gram" and uses_gram(x.size(-2), x.size(-1), steps):
        return _gram_newton_schulz(x, schedule)
    return _iterate(x, schedule)


def _normalise_(x: torch.Tensor, eps: float, scale: float = 1.0) -> None:
    """Each matrix divided by ``scale`` times its Frobenius norm, clamped at ``eps`` (zero stays zero)."""
    norms = torch.linalg.vector_norm(x.flatten(1), dim=1)
    if scale != 1.0:
        norms = norms * scale
    x.div_(norms.clamp(min=eps)[:, None, None])


def _iterate(x: torch.Tensor, schedule) -> torch.Tensor:
    """X <- a X + (b A + c A^2) X with A = X Xᵀ, one (a, b, c) per step."""
    for a, b, c in schedule:
        gram = x @ x.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x


def _gram_newton_schulz(x: torch.Tensor, schedule, restarts: Sequence[int] | None = None) -> torch.Tensor:
    """The ``schedule``'s polynomials on a normalised bf16 batch with rows <= cols, by Gram Newton–Schulz.

    A step of ``_iterate`` is X <- P X with P = a I + Z, Z = b R + c R², R = X Xᵀ. Between restarts
    every P and R is a polynomial in the same Gram matrix, so they commute and each product of two of
    them is symmetric: the iteration keeps Q (the product of the segment's P: a Q + Q Z) and
    R <- P R P (a RZ + Z RZ with RZ = a R + R Z), all rows x rows, as the Gram Newton–Schulz authors
    write it (P itself is never rounded to bf16 but at a segment's start), and forms Q X only at a
    restart (then R = X Xᵀ afresh; before the steps ``restarts``, default ``gram_restarts``) and at the
    end. FLOPs: ``gram_flops``. Matrices large enough for blocked symmetric products go one at a time,
    as 2-D GEMMs (a batched GEMM copies the blocks it is given; such batches hold a few matrices)."""
    restarts = set(gram_restarts(len(schedule)) if restarts is None else restarts)
    levels = symmetric_levels(x.size(-2))
    if levels > 0 and x.ndim == 3:
        out = torch.empty_like(x)
        for i in range(x.size(0)):
            out[i] = _gram_newton_schulz(x[i], schedule, restarts)
        return out
    return gram_segments(x, schedule, restarts, gram_of=lambda y: _symmetric_matmul(y, y.mT, levels),
                         symmetric=lambda a, b, **kw: _symmetric_matmul(a, b, levels, **kw))


def gram_segments(x: torch.Tensor, schedule, restarts, *, gram_of, symmetric) -> torch.Tensor:
    """Gram Newton–Schulz's short-space loop (``_gram_newton_schulz``'s notes): R = ``gram_of(X)`` at the
    start and at each restart, Q and R updated by ``symmetric(a, b, add=, beta=, alpha=)`` (beta add +
    alpha a @ b, known symmetric), Q X at each restart and at the end. An owner group passes its summed
    Gram matrix (``group_math``): the rest of the loop is the same on one owner and on a member."""
    gram = gram_of(x)
    product = None  # Q
    for step, (a, b, c) in enumerate(schedule):
        if step in restarts:
            x = product @ x
            gram = gram_of(x)
            product = None
        z = symmetric(gram, gram, add=gram, beta=b, alpha=c)
        if product is None:
            product = z.clone()
            product.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            product = symmetric(product, z, add=product, beta=a)
        if step + 1 < len(schedule) and step + 1 not in restarts:
            rz = symmetric(gram, z, add=gram, beta=a)
            gram = symmetric(z, rz, add=rz, beta=a)
    return product @ x


def gram_restarts(steps: int) -> tuple[int, ...]:
    """The steps (counting from 0) Gram Newton–Schulz restarts before: every odd one."""
    return tuple(range(1, steps, 2))


def symmetric_levels(rows: int) -> int:
    """How many times a (rows x rows) symmetric product is split into 2 x 2 blocks."""
    levels = 0
    while levels < SYMMETRIC_MAX_LEVELS and rows >> (levels + 1) >= SYMMETRIC_MIN_BLOCK:
        levels += 1
    return levels


def _symmetric_matmul(a: torch.Tensor, b: torch.Tensor, levels: int, *, add: torch.Tensor | None = None,
                      beta: float = 1.0, alpha: float = 1.0) -> torch.Tensor:
    """``beta * add + alpha * a @ b`` (accumulated as one ``addmm``/``baddbmm``) for a result known to be
    symmetric: split ``levels`` times (2-D matrices only), its upper-left and lower-right blocks
    (symmetric too: recursively) and its upper-right one; the lower-left is that one's transpose."""
    if levels == 0:
        if add is None:
            return a @ b if alpha == 1.0 else (a @ b).mul_(alpha)
        return (torch.baddbmm if a.ndim == 3 else torch.addmm)(add, a, b, beta=beta, alpha=alpha)
    half = a.size(0) // 2
    top, low = slice(None, half), slice(half, None)

    def block(rows: slice, cols: slice):
        return None if add is None else add[rows, cols]

    upper_left = _symmetric_matmul(a[top], b[:, top], levels - 1, add=block(top, top), beta=beta, alpha=alpha)
    upper_right = _symmetric_matmul(a[top], b[:, low], 0, add=block(top, low), beta=beta, alpha=alpha)
    lower_right = _symmetric_matmul(a[low], b[:, low], levels - 1, add=block(low, low), beta=beta, alpha=alpha)
    return torch.cat([torch.cat([upper_left, upper_right], 1), torch.cat([upper_right.T, lower_right], 1)], 0)


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


Block = tuple[tuple[int, int], ...]  # ranges (start, stop) whose rows (of a column block: columns) form one matrix


def row_blocks(shape: Sequence[int], split_rows=None) -> list[Block]:
    """Blocks of rows orthogonalised separately; one block unless a split is given.

    ``split_rows`` is either row counts of consecutive blocks, e.g. ``[q, k, v]``,
    or, for interleaved layouts, one list of ``(start, stop)`` row ranges per
    block. The blocks must cover every row exactly once. A fused q/k/v weight
    split this way gets the same update as separate q, k, v weights.
    """
    return _blocks(shape[0], split_rows, "split_rows", "rows")


def column_blocks(shape: Sequence[int], split_cols=None) -> list[Block]:
    """Blocks of columns orthogonalised separately (e.g. an attention output projection per head:
    each head's ``head_dim`` columns); one block unless a split is given. ``split_cols`` as
    ``row_blocks``' ``split_rows``, over columns. With row blocks too, every (row block, column
    block) pair is one matrix."""
    return _blocks(shape[1], split_cols, "split_cols", "columns")


def _blocks(size: int, split, name: str, what: str) -> list[Block]:
    """``row_blocks``/``column_blocks`` over ``size`` rows or columns."""
    if split is None:
        return [((0, size),)]
    split = list(split)
    if all(isinstance(r, int) for r in split):
        if any(r <= 0 for r in split) or sum(split) != size:
            raise ValueError(f"{name} {split}: {what} counts must be positive and sum to {size}")
        starts = [0]
        for r in split:
            starts.append(starts[-1] + r)
        return [((a, b),) for a, b in zip(starts[:-1], starts[1:])]
    blocks = [tuple((int(a), int(b)) for a, b in block) for block in split]
    covered = sorted(r for block in blocks for r in block)
    position = 0
    for start, stop in covered:
        if start != position or stop <= start:
            raise ValueError(f"{name} blocks must cover {what} 0..{size} exactly once; got {covered}")
        position = stop
    if position != size:
        raise ValueError(f"{name} blocks must cover {what} 0..{size} exactly once; got {covered}")
    return blocks


def block_rows(block: Block) -> int:
    """The rows a row block spans (of a column block: its columns)."""
    return sum(stop - start for start, stop in block)


def whole_columns(shape: Sequence[int]) -> tuple[Block, ...]:
    """The column blocks of a matrix not split by columns: one, every column."""
    return (((0, shape[-1]),),)


def second_moment_shape(shape: Sequence[int], col_blocks: Sequence[Block] | None = None) -> tuple[int, ...]:
    """NorMuon's second moment of a weight of ``shape`` (a matrix or a stack of experts): one value per
    row of each Newton–Schulz matrix, i.e. per row and column block (``(..., rows, column blocks)``)."""
    return (*shape[:-1], len(col_blocks) if col_blocks else 1)


def normuon(orthogonal: torch.Tensor, second_moment: torch.Tensor, beta2: float,
            eps: float = NORMUON_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """NorMuon's rule on an orthogonalised update O ``(..., rows, cols)`` and its second moment v
    ``(..., rows)``: ``v' = beta2 v + (1 - beta2) mean_cols(O²)``; ``Ô = O / (sqrt(v') + eps)`` row by
    row, rescaled to O's Frobenius norm (a zero O gives a zero Ô). Returns (Ô, v'), in float32; the
    caller keeps v'. Over whole rows of the matrix Newton–Schulz orthogonalised, never a shard's part of
    one (which is what makes it exact: dion computes it per local shard)."""
    o = orthogonal.float()
    moment = beta2 * second_moment.float() + (1 - beta2) * (o * o).mean(-1)
    scaled = o / (moment.sqrt() + eps).unsqueeze(-1)
    ratio = (torch.linalg.vector_norm(o, dim=(-2, -1), keepdim=True)
             / torch.linalg.vector_norm(scaled, dim=(-2, -1), keepdim=True).clamp(min=torch.finfo(torch.float32).tiny))
    return scaled * ratio, moment


def _take_rows(matrix: torch.Tensor, block: Block) -> torch.Tensor:
    if len(block) == 1:
        return matrix[block[0][0] : block[0][1]]
    return torch.cat([matrix[start:stop] for start, stop in block])


def _take_tile(matrix: torch.Tensor, rows: Block, cols: Block) -> torch.Tensor:
    """The matrix of a (row block, column block) pair: a view where both are one range, else a copy."""
    taken = _take_rows(matrix, rows)
    if len(cols) == 1:
        return taken if cols[0] == (0, matrix.shape[-1]) else taken[:, cols[0][0] : cols[0][1]]
    return torch.cat([taken[:, start:stop] for start, stop in cols], dim=1)


def _tile_ranges(rows: Block, cols: Block):
    """(rows of the matrix, columns of the matrix, rows of the tile, columns of the tile) of each
    rectangle a (row block, column block) pair is made of."""
    row_offset = 0
    for r0, r1 in rows:
        col_offset = 0
        for c0, c1 in cols:
            yield slice(r0, r1), slice(c0, c1), slice(row_offset, row_offset + r1 - r0), slice(col_offset, col_offset + c1 - c0)
            col_offset += c1 - c0
        row_offset += r1 - r0


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
    """
    check_method(ns_method, ns_coefficients)
    dtype = ns_torch_dtype(ns_dtype)
    cols_of = [tuple(col_blocks[i]) if col_blocks is not None and col_blocks[i] else whole_columns(p.shape)
               for i, p in enumerate(params)]
    if normuon_beta2 is not None:
        _check_second_moments(params, cols_of, second_moments)
    variant = dict(col_blocks=cols_of, normuon_beta2=normuon_beta2, second_moments=second_moments)
    if ns_mode == "exact":
        if ns_method != "torch":
            raise ValueError(f"ns_mode 'exact' is torch.optim.Muon's own update: ns_method must be 'torch', "
                             f"got {ns_method!r}")
        if dtype is not torch.bfloat16:
            raise ValueError(f"ns_mode 'exact' is torch.optim.Muon's own update, in bf16: ns_dtype must be "
                             f"'bfloat16', got {ns_dtype!r}")
        return _exact_step(
            params, grads, momentum_buffers, blocks, lr=lr, weight_decay=weight_decay, momentum=momentum,
            nesterov=nesterov, ns_steps=ns_steps, ns_coefficients=ns_coefficients, eps=eps, adjust_lr_fn=adjust_lr_fn,
            **variant,
        )
    if ns_mode != "batched":
        raise ValueError(f"ns_mode must be one of {NS_MODES}, got {ns_mode!r}")
    if not params:
        return 0
    lr = scalar(lr)
    torch._foreach_lerp_(list(momentum_buffers), list(grads), 1 - momentum)
    groups: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}  # (short, long) -> (param, matrix, block, column block)
    for i, (param, param_blocks) in enumerate(zip(params, blocks)):
        for e in range(param.shape[0] if param.ndim == 3 else 1):
            for b, block in enumerate(param_blocks):
                rows = block_rows(block)
                for c, col_block in enumerate(cols_of[i]):
                    cols = block_rows(col_block)
                    groups.setdefault((min(rows, cols), max(rows, cols)), []).append((i, e, b, c))
    torch._foreach_mul_(list(params), 1 - lr * weight_decay)
    for (short, long), group in groups.items():
        for batch in _stack_batches(group, short, long, ns_method, ns_steps):
            _orthogonalise_batch(
                batch, short, long, params, grads, momentum_buffers, blocks,
                lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, ns_coefficients=ns_coefficients,
                eps=eps, adjust_lr_fn=adjust_lr_fn, ns_method=ns_method, dtype=dtype, **variant,
            )
    return sum(len(group) for group in groups.values())


def _check_second_moments(params, cols_of, second_moments) -> None:
    """NorMuon needs one second moment per parameter, shaped by ``second_moment_shape``."""
    if second_moments is None or len(second_moments) != len(params):
        raise ValueError("normuon_beta2 needs second_moments: one tensor per parameter (second_moment_shape)")
    for p, moment, cols in zip(params, second_moments, cols_of):
        expected = second_moment_shape(p.shape, cols)
        if tuple(moment.shape) != expected:
            raise ValueError(f"a NorMuon second moment of shape {tuple(moment.shape)} for a weight of shape "
                             f"{tuple(p.shape)} with {len(cols)} column block(s): expected {expected}")


def apply_normuon(update: torch.Tensor, second_moment: torch.Tensor, e: int, rows: Block, c: int,
                   beta2: float) -> torch.Tensor:
    """NorMuon on one Newton–Schulz matrix's output: its rows' second moments (matrix ``e``, column
    block ``c`` of ``second_moment``) read, advanced and written back; returns Ô."""
    column = _matrix(second_moment, e)[:, c]
    update, moment = normuon(update, _take_rows(column, rows), beta2)
    _put_rows(column, rows, moment)
    return update


def scalar(value):
    """A hyperparameter as a Python number (a 0-dim tensor's value)."""
    return value.item() if isinstance(value, torch.Tensor) else value


def _stack_batches(items: list, short: int, long: int, ns_method: str = "torch", steps: int = NS_STEPS) -> list[list]:
    """``items`` (equally shaped (short, long) matrices) in batches whose bf16 stack is at most
    MAX_STACK_BYTES (the standard iteration needs ~3 such stacks of workspace), fewer where the
    method's workspace is larger (Gram Newton–Schulz: ``workspace_elements``), so no method needs
    more memory than the standard iteration at the cap."""
    per_batch = MAX_STACK_BYTES // (short * long * 2)
    standard = workspace_elements(short, long, "torch", steps)
    per_batch = max(1, per_batch * standard // workspace_elements(short, long, ns_method, steps))
    return [items[first : first + per_batch] for first in range(0, len(items), per_batch)]


def workspace_elements(short: int, long: int, ns_method: str = "torch", steps: int = NS_STEPS) -> int:
    """Elements one (short, long) matrix's Newton–Schulz holds at its peak: the standard iteration
    X, its next value, X Xᵀ and the polynomial; Gram Newton–Schulz X and its next value at a
    restart, and about six (short x short) matrices (R, P, Q, R P, the new R and its blocks)."""
    if ns_method == "gram" and uses_gram(short, long, steps):
        return 2 * short * long + 6 * short * short
    return 2 * short * long + 2 * short * short


def _exact_step(params, grads, momentum_buffers, blocks, *, lr, weight_decay, momentum, nesterov, ns_steps,
                ns_coefficients, eps, adjust_lr_fn, col_blocks, normuon_beta2, second_moments) -> int:
    """torch.optim.Muon's own functional update, one 2-D matrix at a time.

    A block that is one contiguous range of rows (of every column) is a view of
    the weight (contiguous, like a separate weight); an interleaved block
    (TorchTitan's fused wqkv) or a block of columns is gathered into a
    contiguous matrix and written back. Either way ``torch.optim._muon.muon``
    sees exactly the 2-D weight, gradient and momentum a model with separate
    weights would give it. With NorMuon, torch.optim.Muon's own steps around
    its Newton–Schulz (``_exact_normuon``)."""
    from torch.optim._muon import muon as torch_muon

    refusal = exact_mode_refusal(adjust_lr_fn)
    if refusal is not None:
        raise ValueError(f"adjust_lr_fn = {adjust_lr_fn!r}: expected {refusal}")
    count = 0
    for i, (param, grad, buffer, param_blocks) in enumerate(zip(params, grads, momentum_buffers, blocks)):
        for e in range(param.shape[0] if param.ndim == 3 else 1):
            matrices = (_matrix(param, e), _matrix(grad, e), _matrix(buffer, e))
            for block in param_blocks:
                for c, col_block in enumerate(col_blocks[i]):
                    weight, gradient, momentum_buffer = (_contiguous_tile(m, block, col_block) for m in matrices)
                    hyper = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                 ns_coefficients=tuple(ns_coefficients), ns_steps=ns_steps, eps=eps,
                                 adjust_lr_fn=adjust_lr_fn)
                    if normuon_beta2 is None:
                        torch_muon([weight], [gradient], [momentum_buffer], has_complex=False, **hyper)
                    else:
                        _exact_normuon(weight, gradient, momentum_buffer, second_moments[i], e, block, c,
                                       beta2=normuon_beta2, **hyper)
                    for target, updated in ((matrices[0], weight), (matrices[2], momentum_buffer)):
                        if not _shares_memory(target, updated):  # (a copy: written back; a view already is)
                            _put_tile(target, block, col_block, updated)
                    count += 1
    return count


def _exact_normuon(weight, gradient, momentum_buffer, second_moment, e, block, c, *, beta2, lr, weight_decay,
                   momentum, nesterov, ns_coefficients, ns_steps, eps, adjust_lr_fn) -> None:
    """torch.optim.Muon's single-tensor step (torch 2.14's ``_single_tensor_muon``) with NorMuon between
    its Newton–Schulz (torch's own ``_zeropower_via_newtonschulz``) and the update."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    lr = scalar(lr)
    momentum_buffer.lerp_(gradient, 1 - momentum)
    update = gradient.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer
    orthogonal = _zeropower_via_newtonschulz(update, ns_coefficients, ns_steps, eps)
    orthogonal = apply_normuon(orthogonal, second_moment, e, block, c, beta2)
    weight.mul_(1 - lr * weight_decay)
    weight.add_(orthogonal, alpha=-adjusted_lr(lr, adjust_lr_fn, weight.shape))


def _contiguous_tile(matrix: torch.Tensor, rows: Block, cols: Block) -> torch.Tensor:
    """The tile as one contiguous matrix: a view where it is contiguous, else a copy."""
    tile = _take_tile(matrix, rows, cols)
    return tile if tile.is_contiguous() else tile.contiguous()


def _put_rows(matrix: torch.Tensor, block: Block, rows: torch.Tensor) -> None:
    offset = 0
    for start, stop in block:
        matrix[start:stop].copy_(rows[offset : offset + stop - start])
        offset += stop - start


def _put_tile(matrix: torch.Tensor, rows: Block, cols: Block, tile: torch.Tensor) -> None:
    for matrix_rows, matrix_cols, tile_rows, tile_cols in _tile_ranges(rows, cols):
        matrix[matrix_rows, matrix_cols].copy_(tile[tile_rows, tile_cols])


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _orthogonalise_batch(
    members, short, long, params, grads, momentum_buffers, blocks, *, lr, momentum, nesterov, ns_steps,
    ns_coefficients, eps, adjust_lr_fn, ns_method, dtype, col_blocks, normuon_beta2, second_moments,
) -> None:
    """One batch of equally shaped blocks: Nesterov input, stack in the iteration dtype (float16:
    each block normalised in float32 first), Newton–Schulz, NorMuon, update."""
    stack = torch.empty((len(members), short, long), dtype=dtype, device=params[members[0][0]].device)
    scale = ns_input_scale(ns_method)
    for k, (i, e, b, c) in enumerate(members):
        grad = _take_tile(_matrix(grads[i], e), blocks[i][b], col_blocks[i][c])
        buffer = _take_tile(_matrix(momentum_buffers[i], e), blocks[i][b], col_blocks[i][c])
        update = grad.lerp(buffer, momentum) if nesterov else buffer  # one block's fp32 temporary at a time
        wide = update.mT if update.shape[0] > update.shape[1] else update
        stack[k].copy_(wide if dtype is torch.bfloat16 else normalised(wide, eps, scale))
    orthogonal = _orthogonalise_wide_(stack, ns_method=ns_method, steps=ns_steps, coefficients=ns_coefficients, eps=eps,
                                      normalise=dtype is torch.bfloat16)
    del stack
    for k, (i, e, b, c) in enumerate(members):
        param, block, col_block = _matrix(params[i], e), blocks[i][b], col_blocks[i][c]
        rows, cols = block_rows(block), block_rows(col_block)
        update = orthogonal[k].mT if rows > cols else orthogonal[k]
        if normuon_beta2 is not None:
            update = apply_normuon(update, second_moments[i], e, block, c, normuon_beta2)
        step = adjusted_lr(lr, adjust_lr_fn, (rows, cols))
        for matrix_rows, matrix_cols, tile_rows, tile_cols in _tile_ranges(block, col_block):
            param[matrix_rows, matrix_cols].add_(update[tile_rows, tile_cols], alpha=-step)


def _matrix(tensor: torch.Tensor, index: int) -> torch.Tensor:
    return tensor[index] if tensor.ndim == 3 else tensor


def ns_flops(rows: int, cols: int, steps: int = NS_STEPS, *, ns_method: str = "torch") -> int:
    """Multiply-add FLOPs of ``ns_method``'s Newton–Schulz on one (rows, cols) matrix; the plan's cost
    (with "torch"'s)."""
    small, large = min(rows, cols), max(rows, cols)
    # per step: X X^T (s*s*l), poly = b A + c A A (s^3), poly X (s*s*l); x2 for multiply-add
    standard = 2 * steps * (2 * small * small * large + small**3)
    if ns_method == "gram" and uses_gram(small, large, steps):
        return gram_flops(small, large, steps)
    return standard


def gram_flops(short: int, long: int, steps: int = NS_STEPS) -> int:
    """FLOPs of ``_gram_newton_schulz`` on one (short, long) matrix.

    With r = steps // 2 restarts (before each odd step; r + 1 segments): X Xᵀ and Q X r + 1 times
    each (short² long), and steps + 3 (steps - r - 1) products of two (short x short) matrices (R² in
    every step; Q P in each step that does not start a segment, R P and P (R P) in each that does not
    end one). All but Q X are symmetric (``symmetric_flops``: a fraction f of a full GEMM). For 5 steps:
    2 (3 (1 + f) short² long + 11 f short³), against the standard iteration's 2 (10 short² long + 5 short³)."""
    restarts = len(gram_restarts(steps))
    levels = symmetric_levels(short)
    cubes = steps + 3 * (steps - restarts - 1)
    return ((restarts + 1) * (symmetric_flops(short, long, levels) + 2 * short * short * long)
            + cubes * symmetric_flops(short, short, levels))


def symmetric_flops(rows: int, inner: int, levels: int) -> int:
    """FLOPs of ``_symmetric_matmul`` of (rows, inner) by (inner, rows) split ``levels`` times."""
    if levels == 0:
        return 2 * rows * rows * inner
    half = rows // 2
    return (symmetric_flops(half, inner, levels - 1) + 2 * half * (rows - half) * inner
            + symmetric_flops(rows - half, inner, levels - 1))


def uses_gram(short: int, long: int, steps: int = NS_STEPS) -> bool:
    """Whether ``ns_method="gram"`` runs Gram Newton–Schulz on a (short, long) matrix: where that takes
    fewer FLOPs than the standard iteration (``gram_flops``). For 5 steps: where one GEMM does each
    product (short < 2 * SYMMETRIC_MIN_BLOCK = 1024; f = 1) when 12 short² long + 22 short³ <
    20 short² long + 10 short³, i.e. long > 1.5 short; every matrix with short >= 1024 (f <= 3/4)."""
    return gram_flops(short, long, steps) < ns_flops(short, long, steps)


def orthogonalise(
    matrices: Sequence[torch.Tensor],
    *,
    ns_mode: str = "batched",
    steps: int = NS_STEPS,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
    ns_method: str = "torch",
    ns_dtype: str = "bfloat16",
) -> list[torch.Tensor]:
    """Newton–Schulz of whole 2-D matrices (e.g. assembled from tensor-parallel shards), in ``ns_dtype``.

    ``"exact"``: each through ``torch.optim.Muon``'s own Newton–Schulz, which casts its input to bf16
    first, so a matrix given as the bf16 of Muon's input gets bitwise Muon's result. ``"batched"``:
    equally shaped matrices (up to transposition) share batched calls, by ``ns_method`` (float16: each
    normalised in float32 before it is rounded). The inputs may be overwritten."""
    check_method(ns_method, coefficients)
    dtype = ns_torch_dtype(ns_dtype)
    if ns_mode == "exact":
        if ns_method != "torch" or dtype is not torch.bfloat16:
            raise ValueError(f"ns_mode 'exact' is torch.optim.Muon's own update: ns_method must be 'torch' and "
                             f"ns_dtype 'bfloat16', got {ns_method!r}, {ns_dtype!r}")
        from torch.optim._muon import _zeropower_via_newtonschulz

        return [_zeropower_via_newtonschulz(m, tuple(coefficients), steps, eps) for m in matrices]
    if ns_mode != "batched":
        raise ValueError(f"ns_mode must be one of {NS_MODES}, got {ns_mode!r}")
    out: list[torch.Tensor | None] = [None] * len(matrices)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, m in enumerate(matrices):
        groups.setdefault((min(m.shape), max(m.shape)), []).append(i)
    scale = ns_input_scale(ns_method)
    for (short, long), group in groups.items():
        for chosen in _stack_batches(group, short, long, ns_method, steps):
            wide = [matrices[i].mT if matrices[i].shape[0] > matrices[i].shape[1] else matrices[i] for i in chosen]
            if dtype is torch.bfloat16:
                stack = torch.stack(wide).bfloat16()
            else:
                stack = torch.empty((len(chosen), short, long), dtype=dtype, device=wide[0].device)
                for k, matrix in enumerate(wide):
                    stack[k].copy_(normalised(matrix, eps, scale))
            result = _orthogonalise_wide_(stack, ns_method=ns_method, steps=steps, coefficients=coefficients, eps=eps,
                                          normalise=dtype is torch.bfloat16)
            for k, i in enumerate(chosen):
                out[i] = result[k].mT if matrices[i].shape[0] > matrices[i].shape[1] else result[k]
    return out


def local_tiles(rows: Block, cols: Block, *, tp_dim: int | None, tp_rank: int,
                local_shape: Sequence[int]) -> list[tuple[slice, slice]]:
    """The rectangles of a (row block, column block) pair of the full matrix that one tensor-parallel
    shard of ``local_shape`` holds, in the shard's coordinates: a column-wise shard (``tp_dim`` 0) holds
    a range of rows, a row-wise one (1) a range of columns, a replicated matrix (None) everything."""
    local_rows = local_block_rows(rows, tp_dim=0 if tp_dim == 0 else None, tp_rank=tp_rank, local_rows=local_shape[0])
    local_cols = local_block_rows(cols, tp_dim=0 if tp_dim == 1 else None, tp_rank=tp_rank, local_rows=local_shape[1])
    return [(slice(r0, r1), slice(c0, c1)) for r0, r1, _ in local_rows for c0, c1, _ in local_cols]


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
