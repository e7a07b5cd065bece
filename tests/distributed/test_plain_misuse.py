"""A plain-PyTorch user's order and pieces gone wrong (issue 37, item 2): each stops in one line before the
first step, or warns where it can be legitimate (``runtime/usage_checks.py``).

Without these checks every case below trains on silently: AdamW only (no dedicate_params), 7 of the toy
model's 21 parameters stepped (DMuon built before dedicate_params or fully_shard), the dedicated weights
stepped twice (a second optimizer, two DMuon), never (DMuon over a subset), or clipped by a norm that counts
each dedicated gradient on its owner only (torch's clip under DDP; under FSDP2 torch's own error, which
names no fix); an mp_policy given to fully_shard only failed in the first matmul, naming neither setting.
Orders that look wrong but are right are checked to train as the right order does; a hand-built
DistributedDataParallel(model), which hung, now trains as wrap_ddp does.
"""

import warnings

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from tests.support.helpers import batches, local_slice, toy_model
from titan_dmuon import DMuon, dedicate_params, wrap_ddp
from titan_dmuon.testing.toy_model import loss_fn

MUON_WEIGHTS = r"\.(attention|feed_forward)\.w"


def _shard(model, mesh):
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _steps(model, opt, rank, world, steps=2, clip=None, forward=None, other=None):
    """Train ``steps`` steps; ``clip(params)`` after each backward, ``other`` stepped after ``opt``."""
    loss = None
    for batch in batches(steps):
        x, y = local_slice(batch, rank, world)
        loss = loss_fn((forward or model)(x), y)
        loss.backward()
        if clip is not None:
            clip(model.parameters())
        opt.step()
        opt.zero_grad()
        if other is not None:
            other.step()
            other.zero_grad()
    return loss.item()


def _untouched(fn):
    """``fn``'s original torch function where ``dedicate_params`` wrapped it: a name bound before the wrap."""
    return fn.__wrapped__ if getattr(fn, "refuses_dmuon_dedicated_weights", False) else fn


def _misuse(rank, world, case):
    """Run ``case`` to its first step; (error type, message) or None, and the DMuon warnings seen."""
    mesh = init_device_mesh("cpu", (world,))
    model = toy_model()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            _run_case(case, model, mesh, rank, world)
            error = None
        except Exception as e:  # noqa: BLE001
            error = (type(e).__name__, str(e))
    return error, [str(w.message) for w in seen if "DMuon" in str(w.message)]


def _run_case(case, model, mesh, rank, world):
    if case == "dmuon_before_dedicate_params":
        DMuon(model, lr=0.02)
        dedicate_params(model, mesh, predicate=MUON_WEIGHTS)
        return
    if case == "no_dedicate_params":
        _shard(model, mesh)
        _steps(model, DMuon(model, lr=0.02), rank, world)
        return
    if case == "no_muon_weights_said":
        _shard(model, mesh)
        _steps(model, DMuon(model, dedicated=[], lr=0.02), rank, world)
        return
    ddp_cases = ("torch_clip_ddp", "torch_clip_bound_before")
    dedicate_params(model, mesh, predicate=MUON_WEIGHTS, reshard_after_forward=case not in ddp_cases)
    if case in ddp_cases:  # (a name bound before dedicate_params: torch's own, unwrapped)
        clip = torch.nn.utils.clip_grad_norm_
        clip = clip if case == "torch_clip_ddp" else _untouched(clip)
        ddp = wrap_ddp(model, model.__dict__["_dmuon_handles"][0])
        _steps(model, DMuon(model, lr=0.02), rank, world, forward=ddp, clip=lambda ps: clip(ps, 1e-3))
        return
    if case == "dmuon_before_fully_shard":
        opt = DMuon(model, lr=0.02)
        _shard(model, mesh)
        _steps(model, opt, rank, world)
        return
    if case == "mp_policy_on_fully_shard_only":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        _steps(model, DMuon(model, lr=0.02), rank, world)
        return
    _shard(model, mesh)
    if case == "dmuon_over_a_subset":
        DMuon([p for name, p in model.named_parameters() if ".feed_forward." not in name], lr=0.02)
        return
    opt = DMuon(model, lr=0.02)
    if case == "torch_optimizer_beside_dmuon":
        _steps(model, opt, rank, world, other=torch.optim.AdamW(model.parameters(), lr=1e-3))
    elif case == "torch_optimizer_instead":
        _steps(model, torch.optim.SGD(model.parameters(), lr=1e-3), rank, world)
    elif case == "two_dmuon":
        _steps(model, opt, rank, world, other=DMuon(model, lr=0.02))
    elif case == "torch_clip_fsdp":
        _steps(model, opt, rank, world, clip=lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1e-3))
    elif case == "torch_clip_with_norm":  # TorchTitan's form: get_total_norm, then clip_grads_with_norm_
        _steps(model, opt, rank, world, clip=lambda ps: torch.nn.utils.clip_grads_with_norm_(ps, 1e-3, 1.0))
    else:
        raise ValueError(case)


REFUSED = "which only DMuon may update"
MISUSE = {  # case: (error type, phrases) or ("warning", phrases)
    "no_dedicate_params": ("warning", ["DMuon found no dedicated weights", "call dedicate_params"]),
    "dmuon_before_dedicate_params": (
        "ValueError",
        ["'tok_embeddings.weight' is already held by a DMuon", "build DMuon last"],
    ),
    "dmuon_before_fully_shard": (
        "RuntimeError",
        ["'tok_embeddings.weight' was replaced in the model after DMuon", "build DMuon last"],
    ),
    "torch_optimizer_beside_dmuon": ("RuntimeError", ["AdamW would step the dedicated weight", REFUSED]),
    "torch_optimizer_instead": ("RuntimeError", ["SGD would step the dedicated weight", REFUSED]),
    "two_dmuon": ("RuntimeError", ["is held by two DMuon optimizers", "keep one DMuon"]),
    "dmuon_over_a_subset": ("ValueError", ["DMuon was given 8 of the 14 weights", "'layers.0.feed_forward.w1.weight'"]),
    "mp_policy_on_fully_shard_only": (
        "ValueError",
        [
            "layer 'layers.0' computes in torch.bfloat16 under fully_shard's",
            "pass the same mp_policy to dedicate_params",
        ],
    ),
    "torch_clip_fsdp": (
        "RuntimeError",
        ["torch.nn.utils.clip_grad_norm_ was given the dedicated weight", "use titan_dmuon.clip_grad_norm_"],
    ),
    "torch_clip_ddp": ("RuntimeError", ["torch.nn.utils.clip_grad_norm_ was given the dedicated weight"]),
    "torch_clip_bound_before": ("RuntimeError", ["torch.nn.utils.clip_grad_norm_ was given the dedicated weight"]),
    "torch_clip_with_norm": ("RuntimeError", ["torch.nn.utils.clip_grads_with_norm_ was given the dedicated"]),
}


@pytest.mark.parametrize("case", sorted(MISUSE))
def test_misuse_stops_in_one_line(pool2, case):
    """Every rank stops with the same one line (or warns once) before the first optimizer step."""
    kind, phrases = MISUSE[case]
    results = pool2.run(_misuse, case)
    for error, warned in results:
        if kind == "warning":
            assert error is None and len(warned) == 1, (error, warned)
            message = warned[0]
        else:
            assert error is not None and error[0] == kind, error
            message = error[1]
        assert "\n" not in message, message
        for phrase in phrases:
            assert phrase in message, message


def test_no_muon_weights_said_is_quiet(pool2):
    """dedicated=[]: a model (or stage) without Muon weights, said so: AdamW, no warning."""
    for error, warned in pool2.run(_misuse, "no_muon_weights_said"):
        assert error is None and warned == [], (error, warned)


# ---- orders that look wrong but train as the right one ---------------------------------------------------
def _right_and_alike(rank, world, case):
    """(loss of the right order, loss of ``case``) after 2 steps, from the same weights and data."""
    losses = []
    for variant in ("right", case):
        mesh = init_device_mesh("cpu", (world,))
        model = toy_model()
        if variant == "to_dtype_after_dedicate_params":
            dedicate_params(model, mesh, predicate=MUON_WEIGHTS)
            model.to(torch.bfloat16)
        else:
            if variant == "right" and case == "to_dtype_after_dedicate_params":
                model.to(torch.bfloat16)
            if variant == "two_handles_on_one_model":
                dedicate_params(model, mesh, predicate=r"\.attention\.w")
                dedicate_params(model, mesh, predicate=r"\.feed_forward\.w")
            else:
                dedicate_params(model, mesh, predicate=MUON_WEIGHTS, reshard_after_forward="ddp" not in case)
        if "ddp" in case:
            handle = model.__dict__["_dmuon_handles"][0]
            forward = DistributedDataParallel(model) if variant == case else wrap_ddp(model, handle)
        else:
            _shard(model, mesh)
            forward = model
        losses.append(_steps(model, DMuon(model, lr=0.02), rank, world, forward=forward))
    return losses


@pytest.mark.parametrize("case", ["two_handles_on_one_model", "to_dtype_after_dedicate_params", "plain_ddp"])
def test_legitimate_orders_train_as_the_right_one(pool2, case):
    """Two dedicate_params calls on disjoint weights of one model are one dedication split in two (a buffer per
    layer and handle): the same sums, but Newton–Schulz batches other sets of matrices (a GEMM of another batch
    may round its last bits differently): 1e-5 (DMuon that leaves the MLP weights unstepped is 1e-3 off after
    2 steps). model.to(dtype) after dedicate_params converts the same tensors in place (the handle follows
    them): the same operations, bit for bit. DistributedDataParallel(model) built by hand, against wrap_ddp:
    dedicate_params put the dedicated weights on DDP's ignore list (before, DDP's shape check across ranks
    met a 0-element placeholder: one rank raised, the other hung): the same DDP, bit for bit."""
    for right, alike in pool2.run(_right_and_alike, case):
        if case == "two_handles_on_one_model":
            assert abs(right - alike) <= 1e-5, (right, alike)
        else:
            assert right == alike
