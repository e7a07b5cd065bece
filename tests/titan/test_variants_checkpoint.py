"""NorMuon's second moments in DCP checkpoints, through TorchTitan's CheckpointManager (as test_checkpoint.py):
resumed bit for bit in new processes, resharded onto another world size and plan and from tensor
parallelism onto plain FSDP, and loadable across jobs with and without NorMuon (the other state loads;
second moments the checkpoint does not hold start at zero, as in a new job)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.components.optimizer import LRSchedulersContainer

from tests.support import titan_harness as th  # noqa: I001 (enables the CPU accommodations first)
from tests.support.checkpoint_jobs import STEPS, train_until, training_state
from tests.support.helpers import ADAMW, MUON, Counter, distribute, merge_rank_states, toy_model
from titan_dmuon.integration.components.checkpoint import DMuonCheckpointManager
from titan_dmuon.integration.components.optimizer_container import DMuonOptimizersContainer

SECOND = "normuon_second_moment"
NORMUON = {"normuon_beta2": 0.95}


def _variant_job(rank, world, mode, folder, options):
    """The toy model with experts (local: a DTensor second moment; dedicated 2-D weights: a plain one) made
    distributed as in TorchTitan, with DMuon's container built with ``options``, a schedule and a checkpointer."""
    model = toy_model(num_experts=4)
    setup = distribute(model, mode, world)
    config = DMuonOptimizersContainer.Config(
        name="dmuon", lr=MUON["lr"], momentum=MUON["momentum"], adamw_lr=ADAMW["adamw_lr"], ns_mode="exact", **options
    )
    setup.opt = DMuonOptimizersContainer(config, model_parts=[model])
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


def _straight(rank, world, mode, folder, options):
    setup, schedule, counter, _ = _variant_job(rank, world, mode, folder, options)
    return train_until(setup, schedule, counter, rank, world, STEPS), training_state(setup)


def _save_at_half(rank, world, mode, folder, options):
    setup, schedule, counter, manager = _variant_job(rank, world, mode, folder, options)
    losses = train_until(setup, schedule, counter, rank, world, STEPS // 2)
    manager.save(counter.step)
    manager.close()
    return losses, training_state(setup)


def _load_then_train(rank, world, mode, folder, options):
    """The state right after the load, then the losses and state of the remaining steps."""
    setup, schedule, counter, manager = _variant_job(rank, world, mode, folder, options)
    assert manager.load() and counter.step == STEPS // 2
    loaded = training_state(setup)
    return loaded, train_until(setup, schedule, counter, rank, world, STEPS), training_state(setup)


def _equal(a: dict, b: dict, keys) -> list:
    return [k for k in keys if not torch.equal(a[k], b[k])]


def test_normuon_resumes_bit_exact_and_reshards(pool2, pool4, tmp_path):
    """Z3 on 2 ranks with NorMuon: 3 steps + save + new processes + load + 3 steps is the 6 steps straight,
    bit for bit (weights, momentum, second moments, losses); the checkpoint loads on 4 ranks (another plan:
    every second moment where its weight's owner now is) with the second moments of the step it was saved at."""
    straight = pool2.run(_straight, "z3", str(tmp_path / "a"), NORMUON)
    first = pool2.run(_save_at_half, "z3", str(tmp_path / "b"), NORMUON)
    pool2.restart()
    second = pool2.run(_load_then_train, "z3", str(tmp_path / "b"), NORMUON)
    for rank in range(2):
        assert first[rank][0] + second[rank][1] == straight[rank][0]
    a, b = merge_rank_states(s for _, s in straight), merge_rank_states(s for *_, s in second)
    moments = [k for k in a if k.startswith(SECOND + "/")]
    assert moments and a.keys() == b.keys() and not _equal(a, b, a)
    assert any(".moe.w" in k for k in moments) and any("attention" in k for k in moments)  # local experts, dedicated
    saved = merge_rank_states(s for _, s in first)
    pool4.restart()
    resharded = merge_rank_states(
        loaded for loaded, _, _ in pool4.run(_load_then_train, "z3", str(tmp_path / "b"), NORMUON)
    )
    assert not _equal(saved, resharded, saved) and resharded.keys() == saved.keys()


def test_jobs_with_and_without_normuon_load_each_others_checkpoints(pool2, tmp_path):
    """A Muon checkpoint loads into a NorMuon job (weights and momentum; no second moment until the first
    step makes it from zero) and a NorMuon checkpoint into a Muon job (its second moments ignored)."""
    for saved_with, loaded_with, folder in ((NORMUON, {}, "normuon"), ({}, NORMUON, "muon")):
        saved = merge_rank_states(s for _, s in pool2.run(_save_at_half, "z3", str(tmp_path / folder), saved_with))
        pool2.restart()
        loaded = pool2.run(_load_then_train, "z3", str(tmp_path / folder), loaded_with)
        at_load = merge_rank_states(s for s, _, _ in loaded)
        kept = [k for k in saved if not k.startswith(SECOND + "/")]
        assert not any(k.startswith(SECOND + "/") for k in at_load) and not _equal(saved, at_load, kept)
        after = merge_rank_states(s for *_, s in loaded)
        assert any(k.startswith(SECOND + "/") for k in after) == bool(loaded_with)
        assert all(torch.isfinite(torch.tensor(losses)).all() for _, losses, _ in loaded)


# ---- tensor parallelism --------------------------------------------------------------------------------------
def _tp_job(rank, world, folder, tp, until, load: bool):
    """TorchTitan's llama3 (per-head blocks, NorMuon) on TP ``tp`` x FSDP; returns each weight's second moment
    in full by name (TP homes' rows merged, as the checkpoint holds it) after ``until`` steps or the load."""
    dims = th.parallel_dims(world, tp=tp)
    state = th.initial_state(th.tiny_llama3()) if not load else None
    model, container = th.build(th.tiny_llama3(), dims, state=state, lr=0.02, ns_blocks="heads", **NORMUON)
    counter = Counter()
    schedule = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=container, training_steps=4)
    manager = DMuonCheckpointManager.Config(enable=True, folder="ckpt", interval=2).build(
        dataloader=Counter(),
        model_parts=[model],
        optimizers=container,
        lr_schedulers=schedule,
        states={"train_state": counter},
        sd_adapter=None,
        base_folder=folder,
    )
    if load:
        assert manager.load(step=until)
    for batch in th.batches(until, 1, batch=8)[counter.step : until]:
        th.train(model, container, dims, [batch])
        schedule.step()
        counter.step += 1
        manager.save(counter.step)
    flat = container.state_dict()  # (merges the TP homes' rows: a collective)
    out = {}
    for key, value in flat.items():
        if key.endswith("." + SECOND):
            out[key] = (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
    manager.close()
    return out


def test_tensor_parallel_second_moments_reshard_onto_fsdp(pool2, tmp_path):
    """TP 2 keeps each matrix's second moment on its NS home; the checkpoint holds it whole (the homes'
    rows merged on the TP group), so FSDP 2 without TP loads exactly the TP job's second moments."""
    saved = pool2.run(_tp_job, str(tmp_path), 2, 2, False)
    pool2.restart()
    loaded = pool2.run(_tp_job, str(tmp_path), 1, 2, True)
    merged = {}
    for rank_state in saved + loaded:
        for key, value in rank_state.items():
            merged.setdefault(key, []).append(value)
    assert any("wqkv" in k for k in merged) and any(".wo." in k for k in merged)
    for key, values in merged.items():
        assert all(torch.equal(values[0], v) for v in values), key
        assert values[0].abs().sum() > 0, key


# ---- the TP merge's collectives: decided by the job, never by a rank's own state ---------------------------
COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor")


def _issued_by_state_dict(container) -> list[tuple]:
    """The collectives ``container.state_dict()`` issues on this rank (kind, group ranks, shape, dtype), recorded
    instead of run: ranks that disagree would otherwise wait on each other (on gloo until the timeout)."""
    issued, real = [], {name: getattr(dist, name) for name in COLLECTIVES}

    def recorder(name):
        def record(tensor, *args, group=None, **kwargs):
            ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
            shape = tuple(tensor.shape) if torch.is_tensor(tensor) else len(tensor)
            issued.append((name, ranks, shape, str(getattr(tensor, "dtype", ""))))

        return record

    try:
        for name in COLLECTIVES:
            setattr(dist, name, recorder(name))
        container.state_dict()
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return issued


def _tp_state_dict_collectives(rank, world, options, change):
    """TP 2 (llama3, per-head blocks) after one step; then this rank's state is made to differ from its TP
    peer's (``change``) and each rank records what ``state_dict()`` issues."""
    dims = th.parallel_dims(world, tp=world)
    model, container = th.build(th.tiny_llama3(), dims, lr=0.02, ns_blocks="heads", **options)
    th.train(model, container, dims, th.batches(1, 1, batch=8))
    (opt,) = container.dmuon_optimizers()
    split = [m.param for h in opt.dedicated_handles() for m in h.members if m.entry.tp_dim is not None and m.runs_ns]
    assert split
    if change == "dropped" and rank == 1:  # as a load that left them to the next step (FreshSecondMoments)
        for p in split:
            opt.state[p].pop(SECOND, None)
    if change == "leftover" and rank == 0:  # a second moment a Muon job's state holds (a NorMuon state loaded)
        opt.state[split[0]][SECOND] = torch.zeros(split[0].shape[0], 1)
    issued = _issued_by_state_dict(container)
    everyone = [None] * world
    dist.all_gather_object(everyone, issued)
    return everyone, len(split)


@pytest.mark.parametrize("options, change", [(NORMUON, "dropped"), ({}, "leftover")])
def test_tp_state_dict_issues_the_same_collectives_whatever_a_ranks_state(pool2, options, change):
    """Regression (issue 39): ``state_dict()`` merged NorMuon's second moments over the TP group when this
    rank's state held any (and per weight when it held that weight's): two TP ranks whose state differs — a
    rank whose second moments a load left out, a Muon job with a second moment left in one rank's state —
    issued different all-reduces, a hang on NCCL. Now the job's setting (normuon_beta2) and the plan decide:
    with NorMuon one all-reduce per TP-split weight on both ranks (zeros for a moment not held), without it none."""
    for everyone, split in pool2.run(_tp_state_dict_collectives, options, change):
        assert everyone[0] == everyone[1]
        assert len(everyone[0]) == (split if options else 0)
        assert all(kind == "all_reduce" and ranks == (0, 1) for kind, ranks, _, _ in everyone[0])
