"""Pipeline parallelism: TorchTitan's pipeline_llm splits a tiny llama3 into stages and runs
DMuon's parallelize step on each (one DMuon handle per stage that holds Muon targets), on 4 gloo
ranks: 2 pipeline ranks x 2 FSDP ranks; its schedules drive forward and backward, DMuon's
gradient sync is off over the micro-batches and each stage reduces once per step
(tests/support/titan_harness.py's ``train_pp`` does what DMuonTrainer.pp_forward_backward_step does).

The reference is the same model and global batch without pipelining (FSDP2 on the 4 ranks),
itself checked against torch.optim.Muon + AdamW in test_titan_models.py / test_correctness.py.
"""

import pytest
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.components.optimizer import LRSchedulersContainer

from tests.support import titan_harness as th  # noqa: I001 (enables the CPU accommodations first)
from tests.support.helpers import Counter, assert_states_equal, full_parameters, merge_rank_states
from tests.support.titan_outputs import check_hf_export, handles_of, pp_weights
from titan_dmuon.integration.components.checkpoint import DMuonCheckpointManager
from titan_dmuon.runtime import CommLabel

LAYERS = 4
STEPS = 3
LOCAL_BATCH = 4  # per data-parallel rank with pipelining (2 of them); 2 per rank without (4)
MATRICES_PER_LAYER = 7  # wq, wk, wv (blocks of the fused wqkv), wo, w1, w2, w3
SCHEDULES = ["1F1B", "Interleaved1F1B", "InterleavedZeroBubble"]


def _model():
    return th.tiny_llama3(n_layers=LAYERS)


def _data():
    return th.batches(STEPS, 1, batch=2 * LOCAL_BATCH)  # the same global batches with and without pipelining


def _all_weights(per_rank):
    """Every rank's stage weights merged (ranks of the same stage must agree bitwise)."""
    return merge_rank_states(per_rank)


# ---- training ------------------------------------------------------------------------------------
def _without_pipeline(rank, world, state):
    dims = th.parallel_dims(world)
    model, container = th.build(_model(), dims, state=state, lr=0.02, param_dtype="float32")
    norms, inf_norms = [], []
    losses = th.train(model, container, dims, _data(), norms=norms, inf_norms=inf_norms)
    ns = sum(opt.last_step_stats["ns_matrices"] for opt in container.dmuon_optimizers())
    (handle,) = container.dmuon_optimizers()[0].dedicated_handles()
    return losses, norms, full_parameters(model, handle), ns, inf_norms


def _with_pipeline(rank, world, state, schedule, microbatch=1):
    dims = th.pp_dims(world)
    built = th.build_pp(
        _model(),
        dims,
        schedule=schedule,
        local_batch=LOCAL_BATCH,
        microbatch=microbatch,
        state=state,
        lr=0.02,
        param_dtype="float32",
    )
    _, parts, _, _, container = built
    handles = handles_of(parts)
    norms, inf_norms = [], []
    losses = th.train_pp(dims, built, _data()[:1], norms=norms, inf_norms=inf_norms)
    for h in handles:
        h.pop_comm_stats()
    from titan_dmuon.plan.cost_model import design_elements_per_rank
    from titan_dmuon.tools.ledger import CommLedger

    with CommLedger() as ledger:
        losses += th.train_pp(dims, built, _data()[1:], norms=norms, inf_norms=inf_norms)
    moved = sum(e for h in handles for e, _, _ in h.pop_comm_stats().values()) / (STEPS - 1)
    counted = ledger.elements(source=CommLabel.DMUON) / (STEPS - 1)
    design = sum(design_elements_per_rank(h, deferred=True) for h in handles)
    ns = sum(opt.last_step_stats["ns_matrices"] for opt in container.dmuon_optimizers())
    without = [sorted(n for n, _ in part.named_parameters()) for part in parts if not handles_of([part])]
    own_loads = [
        [sum(e.ns_flops for e in h.plan.entries if e.owner == r) for r in range(h.plan.world_size)] for h in handles
    ]  # each stage's Newton-Schulz FLOPs per data-parallel rank, its own matrices
    return {
        "losses": losses,
        "norms": norms,
        "inf_norms": inf_norms,
        "weights": pp_weights(parts),
        "ns": ns,
        "moved": moved,
        "counted": counted,
        "design": design,
        "stages": len(parts),
        "handles": len(handles),
        "without_handle": without,
        "own_loads": own_loads,
    }


@pytest.fixture(scope="module")
def straight(pool4):
    """The same model, weights and global batches without pipelining."""
    state = th.initial_state(_model())
    results = pool4.run(_without_pipeline, state)
    return state, results


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedules_train_as_without_pipelining(pool4, straight, schedule):
    """1F1B (one stage per rank), Interleaved1F1B and InterleavedZeroBubble (two stages per rank;
    ZeroBubble splits each backward into input and weight passes) train as the same job without
    pipelining: the same losses and gradient norms and the same weights after 3 steps. Both
    compute in fp32 (in bf16 micro-batches of 1 sample round otherwise than batches of 2); the
    gradients are summed in another order, and bf16 Newton-Schulz amplifies that on the
    attention output projections (wo: the same job without pipelining on 2 and on 4 ranks
    differs by 1.5e-3 after 3 steps, of 1.5e-2 moved). A missed, doubled or mis-scaled
    micro-batch moves the step-1 norm by percents. Newton-Schulz ran once per matrix in
    the whole job; every stage with Muon targets has its own handle."""
    state, reference = straight
    ref_losses, ref_norms, _, _, ref_inf_norms = reference[0]
    ref_weights = _all_weights(r[2] for r in reference)
    results = pool4.run(_with_pipeline, state, schedule)
    stages = 1 if schedule == "1F1B" else 2
    for r in results:  # TorchTitan gives the embedding and the head a stage's worth each: alone, no handle
        assert r["stages"] == stages and r["handles"] + len(r["without_handle"]) == stages
        assert all(not any(n.startswith("layers.") for n in names) for names in r["without_handle"])
    last_stage = [r for r in results if r["losses"][0] is not None]
    assert len(last_stage) == 2
    for r in last_stage:
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-4)
    for r in results:
        assert r["norms"] == pytest.approx(ref_norms, rel=1e-3)
        assert r["norms"][0] == pytest.approx(ref_norms[0], rel=1e-5)  # step 1: the same weights
        # the max-norm (clip_grad_norm_(inf)): the largest over the stages, not their sum
        assert r["inf_norms"] == pytest.approx(ref_inf_norms, rel=1e-3)
        assert r["inf_norms"][0] == pytest.approx(ref_inf_norms[0], rel=1e-5)
        if len(r["own_loads"]) > 1:  # two stages with Muon targets on this rank: each plan counts the earlier
            totals = [sum(loads) for loads in zip(*r["own_loads"])]  # stages' load, so the rank's sum is as even as
            assert max(totals) - min(totals) <= max(max(s) - min(s) for s in r["own_loads"])  # one stage's
    weights = _all_weights(r["weights"] for r in results)
    assert weights.keys() == ref_weights.keys()
    diff = max((weights[k] - ref_weights[k]).abs().max().item() for k in weights)
    assert diff < 3e-3, diff
    assert sum(r["ns"] for r in results) == sum(r[3] for r in reference) == MATRICES_PER_LAYER * LAYERS
    assert any(len(r["own_loads"]) > 1 for r in results) == (schedule != "1F1B")


@pytest.mark.parametrize("microbatch", [1, 2, 4])
def test_traffic_per_step_does_not_grow_with_micro_batches(pool4, microbatch):
    """With 4, 2 and 1 micro-batches per step each dedicated weight is broadcast once and its
    gradient reduced once per step (in the stage's last backward): 2(N-1)/N * P_M of each stage
    (the deferred design, Z3's re-broadcast included: the weights stay gathered until the
    reduce), counted on the collectives issued (DMuon's own figures and the CommLedger's)."""
    state = th.initial_state(_model())
    results = pool4.run(_with_pipeline, state, "Interleaved1F1B", microbatch)
    for r in results:
        assert r["moved"] == r["counted"] == r["design"] > 0, (r["moved"], r["counted"], r["design"])


def _reduce_order(rank, world, schedule):
    """Steps 2 and 3 of a 6-layer llama3 (1F1B: 2 stages of 3 layers, embedding and head with the
    outer ones; Interleaved1F1B and InterleavedZeroBubble: 4 stages, layers 1-2 and 3-4 alone) on 2
    pipeline x 2 FSDP ranks, 4 micro-batches: the events of this rank in order, each layer's
    backward start (a hook on its output's gradient), each unit's reduce to its owners (with the
    collectives the CommLedger saw it issue), each send of an input gradient to the previous stage
    as the schedule issues it ("send_b", stage, micro-batch), each wait for a unit's reduce ("wait":
    on the CPU the host blocks; on NCCL the current stream, the compute stream, waits), the end of
    ``schedule.step`` (with whether a stage still held unreduced gradients then), and DMuon's
    elements per step as the ledger counted them."""
    from torch.distributed.pipelining import schedules as pipelining_schedules
    from torchtitan.components.checkpointer.utils import canonical_fqn

    from titan_dmuon.plan.cost_model import design_elements_per_rank
    from titan_dmuon.runtime.comm import InFlight
    from titan_dmuon.runtime.reducer import GradientReducer
    from titan_dmuon.tools.ledger import CommLedger

    dims = th.pp_dims(world)
    built = th.build_pp(th.tiny_llama3(n_layers=6), dims, schedule=schedule, local_batch=LOCAL_BATCH, lr=0.02)
    pipeline, parts = built[0], built[1]
    events, ledger = [], CommLedger()

    def mark_backward(name):
        def hook(module, args, output):
            output.register_hook(lambda grad: events.append(("backward", name)))

        return hook

    stages = []
    for part in parts:
        stages.append([f"layers.{key}" for key in (part.layers or {})])
        for key, layer in (part.layers or {}).items():
            layer.register_forward_hook(mark_backward(f"layers.{key}"))
    data = th.batches(3, 1, batch=2 * LOCAL_BATCH)
    th.train_pp(dims, built, data[:1])  # step 1 records the layers' order

    pipeline_stages = getattr(pipeline, "_stages", None) or [pipeline._stage]
    stage_of_reducer = {id(h._ctx.reducer): st.stage_index for st in pipeline_stages for h in handles_of([st.submod])}
    handles = handles_of(parts)

    def tagged_sends(stage):
        real_ops = stage.get_bwd_send_ops

        def get_bwd_send_ops(mb):
            ops = real_ops(mb)
            for op in ops:  # (P2POps sending an input gradient, tagged with their stage and micro-batch)
                op.recorded = (stage.stage_index, mb)
            return ops

        return get_bwd_send_ops

    for st in pipeline_stages:
        st.get_bwd_send_ops = tagged_sends(st)
    real_p2p, real_reduce, real_wait, real_step = (
        pipelining_schedules._batch_p2p,
        GradientReducer.reduce,
        InFlight.wait,
        pipeline.step,
    )

    def batch_p2p(ops, desc=None):
        events.extend(("send_b", *op.recorded) for op in ops if getattr(op, "recorded", None) is not None)
        return real_p2p(ops, desc=desc)

    def reduce(reducer, unit):
        issued = len(ledger.records)
        real_reduce(reducer, unit)
        name = canonical_fqn(unit.name)
        reducer._in_flight[-1].in_flight.recorded = (stage_of_reducer[id(reducer)], name)
        events.append(("reduce", name, [r.kind for r in ledger.records[issued:]]))

    def wait(in_flight, stream=None):
        if getattr(in_flight, "recorded", None) is not None:
            events.append(("wait", *in_flight.recorded))
        real_wait(in_flight, stream)

    def step(*args, **kwargs):
        out = real_step(*args, **kwargs)
        events.append(("schedule_end", any(u.holds_unreduced_grads for h in handles for u in h._units)))
        return out

    events.clear()
    pipelining_schedules._batch_p2p, GradientReducer.reduce, InFlight.wait, pipeline.step = (
        batch_p2p,
        reduce,
        wait,
        step,
    )
    try:
        with ledger:
            for batch in data[1:]:
                events.append(("step",))
                th.train_pp(dims, built, [batch])
    finally:
        pipelining_schedules._batch_p2p, GradientReducer.reduce, InFlight.wait = real_p2p, real_reduce, real_wait
        del pipeline.step
    design = sum(design_elements_per_rank(h, deferred=True) for h in handles)
    return {
        "events": events,
        "stages": stages,
        "pp_rank": dims.get_mesh("pp").get_local_rank(),
        "stage_indices": [st.stage_index for st in pipeline_stages if handles_of([st.submod])],
        "moved": ledger.elements(source=CommLabel.DMUON) / 2,
        "design": design,
    }


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_stage_reduces_during_its_last_backward(pool4, schedule):
    """Each stage's gradient sync is on for its last micro-batch's backward only (as
    torch.distributed.pipelining's ``last_backward``): every layer's reduce is issued once per
    step, by its post-backward hook, so the stage's last layer's reduce goes out before the
    backward of the stage's first layer of that micro-batch starts (it overlaps the rest of the
    backward; a split backward, InterleavedZeroBubble's, reduces right after its last weight pass);
    the order is the same on both ranks of a stage (NCCL matches collectives by order); and
    DMuon's traffic, counted by the CommLedger, is the design's 2(N-1)/N x P_M of each stage per
    step. Regression: the reduce ran after the whole schedule returned, every byte of it exposed.

    When ``schedule.step`` returns every reduce is issued and no stage holds unreduced gradients
    (regression, zero-bubble: without the reduce after the last weight pass the harness's reduce
    after the schedule hid it). And nothing waits for a stage's last reduce before the schedule has
    returned, so the send of the stage's last input gradient is issued first (regression: the end
    of the last backward waited for it, and on NCCL the send, which waits for the compute stream,
    queued behind a layer's reduce on every stage: the pipeline's drain; FSDP2 reduces in the
    schedule's REDUCE_GRAD, after the sends)."""
    results = pool4.run(_reduce_order, schedule)
    split_backward = schedule == "InterleavedZeroBubble"
    for r in results:
        assert r["moved"] == r["design"] > 0, (r["moved"], r["design"])
        steps = [[]]
        for event in r["events"][1:]:
            steps.append([]) if event == ("step",) else steps[-1].append(event)
        assert len(steps) == 2
        layers = [name for stage in r["stages"] for name in stage]
        overlapped = 0
        for events in steps:
            reduces = [e[1] for e in events if e[0] == "reduce"]
            assert sorted(reduces) == sorted(layers)  # once per step
            assert all(e[2] and set(e[2]) == {"reduce"} for e in events if e[0] == "reduce")  # issued there
            (schedule_end,) = [i for i, e in enumerate(events) if e[0] == "schedule_end"]
            assert events[schedule_end] == ("schedule_end", False)  # nothing left unreduced
            assert all(i < schedule_end for i, e in enumerate(events) if e[0] == "reduce")  # every reduce issued
            for stage in r["stage_indices"]:
                waits = [i for i, e in enumerate(events) if e[0] == "wait" and e[1] == stage]
                last_send = max((i for i, e in enumerate(events) if e[:2] == ("send_b", stage)), default=-1)
                assert waits and waits[-1] > schedule_end > last_send, (stage, events)
            for stage in r["stages"]:
                if len(stage) < 2 or split_backward:
                    continue
                first, last = stage[0], stage[-1]
                kinds = [e[:2] for e in events]
                last_backward_of_first = max(i for i, e in enumerate(kinds) if e == ("backward", first))
                assert kinds.index(("reduce", last)) < last_backward_of_first, (stage, kinds)
                overlapped += 1
        assert overlapped >= 2 or split_backward  # every rank holds a stage of two layers or more
        senders = {e[1] for e in r["events"] if e[0] == "send_b"}
        assert senders == set(r["stage_indices"]) - {0}  # (every stage sends its input gradient but the first)
    for a in results:
        for b in results:
            if a["pp_rank"] == b["pp_rank"]:
                assert [e[:2] for e in a["events"]] == [e[:2] for e in b["events"]]


# ---- checkpoints ----------------------------------------------------------------------------------
class _Job:
    """Pipelined (or not) tiny llama3 with its container, LR schedule and TorchTitan checkpoint manager."""

    def __init__(self, world, folder, *, pipeline: bool, state, hf: bool = False):
        if pipeline:
            self.dims = th.pp_dims(world)
            self.built = th.build_pp(
                _model(), self.dims, schedule="Interleaved1F1B", local_batch=LOCAL_BATCH, state=state, lr=0.02
            )
            self.parts, self.container = self.built[1], self.built[4]
        else:
            self.dims = th.parallel_dims(world)
            model, self.container = th.build(_model(), self.dims, state=state, lr=0.02)
            self.parts = [model]
        self.pipeline = pipeline
        self.schedule = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=self.container, training_steps=4)
        self.counter = Counter()
        config, spec = _model()
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
        self.data = th.batches(4, 1, batch=2 * LOCAL_BATCH)

    def train(self, until):
        losses = []
        while self.counter.step < until:
            batch = [self.data[self.counter.step]]
            if self.pipeline:
                losses += th.train_pp(self.dims, self.built, batch)
            else:
                losses += th.train(self.parts[0], self.container, self.dims, batch)
            self.schedule.step()
            self.counter.step += 1
            self.manager.save(self.counter.step, last_step=self.adapter is not None and self.counter.step == 4)
        return losses

    def hf_expected(self):
        """What TorchTitan's last-step HF export should hold of this rank's stages: their full
        weights, fused wqkv split as TorchTitan's state-dict hook does, through llama3's adapter."""
        return th.hf_export_expected(pp_weights(self.parts), self.parts, self.adapter)

    def state(self):
        """Weights, Muon momentum, AdamW moments and steps of this rank's stages, full, by name."""
        from torch.distributed.tensor import DTensor

        out = {f"weight/{k}": v for k, v in pp_weights(self.parts).items()}
        names = {id(p): canonical_fqn(n) for part in self.parts for n, p in part.named_parameters()}
        owned = {}
        for opt in self.container.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    for key, value in opt.state.get(p, {}).items():
                        value = value.full_tensor() if isinstance(value, DTensor) else value
                        owned[f"{key}/{names[id(p)]}"] = value.detach().clone()
        return out, owned


def _train_and_keep(rank, world, folder, state, pipeline, until, hf=False):
    job = _Job(world, folder, pipeline=pipeline, state=state, hf=hf)
    losses = job.train(until)
    return losses, *job.state(), job.hf_expected() if hf else None


def _resume(rank, world, folder, pipeline, until, step=-1):
    job = _Job(world, folder, pipeline=pipeline, state=None)
    assert job.manager.load(step=step)
    losses = job.train(until)
    return losses, *job.state()


def test_pipelined_resume_is_bit_exact_and_loads_without_pipelining(pool4, tmp_path):
    """4 pipelined steps straight == 2 steps + save + new processes + load + 2 steps, bit for bit
    (weights, Muon momentum, AdamW moments, losses): every stage's dedicated weights and momentum
    are in the checkpoint once, under TorchTitan's names. The same checkpoint loads into the job
    without pipelining (FSDP2 on 4 ranks, other owners) with every weight and optimizer state equal,
    and a checkpoint of that job loads into the pipelined one. The last save, in HF safetensors
    through llama3's adapter, holds every stage's weights."""
    state = th.initial_state(_model())
    straight = pool4.run(_train_and_keep, str(tmp_path / "a"), state, True, 4, True)
    first = pool4.run(_train_and_keep, str(tmp_path / "b"), state, True, 2)
    plain = pool4.run(_train_and_keep, str(tmp_path / "c"), state, False, 2)
    pool4.restart()
    second = pool4.run(_resume, str(tmp_path / "b"), True, 4)
    for rank in range(4):
        assert first[rank][0] + second[rank][0] == straight[rank][0]
    assert_states_equal(_all_weights(r[1] for r in second), _all_weights(r[1] for r in straight))
    a, b = merge_rank_states(r[2] for r in straight), merge_rank_states(r[2] for r in second)
    assert_states_equal(a, b)
    assert any(k.startswith("momentum_buffer/") for k in a) and any(k.startswith("exp_avg/") for k in a)

    # the 2-step pipelined checkpoint, into the job without pipelining (no training: until step 2)
    unpipelined = pool4.run(_resume, str(tmp_path / "b"), False, 2, 2)
    assert_states_equal(_all_weights(r[1] for r in unpipelined), _all_weights(r[1] for r in first))
    assert_states_equal(merge_rank_states(r[2] for r in unpipelined), merge_rank_states(r[2] for r in first))

    # and back: the checkpoint of the job without pipelining, into the pipelined one
    pipelined = pool4.run(_resume, str(tmp_path / "c"), True, 2)
    assert_states_equal(_all_weights(r[1] for r in pipelined), _all_weights(r[1] for r in plain))
    assert_states_equal(merge_rank_states(r[2] for r in pipelined), merge_rank_states(r[2] for r in plain))

    # the straight job's last save: model only, in HF safetensors, every stage's weights
    check_hf_export(str(tmp_path / "a" / "ckpt" / "step-4"), merge_rank_states(r[3] for r in straight))
