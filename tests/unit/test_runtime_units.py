"""Each runtime module on its own, in one process on the fake process group (fast: a change to the
reducer or the unit lifecycle is checked here without the multi-process suite).

The fake backend accepts any collective and moves no data, so these tests check state machines,
counts and buffers; values are checked only where no collective produces them (world size 1).
The units, contexts and reducers are built as ``dedicate_params`` builds them (``tests/support/runtime_parts.py``),
without a handle; the handle's own tests use ``dedicate_params``.
"""

from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from tests.support.helpers import toy_model
from tests.support.runtime_parts import fake_pg, runtime_parts
from titan_dmuon.runtime.comm import CommLabel


def _on_fake_pg(world, fn):
    with fake_pg(world):
        return fn()


# ---- comm --------------------------------------------------------------------------------------------
def test_comm_stats_count_integers_and_read_exact_fractions():
    from titan_dmuon.runtime.comm import CommStats

    stats = CommStats()
    stats.add(CommLabel.SHARD_REDUCE, 4, 100, 200)
    stats.add(CommLabel.SHARD_REDUCE, 4, 20, 40)
    stats.add(CommLabel.SHARD_REDUCE, 2, 10, 40)
    stats.add_launch(CommLabel.SHARD_REDUCE)
    elements, nbytes = Fraction(3, 4) * 120 + Fraction(1, 2) * 10, Fraction(3, 4) * 240 + 20
    assert stats.pop() == {CommLabel.SHARD_REDUCE: (elements, nbytes, 1)}
    assert stats.pop() == {}


def _launch_counts():
    from titan_dmuon.runtime.comm import CommStats, Launch

    stats = CommStats()
    with Launch(dist.group.WORLD, 4, torch.device("cpu"), CommLabel.FORWARD_BROADCAST, stats, coalesce=True) as launch:
        launch.broadcast(torch.ones(6), src=1)
        launch.reduce(torch.ones(2), dst=3)
    with Launch(dist.group.WORLD, 1, torch.device("cpu"), CommLabel.BACKWARD_BROADCAST, stats, coalesce=True) as alone:
        alone.broadcast(torch.ones(6), src=0)  # a group of one: nothing to send
    return stats.pop(), len(launch.in_flight.works), len(alone.in_flight.works)


def test_a_launch_counts_elements_once_and_one_launch(solo):
    counts, works, alone = solo.run(_launch_counts_job)[0]
    assert counts == {CommLabel.FORWARD_BROADCAST: (Fraction(3, 4) * 8, Fraction(3, 4) * 32, 1)}
    assert works == 1 and alone == 0  # one coalesced work to wait on; none for a group of one


def _launch_counts_job(rank, world):
    return _on_fake_pg(4, _launch_counts)


def test_a_launch_on_an_accelerator_records_its_event_also_for_a_group_of_one(monkeypatch):
    """Regression (found reading the runtime as CUDA runs it): at world size 1 a unit's gather is
    only a copy into the buffer on the gather stream; the launch issued no collective and recorded
    no event, so the compute stream read the buffer without waiting for the copy. Every launch on
    an accelerator now records one (a launch is counted only when something was issued)."""
    from titan_dmuon.runtime.comm import CommStats, Launch

    recorded = []

    class Stream:
        def record_event(self):
            recorded.append(object())
            return recorded[-1]

    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: Stream())
    stats = CommStats()
    with Launch(None, 1, torch.device("cuda", 0), CommLabel.FORWARD_BROADCAST, stats, coalesce=True) as alone:
        alone.broadcast(torch.ones(3), src=0)
    assert alone.in_flight.event is recorded[0]
    assert stats.pop() == {}  # nothing moved, no launch


def test_in_flight_waits_once():
    from titan_dmuon.runtime.comm import InFlight

    class Work:
        waited = 0

        def wait(self):
            Work.waited += 1

    in_flight = InFlight(works=[Work(), Work()])
    in_flight.wait()
    in_flight.wait()
    assert Work.waited == 2 and in_flight.works == []


# ---- mode ------------------------------------------------------------------------------------------
def _modes():
    from torch.distributed.device_mesh import init_device_mesh

    from titan_dmuon.runtime import DedicationMode

    one_d = DedicationMode.build(init_device_mesh("cpu", (4,)), reshard_after_forward=True)
    two_d = DedicationMode.build(
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard")), reshard_after_forward=False
    )
    errors = []
    for bad in (
        lambda: DedicationMode.build(init_device_mesh("cpu", (2, 2)), reshard_after_forward=True),
        lambda: DedicationMode.build(init_device_mesh("cpu", (4,)), reshard_after_forward="yes"),
        lambda: DedicationMode.build(init_device_mesh("cpu", (4,)), reshard_after_forward=True, expert_sharding="x"),
    ):
        try:
            bad()
        except (TypeError, ValueError) as e:
            errors.append(str(e))
    return (
        (one_d.name, one_d.mesh.shard_size, one_d.mesh.replicate_size, one_d.mesh.hsdp, one_d.mesh.coalesces),
        (two_d.name, two_d.mesh.shard_size, two_d.mesh.replicate_size, two_d.mesh.hsdp),
        [one_d.experts_stay_local(e) for e in (2, 4, 8)],
        [two_d.experts_stay_local(e) for e in (2, 4)],
        errors,
    )


def test_the_mode_is_decided_once_from_the_mesh(solo):
    one_d, two_d, local_1d, local_2d, errors = solo.run(_modes_job)[0]
    assert one_d == ("dmuon_z3", 4, 1, False, True) and two_d == ("dmuon_z2", 2, 2, True)
    # one rule for experts: local when the data-parallel world has no more ranks than experts
    assert local_1d == [False, True, True] and local_2d == [False, True]
    assert len(errors) == 3 and "dp_replicate" in errors[0] and "bool" in errors[1] and "expert_sharding" in errors[2]


def _modes_job(rank, world):
    return _on_fake_pg(4, _modes)


# ---- unit: the buffer's state machine, and the order checks ----------------------------------------------
def _unit_lifecycle():
    from titan_dmuon.runtime.unit import BufferState

    ctx = runtime_parts(4).ctx
    unit = ctx.units[0]
    states = [unit.state]
    unit.gather(CommLabel.FORWARD_BROADCAST)
    states.append(unit.state)
    allocated = ctx.buffer_bytes
    unit.gather(CommLabel.FORWARD_BROADCAST)  # no-op while not FREE
    unit.wait()
    states.append(unit.state)
    unit.swap_in()
    swapped = all(m.module._parameters[m.name] is m.compute for m in unit.members)
    unit.swap_out()
    restored = all(m.module._parameters[m.name] is m.param for m in unit.members)
    unit.free()
    states.append(unit.state)
    prefetched = ctx.units[1]
    prefetched.gather(CommLabel.FORWARD_BROADCAST)
    prefetched.free()  # never used: freed straight from GATHERING
    return (
        [s.value for s in states],
        allocated,
        unit.numel * 4,
        ctx.buffer_bytes,
        swapped,
        restored,
        prefetched.state is BufferState.FREE,
    )


def test_a_units_buffer_goes_free_gathering_ready_free(solo):
    states, allocated, expected, after, swapped, restored, prefetched_freed = solo.run(_lifecycle_job)[0]
    assert states == ["free", "gathering", "ready", "free"]
    assert allocated == expected and after == 0
    assert swapped and restored and prefetched_freed


def _lifecycle_job(rank, world):
    return _on_fake_pg(4, _unit_lifecycle)


def _wide_block_in_place():
    """A unit holding a wide weight split over an owner group of 4 by column blocks, seen from rank 0."""
    from tests.support.owner_groups_parts import TINY_GROUPS, dominant_model, dominant_targets

    model = dominant_model(tall=False)
    parts = runtime_parts(4, model=model, params=dominant_targets(model), owner_groups=TINY_GROUPS)
    (unit,) = [u for u in parts.ctx.units if any(m.group is not None for m in u.members)]
    (member,) = [m for m in unit.members if m.group is not None]
    mine = next(p for p in unit.pieces if p.member is member and p.shard_owner == 0)
    with torch.no_grad():
        member.param.copy_(torch.arange(member.param.numel(), dtype=torch.float32).view(member.param.shape))
    unit.gather(CommLabel.FORWARD_BROADCAST)
    gathered = parts.ctx.buffer_bytes
    unit.wait()
    lo, hi = mine.bounds
    landed = torch.equal(member.compute.detach()[:, lo:hi], member.param)  # (the fake group moves no data)
    segments = [(s.start, s.stop) for s in unit.segments if s.start >= member.offset]
    blocks = [(p.offset, p.offset + p.numel) for p in unit.pieces if p.member is member]
    x = torch.randn(3, member.shape[1])
    torch.nn.functional.linear(x, member.compute).sum().backward()
    return (
        member.shape,
        member.compute.stride(),
        member.compute.grad.stride(),
        landed,
        segments == blocks,
        gathered == unit.numel * 4,
    )


def test_a_wide_weights_column_blocks_are_gathered_in_place(solo):
    """A wide weight split by column blocks is laid out column-major in its unit's buffer: each block is one
    contiguous range (one broadcast straight into place), the owner's block lands in the compute param's
    columns, and gathering allocates the buffer alone. Before, the blocks landed in a staging area as large
    as the weight and were copied into the row-major weight at ``wait`` (a whole-matrix copy on every rank
    per gather). A Linear's weight gradient comes out column-major (matmul's backward keeps the layout), so
    autograd adds no copy of its own."""
    shape, strides, grad_strides, landed, one_range_each, buffer_only = solo.run(_wide_block_in_place_job)[0]
    assert shape[0] < shape[1] and strides == grad_strides == (1, shape[0])
    assert landed and one_range_each and buffer_only


def _wide_block_in_place_job(rank, world):
    return _on_fake_pg(4, _wide_block_in_place)


def _order_checks():
    from titan_dmuon.runtime import UnitOrderError

    ctx = runtime_parts(4, model=toy_model(n_layers=3), allocate=False).ctx
    units = ctx.units
    ctx.begin_forward()
    for unit in units:
        ctx.enter_forward(unit)  # the first step records the order
    ctx.recording = False
    messages = []
    ctx.begin_forward()
    ctx.enter_forward(units[0])
    try:
        ctx.enter_forward(units[2])  # layer 1 skipped
    except UnitOrderError as e:
        messages.append(str(e))
    ctx.begin_forward()
    for unit in units:
        ctx.enter_forward(unit)
        unit.phase = unit.phase.AWAITING_BACKWARD
    try:
        ctx.check_backward_order(units[0])  # layers 1 and 2 had no backward yet
    except UnitOrderError as e:
        messages.append(str(e))
    return messages, [u.name for u in units]


def test_the_context_names_a_skipped_layer(solo):
    messages, names = solo.run(_order_job)[0]
    assert names == ["layers.0", "layers.1", "layers.2"]
    assert len(messages) == 2
    assert "'layers.2' ran forward but layer(s) ['layers.1'] did not run" in messages[0]
    assert "'layers.1' ran forward but got no gradient before layer 'layers.0'" in messages[1]  # the first one it meets


def _order_job(rank, world):
    return _on_fake_pg(4, _order_checks)


# ---- reducer: every member, zeros where none --------------------------------------------------------------
def _reduced_with_one_gradient_missing():
    """World size 1 (nothing is sent): a unit's gradients through the reducer's copy-in into flat
    buffers, its (empty) reduces and its hand-over to the owner's ``.grad``."""
    import warnings

    ctx = runtime_parts(1).ctx
    unit = ctx.units[0]
    for i, m in enumerate(unit.members):
        m.compute.grad = None if i == 1 else torch.full(m.shape, float(i + 1))
    empty = torch.empty

    def dirty_empty(*args, **kwargs):  # memory as an allocator may hand it out: not zeros
        return empty(*args, **kwargs).fill_(float("nan"))

    torch.empty = dirty_empty
    try:
        ctx.reducer.reduce(unit)
    finally:
        torch.empty = empty
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        ctx.reducer.finish()
    grads = [(i, float(m.param.grad.unique()[0]), m.param.grad.unique().numel()) for i, m in enumerate(unit.members)]
    return grads, [m.compute.grad is None for m in unit.members], [str(w.message) for w in warned], unit.members[1].fqn


def test_the_reducer_reduces_every_member_and_zeros_the_missing_one(solo):
    """The flat buffers are torch.empty: a member without a gradient must be zeroed, not left as
    whatever the memory held (fresh memory happened to be zeros, so the test passed without the zero
    fill; here torch.empty hands out NaNs). Its owner gets the zero gradient, and a warning naming it."""
    grads, freed, warned, missing = solo.run(_reduced_job)[0]
    assert grads == [(i, 0.0 if i == 1 else float(i + 1), 1) for i in range(len(grads))]
    assert all(freed)  # autograd's gradients are dropped once copied
    assert len(warned) == 1 and repr(missing) in warned[0]


def _reduced_job(rank, world):
    return _on_fake_pg(1, _reduced_with_one_gradient_missing)


def _accumulated_grads():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from tests.support.helpers import batches, distribute
    from titan_dmuon.testing.toy_model import loss_fn

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    x, y = batches(1)[0]
    grads = {}
    for sync in ("each", "deferred"):
        setup = distribute(toy_model(), "z2", 1, mp_policy=policy)
        for step in ("", " again"):  # two steps (no update between: the same gradients again)
            setup.handle.set_requires_gradient_sync(sync == "each")
            for xs, ys in zip(x.chunk(4), y.chunk(4)):
                loss_fn(setup.module(xs), ys).backward()
            setup.handle.set_requires_gradient_sync(True)
            setup.handle.reduce_gradients()
            grads[sync + step] = {m.fqn: m.param.grad.clone() for m in setup.handle.members}
            for m in setup.handle.members:
                m.param.grad = None
    bf16 = {}  # what adding the micro-batches' gradients up in bf16 would give
    for xs, ys in zip(x.chunk(4), y.chunk(4)):
        setup = distribute(toy_model(), "z2", 1, mp_policy=policy)
        loss_fn(setup.module(xs), ys).backward()  # (sync on: the owner's fp32 copy of this bf16 gradient)
        for m in setup.handle.members:
            g = m.param.grad.to(torch.bfloat16)
            bf16[m.fqn] = g if m.fqn not in bf16 else bf16[m.fqn] + g
    return grads, bf16


def test_gradients_accumulate_in_the_reduce_dtype_with_sync_off(solo):
    """Regression: with gradient sync off the micro-batches' bf16 gradients added up in bf16 on
    the compute params (autograd's accumulation); FSDP2's no-sync accumulates in the reduce
    dtype. Now each post-backward moves them into fp32 accumulators: four micro-batches with one
    deferred reduce give bitwise the gradient of four reduces each added on the owner in fp32 (at
    world size 1: the same fp32 additions of the same bf16 values in the same order), which a bf16
    sum does not."""
    grads, bf16 = solo.run(_accumulated_grads_job)[0]
    assert grads["each"].keys() == grads["deferred"].keys() == bf16.keys()
    for fqn, g in grads["each"].items():
        assert g.dtype == torch.float32 and torch.equal(g, grads["deferred"][fqn]), fqn
        # the next step starts from empty accumulators (the reduce hands them over and clears them): the
        # same batches give the same gradient again, not twice it
        assert torch.equal(grads["deferred again"][fqn], g) and torch.equal(grads["each again"][fqn], g), fqn
    assert any(not torch.equal(g, bf16[fqn].float()) for fqn, g in grads["each"].items())


def _accumulated_grads_job(rank, world):
    return _on_fake_pg(1, _accumulated_grads)


# ---- handle: to_empty() is followed in one place -----------------------------------------------------------
def _follow_to_empty():
    from tests.support.runtime_parts import data_parallel_mesh
    from titan_dmuon import dedicate_params
    from titan_dmuon.runtime import DedicatedParams
    from titan_dmuon.testing.toy_model import ToyConfig, ToyTransformer, muon_targets

    with torch.device("meta"):
        model = ToyTransformer(ToyConfig())
    handle = dedicate_params(model, muon_targets(model), data_parallel_mesh(4))
    before = [m.param for m in handle.members]
    model.to_empty(device="cpu")
    after = [m.param for m in handle.members]
    registered = [m.module._parameters[m.name] for m in handle.members]
    return (
        all(a is not b for a, b in zip(after, before)),
        all(a is r for a, r in zip(after, registered)),
        all(handle.member_of(p) is not None for p in registered),
        DedicatedParams.of(model) == [handle],
        all(p._dmuon_handle() is handle for p in registered),
    )


def test_the_handle_follows_to_empty_through_one_override(solo):
    assert all(solo.run(_follow_job)[0])


def _follow_job(rank, world):
    return _on_fake_pg(4, _follow_to_empty)


# ---- cost model ------------------------------------------------------------------------------------------
class _Mode:
    def __init__(self, n, r, z3):
        self.mesh = type("M", (), {"shard_size": n, "replicate_size": r})()
        self.reshard_after_forward = z3
        self.tp = None


@pytest.mark.parametrize("n, r, z3, kept", [(8, 1, False, 0), (8, 1, True, 10), (4, 2, True, 10)])
def test_the_cost_model_is_the_designs_formula(n, r, z3, kept):
    from titan_dmuon.plan.cost_model import dmuon_elements_per_rank

    p = 1000
    expected = (3 if z3 else 2) * Fraction(n - 1, n) * p - Fraction(n - 1, n) * kept
    expected += 2 * Fraction(r - 1, r) * Fraction(p, n) if r > 1 else 0
    assert dmuon_elements_per_rank(_Mode(n, r, z3), numel=p, kept_unit_numel=kept) == expected


def test_the_step_goes_in_chunks_of_one_one_two_four_and_so_on():
    """The pipelined step's chunks (``runtime/step_schedule.py``): the first layer alone (the next forward
    starts with it), then 1, 2, 4, ... layers; every layer once, in forward order. The issue-order
    test sees only the first three chunks of its 4-layer model."""
    from titan_dmuon.optim.step_schedule import pipeline_chunks

    layers = list(range(10))
    assert [len(chunk) for chunk in pipeline_chunks(layers)] == [1, 1, 2, 4, 2]
    assert [unit for chunk in pipeline_chunks(layers) for unit in chunk] == layers
    assert pipeline_chunks([]) == [] and pipeline_chunks([7]) == [[7]]
