"""``python -m titan_dmuon.sizing``: its figures against what is measured, its tables against TorchTitan.

Memory: the tool's parameters, gradients, optimizer state and DMuon buffers (between steps, peak)
per rank equal, byte for byte, what ``benchmarks/memory_table.py`` measures of the same model and
layout (each rank simulated on the fake process group, bf16 compute / fp32 reduce, the largest
rank of each figure) and what the handle's buffer counters read, and its persistent total equals
the allocator's count of the bytes alive between steps. Tolerance zero, because both sides count
the same deterministic things: storages of the tensors each rank holds (FSDP2's padded dim-0
shards, owners' whole weights, AdamW's moments of the unpadded shard and its step counts), and
DMuon's packed-buffer bytes, which do not depend on timing, kernels or the allocator's caching.
What the tool only estimates (FSDP2's gathered weights, activations) is not asserted.
"""

from __future__ import annotations

import re

import pytest
import torch

from titan_dmuon.plan import cost_model
from titan_dmuon.sizing import command, figures, render
from titan_dmuon.sizing.figures import size_job
from titan_dmuon.sizing.records import Layout, Precision, Weight

DIMS = {  # tiny models, uneven on purpose: 3 layers over 2 or 4 owners, rows that 4 ranks do not divide
    "dense": dict(dim=64, n_layers=3, n_heads=8, n_kv_heads=4, hidden_dim=200, vocab_size=1002),
    "moe": dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48, vocab_size=64, num_experts=4),
}
CASES = [  # (model, optimizer, mode, world): memory_table.py's rows, and experts kept (N <= E) and dedicated (N > E)
    ("dense", "fsdp_adamw", "z3", 2), ("dense", "dmuon", "z2", 2), ("dense", "dmuon", "z3", 2),
    ("dense", "dmuon", "z3", 4), ("dense", "fsdp_adamw", "hsdp", 4), ("dense", "dmuon", "hsdp", 4),
    ("moe", "fsdp_adamw", "z3", 2), ("moe", "dmuon", "z3", 2), ("moe", "dmuon", "hsdp", 4), ("moe", "dmuon", "z3", 8),
]


def toy_weights(dims: dict) -> list[Weight]:
    """The toy transformer's weights as the tool takes them (its Muon targets: ``muon_targets``)."""
    from tests.helpers import toy_model
    from titan_dmuon.testing.toy_model import muon_targets

    model = toy_model(**dims)
    targets = {id(p) for p in muon_targets(model)}
    return [Weight(fqn=name, shape=tuple(p.shape), muon=id(p) in targets,
                   layer=int(name.split(".")[1]) if name.startswith("layers.") else None)
            for name, p in model.named_parameters()]


def layout_of(mode: str, world: int) -> Layout:
    return Layout(replicate=2, shard=world // 2) if mode == "hsdp" else Layout(shard=world)


def _measured(rank: int, world: int, dims: dict, optimizer: str, mode: str, ranks: int) -> dict:
    """Each rank of a ``ranks``-rank job simulated in turn on the fake process group: 3 steps as
    memory_table.py runs them, then its storage breakdown and the handle's buffer counters (peak
    since step 2, when the layer order is known and prefetching runs)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from benchmarks.memory_table import storage_breakdown
    from tests.helpers import baseline, batches, distribute, local_slice, make_mesh, toy_model
    from tests.runtime_parts import fake_pg
    from titan_dmuon.testing.toy_model import loss_fn

    per_rank = []
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for r in range(ranks):
        with fake_pg(ranks, r):
            model = toy_model(**dims)
            if optimizer == "dmuon":
                setup = distribute(model, mode, ranks, mp_policy=policy)
            else:
                setup = baseline(model, optimizer, ranks, mesh=make_mesh("hsdp" if mode == "hsdp" else "z3", ranks),
                                 reshard=mode != "z2", mp_policy=policy)
            for i, batch in enumerate(batches(3, global_batch=2 * ranks, seq=8, vocab=dims["vocab_size"])):
                if i == 1 and setup.handle is not None:
                    setup.handle.reset_peak_buffer_bytes()
                x, y = local_slice(batch, r, ranks)
                setup.opt.zero_grad()
                loss_fn(setup.module(x), y).backward()
                setup.opt.step()
            figures = storage_breakdown(setup)
            figures["peak_buffers"] = setup.handle.peak_buffer_bytes if setup.handle is not None else 0
            per_rank.append(figures)
    return {k: max(f[k] for f in per_rank) for k in per_rank[0]}


@pytest.mark.parametrize("model,optimizer,mode,world", CASES)
def test_memory_equals_the_measured(solo, model, optimizer, mode, world):
    measured = solo.run(_measured, DIMS[model], optimizer, mode, world)[0]
    name = "FSDP2 + AdamW, " + ("Z2" if mode == "z2" else "Z3") if optimizer == "fsdp_adamw" else \
        "DMuon-Z2" if mode == "z2" else "DMuon-Z3"
    predicted = size_job(toy_weights(DIMS[model]), layout_of(mode, world)).stages[0].memory[name]
    assert {"params": predicted.params, "grads": predicted.grads, "opt_state": predicted.optimizer_state,
            "dmuon_buffers": predicted.buffers_between_steps, "peak_buffers": predicted.buffers_peak} == {
        k: measured[k] for k in ("params", "grads", "opt_state", "dmuon_buffers", "peak_buffers")}


def _allocator_persistent(rank: int, world: int, mode: str, ranks: int) -> int:
    """memory_table.py's own run (under the profiler): bytes alive between steps, the largest rank."""
    from benchmarks.memory_table import on_fake_pg

    return max(on_fake_pg(r, ranks, ("dmuon", mode), DIMS["dense"], 2, 8)["persistent"] for r in range(ranks))


def test_persistent_equals_the_allocators_count(solo):
    """The allocator's events (everything alive after the step, nothing named in advance) give the
    tool's persistent total: nothing the tool leaves out stays alive between steps. Tolerance: the
    run also keeps a few bytes that are neither model nor optimizer (8 here, in FSDP2 + AdamW's run
    too: memory_table.py's "other" column), less than the smallest weight (a 64-element norm, 256
    bytes) that a wrong count would miss; the breakdown itself is asserted exactly above."""
    predicted = size_job(toy_weights(DIMS["dense"]), Layout(shard=2)).stages[0].memory["DMuon-Z3"]
    smallest_weight = 4 * DIMS["dense"]["dim"]
    assert 0 <= solo.run(_allocator_persistent, "z3", 2)[0] - predicted.persistent < smallest_weight


# ---- the fast tier: no process group, no model built ------------------------------------------------------
@pytest.mark.unit
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


@pytest.mark.unit
@pytest.mark.parametrize("layout", [Layout(shard=8), Layout(replicate=4, shard=8), Layout(replicate=4),
                                    Layout(shard=4, tp=2), Layout(shard=4, pp=2)])
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
        mode = figures._dedication_mode(layout, reshard_after_forward=False)
        assert stage.traffic["DMuon-Z2"].elements == cost_model.dmuon_elements_per_rank(
            mode, numel=stage.dedicated_numel, deferred=layout.pp > 1)
        world = mode.mesh.world_size
        assert stage.floor.elements == 2 * (world - 1) * stage.dedicated_numel / world


@pytest.mark.unit
@pytest.mark.parametrize("model,flavor,layout", [
    ("llama3", "8B", Layout(shard=64)), ("llama3", "70B", Layout(replicate=4, shard=64, tp=8)),
    ("llama3", "405B", Layout(replicate=8, shard=128, tp=8, pp=16)),
    ("deepseek_v3", "671B", Layout(shard=64, ep=64, pp=8)), ("deepseek_v3", "671B", Layout(shard=1024)),
])
def test_cluster_layouts_answer_from_the_tables(model, flavor, layout):
    """The scale the tool is for, from the shape tables alone (no TorchTitan, nothing built): every
    rank is accounted for, Newton–Schulz runs once per matrix in the job, and the report says which
    mode and why."""
    from titan_dmuon.sizing.model_shapes import from_table

    weights = from_table(model, flavor)
    result = size_job(weights, layout)
    assert len(result.stages) == layout.pp
    assert all(len(s.ns_per_rank) == layout.world // layout.pp for s in result.stages)
    once = sum(e.ns_flops for s in result.stages for e in s.plan.entries)  # each dedicated weight on one owner
    kept = sum(figures._one_expert(w) * w.experts for w in weights if w.muon and w.experts and w not in
               [w for s in result.stages for w in []]) if model == "deepseek_v3" and layout.ep > 1 else 0
    assert sum(sum(s.ns_per_rank) for s in result.stages) == pytest.approx(once + kept, rel=1e-9)
    report = render.render(result, title=f"{model} {flavor}")
    assert "Recommendation: " in report and result.reasons


@pytest.mark.unit
def test_the_command_prints_the_table(capsys):
    command.main(["--model", "llama3", "--flavor", "debugmodel", "--world", "2"])
    out = capsys.readouterr().out
    for figure in ("DMuon buffers, peak", "| DMuon-Z3 |", "critical path", "Recommendation: DMuon-Z"):
        assert figure in out


# ---- the shape tables are TorchTitan's models --------------------------------------------------------------
@pytest.mark.parametrize("model,flavor", [
    ("llama3", "debugmodel"), ("llama3", "8B"), ("llama3", "70B"), ("llama3", "405B"), ("deepseek_v3", "debugmodel"),
    ("deepseek_v3", "16B"), ("deepseek_v3", "671B"), ("qwen3", "debugmodel_moe"),
])
def test_shape_tables_are_torchtitans_models(model, flavor):
    """Weight for weight (name, shape, order, Muon target, layer, tensor-parallel dim), and each fused
    q/k/v block with the row count of TorchTitan's own (grouped) block: the figures depend on nothing else."""
    from titan_dmuon.sizing.model_shapes import from_table, registry_weights

    table, titan = from_table(model, flavor), registry_weights(model, flavor)
    assert [(w.fqn, w.shape, w.muon, w.layer, w.tp_dim) for w in table] == \
        [(w.fqn, w.shape, w.muon, w.layer, w.tp_dim) for w in titan]

    def rows(w):
        return [sum(b - a for a, b in block) for block in w.blocks] if w.blocks else None

    assert [rows(w) for w in table] == [rows(w) for w in titan]
    assert any(re.search("wqkv", w.fqn) for w in table) == any(w.blocks for w in table)


def test_the_workspace_bound_is_what_a_step_on_every_muon_weight_keeps():
    """``workspace_bytes`` (the meta device) against a ``Workspace`` after a real CPU step on the same
    weights (fused q/k/v blocks, an expert stack, two shapes that share a class): the same bytes (the
    memory table's workspace row is it per rank; ``test_persistent_equals_the_allocators_count`` holds
    the total to the allocator)."""
    from titan_dmuon.math.matrix_blocks import row_blocks
    from titan_dmuon.math.muon_update import muon_step
    from titan_dmuon.optim.workspace import Workspace

    blocks = (((0, 32),), ((32, 48),), ((48, 64),))
    weights = [Weight(fqn="wqkv", shape=(64, 32), muon=True, layer=0, blocks=blocks),
               Weight(fqn="w1", shape=(96, 32), muon=True, layer=0), Weight(fqn="w2", shape=(32, 96), muon=True, layer=0),
               Weight(fqn="experts", shape=(4, 48, 32), muon=True, layer=0),
               Weight(fqn="norm", shape=(32,), muon=False, layer=0)]
    muon = [w for w in weights if w.muon]
    params = [torch.randn(w.shape) for w in muon]
    workspace = Workspace()
    muon_step(params, [torch.randn_like(p) for p in params], [torch.zeros_like(p) for p in params],
              [w.blocks or row_blocks(w.shape[-2:]) for w in muon], lr=0.02, weight_decay=0.1, momentum=0.95,
              nesterov=True, ns_steps=5, scratch=workspace)
    assert figures.workspace_bound(weights) == workspace.nbytes() > 0
    assert figures.workspace_bytes([[(w.shape, w.blocks) for w in muon]]) == workspace.nbytes()
