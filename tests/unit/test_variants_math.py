"""The Muon variants' pure math (NorMuon, blocks of columns, float16 iteration) against references
written here, independently of ``titan_dmuon.math``.

Tolerances and why:

* NorMuon's rule (float32) against the rule in float64: a few float32 ulps of the result
  (``RULE_TOLERANCE``, relative to its largest entry); a missing rescale, epsilon or mean is O(1) off.
* A step in ``ns_mode="exact"`` runs torch.optim.Muon's own Newton–Schulz, so it differs from the
  reference only by the rule's float32 rounding times lr: ``EXACT_WEIGHT_TOLERANCE``.
* A batched step's Newton–Schulz is within test_muon_math.py's BATCHED_ULPS of the per-matrix one, and
  NorMuon keeps the update's Frobenius norm, so the weights stay within its BATCHED_WEIGHT_TOLERANCE.
* Blocks of columns are exactly separate matrices (same stacks, same batches): compared bitwise.
* float16: each method against its reference iteration written in float16 (normalised in float32),
  within BATCHED_ULPS float16 ulps (float16 has 3 more significant bits than bf16: 1/8 of a bf16 ulp).
"""

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from benchmarks.ns_deviation import scale_ulps
from tests.support.helpers import reference_newton_schulz, reference_normuon
from titan_dmuon.math import ns_methods
from titan_dmuon.math.matrix_blocks import column_blocks, row_blocks
from titan_dmuon.math.muon_update import muon_step, orthogonalise
from titan_dmuon.math.ns_methods import NS_COEFFICIENTS, NS_METHODS, newton_schulz
from titan_dmuon.math.update_rules import adjusted_lr, normuon, second_moment_shape

BATCHED_ULPS = 4.0  # as test_muon_math.py
BATCHED_WEIGHT_TOLERANCE = 2e-3  # as test_muon_math.py
RULE_TOLERANCE = 1e-5  # float32 rule vs float64 rule, relative to the largest entry (~100 float32 ulps)
EXACT_WEIGHT_TOLERANCE = 1e-6  # lr 0.05 x scale <= 2 x RULE_TOLERANCE x |update| <= ~3, over 3 steps
FLOAT16_ULPS_PER_BF16_ULP = 8.0  # 11 significant bits vs 8
BETA2 = 0.95
HYPER = dict(lr=0.05, weight_decay=0.1, momentum=0.9, nesterov=True, ns_steps=5)


# ---- references, written from the stated rules ----------------------------------------------------------
def reference_step(
    leaves, grads, buffers, moments, *, orthogonalise_fn, beta2, lr, weight_decay, momentum, nesterov, ns_steps
):
    """One step on separate 2-D leaves: torch.optim.Muon's momentum and Nesterov input, ``orthogonalise_fn``,
    NorMuon (``beta2`` None: none), lr scaled for the leaf's shape, decoupled weight decay."""
    for leaf, grad, buffer, k in zip(leaves, grads, buffers, range(len(leaves))):
        buffer.mul_(momentum).add_(grad, alpha=1 - momentum)
        ns_input = grad * (1 - momentum) + buffer * momentum if nesterov else buffer
        update = orthogonalise_fn(ns_input, NS_COEFFICIENTS, ns_steps, 1e-7).double()
        if beta2 is not None:
            update, moments[k] = reference_normuon(update, moments[k], beta2)
        scale = lr * max(1.0, leaf.shape[0] / leaf.shape[1]) ** 0.5  # torch.optim.Muon's "original" rule
        leaf.mul_(1 - lr * weight_decay).add_(update.float(), alpha=-scale)


def tiles(matrix: torch.Tensor, row_split, col_split) -> list[torch.Tensor]:
    """The matrices of a grid of (row block, column block) pairs, row blocks as row counts or range lists,
    column blocks as column counts: each copied out (rows first, then columns, in that order)."""
    if all(isinstance(r, int) for r in row_split):
        edges = [0]
        for r in row_split:
            edges.append(edges[-1] + r)
        row_split = [[(a, b)] for a, b in zip(edges, edges[1:])]
    col_edges = [0]
    for c in col_split:
        col_edges.append(col_edges[-1] + c)
    out = []
    for ranges in row_split:
        rows = torch.cat([matrix[a:b] for a, b in ranges])
        out += [rows[:, a:b].clone() for a, b in zip(col_edges, col_edges[1:])]
    return out


# ---- NorMuon's rule --------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(6, 10), (10, 6), (1, 5), (7, 7)])
def test_normuon_is_the_stated_rule(shape):
    """Over three steps from v = 0: Ô and v as the float64 rule; batched over leading dims as per matrix."""
    g = torch.Generator().manual_seed(0)
    moment, expected_moment = torch.zeros(shape[0]), torch.zeros(shape[0], dtype=torch.float64)
    for _ in range(3):
        o = torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g)  # rows of unequal norms
        got, moment = normuon(o, moment, BETA2)
        expected, expected_moment = reference_normuon(o, expected_moment, BETA2)
        assert (got.double() - expected).abs().max() <= RULE_TOLERANCE * expected.abs().max()
        assert (moment.double() - expected_moment).abs().max() <= RULE_TOLERANCE * expected_moment.abs().max()
        assert torch.linalg.vector_norm(got) == pytest.approx(torch.linalg.vector_norm(o).item(), rel=1e-5)
    stack, moments = torch.randn(3, *shape, generator=g), torch.rand(3, shape[0], generator=g)
    batched, batched_moments = normuon(stack, moments, BETA2)
    for k in range(3):
        single, single_moment = normuon(stack[k], moments[k], BETA2)
        assert torch.allclose(batched[k], single, rtol=1e-6, atol=0) and torch.equal(batched_moments[k], single_moment)


def test_normuon_of_zero_is_zero():
    """A zero update (a zero gradient, or rows of one): zero, never NaN; v decays."""
    moment = torch.full((4,), 0.5)
    update, advanced = normuon(torch.zeros(4, 6), moment, BETA2)
    assert torch.equal(update, torch.zeros(4, 6)) and torch.equal(advanced, moment * BETA2)
    partly = torch.zeros(4, 6)
    partly[1] = 1.0
    update, _ = normuon(partly, torch.zeros(4), BETA2)
    assert torch.isfinite(update).all() and torch.equal(update[0], torch.zeros(6)) and update[1].abs().min() > 0


def test_normuon_equalises_row_norms():
    """What the rule is for: rows of very unequal norms come out (after a first step from v = 0, where
    v = (1 - beta2) mean O^2) of equal norms, the matrix keeping its Frobenius norm."""
    o = torch.randn(5, 40) * torch.tensor([[1e-3], [1e-2], [1.0], [10.0], [1.0]])
    update, _ = normuon(o, torch.zeros(5), BETA2)
    rows = torch.linalg.vector_norm(update, dim=1)
    assert (rows.max() - rows.min()) / rows.max() < 1e-4


# ---- NorMuon in a step -----------------------------------------------------------------------------------
@pytest.mark.parametrize("ns_mode", ["exact", "batched"])
def test_muon_step_with_normuon_matches_the_reference(ns_mode):
    """Matrices (wide, tall, square), an interleaved fused weight's row blocks, a stack of experts and a
    weight in blocks of columns: NorMuon per Newton–Schulz matrix, v per row of it, against separate
    leaves stepped by the reference. And NorMuon is not Muon: without it the weights are further off
    than the tolerance."""
    torch.manual_seed(0)
    interleaved = [[(0, 2), (8, 10)], [(2, 8)], [(10, 16)]]
    layout = [  # (shape, row split, column split)
        ((12, 8), None, None),
        ((8, 12), None, None),
        ((6, 6), None, None),
        ((16, 6), interleaved, None),
        ((3, 16, 6), [8, 8], None),
        ((6, 12), None, [4, 4, 4]),
    ]
    params = [torch.randn(shape) for shape, _, _ in layout]
    blocks = [row_blocks(shape[-2:], rows) for shape, rows, _ in layout]
    cols = [column_blocks(shape[-2:], c) if c else None for shape, _, c in layout]
    moments = [torch.zeros(second_moment_shape(p.shape, c)) for p, c in zip(params, cols)]
    buffers = [torch.zeros_like(p) for p in params]

    def split(tensor, index):
        shape, rows, c = layout[index]
        matrices = tensor if tensor.ndim == 3 else tensor[None]
        return [t for m in matrices for t in tiles(m, rows or [shape[-2]], c or [shape[-1]])]

    leaves = [t for i, p in enumerate(params) for t in split(p, i)]
    muon_leaves = [t.clone() for t in leaves]
    leaf_buffers = [torch.zeros_like(t) for t in leaves]
    muon_buffers = [torch.zeros_like(t) for t in leaves]
    leaf_moments = [torch.zeros(t.shape[0], dtype=torch.float64) for t in leaves]
    ns = _zeropower_via_newtonschulz if ns_mode == "exact" else reference_newton_schulz("torch")
    for _ in range(3):
        grads = [torch.randn_like(p) for p in params]
        leaf_grads = [t for i, g in enumerate(grads) for t in split(g, i)]
        muon_step(
            params,
            grads,
            buffers,
            blocks,
            col_blocks=cols,
            ns_mode=ns_mode,
            normuon_beta2=BETA2,
            second_moments=moments,
            **HYPER,
        )
        reference_step(leaves, leaf_grads, leaf_buffers, leaf_moments, orthogonalise_fn=ns, beta2=BETA2, **HYPER)
        reference_step(
            muon_leaves, leaf_grads, muon_buffers, [None] * len(leaves), orthogonalise_fn=ns, beta2=None, **HYPER
        )
    tolerance = EXACT_WEIGHT_TOLERANCE if ns_mode == "exact" else BATCHED_WEIGHT_TOLERANCE
    got = [t for i, p in enumerate(params) for t in split(p, i)]
    assert max((a - b).abs().max().item() for a, b in zip(got, leaves)) <= tolerance
    assert max((a - b).abs().max().item() for a, b in zip(got, muon_leaves)) > 10 * tolerance
    got_moments = [m for i, v in enumerate(moments) for m in _moment_rows(v, layout[i])]
    for mine, theirs in zip(got_moments, leaf_moments):
        assert (mine.double() - theirs).abs().max() <= (RULE_TOLERANCE if ns_mode == "exact" else 1e-2) * theirs.max()


def _moment_rows(moment: torch.Tensor, layout) -> list[torch.Tensor]:
    """A weight's second moment (..., rows, column blocks) as one vector per Newton–Schulz matrix, in the
    order of ``tiles``."""
    shape, rows, _ = layout
    out = []
    for m in moment if moment.ndim == 3 else moment[None]:
        blocks = row_blocks(shape[-2:], rows)
        for block in blocks:
            for c in range(m.shape[1]):
                out.append(torch.cat([m[a:b, c] for a, b in block]))
    return out


def test_normuon_needs_its_state():
    p = torch.randn(4, 6)
    with pytest.raises(ValueError, match="second_moments"):
        muon_step([p], [p.clone()], [torch.zeros_like(p)], [row_blocks(p.shape)], normuon_beta2=BETA2, **HYPER)
    with pytest.raises(ValueError, match=r"expected \(4, 2\)"):
        muon_step(
            [p],
            [p.clone()],
            [torch.zeros_like(p)],
            [row_blocks(p.shape)],
            col_blocks=[column_blocks(p.shape, [3, 3])],
            normuon_beta2=BETA2,
            second_moments=[torch.zeros(4, 1)],
            **HYPER,
        )


# ---- blocks of columns -----------------------------------------------------------------------------------
@pytest.mark.parametrize("ns_mode", ["exact", "batched"])
@pytest.mark.parametrize("beta2", [None, BETA2])
def test_column_blocks_equal_separate_matrices(ns_mode, beta2):
    """An output projection per head (blocks of columns), a grid of row and column blocks, and a stack
    of experts in blocks of columns: bitwise the update of separate weights (each block's learning rate
    scaled for its own shape: (8, 2) blocks are tall, sqrt(4) times the (8, 8) matrix's rate), momentum
    and NorMuon's second moments included."""
    torch.manual_seed(0)
    layout = [((8, 8), None, [2, 2, 2, 2]), ((12, 10), [4, 8], [6, 4]), ((2, 6, 9), None, [3, 3, 3])]
    params = [torch.randn(shape) for shape, _, _ in layout]
    blocks = [row_blocks(shape[-2:], rows) for shape, rows, _ in layout]
    cols = [column_blocks(shape[-2:], c) for shape, _, c in layout]

    def split(tensor, index):
        shape, rows, c = layout[index]
        return [t for m in (tensor if tensor.ndim == 3 else tensor[None]) for t in tiles(m, rows or [shape[-2]], c)]

    separate = [t for i, p in enumerate(params) for t in split(p, i)]
    buffers, separate_buffers = [torch.zeros_like(p) for p in params], [torch.zeros_like(t) for t in separate]
    moments = [torch.zeros(second_moment_shape(p.shape, c)) for p, c in zip(params, cols)]
    separate_moments = [torch.zeros(second_moment_shape(t.shape)) for t in separate]
    state = dict(normuon_beta2=beta2) if beta2 is None else dict(normuon_beta2=beta2, second_moments=moments)
    separate_state = state if beta2 is None else dict(normuon_beta2=beta2, second_moments=separate_moments)
    for _ in range(2):
        grads = [torch.randn_like(p) for p in params]
        count = muon_step(params, grads, buffers, blocks, col_blocks=cols, ns_mode=ns_mode, **state, **HYPER)
        muon_step(
            separate,
            [t for i, g in enumerate(grads) for t in split(g, i)],
            separate_buffers,
            [row_blocks(t.shape) for t in separate],
            ns_mode=ns_mode,
            **separate_state,
            **HYPER,
        )
        assert count == len(separate)
    assert all(torch.equal(a, b) for a, b in zip([t for i, p in enumerate(params) for t in split(p, i)], separate))
    assert all(
        torch.equal(a, b) for a, b in zip([t for i, p in enumerate(buffers) for t in split(p, i)], separate_buffers)
    )
    if beta2 is not None:
        mine = [m for i, v in enumerate(moments) for m in _moment_rows(v, layout[i])]
        assert all(torch.equal(a, b[:, 0]) for a, b in zip(mine, separate_moments))


def test_the_learning_rate_of_a_block_is_its_shape():
    """The stated rule, on its own: a (8, 2) column block of an (8, 8) weight moves by adjusted_lr of
    (8, 2) (2x the (8, 8) matrix's with "original"); with "match_rms_adamw", 0.2 sqrt(8) for both."""
    assert adjusted_lr(1.0, None, (8, 2)) == 2 * adjusted_lr(1.0, None, (8, 8))
    assert adjusted_lr(1.0, "match_rms_adamw", (8, 2)) == adjusted_lr(1.0, "match_rms_adamw", (8, 8))
    p = torch.zeros(8, 8)
    grad = torch.randn(8, 8)
    muon_step(
        [p],
        [grad],
        [torch.zeros_like(p)],
        [row_blocks(p.shape)],
        col_blocks=[column_blocks(p.shape, [2] * 4)],
        lr=1.0,
        weight_decay=0.0,
        momentum=0.0,
        nesterov=False,
        ns_steps=5,
        ns_mode="exact",
    )
    for c in range(4):
        expected = _zeropower_via_newtonschulz(grad[:, 2 * c : 2 * c + 2].contiguous(), NS_COEFFICIENTS, 5, 1e-7)
        assert torch.equal(p[:, 2 * c : 2 * c + 2], -2.0 * expected.float())


@pytest.mark.parametrize("split", [[3, 3], [4, 4, 1], [[(0, 4)], [(3, 8)]], [[(0, 4)]]])
def test_bad_column_splits_are_rejected(split):
    with pytest.raises(ValueError, match="split_cols"):
        column_blocks((4, 8), split)


# ---- float16 iteration -----------------------------------------------------------------------------------
@pytest.mark.parametrize("method", NS_METHODS)
@pytest.mark.parametrize("shape", [(5, 3), (8, 8), (16, 32), (96, 32), (40, 16)])
@pytest.mark.parametrize("batch", [1, 5])
def test_float16_newton_schulz_is_its_reference_iteration(method, shape, batch):
    torch.manual_seed(0)
    stack = torch.randn(batch, *shape)
    reference = reference_newton_schulz(method, dtype=torch.float16)
    expected = torch.stack([reference(m, NS_COEFFICIENTS, 5, 1e-7) for m in stack]).float()
    got = newton_schulz(stack, ns_method=method, ns_dtype="float16")
    assert got.dtype == torch.float16
    assert scale_ulps(got.float() - expected, expected) * FLOAT16_ULPS_PER_BF16_ULP <= BATCHED_ULPS


@pytest.mark.parametrize("method", NS_METHODS)
def test_float16_normalises_in_float32(method):
    """A momentum outside float16's range (entries of 1e6: inf in float16; of 1e-6: subnormal, ~6% steps)
    gives the output of the same matrix at unit scale (the division rounds the same way up to one float32
    ulp, so within a float16 ulp or two); a zero matrix gives zero. (Its Frobenius norm stays above
    ``eps``, below which Muon's convention clamps it.)"""
    torch.manual_seed(0)
    m = torch.randn(2, 16, 40)
    unit = newton_schulz(m, ns_method=method, ns_dtype="float16").float()
    for scale in (1e6, 1e-6):
        scaled = newton_schulz(m * scale, ns_method=method, ns_dtype="float16").float()
        assert torch.isfinite(scaled).all()
        assert scale_ulps(scaled - unit, unit) * FLOAT16_ULPS_PER_BF16_ULP <= BATCHED_ULPS
    assert torch.equal(
        newton_schulz(torch.zeros(1, 16, 40), ns_method=method, ns_dtype="float16"),
        torch.zeros(1, 16, 40, dtype=torch.float16),
    )


@pytest.mark.parametrize("method", NS_METHODS)
def test_float16_rounds_less_than_bf16(method):
    """The point of float16: on a graded input (singular values 1 to 1e-2) its output is closer to the
    method's own polynomials evaluated in float64 than bf16's, by about the 2^3 of their mantissas (at
    least 2x here, on every method)."""
    g = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(48, 48, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(160, 48, generator=g, dtype=torch.float64))
    m = ((u * torch.logspace(0, -2, 48, dtype=torch.float64)) @ v.T)[None]
    x = m / (m.norm() * ns_methods.ns_input_scale(method))
    for a, b, c in ns_methods.ns_schedule(method, 5):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    errors = {
        dtype: (newton_schulz(m.float(), ns_method=method, ns_dtype=dtype).double() - x).norm() / x.norm()
        for dtype in ("bfloat16", "float16")
    }
    assert errors["float16"] < errors["bfloat16"] / 2, errors


@pytest.mark.parametrize("method", NS_METHODS)
def test_a_float16_step_matches_the_reference(method):
    """muon_step and orthogonalise in float16: each matrix as the reference float16 iteration (separate
    leaves), within the batched bound; the exact mode (torch.optim.Muon's bf16 update) refuses it."""
    torch.manual_seed(0)
    params = [torch.randn(12, 8), torch.randn(8, 12), torch.randn(3, 8, 12)]
    leaves = [params[0].clone(), params[1].clone()] + [e.clone() for e in params[2]]
    buffers, leaf_buffers = [torch.zeros_like(p) for p in params], [torch.zeros_like(t) for t in leaves]
    reference = reference_newton_schulz(method, dtype=torch.float16)
    for _ in range(2):
        grads = [torch.randn_like(p) for p in params]
        muon_step(
            params,
            grads,
            buffers,
            [row_blocks(p.shape[-2:]) for p in params],
            ns_method=method,
            ns_dtype="float16",
            **HYPER,
        )
        reference_step(
            leaves,
            [grads[0], grads[1], *grads[2]],
            leaf_buffers,
            [None] * 5,
            orthogonalise_fn=reference,
            beta2=None,
            **HYPER,
        )
    got = [params[0], params[1], *params[2]]
    assert (
        max((a - b).abs().max().item() for a, b in zip(got, leaves))
        <= BATCHED_WEIGHT_TOLERANCE / FLOAT16_ULPS_PER_BF16_ULP
    )
    matrices = [torch.randn(24, 40), torch.randn(40, 24)]
    for m, o in zip(matrices, orthogonalise([m.bfloat16() for m in matrices], ns_method=method, ns_dtype="float16")):
        expected = reference(m.bfloat16(), NS_COEFFICIENTS, 5, 1e-7).float()
        assert (
            o.dtype == torch.float16
            and scale_ulps(o.float() - expected, expected) * FLOAT16_ULPS_PER_BF16_ULP <= BATCHED_ULPS
        )
    with pytest.raises(ValueError, match="ns_dtype must be 'bfloat16'"):
        muon_step(
            params,
            grads,
            buffers,
            [row_blocks(p.shape[-2:]) for p in params],
            ns_mode="exact",
            ns_dtype="float16",
            **HYPER,
        )
    with pytest.raises(ValueError, match="ns_dtype must be one of"):
        newton_schulz(torch.randn(1, 4, 4), ns_dtype="float32")
