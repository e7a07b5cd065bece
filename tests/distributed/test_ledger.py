"""Communication per step, counted from the collectives actually issued, against theory.

Units (design-facts.md): elements per rank, (n-1)/n * S for broadcast, reduce,
all-gather, reduce-scatter; 2(n-1)/n * S for all-reduce. Model dims are
multiples of N so FSDP2 shards need no padding and totals compare exactly.
"""

from fractions import Fraction

import pytest
import torch.distributed as dist

from tests.support.helpers import batches, distribute, toy_model, train
from tests.support.measure import ledger_figures
from titan_dmuon import CommLedger, baseline_elements_per_rank
from titan_dmuon.runtime import CommLabel
from titan_dmuon.testing.toy_model import muon_targets

SMALL = dict(dim=32, hidden_dim=48, n_kv_heads=2, vocab_size=64, n_layers=2)  # divisible by N = 2, 4
WIDE = dict(dim=64, hidden_dim=128, n_kv_heads=4, vocab_size=128, n_layers=1)  # divisible by N up to 64


def _sizes(dims):
    model = toy_model(**dims)
    p_m = sum(p.numel() for p in muon_targets(model))
    return p_m, sum(p.numel() for p in model.parameters()) - p_m


def _mean(results, key):
    return sum((r[key] for r in results), Fraction(0)) / len(results)


def _check_one_d(results, n, dims):
    """Every 1-D configuration against its theory (results: one dict per measured rank)."""
    p_m, p_other = _sizes(dims)
    fsdp = {"z2": 2, "z3": 3}
    r = {c: res for c, res in results.items()}
    step = Fraction(n - 1, n)
    for mode in ("z2", "z3"):
        # FSDP2 + AdamW on everything: AG (+ AG again in Z3) + RS
        assert r[f"fsdp_adamw_{mode}"]["total"] == fsdp[mode] * step * (p_m + p_other)
        # naive FSDP2 + Muon: the same plus one all-gather of P_M inside step()
        naive = r[f"naive_{mode}"]
        assert naive["total"] - fsdp[mode] * step * p_other == baseline_elements_per_rank(
            f"naive_fsdp_{mode}", shard_size=n, numel=p_m
        )
        assert naive["total"] - fsdp[mode] * step * p_other == (fsdp[mode] + 1) * step * p_m
        assert naive["step"] == step * p_m
        # DMuon: its own collectives hit the theory; FSDP2 handles the rest. Z3 keeps the last
        # layer from forward to backward: one layer's re-broadcast less than FSDP2-Z3 + AdamW.
        dm = r[f"dmuon_{mode}"]
        kept = dm["kept"]
        assert kept == (p_m // dims["n_layers"] if mode == "z3" else 0)
        assert dm["dmuon"] == dm["design"] == fsdp[mode] * step * p_m - step * kept
        assert dm["other"] == fsdp[mode] * step * p_other
        assert dm["total"] == r[f"fsdp_adamw_{mode}"]["total"] - step * kept
        # the update needs no collective: step() only launches the next forward's first broadcast early
        assert dm["step_kinds"] == [(CommLabel.FORWARD_BROADCAST, "broadcast")]
        assert dm["step"] == step * dm["first_unit"]
    ddp = r["dmuon_ddp"]
    assert (
        ddp["dmuon"]
        == ddp["design"]
        == 2 * step * p_m
        == baseline_elements_per_rank("ddp_muon", shard_size=n, numel=p_m)
    )
    assert ddp["other"] == 2 * step * p_other  # DDP's all-reduce of the rest
    assert ddp["total"] == r["ddp_muon_z2"]["total"] == 2 * step * (p_m + p_other)
    assert ddp["step"] == step * ddp["first_unit"]


ONE_D = ["fsdp_adamw_z2", "fsdp_adamw_z3", "naive_z2", "naive_z3", "dmuon_z2", "dmuon_z3", "dmuon_ddp", "ddp_muon_z2"]


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_one_d_matches_theory(world, pool2, pool4):
    pool = {2: pool2, 4: pool4}[world]
    results = {}
    for config in ONE_D:
        per_rank = pool.run(ledger_figures, config, SMALL)
        assert all(r == per_rank[0] for r in per_rank)  # 1-D: every rank moves the same amount
        results[config] = per_rank[0]
    _check_one_d(results, world, SMALL)


def _check_hsdp(dmuon_results, fsdp_results, r, n, dims):
    p_m, p_other = _sizes(dims)
    kept, first = dmuon_results[0]["kept"], dmuon_results[0]["first_unit"]
    assert kept == p_m // dims["n_layers"]
    theory = 3 * Fraction(n - 1, n) * p_m - Fraction(n - 1, n) * kept + 2 * Fraction(r - 1, r) * Fraction(p_m, n)
    assert _mean(dmuon_results, "dmuon") == theory
    assert all(res["design"] == theory for res in dmuon_results)
    # DMuon-HSDP costs what FSDP2-HSDP + AdamW costs (averaged over ranks), less the kept layer's re-broadcast
    assert _mean(dmuon_results, "total") == _mean(fsdp_results, "total") - Fraction(n - 1, n) * kept
    # step() launches the post-step broadcasts to replicate peers and the next forward's first broadcast
    for res in dmuon_results:
        assert {k for k in res["step_kinds"]} <= {
            (CommLabel.REPLICATE_BROADCAST, "broadcast"),
            (CommLabel.FORWARD_BROADCAST, "broadcast"),
        }
    assert _mean(dmuon_results, "step") == Fraction(r - 1, r) * Fraction(p_m, n) + Fraction(n - 1, n) * first


def test_gloo_hsdp_matches_theory(pool4):
    dm = pool4.run(ledger_figures, "dmuon_hsdp", SMALL, True)
    fsdp = pool4.run(ledger_figures, "fsdp_adamw_z3", SMALL, True)
    _check_hsdp(dm, fsdp, 2, 2, SMALL)


def test_mean_over_ranks_is_a_collective_average(pool4):
    """CommLedger.mean_over_ranks agrees with averaging every rank's own count."""
    results = pool4.run(_mean_over_ranks_case)
    local = [r[0] for r in results]
    assert all(r[1] == sum(local, Fraction(0)) / 4 for r in results)
    assert len(set(local)) > 1  # HSDP's replicate stage involves owners only: ranks differ


def _mean_over_ranks_case(rank, world):
    model = toy_model(**{**SMALL, "n_layers": 1})  # 7 matrices: shard owners hold unequal shares
    setup = distribute(model, "hsdp", world)
    data = batches(1, global_batch=world)
    with CommLedger() as ledger:
        train(setup, data, rank, world)
    return ledger.elements(), ledger.mean_over_ranks(dist.group.WORLD)


# ---- the fake process group: any N in one process ---------------------------------
def _fake(rank0, _world, config, n, r):
    """Simulate the ranks of an R x N job one at a time on the fake process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    results = []
    for rank in range(r * n if r > 1 else 1):  # 1-D ranks are symmetric: one suffices
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=r * n)
        try:
            results.append(ledger_figures(rank, r * n, config, WIDE, hsdp=r > 1))
        finally:
            dist.destroy_process_group()
    return results


@pytest.mark.parametrize("n", [8, 16, 64])
def test_fake_pg_one_d_matches_theory(solo, n):
    results = {config: solo.run(_fake, config, n, 1)[0][0] for config in ONE_D}
    _check_one_d(results, n, WIDE)


@pytest.mark.parametrize("n", [8, 16, 64])
def test_fake_pg_hsdp_matches_theory(solo, n):
    dm = solo.run(_fake, "dmuon_hsdp", n, 2)[0]
    fsdp = solo.run(_fake, "fsdp_adamw_z3", n, 2)[0]
    _check_hsdp(dm, fsdp, 2, n, WIDE)
