"""TorchTitan-side decisions checked in-process, without a training job: the data-parallel
degree check before a checkpoint load, and the Z2 default under DDP. (The end-to-end tests that
also cover them take minutes: tests/e2e/test_titan_checkpoint_e2e.py, tests/e2e/test_titan_e2e.py.)"""

import types
import warnings

import pytest
import torch

from tests.support import titan_harness as th
from titan_dmuon.integration.components.checkpoint import CheckpointError, _data_parallel_change, checked_state_dict

OPTION = "--checkpoint.exclude_from_loading dataloader"


def _loader(dp_world_size):
    """What the check reads of TorchTitan's ParallelAwareDataloader (a Stateful in the state dict)."""
    return types.SimpleNamespace(dp_world_size=dp_world_size)


def test_data_parallel_change_is_named():
    """TorchTitan keeps one ``dataloader.dp_rank_N`` per data-parallel rank and cannot reshard them;
    loading them at another degree fails inside TorchTitan (a missing dp_rank_3, or an assertion),
    so the check must see the change from the keys and name the option. The same degree, an excluded
    dataloader, or a checkpoint without dataloader state pass (checked: with the check returning []
    the 2 -> 4 and 2 -> 1 cases fail)."""
    saved = types.SimpleNamespace(
        state_dict_metadata={
            "dataloader.dp_rank_0": None,
            "dataloader.dp_rank_1": None,
            "dataloader.world_size": None,
            "model.w": None,
        }
    )
    for now in (4, 1):
        (problem,) = _data_parallel_change({"dataloader": _loader(now)}, saved)
        assert f"saved with data-parallel degree 2 and this job has {now}" in problem and OPTION in problem
    assert _data_parallel_change({"dataloader": _loader(2)}, saved) == []
    assert _data_parallel_change({"model.w": torch.zeros(1)}, saved) == []  # dataloader excluded from loading
    no_loader = types.SimpleNamespace(state_dict_metadata={"model.w": None})
    assert _data_parallel_change({"dataloader": _loader(4)}, no_loader) == []


def test_checked_state_dict_stops_a_load_at_another_data_parallel_degree(tmp_path):
    """The same through ``checked_state_dict`` (what DMuonCheckpointManager.dcp_load runs) on a real
    DCP checkpoint written with two dataloader ranks: a CheckpointError naming the folder, both
    degrees and the option; at the saved degree the state dict comes back to be loaded."""
    import torch.distributed.checkpoint as dcp

    dataloader = {"dp_rank_0": b"position 0", "dp_rank_1": b"position 1", "world_size": 2}
    with warnings.catch_warnings():  # ("... assuming the intent is to save in a single process": it is)
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"dataloader": dataloader, "model.w": torch.ones(2, 3)}, checkpoint_id=str(tmp_path), no_dist=True)
    with pytest.raises(CheckpointError) as raised:
        checked_state_dict({"dataloader": _loader(4), "model.w": torch.zeros(2, 3)}, str(tmp_path))
    message = str(raised.value)
    assert str(tmp_path) in message and "saved with data-parallel degree 2 and this job has 4" in message
    assert OPTION in message
    state = {"dataloader": _loader(2), "model.w": torch.zeros(2, 3)}
    assert checked_state_dict(state, str(tmp_path)).keys() == state.keys()


def _reshard_after_forward(rank, world, replicate, kwargs):
    _, container = th.build(th.tiny_llama3(), th.parallel_dims(world, replicate=replicate), lr=0.02, **kwargs)
    (handle,) = container.dmuon_optimizers()[0].dedicated_handles()
    return handle.mode.reshard_after_forward


@pytest.mark.parametrize(
    "replicate, kwargs, expected",
    [
        (2, {}, False),  # DDP-like (dp_shard 1): Z2, the all-reduce floor
        (1, {}, True),  # FSDP: mirrors parallelism.fsdp_reshard_after_forward ("default": reshard)
        (1, {"reshard_after_forward": False}, False),  # an explicit setting wins
    ],
)
def test_unset_reshard_after_forward_under_ddp_is_z2(pool2, replicate, kwargs, expected):
    """With optimizer.reshard_after_forward unset, DMuon mirrors FSDP's reshard policy, except under
    DDP-like dims (dp_shard 1, dp_replicate > 1), where nothing reshards and DMuon-Z3 would re-broadcast
    every layer for backward: there it uses Z2 (checked: without the DDP branch the policy "default"
    gives True under DDP and the first case fails)."""
    assert pool2.run(_reshard_after_forward, replicate, kwargs) == [expected] * 2


def test_trainer_finishes_dmuon_collectives_after_training(monkeypatch):
    """Regression (CI, a 4-rank TP job: SIGABRT at exit after the last step): the last step launched
    the next forward's first broadcast and nothing waited for it. DMuonTrainer.train finishes every
    handle's collectives after TorchTitan's loop, once per handle, while the process groups are up."""
    from torchtitan.trainer import Trainer

    from titan_dmuon.integration.trainer import DMuonTrainer

    calls = []
    monkeypatch.setattr(Trainer, "train", lambda self: calls.append("loop"))
    handles = [types.SimpleNamespace(finish_in_flight=lambda i=i: calls.append(f"finish {i}")) for i in range(2)]
    optimizer = types.SimpleNamespace(dedicated_handles=lambda: handles)
    trainer = object.__new__(DMuonTrainer)
    trainer.optimizers = types.SimpleNamespace(dmuon_optimizers=lambda: [optimizer, optimizer])
    trainer.train()
    assert calls == ["loop", "finish 0", "finish 1"]
