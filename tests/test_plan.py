"""The ownership plan: deterministic, complete, balanced, and rank-independent."""

import pytest

from titan_dmuon.muon_math import ns_flops
from titan_dmuon.plan import MatrixSpec, build_plan


def _specs(shapes, unit_size=3):
    return [
        MatrixSpec(fqn=f"layers.{i // unit_size}.w{i}", shape=s, unit=i // unit_size, blocks=(((0, s[0]),),))
        for i, s in enumerate(shapes)
    ]


def test_every_matrix_has_exactly_one_owner_and_plan_is_deterministic():
    specs = _specs([(64, 32), (32, 64), (48, 48), (16, 8), (8, 16), (64, 64)])
    a = build_plan(specs, replicate_size=2, shard_size=2)
    b = build_plan(specs, replicate_size=2, shard_size=2)
    assert a == b and a.digest() == b.digest()
    assert sorted(e.fqn for e in a.entries) == sorted(s.fqn for s in specs)
    assert all(0 <= e.owner < 4 for e in a.entries)


def test_longest_processing_time_balances_ns_flops():
    # 8 equal matrices + 4 matrices twice as expensive on 4 ranks: LPT gives a perfect split
    specs = _specs([(64, 64)] * 4 + [(32, 64)] * 8)
    plan = build_plan(specs, replicate_size=1, shard_size=4)
    load = plan.ns_flops_per_rank
    assert max(load) == min(load)
    assert plan.imbalance == 1.0


def test_more_ranks_than_matrices_leaves_ranks_idle():
    plan = build_plan(_specs([(8, 8), (16, 8)]), replicate_size=2, shard_size=4)
    owners = [e.owner for e in plan.entries]
    assert len(set(owners)) == 2
    assert plan.ns_flops_per_rank.count(0) == 6


def test_hsdp_owner_maps_to_shard_and_replicate_index():
    plan = build_plan(_specs([(8, 8)] * 6), replicate_size=2, shard_size=3)
    for e in plan.entries:
        assert e.owner == plan.replicate_owner(e) * 3 + plan.shard_owner(e)
    # equal costs fill replicate row 0 first, so every shard index holds full weights
    assert all(n > 0 for n in plan.numel_per_shard_rank)


def test_cost_counts_row_blocks_separately():
    fused = MatrixSpec(fqn="wqkv", shape=(96, 32), unit=0, blocks=(((0, 32),), ((32, 64),), ((64, 96),)))
    plan = build_plan([fused], replicate_size=1, shard_size=1)
    assert plan.entries[0].ns_flops == 3 * ns_flops(32, 32)


@pytest.mark.parametrize("change", ["shape", "order", "mesh"])
def test_digest_changes_when_the_plan_does(change):
    specs = _specs([(8, 8), (16, 8), (8, 16)])
    base = build_plan(specs, replicate_size=1, shard_size=2).digest()
    if change == "shape":
        specs = _specs([(8, 8), (16, 8), (8, 24)])
    elif change == "order":
        specs = list(reversed(specs))
    other = build_plan(specs, replicate_size=1, shard_size=2 if change != "mesh" else 3).digest()
    assert other != base
