"""FSDP2's composable ``replicate`` (``torch.distributed._composable.replicate_with_fsdp``, DDP built on
FSDP2) leaves DMuon's dedicated weights alone without being told, as ``fully_shard`` does.

Bug (issue 39): ``replicate`` imports ``_get_modules_and_states`` by name from FSDP2's ``_fsdp_init``,
so DMuon's wrapper of ``fully_shard``'s name did not reach it: ``replicate`` took the dedicated weights
(DTensors, replicated by FSDP2's all-reduce) beside DMuon's owners. ``fsdp_ignore`` now wraps both names.
"""

from __future__ import annotations

import pytest
from torch.distributed.tensor import DTensor

from tests.support.helpers import (
    ADAMW,
    MUON,
    TOLERANCE,
    batches,
    full_parameters,
    local_slice,
    max_diff,
    reference_train,
    toy_model,
)
from titan_dmuon import DMuon, dedicate_params
from titan_dmuon.testing.toy_model import loss_fn, muon_targets

replicate_with_fsdp = pytest.importorskip("torch.distributed._composable.replicate_with_fsdp")


def _replicated(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("replicate",))
    model = toy_model()
    handle = dedicate_params(model, muon_targets(model), mesh, reshard_after_forward=False)
    for layer in model.layers:
        replicate_with_fsdp.replicate(layer, mesh=mesh)
    replicate_with_fsdp.replicate(model, mesh=mesh)
    left_alone = {p for p in model.parameters() if not isinstance(p, DTensor)} == handle.ignored_params
    opt = DMuon(model, dedicated=handle, **MUON, **ADAMW)
    for batch in batches(3):
        x, y = local_slice(batch, rank, world)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return left_alone, full_parameters(model, handle)


def test_replicate_leaves_dedicated_weights_alone_and_trains_as_torch_muon(pool2):
    """Every parameter but the dedicated ones is FSDP2's (a DTensor), and 3 steps land within TOLERANCE of
    single-process torch.optim.Muon + AdamW."""
    results = pool2.run(_replicated)
    reference, _, _ = reference_train(toy_model(), batches(3))
    for left_alone, weights in results:
        assert left_alone
        assert max_diff(weights, reference) <= TOLERANCE
