"""The plain-PyTorch API in three lines (issue 29, item 2), against the explicit API it stands for.

``dedicate_params(model, mesh, predicate=...)``; the usual ``fully_shard`` calls, given nothing from
DMuon (``runtime/fsdp_ignore.py`` adds the dedicated weights to FSDP2's ``ignored_params``);
``DMuon(model, ...)`` and ``clip_grad_norm_`` finding the handle from the parameters;
``set_requires_gradient_sync(model, flag)`` switching FSDP2's and DMuon's gradient sync together.
Each must give bit for bit what the explicit API gives (a list of weights, ``ignored_params=``,
``dedicated=handle``, both switches): the same operations in the same order.
"""

import importlib.util
import pathlib
import re

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tests.support.helpers import ADAMW, MUON, batches, full_parameters, local_slice, toy_model
from titan_dmuon import CommLedger, DMuon, clip_grad_norm_, dedicate_params, set_requires_gradient_sync
from titan_dmuon.testing.toy_model import ToyConfig, ToyTransformer, loss_fn, muon_targets

QUICKSTART = pathlib.Path(__file__).resolve().parents[2] / "examples" / "quickstart.py"
STEPS = 6


def _quickstart():
    spec = importlib.util.spec_from_file_location("quickstart", QUICKSTART)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _explicit_quickstart(rank, world, steps):
    """examples/quickstart.py written with the explicit API: a hand-built list (tests' own rule for the
    toy model's Muon targets), ignored_params on every fully_shard, dedicated=handle."""
    import torch.distributed as dist

    quickstart = _quickstart()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = ToyTransformer(ToyConfig(dim=64, hidden_dim=128, n_layers=4, vocab_size=128))
    handle = dedicate_params(model, muon_targets(model), mesh)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=handle.ignored_params)
    fully_shard(model, mesh=mesh, ignored_params=handle.ignored_params)
    opt = DMuon(model.parameters(), dedicated=handle, lr=0.02, adamw_lr=3e-3)
    generator = torch.Generator().manual_seed(1 + rank)
    losses = []
    for _ in range(steps):
        tokens = quickstart.batch(generator)
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def _quickstart_vs_explicit(rank, world, steps):
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        losses = _quickstart().train(steps)
    return losses, printed.getvalue(), _explicit_quickstart(rank, world, steps)


def test_quickstart_trains_as_the_explicit_api(pool2):
    """examples/quickstart.py (three DMuon lines) on 2 ranks: the loss falls, every step's loss equals
    the explicit API's bit for bit, and rank 0 prints one line per step."""
    text = QUICKSTART.read_text()
    code = [line.split("#")[0] for line in text.splitlines()]
    dmuon_lines = [line for line in code if re.search(r"\bdmuon\.|^import titan_dmuon\b", line)]  # (the model is
    assert len(dmuon_lines) == 3, dmuon_lines  # titan_dmuon.testing's toy transformer: not a DMuon line)
    for rank, (losses, printed, explicit) in enumerate(pool2.run(_quickstart_vs_explicit, STEPS)):
        assert losses == explicit
        assert losses[-1] < losses[0]
        lines = printed.splitlines()
        assert len(lines) == (STEPS if rank == 0 else 0)
        assert all(re.fullmatch(r"step +\d+  loss \d+\.\d{4}", line) for line in lines), lines


# ---- dedicate by predicate, regex or list ------------------------------------------------------------------
def _chosen(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    out = []
    for how in ("list", "regex", "callable"):
        model = toy_model(num_experts=4)
        if how == "list":
            handle = dedicate_params(model, muon_targets(model), mesh)
        elif how == "regex":
            handle = dedicate_params(model, mesh, predicate=r"\.(attention\.w|feed_forward\.w|moe\.)")
        else:
            handle = dedicate_params(
                model, mesh, predicate=lambda name, p: p.ndim >= 2 and ".layers." in f".{name}" and "norm" not in name
            )
        out.append((handle.fqns, [e.fqn for e in handle.local_experts], handle.plan.describe()))
        handle.remove()
    return out


def test_a_predicate_chooses_as_a_list_does(pool1):
    """A regular expression and a callable give the plan a list gives (the same weights in module order)."""
    ((by_list, by_regex, by_callable),) = pool1.run(_chosen)
    assert by_list == by_regex == by_callable
    assert by_list[0] and by_list[1]  # dense weights dedicated, experts kept in place


# ---- fully_shard needs nothing; DMuon and the clip find the handle ---------------------------------------------
def _plain_pytorch_setup(world, explicit: bool, mode="z3"):
    mesh = (
        init_device_mesh("cpu", (world,))
        if mode != "hsdp"
        else init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    )
    model = toy_model()
    reshard = mode != "z2"
    if explicit:
        handle = dedicate_params(model, muon_targets(model), mesh, reshard_after_forward=reshard)
        kw = dict(ignored_params=handle.ignored_params)
    else:
        handle = dedicate_params(model, mesh, predicate=r"\.(attention|feed_forward)\.w", reshard_after_forward=reshard)
        kw = {}
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, **kw)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, **kw)
    opt = DMuon(model.parameters(), dedicated=handle, **MUON, **ADAMW) if explicit else DMuon(model, **MUON, **ADAMW)
    return model, handle, opt


def _clipped_steps(rank, world, explicit, mode, accumulate=1):
    """Clipped steps with ``accumulate`` micro-batches each (sync off but for the last); per step the
    loss, the clip's norm, and the collectives of the micro-batches before the last (reduces only)."""
    model, handle, opt = _plain_pytorch_setup(world, explicit, mode)
    out = []
    for x, y in (local_slice(b, rank, world) for b in batches(3)):
        deferred = []
        for i, (xs, ys) in enumerate(zip(x.chunk(accumulate), y.chunk(accumulate))):
            sync = i == accumulate - 1
            if explicit:
                for layer in [*model.layers, model]:
                    layer.set_requires_gradient_sync(sync, recurse=False)
                handle.set_requires_gradient_sync(sync)
            else:
                set_requires_gradient_sync(model, sync)
            with CommLedger() as ledger:
                (loss_fn(model(xs), ys) / accumulate).backward()
            if not sync:
                deferred.append(len(ledger.select(kind="reduce_scatter")) + len(ledger.select(kind="reduce")))
        if explicit:
            norm = clip_grad_norm_(model.parameters(), 1.0, dedicated=handle)
        else:
            norm = clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        out.append((norm.item(), deferred))
    unsharded = {p for p in model.parameters() if not isinstance(p, DTensor)}  # what FSDP2 left alone
    return out, full_parameters(model, handle), unsharded == handle.ignored_params


@pytest.mark.parametrize("mode, accumulate", [("z3", 1), ("z2", 2)])
def test_the_three_line_api_equals_the_explicit_one(pool2, mode, accumulate):
    """fully_shard without ignored_params, DMuon(model), clip_grad_norm_ without dedicated= and (with
    gradient accumulation) one set_requires_gradient_sync: every norm and weight bit for bit as the
    explicit API, FSDP2 shards exactly the other parameters, and no micro-batch before the last reduces
    anything (FSDP2's reduce-scatters and DMuon's reduces both deferred)."""
    for rank_results in zip(*(pool2.run(_clipped_steps, explicit, mode, accumulate) for explicit in (True, False))):
        (explicit_steps, explicit_weights, _), (steps, weights, left_alone) = rank_results
        assert steps == explicit_steps
        assert explicit_weights.keys() == weights.keys()
        assert all(torch.equal(explicit_weights[k], weights[k]) for k in weights)
        assert left_alone
        assert all(d == [0] * (accumulate - 1) for _, d in steps)


# ---- bad use -------------------------------------------------------------------------------------------------
def _error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return None


def _bad(rank, world, case):
    mesh = init_device_mesh("cpu", (world,))
    model = toy_model()
    if case == "matches_nothing":
        return _error_of(lambda: dedicate_params(model, mesh, predicate=r"\.mlp\."))
    if case == "matches_a_norm":
        return _error_of(lambda: dedicate_params(model, mesh, predicate=r"layers\.0\."))
    if case == "matches_the_embedding":
        return _error_of(lambda: dedicate_params(model, mesh, predicate=lambda name, p: p.ndim == 2))
    if case == "both":
        return _error_of(lambda: dedicate_params(model, muon_targets(model), mesh, predicate=r"\.w"))
    if case == "neither":
        return _error_of(lambda: dedicate_params(model, mesh))
    if case == "bad_regex":
        return _error_of(lambda: dedicate_params(model, mesh, predicate=r"(attention"))
    if case == "after_fully_shard":
        fully_shard(model, mesh=mesh)
        return _error_of(lambda: dedicate_params(model, mesh, predicate=r"\.attention\.w"))
    if case == "fully_shard_took_them":  # a torch where fully_shard cannot be reached: nothing wrapped
        from torch.distributed.fsdp._fully_shard import _fully_shard

        # This worker may or may not have wrapped it already (an earlier test's dedicate_params): peel to torch's own.
        current = _fully_shard._get_modules_and_states
        bare = getattr(current, "__wrapped__", current)
        _fully_shard._get_modules_and_states = bare
        try:
            dedicate_params(model, mesh, predicate=r"\.attention\.w")
            _fully_shard._get_modules_and_states = bare  # (dedicate_params wrapped it again)
            fully_shard(model.layers[0], mesh=mesh)
            return _error_of(lambda: DMuon(model, lr=0.02))
        finally:
            _fully_shard._get_modules_and_states = current
    if case == "no_sync_of_nothing":
        return _error_of(lambda: set_requires_gradient_sync(toy_model(), False))
    raise ValueError(case)


BAD = {
    "matches_nothing": ("ValueError", ["predicate '\\\\.mlp\\\\.' matches no parameter", "'tok_embeddings.weight'"]),
    "matches_a_norm": ("ValueError", ["matches 'layers.0.attention_norm.weight', of shape (32,)", "narrowing"]),
    "matches_the_embedding": ("ValueError", ["'tok_embeddings.weight', an nn.Embedding's table", "in a list"]),
    "both": ("ValueError", ["one way", "it got both"]),
    "neither": ("ValueError", ["one way", "it got neither"]),
    "bad_regex": ("ValueError", ["'(attention' is not a valid regular expression"]),
    "after_fully_shard": ("ValueError", ["already sharded by fully_shard", "call dedicate_params first"]),
    "fully_shard_took_them": (
        "RuntimeError",
        ["'layers.0.attention.wq.weight' was sharded by fully_shard", "ignored_params=handle.ignored_params"],
    ),
    "no_sync_of_nothing": ("ValueError", ["found no FSDP2 module, DDP wrapper or DMuon dedication"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_use_gets_one_clear_line(pool1, case):
    (error,) = pool1.run(_bad, case)
    assert error is not None, "no error raised"
    assert error[0] == BAD[case][0] and "\n" not in error[1], error
    for phrase in BAD[case][1]:
        assert phrase in error[1], error
