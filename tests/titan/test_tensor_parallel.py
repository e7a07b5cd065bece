"""Tensor parallelism: TorchTitan's TP (spmd_types backend: each rank holds TP-local shards of
the column- and row-wise parallel linears) x FSDP, with DMuon dedicating the TP-local shards on the
data-parallel mesh, on 4 gloo ranks (TP 2 x FSDP 2).

The reference is the same model, weights and global batches on FSDP 4 without tensor parallelism
(itself checked against torch.optim.Muon + AdamW in test_titan_models.py / test_correctness.py).
Newton-Schulz runs once per matrix in the whole job: each matrix is assembled from its two shards on
its NS home, so ns_mode='exact' gives torch.optim.Muon's update of the full matrix.
"""

import contextlib

import pytest
import torch
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.components.optimizer import LRSchedulersContainer

from tests.support import titan_harness as th  # noqa: I001 (enables the CPU accommodations first)
from tests.support.helpers import (
    TOLERANCE,
    Counter,
    assert_states_equal,
    full_parameters,
    merge_rank_states,
    reference_newton_schulz,
    torch_muon_newton_schulz,
)
from titan_dmuon.integration.components.checkpoint import DMuonCheckpointManager
from titan_dmuon.runtime import CommLabel

LAYERS = 2
STEPS = 3
MATRICES_PER_LAYER = 7  # wq, wk, wv (blocks of the fused wqkv), wo, w1, w2, w3
MUON_WEIGHTS = ("wqkv.weight", "wo.weight", "w1.weight", "w2.weight", "w3.weight")


def _model(fuse_qkv=True):
    return th.tiny_llama3(n_layers=LAYERS, fuse_qkv=fuse_qkv)


def _data():
    return th.batches(STEPS, 1, batch=8)


def _handle(container):
    (handle,) = container.dmuon_optimizers()[0].dedicated_handles()
    return handle


def _train_llama3_tp(rank, world, state, tp, fuse_qkv=True, options=None):
    from titan_dmuon.plan.cost_model import design_elements_per_rank

    dims = th.parallel_dims(world, tp=tp)
    model, container = th.build(
        _model(fuse_qkv), dims, state=state, lr=0.02, param_dtype="float32", ns_mode="exact", **(options or {})
    )
    handle = _handle(container)
    norms = []
    with _exact_ns_calls() as exact_ns:
        losses = th.train(model, container, dims, _data()[:1], norms=norms)
        first_step = dict(container.dmuon_optimizers()[0].last_step_stats)
        handle.pop_comm_stats()
        losses += th.train(model, container, dims, _data()[1:], norms=norms)
    stats = handle.pop_comm_stats()
    ns = sum(opt.last_step_stats["ns_matrices"] for opt in container.dmuon_optimizers())
    return {
        "losses": losses,
        "norms": norms,
        "weights": full_parameters(model, handle),
        "ns": ns,
        "exact_ns": exact_ns[0],
        "first_step": first_step,
        "moved": sum(e for e, _, _ in stats.values()) / (STEPS - 1),
        "tp_moved": sum(e for label, (e, _, _) in stats.items() if label in CommLabel.tensor_parallel()) / (STEPS - 1),
        "stats": container.dmuon_optimizers()[0].last_step_stats,
        "design": design_elements_per_rank(handle),
        "plan_numel": handle.plan.total_numel,
        "blocks": [m.entry.blocks for m in handle.members],
    }


@contextlib.contextmanager
def _exact_ns_calls():
    """Counts the matrices that go through torch.optim.Muon's own Newton-Schulz (ns_mode="exact":
    every matrix, on its owner or its TP home; "batched" mode runs its own batched iteration). On
    this CPU both give the same bits for these shapes, so only the path taken tells them apart."""
    from torch.optim import _muon

    count, original = [0], _muon._zeropower_via_newtonschulz

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    _muon._zeropower_via_newtonschulz = counted
    try:
        yield count
    finally:
        _muon._zeropower_via_newtonschulz = original


@pytest.fixture(scope="module")
def fsdp4(pool4):
    state = th.initial_state(_model())
    return state, pool4.run(_train_llama3_tp, state, 1)


@pytest.fixture(scope="module")
def tp2(pool4, fsdp4):
    state, _ = fsdp4
    return pool4.run(_train_llama3_tp, state, 2)


def test_tp_trains_as_fsdp_without_tp(fsdp4, tp2):
    """TP 2 x FSDP 2 trains as FSDP 4 from the same weights and batches: the same step-1 loss and
    gradient norm (TP changes matmul reduction orders: 1e-5), losses within 1e-4 and weights within
    2e-3 after 3 steps (bf16 Newton-Schulz amplifies the gradients' last-bit differences, as between
    2 and 4 FSDP ranks, test_pipeline.py). Newton-Schulz ran once per matrix in the whole job."""
    _, reference = fsdp4
    ref_weights = merge_rank_states(r["weights"] for r in reference)
    weights = merge_rank_states(r["weights"] for r in tp2)
    assert weights.keys() == ref_weights.keys()
    for r in tp2:
        assert r["losses"][0] == pytest.approx(reference[0]["losses"][0], rel=1e-6)
        assert r["norms"][0] == pytest.approx(reference[0]["norms"][0], rel=1e-5)
        assert r["losses"] == pytest.approx(reference[0]["losses"], rel=1e-4)
    diff = {k: (weights[k] - ref_weights[k]).abs().max().item() for k in weights}
    assert max(diff.values()) < 2e-3, diff
    moved = max((weights[k] - th_initial).abs().max().item() for k, th_initial in fsdp4[0].items() if k in weights)
    assert moved > 1e-2  # (the weights did train)
    assert sum(r["ns"] for r in tp2) == sum(r["ns"] for r in reference) == MATRICES_PER_LAYER * LAYERS
    # ns_mode="exact" with and without TP: every matrix of every step through torch.optim.Muon's own NS
    assert (
        sum(r["exact_ns"] for r in tp2) == sum(r["exact_ns"] for r in reference) == MATRICES_PER_LAYER * LAYERS * STEPS
    )


def test_tp_traffic_is_the_design(tp2):
    """DMuon's collectives, averaged over the 4 ranks, are the design: Z3 on the FSDP group for the
    TP-local elements plus the step's TP all-to-alls, 2(T-1)/T^2 x the full elements each rank owns
    (each rank's own count depends on which matrices it is the NS home of)."""
    from fractions import Fraction

    mean = sum(Fraction(r["moved"]) for r in tp2) / len(tp2)
    assert mean == tp2[0]["design"] > 0
    tp_mean = sum(Fraction(r["tp_moved"]) for r in tp2) / len(tp2)
    full_numel = sum(v.numel() for k, v in tp2[0]["weights"].items() if k.endswith(MUON_WEIGHTS))
    assert tp2[0]["plan_numel"] * 2 == full_numel  # (the plan counts TP-local elements)
    t, n = 2, 2  # each rank owns 1/n of the full matrices on average: 2(T-1)/T^2 of that
    assert tp_mean == 2 * Fraction(t - 1, t * t) * Fraction(full_numel, n) > 0


def test_fused_qkv_blocks_are_full_matrix_rows(tp2):
    """Under TP each rank's fused wqkv holds whole kv groups; the q/k/v blocks are rows of the full
    matrix (one kv group of [2 q heads, 1 k, 1 v] x head_dim 16 per rank; 2 groups, 128 rows, in all:
    the local weight's own layout would give 64 rows and one range per block)."""
    fused = [b for b in tp2[0]["blocks"] if len(b) == 3]
    assert len(fused) == LAYERS, tp2[0]["blocks"]
    q, k, v = fused[0]
    assert q == ((0, 32), (64, 96))
    assert k == ((32, 48), (96, 112))
    assert v == ((48, 64), (112, 128))


def test_unfused_qkv_under_tp_matches_fused(pool4, fsdp4, tp2):
    """TP with separate wq/wk/wv trains as TP with the fused wqkv, whose blocks NS orthogonalises
    separately: the same losses, and weights (wqkv split by TorchTitan's state-dict names) equal
    within bf16 Newton-Schulz rounding."""
    state, _ = fsdp4
    unfused = pool4.run(_train_llama3_tp, state, 2, False)
    for a, b in zip(unfused, tp2):
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-5)
    assert sum(r["ns"] for r in unfused) == MATRICES_PER_LAYER * LAYERS


@pytest.mark.parametrize("fuse_qkv", [True, False])
def test_qk_clip_under_tp_clips_as_without_tp(pool4, fsdp4, fuse_qkv):
    """QK-clip under TP: each TP rank holds whole heads (GQA: whole kv groups with their query heads) of
    the q/k weights and its inner attention sees exactly those heads' logits, so it clips its own
    heads' rows of its shards. With a threshold every head exceeds at step 1 (each head gets its own
    gamma, so a head mapped to another head's rows changes the weights by far more than the
    tolerance), TP 2 x
    FSDP 2 trains as FSDP 4 with the clip, fused and separate q/k/v: losses and weights within the
    tolerances of test_tp_trains_as_fsdp_without_tp, the same largest logit and count of clipped
    heads (summed over the TP group)."""
    state, _ = fsdp4
    clip = {"qk_clip_threshold": 0.05}
    reference = pool4.run(_train_llama3_tp, state, 1, fuse_qkv, clip)
    results = pool4.run(_train_llama3_tp, state, 2, fuse_qkv, clip)
    for r in results:  # (the last step's figures: every head exceeds 0.05 at step 1, about half at step 3)
        # step 1: both TP ranks clip all their heads, the count summed over them (a MAX would give half)
        assert r["first_step"]["qk_clipped_heads"] == reference[0]["first_step"]["qk_clipped_heads"] == LAYERS * 4
        assert r["losses"] == pytest.approx(reference[0]["losses"], rel=1e-4)
        assert r["stats"]["qk_clipped_heads"] == reference[0]["stats"]["qk_clipped_heads"] > 0
        # (step 3's logits come from weights that differ by up to 2e-3: their largest to 5e-4 here)
        assert r["stats"]["qk_max_logit"] == pytest.approx(reference[0]["stats"]["qk_max_logit"], rel=2e-3)
    weights, ref_weights = (
        merge_rank_states(r["weights"] for r in results),
        merge_rank_states(r["weights"] for r in reference),
    )
    diff = max((weights[k] - ref_weights[k]).abs().max().item() for k in weights)
    assert diff < 2e-3, diff
    unclipped = merge_rank_states(r["weights"] for r in pool4.run(_train_llama3_tp, state, 2, fuse_qkv))
    assert max((weights[k] - unclipped[k]).abs().max().item() for k in weights) > 1e-2  # (the clip did bind)


# ---- the owner's update under TP, compared directly -------------------------------------------------------
def _with_exchange_cap(rank, world, cap, fn, *args):
    """``fn(rank, world, *args)`` with the TP step's MAX_EXCHANGE_BYTES at ``cap`` in this worker."""
    from titan_dmuon.optim import tensor_parallel_update as tensor_parallel_step

    default, tensor_parallel_step.MAX_EXCHANGE_BYTES = tensor_parallel_step.MAX_EXCHANGE_BYTES, cap
    try:
        return fn(rank, world, *args)
    finally:
        tensor_parallel_step.MAX_EXCHANGE_BYTES = default


def _tp_update_vs_torch_muon(rank, world, fuse_qkv, ns_method="torch"):
    """One step of TP 2: each matrix's full weight and full gradient before the step (gathered from
    the TP shards) go through torch.optim.Muon on one process (with ``ns_method``'s Newton–Schulz as
    tests.support.helpers writes it), one row block at a time (a fused wqkv: its q, k and v rows, as separate
    weights); returns, per matrix, how far DMuon's full weight after the step is from that."""
    dims = th.parallel_dims(world, tp=world)
    muon = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=True, adjust_lr_fn="match_rms_adamw")
    ns_mode = "exact" if ns_method == "torch" else "batched"
    model, container = th.build(
        _model(fuse_qkv=fuse_qkv), dims, param_dtype="float32", ns_mode=ns_mode, ns_method=ns_method, **muon
    )
    handle = _handle(container)
    before = {}

    def snapshot(params, max_norm):  # (after backward, before the step; no clipping)
        for m in handle.members:
            before[m.fqn] = (handle.tp_full(m, m.param.detach()).clone(), handle.tp_full(m, m.param.grad).clone())
        return torch.zeros(())

    th.train(model, container, dims, _data()[:1], clip=snapshot)
    diff, sharded = {}, 0
    for m in handle.members:
        weight, grad = before[m.fqn]
        expected = weight.clone()
        for block in m.entry.blocks:
            rows = torch.cat([torch.arange(start, stop) for start, stop in block])
            reference = weight[rows].clone().requires_grad_()
            reference.grad = grad[rows]
            with torch_muon_newton_schulz(None if ns_method == "torch" else reference_newton_schulz(ns_method)):
                torch.optim.Muon([reference], **muon).step()
            expected[rows] = reference.detach()
        diff[m.fqn] = (handle.tp_full(m, m.param.detach()) - expected).abs().max().item()
        sharded += m.entry.tp_dim is not None
    return diff, sharded


@pytest.mark.parametrize("fuse_qkv", [False, True], ids=["separate_qkv", "fused_wqkv"])
def test_tp_update_is_torch_muons_update_of_the_full_matrix(pool2, fuse_qkv):
    """ns_mode="exact" under TP: the owner's update of each TP-sharded matrix (momentum on the shards,
    Newton-Schulz of the assembled matrix on its home, weight decay with the plain lr and the update
    with the full matrix's adjusted lr, "match_rms_adamw", on the shards) is torch.optim.Muon's update
    of the full matrix, bit for bit; a fused wqkv's, of each of its q/k/v blocks (its per-block lr
    was covered only by the 2e-3 tolerance of the training comparison). (Weight decay with the
    adjusted lr was caught only by 2.06e-3 against a 2e-3 tolerance on the weights after 3 steps;
    here it changes the bits at once.)"""
    for diff, sharded in pool2.run(_tp_update_vs_torch_muon, fuse_qkv):
        assert sharded == len(diff) == (MATRICES_PER_LAYER - (2 if fuse_qkv else 0)) * LAYERS
        assert all(d == 0.0 for d in diff.values()), diff


def test_tp_update_in_one_batch_per_matrix_is_still_torch_muons(pool2):
    """With the TP step's cap at one byte every matrix goes through its own exchange (the step's
    pipeline then holds 7 batches per layer, and a job's units are sent on after its last): the
    update is still torch.optim.Muon's of the full matrix, bit for bit."""
    for diff, sharded in pool2.run(_with_exchange_cap, 1, _tp_update_vs_torch_muon, True):
        assert sharded == len(diff) == (MATRICES_PER_LAYER - 2) * LAYERS
        assert all(d == 0.0 for d in diff.values()), diff


@pytest.mark.parametrize("ns_method", ["polar_express", "gram"])
def test_tp_homes_run_the_newton_schulz_method(pool2, ns_method):
    """The TP homes orthogonalise the assembled matrices by ``ns_method`` (muon_math.orthogonalise):
    the full matrices' update is torch.optim.Muon's with that method's Newton–Schulz (written in
    tests.support.helpers), within TOLERANCE (the batched GEMMs' rounding: one step's update of lr 0.02 times
    the adjusted scale, off by a few bf16 ulps, is ~1e-4); the MLP matrices (128 x 64) run Gram
    Newton–Schulz under "gram". With "torch"'s Newton–Schulz in its place the weights are >= 1e-3 off."""
    from titan_dmuon.math.ns_methods import uses_gram

    assert uses_gram(64, 128)
    for diff, sharded in pool2.run(_tp_update_vs_torch_muon, False, ns_method):
        assert sharded == len(diff) == MATRICES_PER_LAYER * LAYERS
        assert max(diff.values()) < TOLERANCE, diff


# ---- checkpoints ----------------------------------------------------------------------------------
class _Job:
    def __init__(self, world, folder, *, tp, state, hf=False):
        self.dims = th.parallel_dims(world, tp=tp)
        model, self.container = th.build(_model(), self.dims, state=state, lr=0.02)
        self.parts = [model]
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
        self.data = th.batches(4, 1, batch=8)

    def train(self, until):
        losses = []
        while self.counter.step < until:
            losses += th.train(self.parts[0], self.container, self.dims, [self.data[self.counter.step]])
            self.schedule.step()
            self.counter.step += 1
            self.manager.save(self.counter.step, last_step=self.adapter is not None and self.counter.step == 4)
        return losses

    def hf_expected(self):
        """The full current weights, the fused wqkv split as TorchTitan's state-dict hook does, through
        llama3's HF adapter: what the last-step HF export must hold."""
        return th.hf_export_expected(full_parameters(self.parts[0], _handle(self.container)), self.parts, self.adapter)

    def state(self):
        """Full weights and full Muon momentum (assembled from the TP shards) by name."""
        from torch.distributed.tensor import DTensor

        handle = _handle(self.container)
        out = {f"weight/{k}": v for k, v in full_parameters(self.parts[0], handle).items()}
        names = {id(p): canonical_fqn(n) for n, p in self.parts[0].named_parameters()}
        momentum = {}
        for opt in self.container.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    value = opt.state.get(p, {}).get("momentum_buffer")
                    if value is None:
                        continue
                    member = handle.member_of(p)
                    if member is not None:
                        value = handle.tp_full(member, value)
                    elif isinstance(value, DTensor):
                        value = value.full_tensor()
                    momentum[names[id(p)]] = value.detach().clone()
        return out, momentum


def _train_and_keep(rank, world, folder, state, tp, until, hf=False):
    job = _Job(world, folder, tp=tp, state=state, hf=hf)
    return job.train(until), *job.state(), job.hf_expected() if hf else None


def _resume(rank, world, folder, tp, until, step=2):
    job = _Job(world, folder, tp=tp, state=None)
    assert job.manager.load(step=step)
    return job.train(until), *job.state()


def test_tp_checkpoint_resumes_bit_exact_and_reshards(pool4, tmp_path):
    """A TP 2 x FSDP 2 job saves at step 2 (DCP: each dedicated weight and its momentum as a DTensor
    of the full matrix on the tp mesh, written once); a new job resumes it bit-exactly to step 4;
    the same checkpoint loads into FSDP 4 (every weight and momentum equal the TP job's at step 2),
    and an FSDP 4 checkpoint loads into TP 2 x FSDP 2; the last save, in HF safetensors, holds the
    full current weights."""
    state = th.initial_state(_model())
    straight = pool4.run(_train_and_keep, str(tmp_path / "tp"), state, 2, 4, True)
    resumed = pool4.run(_resume, str(tmp_path / "tp"), 2, 4)
    assert [r[0] for r in resumed] == [r[0][2:] for r in straight]
    assert_states_equal(merge_rank_states(r[1] for r in resumed), merge_rank_states(r[1] for r in straight))
    assert_states_equal(merge_rank_states(r[2] for r in resumed), merge_rank_states(r[2] for r in straight))
    # reshard both ways: the step-2 state, through each layout
    at_two = pool4.run(_train_and_keep, str(tmp_path / "tp2"), state, 2, 2)
    into_fsdp = pool4.run(_resume, str(tmp_path / "tp2"), 1, 2)
    assert_states_equal(merge_rank_states(r[1] for r in into_fsdp), merge_rank_states(r[1] for r in at_two))
    assert_states_equal(merge_rank_states(r[2] for r in into_fsdp), merge_rank_states(r[2] for r in at_two))
    # the straight job's last save: model only, in HF safetensors, full current weights
    from tests.support.titan_outputs import check_hf_export

    check_hf_export(str(tmp_path / "tp" / "ckpt" / "step-4"), merge_rank_states(r[3] for r in straight))
    fsdp_at_two = pool4.run(_train_and_keep, str(tmp_path / "fsdp"), state, 1, 2)
    into_tp = pool4.run(_resume, str(tmp_path / "fsdp"), 2, 2)
    assert_states_equal(merge_rank_states(r[1] for r in into_tp), merge_rank_states(r[1] for r in fsdp_at_two))
    assert_states_equal(merge_rank_states(r[2] for r in into_tp), merge_rank_states(r[2] for r in fsdp_at_two))


# ---- the step's TP exchange at larger T, on the fake process group ---------------------------------------
def _tp_exchange_traffic(_rank, _world, tp_size):
    """Every rank of a TP group of ``tp_size`` in turn (fake process group): DMuon's elements per rank
    for one step of 8 matrices of uneven sizes, their homes as the plan gives them."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from titan_dmuon.plan.ownership import build_plan
    from titan_dmuon.plan.specs import MatrixSpec
    from titan_dmuon.runtime.comm import CommStats
    from titan_dmuon.runtime.mode import TensorParallelInfo
    from titan_dmuon.runtime.streams import Streams
    from titan_dmuon.runtime.tensor_parallel import TensorParallelNewtonSchulz

    # local shapes and tp dims; as many matrices as the largest T here, so that every rank is a home (the
    # fake process group refuses an empty all-to-all input, which gloo and NCCL take)
    shapes = [
        ((64, 32), 0),
        ((32, 64), 1),
        ((16, 48), 0),
        ((48, 16), 1),
        ((8, 8), 0),
        ((24, 8), 1),
        ((8, 40), 0),
        ((16, 16), 1),
    ]
    specs = [
        MatrixSpec(
            fqn=f"w{i}", shape=s, unit=0, blocks=(((0, s[0] * (tp_size if d == 0 else 1)),),), tp_dim=d, tp_size=tp_size
        )
        for i, (s, d) in enumerate(shapes)
    ]
    # a stack of 3 experts split on their rows, each expert homed on its own; a replicated matrix (a router)
    specs += [
        MatrixSpec(fqn="experts", shape=(3, 8, 16), unit=0, blocks=(((0, 8 * tp_size),),), tp_dim=1, tp_size=tp_size),
        MatrixSpec(fqn="router", shape=(8, 24), unit=0, blocks=(((0, 8),),), tp_dim=None, tp_size=tp_size),
    ]
    plan = build_plan(specs, replicate_size=1, shard_size=1)
    matrices = [m for e in plan.entries for m in e.tp_matrices()]
    moved, launches, homes = [], [], [m.home for m in matrices]
    for rank in range(tp_size):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=tp_size)
        try:
            tp = TensorParallelInfo.from_mesh(init_device_mesh("cpu", (tp_size,), mesh_dim_names=("tp",)))
            stats = CommStats()
            exchange = TensorParallelNewtonSchulz(tp, stats, Streams(torch.device("cpu")))
            shards = [
                torch.zeros(m.shape, dtype=torch.bfloat16) if m.dim is not None or m.home == rank else None
                for m in matrices
            ]
            _, count = exchange.orthogonalise(matrices, shards, lambda ms: ms)
            popped = stats.pop()
            moved.append(sum(e for e, _, _ in popped.values()))
            launches.append((sum(n for _, _, n in popped.values()), count))
        finally:
            dist.destroy_process_group()
    full = sum(torch.Size(e.full_shape).numel() for e in plan.entries if not e.tp_replicated)
    replicated = sum(e.numel for e in plan.entries if e.tp_replicated)
    return moved, launches, homes, full, replicated


@pytest.mark.parametrize("tp_size", [4, 8])
def test_tp_exchange_moves_the_design_at_larger_tp(solo, tp_size):
    """At T = 4 and 8: two all-to-alls per step chunk, each moving (T-1)/T of the shards; averaged over
    the TP group exactly 2(T-1)/T^2 x the full elements (uneven homes change each rank's own count,
    not the average), each expert of a stack like a matrix of its own, and (T-1)/T x a replicated
    matrix (only its result travels, from its home: its gradient reaches the home in backward);
    every matrix and expert orthogonalised on exactly one rank; homes spread over the group."""
    from fractions import Fraction

    moved, launches, homes, full, replicated = solo.run(_tp_exchange_traffic, tp_size)[0]
    t = tp_size
    assert sum(moved) / t == 2 * Fraction(t - 1, t**2) * full + Fraction(t - 1, t) * replicated
    assert all(n == 2 for n, _ in launches)
    assert sum(count for _, count in launches) == 8 + 3 + 1
    assert sorted(set(homes)) == list(range(tp_size))


def _step_issue_order(rank, world):
    from titan_dmuon import CommLedger

    dims = th.parallel_dims(world, tp=2)
    model, container = th.build(th.tiny_llama3(n_layers=4), dims, lr=0.02)
    th.train(model, container, dims, _data()[:1])  # (the first step learns the layer order)
    with CommLedger() as ledger:
        th.train(model, container, dims, _data()[1:2])
    sources = [r.source for r in ledger.records]
    last_reduce = max(i for i, s in enumerate(sources) if s == CommLabel.SHARD_REDUCE)
    step = [r for r in ledger.records[last_reduce + 1 :] if r.source != CommLabel.OTHER]
    runs, launches = [], []  # one per launch (a layer's broadcast: one per owner), its elements summed
    for r in step:
        if launches and launches[-1] is r.launch:
            runs[-1][1] += r.elements
        else:
            runs.append([r.source, r.elements])
            launches.append(r.launch)
    return [tuple(run) for run in runs]


def test_tp_step_pipelines_the_exchange(pool4):
    """The step's issue order (4 layers, chunks [layer 0], [layer 1], [layers 2, 3]: 1, 1, 2, 4, ...
    layers; each chunk one exchange at these sizes), identical on every rank: each chunk's shards go
    to their homes (one all-to-all per chunk) before the previous chunk's Newton–Schulz, whose results
    go back next, so each transfer overlaps a Newton–Schulz (tests/unit/test_tensor_parallel_update.py
    checks the stages' order and stream waits); layer 0 is broadcast for the next forward once its
    results are applied, after layer 1's Newton–Schulz, before layer 1's results are applied. (Other
    chunk sizes give another number of exchanges: 1, 1, 1, 1 four, 1, 2, 1 three but in another order
    of sizes, seen in the elements of each.)"""
    orders = pool4.run(_step_issue_order)
    exchange, back, broadcast = CommLabel.TP_TO_HOME, CommLabel.TP_FROM_HOME, CommLabel.FORWARD_BROADCAST
    sources = [[s for s, _ in order] for order in orders]
    assert sources[0] == [exchange, exchange, back, exchange, back, broadcast, back], orders[0]
    assert all(order == sources[0] for order in sources)
    # summed over the ranks each exchange moves its layers' shards: 1, 1, 2 layers (all layers alike)
    sizes = [sum(n for order in orders for s, n in order[i : i + 1] if s == exchange) for i in (0, 1, 3)]
    assert sizes[0] == sizes[1] > 0 and sizes[2] == 2 * sizes[0], sizes


# ---- the step's capped batches: the same bits as one exchange ------------------------------------------
def _capped_vs_one_exchange(rank, world):
    """Two TP steps (TP = the 2 gloo ranks) of a stack of 6 experts split on their rows, homes
    alternating, and of a matrix split on its columns, by ``TensorParallelStep``: with the cap at one
    expert's exchange bytes (every matrix its own batch: the stack split over six), at four (the
    stack split 4 + 2, the second part batched with the matrix) and at the default (one exchange);
    whether each capped run's shards and momentum equal the default's, and the matrices each
    orthogonalised here."""
    from collections import defaultdict
    from types import SimpleNamespace

    from torch.distributed.device_mesh import init_device_mesh

    from titan_dmuon.optim import tensor_parallel_update as tensor_parallel_step
    from titan_dmuon.optim.tensor_parallel_update import TensorParallelStep, TPItem, exchange_bytes
    from titan_dmuon.optim.whole_update import NSFigures, OwnerUpdate
    from titan_dmuon.plan.specs import TPMatrix
    from titan_dmuon.runtime.comm import CommStats
    from titan_dmuon.runtime.mode import TensorParallelInfo
    from titan_dmuon.runtime.streams import Streams
    from titan_dmuon.runtime.tensor_parallel import TensorParallelNewtonSchulz

    tp = TensorParallelInfo.from_mesh(init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    group = dict(
        lr=0.02,
        weight_decay=0.1,
        momentum=0.95,
        nesterov=True,
        ns_steps=5,
        eps=1e-7,
        ns_coefficients=(3.4445, -4.7750, 2.0315),
        adjust_lr_fn="match_rms_adamw",
        ns_mode="batched",
    )
    generator = torch.Generator().manual_seed(rank)
    stack, matrix = torch.randn(6, 8, 24, generator=generator), torch.randn(16, 12, generator=generator)
    grads = [
        (torch.randn(stack.shape, generator=generator), torch.randn(matrix.shape, generator=generator))
        for _ in range(2)
    ]
    experts = [
        TPMatrix(shape=(8, 24), dim=0, home=e % world, blocks=(((0, 8 * world),),), col_blocks=(((0, 24),),))
        for e in range(6)
    ]
    columns = [TPMatrix(shape=(16, 12), dim=1, home=1, blocks=(((0, 16),),), col_blocks=(((0, 12 * world),),))]
    default, runs = tensor_parallel_step.MAX_EXCHANGE_BYTES, []
    for cap in (exchange_bytes(experts[0], world), 4 * exchange_bytes(experts[0], world), default):
        weights, state = (stack.clone(), matrix.clone()), defaultdict(dict)
        rule = OwnerUpdate(
            SimpleNamespace(state=state, ns_method="torch", ns_dtype="bfloat16", normuon_beta2=None), NSFigures()
        )
        tp_step = TensorParallelStep(TensorParallelNewtonSchulz(tp, CommStats(), Streams(torch.device("cpu"))), rule)
        tensor_parallel_step.MAX_EXCHANGE_BYTES = cap
        try:
            for grad in grads:
                items = [
                    TPItem(param=weights[0], weight=weights[0], grad=grad[0], matrices=experts),
                    TPItem(param=weights[1], weight=weights[1], grad=grad[1], matrices=columns),
                ]
                tp_step.submit([(group, items)], then=lambda: None)
                tp_step.finish()
        finally:
            tensor_parallel_step.MAX_EXCHANGE_BYTES = default
        runs.append(([*weights, *(state[w]["momentum_buffer"] for w in weights)], rule.figures.matrices))
    equal = [all(torch.equal(a, b) for a, b in zip(tensors, runs[-1][0])) for tensors, _ in runs[:-1]]
    return equal, [count for _, count in runs]


def test_capped_exchange_batches_change_no_bit(pool2):
    """The cap splits a step's TP matrices into batches, a stack of experts between batches too: each
    expert's momentum, Newton–Schulz and update are the same elementwise operations on the same
    values, so two steps in capped batches give bitwise the shards and momentum of one exchange per
    step; every matrix orthogonalised once per step, on its home (rank 0 homes 3 of the 7, rank 1 4)."""
    results = pool2.run(_capped_vs_one_exchange)
    assert [equal for equal, _ in results] == [[True, True], [True, True]]
    assert [counts for _, counts in results] == [[6, 6, 6], [8, 8, 8]]
