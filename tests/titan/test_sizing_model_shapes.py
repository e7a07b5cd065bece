"""The shape tables of ``python -m titan_dmuon.sizing`` (titan_dmuon/sizing/model_shapes.py) are TorchTitan's models,
weight for weight."""

from __future__ import annotations

import re

import pytest


@pytest.mark.parametrize(
    "model,flavor",
    [
        ("llama3", "debugmodel"),
        ("llama3", "8B"),
        ("llama3", "70B"),
        ("llama3", "405B"),
        ("deepseek_v3", "debugmodel"),
        ("deepseek_v3", "16B"),
        ("deepseek_v3", "671B"),
        ("qwen3", "debugmodel_moe"),
    ],
)
def test_shape_tables_are_torchtitans_models(model, flavor):
    """Weight for weight (name, shape, order, Muon target, layer, tensor-parallel dim), and each fused
    q/k/v block with the row count of TorchTitan's own (grouped) block: the figures depend on nothing else."""
    from titan_dmuon.sizing.model_shapes import from_table, registry_weights

    table, titan = from_table(model, flavor), registry_weights(model, flavor)
    assert [(w.fqn, w.shape, w.muon, w.layer, w.tp_dim) for w in table] == [
        (w.fqn, w.shape, w.muon, w.layer, w.tp_dim) for w in titan
    ]

    def rows(w):
        return [sum(b - a for a, b in block) for block in w.blocks] if w.blocks else None

    assert [rows(w) for w in table] == [rows(w) for w in titan]
    assert any(re.search("wqkv", w.fqn) for w in table) == any(w.blocks for w in table)
