"""``python -m titan_dmuon.sizing`` without a process group or a model built: Z2's and Z3's buffers by the design's
rule, traffic from the cost model, the cluster layouts from the shape tables, the command's table. Its memory
against what is measured: tests/distributed/test_sizing_memory.py; its tables against TorchTitan's models:
tests/titan/test_sizing_model_shapes.py."""

from __future__ import annotations

import pytest
import torch

from tests.support.sizing_parts import DIMS, toy_weights
from titan_dmuon.plan import cost_model
from titan_dmuon.sizing import command, render, stage_weights, step_memory
from titan_dmuon.sizing.figures import size_job
from titan_dmuon.sizing.records import Layout, Precision, Weight


# ---- the fast tier: no process group, no model built ------------------------------------------------------
def test_z2_holds_p_m_per_rank_and_z3_two_layers():
    """The seeds' first inconsistency, as the tool states it: Z2's buffers peak at P_M (every layer's
    Muon weights, in the compute dtype) on every rank, not P_M / N; Z3's at two layers."""
    weights = toy_weights(DIMS["dense"])
    p_m = sum(w.numel for w in weights if w.muon)
    layer = sum(w.numel for w in weights if w.muon and w.layer == 0)
    for n in (2, 8, 64):
        memory = size_job(weights, Layout(shard=n)).stages[0].memory
        assert memory["DMuon-Z2"].buffers_peak == 2 * p_m
        assert memory["DMuon-Z3"].buffers_peak == 2 * 2 * layer


@pytest.mark.parametrize(
    "layout",
    [Layout(shard=8), Layout(replicate=4, shard=8), Layout(replicate=4), Layout(shard=4, tp=2), Layout(shard=4, pp=2)],
)
def test_traffic_is_the_cost_models(layout):
    """Elements come from ``cost_model`` (what the ledger tests hold the runtime to); the bytes split
    them by dtype, so with 1 byte per element they are the elements again (the TP exchange is bf16
    whatever the dtypes: Newton–Schulz's own)."""
    from titan_dmuon.sizing.model_shapes import from_table

    weights = from_table("llama3", "debugmodel")
    one = size_job(weights, layout, precision=Precision(param=1, compute=1, reduce=1))
    for stage in one.stages:
        for name in ("DMuon-Z2", "DMuon-Z3"):
            tp = stage.tp_exchange
            assert stage.traffic[name].bytes - tp.bytes + tp.elements == stage.traffic[name].elements
        mode = stage_weights.dedication_mode(layout, reshard_after_forward=False)
        assert stage.traffic["DMuon-Z2"].elements == cost_model.dmuon_elements_per_rank(
            mode, numel=stage.dedicated_numel, deferred=layout.pp > 1
        ) + cost_model.owner_group_elements_per_rank(stage.plan)
        world = mode.mesh.world_size
        assert stage.floor.elements == 2 * (world - 1) * stage.dedicated_numel / world


@pytest.mark.parametrize(
    "model,flavor,layout",
    [
        ("llama3", "8B", Layout(shard=64)),
        ("llama3", "70B", Layout(replicate=4, shard=64, tp=8)),
        ("llama3", "405B", Layout(replicate=8, shard=128, tp=8, pp=16)),
        ("deepseek_v3", "671B", Layout(shard=64, ep=64, pp=8)),
        ("deepseek_v3", "671B", Layout(shard=1024)),
    ],
)
def test_cluster_layouts_answer_from_the_tables(model, flavor, layout):
    """The scale the tool is for, from the shape tables alone (no TorchTitan, nothing built): every
    rank is accounted for, Newton–Schulz runs once per matrix in the job, and the report says which
    mode and why."""
    from titan_dmuon.sizing.model_shapes import from_table

    weights = from_table(model, flavor)
    result = size_job(weights, layout)
    assert len(result.stages) == layout.pp
    assert all(len(s.ns_per_rank) == layout.world // layout.pp for s in result.stages)
    once = sum(e.ns_flops for s in result.stages for e in s.one_owner.plan.entries)  # each weight on one owner
    kept = (
        sum(
            stage_weights.one_expert(w) * w.experts
            for w in weights
            if w.muon and w.experts and w not in [w for s in result.stages for w in []]
        )
        if model == "deepseek_v3" and layout.ep > 1
        else 0
    )
    assert sum(sum(s.one_owner.ns_per_rank) for s in result.stages) == pytest.approx(once + kept, rel=1e-9)
    report = render.render(result, title=f"{model} {flavor}")
    assert "Recommendation: " in report and result.reasons


def test_the_command_prints_the_table(capsys):
    command.main(["--model", "llama3", "--flavor", "debugmodel", "--world", "2"])
    out = capsys.readouterr().out
    for figure in ("DMuon buffers, peak", "| DMuon-Z3 |", "critical path", "Recommendation: DMuon-Z"):
        assert figure in out


# ---- the shape tables are TorchTitan's models --------------------------------------------------------------


def test_a_layout_where_neither_mode_fits_says_so():
    """Issue 39: llama3 405B on 8 x 1024 data-parallel ranks: Z2's peak is far over the budget and Z3's is
    over it too; the recommendation is still the smaller (Z3), and a reason says that neither fits, with
    what would. Where Z3 fits (TP 8), its peak is said to be within the budget."""
    from titan_dmuon.sizing.model_shapes import from_table

    weights = from_table("llama3", "405B")
    over = size_job(weights, Layout(replicate=8, shard=1024))
    assert over.recommendation == "DMuon-Z3"
    assert any("Z3 does not fit" in r for r in over.reasons) and "neither fits" in over.reasons[-1], over.reasons
    within = size_job(weights, Layout(replicate=8, shard=128, tp=8))
    assert within.recommendation == "DMuon-Z3" and any(r.startswith("Z3 fits") for r in within.reasons)


def test_the_workspace_bound_is_what_a_step_on_every_muon_weight_keeps():
    """``workspace_bytes`` (the meta device) against a ``Workspace`` after a real CPU step on the same
    weights (fused q/k/v blocks, an expert stack, two shapes that share a class): the same bytes (the
    memory table's workspace row is it per rank; ``test_persistent_equals_the_allocators_count`` holds
    the total to the allocator)."""
    from titan_dmuon.math.matrix_blocks import row_blocks
    from titan_dmuon.math.muon_update import muon_step
    from titan_dmuon.optim.workspace import Workspace

    blocks = (((0, 32),), ((32, 48),), ((48, 64),))
    weights = [
        Weight(fqn="wqkv", shape=(64, 32), muon=True, layer=0, blocks=blocks),
        Weight(fqn="w1", shape=(96, 32), muon=True, layer=0),
        Weight(fqn="w2", shape=(32, 96), muon=True, layer=0),
        Weight(fqn="experts", shape=(4, 48, 32), muon=True, layer=0),
        Weight(fqn="norm", shape=(32,), muon=False, layer=0),
    ]
    muon = [w for w in weights if w.muon]
    params = [torch.randn(w.shape) for w in muon]
    workspace = Workspace()
    muon_step(
        params,
        [torch.randn_like(p) for p in params],
        [torch.zeros_like(p) for p in params],
        [w.blocks or row_blocks(w.shape[-2:]) for w in muon],
        lr=0.02,
        weight_decay=0.1,
        momentum=0.95,
        nesterov=True,
        ns_steps=5,
        scratch=workspace,
    )
    assert step_memory.workspace_bound(weights) == workspace.nbytes() > 0
    assert step_memory.workspace_bytes([[(w.shape, w.blocks) for w in muon]]) == workspace.nbytes()
