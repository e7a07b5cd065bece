"""QK-clip with TorchTitan: the config keys and refusals, the rule on TorchTitan's own attention
modules (llama3 fused / separate GQA, deepseek_v3 MLA with wq or wq_a/wq_b) in-process on 2
gloo ranks, and pipelining and activation checkpointing (TorchTitan's trainer on the debug models:
tests/titan/test_trainer_jobs_features.py)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.support.titan_configs import MOE, one_line_error, parse_args, toml_file
from titan_dmuon.integration.names import Metric
from titan_dmuon.optim.optimizer import StepStat

pytestmark = pytest.mark.usefixtures("in_repo_root")  # (tests/titan/conftest.py)


# ---- config ------------------------------------------------------------------------------------------
def test_keys_reach_the_container_from_toml_and_the_command_line(tmp_path):
    from titan_dmuon.integration.config.toml_file import load_config

    body = '[model]\nname = "llama3"\nflavor = "debugmodel"\n[optimizer]\nname = "dmuon"\nqk_clip_threshold = 50.0\n'
    opt = load_config(toml_file(tmp_path, body), ["--optimizer.qk_clip_alpha", "0.25"], world_size=2).optimizer
    assert (opt.qk_clip_threshold, opt.qk_clip_alpha) == (50.0, 0.25)
    config = parse_args("--optimizer.qk_clip_threshold", "3.5")
    assert config.optimizer.qk_clip_threshold == 3.5 and config.optimizer.qk_clip_alpha == 0.5


def test_bad_values_and_qwen3_and_compile_are_refused(tmp_path):
    from titan_dmuon.integration.config.toml_file import load_config

    llama = '[model]\nname = "llama3"\nflavor = "debugmodel"\n[optimizer]\nname = "dmuon"\n'
    message = one_line_error(load_config, toml_file(tmp_path, llama + "qk_clip_threshold = -1.0\n"), world_size=2)
    assert "qk_clip_threshold" in message and "> 0" in message
    message = one_line_error(load_config, toml_file(tmp_path, llama + "qk_clip_alpha = 2.0\n"), world_size=2)
    assert "qk_clip_alpha" in message
    qwen3 = MOE.replace('name = "dmuon"\n', 'name = "dmuon"\nqk_clip_threshold = 100.0\n')
    message = one_line_error(load_config, toml_file(tmp_path, qwen3), world_size=2)
    assert "qk_clip_threshold" in message and "q_norm" in message and "qwen3" in message
    compiled = llama + "qk_clip_threshold = 1.0\n[compile]\nenable = true\n"
    message = one_line_error(load_config, toml_file(tmp_path, compiled), world_size=2)
    assert "qk_clip_threshold" in message and "compile" in message
    adamw = llama.replace('"dmuon"', '"AdamW"') + "qk_clip_threshold = 1.0\n"
    assert "qk_clip_threshold" in one_line_error(load_config, toml_file(tmp_path, adamw), world_size=2)


def test_with_dmuon_takes_the_keys():
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from titan_dmuon import with_dmuon

    config = with_dmuon(llama3_debugmodel(), qk_clip_threshold=10.0, qk_clip_alpha=0.3)
    assert (config.optimizer.qk_clip_threshold, config.optimizer.qk_clip_alpha) == (10.0, 0.3)


# ---- the rule on TorchTitan's attention modules ---------------------------------------------------------------
def _naive(q, k, scale):
    """Max logit per query head from the full matrix; q, k (B, L, N, H), causal."""
    q, k = q.transpose(1, 2).double(), k.transpose(1, 2).double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = q @ k.transpose(-1, -2) * scale
    length = q.shape[2]
    logits = logits.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    return logits.amax(dim=(0, 2, 3))


def _titan_rule(rank, world, family, kwargs):
    """Muon lr 0 and AdamW lr 1e-30 (below the weights' resolution): the step changes only what the clip rescales.
    tau is set to the median of layer 0's heads, measured by an independent hook in the step's forward;
    after the step the same forward's layer-0 logits are <= tau (= tau for the clipped heads;
    layer 0's input does not depend on any clipped weight) and the unclipped heads' are unchanged."""
    from torchtitan.models.common.attention import BaseAttention

    from tests.support import titan_harness as th

    model_and_spec = th.tiny_llama3(**kwargs) if family == "llama3" else th.tiny_deepseek_v3(**kwargs)
    dims = th.parallel_dims(world)
    model, container = th.build(
        model_and_spec, dims, param_dtype="float32", lr=0.0, adamw_lr=1e-30, qk_clip_threshold=1e9
    )
    (opt,) = container.dmuon_optimizers()
    attention = next(m for m in model.modules() if isinstance(m, BaseAttention))
    seen = []
    attention.inner_attention.register_forward_hook(
        lambda m, args, kw, out: seen.append(
            _naive(args[0].detach(), args[1].detach(), kw.get("scale") or args[0].shape[-1] ** -0.5)
        ),
        with_kwargs=True,
    )
    tokens = th.batches(1, world)[0]
    b = tokens.shape[0] // world
    local = tokens[rank * b : (rank + 1) * b]
    loss = F.cross_entropy(model(local[:, :-1]).flatten(0, 1).float(), local[:, 1:].flatten())
    loss.backward()
    before = seen[-1].float()
    dist.all_reduce(before, op=dist.ReduceOp.MAX)
    tau = before.median().item()
    opt.qk_clip.threshold = tau
    weights_before = {n: _local(p).clone() for n, p in model.named_parameters()}
    container.step()
    container.zero_grad()
    stats = opt.last_step_stats
    with torch.no_grad():
        model(local[:, :-1])
    after = seen[-1].float()
    dist.all_reduce(after, op=dist.ReduceOp.MAX)
    changed = [n for n, p in model.named_parameters() if p.numel() and not torch.equal(_local(p), weights_before[n])]
    return {"before": before, "after": after, "tau": tau, "stats": stats, "changed": changed}


def _local(p):
    from torch.distributed.tensor import DTensor

    p = p.detach()
    return p.to_local() if isinstance(p, DTensor) else p


@pytest.mark.parametrize(
    "family,kwargs",
    [
        ("llama3", {"fuse_qkv": True}),
        ("llama3", {"fuse_qkv": False}),
        ("deepseek_v3", {"q_lora_rank": 0}),
        ("deepseek_v3", {"q_lora_rank": 16}),
    ],
    ids=["llama3-fused-gqa", "llama3-separate-gqa", "deepseek_v3-mla-wq", "deepseek_v3-mla-wq_b"],
)
def test_rule_on_titan_attention(pool2, family, kwargs):
    results = pool2.run(_titan_rule, family, kwargs)
    for r in results:
        clipped = r["before"] > r["tau"]
        assert clipped.any() and not clipped.all()
        torch.testing.assert_close(
            r["after"][clipped], torch.full_like(r["after"][clipped], r["tau"]), rtol=1e-5, atol=0
        )
        # unclipped heads: their rows are multiplied by exactly 1 (bitwise: tests/distributed/test_qk_clip.py); the
        # recomputed logits agree to one fp32 ulp (MKL's GEMM rounding depends on the buffers' alignment)
        torch.testing.assert_close(r["after"][~clipped], r["before"][~clipped], rtol=1e-6, atol=0)
        assert r["stats"]["qk_clipped_heads"] >= int(clipped.sum())
        assert r["stats"]["qk_max_logit"] >= r["before"].max().item() * (1 - 1e-6)
    # among the layers' weights (owners only hold the full dedicated ones), only the clipped q/k weights moved
    changed = sorted({n for r in results for n in r["changed"] if n.startswith("layers.")})
    allowed = ("wqkv", "wq.", "wk.") if family == "llama3" else ("wq.", "wq_b.", "wkv_b.")
    assert changed and all(any(a in n for a in allowed) for n in changed), changed
    if family == "llama3":
        assert not any("wk." in n for n in changed)  # GQA: the shared key heads are left alone


# ---- pipeline parallelism and activation checkpointing ----------------------------------------------------------
PP_TAU = 0.05


def _clip_job(rank, world, state, schedule=None, ac="none", steps=3):
    """tiny llama3 (2 layers) with the clip on 4 ranks: FSDP 4 (``schedule`` None), or pipelining
    over 2 ranks (1F1B: 2 stages; Interleaved1F1B: 4, 2 per rank) x FSDP 2 (4 micro-batches of 1
    sample per data-parallel rank), with TorchTitan's activation checkpointing ``ac``. Returns the
    losses, this rank's weights, each step's figures, step 1's S per head by layer and the
    captures each step ran (``max_logits`` calls)."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    import titan_dmuon.optim.qk_clip as qk_clip_module
    from tests.support import titan_harness as th
    from tests.support.helpers import full_parameters
    from tests.support.titan_outputs import pp_weights

    ac_config = {"none": None, "selective": SelectiveAC.Config(), "full": FullAC.Config()}[ac]
    kwargs = {"state": state, "lr": 0.02, "param_dtype": "float32", "qk_clip_threshold": PP_TAU, "ac_config": ac_config}
    if schedule is None:
        dims = th.parallel_dims(world)
        model, container = th.build(th.tiny_llama3(), dims, **kwargs)
        parts = [model]
        train = lambda batch: th.train(model, container, dims, [batch])
    else:
        dims = th.pp_dims(world)
        built = th.build_pp(th.tiny_llama3(), dims, schedule=schedule, local_batch=4, **kwargs)
        parts, container = built[1], built[-1]
        train = lambda batch: th.train_pp(dims, built, [batch])
    optimizers = container.dmuon_optimizers()
    losses, stats, captures, by_layer = [], [], [], {}
    real = qk_clip_module.max_logits
    qk_clip_module.max_logits = lambda *a, **kw: (captures.__setitem__(-1, captures[-1] + 1), real(*a, **kw))[1]
    try:
        for step, batch in enumerate(th.batches(steps, 1, batch=8)):
            captures.append(0)
            losses += train(batch)
            stats.append([opt.last_step_stats for opt in optimizers])
            if step == 0:
                by_layer = {k: v for opt in optimizers for k, v in opt.qk_clip.max_logits_by_layer().items()}
    finally:
        qk_clip_module.max_logits = real
    if schedule is None:
        weights = full_parameters(model, optimizers[0].dedicated_handles()[0])
    else:
        weights = pp_weights(parts)
    layers = sum(len(part.layers or {}) for part in parts)
    return {"losses": losses, "weights": weights, "stats": stats, "s": by_layer, "captures": captures, "layers": layers}


@pytest.fixture(scope="module")
def clip_jobs(pool4):
    """The same job without pipelining and with 1F1B, neither checkpointed, 3 steps each."""
    from tests.support import titan_harness as th

    state = th.initial_state(th.tiny_llama3())
    return state, pool4.run(_clip_job, state), pool4.run(_clip_job, state, "1F1B")


def test_pipeline_stages_clip_as_without_pipelining(clip_jobs):
    """llama3 with 2 pipeline stages (one layer each, 1F1B) x 2 FSDP ranks against the same job on 4
    FSDP ranks. Regression: the pipeline's metadata inference at the first step runs the second
    stage's forward on uninitialised inputs, whose logits (NaN here) the capture took into step 1's
    S (that stage then did not clip at step 1, and reported NaN); the capture is paused there:
    each stage's DMuon captures, reduces and clips its own layer; weights agree to the tolerance of
    tests/titan/test_pipeline.py without the clip (3e-3: gradients summed in another order, amplified by
    bf16 Newton-Schulz). tau = 0.05 binds on every head at step 1 (checked on step 1's figures: the
    last step's count depends on how far the clip already pulled S down, which made a check of it
    flaky); a stage that did not clip would be off by about the q rows' size."""
    from tests.support.helpers import max_diff, merge_rank_states

    _, straight, piped = clip_jobs
    # step 1 (the initial weights: every head's S is 0.08-0.12 here), every head of every stage binds
    assert straight[0]["stats"][0][0]["qk_clipped_heads"] == 8
    for r in piped:
        # each stage clipped its own 4 heads
        assert len(r["stats"][0]) == 1 and r["stats"][0][0]["qk_clipped_heads"] == 4
    weights = merge_rank_states([r["weights"] for r in piped])
    assert max_diff(weights, straight[0]["weights"]) < 3e-3
    last_stage = next(r["losses"] for r in piped if r["losses"][0] is not None)
    assert last_stage == pytest.approx(straight[0]["losses"], rel=1e-4)


def _clip_matrix(rank, world, state, jobs):
    return [_clip_job(rank, world, state, schedule, ac, steps=1) for schedule, ac in jobs]


def test_clip_under_every_activation_checkpointing_with_and_without_pipelining(pool4, clip_jobs):
    """QK-clip x TorchTitan's activation checkpointing {none, selective, full} x {no pipelining,
    1F1B, Interleaved1F1B}: step 1's S of every head of every layer equals the job's without
    pipelining and checkpointing, and each rank ran one capture per layer it holds and micro-batch
    (4 with pipelining; none in a recompute or the metadata inference). Regressions: under
    selective AC a pipelined job stopped at step 1 ("aten.transpose.int invocation index 4
    encountered during backward but not found in storage"): the capture, paused in the metadata
    inference's forward, ran in the recompute of its backward, inside selective AC's caching mode;
    under full AC a later stage's recompute there captured the logits of uninitialised inputs (NaN
    S at step 1, and Interleaved1F1B's first rank, whose second stage it was, logged the other
    stage's figure). Without checkpointing the forwards are the same ops on the same data:
    equal bitwise; with pipelining the micro-batches of 1 sample round the projections (fp32
    GEMMs of other shapes) to a few ulps: 1e-5 relative (a wrong capture, NaN or uninitialised
    memory, is off by far more)."""
    from tests.support.helpers import merge_rank_states

    state, straight, piped = clip_jobs
    jobs = [
        (None, "selective"),
        (None, "full"),
        ("1F1B", "selective"),
        ("1F1B", "full"),
        ("Interleaved1F1B", "none"),
        ("Interleaved1F1B", "selective"),
        ("Interleaved1F1B", "full"),
    ]
    results = pool4.run(_clip_matrix, state, jobs)
    reference = straight[0]["s"]
    assert len(reference) == 2 and all(torch.isfinite(s).all() for s in reference.values())
    runs = [((None, "none"), straight), (("1F1B", "none"), piped)]
    runs += [(job, [per_rank[i] for per_rank in results]) for i, job in enumerate(jobs)]
    for (schedule, ac), ranks in runs:
        merged = merge_rank_states([r["s"] for r in ranks])  # (the ranks of a stage agree bitwise)
        assert merged.keys() == reference.keys(), (schedule, ac)
        for name, s in merged.items():
            if schedule is None:
                assert torch.equal(s, reference[name]), (ac, name)
            else:
                torch.testing.assert_close(s, reference[name], rtol=1e-5, atol=0, msg=f"{schedule} {ac} {name}")
        for r in ranks:
            assert r["captures"][0] == r["layers"] * (1 if schedule is None else 4), (schedule, ac, r["captures"])


def test_log_figure_shows_a_stage_s_nan():
    """The log's max logit over a rank's pipeline stages. Regression: Python's max hid a stage's NaN
    behind the other stage's figure (Interleaved1F1B's first rank logged 0.5953, a NaN stage unseen)."""
    import math

    from titan_dmuon.integration.trainer import qk_clip_figures

    logit, heads = StepStat.QK_MAX_LOGIT, StepStat.QK_CLIPPED_HEADS
    for stats in (
        [{logit: 0.6, heads: 2}, {logit: math.nan, heads: 0}],
        [{logit: math.nan, heads: 0}, {logit: 0.6, heads: 2}],
    ):
        figures = qk_clip_figures(stats)
        assert math.isnan(figures[Metric.QK_MAX_LOGIT]) and figures[Metric.QK_CLIPPED_HEADS] == 2.0
    assert qk_clip_figures([{logit: 0.6, heads: 1}, {logit: 0.7, heads: 3}, {StepStat.NS_MATRICES: 4}]) == {
        Metric.QK_MAX_LOGIT: 0.7,
        Metric.QK_CLIPPED_HEADS: 4.0,
    }
    assert qk_clip_figures([{StepStat.NS_MATRICES: 4}]) == {}
