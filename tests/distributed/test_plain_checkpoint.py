"""PyTorch's own checkpoint API with its defaults, on plain-PyTorch DMuon jobs (no TorchTitan).

``get_state_dict``/``set_state_dict`` with ``dcp.save``/``dcp.load``, and ``model.state_dict()`` /
``opt.state_dict()`` with ``dcp.save``/``dcp.load``, each with no options: a job saved at step 2
and loaded into a new model, handle and optimizer (initialised from another seed, so that anything
not loaded shows) trains on bit for bit as the job that never stopped (weights, Muon momentum, AdamW
moments and steps, every loss); a checkpoint loads across world sizes and modes with every weight and
momentum where the new plan puts it. docs/guides/checkpoints-plain-pytorch.md is the recipe.

Bug (issue 29): ``set_state_dict`` raised "Missing optimizer state for parameter ... use
StateDictOptions(strict=False)" on every rank: a rank that is not a dedicated weight's owner keeps
no momentum for it, and DMuon's state dict left the parameter out. It now lists it with no entries
(``titan_dmuon.optim.optimizer_state``), and a fresh optimizer lists the zeros its first step would create,
so that ``opt.state_dict()`` names every tensor ``dcp.load`` must fill.
"""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from tests.support.helpers import (
    assert_states_equal,
    batches,
    distribute,
    full_state,
    local_slice,
    merge_rank_states,
    toy_model,
)
from titan_dmuon.runtime import canonical_fqn
from titan_dmuon.testing.toy_model import loss_fn

STEPS, SAVED_AT = 4, 2
EXPERTS = 4


def _toy_setup(mode: str, world: int, *, seed: int = 0):
    """mode: "z2" | "z3" | "hsdp" | "ddp" (dense), "moe_local" (experts kept on FSDP2's dim-0 shards,
    updated in place) | "moe_dedicated" (each expert weight has one owner), both Z3; "z3_normuon"
    (the MoE model with NorMuon)."""
    if mode.startswith("moe"):
        expert_sharding = mode.removeprefix("moe_")
        return distribute(toy_model(seed, num_experts=EXPERTS), "z3", world, expert_sharding=expert_sharding)
    if mode == "z3_normuon":  # NorMuon's second moments are state too (experts: in place, as a DTensor)
        return distribute(toy_model(seed, num_experts=EXPERTS), "z3", world, opt_kwargs={"normuon_beta2": 0.95})
    return distribute(toy_model(seed), mode, world)


def _train_steps(setup, rank, world, start, stop):
    data = batches(STEPS)
    losses = []
    for step in range(start, stop):
        x, y = local_slice(data[step], rank, world)
        loss = loss_fn(setup.module(x), y)
        loss.backward()
        setup.opt.step()
        setup.opt.zero_grad()
        losses.append(loss.item())
    return losses


def _state(setup) -> dict[str, torch.Tensor]:
    """Weights in full, and every optimizer state tensor (DTensors in full, a dedicated weight's momentum
    from its owner), keyed by name; merge over ranks with merge_rank_states. Collective."""
    out = {f"weight/{k}": v for k, v in full_state(setup).items()}
    names = {id(p): canonical_fqn(n) for n, p in setup.model.named_parameters()}
    for group in setup.opt.param_groups:
        for p in group["params"]:
            for key, value in setup.opt.state.get(p, {}).items():
                value = value.full_tensor() if isinstance(value, DTensor) else value
                out[f"{key}/{names[id(p)]}"] = value.detach().clone()
    return out


# ---- the two APIs, with their defaults -------------------------------------------------------------------
def _save(setup, folder: str, api: str) -> None:
    if api == "get_state_dict":
        model_state, optim_state = get_state_dict(setup.model, setup.opt)
    else:
        model_state, optim_state = setup.model.state_dict(), setup.opt.state_dict()
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)


def _load(setup, folder: str, api: str) -> None:
    if api == "get_state_dict":
        model_state, optim_state = get_state_dict(setup.model, setup.opt)
        dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
        set_state_dict(setup.model, setup.opt, model_state_dict=model_state, optim_state_dict=optim_state)
    else:
        state = {"model": setup.model.state_dict(), "optim": setup.opt.state_dict()}
        dcp.load(state, checkpoint_id=folder)
        setup.model.load_state_dict(state["model"])
        setup.opt.load_state_dict(state["optim"])


APIS = ("get_state_dict", "state_dict")


def _straight_and_resumed(rank, world, mode, folder):
    """The straight job saves at step 2 with each API (and goes on to step 4); for each API a new job
    loads that checkpoint and trains to step 4. Also: a fresh optimizer's state_dict() lists exactly the
    tensors that a first step creates (``initialise_missing_state`` against ``step()``)."""
    straight, fresh = _toy_setup(mode, world), _toy_setup(mode, world, seed=1)
    fresh.opt.state_dict()
    fresh = set(_state(fresh))
    losses = _train_steps(straight, rank, world, 0, SAVED_AT)
    after_a_step = set(_state(straight))
    for api in APIS:
        _save(straight, f"{folder}/{api}", api)
    losses += _train_steps(straight, rank, world, SAVED_AT, STEPS)
    out = {"straight": (losses, _state(straight))}
    for api in APIS:
        resumed = _toy_setup(mode, world, seed=1)
        _load(resumed, f"{folder}/{api}", api)
        out[api] = (_train_steps(resumed, rank, world, SAVED_AT, STEPS), _state(resumed))
    return out, (after_a_step, fresh)


@pytest.mark.parametrize("mode", ["z2", "z3", "ddp", "moe_local", "moe_dedicated", "z3_normuon"])
def test_resume_is_bit_exact_with_the_defaults(pool2, tmp_path, mode):
    results = pool2.run(_straight_and_resumed, mode, str(tmp_path))
    straight = merge_rank_states(r["straight"][1] for r, _ in results)
    assert any(k.startswith("momentum_buffer/") for k in straight) and any(k.startswith("exp_avg/") for k in straight)
    for api in APIS:
        for rank, (r, _) in enumerate(results):
            assert r[api][0] == r["straight"][0][SAVED_AT:], (api, rank)
        assert_states_equal(merge_rank_states(r[api][1] for r, _ in results), straight)
    for after_a_step, fresh in (keys for _, keys in results):
        assert fresh == after_a_step  # the same tensors, on every rank


# ---- across world sizes and modes -------------------------------------------------------------------------
def _save_at(rank, world, mode, folder):
    setup = _toy_setup(mode, world)
    _train_steps(setup, rank, world, 0, SAVED_AT)
    _save(setup, folder, "get_state_dict")
    return _state(setup)


def _load_and_step(rank, world, mode, folder):
    setup = _toy_setup(mode, world, seed=1)
    _load(setup, folder, "get_state_dict")
    loaded = _state(setup)
    losses = _train_steps(setup, rank, world, SAVED_AT, SAVED_AT + 1)
    return loaded, losses


def _loads_as_saved(results, saved) -> None:
    """Every weight, momentum and Adam moment as saved (Adam's of DDP's replicated weights and FSDP2's
    shards alike), and training goes on."""
    loaded = merge_rank_states(state for state, _ in results)
    shared = {k for k in saved if not k.startswith("step/")}
    assert {k for k in loaded if not k.startswith("step/")} == shared
    assert_states_equal({k: loaded[k] for k in shared}, {k: saved[k] for k in shared})
    assert all(torch.isfinite(torch.tensor(losses)).all() for _, losses in results)


def test_reshard_across_world_sizes_and_modes(pool2, pool4, tmp_path):
    """Z3 on 2 ranks -> HSDP 2 x 2; HSDP -> HSDP resumes bit for bit; HSDP -> DDP on 2 ranks."""
    saved = merge_rank_states(pool2.run(_save_at, "z3", str(tmp_path / "z3")))
    _loads_as_saved(pool4.run(_load_and_step, "hsdp", str(tmp_path / "z3")), saved)

    results = pool4.run(_straight_and_resumed, "hsdp", str(tmp_path / "hsdp"))
    straight = merge_rank_states(r["straight"][1] for r, _ in results)
    for api in APIS:
        for r, _ in results:
            assert r[api][0] == r["straight"][0][SAVED_AT:]
        assert_states_equal(merge_rank_states(r[api][1] for r, _ in results), straight)

    saved = merge_rank_states(pool4.run(_save_at, "hsdp", str(tmp_path / "hsdp4")))
    _loads_as_saved(pool2.run(_load_and_step, "ddp", str(tmp_path / "hsdp4")), saved)


@pytest.mark.parametrize("before, after", [("moe_local", "moe_dedicated"), ("moe_dedicated", "moe_local")])
def test_experts_reshard_between_local_and_dedicated(pool2, tmp_path, before, after):
    """Experts kept in place (FSDP2's DTensors, momentum on every rank) and dedicated (one owner's
    plain tensor) save the same keys: either loads into the other."""
    saved = merge_rank_states(pool2.run(_save_at, before, str(tmp_path)))
    _loads_as_saved(pool2.run(_load_and_step, after, str(tmp_path)), saved)


# ---- what DMuon presents ------------------------------------------------------------------------------------
def _listed(rank, world):
    setup = _toy_setup("z3", world)
    _, optim_state = get_state_dict(setup.model, setup.opt)
    return {name: sorted(state) for name, state in optim_state["state"].items()}, setup.handle.fqns


def test_every_parameter_is_listed_and_momentum_only_on_its_owner(pool2):
    """Every parameter has an entry on every rank (what set_state_dict checks); a dedicated weight's
    momentum is on its owner only (DCP writes it once, from there), the other rank's entry is empty."""
    results = pool2.run(_listed)
    listed, dedicated = [state for state, _ in results], results[0][1]
    assert all(state.keys() == listed[0].keys() for state in listed)
    for fqn in dedicated:
        assert sorted(state[fqn] for state in listed) == [[], ["momentum_buffer"]], fqn


# ---- tensor parallelism ----------------------------------------------------------------------------------


# ---- one consolidated copy of the weights ----------------------------------------------------------------
def _consolidated(rank, world):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    setup = _toy_setup("z3", world)
    _train_steps(setup, rank, world, 0, 1)
    full = get_model_state_dict(setup.model, options=StateDictOptions(full_state_dict=True))
    lacking = set(setup.handle.fqns) - set(full)
    full.update(setup.handle.full_tensors())
    fresh = _toy_setup("z3", world, seed=1)
    set_model_state_dict(fresh.model, dict(full), options=StateDictOptions(full_state_dict=True))
    return lacking, full, full_state(setup), full_state(fresh)


def test_a_consolidated_copy_takes_the_handles_weights_and_loads_back(pool2):
    """full_state_dict=True gathers DTensors only (the recipe's limit): the dedicated weights other ranks
    own are missing until handle.full_tensors() adds them; the full dict then equals every weight and
    loads into a new job with set_model_state_dict(full_state_dict=True)."""
    results = pool2.run(_consolidated)
    assert set.union(*(lacking for lacking, *_ in results))  # some rank lacks some weight without them
    for _, full, weights, loaded in results:
        assert_states_equal(full, weights)
        assert_states_equal(loaded, weights)
