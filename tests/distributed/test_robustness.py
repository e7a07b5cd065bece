"""No hang and no silent wrong answer on the paths where ranks differ or something fails.

* A dedicated weight that gets a gradient on some ranks only: every rank reduces every member
  (zeros where it has none), so the job trains and equals the single-process reference.
* A rank that skips a whole layer (in forward, or whose gradient does not reach it): it stops
  with an error naming the layer before it issues a collective its peers do not; its peers then
  fail within seconds instead of waiting for the collective timeout.
* Collectives that deliver their result only at ``wait()`` (a GPU's behaviour, rare on gloo):
  every reference comparison still holds, so no result is read before its wait.
* A coalesced launch that raises closes its group; a checkpoint waits on the host for HSDP's
  replica broadcasts; a load drops buffers gathered before it; edge layouts (only local
  experts, frozen targets) work or are refused clearly.
"""

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.support.helpers import (
    TOLERANCE,
    batches,
    distribute,
    full_state,
    late_delivery,
    local_slice,
    max_diff,
    reference_train,
    toy_model,
    train,
)
from tests.support.pool import run_job
from titan_dmuon import dedicate_params
from titan_dmuon.testing.toy_model import loss_fn, muon_targets


# ---- gradients on some ranks only ------------------------------------------------------------------
class _Branchy(nn.Module):
    """Each layer has a weight every rank uses and one only the ranks with ``use_branch`` use."""

    def __init__(self, layers=2, dim=16):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, dim)
        self.layers = nn.ModuleList(
            nn.ModuleDict({"used": nn.Linear(dim, dim, bias=False), "branch": nn.Linear(dim, dim, bias=False)})
            for _ in range(layers)
        )
        self.out = nn.Linear(dim, 64, bias=False)
        self.use_branch = True

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = h + layer["used"](h) + (layer["branch"](h) if self.use_branch else 0)
        return self.out(h)


class _BranchyBlocks(nn.Module):
    """_Branchy with each layer a module of its own (a unit DMuon hooks)."""

    def __init__(self, layers=2, dim=16):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, dim)
        self.layers = nn.ModuleList(_BranchBlock(dim) for _ in range(layers))
        self.out = nn.Linear(dim, 64, bias=False)

    @property
    def use_branch(self):
        return self.layers[0].use_branch

    @use_branch.setter
    def use_branch(self, value):
        for layer in self.layers:
            layer.use_branch = value

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


class _BranchBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.used = nn.Linear(dim, dim, bias=False)
        self.branch = nn.Linear(dim, dim, bias=False)
        self.use_branch = True

    def forward(self, h):
        return h + self.used(h) + (self.branch(h) if self.use_branch else 0)


def _layer_targets(model):
    return [p for n, p in model.named_parameters() if n.startswith("layers.")]


def _branch_on_rank0(rank, world, mode):
    """Rank 0 uses every layer's branch, the others do not; the reference's slice 0 likewise."""
    data = batches(3)
    model = _BranchyBlocks()
    ref, _, _ = reference_train(
        model, data, targets_fn=_layer_targets, slices=world, before_slice=lambda m, i: setattr(m, "use_branch", i == 0)
    )
    model.use_branch = rank == 0
    setup = distribute(model, mode, world, targets_fn=_layer_targets)
    train(setup, data, rank, world)
    return max_diff(full_state(setup), ref)


@pytest.mark.parametrize("mode", ["z3", "z2", "ddp"])
def test_a_weight_used_on_some_ranks_only_trains_and_equals_the_reference(pool2, mode):
    """Before, the reducer launched only for members with a gradient, so rank 0 and rank 1 issued
    different collectives and every rank stopped at the process-group timeout ("Application
    timeout caused pair closure"). Now every member is reduced, zeros where a rank has none: the
    owner gets rank 0's gradient, which is what the single process computes on the whole batch."""
    for diff in pool2.run(_branch_on_rank0, mode):
        assert diff < TOLERANCE


def test_a_weight_used_on_some_ranks_only_under_hsdp(pool4):
    for diff in pool4.run(_branch_on_rank0, "hsdp"):
        assert diff < TOLERANCE


# ---- a layer skipped on one rank: a clear error, quickly, on every rank -------------------------------
def _skip_layer_on_rank0(rank, world, where):
    """Train 2 steps (the first records the order); in step 2, rank 0 skips layer 1's forward
    ("forward"), or runs it but detaches its output so no gradient reaches it ("backward")."""
    model = toy_model(n_layers=3)
    setup = distribute(model, "z3", world)
    data = batches(2)
    train(setup, data[:1], rank, world)

    def forward(tokens):
        h = model.tok_embeddings(tokens)
        for i, layer in enumerate(model.layers):
            odd = rank == 0 and i == 1
            if odd and where == "forward":
                continue
            h = layer(h).detach() if odd and where == "backward" else layer(h)
        return model.output(model.norm(h))

    model.forward = forward
    train(setup, data[1:], rank, world)
    return "trained"


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_layer_skipped_on_one_rank_stops_every_rank_with_its_name(where):
    """Rank 0 skips a layer (its forward, or its backward: its output does not reach the loss).
    Before, every rank waited for the others' collectives until the process-group timeout. Now
    rank 0 raises at the next layer, before issuing anything its peers do not, naming the layer;
    its peer's pending collective then fails when rank 0 exits, within seconds."""
    start = time.monotonic()
    results = run_job(_skip_layer_on_rank0, 2, where, timeout=90, pg_timeout_s=60)
    elapsed = time.monotonic() - start
    (ok0, error0, code0), (ok1, _, code1) = results
    assert not ok0 and code0 != 0 and "UnitOrderError" in error0 and "'layers.1'" in error0, error0
    assert not ok1 and code1 != 0  # the peer fails too (its collective lost its partner) ...
    assert elapsed < 50  # ... long before the 60 s collective timeout


# ---- results only at wait(): no read before a wait ------------------------------------------------
def _vs_reference_late(rank, world, mode, break_wait):
    from titan_dmuon.runtime.comm import InFlight
    from titan_dmuon.runtime.reducer import GradientReducer, Stage

    data = batches(3)
    model = toy_model()
    ref, _, _ = reference_train(model, data, slices=world)
    original = GradientReducer._advance

    def advance_without_waiting(self):  # the broken variant: nothing waits for the shard stage
        for flight in self._in_flight:
            if flight.stage is Stage.SHARD:
                flight.in_flight = InFlight()
        original(self)

    with late_delivery():
        if break_wait:
            GradientReducer._advance = advance_without_waiting
        try:
            setup = distribute(model, mode, world)
            train(setup, data, rank, world)
        finally:
            GradientReducer._advance = original
    return max_diff(full_state(setup), ref)


@pytest.mark.parametrize("mode", ["z3", "z2", "ddp"])
def test_collectives_that_deliver_only_at_wait_change_nothing(pool2, mode):
    for diff in pool2.run(_vs_reference_late, mode, False):
        assert diff < TOLERANCE


def test_hsdp_with_collectives_that_deliver_only_at_wait(pool4):
    for diff in pool4.run(_vs_reference_late, "hsdp", False):
        assert diff < TOLERANCE


def test_late_delivery_catches_a_replicate_stage_that_does_not_wait(pool4):
    """The harness is not blind: launching HSDP's replicate stage without waiting for the shard
    stage (it then reduces each rank's own gradient, not the shard group's sum) is far off."""
    for diff in pool4.run(_vs_reference_late, "hsdp", True):
        assert diff > 10 * TOLERANCE


# ---- a load drops what was gathered before it ---------------------------------------------------------
def _load_then_forward(rank, world):
    """Train 2 steps (the step then starts the first layer's broadcast for the next forward),
    load another model's weights, and run one forward: the loss must be the loaded model's."""
    data = batches(3)
    setup = distribute(toy_model(seed=0), "z3", world)
    train(setup, data[:2], rank, world)
    other = distribute(toy_model(seed=5), "z3", world)
    setup.model.load_state_dict(other.model.state_dict())
    x, y = local_slice(data[2], rank, world)
    with torch.no_grad():
        return loss_fn(setup.module(x), y).item(), loss_fn(other.module(x), y).item()


def test_the_first_layers_early_broadcast_is_dropped_by_a_load(pool2):
    """The step launches the next forward's first broadcast; a load_state_dict that follows must
    drop it (its buffer holds the old weights), or the next forward mixes old and loaded weights."""
    for loss, expected in pool2.run(_load_then_forward):
        assert loss == expected


# ---- a coalesced launch that raises closes its group ---------------------------------------------------
def _launch_that_raises(rank0, _world):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from titan_dmuon.runtime.comm import CommLabel, CommStats, Launch

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    calls = []
    # (the class's own descriptors, restored as they were: a method fetched from the class would not bind)
    start, end = vars(dist.ProcessGroup)["_start_coalescing"], vars(dist.ProcessGroup)["_end_coalescing"]
    dist.ProcessGroup._start_coalescing = lambda self, device: (calls.append("start"), start(self, device))[1]
    dist.ProcessGroup._end_coalescing = lambda self, device: (calls.append("end"), end(self, device))[1]
    try:
        with Launch(
            dist.group.WORLD, 4, torch.device("cpu"), CommLabel.FORWARD_BROADCAST, CommStats(), coalesce=True
        ) as launch:
            launch.broadcast(torch.ones(3), src=0)
            raise KeyError("an error between two collectives of one launch")
    except KeyError:
        pass
    finally:
        dist.ProcessGroup._start_coalescing, dist.ProcessGroup._end_coalescing = start, end
        dist.destroy_process_group()
    return calls


def test_a_launch_that_raises_closes_its_coalesced_group(solo):
    """torch's _coalescing_manager does not end the group when the body raises; the group then
    stays open on the process group and swallows FSDP2's next collectives (a hang on NCCL)."""
    assert solo.run(_launch_that_raises)[0] == ["start", "end"]


# ---- a checkpoint waits on the host for HSDP's replica broadcasts ------------------------------------------
def _state_dict_waits_on_host(rank, world):
    from titan_dmuon.runtime.comm import InFlight

    setup = distribute(toy_model(), "hsdp", world)
    train(setup, batches(2), rank, world)  # the last step leaves replica broadcasts in flight
    waited = []
    original = InFlight.synchronize
    InFlight.synchronize = lambda self: (waited.append(1), original(self))[1]
    try:
        setup.model.state_dict()
    finally:
        InFlight.synchronize = original
    return len(waited)


def test_a_checkpoint_waits_on_the_host_for_replica_broadcasts(pool4):
    """DCP's asynchronous checkpointing stages tensors on its own stream from another thread, which
    a stream wait does not order after the broadcast: the state-dict hook waits on the host."""
    counts = pool4.run(_state_dict_waits_on_host)
    assert sum(counts) > 0  # holders of broadcast weights synchronised before the state dict was read


# ---- edge layouts --------------------------------------------------------------------------------------
def _experts_only(rank, world):
    data = batches(3)
    model = toy_model(num_experts=4)
    experts = lambda m: [p for n, p in m.named_parameters() if p.ndim == 3]  # noqa: E731
    ref, _, _ = reference_train(model, data, targets_fn=experts, slices=world)
    setup = distribute(model, "z3", world, targets_fn=experts)
    train(setup, data, rank, world)
    return len(setup.handle.members), len(setup.handle.local_experts), max_diff(full_state(setup), ref)


def test_a_handle_with_only_local_experts(pool2):
    """Only 3-D expert weights on Muon, all kept where FSDP2 shards them: a handle with no dedicated
    weight (no unit) trains and matches the reference (it crashed at the first forward, reading
    its first member)."""
    for members, local, diff in pool2.run(_experts_only):
        assert members == 0 and local == 6
        assert diff < TOLERANCE


def _frozen_target(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    model = toy_model()
    targets = muon_targets(model)
    targets[0].requires_grad_(False)
    try:
        dedicate_params(model, targets, init_device_mesh("cpu", (world,)))
    except ValueError as e:
        return str(e)
    return None


def test_a_frozen_target_is_refused_by_name(pool2):
    """A requires_grad=False target would never get a gradient (its hook registration raised and
    its layer's readiness count never completed)."""
    for message in pool2.run(_frozen_target):
        assert message is not None and "layers.0.attention.wq.weight" in message and "frozen" in message
