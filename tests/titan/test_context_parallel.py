"""Context parallelism (CP): TorchTitan's CP on this CPU (the accommodation of integration/cpu.py),
and DMuon under CP, each against the same job without CP.

Every comparison starts both jobs from the same weights (TorchTitan's random init depends on the FSDP
mesh, which CP enlarges: a seed checkpoint or ``state=`` gives both the same start) and gives them the
same global batch: without CP each data-parallel rank takes whole sequences, with CP 2 each sequence
is cut in 4 chunks and rank r of the cp pair takes chunks r and 3-r (TorchTitan's head-tail load
balancer), its attention reading every key at or before its queries' positions. Parameters are kept
in fp32 (``param_dtype``) so the jobs compute the same sums in other orders: the step-1 loss and
gradient norm agree to 1e-5 and 1e-4 relative. With DMuon, bf16 Newton-Schulz turns last-bit gradient
differences into 1-2 bf16 ulps of an update: weights within MUON_TOLERANCE.
"""

from fractions import Fraction

import pytest
import torch

from tests.support import titan_harness as th  # noqa: I001 (enables the CPU accommodations first)
from tests.support.helpers import TOLERANCE, full_parameters, merge_rank_states
from titan_dmuon.integration.distributed import context_parallel

STEPS = 3
LAYERS = 2
# DMuon's weights after 3 steps of two layouts: bf16 Newton-Schulz turns the gradients' last-bit differences
# (sums in other orders) into 1-2 bf16 ulps of an update (as between TP and FSDP: test_tensor_parallel.py;
# 1.1e-3 measured here on AVX2 kernels, ONEDNN_MAX_CPU_ISA=AVX2)
MUON_TOLERANCE = 2e-3


# ---- the pieces, in one process ---------------------------------------------------------------------


def _model():
    return th.tiny_llama3(n_layers=LAYERS)


def _data(global_batch: int):
    return th.batches(STEPS, 1, batch=global_batch)


def _llama3_job(rank, world, state, settings: dict):
    """One job of the tiny llama3 from ``state`` (None: TorchTitan's own initialisation with seed 0)
    (``settings``: cp, replicate, tp, optimizer, global_batch, steps and the optimizer's options):
    losses, gradient norms, the full weights; with DMuon its traffic per step after the first, by its
    own counts and by the CommLedger, the design's figure, the shard group, QK-clip's maxima."""
    from titan_dmuon.plan.cost_model import design_elements_per_rank
    from titan_dmuon.runtime import CommLabel
    from titan_dmuon.tools.ledger import CommLedger

    settings = dict(settings)
    cp, replicate, tp = (settings.pop(k, 1) for k in ("cp", "replicate", "tp"))
    optimizer, global_batch, steps = (
        settings.pop(k, d) for k, d in (("optimizer", "dmuon"), ("global_batch", 4), ("steps", STEPS))
    )
    if optimizer == "dmuon":
        settings.setdefault("ns_mode", "exact")  # (torch.optim.Muon's own Newton-Schulz, matrix by matrix)
    dims = th.parallel_dims(world, replicate=replicate, tp=tp, cp=cp)
    model, container = th.build(
        _model(), dims, optimizer=optimizer, state=state, lr=0.02, param_dtype="float32", **settings
    )
    data, norms = _data(global_batch)[:steps], []
    losses = th.train(model, container, dims, data[:1], norms=norms)
    out = {"losses": losses, "norms": norms}
    if steps == 1:
        return out
    first_logits = _max_logits(container)
    handles = container.dmuon_optimizers()[0].dedicated_handles() if optimizer == "dmuon" else []
    for handle in handles:
        handle.pop_comm_stats()
    with CommLedger() as counted:
        losses += th.train(model, container, dims, data[1:], norms=norms)
    out["weights"] = full_parameters(model, handles[0] if handles else None)
    if handles:
        (handle,) = handles
        stats = handle.pop_comm_stats()
        opt = container.dmuon_optimizers()[0]
        dmuon = counted.select(source=CommLabel.DMUON)
        out.update(
            moved=sum(e for e, _, _ in stats.values()) / (steps - 1),
            design=design_elements_per_rank(handle),
            counted=counted.elements(source=CommLabel.DMUON) / (steps - 1),
            groups={r.group_size for r in dmuon},
            shard_size=handle.mode.mesh.shard_size,
            momentum=_momentum(opt, handle),
            ns=opt.last_step_stats["ns_matrices"],
            first_logits=first_logits,
            last_logits=_max_logits(container),
        )
    return out


def _max_logits(container) -> dict | None:
    """QK-clip's per-head maxima of the last step, by layer (None without QK-clip)."""
    opts = container.dmuon_optimizers() if hasattr(container, "dmuon_optimizers") else []
    clip = opts[0].qk_clip if opts else None
    return clip.max_logits_by_layer() if clip is not None else None


def _momentum(opt, handle) -> dict:
    """The owners' momentum buffers by weight name (this rank's)."""
    names = {id(m.param): m.fqn for m in handle.members}
    return {
        names[id(p)]: s["momentum_buffer"].clone()
        for p, s in opt.state.items()
        if id(p) in names and "momentum_buffer" in s
    }


def _assert_same_training(a: list, b: list, *, weights=MUON_TOLERANCE):
    """Step-1 loss and norm to 1e-5/1e-4 (fp32 sums in other orders), the losses after, the weights."""
    assert a[0]["losses"][0] == pytest.approx(b[0]["losses"][0], rel=1e-5)
    assert a[0]["norms"][0] == pytest.approx(b[0]["norms"][0], rel=1e-4)
    assert a[0]["losses"] == pytest.approx(b[0]["losses"], rel=1e-4)
    wa, wb = merge_rank_states(r["weights"] for r in a), merge_rank_states(r["weights"] for r in b)
    assert wa.keys() == wb.keys()
    diff = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    assert diff < weights, diff


@pytest.fixture(scope="module")
def state():
    return th.initial_state(_model())


@pytest.fixture(scope="module")
def fsdp2(pool2, state):
    return {opt: pool2.run(_llama3_job, state, {"optimizer": opt}) for opt in ("AdamW", "dmuon")}


@pytest.fixture(scope="module")
def cp2(pool2, state):
    return {opt: pool2.run(_llama3_job, state, {"cp": 2, "optimizer": opt}) for opt in ("AdamW", "dmuon")}


def test_titans_adamw_under_cp_trains_as_without_cp(fsdp2, cp2):
    """The CPU accommodation, with TorchTitan's own AdamW: CP 2 (one sequence cut between the two
    ranks) trains as FSDP 2 (each rank a whole sequence) on the same global batch: step-1 loss and
    gradient norm to fp32 reduction order, weights after 3 steps within TOLERANCE, 5% of one step's
    update (lr 0.02; Adam divides each gradient element by its own running magnitude, so an element
    whose gradient is near 0 turns a last-bit difference into a visible one)."""
    _assert_same_training(cp2["AdamW"], fsdp2["AdamW"], weights=TOLERANCE)


def test_dmuon_under_cp_trains_as_without_cp(fsdp2, cp2):
    """DMuon under CP 2 (its dedication group: the 2 cp ranks, which sum each weight's gradient)
    trains as DMuon on FSDP 2, Newton-Schulz once per matrix in the job."""
    _assert_same_training(cp2["dmuon"], fsdp2["dmuon"])
    assert [r["shard_size"] for r in cp2["dmuon"]] == [2, 2]
    assert sum(r["ns"] for r in cp2["dmuon"]) == sum(r["ns"] for r in fsdp2["dmuon"]) == 7 * LAYERS


def test_dmuon_traffic_under_cp_is_the_design(fsdp2, cp2):
    """DMuon's collectives under CP 2 are the design's figure for a shard group of 2 (Z3) and what it
    moves on FSDP 2; FSDP2's own traffic (the other parameters) and TorchTitan's CP all-gathers of k
    and v are the rest."""
    moved = [Fraction(r["moved"]) for r in cp2["dmuon"]]
    assert sum(moved) / 2 == cp2["dmuon"][0]["design"] == fsdp2["dmuon"][0]["design"] > 0


def test_qk_clip_under_cp_takes_the_max_over_the_whole_sequence(pool2, state, fsdp2):
    """QK-clip under CP 2: each rank's capture sees its own queries and keys; it gathers the keys of
    the cp pair and takes its queries against every key at or before their positions, and the step's
    MAX over the dedication group (which includes the cp ranks) completes each head's max over the
    whole sequence. The per-head maxima of every layer at step 1 equal FSDP 2's (each rank whole
    sequences) to fp32 reduction order, and with a threshold every head exceeds the job trains as
    FSDP 2 with the clip (each step's gamma is a ratio of logits of weights that bf16 Newton-Schulz
    left 1-2 ulps apart).
    (Without the gather, each rank's keys alone, the maxima of the heads whose largest logit pairs a
    query with the other rank's key come out lower.)"""
    clip = {"qk_clip_threshold": 0.05}
    reference = pool2.run(_llama3_job, state, {**clip})
    results = pool2.run(_llama3_job, state, {"cp": 2, **clip})
    expected = reference[0]["first_logits"]
    for r in results:
        assert r["first_logits"].keys() == expected.keys() and len(expected) == LAYERS
        for name, m in r["first_logits"].items():
            assert (m > clip["qk_clip_threshold"]).all()
            torch.testing.assert_close(m, expected[name], rtol=1e-5, atol=0)
    _assert_same_training(results, reference)
    clipped, unclipped = (merge_rank_states(r["weights"] for r in job) for job in (results, fsdp2["dmuon"]))
    assert max((clipped[k] - unclipped[k]).abs().max().item() for k in clipped) > 1e-2  # (the clip did bind)


def _dedication_groups(_rank, _world, replicate, shard, cp, tp):
    """Each rank of a replicate x shard x cp x tp job in turn (fake process group), both SPMD backends:
    the ranks of its dedication mesh's shard group and replicate group (None without one)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.distributed import ParallelDims

    from titan_dmuon.integration.distributed.degrees import ParallelDegrees, dedication_mesh
    from titan_dmuon.runtime.mode import MeshInfo

    world = replicate * shard * cp * tp
    out = {}
    for backend in ("spmd_types", "partial_dtensor"):
        groups = []
        for rank in range(world):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
            try:
                dims = ParallelDims(
                    dp_replicate=replicate,
                    dp_shard=shard,
                    cp=cp,
                    tp=tp,
                    pp=1,
                    ep=1,
                    world_size=world,
                    spmd_backend=backend,
                )
                info = MeshInfo.from_mesh(dedication_mesh(dims, ParallelDegrees.of(dims), backend != "partial_dtensor"))
                groups.append(
                    (
                        tuple(dist.get_process_group_ranks(info.shard_group)),
                        tuple(dist.get_process_group_ranks(info.replicate_group)) if info.hsdp else None,
                    )
                )
            finally:
                dist.destroy_process_group()
        out[backend] = groups
    return out


@pytest.mark.parametrize("replicate, shard, cp, tp", [(1, 2, 2, 1), (2, 2, 2, 1), (2, 1, 2, 1), (1, 2, 2, 2)])
def test_dedication_group_is_dp_shard_x_cp_on_both_backends(solo, replicate, shard, cp, tp):
    """The dedication mesh of every rank, built as on the job's ranks (fake process group, up to 8 ranks): its
    shard group is the ranks with this rank's replicate and tp coordinates (TorchTitan's world mesh is
    laid out replicate, shard, cp, tp, tp fastest), its replicate group the ranks with its shard, cp and tp
    coordinates, under spmd_types (the flattened dp_shard x cp) and partial_dtensor (TorchTitan's fsdp
    mesh: the path GPU jobs on that backend take) alike."""
    groups = solo.run(_dedication_groups, replicate, shard, cp, tp)[0]
    world, n = replicate * shard * cp * tp, shard * cp
    expected = []
    for rank in range(world):
        r, t = rank // (n * tp), rank % tp
        shard_group = tuple(r * n * tp + s * tp + t for s in range(n))
        replicate_group = tuple(q * n * tp + rank % (n * tp) for q in range(replicate)) if replicate > 1 else None
        expected.append((shard_group, replicate_group))
    assert groups["spmd_types"] == groups["partial_dtensor"] == expected


# ---- 4 ranks: each combination against the same job without CP --------------------------------------
@pytest.fixture(scope="module")
def fsdp4(pool4, state):
    return pool4.run(_llama3_job, state, {})


def test_cp_x_fsdp_trains_as_fsdp_without_cp_at_the_design_traffic(pool4, state, fsdp4):
    """CP 2 x FSDP 2 (TorchTitan's FSDP mesh: dp_shard x cp, 4 ranks) trains as FSDP 4 on the same global
    batch (each data-parallel pair of ranks cuts its 2 sequences between them); DMuon's dedication group
    is those 4 ranks: every DMuon collective goes over 4 ranks, the CommLedger's count of them equals
    DMuon's own and the design's figure for N = 4 (Z3: 3(N-1)/N x P_M less the kept layer), which is
    what it moves on FSDP 4, and Newton-Schulz runs once per matrix in the job."""
    cp = pool4.run(_llama3_job, state, {"cp": 2})
    _assert_same_training(cp, fsdp4)
    assert [r["shard_size"] for r in cp] == [4] * 4 and all(r["groups"] == {4} for r in cp)
    moved, counted = (sum(Fraction(r[k]) for r in cp) / 4 for k in ("moved", "counted"))
    assert moved == counted == cp[0]["design"] == fsdp4[0]["design"] == sum(Fraction(r["moved"]) for r in fsdp4) / 4 > 0
    assert sum(r["ns"] for r in cp) == 7 * LAYERS


def test_cp_x_hsdp_trains_as_hsdp_without_cp(pool4, state):
    """CP 2 x HSDP (2 replicas, dp_shard 1): the shard group is the cp pair, the replicate stage the
    replicas; it trains as HSDP 2 x 2 on the same global batch, at the design's traffic for R = 2, N = 2."""
    cp = pool4.run(_llama3_job, state, {"cp": 2, "replicate": 2})
    hsdp = pool4.run(_llama3_job, state, {"replicate": 2})
    _assert_same_training(cp, hsdp)
    assert [r["shard_size"] for r in cp] == [2] * 4
    assert sum(Fraction(r["counted"]) for r in cp) / 4 == cp[0]["design"] == hsdp[0]["design"] > 0
    assert sum(r["ns"] for r in cp) == 7 * LAYERS


def test_cp_x_tp_trains_as_tp_without_cp_and_starts_where_adamw_starts(pool4, state):
    """CP 2 x TP 2 (dp_shard 1) trains as FSDP 2 x TP 2 on the same global batch, Newton-Schulz once per
    matrix; and from TorchTitan's own initialisation (seed 0, no shared state) DMuon's step 1 is AdamW's
    on the CP x TP layout: DMuon initialises its TP-local weights as the DTensors FSDP2 makes of them,
    which under CP shard over the flattened dp_shard x cp dim (test fails if the cp dim is taken as
    replicated: each cp rank would draw another rank's numbers)."""
    cp = pool4.run(_llama3_job, state, {"cp": 2, "tp": 2})
    tp = pool4.run(_llama3_job, state, {"tp": 2})
    _assert_same_training(cp, tp)
    assert sum(r["ns"] for r in cp) == 7 * LAYERS
    dmuon, adamw = (
        pool4.run(_llama3_job, None, {"cp": 2, "tp": 2, "optimizer": opt, "steps": 1}) for opt in ("dmuon", "AdamW")
    )
    assert dmuon[0]["losses"][0] == pytest.approx(adamw[0]["losses"][0], rel=1e-6)
    assert dmuon[0]["norms"][0] == pytest.approx(adamw[0]["norms"][0], rel=1e-5)


def _pipelined(rank, world, state, cp):
    """Pipeline 2 x (CP 2 or FSDP 2), 1F1B, 2 micro-batches per step from a global batch of 4: losses (on
    the last stage's ranks), norms, the stages' weights, DMuon's traffic (ledger) and design, NS matrices."""
    from titan_dmuon.plan.cost_model import design_elements_per_rank
    from titan_dmuon.runtime import CommLabel, DedicatedParams
    from titan_dmuon.tools.ledger import CommLedger

    dims = th.pp_dims(world, cp=cp)
    local_batch = 4 // dims.dp_shard
    built = th.build_pp(
        _model(),
        dims,
        schedule="1F1B",
        local_batch=local_batch,
        microbatch=local_batch // 2,
        state=state,
        lr=0.02,
        param_dtype="float32",
        ns_mode="exact",
    )
    parts, container = built[1], built[4]
    handles = [h for part in parts for h in DedicatedParams.of(part)]
    norms = []
    losses = th.train_pp(dims, built, _data(4)[:1], norms=norms)
    with CommLedger() as ledger:
        losses += th.train_pp(dims, built, _data(4)[1:], norms=norms)
    weights = {}
    for part in parts:
        weights.update(full_parameters(part, DedicatedParams.of(part)[0] if DedicatedParams.of(part) else None))
    return {
        "losses": losses,
        "norms": norms,
        "weights": weights,
        "ns": sum(opt.last_step_stats["ns_matrices"] for opt in container.dmuon_optimizers()),
        "counted": ledger.elements(source=CommLabel.DMUON) / (STEPS - 1),
        "design": sum(design_elements_per_rank(h, deferred=True) for h in handles),
    }


def test_cp_x_pp_trains_as_pp_without_cp(pool4, state):
    """Pipeline 2 x CP 2 (each stage's dedication group: its cp pair) trains as pipeline 2 x FSDP 2 on the
    same global batch (TorchTitan hands every stage the cp part's positions), one gradient reduce per
    stage and step at the design's traffic, Newton-Schulz once per matrix in the job."""
    cp = pool4.run(_pipelined, state, 2)
    pp = pool4.run(_pipelined, state, 1)
    last = [i for i, r in enumerate(cp) if r["losses"][0] is not None]
    assert len(last) == 2 and [i for i, r in enumerate(pp) if r["losses"][0] is not None] == last
    for i in last:
        assert cp[i]["losses"] == pytest.approx(pp[i]["losses"], rel=1e-4)
        assert cp[i]["losses"][0] == pytest.approx(pp[i]["losses"][0], rel=1e-5)
    for a, b in zip(cp, pp):
        assert a["norms"][0] == pytest.approx(b["norms"][0], rel=1e-4)
    wa, wb = merge_rank_states(r["weights"] for r in cp), merge_rank_states(r["weights"] for r in pp)
    assert wa.keys() == wb.keys()
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < MUON_TOLERANCE
    assert sum(Fraction(r["counted"]) for r in cp) / 4 == sum(Fraction(r["design"]) for r in cp) / 4 > 0
    assert sum(r["ns"] for r in cp) == sum(r["ns"] for r in pp) == 7 * LAYERS


def _moe_job(rank, world, state, cp):
    """The tiny qwen3 MoE (8 experts, routing forced round-robin as in test_tensor_parallel_moe.py: a
    top-k choice between nearly equal scores may otherwise flip with the summation order), expert
    parallelism 2 over (CP 2 x FSDP 2) or FSDP 4: losses, norms, weights, DMuon's traffic and design."""
    from titan_dmuon.plan.cost_model import design_elements_per_rank
    from titan_dmuon.runtime import CommLabel
    from titan_dmuon.tools.ledger import CommLedger

    config, spec = th.tiny_qwen3_moe(experts=8)
    for layer in config.layers:
        if getattr(layer, "moe", None) is not None:
            layer.moe.router._debug_force_load_balance = True
    dims = th.parallel_dims(world, ep=2, cp=cp)
    model, container = th.build((config, spec), dims, state=state, lr=0.02, param_dtype="float32", ns_mode="exact")
    (handle,) = container.dmuon_optimizers()[0].dedicated_handles()
    norms = []
    losses = th.train(model, container, dims, _data(4)[:1], norms=norms)
    with CommLedger() as ledger:
        losses += th.train(model, container, dims, _data(4)[1:], norms=norms)
    return {
        "losses": losses,
        "norms": norms,
        "weights": full_parameters(model, handle),
        "local": len(handle.local_experts),
        "counted": ledger.elements(source=CommLabel.DMUON) / (STEPS - 1),
        "design": design_elements_per_rank(handle),
        "ns": container.dmuon_optimizers()[0].last_step_stats["ns_matrices"],
    }


def test_cp_x_moe_with_expert_parallelism_trains_as_without_cp(pool4):
    """TorchTitan's expert region under CP counts the cp ranks (expert-FSDP x EP = dp_shard x cp x tp):
    CP 2 x FSDP 2 with expert parallelism 2 keeps whole experts on their EP ranks as FSDP 4 with EP 2
    does, each rank updating its own (no DMuon collective for them), the dense matrices dedicated over
    the 4 ranks; it trains as FSDP 4 with EP 2 on the same global batch at the design's traffic."""
    from tests.support.pool import WorkerPool

    state = th.initial_state(th.tiny_qwen3_moe(experts=8))
    fsdp = pool4.run(_moe_job, state, 1)
    fresh = WorkerPool(4)  # (a worker's spmd_types annotations name the meshes of its first layout: CP 2 x FSDP 2's)
    try:
        cp = fresh.run(_moe_job, state, 2)
    finally:
        fresh.close()
    _assert_same_training(cp, fsdp)
    assert [r["local"] for r in cp] == [r["local"] for r in fsdp] == [6] * 4  # (3 expert stacks x 2 layers)
    assert sum(Fraction(r["counted"]) for r in cp) / 4 == cp[0]["design"] == fsdp[0]["design"] > 0
    assert sum(r["ns"] for r in cp) == sum(r["ns"] for r in fsdp)


# ---- checkpoints -------------------------------------------------------------------------------------
def _checkpointed(rank, world, folder, state, cp, steps, hf):
    """A DMuon job (CP 2 or FSDP 2) with TorchTitan's checkpointer: from ``state`` it trains ``steps``
    steps and saves a DCP checkpoint at the last (and, with ``hf``, the model in HF safetensors beside
    it: the last save); from None it loads the checkpoint at step 2. Its weights and Muon momentum in
    full by name, and what the HF export must hold."""
    from torch.distributed.tensor import DTensor
    from torchtitan.components.checkpointer.utils import canonical_fqn
    from torchtitan.components.optimizer import LRSchedulersContainer

    from tests.support.helpers import Counter
    from titan_dmuon.integration.components.checkpoint import DMuonCheckpointManager

    config, spec = _model()
    dims = th.parallel_dims(world, cp=cp)
    model, container = th.build((config, spec), dims, state=state, lr=0.02)
    schedule = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=container, training_steps=steps)
    counter, managers = Counter(), {}
    for kind in ("dcp", "hf") if hf else ("dcp",):
        manager = DMuonCheckpointManager.Config(
            enable=True, folder=kind, interval=steps, last_save_model_only=kind == "hf", last_save_in_hf=kind == "hf"
        )
        managers[kind] = manager.build(
            dataloader=Counter(),
            model_parts=[model],
            optimizers=container,
            lr_schedulers=schedule,
            states={"train_state": counter},
            sd_adapter=spec.state_dict_adapter(config, None),
            base_folder=folder,
        )
    if state is None:
        assert managers["dcp"].load(step=2)
    else:
        th.train(model, container, dims, _data(4)[:steps])
        counter.step = steps
        managers["dcp"].save(steps)
        if hf:
            managers["hf"].save(steps, last_step=True)
    (handle,) = container.dmuon_optimizers()[0].dedicated_handles()
    weights = full_parameters(model, handle)
    names = {id(p): canonical_fqn(n) for n, p in model.named_parameters()}
    momentum = {}
    for opt in container.optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                value = opt.state.get(p, {}).get("momentum_buffer")
                if value is not None:
                    momentum[names[id(p)]] = (
                        (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
                    )
    expected_hf = th.hf_export_expected(weights, [model], spec.state_dict_adapter(config, None)) if hf else None
    return weights, momentum, expected_hf


def test_cp_checkpoint_resumes_without_cp_and_the_other_way(pool2, tmp_path, state):
    """A DCP checkpoint of a CP 2 job (DMuon's dedicated weights and momentum written once, by their
    owners on the dp_shard x cp group) loads into FSDP 2 without CP, and an FSDP 2 checkpoint into CP 2:
    every weight and Muon momentum equal the saving job's, bitwise; the CP job's HF export (its last
    save) holds its full weights."""
    from tests.support.helpers import assert_states_equal
    from tests.support.titan_outputs import check_hf_export

    for saving_cp, loading_cp in ((2, 1), (1, 2)):
        folder = str(tmp_path / f"cp{saving_cp}")
        saved = pool2.run(_checkpointed, folder, state, saving_cp, 2, saving_cp > 1)
        loaded = pool2.run(_checkpointed, folder, None, loading_cp, 2, False)
        for i in (0, 1):
            assert_states_equal(merge_rank_states(r[i] for r in loaded), merge_rank_states(r[i] for r in saved))
        assert len(merge_rank_states(r[1] for r in loaded)) == 5 * LAYERS  # (wqkv, wo, w1, w2, w3: each on its owner)
        if saving_cp > 1:
            check_hf_export(f"{folder}/hf/step-2", saved[0][2])


# ---- run_train.sh, as a user runs it -------------------------------------------------------------------


# ---- with an accelerator -----------------------------------------------------------------------------
def test_nothing_of_the_cpu_accommodation_runs_with_an_accelerator(monkeypatch):
    """With an accelerator (``accelerator_present`` True) a CP job keeps TorchTitan's own attention
    (FlexAttention), its parallelize step binds nothing, and the CPU-only checks do not run."""
    import dataclasses

    from torchtitan.models.common.attention import FlexAttention

    from titan_dmuon.config_registry import llama3_debugmodel_dmuon
    from titan_dmuon.integration.config import finalize
    from titan_dmuon.integration.config.validation.naming import PYTHON_NAMES, ConfigError
    from titan_dmuon.integration.config.validation.parallelism_section import validate_context_parallel
    from titan_dmuon.integration.distributed import parallelize

    monkeypatch.setattr(th.cpu, "accelerator_present", lambda: True)
    config = llama3_debugmodel_dmuon()
    config.parallelism = dataclasses.replace(
        config.parallelism, context_parallel_degree=2, spmd_backend="partial_dtensor"
    )
    config.model_spec = dataclasses.replace(config.model_spec, model=th.tiny_llama3()[0])
    finalize._finalize_model_spec(config)
    assert all(
        isinstance(layer.attention.inner_attention, FlexAttention.Config) for layer in config.model_spec.model.layers
    )
    validate_context_parallel(config, PYTHON_NAMES, this_machine=True)  # (no CPU refusal)
    calls = []
    monkeypatch.setattr(context_parallel, "bind_context_parallel_attention", lambda *a: calls.append("bind"))
    monkeypatch.setattr(th.cpu, "force_sum_reductions", lambda *a: calls.append("sum"))
    parallelize.parallelize_without_dmuon(
        torch.nn.Linear(1, 1), base_fn=lambda m, **_: m, parallel_dims=None, parallelism=config.parallelism
    )
    assert calls == []
    monkeypatch.setattr(th.cpu, "accelerator_present", lambda: False)  # (and without one, they do)
    with pytest.raises(
        ConfigError, match="spmd_backend = 'partial_dtensor' with parallelism.context_parallel_degree = 2"
    ):
        validate_context_parallel(config, PYTHON_NAMES, this_machine=True)
    finalize._finalize_model_spec(config)
    assert all(
        isinstance(layer.attention.inner_attention, context_parallel.ContextParallelCausalAttention.Config)
        for layer in config.model_spec.model.layers
    )
