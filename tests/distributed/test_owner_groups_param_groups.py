"""Two Muon param groups with owner groups, through the plain API (``[{"params": ..., "lr": ...}, ...]``).

The model of ``tests/distributed/test_owner_groups.py`` (a dominant matrix split over an owner group beside small
one-owner matrices) with its Muon targets in two user param groups at different learning rates, the
dominant matrix in the second: it trains as single-process ``torch.optim.Muon`` with the same two groups
+ AdamW, and resumes bit for bit from PyTorch's checkpoint API with its defaults
(``get_state_dict``/``set_state_dict`` + ``dcp.save``/``dcp.load``).

Bug (issue 39): a ``list_every_param`` that lists the empty entries of the first user param group only
(the non-owners of the second group's one-owner weights left out) passed every test, because no test
built two param groups with groups; ``set_state_dict`` then refuses the load ("Missing optimizer state").
``test_a_second_group_left_out_of_the_state_is_refused_by_pytorch`` plants it and sees the refusal.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tests.support.helpers import (
    ADAMW,
    MUON,
    assert_states_equal,
    batches,
    distribute,
    full_state,
    local_slice,
    max_diff,
)
from tests.support.owner_groups_parts import (
    ADAMW_EPS,
    GROUP_TOLERANCE,
    STEPS,
    TINY_GROUPS,
    dominant_model,
    dominant_targets,
)
from titan_dmuon.testing.toy_model import loss_fn

LR = (0.02, 0.01)  # attention-like small matrices, then the MLP-like dominant one


def _user_groups(model) -> list[dict]:
    """Group 1: the first layer's small matrices but its last, and the embedding; group 2: the dominant
    matrix, the first layer's last small matrix (a one-owner weight: non-owners list it empty), the rest."""
    small = model.layers[0]
    first = [small.wq.weight, small.wk.weight, model.embed.weight]
    chosen = {id(p) for p in first}
    return [
        {"params": first, "lr": LR[0]},
        {"params": [p for p in model.parameters() if id(p) not in chosen], "lr": LR[1]},
    ]


def _job(mode: str, world: int, seed: int = 0):
    return distribute(
        dominant_model(seed),
        mode,
        world,
        targets_fn=dominant_targets,
        owner_groups=TINY_GROUPS,
        opt_kwargs=ADAMW_EPS,
        param_groups_fn=_user_groups,
    )


def _train(setup, rank, world, start, stop):
    data, losses = batches(STEPS), []
    for step in range(start, stop):
        x, y = local_slice(data[step], rank, world)
        loss = loss_fn(setup.module(x), y)
        loss.backward()
        setup.opt.step()
        setup.opt.zero_grad()
        losses.append(loss.item())
    return losses


def _reference(model) -> dict[str, torch.Tensor]:
    """Single process: torch.optim.Muon with the same two Muon param groups, torch.optim.AdamW on the rest."""
    model = copy.deepcopy(model)
    targets = {id(p) for p in dominant_targets(model)}
    groups = _user_groups(model)
    muon = torch.optim.Muon(
        [{"params": [p for p in g["params"] if id(p) in targets], "lr": g["lr"]} for g in groups],
        **{k: v for k, v in MUON.items() if k != "lr"},
    )
    adamw = torch.optim.AdamW(
        [p for p in model.parameters() if id(p) not in targets],
        lr=ADAMW["adamw_lr"],
        betas=ADAMW["adamw_betas"],
        eps=ADAMW_EPS["adamw_eps"],
        weight_decay=ADAMW["adamw_weight_decay"],
    )
    for x, y in batches(STEPS):
        loss_fn(model(x), y).backward()
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _trained(rank, world, mode):
    setup = _job(mode, world)
    _train(setup, rank, world, 0, STEPS)
    groups = [(e.fqn, e.group.size) for e in setup.handle.plan.entries if e.group is not None]
    return full_state(setup), groups, [g["lr"] for g in setup.opt.param_groups if g["use_muon"]]


@pytest.mark.parametrize("mode", ["z3", "hsdp"])
def test_two_muon_param_groups_with_an_owner_group_train_as_torch_muon(pool4, mode):
    """The dominant matrix (group 2's) is split over an owner group; each Muon group keeps its own learning
    rate; the weights after a few steps are within GROUP_TOLERANCE of torch.optim.Muon + AdamW with the same
    groups (the same job with both groups at one learning rate is far further off than that)."""
    state, groups, lrs = pool4.run(_trained, mode)[0]
    assert [name for name, _ in groups] == ["layers.1.big.weight"] and lrs == list(LR)
    reference = _reference(dominant_model())
    assert max_diff(state, reference) <= GROUP_TOLERANCE
    assert max_diff(state, _reference_at(dominant_model(), LR[0])) > 4 * GROUP_TOLERANCE


def _reference_at(model, lr: float) -> dict[str, torch.Tensor]:
    """The reference with both Muon groups at ``lr`` (what a step that ignored group 2's rate would follow)."""
    global LR
    saved, LR = LR, (lr, lr)
    try:
        return _reference(model)
    finally:
        LR = saved


def _save(setup, folder):
    model_state, optim_state = get_state_dict(setup.model, setup.opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)


def _load(setup, folder):
    model_state, optim_state = get_state_dict(setup.model, setup.opt)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
    set_state_dict(setup.model, setup.opt, model_state_dict=model_state, optim_state_dict=optim_state)


def _straight_and_resumed(rank, world, mode, folder):
    straight = _job(mode, world)
    losses = _train(straight, rank, world, 0, 2)
    _save(straight, folder)
    losses += _train(straight, rank, world, 2, STEPS)
    resumed = _job(mode, world, seed=1)
    _load(resumed, folder)
    return losses[2:], full_state(straight), _train(resumed, rank, world, 2, STEPS), full_state(resumed)


@pytest.mark.parametrize("mode", ["z3", "hsdp"])
def test_two_param_groups_with_owner_groups_resume_bit_exact_with_pytorch_defaults(pool4, tmp_path, mode):
    """Saved at step 2 with get_state_dict + dcp.save, loaded into a job from another seed with dcp.load +
    set_state_dict (no options): the same losses and weights bit for bit as the job that never stopped."""
    for rank, (losses, straight, resumed_losses, resumed) in enumerate(
        pool4.run(_straight_and_resumed, mode, str(tmp_path))
    ):
        assert resumed_losses == losses, rank
        assert_states_equal(resumed, straight)


def _planted(rank, world, folder):
    """The bug of issue 39 planted: only the first user param group's parameters listed when empty."""
    from titan_dmuon.optim import optimizer

    def first_group_only(opt, packed):
        for index in range(len(opt.param_groups[0]["params"]) + len(opt.param_groups[1]["params"])):
            packed["state"].setdefault(index, {})

    original = optimizer.list_every_param
    optimizer.list_every_param = first_group_only
    try:
        straight = _job("z3", world)
        _train(straight, rank, world, 0, 1)
        _save(straight, folder)
        try:
            _load(_job("z3", world, seed=1), folder)
        except (RuntimeError, KeyError, ValueError) as e:
            return str(e)
        return None
    finally:
        optimizer.list_every_param = original


def test_a_second_group_left_out_of_the_state_is_refused_by_pytorch(pool4, tmp_path):
    """The planted bug: PyTorch's defaults refuse the load on the ranks that do not own a weight of the
    second user group, so the resume test above fails with it."""
    messages = pool4.run(_planted, str(tmp_path))
    assert any(m is not None and "Missing optimizer state" in m for m in messages), messages
