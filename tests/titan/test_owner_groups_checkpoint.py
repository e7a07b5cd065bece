"""Owner groups in DCP checkpoints, through TorchTitan's CheckpointManager (as tests/titan/test_checkpoint.py).

A member keeps a block of a weight and of its momentum; in ``state_dict()`` both are DTensors of the
whole matrix (``Shard`` along its long side on the group), so DCP sees the full matrix: a resume is
bitwise, and a checkpoint loads into another group size, one owner, or from TorchTitan's AdamW.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torchtitan.components.optimizer import LRSchedulersContainer

from tests.support.checkpoint_jobs import train_until
from tests.support.helpers import ADAMW, MUON, Counter, baseline, distribute, full_state, make_mesh
from tests.support.owner_groups_parts import ADAMW_EPS, TINY_GROUPS, dominant_model, dominant_targets
from titan_dmuon.integration.components.checkpoint import DMuonCheckpointManager
from titan_dmuon.integration.components.optimizer_container import DMuonOptimizersContainer
from titan_dmuon.runtime.members import pieces_of

STEPS = 4
PAIRS = dataclasses.replace(TINY_GROUPS, node_size=8, max_size=2)  # the same job with groups of at most 2


def _grouped_job(rank, world, mode, folder, groups, *, optimizer="dmuon", tall=True):
    model = dominant_model(tall=tall)
    if optimizer == "dmuon":
        setup = distribute(model, mode, world, targets_fn=dominant_targets, owner_groups=groups)
        kwargs = dict(lr=MUON["lr"], momentum=MUON["momentum"], adamw_lr=ADAMW["adamw_lr"], **ADAMW_EPS)
    else:  # TorchTitan's own AdamW on FSDP2
        setup = baseline(model, "fsdp_adamw", world, mesh=make_mesh(mode, world))
        kwargs = dict(lr=1e-2)
    setup.opt = DMuonOptimizersContainer(DMuonOptimizersContainer.Config(name=optimizer, **kwargs), model_parts=[model])
    schedule = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=setup.opt, training_steps=STEPS)
    counter = Counter()
    manager = DMuonCheckpointManager.Config(enable=True, folder="ckpt", interval=1).build(
        dataloader=Counter(),
        model_parts=[model],
        optimizers=setup.opt,
        lr_schedulers=schedule,
        states={"train_state": counter},
        sd_adapter=None,
        base_folder=folder,
    )
    return setup, schedule, counter, manager


def _momentum(setup) -> dict[str, torch.Tensor]:
    """Each dedicated weight's momentum in full, on every rank: each piece broadcast over the world from the
    rank of the row that runs its NS (the owner, or each member of the group, its block)."""
    handle = setup.handle
    ranks = handle.mesh.mesh.flatten()
    out = {}
    for opt in setup.opt.optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                member = handle.member_of(p)
                if member is None:
                    continue
                value = opt.state.get(p, {}).get("momentum_buffer")
                full = torch.zeros(member.shape)
                for piece in pieces_of(member, handle.plan):
                    part = piece.of(full).contiguous()
                    if member.runs_ns and (piece.index is None or piece.index == member.block):
                        part.copy_(value)
                    holder = piece.replicate_owner * handle.plan.shard_size + piece.shard_owner
                    dist.broadcast(part, src=int(ranks[holder]))
                    piece.of(full).copy_(part)
                out[member.fqn] = full
    return out


def _state(setup):
    return {
        **{f"weight/{k}": v for k, v in full_state(setup).items()},
        **{f"momentum/{k}": v for k, v in _momentum(setup).items()},
    }


def _straight(rank, world, mode, folder, groups):
    setup, schedule, counter, _ = _grouped_job(rank, world, mode, folder, groups)
    losses = train_until(setup, schedule, counter, rank, world, STEPS)
    return losses, _state(setup)


def _first_half(rank, world, mode, folder, groups):
    setup, schedule, counter, manager = _grouped_job(rank, world, mode, folder, groups)
    losses = train_until(setup, schedule, counter, rank, world, STEPS // 2)
    manager.save(counter.step)
    manager.close()
    return losses, _state(setup)


def _second_half(rank, world, mode, folder, groups):
    setup, schedule, counter, manager = _grouped_job(rank, world, mode, folder, groups)
    assert manager.load()
    loaded = _state(setup)
    losses = train_until(setup, schedule, counter, rank, world, STEPS)
    return losses, loaded, _state(setup), setup.handle.plan.entries


def _equal(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("mode", ["z3", "hsdp"])
def test_resume_with_owner_groups_is_bit_exact(pool4, tmp_path, mode):
    """4 steps straight == 2 steps + save + new processes + load + 2 steps, bit for bit (weights, momentum,
    the loss at every step), with the dominant weight over an owner group."""
    straight = pool4.run(_straight, mode, str(tmp_path / "a"), TINY_GROUPS)
    first = pool4.run(_first_half, mode, str(tmp_path / "b"), TINY_GROUPS)
    pool4.restart()
    second = pool4.run(_second_half, mode, str(tmp_path / "b"), TINY_GROUPS)
    assert any(e.group is not None for e in second[0][3])
    for rank in range(4):
        assert first[rank][0] + second[rank][0] == straight[rank][0]
        assert _equal(second[rank][1], first[rank][1]) == [] and _equal(second[rank][2], straight[rank][1]) == []


@pytest.mark.parametrize("saved_with, loaded_with", [(TINY_GROUPS, PAIRS), (TINY_GROUPS, None), (None, TINY_GROUPS)])
def test_a_checkpoint_loads_across_group_sizes(pool4, tmp_path, saved_with, loaded_with):
    """Saved with groups of 4, loaded with groups of 2 or one owner, and saved with one owner, loaded with
    groups: every weight and momentum lands whole where the new plan keeps it, and training continues."""
    saved = pool4.run(_first_half, "z3", str(tmp_path), saved_with)
    pool4.restart()
    for rank, (losses, loaded, _, entries) in enumerate(pool4.run(_second_half, "z3", str(tmp_path), loaded_with)):
        sizes = {e.group.size for e in entries if e.group is not None}
        assert sizes == ({2} if loaded_with is PAIRS else {4} if loaded_with else set())
        assert _equal(loaded, saved[rank][1]) == []
        assert len(losses) == STEPS // 2 and torch.isfinite(torch.tensor(losses)).all()


def _save_adamw(rank, world, folder):
    setup, schedule, counter, manager = _grouped_job(rank, world, "z3", folder, None, optimizer="AdamW")
    train_until(setup, schedule, counter, rank, world, STEPS // 2)
    manager.save(counter.step)
    manager.close()
    return full_state(setup)


def _load_into_groups(rank, world, folder):
    setup, schedule, counter, manager = _grouped_job(rank, world, "z3", folder, TINY_GROUPS)
    assert manager.load()
    loaded = full_state(setup)
    losses = train_until(setup, schedule, counter, rank, world, STEPS)
    return loaded, losses


def test_owner_groups_resume_from_an_adamw_checkpoint(pool4, tmp_path):
    """TorchTitan's AdamW (FSDP2 shards) -> DMuon with owner groups: the weights come along."""
    saved = pool4.run(_save_adamw, str(tmp_path))[0]
    pool4.restart()
    for loaded, losses in pool4.run(_load_into_groups, str(tmp_path)):
        assert _equal(loaded, saved) == []
        assert len(losses) == STEPS // 2


def test_a_checkpoint_with_owner_groups_loads_on_another_world_size(pool2, pool4, tmp_path):
    """Saved on 4 ranks (the dominant weight over a group of 4), loaded on 2 (the plan of 2 ranks): every
    weight and momentum whole where the new plan keeps it, and training continues."""
    saved = pool4.run(_first_half, "z3", str(tmp_path), TINY_GROUPS)[0][1]
    pool2.restart()
    for losses, loaded, _, _ in pool2.run(_second_half, "z3", str(tmp_path), TINY_GROUPS):
        assert _equal(loaded, saved) == []
        assert len(losses) == STEPS // 2 and torch.isfinite(torch.tensor(losses)).all()
