"""The variants in training, on the gloo pools, against single-process references written in the tests.

* NorMuon (``normuon_beta2``): the toy transformer (dense, and with 3-D experts updated where FSDP2 keeps
  them) under DMuon-Z3 on 2 ranks and HSDP 2 x 2 on 4, against ``reference_train`` with NorMuon on each
  torch.optim.Muon leaf (``tests.support.helpers.reference_normuon`` in float32, the rule's own precision, one
  second moment per leaf; the reference sums the ranks' gradients in their order). Tolerance:
  helpers.TOLERANCE, the bf16 bound (batched Newton–Schulz is within a few bf16 ulps of torch's per-matrix
  one, and NorMuon keeps the update's Frobenius norm, so the weights stay within it); Muon itself ends
  more than 3x that far off after 4 steps, so the test sees the rule. With experts the jobs run
  ``ns_mode = "exact"`` (torch's own Newton–Schulz on both sides): top-k routing turns any last-bit
  difference of the router into another expert for some token, a difference no bound on the update
  covers (a float64 reference rule, 1e-8 off after one step, moved the routers 3e-3 in four).
* float16 iteration: the same toy job against ``reference_train`` with the float16 reference iteration.
* Per-head Newton–Schulz (``ns_blocks = "heads"``) on TorchTitan's families (llama3 fused wqkv, qwen3
  dense and MoE, deepseek_v3 with and without q_lora), with and without tensor parallelism, with and
  without NorMuon, ``ns_mode = "exact"``: before each step the full weight and gradient of every
  dedicated matrix are taken, and the reference steps each head block of them (cut here from the
  attention's head sizes) as its own torch.optim.Muon weight, carrying momentum and NorMuon's second
  moment across steps. Without NorMuon the weights are bitwise the reference's (torch's own update on
  the same blocks); with it within EXACT_NORMUON (the same float32 rule, written here).
"""

import pytest
import torch

from tests.support import titan_harness as th  # noqa: I001 (enables the CPU accommodations first)
from tests.support.helpers import (
    TOLERANCE,
    batches,
    distribute,
    full_state,
    max_diff,
    normuon_newton_schulz,
    reference_newton_schulz,
    reference_train,
    torch_muon_newton_schulz,
    toy_model,
    train,
)

BETA2 = 0.95
STEPS = 4
EXACT_NORMUON = 1e-6  # float32 rule vs the reference's float32 rule: a few float32 ulps of lr x |Ô| (lr 0.02, |Ô| < 5)
# Under TP the home's Ô travels back in the Newton–Schulz dtype (bf16, as every TP result): each entry rounded
# by at most 2^-9 of itself, per step: 2 steps x lr 0.02 x scale <= 2 x |Ô| <= 4 x 2^-9. A rule computed on a
# shard's part of the rows (dion's) or missing the Frobenius rescale is off by a sizeable part of lr x |Ô|.
TP_NORMUON = 2 * 0.02 * 2 * 4 * 2**-9
# float16 under TP against the float16 reference on the same bf16 inputs: batched vs per-matrix GEMMs (4 float16
# ulps of |O| <= 1.2) and Ô rounded to float16 (2^-11 of |Ô| <= 4), per step: 2 x 0.02 x 2 x (4 x 2^-10 + 4 x 2^-11)
FLOAT16_TP = 2 * 0.02 * 2 * (4 * 2**-10 + 4 * 2**-11)


# ---- NorMuon and float16 on the toy transformer ---------------------------------------------------------------
def _toy_vs_reference(rank, world, mode, experts, options):
    data = batches(STEPS)
    model = toy_model(num_experts=experts) if experts else toy_model()
    reference_options = {
        "normuon_beta2": options.get("normuon_beta2"),
        "ns_dtype": getattr(torch, options.get("ns_dtype", "bfloat16")),
    }
    ref, _, _ = reference_train(model, data, slices=world, **reference_options)  # (the ranks' gradient sums)
    muon_ref, _, _ = reference_train(model, data, slices=world)
    setup = distribute(model, mode, world, opt_kwargs=options)
    losses = train(setup, data, rank, world)
    state = full_state(setup)
    moments = sum(1 for s in setup.opt.state.values() if "normuon_second_moment" in s)
    return max_diff(state, ref), max_diff(state, muon_ref), [loss for loss, _, _ in losses], moments


@pytest.mark.parametrize("experts", [0, 4], ids=["dense", "experts"])
def test_normuon_matches_the_reference_on_two_ranks(pool2, experts):
    """DMuon-Z3 with NorMuon (dense, and with local experts: each expert its own matrix, its second
    moment a DTensor sharded with it) matches the single-process NorMuon reference."""
    options = {"normuon_beta2": BETA2, **({"ns_mode": "exact"} if experts else {})}
    results = pool2.run(_toy_vs_reference, "z3", experts, options)
    for diff, from_muon, _, _ in results:
        assert diff < TOLERANCE < from_muon / 3, (diff, from_muon)
    assert sum(m for *_, m in results) > 0


def test_normuon_matches_the_reference_under_hsdp_on_four_ranks(pool4):
    """HSDP 2 x 2 with experts: the global owner's second moment over the gradient summed over both
    replica groups (the reference sums per-rank slices in HSDP's order)."""
    for diff, from_muon, _, _ in pool4.run(_toy_vs_reference, "hsdp", 4, {"normuon_beta2": BETA2, "ns_mode": "exact"}):
        assert diff < TOLERANCE < from_muon / 3, (diff, from_muon)


def test_float16_newton_schulz_matches_its_reference_and_trains(pool2):
    """ns_dtype float16 with every method's default ("torch"): the reference iteration in float16
    (tests.support.helpers),
    within the bf16 bound; the loss falls."""
    for diff, _, losses, _ in pool2.run(_toy_vs_reference, "z3", 0, {"ns_dtype": "float16"}):
        assert diff < TOLERANCE, diff
        assert losses[-1] < losses[0]


# ---- per-head Newton–Schulz on TorchTitan's families --------------------------------------------------------
FAMILIES = {
    "llama3": lambda: th.tiny_llama3(fuse_qkv=True),
    "qwen3": lambda: th.tiny_qwen3(),
    "qwen3_moe": lambda: th.tiny_qwen3_moe(),
    "deepseek_v3": lambda: th.tiny_deepseek_v3(),
    "deepseek_v3_q_lora": lambda: th.tiny_deepseek_v3(q_lora_rank=24),
}
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=True)


def _head_blocks_here(model, fqn: str, shape) -> tuple[list, list]:
    """Row blocks and column blocks of a weight, per head, as this test cuts them from the attention's own
    head sizes: q/k/v and fused wqkv rows by head_dim; MLA's wq/wq_b rows by qk_nope + qk_rope, wkv_b's
    by qk_nope + v (one head's k and v together); wo's columns by head_dim (MLA: v_head_dim). Anything
    else whole."""
    rows, cols = shape
    name = fqn.rsplit(".", 2)
    module = model.get_submodule(fqn.split(".attention.")[0] + ".attention") if ".attention." in fqn else None
    if module is None or name[-2] in ("wq_a", "wkv_a"):
        return [(0, rows)], [(0, cols)]
    mla = hasattr(module, "wkv_b")
    step_rows = {
        "wqkv": getattr(module, "head_dim", 0),
        "wq": getattr(module, "head_dim", 0),
        "wk": getattr(module, "head_dim", 0),
        "wv": getattr(module, "head_dim", 0),
    }
    if mla:
        step_rows = {
            "wq": module.qk_nope_head_dim + module.qk_rope_head_dim,
            "wq_b": module.qk_nope_head_dim + module.qk_rope_head_dim,
            "wkv_b": module.qk_nope_head_dim + module.v_head_dim,
        }
    if name[-2] == "wo":
        step = module.v_head_dim if mla else module.head_dim
        return [(0, rows)], [(c, c + step) for c in range(0, cols, step)]
    step = step_rows[name[-2]]
    return [(r, r + step) for r in range(0, rows, step)], [(0, cols)]


def _heads_vs_reference(rank, world, family, tp, beta2, ns_dtype="bfloat16"):
    """Two steps; per dedicated matrix this rank holds (whole, or assembled from TP shards), the largest
    difference from the reference after each step, and how many matrices had several blocks. float16:
    the batched mode (the exact one is bf16), the reference's Newton–Schulz the float16 one."""
    dims = th.parallel_dims(world, tp=tp)
    options = dict(MUON, param_dtype="float32", ns_mode="exact", ns_blocks="heads")
    if ns_dtype != "bfloat16":
        options.update(ns_mode="batched", ns_dtype=ns_dtype)
    orthogonalise = None
    if ns_dtype != "bfloat16":  # (under TP its input reaches the home in bf16, the exchange's dtype)
        float16_iteration = reference_newton_schulz("torch", getattr(torch, ns_dtype))
        orthogonalise = lambda g, *args: float16_iteration(g.bfloat16() if tp > 1 else g, *args)  # noqa: E731
    if beta2 is not None:
        options["normuon_beta2"] = beta2
    model, container = th.build(FAMILIES[family](), dims, **options)
    (handle,) = container.dmuon_optimizers()[0].dedicated_handles()
    before: dict = {}

    def snapshot(params, max_norm):  # after backward, before the step (no clipping)
        for m in handle.members:
            if tp > 1:  # (a weight TP replicates has its summed gradient on its home only)
                full = (handle.tp_full(m, m.param.detach()).clone(), handle.tp_full(m, m.param.grad).clone())
                if m.entry.tp_dim is not None or m.entry.tp_homes[0] == handle.mode.tp.rank:
                    before[m.fqn] = full
            elif m.holds_full and m.runs_ns and m.param.grad is not None:
                before[m.fqn] = (m.param.detach().clone(), m.param.grad.clone())
        return torch.zeros(())

    references: dict = {}  # (fqn, expert, row block, column block) -> (leaf, its torch.optim.Muon, its NS)
    diffs, split = {}, 0
    for batch in th.batches(2, world // tp):
        before.clear()
        th.train(model, container, dims, [batch], clip=snapshot)
        for m in handle.members:
            if m.fqn not in before:
                continue
            weight, grad = before[m.fqn]
            after = handle.tp_full(m, m.param.detach()) if tp > 1 else m.param.detach()
            row_blocks, col_blocks = _head_blocks_here(model, m.fqn, weight.shape[-2:])
            split += len(row_blocks) * len(col_blocks) > 1
            expected = weight.clone()
            for e in range(weight.shape[0] if weight.ndim == 3 else 1):
                for r0, r1 in row_blocks:
                    for c0, c1 in col_blocks:
                        target = (
                            (e, slice(r0, r1), slice(c0, c1)) if weight.ndim == 3 else (slice(r0, r1), slice(c0, c1))
                        )
                        key = (m.fqn, e, r0, c0)
                        if key not in references:
                            leaf = torch.nn.Parameter(weight[target].clone())
                            fn = normuon_newton_schulz(orthogonalise, beta2) if beta2 is not None else orthogonalise
                            references[key] = (leaf, torch.optim.Muon([leaf], **MUON), fn)
                        leaf, opt, fn = references[key]
                        with torch.no_grad():
                            leaf.copy_(weight[target])
                        leaf.grad = grad[target].contiguous()
                        with torch_muon_newton_schulz(fn):
                            opt.step()
                        expected[target] = leaf.detach()
            diffs[m.fqn] = max(diffs.get(m.fqn, 0.0), (after - expected).abs().max().item())
    return diffs, split


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_per_head_newton_schulz_is_the_per_head_reference(pool2, family):
    """FSDP 2, no NorMuon: every dedicated matrix's two steps are bitwise torch.optim.Muon's on its head
    blocks (each block's learning rate of its own shape), the other matrices' on the whole matrix."""
    results = pool2.run(_heads_vs_reference, family, 1, None)
    assert sum(split for _, split in results) > 0
    for diffs, _ in results:
        assert all(d == 0.0 for d in diffs.values()), diffs


@pytest.mark.parametrize("family", ["llama3", "deepseek_v3"])
def test_per_head_and_normuon_under_tensor_parallelism(pool2, family):
    """TP 2 (wq/wk/wv, wqkv, wq/wkv_b split by rows, wo by columns: whole heads per rank; MLA's wkv_a
    replicated): each head block orthogonalised on its matrix's home, NorMuon there over the block's whole
    rows, the update applied on the shards. Without NorMuon bitwise; with it within TP_NORMUON of the
    reference rule on torch's own Newton–Schulz (Ô crosses the exchange in bf16)."""
    for beta2 in (None, BETA2):
        results = pool2.run(_heads_vs_reference, family, 2, beta2)
        for diffs, split in results:
            assert split > 0 and diffs
            bound = 0.0 if beta2 is None else TP_NORMUON
            assert max(diffs.values()) <= bound, diffs


def test_float16_per_head_and_normuon_under_tensor_parallelism(pool2):
    """TP 2 with float16 iteration: the homes normalise the bf16 inputs in float32, iterate in float16 and
    send float16 results back (head blocks written into a float16 buffer); within FLOAT16_TP of the
    float16 reference on the same bf16 inputs."""
    for diffs, split in pool2.run(_heads_vs_reference, "llama3", 2, BETA2, "float16"):
        assert split > 0 and max(diffs.values()) < FLOAT16_TP, diffs


def test_normuon_with_per_heads_on_a_moe_family(pool2):
    """qwen3 MoE on FSDP 2 with NorMuon and per-head blocks (dedicated matrices; the experts are covered
    by the toy tests above)."""
    for diffs, _split in pool2.run(_heads_vs_reference, "qwen3_moe", 1, BETA2):
        assert max(diffs.values()) <= EXACT_NORMUON, diffs


def test_reference_newton_schulz_is_not_the_identity():
    """(The reference's float16 iteration is a real iteration, so the float16 test can fail.)"""
    x = torch.randn(8, 16)
    out = reference_newton_schulz("torch", torch.float16)(x, (3.4445, -4.7750, 2.0315), 5, 1e-7)
    assert out.dtype == torch.float16 and not torch.allclose(out.float(), x / x.norm(), atol=1e-2)
