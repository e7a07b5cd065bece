"""The runtime as a GPU job meets it: no host sync per step, memory no worse than FSDP2,
launches, hooks that come off, and DDP with activation checkpointing."""

import gc
import types
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy

from tests.support.helpers import (
    ADAMW,
    MUON,
    TOLERANCE,
    allocation_peak,
    baseline,
    batches,
    bitwise_equal,
    distribute,
    full_state,
    local_slice,
    make_mesh,
    max_diff,
    reference_train,
    toy_model,
    train,
)
from tests.support.measure import HostSyncCounter, host_syncs_in_steady_steps
from titan_dmuon import DMuon, clip_grad_norm_, dedicate_params
from titan_dmuon.runtime import CommLabel
from titan_dmuon.testing.toy_model import loss_fn, muon_targets

# ---- no host sync in a steady-state step --------------------------------------------------


def _host_syncs(rank, world, mode, ns_method="torch"):
    setup = distribute(toy_model(), mode, world, opt_kwargs={"ns_method": ns_method})
    return host_syncs_in_steady_steps(setup, rank, world)


@pytest.mark.parametrize("mode", ["z3", "z2", "ddp"])
def test_no_host_sync_in_a_steady_state_step(pool2, mode):
    """forward, backward, DMuon's clip and step: nothing waits for a device value on the host."""
    for syncs in pool2.run(_host_syncs, mode):
        assert syncs == []


@pytest.mark.parametrize("ns_method", ["polar_express", "gram"])
def test_no_host_sync_with_each_newton_schulz_method(pool2, ns_method):
    """The other methods' schedules and Gram Newton–Schulz's restarts are decided from shapes and step
    numbers, never from a device value."""
    for syncs in pool2.run(_host_syncs, "z3", ns_method):
        assert syncs == []


def test_no_host_sync_under_hsdp(pool4):
    for syncs in pool4.run(_host_syncs, "hsdp"):
        assert syncs == []


def test_the_counter_sees_a_host_sync(pool2):
    """The counting mode is not blind: a .item() inside the step is counted."""

    for syncs in pool2.run(_sync_inside):
        assert syncs == ["_local_scalar_dense.default"]


def _sync_inside(rank, world):
    counter = HostSyncCounter(set())
    with counter:
        torch.ones(2).sum().item()
    return counter.syncs


# ---- memory: Z3's transient peak is no more than FSDP2's -------------------------------------
MIXED = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
MEMORY_DIMS = dict(dim=64, hidden_dim=128, n_layers=4, vocab_size=64)


def _forward_backward_peak(rank0, _world, kind, mode, n):
    """Bytes allocated at the peak of one steady-state forward+backward on rank 0 of N, above what was
    allocated before it (activations, gathered weights, gradients and reduce buffers).

    On the fake process group: the same allocations as on gloo, all on this thread (the profiler
    misses frees that gloo's worker threads do, which would read as memory never released)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    try:
        model = toy_model(**MEMORY_DIMS)
        mesh = make_mesh(mode, n)
        if kind == "dmuon":
            setup = distribute(model, mode, n, mp_policy=MIXED, mesh=mesh)
        else:
            setup = baseline(model, "fsdp_adamw", n, reshard=mode != "z2", mp_policy=MIXED, mesh=mesh)
        data = batches(3, global_batch=n, vocab=MEMORY_DIMS["vocab_size"])
        train(setup, data[:2], 0, n)
        x, y = local_slice(data[2], 0, n)
        return allocation_peak(lambda: loss_fn(setup.module(x), y).backward())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["z3", "z2"])
def test_transient_memory_no_more_than_fsdp2(solo, mode):
    """Same model, same batch, bf16 compute / fp32 reduce, 2 ranks: DMuon's peak over forward+backward
    is at most FSDP2+AdamW's (Z3: each layer's gathered weights, its gradients and its reduce buffer,
    like FSDP2's all-gather output and reduce-scatter input; Z2 keeps every layer)."""
    mine = solo.run(_forward_backward_peak, "dmuon", mode, 2)[0]
    theirs = solo.run(_forward_backward_peak, "fsdp", mode, 2)[0]
    assert 0 < mine <= theirs, (mine, theirs)


# ---- launches -----------------------------------------------------------------------------------
def _launches(rank0, _world, mode, n):
    """DMuon's launches per step on simulated rank 0 of N (fake process group: coalesces like NCCL)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from titan_dmuon import CommLedger

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    try:
        dims = dict(dim=64, hidden_dim=128, n_kv_heads=4, vocab_size=128, n_layers=3)
        setup = distribute(toy_model(**dims), mode, n)
        data = batches(3, global_batch=n, vocab=128)
        train(setup, data[:2], 0, n)
        with CommLedger() as ledger:
            train(setup, data[2:], 0, n)
        return ledger.launches(source=CommLabel.DMUON), len(ledger.select(source=CommLabel.DMUON))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode, per_step", [("z2", 2 * 3), ("z3", 3 * 3 - 1), ("ddp", 2 * 3)])
def test_one_launch_per_layer_and_direction(solo, mode, per_step):
    """3 layers, 7 matrices each spread over 8 owners: every layer's broadcasts go out as one
    coalesced group, its reduces as another (Z3: minus the last layer's re-broadcast)."""
    launches, collectives = solo.run(_launches, mode, 8)[0]
    assert launches == per_step
    assert collectives > 2 * launches  # several owners per layer: one launch instead of one per owner


# ---- hooks come off, models are not kept alive ------------------------------------------------------
def _remove_and_collect(rank, world):
    setup = distribute(toy_model(), "z3", world)
    train(setup, batches(1), rank, world)
    model_ref, handle_ref = weakref.ref(setup.model), weakref.ref(setup.handle)
    installed = _dmuon_hooks(setup)
    setup.handle.remove()
    leftover = _dmuon_hooks(setup)
    del setup
    gc.collect()
    return installed, leftover, model_ref() is None, handle_ref() is None


def _dmuon_hooks(setup) -> int:
    count = len(setup.handle.of(setup.model))
    for module in setup.model.modules():
        for hooks in (
            module._forward_pre_hooks,
            module._forward_hooks,
            module._state_dict_hooks,
            module._load_state_dict_pre_hooks,
            module._load_state_dict_post_hooks,
        ):
            count += sum("DedicatedParams" in repr(h) or "state_dict_hooks" in repr(h) for h in hooks.values())
    return count


def test_remove_takes_hooks_off_and_nothing_keeps_the_model_alive(pool2):
    """Nothing keeps a dedicated model reachable once the user drops it: no module-level
    registry, and no hook that autograd's C++ side holds beyond one backward (the per-step
    hooks live in the autograd graph, which is freed with it)."""
    for installed, leftover, model_gone, handle_gone in pool2.run(_remove_and_collect):
        assert installed > 0 and leftover == 0
        assert model_gone and handle_gone


# ---- nothing left in flight at the end of training ------------------------------------------------
def _finish_in_flight(rank, world, mode):
    from titan_dmuon.runtime.unit import BufferState

    setup = distribute(toy_model(), mode, world)
    data = batches(3)
    train(setup, data[:2], rank, world)
    units = setup.handle._units
    launched = sum(u.state is BufferState.GATHERING for u in units)
    synchronized = []  # the host's waits (a stream wait would leave an accelerator's broadcast running)

    def recorded(flight, what):
        return types.SimpleNamespace(
            synchronize=lambda: (synchronized.append(what), flight.synchronize()), wait=flight.wait
        )

    for unit in units:
        if unit.state is BufferState.GATHERING:
            unit._in_flight = recorded(unit._in_flight, "gather")
    replicas = setup.handle._ctx.replicas._in_flight  # (HSDP: the step's broadcasts to the replicas)
    replica_launched = len(replicas)
    for index in list(replicas):
        replicas[index] = recorded(replicas[index], "replica")
    setup.handle.finish_in_flight()
    left = sum(u.state is not BufferState.FREE or u._in_flight is not None for u in units)
    left += len(setup.handle._ctx.replicas._in_flight)
    train(setup, data[2:], rank, world)  # the next forward gathers again
    straight = distribute(toy_model(), mode, world)
    train(straight, data, rank, world)
    return {
        "launched": launched,
        "gathers_synchronized": synchronized.count("gather"),
        "replica_launched": replica_launched,
        "replicas_synchronized": synchronized.count("replica"),
        "left": left,
        "same": bitwise_equal(full_state(setup), full_state(straight)),
    }


@pytest.mark.parametrize("mode", ["z3", "z2"])
def test_finish_in_flight_leaves_no_collective_and_training_goes_on(pool2, mode):
    """Regression: each step launches the next forward's first broadcast and nobody waits for it
    after the last step. A 4-rank TP job on CI aborted at exit (SIGABRT, rank 3, after its last
    step logged): a gloo worker finishing that broadcast while the interpreter shut down. The
    trainer now calls ``finish_in_flight`` after training (test_titan_checks.py); here: the step
    had launched one, the host waited for it (not only a stream), afterwards nothing is gathering or
    in flight, and training goes on bitwise as the same job without the call (same kernels in the same
    order: only waits and frees differ)."""
    for r in pool2.run(_finish_in_flight, mode):
        assert r["launched"] == r["gathers_synchronized"] == 1 and r["left"] == 0
        assert r["replica_launched"] == 0
        assert r["same"]


def test_finish_in_flight_waits_for_hsdps_replica_broadcasts_on_the_host(pool4):
    """Under HSDP the step also leaves its post-step broadcasts to the replicas in flight (each
    layer's, but the first's, which the next forward's gather already waited for): the host waits
    for every one (``synchronize``), not a stream, which on an accelerator would leave them running
    when the process groups go. Regression: the Z2/Z3 runs above have no replica broadcast, so a
    ``finish_in_flight`` that waited for them by the stream (on gloo the host blocks either way)
    passed."""
    for r in pool4.run(_finish_in_flight, "hsdp"):
        assert r["launched"] == r["gathers_synchronized"] == 1 and r["left"] == 0
        assert r["replica_launched"] == r["replicas_synchronized"] > 0
        assert r["same"]


# ---- DDP with activation checkpointing ----------------------------------------------------------------
def _ddp_with_activation_checkpointing(rank, world):
    data = batches(5)
    model = toy_model()
    ref, _, _ = reference_train(model, data)
    for i, layer in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(layer)
    setup = distribute(model, "ddp", world)
    train(setup, data, rank, world)
    return max_diff(full_state(setup), ref)


def test_ddp_with_activation_checkpointed_blocks(pool2):
    """wrap_ddp passed canonical names (without "_checkpoint_wrapped_module.") to DDP's ignore
    list, so DDP also tried to sync the dedicated weights and crashed on the 0-element
    placeholders ("params[..] with sizes [0] appears not to match"). It now passes the names
    as named_parameters() spells them."""
    for diff in pool2.run(_ddp_with_activation_checkpointing):
        assert diff < TOLERANCE


# ---- DMuon's Muon update, step for step, against torch.optim.Muon ----------------------------------
def _single_process_steps(rank, world, muon=MUON, adamw=ADAMW):
    """One rank, exact mode: DMuon's owner-side update must be torch.optim.Muon's, bit for bit, every step."""
    data = batches(4)
    model = toy_model()
    reference = toy_model()
    targets = muon_targets(reference)
    ids = {id(p) for p in targets}
    ref_muon = torch.optim.Muon(targets, **muon)
    ref_adamw = torch.optim.AdamW(
        [p for p in reference.parameters() if id(p) not in ids],
        lr=adamw["adamw_lr"],
        betas=adamw["adamw_betas"],
        eps=adamw["adamw_eps"],
        weight_decay=adamw["adamw_weight_decay"],
    )
    mesh = make_mesh("z3", world)
    handle = dedicate_params(model, muon_targets(model), mesh)
    opt = DMuon(model.parameters(), dedicated=handle, **muon, **adamw, ns_mode="exact")
    mismatched = []
    for step, (x, y) in enumerate(data):
        loss_fn(model(x), y).backward()
        loss_fn(reference(x), y).backward()
        opt.step()
        opt.zero_grad()
        ref_muon.step()
        ref_adamw.step()
        ref_muon.zero_grad()
        ref_adamw.zero_grad()
        for (name, mine), theirs in zip(model.named_parameters(), reference.parameters()):
            if not torch.equal(mine, theirs):
                mismatched.append((step, name))
    return mismatched


def test_muon_update_is_torch_muon_step_for_step(pool1):
    """Weight decay, momentum, Nesterov and the shape-based LR scale: any difference from
    torch.optim.Muon shows as an unequal weight in the first step."""
    assert pool1.run(_single_process_steps) == [[]]


def test_adamw_groups_get_their_own_weight_decay(pool1):
    """Every other test gives Muon and AdamW the same weight decay (0.1), so AdamW groups decayed
    with Muon's ``weight_decay`` instead of ``adamw_weight_decay`` (or the reverse) would pass them
    all. With 0.1 vs 0.03 each AdamW-updated weight (embeddings, norms, head) differs from
    torch.optim.AdamW's in the first step (checked: with ``DMuonOptions.adamw()`` patched to pass
    Muon's decay, all 7 AdamW parameters differ at step 0, while the 0.1/0.1 test still passes)."""
    muon = {**MUON, "weight_decay": 0.1}
    adamw = {**ADAMW, "adamw_weight_decay": 0.03}
    assert pool1.run(_single_process_steps, muon, adamw) == [[]]


# ---- clipping: error_if_nonfinite ------------------------------------------------------------------------
def _nonfinite(rank, world, error_if_nonfinite):
    setup = distribute(toy_model(), "z3", world)
    x, y = local_slice(batches(1)[0], rank, world)
    loss_fn(setup.module(x), y).backward()
    owned = [p for p in setup.handle.params if setup.handle.runs_newton_schulz(p)]
    if rank == 0:
        owned[0].grad[0, 0] = float("inf")  # one rank's owned gradient: every rank must see it
    try:
        return float(
            clip_grad_norm_(
                setup.model.parameters(), 1.0, error_if_nonfinite=error_if_nonfinite, dedicated=setup.handle
            )
        )
    except RuntimeError as e:
        return str(e)


def test_clip_error_if_nonfinite(pool2):
    """TorchTitan's clip argument is honoured: an inf on one owner's gradient stops every rank
    (the norm is all-reduced), or, when not asked to, comes back as inf."""
    assert all("non-finite" in r for r in pool2.run(_nonfinite, True))
    assert pool2.run(_nonfinite, False) == [float("inf")] * 2
