"""The ownership plan: deterministic, complete, balanced, and rank-independent."""

import dataclasses
import random

import pytest

from tests.support.plan_reference import reference_build_plan
from titan_dmuon.math.ns_methods import ns_flops
from titan_dmuon.plan.ownership import build_plan
from titan_dmuon.plan.specs import MatrixSpec


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


# ---- balance on realistic shape mixes -------------------------------------------------------
def _llama_specs(layers, dim, hidden, kv_dim):
    """TorchTitan llama3 block shapes: a fused wqkv (NS per q, k, v block), wo, w1, w2, w3."""
    specs = []
    for layer in range(layers):
        qkv = (((0, dim),), ((dim, dim + kv_dim),), ((dim + kv_dim, dim + 2 * kv_dim),))
        shapes = {
            "wqkv": ((dim + 2 * kv_dim, dim), qkv),
            "wo": ((dim, dim), None),
            "w1": ((hidden, dim), None),
            "w2": ((dim, hidden), None),
            "w3": ((hidden, dim), None),
        }
        for name, (shape, blocks) in shapes.items():
            specs.append(
                MatrixSpec(fqn=f"layers.{layer}.{name}", shape=shape, unit=layer, blocks=blocks or (((0, shape[0]),),))
            )
    return specs


def _toy_specs():
    from titan_dmuon.testing.toy_model import ToyConfig, ToyTransformer, muon_targets

    model = ToyTransformer(ToyConfig())
    names = {id(p): n for n, p in model.named_parameters()}
    return [
        MatrixSpec(
            fqn=names[id(p)], shape=tuple(p.shape), unit=int(names[id(p)].split(".")[1]), blocks=(((0, p.shape[0]),),)
        )
        for p in muon_targets(model)
    ]


@pytest.mark.parametrize(
    "specs, ranks, bound",
    [
        (_toy_specs(), 4, 1.05),  # round-robin assignment: 1.21
        (_llama_specs(32, 4096, 14336, 1024), 64, 1.07),  # llama3 8B; round-robin: 1.26
        (_llama_specs(80, 8192, 28672, 1024), 64, 1.02),  # llama3 70B
    ],
    ids=["toy@4", "llama3-8B@64", "llama3-70B@64"],
)
def test_owner_balance_on_realistic_shapes(specs, ranks, bound):
    """Longest-processing-time first by NS FLOPs: the busiest rank's Newton–Schulz work stays
    within a few percent of the mean (it is on every step's critical path)."""
    plan = build_plan(specs, replicate_size=1, shard_size=ranks)
    assert plan.imbalance <= bound, plan.imbalance


def test_experts_kept_on_their_rank_count_toward_balance():
    """Experts FSDP2 keeps on a rank (initial load) are NS work too: dedicated matrices go to the
    ranks with fewer of them, and the balance figure includes them."""
    c = ns_flops(64, 64)
    plan = build_plan(_specs([(64, 64)] * 4), replicate_size=1, shard_size=3, initial_load=[2 * c, 0, 0])
    assert sorted(e.owner for e in plan.entries) == [1, 1, 2, 2]  # rank 0 is busy with its experts
    assert plan.ns_flops_per_rank == [2 * c] * 3 and plan.imbalance == 1.0


def test_tensor_parallel_homes_balance_each_layer_over_the_tp_ranks():
    """Each TP matrix's NS home: per layer the largest first to the least-loaded tp rank (load carried
    over layers), deterministic, in the digest; the cost is the full matrix's."""
    specs = [
        MatrixSpec(
            fqn=f"l{u}.w{i}", shape=(8 * (i + 1), 16), unit=u, blocks=(((0, 16 * (i + 1)),),), tp_dim=0, tp_size=2
        )
        for u in range(2)
        for i in range(4)
    ]
    plan = build_plan(specs, replicate_size=1, shard_size=1)
    assert plan == build_plan(specs, replicate_size=1, shard_size=1)
    assert specs[0].full_shape == (16, 16) and plan.entries[0].ns_flops == ns_flops(16, 16)
    for unit in range(2):
        homes = [e.tp_homes[0] for e in plan.entries if e.unit == unit]
        assert sorted(set(homes)) == [0, 1]
    load = [0, 0]
    for e in plan.entries:
        load[e.tp_homes[0]] += e.ns_flops
    assert max(load) / (sum(load) / 2) < 1.2
    moved = build_plan([dataclasses.replace(s, tp_size=4) for s in specs], replicate_size=1, shard_size=1)
    assert moved.digest() != plan.digest()


def test_tensor_parallel_homes_of_experts_and_replicated_weights():
    """Under TP each expert is one matrix of the exchange: a dedicated stack's experts get homes of their
    own, and so do the experts FSDP2 keeps on each data-parallel rank (ceil(E/N) whole experts from
    rank s * ceil(E/N), in every replica), balanced in that rank's TP group with the matrices it owns;
    a replicated weight (every tp rank holds it) has one home. All of it is in the digest."""
    experts = MatrixSpec(fqn="l0.experts", shape=(4, 8, 16), unit=0, blocks=(((0, 16),),), tp_dim=1, tp_size=2)
    router = MatrixSpec(fqn="l0.router", shape=(4, 16), unit=0, blocks=(((0, 4),),), tp_dim=None, tp_size=2)
    dense = MatrixSpec(fqn="l0.wo", shape=(16, 8), unit=0, blocks=(((0, 16),),), tp_dim=1, tp_size=2)
    kept = MatrixSpec(fqn="l1.experts", shape=(3, 8, 16), unit=1, blocks=(((0, 16),),), tp_dim=1, tp_size=2)
    plan = build_plan([experts, router, dense], replicate_size=2, shard_size=2, local_tp_specs=[kept])
    by_name = {e.fqn: e for e in plan.entries}
    assert len(by_name["l0.experts"].tp_homes) == 4 and set(by_name["l0.experts"].tp_homes) == {0, 1}
    assert by_name["l0.router"].tp_replicated and len(by_name["l0.router"].tp_homes) == 1
    # 3 experts over 2 shard indices: 2 on index 0, 1 on index 1, on both replicas (global ranks r * 2 + s)
    assert [(x.rank, x.first, len(x.tp_homes)) for x in plan.local_tp_experts] == [
        (0, 0, 2),
        (1, 2, 1),
        (2, 0, 2),
        (3, 2, 1),
    ]
    assert set(plan.local_tp_experts_of(0)[0].tp_homes) == {0, 1}  # one expert per TP rank
    assert plan.local_tp_numel == 2 * 3 * 8 * 16  # each replica's experts
    assert plan.digest() != build_plan([experts, router, dense], replicate_size=2, shard_size=2).digest()
    moved = dataclasses.replace(kept, shape=(4, 8, 16))
    assert (
        plan.digest()
        != build_plan([experts, router, dense], replicate_size=2, shard_size=2, local_tp_specs=[moved]).digest()
    )


# ---- the heap assigns as the scan of every rank did ----------------------------------------------
def _random_specs(rng: random.Random) -> list[MatrixSpec]:
    """Few distinct costs, so most weights tie: (8, 16) and (16, 8) cost the same, a (16, 16) split in
    two blocks twice a (8, 16); stacks of experts; some tensor-parallel shards (tp_dim 0 or 1)."""
    specs = []
    for i in range(rng.randrange(0, 40)):
        rows, cols = rng.choice([(8, 16), (16, 8), (16, 16), (8, 8), (32, 16)])
        blocks = (((0, rows),),)
        if rows == 16 and rng.random() < 0.3:
            blocks = (((0, 8),), ((8, 16),))
        shape, tp_dim, tp_size = (rows, cols), None, 1
        kind = rng.random()
        if kind < 0.2:
            shape = (rng.choice([2, 4]), rows, cols)
        elif kind < 0.4:
            tp_dim, tp_size = rng.choice([0, 1]), rng.choice([2, 4])
            shape = (rows // tp_size, cols) if tp_dim == 0 else (rows, cols // tp_size)
        specs.append(
            MatrixSpec(
                fqn=f"layers.{i // 5}.w{i}",
                shape=shape,
                unit=rng.randrange(4),
                blocks=blocks,
                tp_dim=tp_dim,
                tp_size=tp_size,
            )
        )
    return specs


@pytest.mark.parametrize("seed", range(4))
def test_heap_assignment_equals_the_scan_of_every_rank(seed):
    """build_plan takes the least-loaded rank off a heap of (load, rank) instead of scanning every rank per
    weight (O(M x R): 33 s for 46,848 experts on 8192 ranks): the plans must be identical, ties included
    (lowest load, then lowest rank; weights by cost, then position), with experts' initial load, on HSDP
    meshes and with tensor-parallel homes. Reference: the old scan, written independently."""
    rng = random.Random(seed)
    unit = ns_flops(8, 8)
    for _ in range(50):
        specs = _random_specs(rng)
        replicate_size, shard_size = rng.choice([1, 1, 2, 3]), rng.randrange(1, 10)
        world = replicate_size * shard_size
        initial_load = rng.choice(
            [None, [rng.choice([0, 0, unit, 2 * unit, rng.randrange(10 * unit)]) for _ in range(world)]]
        )
        plan = build_plan(specs, replicate_size=replicate_size, shard_size=shard_size, initial_load=initial_load)
        expected = reference_build_plan(
            specs, replicate_size=replicate_size, shard_size=shard_size, initial_load=initial_load
        )
        assert [e.owner for e in plan.entries] == [e.owner for e in expected.entries]
        assert plan == expected and plan.digest() == expected.digest()


@pytest.mark.parametrize("replicate_size, shard_size", [(1, 1024), (2, 512), (1, 100)])
def test_heap_assignment_equals_the_scan_at_scale(replicate_size, shard_size):
    """The same on llama3 405B's shapes (fewer weights than ranks: every rank but the busiest idle or
    nearly) and on experts that all cost the same (every pick a tie)."""
    experts = [
        MatrixSpec(fqn=f"layers.{layer}.experts.{name}.{e}", shape=shape, unit=layer, blocks=(((0, shape[0]),),))
        for layer in range(4)
        for name, shape in (("w1", (64, 112)), ("w2", (112, 64)), ("w3", (64, 112)))
        for e in range(64)
    ]
    for specs in (_llama_specs(126, 16384, 53248, 1024), experts):
        plan = build_plan(specs, replicate_size=replicate_size, shard_size=shard_size)
        assert plan == reference_build_plan(specs, replicate_size=replicate_size, shard_size=shard_size)
