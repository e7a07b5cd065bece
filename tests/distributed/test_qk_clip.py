"""QK-clip (MuonClip): the math against naive formulas, the options, and DMuon with the clip
against a single-process reference written here (torch.optim.Muon + torch.optim.AdamW + the
clip rule applied by hand: S per head from the full logits matrix, then per-head row loops).

Tolerances: ns_mode="exact" (torch.optim.Muon's own update per matrix). Without the clip this
toy run already differs from the reference by 1.2e-4 after one step (gradient sums in another
order, amplified by bf16 Newton-Schulz); with the clip the difference is the same after one step
(1.2e-4) and <= 8e-4 after four (S is read from weights that differ by that much), inside
helpers.TOLERANCE (1e-3). The same runs without the clip are 2e-2 to 7e-2 away, so a wrong rule
(k scaled under GQA, alpha ignored, gamma not applied, the reduce missing) fails.
"""

import copy

import pytest
import torch
from torch import nn

from tests.support.helpers import (
    ADAMW,
    MUON,
    TOLERANCE,
    batches,
    distribute,
    full_state,
    global_loss,
    local_slice,
    max_diff,
    toy_model,
)
from titan_dmuon import DMuon, DMuonOptions
from titan_dmuon.math.qk_clip_factors import clip_factors, max_logits, role_exponent, row_map, scale_rows
from titan_dmuon.optim.qk_clip import QKClipAttention
from titan_dmuon.options import OptionError
from titan_dmuon.testing.toy_model import loss_fn, muon_targets, qk_clip_attention

TAU = 1.0  # the toy model's initial per-head maxima are 0.68-1.35: some heads clip, some do not
STEPS = 4


# ---- math ---------------------------------------------------------------------------------------------
def _naive_max(q, k, scale, causal=True):
    """The full [B, H, Lq, Lk] logits (BNLH), GQA by repeating key heads, causal by a triangle."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = (q.double() @ k.double().transpose(-1, -2)) * scale
    lq, lk = q.shape[2], k.shape[2]
    if causal:
        mask = torch.ones(lq, lk, dtype=torch.bool).triu(lk - lq + 1)
        logits = logits.masked_fill(mask, float("-inf"))
    return logits.amax(dim=(0, 2, 3))


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("chunk", [1, 37, 1 << 22])
@pytest.mark.parametrize("causal", [True, False])
def test_chunked_max_equals_naive(heads, kv_heads, chunk, causal):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, heads, 11, 8, generator=g)
    k = torch.randn(3, kv_heads, 11, 8, generator=g)
    want = _naive_max(q, k, 0.3, causal)
    got = max_logits(q, k, scale=0.3, causal=causal, layout="BNLH", chunk_elements=chunk)
    assert got.dtype == torch.float32 and got.shape == (heads,)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    # (B, L, N, H) layout: the same numbers
    got_blnh = max_logits(q.transpose(1, 2), k.transpose(1, 2), scale=0.3, causal=causal, chunk_elements=chunk)
    torch.testing.assert_close(got_blnh, got, rtol=0, atol=0)


def test_chunked_max_more_keys_than_queries_and_bf16():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 2, 5, 4, generator=g), torch.randn(2, 2, 9, 4, generator=g)
    torch.testing.assert_close(
        max_logits(q, k, scale=1.0, layout="BNLH", chunk_elements=8).double(), _naive_max(q, k, 1.0)
    )
    qb, kb = q.bfloat16(), k.bfloat16()
    torch.testing.assert_close(
        max_logits(qb, kb, scale=1.0, layout="BNLH").double(),
        _naive_max(qb.float(), kb.float(), 1.0),
        rtol=1e-6,
        atol=1e-6,
    )


def test_chunk_bounds_memory():
    """The largest logits chunk alive stays within chunk_elements (one query row at the least)."""
    seen = []
    real = torch.matmul

    def spy(a, b):
        out = real(a, b)
        seen.append(out.numel())
        return out

    q, k = torch.randn(2, 4, 64, 8), torch.randn(2, 4, 64, 8)
    torch.matmul = spy
    try:
        max_logits(q, k, scale=1.0, layout="BNLH", chunk_elements=4096)
    finally:
        torch.matmul = real
    assert len(seen) > 1 and max(seen) <= 4096 < 2 * 4 * 64 * 64


def test_clip_factors():
    s = torch.tensor([0.5, 2.0, 4.0, float("-inf"), float("nan"), 1.0])
    got = clip_factors(s, 1.0)
    assert got.tolist()[:4] == [1.0, 0.5, 0.25, 1.0] and got[4] == 1.0 and got[5] == 1.0


def _factors(attention, alpha, gamma):
    """Per weight, the per-row factor the rule gives (by scaling a weight of ones)."""
    out = {}
    by_param = {}
    for part in attention.rows:
        by_param.setdefault(part.param, []).append(
            (part.heads, role_exponent(part.role, alpha=alpha, shared_keys=attention.shared_keys))
        )
    for param, parts in by_param.items():
        head, exponent = row_map(param.shape[0], parts)
        w = torch.ones(param.shape)
        scale_rows(w, gamma, head, exponent)
        out[param] = w[:, 0]
        assert torch.equal(w, w[:, :1].expand_as(w))
    return out


GAMMA = torch.tensor([0.25, 1.0, 0.5, 1.0])  # heads 0 and 2 clipped


def test_rows_mha_separate():
    wq, wk = nn.Parameter(torch.empty(8, 3)), nn.Parameter(torch.empty(8, 3))
    a = QKClipAttention.separate(nn.Identity(), wq=wq, wk=wk, n_heads=4, head_dim=2)
    f = _factors(a, 0.25, GAMMA)
    q_want = torch.tensor([0.25**0.25] * 2 + [1.0] * 2 + [0.5**0.25] * 2 + [1.0] * 2)
    k_want = torch.tensor([0.25**0.75] * 2 + [1.0] * 2 + [0.5**0.75] * 2 + [1.0] * 2)
    torch.testing.assert_close(f[wq], q_want)
    torch.testing.assert_close(f[wk], k_want)
    assert f[wq][2:4].eq(1.0).all() and f[wk][6:].eq(1.0).all()  # exactly 1: unclipped rows bitwise


def test_rows_gqa_scales_queries_only():
    wq, wk = nn.Parameter(torch.empty(8, 3)), nn.Parameter(torch.empty(4, 3))
    a = QKClipAttention.separate(nn.Identity(), wq=wq, wk=wk, n_heads=4, n_kv_heads=2, head_dim=2)
    f = _factors(a, 0.5, GAMMA)
    assert wk not in f  # the shared key rows are not touched
    assert f[wq].tolist() == [0.25] * 2 + [1.0] * 2 + [0.5] * 2 + [1.0] * 2


def test_rows_fused_grouped_and_blocks():
    # TorchTitan's grouped layout: [kv group][2 q heads, k, v][head_dim 1], 2 groups -> 8 rows
    w = nn.Parameter(torch.empty(8, 3))
    f = _factors(QKClipAttention.fused(nn.Identity(), wqkv=w, n_heads=4, n_kv_heads=2, head_dim=1), 0.5, GAMMA)
    assert f[w].tolist() == [0.25, 1.0, 1.0, 1.0, 0.5, 1.0, 1.0, 1.0]  # q0 q1 k v | q2 q3 k v
    # MHA grouped: [q, k, v] per head
    w = nn.Parameter(torch.empty(12, 3))
    f = _factors(QKClipAttention.fused(nn.Identity(), wqkv=w, n_heads=4, head_dim=1), 0.5, GAMMA)
    torch.testing.assert_close(f[w], torch.tensor([0.5, 0.5, 1, 1, 1, 1, 0.5**0.5, 0.5**0.5, 1, 1, 1, 1]))
    # blocks [all q | all k | all v], MHA
    w = nn.Parameter(torch.empty(12, 3))
    f = _factors(QKClipAttention.fused(nn.Identity(), wqkv=w, n_heads=4, head_dim=1, grouped=False), 0.5, GAMMA)
    torch.testing.assert_close(f[w], torch.tensor([0.5, 1, 0.5**0.5, 1, 0.5, 1, 0.5**0.5, 1, 1, 1, 1, 1]))


def test_rows_mla():
    # 2 heads, nope 2, rope 1, v 3: wq rows per head [n n r], wkv_b rows per head [kn kn v v v]
    wq, wkv_b = nn.Parameter(torch.empty(6, 4)), nn.Parameter(torch.empty(10, 4))
    a = QKClipAttention.mla(
        nn.Identity(), wq=wq, wkv_b=wkv_b, n_heads=2, qk_nope_head_dim=2, qk_rope_head_dim=1, v_head_dim=3
    )
    f = _factors(a, 0.5, torch.tensor([0.25, 1.0]))
    assert f[wq].tolist() == [0.5, 0.5, 0.25, 1.0, 1.0, 1.0]  # nope sqrt(gamma), rope gamma
    assert f[wkv_b].tolist() == [0.5, 0.5, 1.0, 1.0, 1.0] + [1.0] * 5  # k nope sqrt(gamma), v untouched
    assert a.head_dim == 3 and not a.shared_keys


@pytest.mark.parametrize("alpha", [0.25, 0.8])
def test_rows_mla_splits_the_factor_by_alpha(alpha):
    """MLA at alpha != 0.5, where gamma ** alpha and gamma ** (1 - alpha) differ (at 0.5 they are
    equal, so a k_nope scaled by gamma ** alpha passed every MLA test): the rule, written out per row,
    is non-rotary q gamma ** alpha, rotary q gamma, non-rotary k gamma ** (1 - alpha) (their product
    on a nope logit and on a rope logit both gamma), v and the shared rotary key untouched."""
    wq, wkv_b = nn.Parameter(torch.empty(6, 4)), nn.Parameter(torch.empty(10, 4))
    a = QKClipAttention.mla(
        nn.Identity(), wq=wq, wkv_b=wkv_b, n_heads=2, qk_nope_head_dim=2, qk_rope_head_dim=1, v_head_dim=3
    )
    g = torch.tensor([0.25, 1.0])
    f = _factors(a, alpha, g)
    nope_q, nope_k = g[0] ** alpha, g[0] ** (1.0 - alpha)
    torch.testing.assert_close(f[wq], torch.tensor([nope_q, nope_q, g[0], 1.0, 1.0, 1.0]))
    torch.testing.assert_close(f[wkv_b], torch.tensor([nope_k, nope_k, 1.0, 1.0, 1.0] + [1.0] * 5))
    torch.testing.assert_close(f[wq][0] * f[wkv_b][0], g[0])  # a nope logit scaled by gamma


# ---- options --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,key",
    [
        ({"qk_clip_threshold": 0.0}, "qk_clip_threshold"),
        ({"qk_clip_threshold": -1.0}, "qk_clip_threshold"),
        ({"qk_clip_threshold": float("nan")}, "qk_clip_threshold"),
        ({"qk_clip_threshold": float("inf")}, "qk_clip_threshold"),
        ({"qk_clip_threshold": "10"}, "qk_clip_threshold"),
        ({"qk_clip_alpha": 1.5}, "qk_clip_alpha"),
        ({"qk_clip_alpha": -0.1}, "qk_clip_alpha"),
    ],
)
def test_option_errors(kwargs, key):
    with pytest.raises(OptionError) as e:
        DMuonOptions(**kwargs)
    assert e.value.key == key and key in str(e.value)


def test_options_valid():
    o = DMuonOptions(qk_clip_threshold=100, qk_clip_alpha=0.0)
    assert o.qk_clip_threshold == 100 and "qk_clip_threshold" not in o.muon()


def _errors_one_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from titan_dmuon import dedicate_params

    out = {}
    model = toy_model()
    handle = dedicate_params(model, muon_targets(model), init_device_mesh("cpu", (1,)))
    try:
        DMuon(model.parameters(), dedicated=handle, qk_clip_threshold=1.0)
    except ValueError as e:
        out["no_attention"] = str(e)
    try:
        DMuon([{"params": list(model.parameters()), "qk_clip_threshold": 1.0}], dedicated=handle)
    except OptionError as e:
        out["group"] = e.key
    handle.remove()
    model = toy_model()
    wk = {id(layer.attention.wq.weight) for layer in model.layers}
    handle = dedicate_params(model, [p for p in muon_targets(model) if id(p) not in wk], init_device_mesh("cpu", (1,)))
    try:
        DMuon(model.parameters(), dedicated=handle, qk_clip_threshold=1.0, qk_clip_attention=qk_clip_attention(model))
    except ValueError as e:
        out["not_dedicated"] = str(e)
    handle.remove()
    return out


def test_clip_errors(pool1):
    out = pool1.run(_errors_one_rank)[0]
    assert "no attention layer was described" in out["no_attention"]
    assert out["group"] == "qk_clip_threshold"
    assert "not a dedicated weight" in out["not_dedicated"]


# ---- DMuon with the clip vs the single-process reference ---------------------------------------------------
def _reference(model, data, *, tau, alpha, muon=MUON, adamw=ADAMW):
    """torch.optim.Muon + AdamW on the global batch, then the clip rule by hand, head by head."""
    model = copy.deepcopy(model)
    targets = muon_targets(model)
    ids = {id(p) for p in targets}
    opt_muon = torch.optim.Muon(targets, **muon)
    opt_adamw = torch.optim.AdamW(
        [p for p in model.parameters() if id(p) not in ids],
        lr=adamw["adamw_lr"],
        betas=adamw["adamw_betas"],
        eps=adamw["adamw_eps"],
        weight_decay=adamw["adamw_weight_decay"],
    )
    seen = {}

    def hook(i, module, args, kwargs, out):
        q, k = args[0], args[1]
        s = _naive_max(q.detach(), k.detach(), q.shape[-1] ** -0.5).float()
        seen[i] = s if i not in seen else torch.maximum(seen[i], s)

    hooks = [
        layer.attention.inner_attention.register_forward_hook(lambda *a, i=i: hook(i, *a), with_kwargs=True)
        for i, layer in enumerate(model.layers)
    ]
    losses, maxima, clipped, per_step_s = [], [], [], []
    for x, y in data:
        seen.clear()
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.item())
        opt_muon.step()
        opt_adamw.step()
        opt_muon.zero_grad()
        opt_adamw.zero_grad()
        maxima.append(max(s.max().item() for s in seen.values()))
        clipped.append(sum(int((s > tau).sum()) for s in seen.values()))
        per_step_s.append({i: s.clone() for i, s in seen.items()})
        with torch.no_grad():
            for i, layer in enumerate(model.layers):
                a = layer.attention
                hd, gqa = a.head_dim, a.n_kv_heads < a.n_heads
                for h in range(a.n_heads):
                    s = seen[i][h].item()
                    if not s > tau:
                        continue
                    gamma = torch.tensor(tau / s, dtype=torch.float32)
                    rows = slice(h * hd, (h + 1) * hd)
                    if gqa:
                        a.wq.weight[rows] *= gamma
                    else:
                        a.wq.weight[rows] *= torch.pow(gamma, torch.tensor(alpha))
                        a.wk.weight[rows] *= torch.pow(gamma, torch.tensor(1.0 - alpha))
    for h in hooks:
        h.remove()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses, maxima, clipped, per_step_s


def _vs_reference(rank, world, mode, kv_heads, alpha, steps=STEPS, tau=TAU, no_grad_forwards=False):
    data = batches(steps)
    model = toy_model(n_kv_heads=kv_heads)
    ref, ref_losses, ref_max, ref_clipped, _ = _reference(model, data, tau=tau, alpha=alpha)
    unclipped, _, _, _, _ = _reference(model, data, tau=float("inf"), alpha=alpha)
    swapped, _, _, _, _ = _reference(model, data, tau=tau, alpha=1.0 - alpha)
    setup = distribute(copy.deepcopy(model), mode, world, opt_kwargs={"ns_mode": "exact"})
    opt = DMuon(
        setup.model.parameters(),
        dedicated=setup.handle,
        qk_clip_attention=qk_clip_attention(setup.model),
        **{**MUON, **ADAMW, "ns_mode": "exact", "qk_clip_threshold": tau, "qk_clip_alpha": alpha},
    )
    losses, maxima, clipped = [], [], []
    for batch in data:
        x, y = local_slice(batch, rank, world)
        loss = loss_fn(setup.module(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        stats = opt.last_step_stats
        if no_grad_forwards:  # an evaluation between steps, its logits 100 times the training batch's
            _forward_with_large_logits(setup, x)
        maxima.append(stats["qk_max_logit"])
        clipped.append(stats["qk_clipped_heads"])
    state = full_state(setup)
    return {
        "diff": max_diff(state, ref),
        "unclipped_diff": max_diff(state, unclipped),
        "swapped_diff": max_diff(state, swapped),
        "losses": global_loss(losses),
        "ref_losses": ref_losses,
        "maxima": maxima,
        "ref_max": ref_max,
        "clipped": clipped,
        "ref_clipped": ref_clipped,
    }


def _check(results):
    for r in results:
        assert r["diff"] < TOLERANCE, r["diff"]
        assert r["unclipped_diff"] > 10 * TOLERANCE  # the clip bound: without it the weights differ
        assert r["losses"] == pytest.approx(r["ref_losses"], abs=1e-4)
        # S at step 1 (the same weights everywhere) to fp32 rounding; later steps see weights that agree
        # to TOLERANCE (as without the clip), so S to 2e-3
        assert r["maxima"][0] == pytest.approx(r["ref_max"][0], rel=1e-6)
        assert r["maxima"] == pytest.approx(r["ref_max"], rel=2e-3)
        assert r["clipped"] == r["ref_clipped"] and r["clipped"][0] > 0
    return results[0]


@pytest.mark.parametrize(
    "mode,kv_heads", [("z2", 4), ("z2", 2), ("z3", 2), ("ddp", 2)], ids=["z2-mha", "z2-gqa", "z3-gqa", "ddp-gqa"]
)
def test_two_ranks_match_reference(pool2, mode, kv_heads):
    _check(pool2.run(_vs_reference, mode, kv_heads, 0.5 if kv_heads == 4 else 0.3))


def test_alpha_splits_the_factor_between_q_and_k(pool2):
    """Z3, MHA, alpha 0.2: matches the reference with alpha 0.2 and is far from the one with 0.8
    (q and k exponents not swapped, alpha not ignored)."""
    r = _check(pool2.run(_vs_reference, "z3", 4, 0.2))
    assert r["swapped_diff"] > 10 * TOLERANCE


def _forward_with_large_logits(setup, x) -> None:
    scale_qk = [
        layer.attention.inner_attention.register_forward_pre_hook(
            lambda module, args, kwargs: ((args[0] * 10, args[1] * 10, *args[2:]), kwargs), with_kwargs=True
        )
        for layer in setup.model.layers
    ]
    with torch.no_grad():
        setup.module(x)
    for hook in scale_qk:
        hook.remove()


def test_no_grad_forwards_are_not_captured(pool2):
    """Z3, GQA: a forward under torch.no_grad() after each step (an evaluation), whose q and k are
    scaled by 10 (logits 100 times the training batch's: every head far above tau), leaves the
    next step's S, the clipped heads and gamma (the weights) the reference's: the capture counts
    the training forwards only. (Counted, S would be ~100 and every head clipped.)"""
    _check(pool2.run(_vs_reference, "z3", 2, 0.3, STEPS, TAU, True))


def test_hsdp_matches_reference(pool4):
    """HSDP 2 x 2, MHA: S all-reduced over the shard and the replicate group, the rescale on the
    global owner before the replica broadcast."""
    _check(pool4.run(_vs_reference, "hsdp", 4, 0.5))


# ---- the invariant ---------------------------------------------------------------------------------------
def _attention_inputs(model, x):
    """Each attention layer's input on the global batch x."""
    seen = []
    hooks = [
        layer.attention.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
        for layer in model.layers
    ]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return seen


def _layer_max(x, wq, wk, n_heads, n_kv_heads):
    b, s, _ = x.shape
    hd = wq.shape[0] // n_heads
    q = (x @ wq.T).view(b, s, n_heads, hd).transpose(1, 2)
    k = (x @ wk.T).view(b, s, n_kv_heads, hd).transpose(1, 2)
    return _naive_max(q, k, hd**-0.5)


def _invariant(rank, world, kv_heads):
    """lr = 0: the step changes the weights only by the clip. Recomputing the step's logits (each
    layer's input as in the step) from the clipped weights gives max <= tau per head, = tau for the
    clipped ones; unclipped heads' rows and logits are bitwise unchanged, as is every other weight."""
    data = batches(1)
    model = toy_model(n_kv_heads=kv_heads)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    inputs = _attention_inputs(model, data[0][0])
    zero = {"lr": 0.0, "adamw_lr": 0.0, "ns_mode": "exact"}
    setup = distribute(copy.deepcopy(model), "z3", world, opt_kwargs=zero)
    opt = DMuon(
        setup.model.parameters(),
        dedicated=setup.handle,
        qk_clip_attention=qk_clip_attention(setup.model),
        **{**MUON, **ADAMW, **zero, "qk_clip_threshold": TAU},
    )
    x, y = local_slice(data[0], rank, world)
    loss_fn(setup.module(x), y).backward()
    opt.step()
    opt.zero_grad()
    after = full_state(setup)
    out = {"clipped": [], "kept": [], "rows_same": [], "others_same": True}
    a0 = model.layers[0].attention
    hd = a0.head_dim
    for i, x_i in enumerate(inputs):
        wq, wk = f"layers.{i}.attention.wq.weight", f"layers.{i}.attention.wk.weight"
        s0 = _layer_max(x_i, before[wq], before[wk], a0.n_heads, a0.n_kv_heads)
        s1 = _layer_max(x_i, after[wq], after[wk], a0.n_heads, a0.n_kv_heads)
        for h in range(a0.n_heads):
            rows = slice(h * hd, (h + 1) * hd)
            clipped = s0[h].item() > TAU
            (out["clipped"] if clipped else out["kept"]).append((s0[h].item(), s1[h].item()))
            out["rows_same"].append((clipped, torch.equal(after[wq][rows], before[wq][rows])))
        if kv_heads < a0.n_heads:  # GQA: the key weight is untouched
            out["others_same"] &= torch.equal(after[wk], before[wk])
    for name in after:
        if ".wq." not in name and ".wk." not in name:
            out["others_same"] &= torch.equal(after[name], before[name])
    return out


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_invariant_after_clip(pool2, kv_heads):
    r = pool2.run(_invariant, kv_heads)[0]
    assert r["clipped"] and r["kept"]
    for s0, s1 in r["clipped"]:
        assert s0 > TAU and s1 <= TAU * (1 + 1e-5) and s1 == pytest.approx(TAU, rel=1e-5)
    for s0, s1 in r["kept"]:
        assert s1 == s0  # bitwise: its q (and k) rows were multiplied by exactly 1
    for was_clipped, same in r["rows_same"]:
        assert same != was_clipped
    assert r["others_same"]


# ---- no host sync ---------------------------------------------------------------------------------------
def _clip_host_syncs(rank, world, mode):
    from tests.support.measure import host_syncs_in_steady_steps

    setup = distribute(toy_model(n_kv_heads=4), mode, world)
    setup.opt = DMuon(
        setup.model.parameters(),
        dedicated=setup.handle,
        qk_clip_attention=qk_clip_attention(setup.model),
        **{**MUON, **ADAMW, "qk_clip_threshold": 0.3},
    )
    clipped = []
    syncs = host_syncs_in_steady_steps(  # (the figures are read outside the counted step)
        setup, rank, world, after_step=lambda: clipped.append(setup.opt.last_step_stats["qk_clipped_heads"])
    )
    return syncs, sum(clipped)


def test_no_host_sync_with_the_clip(pool2):
    """Capture, the MAX all-reduce, gamma and the rescale stay on the device (the figures are read
    at log time only); the clip was binding in the counted steps."""
    for syncs, clipped in pool2.run(_clip_host_syncs, "z3"):
        assert syncs == [] and clipped > 0


# ---- activation checkpointing -------------------------------------------------------------------------
def _checkpointed_capture(rank, world, ac):
    """The toy model's blocks under activation checkpointing: as TorchTitan wraps them
    (non-reentrant; ``ac`` "full", or "selective" with a policy that saves the matmuls, as
    TorchTitan's does), "reentrant", or none. Pass 1 is a pipeline's metadata inference: forward
    and backward (which recomputes the checkpointed forwards) with the capture paused. Pass 2 is
    a training step."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    import titan_dmuon.optim.qk_clip as qk_clip_module

    forward_ops = []  # (pass, op) the selective policy was asked about in the checkpointed forwards
    saved = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default}

    def policy(ctx, func, *args, **kwargs):
        if not ctx.is_recompute:
            forward_ops.append((current[0], str(func)))
        return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE

    model = toy_model()
    if ac is not None:
        kwargs = {
            "full": {},
            "reentrant": {"checkpoint_impl": CheckpointImpl.REENTRANT},
            "selective": {"context_fn": lambda: create_selective_checkpoint_contexts(policy)},
        }[ac]
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer, **kwargs)
    setup = distribute(model, "z3", world)
    opt = DMuon(
        setup.model.parameters(),
        dedicated=setup.handle,
        qk_clip_attention=qk_clip_attention(setup.model),
        **{**MUON, **ADAMW, "qk_clip_threshold": TAU},
    )
    captures, real = [], qk_clip_module.max_logits
    qk_clip_module.max_logits = lambda *a, **kw: (captures.append(current[0]), real(*a, **kw))[1]
    current = [1]
    try:
        x, y = batches(1)[0]
        with opt.qk_clip.paused():
            loss_fn(setup.module(x), y).backward()
        opt.zero_grad()
        current[0] = 2
        loss_fn(setup.module(x), y).backward()
        opt.step()
    finally:
        qk_clip_module.max_logits = real
    return {
        "captures": captures,
        "s": opt.qk_clip.max_logits_by_layer(),
        "ops": [[op for p, op in forward_ops if p == n] for n in (1, 2)],
    }


def test_capture_under_activation_checkpointing(pool1):
    """Full and selective activation checkpointing (as TorchTitan applies them) and reentrant
    checkpointing against none. Regressions: the capture ran again in each recompute (twice the
    cost under full AC); its ops (q . k^T in chunks) ran inside selective AC's dispatch modes, so
    a checkpointed region saved the capture's logits for backward (the policy saves matmul
    outputs) and, when the forward's capture was paused (a pipeline's metadata inference) but its
    recompute's was not, the recompute asked for ops the forward never recorded ("... not found
    in storage"). Now: one capture per layer and forward (reentrant: in its recompute, its forward
    runs under no_grad), none while paused; the checkpointed forward records exactly the ops it
    records without the capture; and step 1's S per head equal the same job's without
    checkpointing, bitwise (the same forward ops in one process)."""
    straight = pool1.run(_checkpointed_capture, None)[0]
    layers = len(straight["s"])
    assert straight["captures"] == [2] * layers
    for ac in ("full", "selective", "reentrant"):
        r = pool1.run(_checkpointed_capture, ac)[0]
        assert r["captures"] == [2] * layers, (ac, r["captures"])
        assert r["s"].keys() == straight["s"].keys()
        for name, s in r["s"].items():
            assert torch.equal(s, straight["s"][name]), (ac, name)
        if ac == "selective":
            assert r["ops"][0] and r["ops"][1] == r["ops"][0]
