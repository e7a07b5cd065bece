"""Mixture of experts: exact per-expert Muon against a reference where every expert slice is
its own torch.optim.Muon leaf; experts kept where FSDP2 shards them (dim 0) or dedicated.

On 2 ranks with ``ns_mode="exact"`` DMuon is bitwise the reference by construction: the gradients
the ranks reduce are the reference's per-rank slices summed ((g0 + g1) / 2 is exact in any order),
and every expert's Newton-Schulz is torch.optim.Muon's own call on the same matrix. Elsewhere
(4 ranks: sums in another order; the batched path: GEMM rounding) the tolerance is helpers.TOLERANCE,
for the reason given there.
"""

from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from tests.support.helpers import (
    TOLERANCE,
    batches,
    distribute,
    full_state,
    global_loss,
    max_diff,
    reference_train,
    toy_model,
    train,
)

STEPS = 4


def _moe_vs_reference(
    rank, world, mode, experts, routed=None, expert_sharding="auto", ns_mode="exact", ns_method="torch"
):
    data = batches(STEPS)
    model = toy_model(num_experts=experts, routed_experts=routed)
    ref, ref_losses, _ = reference_train(model, data, slices=world, ns_method=ns_method)
    setup = distribute(
        model, mode, world, expert_sharding=expert_sharding, opt_kwargs={"ns_mode": ns_mode, "ns_method": ns_method}
    )
    log = train(setup, data, rank, world)
    ns = torch.tensor([n for _, _, n in log], dtype=torch.int64)
    dist.all_reduce(ns)
    handle = setup.handle
    return {
        "diff": max_diff(full_state(setup), ref),
        "losses": global_loss([loss for loss, _, _ in log]),
        "ref_losses": ref_losses,
        "local": len(handle.local_experts),
        "dedicated_3d": sum(len(e.shape) == 3 for e in handle.plan.entries),
        "ns_per_step": ns.tolist(),
    }


def _check(results, *, local, dedicated_3d, ns_per_step, bitwise=None):
    bitwise = len(results) == 2 if bitwise is None else bitwise
    for r in results:
        if bitwise:
            # two ranks, exact mode: the reduced gradients are the reference's and every Newton-Schulz
            # call is torch.optim.Muon's own, so the weights are the reference's bit for bit
            assert r["diff"] == 0.0, r["diff"]
        else:
            assert r["diff"] < TOLERANCE, r["diff"]
        assert r["losses"] == pytest.approx(r["ref_losses"], abs=1e-4)
        assert r["local"] == local and r["dedicated_3d"] == dedicated_3d
        # Newton-Schulz once per expert matrix (and per attention/router matrix) per step, in the whole job
        assert r["ns_per_step"] == [ns_per_step] * STEPS


# 2 layers: per layer 4 attention matrices + router + 3 expert weights of E experts each
def _ns(experts, replicas=1):
    return 2 * (5 + 3 * experts * replicas)


@pytest.mark.parametrize("mode", ["z3", "z2"])
@pytest.mark.parametrize("experts", [4, 2])
def test_experts_at_least_ranks_stay_local(pool2, mode, experts):
    """E >= N: FSDP2 gives every rank whole experts; each rank updates its own."""
    _check(pool2.run(_moe_vs_reference, mode, experts), local=6, dedicated_3d=0, ns_per_step=_ns(experts))


def test_batched_experts_match_within_tolerance(pool2):
    """The default batched path (experts of one weight share a Newton-Schulz call): the reference
    within helpers.TOLERANCE, not bitwise (a batched GEMM may round differently on another CPU)."""
    results = pool2.run(_moe_vs_reference, "z3", 4, None, "auto", "batched")
    _check(results, local=6, dedicated_3d=0, ns_per_step=_ns(4), bitwise=False)


@pytest.mark.parametrize("expert_sharding", ["auto", "dedicated"])
def test_experts_take_the_newton_schulz_method(pool2, expert_sharding):
    """ns_method "gram" on experts kept on their rank ("auto": batched per rank) and dedicated to one
    owner each: the reference's experts are torch.optim.Muon leaves with the method's Newton–Schulz
    written independently (tests.support.helpers.reference_newton_schulz); the toy experts (48 x 32) run the Polar
    Express iteration, the k/v projections (16 x 32) Gram Newton–Schulz. Within TOLERANCE (the batched
    GEMMs' rounding, as test_batched_experts_match_within_tolerance)."""
    results = pool2.run(_moe_vs_reference, "z3", 4, None, expert_sharding, "batched", "gram")
    dedicated = expert_sharding == "dedicated"
    _check(results, local=0 if dedicated else 6, dedicated_3d=6 if dedicated else 0, ns_per_step=_ns(4), bitwise=False)


def test_fewer_experts_than_ranks_are_dedicated(pool4):
    """E < N: each expert weight gets one owner, NS still once per expert matrix."""
    _check(pool4.run(_moe_vs_reference, "z3", 2), local=0, dedicated_3d=6, ns_per_step=_ns(2))


def test_uneven_routing(pool2):
    """Only expert 0 of 4 gets tokens: the others get zero gradients on every rank,
    yet their weight decay and momentum advance exactly as the reference's."""
    _check(pool2.run(_moe_vs_reference, "z3", 4, 1), local=6, dedicated_3d=0, ns_per_step=_ns(4))


def test_hsdp_experts(pool4):
    """HSDP 2 x 2, E = 4 >= N = 2: experts local to each shard rank, the same on both replicas."""
    _check(pool4.run(_moe_vs_reference, "hsdp", 4), local=6, dedicated_3d=0, ns_per_step=_ns(4, replicas=2))


def test_hsdp_dedicated_experts(pool4):
    """HSDP 2 x 2 with experts dedicated: reduced to one global owner, NS once in the whole job."""
    _check(pool4.run(_moe_vs_reference, "hsdp", 4, None, "dedicated"), local=0, dedicated_3d=6, ns_per_step=_ns(4))


# ---- communication: no more than FSDP2 + AdamW on the same MoE model -------------------------------
MOE_DIMS = dict(dim=64, hidden_dim=64, n_kv_heads=4, vocab_size=128, n_layers=2, num_experts=8)


def _moe_traffic(rank, world, hsdp):
    from tests.support.measure import ledger_figures

    return ledger_figures(rank, world, "dmuon_hsdp" if hsdp else "dmuon_z3", MOE_DIMS, hsdp), ledger_figures(
        rank, world, "fsdp_adamw_z3", MOE_DIMS, hsdp
    )


@pytest.mark.parametrize("world", [2, 4])
def test_moe_traffic_no_more_than_fsdp2_adamw(pool2, pool4, world):
    """Local experts move exactly what FSDP2 moves for them; the dedicated weights move FSDP2's
    volume; Z3 keeps the last layer (one layer's re-broadcast less)."""
    pool = {2: pool2, 4: pool4}[world]
    for dmuon, fsdp in pool.run(_moe_traffic, False):
        assert dmuon["total"] == fsdp["total"] - Fraction(world - 1, world) * dmuon["kept"]


def test_moe_hsdp_traffic(pool4):
    results = pool4.run(_moe_traffic, True)
    dmuon = sum(d["total"] for d, _ in results) / 4
    fsdp = sum(f["total"] for _, f in results) / 4
    assert dmuon == fsdp - Fraction(1, 2) * results[0][0]["kept"]


def _fake_moe(rank0, _world, n, expert_sharding):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tests.support.measure import ledger_figures

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    try:
        dims = {**MOE_DIMS, "n_layers": 1}
        return (
            ledger_figures(0, n, "dmuon_z3", dims, expert_sharding=expert_sharding),
            ledger_figures(0, n, "fsdp_adamw_z3", dims),
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("n, expert_sharding", [(8, "auto"), (64, "auto")])
def test_moe_traffic_at_scale(solo, n, expert_sharding):
    """N = 8: E = 8 experts stay local (one per rank). N = 64 > E: experts dedicated; FSDP2 pads
    its dim-0 shards of the 8-expert weights to 64 rows, DMuon moves no padding."""
    dmuon, fsdp = solo.run(_fake_moe, n, expert_sharding)[0]
    if n <= MOE_DIMS["num_experts"]:
        assert dmuon["total"] == fsdp["total"] - Fraction(n - 1, n) * dmuon["kept"]
    else:
        assert dmuon["total"] < fsdp["total"]
