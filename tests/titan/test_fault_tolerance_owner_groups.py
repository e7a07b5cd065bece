"""Owner groups under fault tolerance's replica groups, in-process (as test_fault_tolerance.py, which is at its
size limit): 4 gloo ranks play 2 replica groups of 2, each dedicating a model with one dominant matrix on its
own mesh, where the plan splits that matrix over an owner group of both ranks; the all-reduce hook averages
each member's reduced block with the same member of the other group, where TorchFT's ``Manager.allreduce``
runs in a real job. A replica group's restart is healed as TorchFT heals it: the state TorchTitan registers
(``ModelWrapper`` and the optimizer container's state dicts) sent through TorchFT's serialisation (torch's
streaming pickle, as its HTTP transport does) and loaded into a freshly built group.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tests.support.helpers import (
    ADAMW,
    MUON,
    batches,
    bitwise_equal,
    distribute,
    full_state,
    max_diff,
    reference_train,
    train,
)
from tests.support.owner_groups_parts import (
    ADAMW_EPS,
    GROUP_TOLERANCE,
    STEPS,
    TINY_GROUPS,
    dominant_model,
    dominant_targets,
)

GROUPS = 2
RESTART_AT = 2  # the steps before the second replica group restarts


def _transported(state: dict) -> dict:
    """``state`` as a healing replica receives it: pickled and unpickled by the streaming functions TorchFT's
    HTTP transport uses (its DTensors arrive on copies of their meshes, with no process group)."""
    import io

    from torch.distributed._serialization import _streaming_load, _streaming_save

    buffer = io.BytesIO()
    _streaming_save(state, buffer)
    buffer.seek(0)
    return _streaming_load(buffer, weights_only=False)


def _locals(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a (nested) state dict as this rank holds it, by key."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(_locals(value, f"{prefix}{key}."))
        elif torch.is_tensor(value):
            out[prefix + str(key)] = (value.to_local() if isinstance(value, DTensor) else value).detach().clone()
    return out


def _replica_group(grid, seed: int):
    """One replica group's job on its row of ``grid``: DMuon-Z3 with owner groups, TorchTitan's optimizer
    container, and the hooks that average each reduced gradient across the groups."""
    from titan_dmuon.integration.components.optimizer_container import DMuonOptimizersContainer

    across = grid.get_group("group")  # (rank r of every group: what TorchFT's process group links)

    def average_across_groups(tensor):
        dist.all_reduce(tensor, group=across)
        tensor.div_(GROUPS)

    model = dominant_model(seed)
    setup = distribute(
        model,
        "z3",
        0,
        mesh=grid["dp_shard"],
        targets_fn=dominant_targets,
        owner_groups=TINY_GROUPS,
        opt_kwargs=ADAMW_EPS,
    )
    config = DMuonOptimizersContainer.Config(
        name="dmuon", lr=MUON["lr"], momentum=MUON["momentum"], adamw_lr=ADAMW["adamw_lr"], **ADAMW_EPS
    )
    setup.opt = DMuonOptimizersContainer(config, model_parts=[model])
    setup.handle.set_all_reduce_hook(average_across_groups)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(average_across_groups)
    return setup


def _replicas_with_owner_groups(rank, world, restart: bool):
    """2 replica groups x FSDP 2, the dominant matrix over an owner group in each; with ``restart`` the second
    group is rebuilt after RESTART_AT steps (another seed: its own initial weights) and healed from the state
    TorchFT would send it, while the first trains on with its live state."""
    from torchtitan.components.checkpointer.base import ModelWrapper

    from titan_dmuon.runtime.owner_group_comm import join_owner_groups

    data = batches(STEPS)
    grid = init_device_mesh("cpu", (GROUPS, world // GROUPS), mesh_dim_names=("group", "dp_shard"))
    setup = _replica_group(grid, seed=0)
    group_rank = grid.get_local_rank("group")
    out = {"groups": [e.group.size for e in setup.handle.plan.entries if e.group is not None]}
    train(setup, data[:RESTART_AT] if restart else data, rank, world)
    if restart:
        served = _transported({"model": ModelWrapper(setup.model).state_dict(), "optimizer": setup.opt.state_dict()})
        everyone = [None] * world
        dist.all_gather_object(everyone, _locals(served))
        out["served_as_peer"] = bitwise_equal(everyone[rank], everyone[(rank + world // GROUPS) % world])
        if group_rank == 1:  # (a restarted group makes its owner groups anew: the world's ranks all take part)
            setup = _replica_group(grid, seed=1)
            ModelWrapper(setup.model).load_state_dict(served["model"])
            setup.opt.load_state_dict(served["optimizer"])
            out["groups_after"] = [e.group.size for e in setup.handle.plan.entries if e.group is not None]
        else:
            join_owner_groups(grid["dp_shard"], TINY_GROUPS)
        train(setup, data[RESTART_AT:], rank, world)
    state = full_state(setup)  # (within the group)
    everyone = [None] * world
    dist.all_gather_object(everyone, state)
    out["state"] = state
    out["groups_identical"] = bitwise_equal(everyone[rank % 2], everyone[2 + rank % 2])
    return out


@pytest.fixture(scope="module")
def uninterrupted(pool4):
    return pool4.run(_replicas_with_owner_groups, False)


def test_replica_groups_with_owner_groups_train_as_one_batch(uninterrupted):
    """Each replica group splits the dominant matrix over an owner group of its 2 ranks; the groups together
    train as one process on the union of their batches (torch.optim.Muon + AdamW, the 4 slices summed as the
    groups sum them), within GROUP_TOLERANCE (the owner group's Newton–Schulz may round up to GROUP_RATIO
    times as far from exact arithmetic as one owner's: tests/support/owner_groups_parts.py), and stay bitwise
    identical (each member averages the same block with its peer)."""
    reference, _, _ = reference_train(
        dominant_model(), batches(STEPS), targets_fn=dominant_targets, adamw={**ADAMW, **ADAMW_EPS}, slices=4
    )
    for r in uninterrupted:
        assert r["groups"] == [2]
        assert r["groups_identical"]
        assert max_diff(r["state"], reference) <= GROUP_TOLERANCE


def test_a_restarted_replica_group_heals_its_owner_groups(pool4, uninterrupted):
    """Regression: a healing replica got its blocks as DTensors on unpickled copies of the owner groups'
    meshes, which the load took for another layout (it compared meshes by identity) and gathered with
    ``full_tensor()`` on a mesh with no process group: AttributeError '_dim_group_names'. Now blocks are
    recognised by their ranks and placement. The second group restarts after 2 of 4 steps, is healed from
    the state a peer serves (its own is bitwise the peer's: served_as_peer) and the job ends bitwise as the
    uninterrupted one (weights of both groups; the momentum and AdamW moments then too, or the steps after
    the restart would differ)."""
    healed = pool4.run(_replicas_with_owner_groups, True)
    for r, straight in zip(healed, uninterrupted):
        assert r["served_as_peer"] and r["groups_identical"]
        assert r["groups"] == [2] and r.get("groups_after", [2]) == [2]
        assert bitwise_equal(r["state"], straight["state"])
