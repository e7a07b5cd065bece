"""The order DMuon issues its collectives in, where the order decides overlap on NCCL.

NCCL runs one communicator's collectives in issue order. So:

* forward: the next layer's broadcast (the prefetch) is issued after FSDP2's all-gather for this
  layer, never ahead of it on the shared shard group (else this layer's compute waits for the
  next layer's transfer);
* backward (Z3): the layer before's re-broadcast is issued before this layer's reduce;
* the step: each layer is sent on (HSDP replica broadcast; the first layer's broadcast for the
  next forward) as soon as its own update is applied, before the later layers' Newton–Schulz,
  and this changes no result.

The order is identical on every rank (collectives are matched by order).
"""

import pytest

from tests.support.helpers import batches, bitwise_equal, distribute, full_state, local_slice, toy_model, train
from titan_dmuon import CommLedger
from titan_dmuon.runtime import CommLabel
from titan_dmuon.testing.toy_model import loss_fn

DIMS = dict(n_layers=3)


def _steady_state_records(rank, world, mode):
    """(forward, backward) collectives of step 3, each a list of (who, kind, group size): FSDP2's
    one by one ("fsdp"), DMuon's one entry per launch (its CommLabel)."""
    setup = distribute(toy_model(**DIMS), mode, world)
    data = batches(3)
    train(setup, data[:2], rank, world)
    x, y = local_slice(data[2], rank, world)
    with CommLedger() as forward:
        loss = loss_fn(setup.module(x), y)
    with CommLedger() as backward:
        loss.backward()
    setup.opt.zero_grad()
    return _entries(forward), _entries(backward)


def _entries(ledger):
    out, launches = [], set()
    for r in ledger.records:
        if r.source == CommLabel.OTHER:
            out.append(("fsdp", r.kind, r.group_size))
        elif r.launch not in launches:
            launches.add(r.launch)
            out.append((r.source, r.kind, r.group_size))
    return out


@pytest.mark.parametrize("mode", ["z3", "z2"])
def test_forward_prefetch_comes_after_fsdp2s_all_gather(pool2, mode):
    """Root all-gather, then per layer FSDP2's all-gather of its norms and only then the next
    layer's broadcast (the first layer's was launched by the previous step). Measured before the
    fix: root AG, B(1), B(1), AG(0), B(2), B(2), AG(1), AG(2): compute(0) waited for B(1)."""
    results = pool2.run(_steady_state_records, mode)
    forward = results[0][0]
    ag, bcast = ("fsdp", "all_gather", 2), (CommLabel.FORWARD_BROADCAST, "broadcast", 2)
    assert forward == [ag, ag, bcast, ag, bcast, ag], forward
    assert all(r[0] == forward for r in results)  # the same order on every rank


def test_forward_prefetch_order_under_hsdp(pool4):
    results = pool4.run(_steady_state_records, "hsdp")
    forward = results[0][0]
    ag, bcast = ("fsdp", "all_gather", 2), (CommLabel.FORWARD_BROADCAST, "broadcast", 2)
    assert forward == [ag, ag, bcast, ag, bcast, ag], forward
    assert all(r[0] == forward for r in results)


def test_z3_backward_prefetch_comes_before_the_reduce(pool2):
    """Z3 backward, layers 2, 1, 0 (layer 2 kept from forward): layer 1's re-broadcast goes out in
    layer 2's pre-backward, before layer 2's reduce; without the prefetch it would come after
    (and layer 1's backward would wait for it)."""
    results = pool2.run(_steady_state_records, "z3")
    ours = [who for who, _, _ in results[0][1] if who != "fsdp"]
    b, r = CommLabel.BACKWARD_BROADCAST, CommLabel.SHARD_REDUCE
    assert ours == [b, r, b, r, r], ours
    assert all(res[1] == results[0][1] for res in results)


# ---- the step ----------------------------------------------------------------------------------------
def _step_events(rank, world, mode):
    """What step 3's optimizer step does, in order: ("ns", unit) for each Newton-Schulz call on a
    dedicated layer, ("send", label) for each launch."""
    from titan_dmuon.optim import whole_update as owner_update
    from titan_dmuon.runtime import comm

    setup = distribute(toy_model(**DIMS), mode, world)
    data = batches(3)
    train(setup, data[:2], rank, world)
    x, y = local_slice(data[2], rank, world)
    loss_fn(setup.module(x), y).backward()
    events = []
    real_step, real_enter = owner_update.muon_step, comm.Launch.__enter__
    owner_update.muon_step = lambda params, *a, **k: (
        events.append(("ns", tuple(p.shape for p in params))),
        real_step(params, *a, **k),
    )[1]
    comm.Launch.__enter__ = lambda self: (events.append(("send", self.source)), real_enter(self))[1]
    try:
        setup.opt.step()
    finally:
        owner_update.muon_step, comm.Launch.__enter__ = real_step, real_enter
    return [e if e[0] == "send" else ("ns",) for e in events]


def test_the_step_sends_each_layer_on_before_the_next_layers_newton_schulz(pool4):
    """HSDP 2 x 2: after each layer's Newton-Schulz, its replica broadcast; after the first layer's,
    also its broadcast for the next forward, so both overlap the later layers' Newton-Schulz
    (before, every send waited for the whole step)."""
    for events in pool4.run(_step_events, "hsdp"):
        sends = [i for i, e in enumerate(events) if e[0] == "send"]
        first_forward = events.index(("send", CommLabel.FORWARD_BROADCAST))
        last_ns = max(i for i, e in enumerate(events) if e == ("ns",))
        assert first_forward < last_ns, events
        replica = [i for i in sends if events[i] == ("send", CommLabel.REPLICATE_BROADCAST)]
        assert replica and replica[0] < last_ns, events


def _pipelined_vs_deferred(rank, world, mode, ns_mode):
    """The same run twice: sends issued as each layer is updated (the product), and all sends
    deferred to the end of the step (as before the pipelining)."""
    from titan_dmuon.optim.optimizer import DMuon
    from titan_dmuon.runtime import DedicatedParams

    out = []
    for defer in (False, True):
        setup = distribute(toy_model(**DIMS), mode, world, opt_kwargs={"ns_mode": ns_mode})
        real_updated, real_muon_step = DedicatedParams.updated, DMuon._muon_step
        if defer:
            queued = []
            DedicatedParams.updated = lambda self, unit: queued.append((self, unit))

            def muon_step_then_send(self, groups):
                real_muon_step(self, groups)
                for handle, unit in queued:
                    real_updated(handle, unit)
                queued.clear()

            DMuon._muon_step = muon_step_then_send
        try:
            train(setup, batches(4), rank, world)
        finally:
            DedicatedParams.updated, DMuon._muon_step = real_updated, real_muon_step
        out.append(full_state(setup))
    return bitwise_equal(*out)


@pytest.mark.parametrize("ns_mode", ["batched", "exact"])
def test_the_pipelined_step_is_bitwise_the_unpipelined_one(pool2, ns_mode):
    assert all(pool2.run(_pipelined_vs_deferred, "z3", ns_mode))


def test_the_pipelined_step_is_bitwise_the_unpipelined_one_under_hsdp(pool4):
    assert all(pool4.run(_pipelined_vs_deferred, "hsdp", "batched"))


def test_an_update_sent_too_early_would_be_caught(pool2):
    """The comparison can fail: sending a layer before its update (here: every layer sent at the
    start of the step) leaves the next forward with the old weights of the first layer."""
    assert not all(pool2.run(_sent_too_early))


def _sent_too_early(rank, world):
    from titan_dmuon.optim.optimizer import DMuon
    from titan_dmuon.runtime import DedicatedParams

    reference = distribute(toy_model(**DIMS), "z3", world)
    train(reference, batches(4), rank, world)
    setup = distribute(toy_model(**DIMS), "z3", world)
    real_updated, real_muon_step = DedicatedParams.updated, DMuon._muon_step
    DedicatedParams.updated = lambda self, unit: None

    def send_first(self, groups):
        for handle in self._handles:
            for unit in handle.step_units():
                real_updated(handle, unit)
        real_muon_step(self, groups)

    DMuon._muon_step = send_first
    try:
        train(setup, batches(4), rank, world)
    finally:
        DedicatedParams.updated, DMuon._muon_step = real_updated, real_muon_step
    return bitwise_equal(full_state(reference), full_state(setup))
