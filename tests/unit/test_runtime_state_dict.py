"""``runtime/state_dict.py``'s hooks on a module with two dedicated weights, one held here and one not,
with a recording stand-in for the handle (no process group): a state dict has exactly the weights
this rank holds; a load takes exactly those, reports no other as missing, and tells the handle. On an
accelerator a state dict first waits for the device (a recording stand-in for its device module)."""

import types

import torch
from torch import nn

from tests.support.runtime_parts import RecordingDevice
from titan_dmuon.plan.ownership import build_plan
from titan_dmuon.plan.specs import MatrixSpec
from titan_dmuon.runtime.members import Member
from titan_dmuon.runtime.state_dict import install_state_dict_hooks


class _Handle:
    """What the hooks call on ``DedicatedParams``, recorded; TP conversions as tp rank 1 of 2 would do."""

    def __init__(self, members, device="cpu"):
        self.members, self.calls = members, []
        self.mode = types.SimpleNamespace(mesh=types.SimpleNamespace(device=torch.device(device)))

    def members_of(self, module):
        return [m for m in self.members if m.module is module]

    def wait_for_replicate_broadcasts(self, *, host=False):
        self.calls.append(("wait", host))

    def discard_gathered_weights(self):
        self.calls.append(("discard",))

    def weights_changed(self):
        self.calls.append(("changed",))

    def as_sharded(self, member, local):
        self.calls.append(("as_sharded", member.name))
        return local

    def tp_local(self, member, full):
        return full.chunk(2, dim=member.entry.tp_dim)[1]


def _layer(tp_dim=None, device="cpu"):
    """``held`` (6 x 4, this rank keeps it) and ``other`` (a 0-element placeholder: another rank's);
    the handle's mesh is on ``device`` (the tensors stay on the CPU)."""
    tp_size = 1 if tp_dim is None else 2
    specs = [
        MatrixSpec(
            fqn=name,
            shape=(6, 4),
            unit=0,
            blocks=(((0, 6 * (2 if tp_dim == 0 else 1)),),),
            tp_dim=tp_dim,
            tp_size=tp_size,
        )
        for name in ("held", "other")
    ]
    held_entry, other_entry = build_plan(specs, replicate_size=1, shard_size=2).entries
    layer = nn.Module()
    layer.held = nn.Parameter(torch.zeros(6, 4))
    layer.other = nn.Parameter(torch.empty(0))
    members = [
        Member(entry=held_entry, module=layer, name="held", param=layer.held, holds_full=True, runs_ns=True),
        Member(entry=other_entry, module=layer, name="other", param=layer.other, holds_full=False, runs_ns=False),
    ]
    handle = _Handle(members, device)
    install_state_dict_hooks(handle, layer)
    return layer, handle


def test_a_state_dict_has_the_weights_this_rank_holds_after_the_replica_broadcasts():
    layer, handle = _layer()
    state = layer.state_dict()
    assert list(state) == ["held"] and torch.equal(state["held"], layer.held)
    assert handle.calls == [("wait", True)]  # the host waited: DCP may read from another thread


def test_a_state_dict_on_an_accelerator_waits_for_the_device(monkeypatch):
    """The owners' weights and momentum are written by the step on the compute stream, which never
    syncs the host; DCP's background stager and TorchFT's recovery (on its quorum thread) copy the
    live tensors on their own streams. Regression: only the replica broadcasts were waited for, so
    a checkpoint or a healing group could get half-updated weights. The hook now synchronises the
    handle's device (named: TorchFT's thread may have another current device), after the replica
    broadcasts; load hooks do not (the load writes on the compute stream, in order)."""
    device = RecordingDevice()
    monkeypatch.setattr(torch, "get_device_module", lambda d=None: device)
    layer, handle = _layer(device="cuda:1")
    layer.state_dict()
    assert handle.calls == [("wait", True)] and device.log == [("synchronize", "cuda:1")]
    layer.load_state_dict({"held": torch.ones(6, 4)})
    assert device.log == [("synchronize", "cuda:1")]


def test_a_load_takes_the_held_weights_only_and_reports_no_other_missing():
    """The checkpoint of another plan has both weights (full): the one not held here is dropped before
    ``load_state_dict`` copies it into the 0-element placeholder (a size mismatch), and a checkpoint
    with the held one only is complete under ``strict=True``; gathers made before the load are
    dropped and later ones read the loaded values."""
    layer, handle = _layer()
    layer.load_state_dict({"held": torch.full((6, 4), 2.0), "other": torch.full((6, 4), 3.0)})
    assert torch.equal(layer.held, torch.full((6, 4), 2.0)) and layer.other.numel() == 0
    assert handle.calls == [("wait", True), ("discard",), ("changed",)]
    result = layer.load_state_dict({"held": torch.full((6, 4), 5.0)}, strict=True)
    assert result.missing_keys == [] and torch.equal(layer.held, torch.full((6, 4), 5.0))


def test_a_tp_shard_is_saved_as_its_full_matrix_and_loaded_from_one():
    """Under tensor parallelism the held weight is this rank's shard: saved through ``as_sharded`` (a
    DTensor of the full matrix for DCP), and a full matrix in the checkpoint (e.g. from a job without
    TP) loads as this rank's chunk of it."""
    layer, handle = _layer(tp_dim=0)
    assert list(layer.state_dict()) == ["held"] and ("as_sharded", "held") in handle.calls
    full = torch.arange(12 * 4, dtype=torch.float32).view(12, 4)
    layer.load_state_dict({"held": full}, strict=True)
    assert torch.equal(layer.held, full[6:])
