"""The pure math against torch.optim.Muon (torch 2.14).

``ns_mode="exact"`` is bitwise torch.optim.Muon by construction (the same functional call on the
same 2-D matrices), on any kernel. The batched path runs the same arithmetic through batched
GEMMs, which oneDNN (and cuBLAS) may round differently for some batch sizes and shapes (on this
project's machines: batches of 5+ of (16, 32) with ONEDNN_MAX_CPU_ISA=AVX512_CORE, of 16 with AMX):
it is held to BATCHED_ULPS bf16 ulps at the output's scale (benchmarks/ns_deviation.py measures
at most 1.5); a wrong transpose, coefficient or normalisation is tens of ulps off or more.
"""

import copy

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from benchmarks.ns_deviation import scale_ulps
from titan_dmuon.math.matrix_blocks import row_blocks
from titan_dmuon.math.muon_update import muon_step
from titan_dmuon.math.ns_methods import NS_COEFFICIENTS, newton_schulz, ns_flops
from titan_dmuon.math.update_rules import adjusted_lr, exact_mode_refusal

BATCHED_ULPS = 4.0  # batched vs per-matrix Newton-Schulz, in bf16 ulps at the output's scale
# Weights after a few batched steps vs torch.optim.Muon: each step's update is lr * scale * NS, off by
# at most BATCHED_ULPS ulps of NS's scale (2^-8 relative at |NS| < 1): lr 0.05 * 1.5 * 4 * 2^-8 ~ 1e-3.
BATCHED_WEIGHT_TOLERANCE = 2e-3


@pytest.mark.parametrize("shape", [(5, 3), (3, 5), (8, 8), (96, 32), (1, 7), (16, 32)])
@pytest.mark.parametrize("batch", [1, 4, 5, 16])
def test_batched_newton_schulz_is_torch_up_to_gemm_rounding(shape, batch):
    torch.manual_seed(0)
    stack = torch.randn(batch, *shape)
    expected = torch.stack([_zeropower_via_newtonschulz(g, NS_COEFFICIENTS, 5, 1e-7) for g in stack]).float()
    assert scale_ulps(newton_schulz(stack).float() - expected, expected) <= BATCHED_ULPS


def test_the_batched_bound_catches_a_wrong_newton_schulz():
    """The bound is tight enough to fail: one Newton-Schulz iteration short is far outside it."""
    torch.manual_seed(0)
    stack = torch.randn(4, 16, 32)
    expected = torch.stack([_zeropower_via_newtonschulz(g, NS_COEFFICIENTS, 5, 1e-7) for g in stack]).float()
    wrong = newton_schulz(stack, steps=4).float()
    assert scale_ulps(wrong - expected, expected) > 10 * BATCHED_ULPS


def test_newton_schulz_orthogonalises():
    torch.manual_seed(0)
    x = newton_schulz(torch.randn(1, 16, 64))[0].float()
    singular = torch.linalg.svdvals(x)
    assert singular.min() > 0.5 and singular.max() < 1.5  # the quintic's band, not exactly 1


def test_newton_schulz_rejects_non_batched_input():
    with pytest.raises(ValueError, match=r"\(batch, rows, cols\)"):
        newton_schulz(torch.randn(4, 4))


@pytest.mark.parametrize("ns_mode", ["exact", "batched"])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw", "spectral_unclamped"])
def test_muon_step_is_torch_muon(ns_mode, nesterov, adjust_lr_fn):
    """exact: bitwise, every step; batched: within the GEMM-rounding bound. Five (16, 32) matrices
    make a batch that some kernels round differently from one matrix at a time."""
    if exact_mode_refusal(adjust_lr_fn) is not None:
        pytest.skip(f"torch {torch.__version__}'s torch.optim.Muon has no {adjust_lr_fn!r} (torch >= 2.14)")
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s)) for s in [(12, 8), (8, 12), (12, 8), (5, 5)] + [(16, 32)] * 5]
    reference = copy.deepcopy(params)
    opt = torch.optim.Muon(
        reference, lr=0.05, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn
    )
    buffers = [torch.zeros_like(p) for p in params]
    for step in range(3):
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(reference, grads):
            p.grad = g.clone()
        opt.step()
        with torch.no_grad():
            count = muon_step(
                params,
                grads,
                buffers,
                [row_blocks(p.shape) for p in params],
                lr=0.05,
                weight_decay=0.1,
                momentum=0.9,
                nesterov=nesterov,
                ns_steps=5,
                adjust_lr_fn=adjust_lr_fn,
                ns_mode=ns_mode,
            )
        assert count == 9
        for mine, ref in zip(params, reference):
            if ns_mode == "exact":
                assert torch.equal(mine, ref), step
            else:
                assert (mine - ref).abs().max() < BATCHED_WEIGHT_TOLERANCE, step


@pytest.mark.parametrize("split", [None, [8, 4, 4], [[(0, 2), (8, 10)], [(2, 8)], [(10, 16)]]])
def test_exact_mode_on_blocks_and_experts_is_torch_muon_per_matrix(split):
    """A fused weight's row blocks (contiguous or interleaved) and a 3-D stack of experts: each
    matrix is torch.optim.Muon's separate weight, bitwise, momentum included."""
    torch.manual_seed(0)
    experts = torch.randn(3, 16, 6)
    blocks = row_blocks((16, 6), split)
    leaves = [torch.nn.Parameter(torch.cat([experts[e][a:b] for a, b in block])) for e in range(3) for block in blocks]
    opt = torch.optim.Muon(leaves, lr=0.05, weight_decay=0.1, momentum=0.9)
    buffer = torch.zeros_like(experts)
    for _ in range(3):
        grad = torch.randn_like(experts)
        for leaf, (e, block) in zip(leaves, [(e, b) for e in range(3) for b in blocks]):
            leaf.grad = torch.cat([grad[e][a:b] for a, b in block])
        opt.step()
        count = muon_step(
            [experts],
            [grad],
            [buffer],
            [blocks],
            lr=0.05,
            weight_decay=0.1,
            momentum=0.9,
            nesterov=True,
            ns_steps=5,
            ns_mode="exact",
        )
        assert count == 3 * len(blocks)
        for leaf, (e, block) in zip(leaves, [(e, b) for e in range(3) for b in blocks]):
            assert torch.equal(torch.cat([experts[e][a:b] for a, b in block]), leaf)
            assert torch.equal(torch.cat([buffer[e][a:b] for a, b in block]), opt.state[leaf]["momentum_buffer"])


def test_split_rows_equal_separate_matrices():
    """A fused (q; k; v) weight split by rows gets the update of three separate weights."""
    torch.manual_seed(0)
    parts = [torch.randn(8, 6), torch.randn(4, 6), torch.randn(4, 6)]
    grads = [torch.randn_like(p) for p in parts]
    separate = [p.clone() for p in parts]
    fused = torch.cat(parts)
    muon_step(
        separate,
        grads,
        [torch.zeros_like(p) for p in parts],
        [row_blocks(p.shape) for p in parts],
        lr=0.1,
        weight_decay=0.1,
        momentum=0.9,
        nesterov=True,
        ns_steps=5,
    )
    muon_step(
        [fused],
        [torch.cat(grads)],
        [torch.zeros_like(fused)],
        [row_blocks(fused.shape, [8, 4, 4])],
        lr=0.1,
        weight_decay=0.1,
        momentum=0.9,
        nesterov=True,
        ns_steps=5,
    )
    assert torch.equal(fused, torch.cat(separate))


def test_interleaved_blocks_equal_separate_matrices():
    """Grouped layout [q0 q1 k v | q2 q3 k v] (TorchTitan's fused wqkv): blocks of row ranges."""
    torch.manual_seed(0)
    hd = 2
    q, k, v = torch.randn(4 * hd, 6), torch.randn(2 * hd, 6), torch.randn(2 * hd, 6)
    gq, gk, gv = torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)

    def interleave(a, b, c):
        return torch.cat(
            [
                torch.cat([a[g * 2 * hd : (g + 1) * 2 * hd], b[g * hd : (g + 1) * hd], c[g * hd : (g + 1) * hd]])
                for g in range(2)
            ]
        )

    fused, grad = interleave(q, k, v), interleave(gq, gk, gv)
    group = 4 * hd
    blocks = row_blocks(
        fused.shape,
        [
            [(g * group, g * group + 2 * hd) for g in range(2)],
            [(g * group + 2 * hd, g * group + 3 * hd) for g in range(2)],
            [(g * group + 3 * hd, (g + 1) * group) for g in range(2)],
        ],
    )
    separate = [q.clone(), k.clone(), v.clone()]
    kwargs = dict(lr=0.1, weight_decay=0.1, momentum=0.9, nesterov=True, ns_steps=5)
    muon_step(
        separate,
        [gq, gk, gv],
        [torch.zeros_like(t) for t in separate],
        [row_blocks(t.shape) for t in separate],
        **kwargs,
    )
    muon_step([fused], [grad], [torch.zeros_like(fused)], [blocks], **kwargs)
    assert torch.equal(fused, interleave(*separate))


@pytest.mark.parametrize("split", [[3, 3], [4, 4, 1], [[(0, 4)], [(3, 8)]], [[(0, 4)]]])
def test_bad_splits_are_rejected(split):
    with pytest.raises(ValueError, match="split_rows"):
        row_blocks((8, 4), split)


def test_adjusted_lr_matches_torch():
    from torch.optim._muon import _adjust_lr

    for fn in (None, "original", "match_rms_adamw", "spectral_unclamped"):
        if exact_mode_refusal(fn) is not None:  # (torch < 2.14 has no "spectral_unclamped")
            continue
        for shape in [(4, 16), (16, 4), (7, 7)]:
            assert adjusted_lr(0.02, fn, shape) == _adjust_lr(0.02, fn, torch.Size(shape))
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        adjusted_lr(0.02, "bogus", (4, 4))


def test_ns_flops_symmetric_and_growing():
    assert ns_flops(64, 256) == ns_flops(256, 64)
    assert ns_flops(128, 256) > ns_flops(64, 256)


def test_shapes_equal_up_to_transpose_share_one_batch(monkeypatch):
    """w1 (hidden, dim) and w2 (dim, hidden) are one batch of (dim, hidden) matrices; a fused q/k/v
    counts one Newton-Schulz matrix per block; the result stays torch.optim.Muon's, bit for bit."""
    from titan_dmuon.math import muon_update

    batches = []
    original = muon_update.orthogonalise_wide_
    monkeypatch.setattr(
        muon_update, "orthogonalise_wide_", lambda x, **k: batches.append(tuple(x.shape)) or original(x, **k)
    )
    torch.manual_seed(0)
    params = [torch.randn(12, 8), torch.randn(8, 12), torch.randn(24, 8)]  # w1, w2, a fused (8; 8; 8) q/k/v
    reference = [torch.nn.Parameter(p.clone()) for p in params[:2]] + [
        torch.nn.Parameter(t.clone()) for t in params[2].split(8)
    ]
    grads = [torch.randn_like(p) for p in params]
    count = muon_step(
        params,
        grads,
        [torch.zeros_like(p) for p in params],
        [row_blocks(p.shape) for p in params[:2]] + [row_blocks(params[2].shape, [8, 8, 8])],
        lr=0.05,
        weight_decay=0.1,
        momentum=0.9,
        nesterov=True,
        ns_steps=5,
    )
    assert count == 5 and sorted(batches) == [(2, 8, 12), (3, 8, 8)]
    for p, g in zip(reference, grads[:2] + list(grads[2].split(8))):
        p.grad = g.clone()
    torch.optim.Muon(reference, lr=0.05, weight_decay=0.1, momentum=0.9).step()
    for mine, theirs in ((params[0], reference[0]), (params[1], reference[1]), (params[2], torch.cat(reference[2:]))):
        assert (mine - theirs).abs().max() < BATCHED_WEIGHT_TOLERANCE


def test_stack_cap_splits_batches_without_changing_the_update(monkeypatch):
    from titan_dmuon.math import muon_update, ns_methods

    torch.manual_seed(0)
    params = [torch.randn(8, 12) for _ in range(5)]
    grads = [torch.randn_like(p) for p in params]

    def run(cap):
        monkeypatch.setattr(ns_methods, "MAX_STACK_BYTES", cap)
        batches = []
        original = muon_update.orthogonalise_wide_
        monkeypatch.setattr(
            muon_update, "orthogonalise_wide_", lambda x, **k: batches.append(x.shape[0]) or original(x, **k)
        )
        out = [p.clone() for p in params]
        muon_step(
            out,
            grads,
            [torch.zeros_like(p) for p in params],
            [row_blocks(p.shape) for p in params],
            lr=0.05,
            weight_decay=0.1,
            momentum=0.9,
            nesterov=True,
            ns_steps=5,
        )
        monkeypatch.setattr(muon_update, "orthogonalise_wide_", original)
        return out, batches

    whole, whole_batches = run(2**30)
    capped, capped_batches = run(2 * 8 * 12 * 2)  # two bf16 8 x 12 matrices per batch
    assert whole_batches == [5] and capped_batches == [2, 2, 1]
    # other batch sizes: the same update up to GEMM rounding
    assert all((a - b).abs().max() < BATCHED_WEIGHT_TOLERANCE for a, b in zip(whole, capped))


def test_capped_batches_are_smaller_for_a_method_with_a_larger_workspace(monkeypatch):
    """At the stack cap each method's batch holds as many matrices as keep its Newton-Schulz
    workspace within the standard iteration's at the cap (no method needs more memory than "torch"
    there). On six bf16 8 x 32 matrices (Gram Newton-Schulz runs on them: long > 1.5 short) with a
    cap of four such matrices: "torch" and "polar_express" hold X, its next value, X X^T and the
    polynomial, 2*8*32 + 2*8*8 = 640 elements a matrix, and go 4 + 2; Gram holds X and its next
    value and six 8 x 8 products, 2*8*32 + 6*8*8 = 896: 4 * 640 // 896 = 2 a batch, 2 + 2 + 2.
    Regression: the cap test covered "torch" only, so Gram's batches were never checked against
    its larger workspace (memory only: the results are the same)."""
    from titan_dmuon.math import muon_update, ns_methods

    short, long = 8, 32
    monkeypatch.setattr(ns_methods, "MAX_STACK_BYTES", 4 * short * long * 2)
    standard = 2 * short * long + 2 * short * short
    workspace = {"torch": standard, "polar_express": standard, "gram": 2 * short * long + 6 * short * short}
    original = muon_update.orthogonalise_wide_
    for method, expected in (("torch", [4, 2]), ("polar_express", [4, 2]), ("gram", [2, 2, 2])):
        assert ns_methods.uses_gram(short, long) or method != "gram"
        batches = []
        monkeypatch.setattr(
            muon_update, "orthogonalise_wide_", lambda x, **k: batches.append(x.shape[0]) or original(x, **k)
        )
        muon_update.orthogonalise([torch.randn(short, long) for _ in range(6)], ns_method=method)
        assert batches == expected, (method, batches)
        assert max(batches) * workspace[method] <= 4 * standard  # within the standard iteration's at the cap


def test_orthogonalise_exact_is_torch_muon_newton_schulz_on_the_bf16_input():
    """The TP step sends the bf16 of Muon's input to the NS home; torch.optim.Muon casts its fp32 input
    to bf16 first, so the exact mode on the bf16 matrix is bitwise Muon's NS of the fp32 one; the
    batched mode is within its stated bound (here: same shapes share one call)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    from titan_dmuon.math.muon_update import orthogonalise

    g = torch.Generator().manual_seed(3)
    matrices = [torch.randn(shape, generator=g) for shape in [(24, 40), (40, 24), (24, 40), (16, 16)]]
    exact = orthogonalise([m.bfloat16() for m in matrices], ns_mode="exact")
    for m, o in zip(matrices, exact):
        assert torch.equal(o, _zeropower_via_newtonschulz(m, (3.4445, -4.7750, 2.0315), 5, 1e-7))
    batched = orthogonalise([m.bfloat16() for m in matrices], ns_mode="batched")
    for o, b in zip(exact, batched):
        assert b.shape == o.shape and (b.float() - o.float()).abs().max() <= 2 * 2**-8 * o.float().abs().max()


def test_local_block_rows_of_tensor_parallel_shards():
    """A fused q/k/v block's rows of the full matrix, as each column-wise TP shard holds them (with
    where they sit in the block); a row-wise shard holds every row of every block."""
    from titan_dmuon.math.matrix_blocks import local_block_rows

    q = ((0, 32), (64, 96))  # 2 kv groups of 64 rows; each of 2 tp ranks holds one group
    assert local_block_rows(q, tp_dim=0, tp_rank=0, local_rows=64) == [(0, 32, 0)]
    assert local_block_rows(q, tp_dim=0, tp_rank=1, local_rows=64) == [(0, 32, 32)]
    k = ((32, 48), (96, 112))
    assert local_block_rows(k, tp_dim=0, tp_rank=1, local_rows=64) == [(32, 48, 16)]
    assert local_block_rows(((0, 10), (20, 30)), tp_dim=1, tp_rank=1, local_rows=30) == [(0, 10, 0), (20, 30, 10)]
    assert local_block_rows(((0, 128),), tp_dim=0, tp_rank=1, local_rows=64) == [(0, 64, 64)]
