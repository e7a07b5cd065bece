"""The Newton–Schulz methods (``ns_methods.NS_METHODS``) against what each one guarantees.

Three contracts, each with its own tolerance and reason:

* The algorithm: each method's batched output is its reference iteration, written independently in
  ``tests.support.helpers.reference_newton_schulz`` (per matrix, bf16, fused ``addmm``s as torch.optim.Muon
  writes its own), up to BATCHED_ULPS bf16 ulps at the output's scale: the same arithmetic, rounded as
  the batched GEMM kernel rounds it (the bound of test_muon_math.py); a wrong coefficient, safety
  factor or restart is tens of ulps off or more (checked below).
* The cost: ``ns_flops`` / ``gram_flops`` are the FLOPs the code runs (counted by torch's FlopCounterMode
  on meta tensors), and "gram" runs Gram Newton–Schulz exactly where its count is the lower one.
* The accuracy (``test_accuracy_contract``): what the polynomials promise, computed in float64 from the
  input's singular values, widened by bf16 round-off as derived in that test's docstring. No NaN or inf on
  any input; a zero matrix gives exactly zero.
"""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.ns_deviation import scale_ulps
from tests.support.helpers import PAPER_POLAR_EXPRESS, PAPER_SAFETY, paper_schedule, reference_newton_schulz
from titan_dmuon.math import ns_methods
from titan_dmuon.math.ns_methods import NS_COEFFICIENTS, NS_METHODS, newton_schulz, ns_flops, ns_schedule, uses_gram

BATCHED_ULPS = 4.0  # as test_muon_math.py: batched vs per-matrix GEMM rounding, in bf16 ulps at the output's scale
U = 2.0**-8  # bf16 unit round-off (8 significant bits, rounding to nearest)
STEPS = 5


def test_the_schedules_are_torchs_and_the_papers():
    """ "torch": torch.optim.Muon's triple every step; "polar_express" and "gram": the paper's
    Algorithm 1 list with its safety factor on all but the last polynomial, the last repeated."""
    assert ns_schedule("torch", 3) == (NS_COEFFICIENTS,) * 3
    for method in ("polar_express", "gram"):
        assert list(ns_schedule(method, 5)) == paper_schedule(5)
        assert (
            list(ns_schedule(method, 10)) == paper_schedule(10)
            and ns_schedule(method, 10)[-3:] == (PAPER_POLAR_EXPRESS[-1],) * 3
        )
    assert ns_methods.ns_input_scale("polar_express") == PAPER_SAFETY
    with pytest.raises(ValueError, match="ns_method must be one of"):
        ns_schedule("newton", 5)
    with pytest.raises(ValueError, match="apply to ns_method 'torch' only"):
        newton_schulz(torch.randn(1, 4, 8), ns_method="gram", coefficients=(3.0, -4.0, 2.0))


SHAPES = [(5, 3), (3, 5), (8, 8), (1, 7), (16, 32), (24, 32), (96, 32), (40, 16)]


@pytest.mark.parametrize("method", ["polar_express", "gram"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("batch", [1, 5])
def test_each_method_is_its_reference_iteration(method, shape, batch):
    """Both branches of "gram" are covered: (16, 32), (96, 32), (40, 16), (3, 5), (1, 7) run Gram
    Newton–Schulz (long > 1.5 short), the others the Polar Express iteration."""
    torch.manual_seed(0)
    stack = torch.randn(batch, *shape)
    reference = reference_newton_schulz(method)
    expected = torch.stack([reference(m, NS_COEFFICIENTS, STEPS, 1e-7) for m in stack]).float()
    assert scale_ulps(newton_schulz(stack, ns_method=method).float() - expected, expected) <= BATCHED_ULPS


def spectrum(rows: int, cols: int, singular_values: torch.Tensor, generator) -> torch.Tensor:
    """A (rows, cols) float64 matrix with these singular values and random singular vectors."""
    k = len(singular_values)
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=generator, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, k, generator=generator, dtype=torch.float64))
    return (u * singular_values) @ v.T


def test_the_bound_catches_a_wrong_schedule_or_restart():
    """The Polar Express polynomials without the safety factor, or torch's coefficients instead, are
    more than 4 x BATCHED_ULPS off on Gaussian matrices; Gram Newton–Schulz without restarts, or with
    float16's one restart before step 2, on matrices with singular values from 1 to 1e-3."""
    torch.manual_seed(0)
    gaussian = torch.randn(4, 16, 48)
    g = torch.Generator().manual_seed(0)
    graded = torch.stack(
        [spectrum(64, 192, torch.logspace(0, -3, 64, dtype=torch.float64), g) for _ in range(2)]
    ).float()
    for method, stack in (("polar_express", gaussian), ("gram", gaussian), ("gram", graded)):
        reference = reference_newton_schulz(method)
        expected = torch.stack([reference(m, NS_COEFFICIENTS, STEPS, 1e-7) for m in stack]).float()
        assert scale_ulps(newton_schulz(stack, ns_method=method).float() - expected, expected) <= BATCHED_ULPS
        x = stack.bfloat16()
        x = x / (x.flatten(1).norm(dim=1) * PAPER_SAFETY)[:, None, None]
        if stack is gaussian:
            wrong = [
                ns_methods._iterate(x.clone(), PAPER_POLAR_EXPRESS[:STEPS]),
                ns_methods._iterate(x.clone(), [NS_COEFFICIENTS] * STEPS),
            ]
        else:
            wrong = [ns_methods._gram_newton_schulz(x.clone(), paper_schedule(STEPS), restarts=r) for r in ((), (2,))]
        for output in wrong:
            assert scale_ulps(output.float() - expected, expected) > 4 * BATCHED_ULPS


@pytest.mark.parametrize(
    "shape", [(16, 40), (40, 16), (24, 32), (1024, 1024), (1030, 3001), (2048, 2048), (4096, 14336)]
)
@pytest.mark.parametrize("method", NS_METHODS)
def test_ns_flops_are_the_flops_run(shape, method):
    """Counted on meta tensors (no arithmetic): every matmul of the iteration each method runs on this
    shape; odd sizes and 1 and 2 levels of symmetric blocks included."""
    short, long = sorted(shape)
    x = torch.empty(1, short, long, dtype=torch.bfloat16, device="meta")
    with FlopCounterMode(display=False) as counter:
        ns_methods.orthogonalise_wide_(x, ns_method=method, steps=STEPS, coefficients=NS_COEFFICIENTS, eps=1e-7)
    assert counter.get_total_flops() == ns_flops(*shape, STEPS, ns_method=method)


def test_gram_runs_where_it_takes_fewer_flops():
    """For 5 steps: on every matrix with a short side of 1024 or more (symmetric products in blocks), and
    on smaller ones whose long side is more than 1.5 times the short side (one GEMM per product:
    12 s² l + 22 s³ < 20 s² l + 10 s³). Elsewhere "gram" is "polar_express", bit for bit."""
    for short in (1, 7, 64, 96, 256, 1000, 1023, 1024, 2048, 4096):
        for long in sorted({short, short + 1, (3 * short) // 2, (3 * short) // 2 + 1, 2 * short, 4 * short}):
            assert uses_gram(short, long) == (short >= 1024 or 2 * long > 3 * short), (short, long)
            gram = ns_flops(short, long, ns_method="gram")
            assert gram == min(ns_flops(short, long), ns_methods.gram_flops(short, long))
    torch.manual_seed(0)
    stack = torch.randn(3, 24, 32)
    assert torch.equal(newton_schulz(stack, ns_method="gram"), newton_schulz(stack, ns_method="polar_express"))


@pytest.mark.parametrize("levels", [1, 2])
def test_symmetric_products_in_blocks_are_the_product(levels):
    """In float64 (no rounding to speak of): the blocked product of X by Xᵀ, and of two polynomials in
    X Xᵀ with the fused ``beta * add + alpha * product``, equal the full ones to 1e-12 (symmetric: the
    lower-left block is the upper-right one's transpose); odd sizes split unevenly."""
    torch.manual_seed(0)
    x = torch.randn(1029, 1500, dtype=torch.float64) / 40
    gram = x @ x.T
    blocked = ns_methods._symmetric_matmul(x, x.T, levels)
    assert (blocked - gram).abs().max() < 1e-12 and (blocked - blocked.T).abs().max() < 1e-12
    z = torch.addmm(gram, gram, gram, beta=-2.0, alpha=0.5)
    fused = ns_methods._symmetric_matmul(gram, z, levels, add=gram, beta=3.0, alpha=1.0)
    assert (fused - torch.addmm(gram, gram, z, beta=3.0)).abs().max() < 1e-12
    assert (ns_methods._symmetric_matmul(gram, z, levels, alpha=0.5) - 0.5 * gram @ z).abs().max() < 1e-12


def _band(method: str, singular_values: torch.Tensor, per_step: float, steps: int = STEPS) -> tuple[float, float]:
    """[lowest, highest] singular value ``steps`` of ``method``'s steps can give a matrix with these
    (float64) singular values, normalised as the method normalises its input, when round-off moves each
    singular value by at most ``per_step`` times the band's top in every step. Propagated step by step on
    a dense grid: the interval entering a step, widened by the round-off, mapped through its polynomial."""
    x = singular_values / singular_values.norm() / ns_methods.ns_input_scale(method)
    low, high = x.min().item(), x.max().item()
    for a, b, c in ns_schedule(method, STEPS)[:steps]:
        slack = per_step * high
        grid = torch.linspace(max(0.0, low - slack), high + slack, 100001, dtype=torch.float64)
        values = a * grid + b * grid**3 + c * grid**5
        low, high = values.min().item(), values.max().item()
    return low, high


def _last_rounding(method: str, singular_values: torch.Tensor) -> float:
    """The result's own round-off, relative: the last step's Gram matrix, polynomial and X (3 U). Gram
    Newton–Schulz forms its last segment (steps 3 and 4) as one matrix Q = q(R), rounded relative to its
    largest eigenvalue, then Q X: a singular value sigma of X becomes q(sigma) sigma, so the round-off of Q
    is U max q / q(sigma) relative to it; max over the band entering the segment of max q / min q."""
    if method != "gram":
        return 3 * U
    start = ns_methods.gram_restarts(STEPS)[-1]
    low, high = _band(method, singular_values, PER_STEP, steps=start)
    grid = torch.linspace(max(low - PER_STEP * high, high * 1e-6), high * (1 + PER_STEP), 100001, dtype=torch.float64)
    values = grid
    for a, b, c in ns_schedule(method, STEPS)[start:]:
        values = a * values + b * values**3 + c * values**5
    ratio = values / grid
    return 3 * U + U * (ratio.max() / ratio.min()).item()


def _inputs(rows: int, cols: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    k = min(rows, cols)
    one_entry = torch.zeros(rows, cols, dtype=torch.float64)
    one_entry[rows // 3, cols // 2] = -3.0
    return {
        "gaussian": torch.randn(rows, cols, generator=g, dtype=torch.float64),
        "singular values 1 to 1e-2": spectrum(rows, cols, torch.logspace(0, -2, k, dtype=torch.float64), g),
        "rank 4": spectrum(rows, cols, torch.tensor([1.0, 0.5, 0.3, 0.1], dtype=torch.float64), g),
        "condition 1e6": spectrum(rows, cols, torch.logspace(0, -6, k, dtype=torch.float64), g),
        "zero": torch.zeros(rows, cols, dtype=torch.float64),
        "one entry": one_entry,
    }


# The bf16 round-off model (U = 2^-8 relative): every step moves each singular value by at most PER_STEP
# times the band's top (X rounded to bf16, and the Gram matrix X Xᵀ its polynomial is evaluated from, U
# each), and the result carries its own round-off (``_last_rounding``).
PER_STEP = 2 * U


def test_the_polynomials_absorb_the_round_off_of_a_step():
    """The premise of the bound below, the Polar Express safety factor's purpose (1% = 2.56 U, the paper's
    Section 4.4): singular values up to PER_STEP above a step's band are mapped back into the next band,
    so the round-off does not compound at the top; torch's quintic has a 4.3% margin of its own. Without
    the safety factor (the paper's raw polynomials) the same round-off grows past any bound."""
    unit = torch.ones(1, dtype=torch.float64)
    for method in NS_METHODS:
        assert _band(method, unit * torch.logspace(0, -3, 50, dtype=torch.float64), PER_STEP)[1] == pytest.approx(
            _band(method, unit * torch.logspace(0, -3, 50, dtype=torch.float64), 0.0)[1], rel=1e-9
        )
    raw = {"torch": NS_COEFFICIENTS}

    def unsafe(method, steps):  # the paper's polynomials without the safety factor
        return PAPER_POLAR_EXPRESS[:steps] if method != "torch" else raw["torch"] * steps

    real = ns_methods.ns_schedule
    try:
        ns_methods.ns_schedule = unsafe
        globals()["ns_schedule"] = unsafe
        assert _band("polar_express", torch.logspace(0, -3, 50, dtype=torch.float64), PER_STEP)[1] > 10
    finally:
        ns_methods.ns_schedule = real
        globals()["ns_schedule"] = real


@pytest.mark.parametrize("shape", [(48, 160), (160, 48), (64, 64)])
@pytest.mark.parametrize("method", NS_METHODS)
def test_accuracy_contract(method, shape):
    """What each method guarantees on Gaussian, graded (singular values 1 to 1e-2), rank-4 and
    condition-1e6 matrices, a zero matrix and a single nonzero entry.

    In exact arithmetic the output's singular values are the method's polynomials composed at the input's
    normalised singular values: within the minimax band of the schedule (Polar Express: [0.8703, 1.1236]
    for inputs in its design interval [1e-3, 1]; torch's quintic: up to 1.2024), though where in the band
    a value near its top lands is sensitive to the last bit (the composition oscillates). In bf16 the
    singular values stay in ``_band`` with the PER_STEP round-off model, widened at the end by the result's
    own round-off (``_last_rounding``): at the top, the polynomials' own maximum (premise checked above); at the bottom,
    the band minus the round-off, vacuous (0) where the input's smallest singular value is below it
    (condition 1e6, square Gaussian). No NaN or inf; a zero matrix gives exactly zero; a single entry (a
    rank-1 matrix whose non-zero pattern every product keeps) gives a single entry of the same sign."""
    for name, matrix in _inputs(*shape).items():
        output = newton_schulz(matrix.float()[None], ns_method=method)[0].double()
        assert torch.isfinite(output).all(), name
        if name == "zero":
            assert torch.equal(output, torch.zeros_like(output))
            continue
        singular_values = torch.linalg.svdvals(matrix)
        singular_values = singular_values[singular_values > 1e-12 * singular_values[0]]  # (rank 4: 4)
        low, high = _band(method, singular_values, PER_STEP)
        last = _last_rounding(method, singular_values)
        got = torch.linalg.svdvals(output)
        assert got.max() <= high * (1 + last), (name, got.max().item(), high, last)
        assert got[: len(singular_values)].min() >= low - last * high, (name, got.min().item(), low, last)
        if name == "one entry":
            assert torch.count_nonzero(output) == 1 and output[shape[0] // 3, shape[1] // 2] < 0
