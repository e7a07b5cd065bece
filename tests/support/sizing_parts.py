"""The tiny models whose sizes tests/unit/test_sizing.py and tests/distributed/test_sizing_memory.py compare."""

from __future__ import annotations

from titan_dmuon.sizing.records import Layout, Weight

DIMS = {  # tiny models, uneven on purpose: 3 layers over 2 or 4 owners, rows that 4 ranks do not divide
    "dense": dict(dim=64, n_layers=3, n_heads=8, n_kv_heads=4, hidden_dim=200, vocab_size=1002),
    "moe": dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48, vocab_size=64, num_experts=4),
}


def toy_weights(dims: dict) -> list[Weight]:
    """The toy transformer's weights as the tool takes them (its Muon targets: ``muon_targets``)."""
    from tests.support.helpers import toy_model
    from titan_dmuon.testing.toy_model import muon_targets

    model = toy_model(**dims)
    targets = {id(p) for p in muon_targets(model)}
    return [
        Weight(
            fqn=name,
            shape=tuple(p.shape),
            muon=id(p) in targets,
            layer=int(name.split(".")[1]) if name.startswith("layers.") else None,
        )
        for name, p in model.named_parameters()
    ]


def layout_of(mode: str, world: int) -> Layout:
    return Layout(replicate=2, shard=world // 2) if mode == "hsdp" else Layout(shard=world)
