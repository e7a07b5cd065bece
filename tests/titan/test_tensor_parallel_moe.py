"""Tensor parallelism on TorchTitan's MoE models (spmd_types backend), on 4 gloo ranks.

TP 2 x FSDP 2 against FSDP 4 without tensor parallelism from the same weights and global batches
(itself checked against torch.optim.Muon + AdamW in test_titan_models.py / test_moe.py), as
tests/titan/test_tensor_parallel.py does for dense models. Two tiny models cover the layouts:

* qwen3 MoE, 8 experts: TorchTitan keeps whole experts per data-parallel rank (dim-0 shards: 8
  experts >= dp 2 x tp 2), each split by TP (w1/w3 on their rows, w2 on its columns); each rank's
  TP group assembles every expert on one home (balanced with the dense matrices) for Newton-Schulz;
  the router, which every tp rank holds whole, gets its gradient summed over TP on its home;
* deepseek_v3 (MLA with a q LoRA, a dense first layer, shared experts), 2 experts: fewer experts
  than dp x tp ranks, so TorchTitan would split each expert on dim 1 and DMuon dedicates each
  expert weight instead (its T TP shards at one owner coordinate, each expert homed separately);
  MLA's wq_a/wkv_a are replicated over TP like the router.

Routing is forced round-robin (TorchTitan's ``debug.moe_force_load_balance``): TP sums each
matmul in another order, and a top-k choice between two nearly equal scores may then go the other
way, which moves a token to another expert: a change of the model's computation (as between any two
layouts, with any optimizer), not of the optimizer's arithmetic. With forced routing every token
meets the same experts in both layouts.
"""

from fractions import Fraction

import pytest
import torch

from tests.support import titan_harness as th  # noqa: I001 (enables the CPU accommodations first)
from tests.support.helpers import full_parameters, merge_rank_states
from tests.support.tp_moe_jobs import (
    DEEPSEEK_EXPERTS,
    LAYOUTS,
    MUON_WEIGHTS,
    STEPS,
    tp_moe_model,
    tp_moe_momentum,
    train_tp_moe,
)
from titan_dmuon.runtime import CommLabel

ADAMW_LR = 1e-3  # DMuonOptions' default adamw_lr


def _ns_per_step(family: str, experts: int) -> int:
    """Newton-Schulz matrices in one step of the whole job: every matrix once, each expert once."""
    if family == "qwen3":  # 2 layers: q, k, v blocks of the fused wqkv, wo, router, 3 weights of E experts
        return 2 * (4 + 1 + 3 * experts)
    # layer 0: wq_a, wq_b, wkv_a, wkv_b, wo, dense w1/w2/w3; layers 1-2 the same attention, router,
    # shared w1/w2/w3 and 3 weights of E experts
    return 8 + 2 * (5 + 1 + 3 + 3 * experts)


# ---- the two layouts, from the same weights -------------------------------------------------------------


@pytest.fixture(scope="module", params=list(LAYOUTS))
def runs(request, pool4):
    """(family, FSDP 4 results, TP 2 x FSDP 2 results), per rank."""
    family, experts = request.param, LAYOUTS[request.param]
    state = th.initial_state(tp_moe_model(family, experts))
    return (
        family,
        pool4.run(train_tp_moe, family, experts, state, 1),
        pool4.run(train_tp_moe, family, experts, state, 2),
    )


def _check_trains_as_fsdp(reference, results, *, initial=None):
    """Step 1 equal (TP changes matmul reduction orders: 1e-6 on the loss, 1e-5 on the norm), the
    losses within 1e-4 over the steps; after them the Muon weights within 2e-3 (bf16 Newton-Schulz
    amplifies the gradients' last-bit differences: the dense TP tests' tolerance) and the AdamW
    ones within 2 lr per step (Adam's first steps move every element with a nonzero gradient by
    about lr whatever its size, so an element whose gradient is within rounding of zero may step
    either way)."""
    weights = merge_rank_states(r["weights"] for r in results)  # (every rank's copy of a weight agrees bitwise)
    ref_weights = merge_rank_states(r["weights"] for r in reference)
    assert weights.keys() == ref_weights.keys()
    for r in results:
        assert r["losses"][0] == pytest.approx(reference[0]["losses"][0], rel=1e-6)
        assert r["norms"][0] == pytest.approx(reference[0]["norms"][0], rel=1e-5)
        assert r["losses"] == pytest.approx(reference[0]["losses"], rel=1e-4)
    diff = {k: (weights[k] - ref_weights[k]).abs().max().item() for k in weights}
    muon = {k: d for k, d in diff.items() if k.endswith(MUON_WEIGHTS)}
    assert max(muon.values()) < 2e-3, sorted(muon.items(), key=lambda kv: -kv[1])[:4]
    assert max(d for k, d in diff.items() if k not in muon) < 2 * ADAMW_LR * len(results[0]["losses"])
    if initial is not None:  # (the weights did train)
        assert max((weights[k] - initial[k]).abs().max().item() for k in muon if k in initial) > 1e-2


def test_tp_moe_trains_as_fsdp_without_tp(runs):
    """TP 2 x FSDP 2 trains TorchTitan's MoE models as FSDP 4 does (tolerances in
    _check_trains_as_fsdp); Newton-Schulz ran once per matrix and once per expert in the whole job
    (summed over the ranks: FSDP 4's count), each through torch.optim.Muon's own iteration
    (ns_mode="exact": every step); the experts are where the module docstring says."""
    family, reference, results = runs
    _check_trains_as_fsdp(reference, results, initial=th.initial_state(tp_moe_model(family, LAYOUTS[family])))
    expected = _ns_per_step(family, LAYOUTS[family])
    assert sum(r["ns"] for r in results) == sum(r["ns"] for r in reference) == expected
    assert sum(r["exact_ns"] for r in results) == sum(r["exact_ns"] for r in reference) == expected * STEPS
    experts = [
        f"layers.{i}.moe.routed_experts.inner_experts.{w}"
        for i in (range(2) if family == "qwen3" else (1, 2))
        for w in ("w1_EFD", "w2_EDF", "w3_EFD")
    ]
    split = {"w1_EFD": 1, "w2_EDF": 2, "w3_EFD": 1}
    expected_layout = sorted((e, split[e.rsplit(".", 1)[1]]) for e in experts)
    for r in results:
        if family == "qwen3":  # kept in place, TP-split
            assert r["local"] == expected_layout and r["dedicated_3d"] == []
            assert r["replicated"] == ["layers.0.moe.router.gate.weight", "layers.1.moe.router.gate.weight"]
        else:  # dedicated, TP-split
            assert r["dedicated_3d"] == expected_layout and r["local"] == []
            assert {n.rsplit(".", 2)[1] for n in r["replicated"]} == {"gate", "wq_a", "wkv_a"}


def test_tp_moe_traffic_is_the_design(runs):
    """DMuon's collectives averaged over the 4 ranks are the design exactly: Z3 on the FSDP group for
    the TP-local elements, plus per matrix (per expert) of the TP exchange 2(T-1)/T^2 of its full
    elements (a replicated weight: its gradient to its home, the result back), for the experts kept
    in place in each data-parallel rank's TP group too (each rank's own count depends on which
    matrices it is the home of)."""
    family, _, results = runs
    mean = sum(Fraction(r["moved"]) for r in results) / len(results)
    assert mean == results[0]["design"] > 0
    labels = set().union(*(r["labels"] for r in results))
    assert set(CommLabel.tensor_parallel()) <= labels


def test_tp_moe_starts_where_adamw_starts(pool4):
    """From the same seed without a shared state, DMuon's TP 2 x FSDP 2 job and TorchTitan's AdamW on
    the same layout see the same step-1 loss and gradient norm: DMuon's dedicated TP shards (a
    dedicated expert's too, which TorchTitan shards on dim 1 strided over its TP split) and the
    weights TP replicates are initialised as TorchTitan initialises them, and the clip counts a
    replicated weight's gradient once (summed over TP on its home; 1e-5: summed in another order)."""
    for family, experts in LAYOUTS.items():
        adamw = pool4.run(train_tp_moe, family, experts, None, 2, 1, None, 1, "AdamW")
        dmuon = pool4.run(train_tp_moe, family, experts, None, 2, 1, None, 1)
        for a, d in zip(adamw, dmuon):
            assert d["losses"] == a["losses"]
            assert d["norms"][0] == pytest.approx(a["norms"][0], rel=1e-5)


def test_tp_with_expert_parallelism(pool4):
    """TP 2 x EP 2 x FSDP 2 (spmd_types; its expert all-to-all runs on gloo through the CPU
    accommodation for uneven splits): experts are whole on their EP rank (not TP-split) and each
    rank updates its own; attention, shared experts and dense layers go through the TP exchange,
    the router and wq_a/wkv_a through their TP homes. It trains as FSDP 4 (same tolerances), NS once
    per matrix and expert, traffic the design."""
    from tests.support.pool import WorkerPool

    experts = 8
    state = th.initial_state(tp_moe_model("deepseek_v3", experts))
    reference = pool4.run(train_tp_moe, "deepseek_v3", experts, state, 1)
    fresh = WorkerPool(4)  # (a worker's spmd_types annotations name the meshes of its first TP layout)
    try:
        results = fresh.run(train_tp_moe, "deepseek_v3", experts, state, 2, 2)
    finally:
        fresh.close()
    _check_trains_as_fsdp(reference, results)
    assert sum(r["ns"] for r in results) == sum(r["ns"] for r in reference) == _ns_per_step("deepseek_v3", experts)
    for r in results:
        assert len(r["local"]) == 6 and all(tp_dim is None for _, tp_dim in r["local"]) and r["dedicated_3d"] == []
    assert sum(Fraction(r["moved"]) for r in results) / len(results) == results[0]["design"]


def _uneven_all_to_all(rank, world):
    """Rank r sends r + 1 rows to each peer (TorchTitan's token exchange: uneven splits), through the
    torch.distributed that spmd_types calls."""
    import spmd_types._dist

    inputs = [torch.full((rank + 1, 3), float(10 * rank + peer)) for peer in range(world)]
    outputs = [torch.empty(peer + 1, 3) for peer in range(world)]
    spmd_types._dist.dist.all_to_all(outputs, inputs)
    return [o[:, 0].tolist() for o in outputs]


def test_spmd_types_uneven_all_to_all_runs_on_gloo(pool2):
    """gloo's list all_to_all requires equal sizes ("invalid tensor size"), and spmd_types exchanges
    expert-parallel tokens with it: the CPU accommodation runs it as gloo's all_to_all_single with
    split sizes. (Forced round-robin routing splits the tokens evenly, so test_tp_with_expert_parallelism
    does not meet uneven splits; the run_train.sh runs of the README do.)"""
    for rank, received in enumerate(pool2.run(_uneven_all_to_all)):
        assert received == [[float(10 * peer + rank)] * (peer + 1) for peer in range(2)]


def test_qk_clip_on_mla_under_tp(pool4):
    """QK-clip on deepseek_v3's MLA under TP 2 x FSDP 2: each TP rank holds whole heads of wq_b and
    wkv_b and its inner attention sees exactly their logits, so it clips its own heads' rows (wq_a
    and wkv_a, replicated, are not clipped). With a threshold most heads exceed at step 1 it trains
    as FSDP 4 with the clip: the same count of clipped heads (summed over the TP group), the same
    largest logit, losses and weights within the tolerances above."""
    family, experts = "deepseek_v3", DEEPSEEK_EXPERTS
    state = th.initial_state(tp_moe_model(family, experts))
    clip = {"qk_clip_threshold": 0.05}
    reference = pool4.run(train_tp_moe, family, experts, state, 1, 1, clip)
    results = pool4.run(train_tp_moe, family, experts, state, 2, 1, clip)
    _check_trains_as_fsdp(reference, results)
    for r in results:  # (of 3 layers x 4 heads, those above 0.05 at step 1: all but a few)
        assert r["first_step"]["qk_clipped_heads"] == reference[0]["first_step"]["qk_clipped_heads"] > 3 * 4 // 2
        assert r["first_step"]["qk_max_logit"] == pytest.approx(reference[0]["first_step"]["qk_max_logit"], rel=1e-5)


# ---- checkpoints ----------------------------------------------------------------------------------------
class _Job:
    """A tiny qwen3 MoE (2 experts: dedicated and TP-split under TP 2 x FSDP 2; dedicated under FSDP 4)
    with its DMuon container, LR schedule and TorchTitan's checkpoint manager."""

    def __init__(self, world, folder, *, tp, state, hf=False):
        from torchtitan.components.optimizer import LRSchedulersContainer

        from tests.support.helpers import Counter
        from titan_dmuon.integration.components.checkpoint import DMuonCheckpointManager

        self.dims = th.parallel_dims(world, tp=tp)
        model, self.container = th.build(tp_moe_model("qwen3", CHECKPOINT_EXPERTS), self.dims, state=state, lr=0.02)
        self.parts = [model]
        self.schedule = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=self.container, training_steps=4)
        self.counter = Counter()
        config, spec = tp_moe_model("qwen3", CHECKPOINT_EXPERTS)
        self.adapter = spec.state_dict_adapter(config, None) if hf else None
        manager = DMuonCheckpointManager.Config(
            enable=True, folder="ckpt", interval=2, last_save_model_only=hf, last_save_in_hf=hf
        )
        self.manager = manager.build(
            dataloader=Counter(),
            model_parts=self.parts,
            optimizers=self.container,
            lr_schedulers=self.schedule,
            states={"train_state": self.counter},
            sd_adapter=self.adapter,
            base_folder=folder,
        )
        self.data = th.batches(4, 1, batch=8)

    def handle(self):
        (handle,) = self.container.dmuon_optimizers()[0].dedicated_handles()
        return handle

    def train(self, until):
        losses = []
        while self.counter.step < until:
            losses += th.train(self.parts[0], self.container, self.dims, [self.data[self.counter.step]])
            self.schedule.step()
            self.counter.step += 1
            self.manager.save(self.counter.step, last_step=self.adapter is not None and self.counter.step == 4)
        return losses

    def state(self):
        """Full weights and full Muon momentum by name (each expert's assembled from its TP shards)."""
        handle = self.handle()
        weights = {f"weight/{k}": v for k, v in full_parameters(self.parts[0], handle).items()}
        return weights, tp_moe_momentum(self.container, handle, self.parts[0])


CHECKPOINT_EXPERTS = 2


def _train_and_keep(rank, world, folder, state, tp, until, hf=False):
    job = _Job(world, folder, tp=tp, state=state, hf=hf)
    losses = job.train(until)
    expected = None
    if hf:
        expected = th.hf_export_expected(full_parameters(job.parts[0], job.handle()), job.parts, job.adapter)
    return losses, *job.state(), expected


def _resume(rank, world, folder, tp, until, step=2):
    job = _Job(world, folder, tp=tp, state=None)
    assert job.manager.load(step=step)
    return job.train(until), *job.state()


def test_tp_moe_checkpoint_resumes_bit_exact_and_reshards(pool4, tmp_path):
    """A TP 2 x FSDP 2 MoE job (each expert weight dedicated and TP-split, the router replicated over
    TP) saves at step 2; a new job resumes it bit-exactly to step 4 (losses, every weight and
    momentum); the step-2 checkpoint loads into FSDP 4 and an FSDP 4 checkpoint into TP 2 x FSDP 2,
    with every expert's weight and momentum (and every other's) equal; the last save, in HF
    safetensors through qwen3's adapter, holds the full current weights, every expert split out."""
    from tests.support.helpers import assert_states_equal
    from tests.support.titan_outputs import check_hf_export

    state = th.initial_state(tp_moe_model("qwen3", CHECKPOINT_EXPERTS))
    straight = pool4.run(_train_and_keep, str(tmp_path / "tp"), state, 2, 4, True)
    resumed = pool4.run(_resume, str(tmp_path / "tp"), 2, 4)
    assert [r[0] for r in resumed] == [r[0][2:] for r in straight]
    for i in (1, 2):
        assert_states_equal(merge_rank_states(r[i] for r in resumed), merge_rank_states(r[i] for r in straight))
    momentum = merge_rank_states(r[2] for r in straight)
    assert {k for k in momentum if "inner_experts" in k} == {
        f"layers.{n}.moe.routed_experts.inner_experts.{w}" for n in range(2) for w in ("w1_EFD", "w2_EDF", "w3_EFD")
    }
    check_hf_export(str(tmp_path / "tp" / "ckpt" / "step-4"), merge_rank_states(r[3] for r in straight))
    at_two = pool4.run(_train_and_keep, str(tmp_path / "tp2"), state, 2, 2)
    into_fsdp = pool4.run(_resume, str(tmp_path / "tp2"), 1, 2)
    fsdp_at_two = pool4.run(_train_and_keep, str(tmp_path / "fsdp"), state, 1, 2)
    into_tp = pool4.run(_resume, str(tmp_path / "fsdp"), 2, 2)
    for loaded, saved in ((into_fsdp, at_two), (into_tp, fsdp_at_two)):
        for i in (1, 2):
            assert_states_equal(merge_rank_states(r[i] for r in loaded), merge_rank_states(r[i] for r in saved))
