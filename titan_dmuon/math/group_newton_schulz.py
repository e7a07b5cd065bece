"""Newton–Schulz of one matrix split over an owner group: pure functions, one collective given.

A matrix may be owned by k ranks ("an owner group"), member i keeping one contiguous block X_i of it
along its long side (rows of a tall matrix, columns of a wide one: ``block_bounds``). Orthogonalised
as the wide X = [X_1 ... X_k] (short x long), every product Newton–Schulz needs splits the same way:
the Gram matrix X Xᵀ = Σ X_i X_iᵀ, and every update multiplies X from the left (X <- a X + P X, or
Q X), so member i updates X_i with the whole (short x short) factor and its own block. Nothing here
communicates: the caller gives ``all_reduce``, a callable that sums an fp32 tensor in place over the
group (a process group's all-reduce; in tests, a sum over simulated members).

Per matrix, the group sums the Gram matrix at every step of the standard iteration ("torch",
"polar_express"), and only at the restarts of Gram Newton–Schulz ("gram": ``len(gram_restarts) + 1``
times), whose short-space iteration every member repeats on the same summed Gram matrix. The squared
Frobenius norm (one fp32 number) rides with the first Gram sum: that sum is of the block before it is
normalised, and Gram(X / n) = Gram(X) / n², divided in fp32 before the one rounding to bf16
(``_first_gram``), so a matrix costs ``gram_all_reduces`` all-reduces, not one more for its norm.

Decisions (``docs/owner-groups.md`` has the figures):

* The Gram matrix is reduced in fp32, its upper triangle only (``pack_symmetric``): s (s + 1) / 2
  fp32 numbers, the bytes of the full matrix in bf16. Each member's part is its bf16 GEMM (the
  one-owner's own product on its block), summed in fp32 and rounded to bf16 once, so the summed
  Gram matrix differs from the one-owner's by at most (3 u + (k - 1 + 2 l) 2^-24) sqrt(A_jj A_ll)
  per entry (u = 2^-8; ``GRAM_ROUNDINGS`` = 3: the one-owner's own rounding, each part's, and the
  sum's, with Σ_i |(X_i X_iᵀ)_jl| <= sqrt(A_jj A_ll) by Cauchy–Schwarz; 2^-24: the fp32 sums, of the
  k parts and inside both GEMMs over at most l products). Whatever k, under 4 u for k + 2 l < 2^16.
  Reduced in bf16, every hop of a ring rounds: k - 1 roundings, a bound that grows with k.
* The short³ part of a standard step (the polynomial b A + c A² of the s x s Gram matrix): every
  member repeats it when its block is at least as long as the short side; a member with a narrower
  block never forms it and applies A twice to its block, in Horner's order
  X_i <- a X_i + A (b X_i + c A X_i) (two roundings per step, as the polynomial's): 6 s² b FLOPs
  instead of 4 s² b + 2 s³ for a block b columns wide, fewer exactly when b < s (``reassociates``),
  and no collective beyond the Gram matrix's. Splitting A² by rows over the members instead costs an
  all-gather of s² bf16 per step (half again the Gram all-reduce's bytes) for fewer FLOPs on long
  matrices (``benchmarks/plan_scale.py --short-cube``): not done, one collective per step kept.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from titan_dmuon.math.ns_methods import (
    NS_COEFFICIENTS,
    NS_EPS,
    NS_STEPS,
    _symmetric_matmul,
    check_method,
    gram_restarts,
    gram_segments,
    ns_input_scale,
    ns_schedule,
    symmetric_flops,
    symmetric_levels,
)

AllReduce = Callable[[torch.Tensor], None]  # sums an fp32 tensor in place over the owner group
GRAM_ROUNDINGS = 3  # bf16 roundings the group's Gram matrix may differ from the one-owner's by (see above)
GRAM_REDUCE_DTYPE = torch.float32
GRAM_REDUCE_BYTES = 4


def block_bounds(long: int, group_size: int) -> tuple[int, ...]:
    """Where each member's block starts along the long side (and where the last ends): ``group_size``
    contiguous blocks of ceil(long / k), the last one shorter, as ``torch.chunk`` (and so DTensor's
    ``Shard``) splits, none of them empty (``has_blocks``)."""
    if not has_blocks(long, group_size):
        raise ValueError(
            f"an owner group of {group_size} ranks cannot split a long side of {long} into "
            f"{group_size} blocks of ceil({long}/{group_size}) (torch.chunk's sizes)"
        )
    width = widest_block(long, group_size)
    return tuple(min(i * width, long) for i in range(group_size + 1))


def has_blocks(long: int, group_size: int) -> bool:
    """Whether ``long`` splits into ``group_size`` non-empty blocks of ceil(long / k), the last shorter."""
    return 1 <= group_size <= long and (group_size - 1) * widest_block(long, group_size) < long


def widest_block(long: int, group_size: int) -> int:
    """The longest block of ``block_bounds(long, group_size)`` (the first)."""
    return -(-long // group_size)


# ---- the Gram matrix's upper triangle, packed --------------------------------------------------------
def packed_numel(n: int) -> int:
    """Elements of an (n x n) symmetric matrix's packed upper triangle (diagonal included)."""
    return n * (n + 1) // 2


def _halves(n: int) -> tuple[int, int]:
    return (n + 1) // 2, n // 2


def pack_symmetric(matrices: torch.Tensor, dtype: torch.dtype = GRAM_REDUCE_DTYPE, *, extra: int = 0) -> torch.Tensor:
    """(B, n, n) symmetric matrices as (B, n (n + 1) / 2) numbers of ``dtype``, by blocks (no index
    tensors): with A = [[A11, A12], [A12ᵀ, A22]] (A11 of ceil(n/2) rows), A11's lower triangle and
    A22's upper one share one rectangle (A22's shifted by one row or column), followed by A12.
    Only the upper triangle of A is read (the lower triangle of A11 is its upper one mirrored).
    ``extra`` columns are left after it for the caller (the squared norm: no concatenated copy)."""
    batch, n = matrices.size(0), matrices.size(-1)
    a, b = _halves(n)
    even = a == b
    out = torch.empty(batch, packed_numel(n) + extra, dtype=dtype, device=matrices.device)
    rows = a + 1 if even else a
    rectangle = out[:, : rows * a].view(batch, rows, a)
    rectangle.zero_()
    rectangle[:, 1 if even else 0 :] = torch.tril(matrices[:, :a, :a].mT)
    shifted = rectangle[:, :b, (0 if even else 1) : (0 if even else 1) + b]
    shifted.add_(torch.triu(matrices[:, a:, a:]))
    out[:, rows * a : rows * a + a * b].view(batch, a, b).copy_(matrices[:, :a, a:])
    return out


def unpack_symmetric(packed: torch.Tensor, n: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``pack_symmetric``'s inverse: (B, n, n) symmetric matrices of ``dtype`` (each entry rounded once)."""
    batch = packed.size(0)
    a, b = _halves(n)
    even = a == b
    rows = a + 1 if even else a
    rectangle = packed[:, : rows * a].view(batch, rows, a)
    lower = rectangle[:, 1 if even else 0 :]  # A11's lower triangle
    upper = rectangle[:, :b, (0 if even else 1) : (0 if even else 1) + b]  # A22's upper triangle
    out = torch.empty(batch, n, n, dtype=dtype, device=packed.device)
    # (each entry rounded once, then a triangle and its mirror added where it was zero: small temporaries)
    lower, upper = lower.to(dtype), upper.to(dtype)
    out[:, :a, :a] = torch.tril(lower)
    out[:, :a, :a] += torch.tril(lower, -1).mT
    out[:, a:, a:] = torch.triu(upper)
    out[:, a:, a:] += torch.triu(upper, 1).mT
    corner = packed[:, rows * a :].view(batch, a, b)
    out[:, :a, a:] = corner
    out[:, a:, :a] = corner.mT
    return out


def summed_gram(blocks: torch.Tensor, all_reduce: AllReduce, levels: int = 0) -> torch.Tensor:
    """X Xᵀ of the whole matrices from this member's (B, short, b) blocks: its bf16 part (as the
    one-owner computes the product: one GEMM, or ``levels`` of symmetric blocks), summed over the
    group in fp32 (upper triangle), rounded to bf16 once."""
    part = _batched_symmetric(blocks, blocks.mT, levels) if levels else blocks @ blocks.mT
    packed = pack_symmetric(part)
    del part
    all_reduce(packed)
    return unpack_symmetric(packed, blocks.size(-2), blocks.dtype)


# ---- the iteration -------------------------------------------------------------------------------------
def group_newton_schulz(
    block: torch.Tensor,
    *,
    shape: tuple[int, int],
    group_size: int,
    all_reduce: AllReduce,
    steps: int = NS_STEPS,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
    ns_method: str = "torch",
    overwrite: bool = False,
) -> torch.Tensor:
    """This member's block of ``ns_method``'s Newton–Schulz of B matrices of ``shape`` (rows, cols),
    owned by ``group_size`` ranks: ``block`` is (B, rows_i, cols) (a tall matrix's row block) or
    (B, rows, cols_i) (a wide or square one's column block), bounds from ``block_bounds``. Every
    member calls it with the same shape, steps and method, and ``all_reduce`` on the same group;
    the result is in bf16, in the block's orientation; ``overwrite``: a bf16 ``block`` is the caller's
    scratch, iterated in place (no copy). ``group_size`` 1 (a summing callable that
    does nothing) is the one-owner iteration, its Gram matrix taken from its upper triangle."""
    if block.ndim != 3:
        raise ValueError(f"group_newton_schulz expects (batch, rows, cols), got {tuple(block.shape)}")
    check_method(ns_method, coefficients)
    rows, cols = shape
    tall = rows > cols
    short, long = (cols, rows) if tall else (rows, cols)
    x = block.bfloat16()
    if tall:
        x = x.mT
    if x.size(-2) != short or not 0 < x.size(-1) <= long:
        raise ValueError(f"a block of shape {tuple(block.shape[1:])} is not a block along the long side of {shape}")
    x = x.clone() if not overwrite and (x is block or x._base is block) else x
    del block  # (handed over: with ``overwrite``, the stack is freed once the first step has replaced it)
    schedule = ns_schedule(ns_method, steps, coefficients)
    uses_gram = ns_method == "gram" and group_uses_gram(short, long, group_size, steps)
    levels = symmetric_levels(short) if uses_gram else 0
    scale = ns_input_scale(ns_method)

    def first_gram(y: torch.Tensor) -> torch.Tensor:
        if group_size == 1:  # (nothing to sum: the one-owner's order, its Gram matrix of the normalised X)
            _first_gram(y, eps, scale, lambda t: None, levels)
            return summed_gram(y, all_reduce, levels)
        return _first_gram(y, eps, scale, all_reduce, levels)

    held = [x]  # (no name here keeps the block alive while the iteration replaces it: member_workspace_elements)
    del x
    if uses_gram:
        x = _group_gram(held, schedule, all_reduce, first_gram, levels)
    else:
        reassociate = reassociates(short, widest_block(long, group_size))
        x = _group_iterate(held, schedule, all_reduce, first_gram, reassociate=reassociate)
    return x.mT if tall else x


def _first_gram(x: torch.Tensor, eps: float, scale: float, all_reduce: AllReduce, levels: int) -> torch.Tensor:
    """Normalise each matrix in place by ``scale`` times its Frobenius norm over the group (clamped at
    ``eps``), and return its first summed Gram matrix, both from one all-reduce: the packed Gram part of
    the block as it came, with its squared norm (fp32) as one more column. The norm is rooted and rounded
    to bf16 as the one-owner's ``vector_norm`` of its bf16 matrix rounds its fp32 result, and divides X as
    there; the summed Gram matrix is divided by the same divisor squared in fp32, then rounded once.
    Each matrix's fp32 squares are taken one matrix at a time (``vector_norm`` with a dtype copies its
    input in that dtype: the whole batch in fp32 before), the packed sum divided in place."""
    squares = torch.stack([torch.linalg.vector_norm(m, dtype=GRAM_REDUCE_DTYPE) for m in x]).square()
    part = _batched_symmetric(x, x.mT, levels) if levels else x @ x.mT
    fused = pack_symmetric(part, extra=1)
    del part
    fused[:, -1] = squares
    all_reduce(fused)
    norms = fused[:, -1].sqrt().to(x.dtype)
    if scale != 1.0:
        norms = norms * scale
    divisor = norms.clamp(min=eps)
    x.div_(divisor[:, None, None])
    packed = fused[:, :-1]
    packed.div_(divisor.to(GRAM_REDUCE_DTYPE).square()[:, None])
    return unpack_symmetric(packed, x.size(-2), x.dtype)


def _group_iterate(held: list, schedule, all_reduce: AllReduce, first_gram, *, reassociate: bool) -> torch.Tensor:
    """``ns_methods._iterate`` on this member's block (``held``'s one tensor, taken): X_i <- a X_i +
    (b A + c A²) X_i with A the group's Gram matrix (``first_gram`` at the first step);
    ``reassociate``: X_i <- a X_i + b A X_i + c A (A X_i) (no s³ product). At most X_i, its next value
    and A X_i (or A and its polynomial) are alive with A: no name keeps an earlier one."""
    x = held.pop()
    for step, (a, b, c) in enumerate(schedule):
        gram = first_gram(x) if step == 0 else summed_gram(x, all_reduce)
        if reassociate:  # (the inner product: b X_i + c A X_i, rounded once)
            x = torch.baddbmm(x, gram, torch.baddbmm(x, gram, x, beta=b, alpha=c), beta=a)
        else:  # ns_methods._iterate's step
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        del gram
    return x


def _group_gram(held: list, schedule, all_reduce: AllReduce, first_gram, levels: int) -> torch.Tensor:
    """``ns_methods._gram_newton_schulz`` on this member's block (``held``'s one tensor, taken): the
    short-space iteration (R, Q) on the group's summed Gram matrix (``first_gram`` at the start), repeated
    by every member; Q X_i at each restart and at the end. Large matrices go one at a time (2-D
    symmetric products), as there."""
    restarts = set(gram_restarts(len(schedule)))
    given = [first_gram(held[0])]

    def gram_of(y: torch.Tensor) -> torch.Tensor:
        return given.pop() if given else summed_gram(y, all_reduce, levels)

    return gram_segments(
        held.pop(),
        schedule,
        restarts,
        gram_of=gram_of,
        symmetric=lambda a, b, **kw: _batched_symmetric(a, b, levels, **kw),
    )


def _batched_symmetric(a: torch.Tensor, b: torch.Tensor, levels: int, **kwargs) -> torch.Tensor:
    """``_symmetric_matmul`` on a batch: one matrix at a time where it splits into blocks (2-D only)."""
    if levels == 0:
        return _symmetric_matmul(a, b, 0, **kwargs)
    add = kwargs.pop("add", None)
    return torch.stack(
        [_symmetric_matmul(a[i], b[i], levels, add=None if add is None else add[i], **kwargs) for i in range(a.size(0))]
    )


# ---- the cost -------------------------------------------------------------------------------------------
def reassociates(short: int, widest_block: int) -> bool:
    """Whether members skip the s³ polynomial and apply the Gram matrix twice (see the module's notes):
    exactly where that takes fewer FLOPs, blocks narrower than the short side."""
    return widest_block < short


def _standard_member_flops(short: int, block: int, widest: int, steps: int) -> int:
    """The standard iteration on a block ``block`` wide (the group decides by its ``widest`` block)."""
    per_step = 6 * short * short * block if reassociates(short, widest) else 4 * short * short * block + 2 * short**3
    return steps * per_step


def _gram_member_flops(short: int, block: int, steps: int) -> int:
    """Gram Newton–Schulz on a block ``block`` wide: X Xᵀ and Q X at each restart and at the start and
    end (``gram_flops`` with the block's width), the short-space products repeated in full."""
    levels = symmetric_levels(short)
    restarts = len(gram_restarts(steps))
    cubes = steps + 3 * (steps - restarts - 1)
    return (restarts + 1) * (
        symmetric_flops(short, block, levels) + 2 * short * short * block
    ) + cubes * symmetric_flops(short, short, levels)


def member_workspace_elements(short: int, block: int, ns_method: str = "torch", steps: int = NS_STEPS) -> int:
    """Elements one matrix's group Newton–Schulz holds on a member at its peak (bf16 elements), its block
    ``block`` wide (the group's widest), as ``ns_methods.workspace_elements`` counts one owner's: with the
    polynomial, the block and its next value, the summed Gram matrix and its polynomial; in Horner's order
    (``reassociates``) the block, A X_i and the next value, with the Gram matrix; Gram Newton–Schulz the
    block and its next value, about six short x short matrices; and the packed fp32 sum (two bf16
    elements a number). ``member_batch_elements`` adds what a batch holds once."""
    if ns_method == "gram":
        blocks, squares = 2, 6
    elif reassociates(short, block):
        blocks, squares = 3, 1
    else:
        blocks, squares = 2, 2
    return blocks * short * block + squares * short * short + 2 * packed_numel(short)


def member_batch_elements(short: int, block: int, count: int, ns_method: str = "torch", steps: int = NS_STEPS) -> int:
    """Elements a member's step holds at its peak for a batch of ``count`` equally shaped blocks (bf16
    elements): each one's ``member_workspace_elements``, and one block's fp32 temporary at a time (the
    Nesterov input before it is rounded into the stack; a matrix's squares for its norm)."""
    return count * member_workspace_elements(short, block, ns_method, steps) + 2 * short * block


def group_uses_gram(short: int, long: int, group_size: int, steps: int = NS_STEPS) -> bool:
    """Whether ``ns_method="gram"`` runs Gram Newton–Schulz on a group's (short, long) matrix: where its
    busiest member's FLOPs are fewer than the standard iteration's (one owner: ``uses_gram``)."""
    widest = widest_block(long, group_size)
    return _gram_member_flops(short, widest, steps) < _standard_member_flops(short, widest, widest, steps)


def group_ns_flops(
    short: int, long: int, block: int, group_size: int, steps: int = NS_STEPS, *, ns_method: str = "torch"
) -> int:
    """FLOPs of one member's part of ``ns_method``'s Newton–Schulz of a (short, long) matrix owned by
    ``group_size`` ranks, its block ``block`` wide. One owner (``block == long``): ``ns_flops``."""
    short, long = min(short, long), max(short, long)
    if ns_method == "gram" and group_uses_gram(short, long, group_size, steps):
        return _gram_member_flops(short, block, steps)
    return _standard_member_flops(short, block, widest_block(long, group_size), steps)


def gram_all_reduces(short: int, long: int, group_size: int, steps: int = NS_STEPS, *, ns_method: str = "torch") -> int:
    """All-reduces of one matrix's group Newton–Schulz, each of ``packed_numel(short)`` fp32 numbers
    (the first one a number more: the squared norm rides with it): every step (at least the first's,
    which normalises), or Gram Newton–Schulz's restarts + 1; none for one owner."""
    short, long = min(short, long), max(short, long)
    if group_size == 1:
        return 0
    if ns_method == "gram" and group_uses_gram(short, long, group_size, steps):
        return len(gram_restarts(steps)) + 1
    return max(steps, 1)


def gram_bound(diagonal: torch.Tensor) -> torch.Tensor:
    """The largest difference between the group's summed Gram matrix and the one-owner's, per entry:
    GRAM_ROUNDINGS bf16 unit round-offs of sqrt(A_jj A_ll), from the Gram matrix's diagonal (B, n)."""
    scale = (diagonal[:, :, None] * diagonal[:, None, :]).clamp(min=0).sqrt()
    return GRAM_ROUNDINGS * 2.0**-8 * scale
