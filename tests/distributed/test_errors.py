"""Bad input gets a clear error at dedicate/construct time, on every rank, never a hang."""

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from tests.support.helpers import ADAMW, MUON, batches, distribute, local_slice, toy_model
from titan_dmuon import DMuon, dedicate_params, wrap_ddp
from titan_dmuon.testing.toy_model import ToyConfig, ToyTransformer, loss_fn, muon_targets


def _error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return None


def _bad_dedicate(rank, world, case):
    model = toy_model()
    mesh = init_device_mesh("cpu", (world,))
    targets = muon_targets(model)
    if case == "not_2d":
        return _error_of(lambda: dedicate_params(model, [model.norm.weight], mesh))
    if case == "foreign":
        return _error_of(lambda: dedicate_params(model, [nn.Parameter(torch.ones(4, 4))], mesh))
    if case == "listed_twice":
        return _error_of(lambda: dedicate_params(model, targets + targets[:1], mesh))
    if case == "dedicated_twice":
        dedicate_params(model, targets[:2], mesh)
        return _error_of(lambda: dedicate_params(model, targets[1:3], mesh))
    if case == "reshard_not_bool":
        return _error_of(lambda: dedicate_params(model, targets, mesh, reshard_after_forward="yes"))
    if case == "after_fully_shard":
        fully_shard(model, mesh=mesh)
        return _error_of(lambda: dedicate_params(model, list(model.parameters())[:1], mesh))
    if case == "after_ddp":
        ddp = DistributedDataParallel(model)
        return _error_of(lambda: dedicate_params(ddp, targets, mesh))
    if case == "misnamed_2d_mesh":
        mesh2 = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
        return _error_of(lambda: dedicate_params(model, targets, mesh2))
    if case == "unnamed_2d_mesh":
        mesh2 = init_device_mesh("cpu", (1, world))
        return _error_of(lambda: dedicate_params(model, targets, mesh2))
    if case == "3d_mesh":
        mesh3 = init_device_mesh("cpu", (1, world, 1), mesh_dim_names=("a", "dp_replicate", "dp_shard"))
        return _error_of(lambda: dedicate_params(model, targets, mesh3))
    if case == "bad_split":
        return _error_of(lambda: dedicate_params(model, targets, mesh, split_rows={targets[0]: [10, 10]}))
    if case in ("tp_dim_of_stack", "tp_dims_missing"):  # (TP-local shards in name only: refused before any use)
        model = toy_model(num_experts=4)
        targets = muon_targets(model)
        mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp_shard", "tp"))
        stack = next(p for p in targets if p.ndim == 3)
        dims = {p: 0 for p in targets} if case == "tp_dim_of_stack" else {stack: 1}
        return _error_of(
            lambda: dedicate_params(model, targets, mesh2["dp_shard"], tp_mesh=mesh2["tp"], tp_shard_dims=dims)
        )
    if case == "plans_differ":  # rank 1 leaves one weight out
        return _error_of(lambda: dedicate_params(model, targets if rank == 0 else targets[:-1], mesh))
    raise ValueError(case)


CASES = {
    "not_2d": ("ValueError", ["norm.weight", "(32,)", "2-D"]),
    "foreign": ("ValueError", ["not a parameter of the given module"]),
    "listed_twice": ("ValueError", ["layers.0.attention.wq.weight", "twice"]),
    "dedicated_twice": ("ValueError", ["already dedicated"]),
    "reshard_not_bool": ("TypeError", ["reshard_after_forward must be a bool", "'yes'"]),
    "after_fully_shard": ("ValueError", ["already sharded by fully_shard", "call dedicate_params first"]),
    "after_ddp": ("ValueError", ["before wrapping the model in DistributedDataParallel"]),
    "misnamed_2d_mesh": ("ValueError", ["('dp_replicate', 'dp_shard')", "('replicate', 'shard')"]),
    "unnamed_2d_mesh": ("ValueError", ["no names"]),
    "3d_mesh": ("ValueError", ["1-D (DDP/FSDP) or 2-D (HSDP)", "3 dims"]),
    "bad_split": ("ValueError", ["split_rows", "sum to 32"]),
    "plans_differ": ("RuntimeError", ["plans differ across ranks", "[[0], [1]]"]),
    "tp_dim_of_stack": ("ValueError", ["moe.w1'] = 0: expected, for an expert stack: 1 or 2", "or None (replicated)"]),
    "tp_dims_missing": ("ValueError", ["has no entry in tp_shard_dims", "None when every tp rank holds it whole"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_dedicate_input(pool2, case):
    kind, phrases = CASES[case]
    for error in pool2.run(_bad_dedicate, case):
        assert error is not None, "no error raised"
        assert error[0] == kind, error
        for phrase in phrases:
            assert phrase in error[1], error


def _bad_optimizer(rank, world, options):
    setup = distribute(toy_model(), "z3", world)
    return _error_of(lambda: DMuon(setup.model.parameters(), dedicated=setup.handle, **options)) or _error_of(
        lambda: DMuon([{"params": list(setup.model.parameters()), **options}], dedicated=setup.handle)
    )


@pytest.mark.parametrize(
    "options, phrase",
    [
        ({"lr": -1.0}, "lr = -1.0: expected a number >= 0"),
        ({"momentum": 1.5}, "momentum = 1.5: expected a number in [0, 1)"),
        ({"ns_steps": 0}, "ns_steps = 0: expected an integer in [1, 100)"),
        ({"adjust_lr_fn": "spectral"}, "adjust_lr_fn = 'spectral': expected one of"),
        ({"adamw_betas": (0.9,)}, "adamw_betas = (0.9,): expected two numbers"),
        ({"nesterov": "yes"}, "nesterov = 'yes': expected true or false"),
        ({"ns_method": "newton"}, "ns_method = 'newton': expected one of ('torch', 'polar_express', 'gram')"),
        (
            {"ns_method": "gram", "ns_mode": "exact"},
            "ns_method = 'gram': expected 'torch' with ns_mode 'exact' (torch.optim.Muon's own update), "
            "or ns_mode 'batched'",
        ),
        (
            {"ns_method": "polar_express", "ns_coefficients": (3.0, -4.0, 2.0)},
            "ns_coefficients = (3.0, -4.0, 2.0): expected torch.optim.Muon's (3.4445, -4.775, 2.0315) with ns_method "
            "'polar_express' (its own per-step schedule), or ns_method 'torch'",
        ),
        ({"lr": torch.tensor([1e-3, 2e-3])}, "expected a number >= 0 (or a 1-element tensor)"),
    ],
)
def test_bad_optimizer_options(pool2, options, phrase):
    for error in pool2.run(_bad_optimizer, options):
        assert error is not None and phrase in error[1], error


def test_unknown_group_option(pool2):
    for error in pool2.run(_unknown_group_option):
        assert error[0] == "ValueError" and "unknown DMuon param-group option(s) ['betas']" in error[1]


def _unknown_group_option(rank, world):
    setup = distribute(toy_model(), "z3", world)
    return _error_of(
        lambda: DMuon([{"params": list(setup.model.parameters()), "betas": (0.9, 0.9)}], dedicated=setup.handle)
    )


def _forward_on_meta(rank, world):
    with torch.device("meta"):
        model = ToyTransformer(ToyConfig())
    dedicate_params(model, muon_targets(model), init_device_mesh("cpu", (world,)))
    x, _ = local_slice(batches(1)[0], rank, world)
    return _error_of(lambda: model(x))


def test_forward_before_materialising_meta_model(pool2):
    for error in pool2.run(_forward_on_meta):
        assert error[0] == "RuntimeError" and "still on the meta device" in error[1] and "to_empty" in error[1]


def _optimizer_built_before_to_empty(rank, world):
    with torch.device("meta"):
        model = ToyTransformer(ToyConfig())
    setup = distribute(model, "z3", world)  # builds DMuon on the meta parameters
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.01)
    x, y = local_slice(batches(1)[0], rank, world)
    loss_fn(setup.module(x), y).backward()
    return _error_of(setup.opt.step)


def test_optimizer_built_before_materialisation(pool2):
    for error in pool2.run(_optimizer_built_before_to_empty):
        assert error[0] == "RuntimeError" and "was replaced in the model after DMuon was built" in error[1], error
        assert "build DMuon last, after dedicate_params, fully_shard and materialising the model" in error[1]


def _ddp_on_hsdp_handle(rank, world):
    model = toy_model()
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    handle = dedicate_params(model, muon_targets(model), mesh)
    return _error_of(lambda: wrap_ddp(model, handle))


def test_wrap_ddp_needs_a_one_d_handle(pool2):
    for error in pool2.run(_ddp_on_hsdp_handle):
        assert error[0] == "ValueError" and "1-D mesh" in error[1]


def test_empty_parameter_list():
    with pytest.raises(ValueError, match="empty parameter list"):
        DMuon([], **MUON, **ADAMW)
