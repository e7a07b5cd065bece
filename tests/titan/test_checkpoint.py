"""DCP checkpoints through TorchTitan's CheckpointManager, in-process on gloo worker pools.

The toy transformer stands in for the TorchTitan model (the manager, the
optimizer container and DCP are TorchTitan's and torch's own); resuming
happens in NEW processes (the pool is restarted between save and load).
tests/e2e/test_titan_checkpoint_e2e.py does the same through run_train.sh.
"""

import os

import pytest
import torch
import torch.distributed as dist
from torchtitan.components.optimizer import LRSchedulersContainer

from tests.support.checkpoint_jobs import STEPS, train_until, training_state
from tests.support.helpers import (
    ADAMW,
    MUON,
    Counter,
    baseline,
    distribute,
    full_state,
    make_mesh,
    merge_rank_states,
    toy_model,
)
from titan_dmuon.integration.components.checkpoint import CheckpointError, DMuonCheckpointManager
from titan_dmuon.integration.components.optimizer_container import DMuonOptimizersContainer


def _toy_job(
    rank,
    world,
    mode,
    folder,
    *,
    optimizer="dmuon",
    dims=None,
    async_mode="disabled",
    last_model_only=False,
    ns_method="torch",
):
    """A toy model made distributed as in TorchTitan, with its container, schedule and checkpointer."""
    model = toy_model(**(dims or {}))
    if optimizer == "dmuon":
        setup = distribute(model, mode, world)
    else:  # TorchTitan's own AdamW on FSDP2
        setup = baseline(model, "fsdp_adamw", world, mesh=make_mesh(mode, world))
    kwargs = (
        dict(lr=MUON["lr"], momentum=MUON["momentum"], adamw_lr=ADAMW["adamw_lr"], ns_method=ns_method)
        if (optimizer == "dmuon")
        else dict(lr=1e-2)
    )
    setup.opt = DMuonOptimizersContainer(DMuonOptimizersContainer.Config(name=optimizer, **kwargs), model_parts=[model])
    schedule = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=setup.opt, training_steps=STEPS)
    counter = Counter()
    config = DMuonCheckpointManager.Config(
        enable=True, folder="ckpt", interval=1, async_mode=async_mode, last_save_model_only=last_model_only
    )
    manager = config.build(
        dataloader=Counter(),
        model_parts=[model],
        optimizers=setup.opt,
        lr_schedulers=schedule,
        states={"train_state": counter},
        sd_adapter=None,
        base_folder=folder,
    )
    return setup, schedule, counter, manager


def _straight(rank, world, mode, folder):
    setup, schedule, counter, _ = _toy_job(rank, world, mode, folder)
    losses = train_until(setup, schedule, counter, rank, world, STEPS)
    return losses, training_state(setup)


def _first_half(rank, world, mode, folder):
    setup, schedule, counter, manager = _toy_job(rank, world, mode, folder)
    losses = train_until(setup, schedule, counter, rank, world, STEPS // 2)
    manager.save(counter.step)
    manager.close()
    return losses


def _second_half(rank, world, mode, folder):
    setup, schedule, counter, manager = _toy_job(rank, world, mode, folder)
    assert manager.load()
    assert counter.step == STEPS // 2
    losses = train_until(setup, schedule, counter, rank, world, STEPS)
    return losses, training_state(setup)


@pytest.mark.parametrize("mode, world", [("z2", 2), ("z3", 2), ("hsdp", 4)])
def test_resume_is_bit_exact(pool2, pool4, tmp_path, mode, world):
    """6 steps straight == 3 steps + save + new processes + load + 3 steps, bit for bit:
    weights, Muon momentum, AdamW moments, and the loss at every step."""
    pool = {2: pool2, 4: pool4}[world]
    straight = pool.run(_straight, mode, str(tmp_path / "a"))
    first = pool.run(_first_half, mode, str(tmp_path / "b"))
    pool.restart()
    second = pool.run(_second_half, mode, str(tmp_path / "b"))
    for rank in range(world):
        assert first[rank] + second[rank][0] == straight[rank][0]
    a, b = merge_rank_states(s for _, s in straight), merge_rank_states(s for _, s in second)
    assert a.keys() == b.keys() and any(k.startswith("momentum_buffer/") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]


def _switch_straight(rank, world, folder, before, after):
    """``before``'s Newton–Schulz for half the steps, then ``after``'s, in one process."""
    setup, schedule, counter, _ = _toy_job(rank, world, "z3", folder, ns_method=before)
    losses = train_until(setup, schedule, counter, rank, world, STEPS // 2)
    for optimizer in setup.opt.dmuon_optimizers():
        optimizer.ns_method = after
    return losses + train_until(setup, schedule, counter, rank, world, STEPS), training_state(setup)


def _switch_first_half(rank, world, folder, before):
    setup, schedule, counter, manager = _toy_job(rank, world, "z3", folder, ns_method=before)
    losses = train_until(setup, schedule, counter, rank, world, STEPS // 2)
    manager.save(counter.step)
    manager.close()
    return losses


def _switch_second_half(rank, world, folder, after):
    setup, schedule, counter, manager = _toy_job(rank, world, "z3", folder, ns_method=after)
    assert manager.load()
    methods = {optimizer.ns_method for optimizer in setup.opt.dmuon_optimizers()}
    keys = [k for optimizer in setup.opt.dmuon_optimizers() for g in optimizer.state_dict()["param_groups"] for k in g]
    return train_until(setup, schedule, counter, rank, world, STEPS), training_state(setup), (methods, keys)


@pytest.mark.parametrize("before, after", [("torch", "gram"), ("gram", "polar_express")])
def test_the_newton_schulz_method_can_change_across_a_resume(pool2, tmp_path, before, after):
    """A checkpoint holds the momentum, which no method changes, and not the method (a job-wide option,
    outside the param groups that DCP saves and restores): a job saved with one ns_method resumes with the
    config's, bit for bit the job that switched in-process. (As a param-group option it came back as the
    checkpoint's method, and a checkpoint saved before ns_method existed could not be loaded.)"""
    straight = pool2.run(_switch_straight, str(tmp_path / "a"), before, after)
    first = pool2.run(_switch_first_half, str(tmp_path / "b"), before)
    pool2.restart()
    second = pool2.run(_switch_second_half, str(tmp_path / "b"), after)
    for rank in range(2):
        methods, keys = second[rank][2]
        assert methods == {after} and keys and "ns_method" not in keys
        assert first[rank] + second[rank][0] == straight[rank][0]
    a, b = merge_rank_states(s for _, s in straight), merge_rank_states(s for _, s, _ in second)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _save_then_report(rank, world, mode, folder):
    setup, schedule, counter, manager = _toy_job(rank, world, mode, folder)
    train_until(setup, schedule, counter, rank, world, 2)
    manager.save(counter.step)  # right after step(): HSDP's post-step broadcasts are still in flight
    manager.close()
    return full_state(setup)


def _load_then_report(rank, world, mode, folder):
    setup, schedule, counter, manager = _toy_job(rank, world, mode, folder)
    assert manager.load()
    loaded = full_state(setup)
    losses = train_until(setup, schedule, counter, rank, world, counter.step + 1)  # and training continues
    return loaded, losses


@pytest.mark.parametrize(
    "save_mode, save_world, load_mode, load_world",
    [("z3", 4, "z3", 2), ("z3", 2, "z3", 4), ("z2", 2, "z3", 2), ("z3", 4, "hsdp", 4), ("hsdp", 4, "ddp", 2)],
)
def test_reshard_on_load(pool2, pool4, tmp_path, save_mode, save_world, load_mode, load_world):
    """Each weight and its momentum land on whichever rank owns it now.

    FSDP -> HSDP once loaded stale weights on replica holders: TorchTitan's zero-gradient
    step inside DCP's load started post-step broadcasts of the PRE-load weights, which
    landed after DCP had read the checkpoint into the tensors in place. DMuon.state_dict()
    now lands them first, before DCP reads."""
    pools = {2: pool2, 4: pool4}
    saved = pools[save_world].run(_save_then_report, save_mode, str(tmp_path))[0]
    pools[load_world].restart()
    for loaded, losses in pools[load_world].run(_load_then_report, load_mode, str(tmp_path)):
        assert loaded.keys() == saved.keys()
        assert all(torch.equal(loaded[k], saved[k]) for k in saved)
        assert len(losses) == 1 and torch.isfinite(torch.tensor(losses)).all()


def _saved_weights_are_current(rank, world, folder, model_only):
    """Every dedicated weight in the checkpoint equals its global owner's current value,
    whichever holder DCP picked as the writer."""
    setup, schedule, counter, manager = _toy_job(rank, world, "hsdp", folder, last_model_only=model_only)
    train_until(setup, schedule, counter, rank, world, 2)
    current = {
        fqn: p.detach().clone()
        for fqn, p in zip(setup.handle.fqns, setup.handle.params)
        if setup.handle.runs_newton_schulz(p)
    }
    manager.save(counter.step, last_step=model_only)
    manager.close()
    dist.barrier()
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    written = _load_state_dict_from_keys(
        set(current), storage_reader=FileSystemReader(os.path.join(folder, "ckpt", "step-2"))
    )
    return [fqn for fqn in current if not torch.equal(written[fqn], current[fqn])]


@pytest.mark.parametrize("model_only", [False, True])
def test_no_stale_copy_is_saved(pool4, tmp_path, model_only):
    """Under HSDP every replica group's shard owner holds a dedicated weight, and DCP writes
    one arbitrary holder's copy. A save right after step() must wait for the post-step
    broadcast, or a replica's one-step-old copy could be written silently (full saves
    also pass through DMuon.state_dict(); a model-only save relies on the model hook)."""
    for stale in pool4.run(_saved_weights_are_current, str(tmp_path), model_only):
        assert stale == []


def _zero_grad_init_step(rank, world, mode, folder):
    setup, _, _, _ = _toy_job(rank, world, mode, folder)
    before = full_state(setup)
    flat = setup.opt.state_dict()  # TorchTitan's init_optim_state: zero grads, lr 0, one step
    after = full_state(setup)
    momentum = [v for k, v in flat.items() if k.endswith("momentum_buffer")]
    return all(torch.equal(before[k], after[k]) for k in before), [float(m.abs().max()) for m in momentum]


@pytest.mark.parametrize("mode, world", [("z3", 2), ("hsdp", 4)])
def test_zero_grad_init_step_changes_nothing(pool2, pool4, tmp_path, mode, world):
    for unchanged, momentum in {2: pool2, 4: pool4}[world].run(_zero_grad_init_step, mode, str(tmp_path)):
        assert unchanged and all(m == 0.0 for m in momentum)


def test_async_save_round_trip(pool2, tmp_path):
    saved = pool2.run(_async_save, str(tmp_path))[0]
    pool2.restart()
    for loaded, _ in pool2.run(_load_then_report, "z3", str(tmp_path)):
        assert all(torch.equal(loaded[k], saved[k]) for k in saved)


def _async_save(rank, world, folder):
    setup, schedule, counter, manager = _toy_job(rank, world, "z3", folder, async_mode="async")
    train_until(setup, schedule, counter, rank, world, 2)
    manager.save(counter.step)
    manager.maybe_wait_for_saving()
    manager.close()
    return full_state(setup)


# ---- bad input ------------------------------------------------------------------------------
def _save_only(rank, world, mode, folder, optimizer="dmuon", dims=None):
    setup, schedule, counter, manager = _toy_job(rank, world, mode, folder, optimizer=optimizer, dims=dims)
    train_until(setup, schedule, counter, rank, world, 2)
    manager.save(counter.step)
    manager.close()
    return full_state(setup)


def _load_error(rank, world, folder, dims=None):
    setup, _, _, manager = _toy_job(rank, world, "z3", folder, dims=dims)
    try:
        manager.load()
    except CheckpointError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "dims, phrase",
    [
        ({"hidden_dim": 64}, "'layers.0.feed_forward.w1.weight' has shape (48, 32) in it but (64, 32)"),
        ({"n_layers": 3}, "it has no 'layers.2."),
    ],
)
def test_checkpoint_of_another_model(pool2, tmp_path, dims, phrase):
    pool2.run(_save_only, "z3", str(tmp_path))
    for error in pool2.run(_load_error, str(tmp_path), dims):  # every rank stops, none hangs
        assert error is not None and phrase in error and "ckpt/step-2" in error


def test_truncated_or_corrupt_checkpoint(pool2, tmp_path):
    pool2.run(_save_only, "z3", str(tmp_path))
    step = tmp_path / "ckpt" / "step-2"
    data = sorted(f for f in os.listdir(step) if f.endswith(".distcp"))[0]
    with open(step / data, "r+b") as f:
        f.truncate(100)
    for error in pool2.run(_load_error, str(tmp_path)):
        assert f"data file {data} is truncated (100 bytes" in error
    (step / ".metadata").write_bytes(b"not a pickle")
    for error in pool2.run(_load_error, str(tmp_path)):
        assert "cannot read its .metadata" in error and "incomplete or corrupt" in error


def _resume_from_adamw(rank, world, folder):
    import logging

    from torchtitan.tools.logging import logger

    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage()) if record.levelno >= logging.WARNING else None
    logger.addHandler(handler)
    setup, schedule, counter, manager = _toy_job(rank, world, "z3", folder)
    assert manager.load()
    logger.removeHandler(handler)
    loaded = full_state(setup)
    momentum = [
        s["momentum_buffer"] for opt in setup.opt.optimizers for s in opt.state.values() if "momentum_buffer" in s
    ]
    losses = train_until(setup, schedule, counter, rank, world, counter.step + 1)
    return loaded, [float(m.abs().max()) for m in momentum], counter.step, losses, warnings


def test_dmuon_resumes_from_an_adamw_checkpoint(pool2, tmp_path):
    saved = pool2.run(_save_only, "z3", str(tmp_path), "AdamW")[0]
    pool2.restart()
    for loaded, momentum, step, losses, warnings in pool2.run(_resume_from_adamw, str(tmp_path)):
        assert any("written by another optimizer (e.g. AdamW)" in w and "starts fresh" in w for w in warnings)
        assert all(torch.equal(loaded[k], saved[k]) for k in saved)  # weights from the AdamW run
        assert all(m == 0.0 for m in momentum)  # fresh momentum (before the step that follows)
        assert step == 3 and len(losses) == 1  # the step count came along; training continues
