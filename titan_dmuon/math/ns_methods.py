"""Newton–Schulz orthogonalisation by method, batched by shape: pure functions, pinned to ``torch.optim.Muon``.

Three methods (``ns_method``): ``"torch"`` (``torch.optim.Muon``'s quintic, one coefficient triple every step),
``"polar_express"`` (a minimax polynomial per step, with its safety scaling) and ``"gram"`` (the same
polynomials carried on the Gram matrix X Xᵀ, restarted before every odd step, where that takes fewer FLOPs:
``uses_gram``). Every method keeps ``torch.optim.Muon``'s conventions: bf16 (or float16, normalised in
float32 first), the input divided by its Frobenius norm, a tall matrix orthogonalised as its transpose.
Why each constant has its value: docs/newton-schulz.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


NS_EPS = 1e-7


NS_STEPS = 5


NS_METHODS = ("torch", "polar_express", "gram")


# The Newton–Schulz iteration's dtype: torch.optim.Muon's bf16, or float16 (the original DMuon's default,
# Step 3.5 Flash's): both 2 bytes; float16 has 3 more mantissa bits and a range of 6e-5 to 65504, which
# the iteration's values (bounded by the polynomials' coefficients once the input is normalised) keep.
NS_DTYPES = ("bfloat16", "float16")


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


# Gram Newton–Schulz restarts before every odd step (``gram_restarts``): in bf16 its authors' single restart
# (tuned for float16) let singular values reach 2 (docs/newton-schulz.md; benchmarks/ns_accuracy.py).
# A symmetric product is computed by blocks while they keep at least this many rows, at most this many levels
# deep: 3/4 of the GEMM FLOPs at one level, 5/8 at two; small matrices keep one GEMM.
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
        x = orthogonalise_wide_(
            x, ns_method=ns_method, steps=steps, coefficients=coefficients, eps=eps, normalise=False
        )
        return x.mT if transposed else x
    x = matrices.bfloat16()
    if transposed:
        x = x.mT
    x = x.clone() if x is matrices or x._base is matrices else x
    x = orthogonalise_wide_(x, ns_method=ns_method, steps=steps, coefficients=coefficients, eps=eps)
    return x.mT if transposed else x


def ns_torch_dtype(ns_dtype: str) -> torch.dtype:
    """The torch dtype of an ``ns_dtype`` name (``NS_DTYPES``); ValueError for another."""
    if ns_dtype not in NS_DTYPES:
        raise ValueError(f"ns_dtype must be one of {NS_DTYPES}, got {ns_dtype!r}")
    return getattr(torch, ns_dtype)


def normalised(
    matrices: torch.Tensor, eps: float = NS_EPS, scale: float = 1.0, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Each matrix of ``(..., rows, cols)`` divided by ``scale`` times its Frobenius norm, clamped at
    ``eps`` (zero stays zero), in float32: what a float16 iteration starts from, normalised before it
    is rounded to float16 (a momentum's entries may lie far below float16's smallest normal number, 6e-5,
    or above its largest, 65504; float32 holds both, and after the division every entry is at most 1).
    Into ``out`` (float32, the input's shape) where given."""
    x = matrices.float() if out is None or matrices.dtype is torch.float32 else out.copy_(matrices)
    norms = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    if scale != 1.0:
        norms = norms * scale
    return x / norms.clamp(min=eps) if out is None else torch.div(x, norms.clamp(min=eps), out=out)


def check_method(ns_method: str, coefficients=NS_COEFFICIENTS) -> None:
    """ValueError unless ``ns_method`` is known and ``coefficients`` (torch's own) fit it."""
    if ns_method not in NS_METHODS:
        raise ValueError(f"ns_method must be one of {NS_METHODS}, got {ns_method!r}")
    if ns_method != "torch" and tuple(coefficients) != NS_COEFFICIENTS:
        raise ValueError(
            f"ns_coefficients {tuple(coefficients)} apply to ns_method 'torch' only; "
            f"{ns_method!r} has its own per-step schedule"
        )


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


def fresh(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A ``Scratch`` that allocates a new buffer each time (the default: nothing is kept between calls)."""
    return torch.empty(shape, dtype=dtype, device=device)


# Where the math writes its temporaries: ``scratch(name, shape, dtype, device)`` returns a buffer of that
# shape; a name is never used twice for buffers alive at once, so a caller may hand back the same memory
# for a name every call (``optim/workspace.py``: the step's temporaries planned once and reused).
Scratch = Callable[[str, tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


def scratch_like(scratch: Scratch, name: str, like: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A ``scratch`` buffer laid out as ``like`` (as ``like.to(dtype)`` would be: a transposed matrix stays
    transposed), so reductions over it add in the same order and elementwise kernels take the same path."""
    if like.ndim == 2 and like.stride(0) == 1 and like.stride(1) != 1:
        return scratch(name, (like.size(1), like.size(0)), dtype, like.device).T
    return scratch(name, tuple(like.shape), dtype, like.device)


def orthogonalise_wide_(
    x: torch.Tensor,
    *,
    ns_method: str,
    steps: int,
    coefficients,
    eps: float,
    normalise: bool = True,
    scratch: Scratch = fresh,
) -> torch.Tensor:
    """``ns_method`` on a batch with rows <= cols in its iteration dtype: bf16, which it normalises in
    place ("torch": as torch.optim.Muon, ``coefficients`` every step and no input scale), or, with
    ``normalise=False``, already normalised (``normalised``: float16 inputs). The result is ``x`` or a
    ``scratch`` buffer (its intermediates are ``scratch``'s)."""
    schedule = ns_schedule(ns_method, steps, coefficients)
    if normalise:
        _normalise_(x, eps, ns_input_scale(ns_method))
    if ns_method == "gram" and uses_gram(x.size(-2), x.size(-1), steps):
        return _gram_newton_schulz(x, schedule, scratch=scratch)
    return _iterate(x, schedule, scratch)


def _normalise_(x: torch.Tensor, eps: float, scale: float = 1.0) -> None:
    """Each matrix divided by ``scale`` times its Frobenius norm, clamped at ``eps`` (zero stays zero)."""
    norms = torch.linalg.vector_norm(x.flatten(1), dim=1)
    if scale != 1.0:
        norms = norms * scale
    x.div_(norms.clamp(min=eps)[:, None, None])


def _matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``a @ b`` into ``out`` (the kernel ``@`` runs: ``bmm`` on batches, ``mm`` on matrices)."""
    return (torch.bmm if a.ndim == 3 else torch.mm)(a, b, out=out)


def _square(x: torch.Tensor) -> tuple[int, ...]:
    """The shape of X Xᵀ (per matrix of a batch)."""
    return (*x.shape[:-1], x.size(-2))


def _iterate(x: torch.Tensor, schedule, scratch: Scratch = fresh) -> torch.Tensor:
    """X <- a X + (b A + c A^2) X with A = X Xᵀ, one (a, b, c) per step; X alternates between a
    ``scratch`` buffer and ``x`` itself (a contiguous one; else a second buffer), A and the polynomial
    in two more."""
    gram = scratch("ns_gram", _square(x), x.dtype, x.device)
    poly = scratch("ns_poly", _square(x), x.dtype, x.device)
    targets = (
        scratch("ns_next", tuple(x.shape), x.dtype, x.device),
        x if x.is_contiguous() else scratch("ns_next2", tuple(x.shape), x.dtype, x.device),
    )
    for step, (a, b, c) in enumerate(schedule):
        _matmul(x, x.mT, gram)
        torch.baddbmm(gram, gram, gram, beta=b, alpha=c, out=poly)
        x = torch.baddbmm(x, poly, x, beta=a, out=targets[step % 2])
    return x


def _gram_newton_schulz(
    x: torch.Tensor, schedule, restarts: Sequence[int] | None = None, *, scratch: Scratch = fresh
) -> torch.Tensor:
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

    def symmetric(a, b, **kw):
        return _symmetric_matmul(a, b, levels, scratch=scratch, **kw)

    def gram_of(y, out):
        return symmetric(y, y.mT, out=out)

    if levels > 0 and x.ndim == 3:
        out = scratch("gram_result", tuple(x.shape), x.dtype, x.device)
        for i in range(x.size(0)):
            gram_segments(x[i], schedule, restarts, gram_of=gram_of, symmetric=symmetric, scratch=scratch, out=out[i])
        return out
    return gram_segments(x, schedule, restarts, gram_of=gram_of, symmetric=symmetric, scratch=scratch)


def gram_segments(
    x: torch.Tensor,
    schedule,
    restarts,
    *,
    gram_of,
    symmetric,
    scratch: Scratch | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gram Newton–Schulz's short-space loop (``_gram_newton_schulz``'s notes): R = ``gram_of(X)`` at the
    start and at each restart, Q and R updated by ``symmetric(a, b, add=, beta=, alpha=)`` (beta add +
    alpha a @ b, known symmetric), Q X at each restart and at the end. An owner group passes its summed
    Gram matrix (``math/group_newton_schulz.py``): the rest of the loop is the same on one owner and on a member.
    With ``scratch``, every product goes into a ``scratch`` buffer (``gram_of`` and ``symmetric`` take
    ``out=``), the last into ``out`` where given; without, each is a new tensor."""
    square, wide = _square(x), tuple(x.shape)
    pairs = {"gram": ["gram_r", "gram_r2"], "product": ["gram_q", "gram_q2"], "x": ["gram_x", "gram_x2"]}

    def into(role: str, shape=square) -> dict:
        """``out=`` a buffer for ``role`` (of a pair: the one it did not take last, never the one read), or nothing."""
        if scratch is None:
            return {}
        name = role
        if role in pairs:
            pairs[role].reverse()
            name = pairs[role][0]
        return {"out": scratch(name, shape, x.dtype, x.device)}

    def times_x(product, x, last=False):
        if scratch is None:
            return product @ x
        return _matmul(product, x, out if last and out is not None else into("x", wide)["out"])

    gram = gram_of(x, **into("gram"))
    product = None  # Q
    for step, (a, b, c) in enumerate(schedule):
        if step in restarts:
            x = times_x(product, x)
            gram = gram_of(x, **into("gram"))
            product = None
        z = symmetric(gram, gram, add=gram, beta=b, alpha=c, **into("gram_z"))
        if product is None:
            product = z.clone() if scratch is None else into("product")["out"].copy_(z)
            product.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            product = symmetric(product, z, add=product, beta=a, **into("product"))
        if step + 1 < len(schedule) and step + 1 not in restarts:
            rz = symmetric(gram, z, add=gram, beta=a, **into("gram_rz"))
            gram = symmetric(z, rz, add=rz, beta=a, **into("gram"))
    return times_x(product, x, last=True)


def gram_restarts(steps: int) -> tuple[int, ...]:
    """The steps (counting from 0) Gram Newton–Schulz restarts before: every odd one."""
    return tuple(range(1, steps, 2))


def symmetric_levels(rows: int) -> int:
    """How many times a (rows x rows) symmetric product is split into 2 x 2 blocks."""
    levels = 0
    while levels < SYMMETRIC_MAX_LEVELS and rows >> (levels + 1) >= SYMMETRIC_MIN_BLOCK:
        levels += 1
    return levels


def _symmetric_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    levels: int,
    *,
    add: torch.Tensor | None = None,
    beta: float = 1.0,
    alpha: float = 1.0,
    out: torch.Tensor | None = None,
    scratch: Scratch = fresh,
) -> torch.Tensor:
    """``beta * add + alpha * a @ b`` (accumulated as one ``addmm``/``baddbmm``) for a result known to be
    symmetric: split ``levels`` times (2-D matrices only), its upper-left and lower-right blocks
    (symmetric too: recursively) and its upper-right one; the lower-left is that one's transpose. Into
    ``out`` where given (each block computed into a ``scratch`` block first, as the blocks of a new
    result are, then copied), else a new tensor."""
    if levels == 0:
        if add is None:
            if out is None:
                return a @ b if alpha == 1.0 else (a @ b).mul_(alpha)
            _matmul(a, b, out)
            return out if alpha == 1.0 else out.mul_(alpha)
        accumulate = torch.baddbmm if a.ndim == 3 else torch.addmm
        if out is None:
            return accumulate(add, a, b, beta=beta, alpha=alpha)
        return accumulate(add, a, b, beta=beta, alpha=alpha, out=out)
    half = a.size(0) // 2
    top, low = slice(None, half), slice(half, None)

    def block(rows: slice, cols: slice):
        return None if add is None else add[rows, cols]

    def into(name: str, rows: slice, cols: slice):
        """A ``scratch`` block for this level's product (``out`` given), or a new tensor (None)."""
        if out is None:
            return None
        shape = (a[rows].size(0), b[:, cols].size(1))
        return scratch(f"symmetric_{name}_{levels}", shape, a.dtype, a.device)

    upper_left = _symmetric_matmul(
        a[top],
        b[:, top],
        levels - 1,
        add=block(top, top),
        beta=beta,
        alpha=alpha,
        out=into("upper_left", top, top),
        scratch=scratch,
    )
    upper_right = _symmetric_matmul(
        a[top], b[:, low], 0, add=block(top, low), beta=beta, alpha=alpha, out=into("upper_right", top, low)
    )
    lower_right = _symmetric_matmul(
        a[low],
        b[:, low],
        levels - 1,
        add=block(low, low),
        beta=beta,
        alpha=alpha,
        out=into("lower_right", low, low),
        scratch=scratch,
    )
    if out is None:
        return torch.cat([torch.cat([upper_left, upper_right], 1), torch.cat([upper_right.T, lower_right], 1)], 0)
    out[top, top].copy_(upper_left)
    out[top, low].copy_(upper_right)
    out[low, top].copy_(upper_right.T)
    out[low, low].copy_(lower_right)
    return out


def stack_batches(items: list, short: int, long: int, ns_method: str = "torch", steps: int = NS_STEPS) -> list[list]:
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
    return (restarts + 1) * (symmetric_flops(short, long, levels) + 2 * short * short * long) + cubes * symmetric_flops(
        short, short, levels
    )


def symmetric_flops(rows: int, inner: int, levels: int) -> int:
    """FLOPs of ``_symmetric_matmul`` of (rows, inner) by (inner, rows) split ``levels`` times."""
    if levels == 0:
        return 2 * rows * rows * inner
    half = rows // 2
    return (
        symmetric_flops(half, inner, levels - 1)
        + 2 * half * (rows - half) * inner
        + symmetric_flops(rows - half, inner, levels - 1)
    )


def uses_gram(short: int, long: int, steps: int = NS_STEPS) -> bool:
    """Whether ``ns_method="gram"`` runs Gram Newton–Schulz on a (short, long) matrix: where that takes
    fewer FLOPs than the standard iteration (``gram_flops``). For 5 steps: where one GEMM does each
    product (short < 2 * SYMMETRIC_MIN_BLOCK = 1024; f = 1) when 12 short² long + 22 short³ <
    20 short² long + 10 short³, i.e. long > 1.5 short; every matrix with short >= 1024 (f <= 3/4)."""
    return gram_flops(short, long, steps) < ns_flops(short, long, steps)
