"""Owner groups on real process groups (gloo): Newton–Schulz of one matrix split over the ranks.

The bound is ``tests/test_group_math.py``'s (the group's distance from the exact-arithmetic iteration
within GROUP_RATIO of the one-owner's, plus each evaluation's kernel rounding); here the all-reduce is
gloo's, whose order of summation is its own.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from benchmarks.ns_deviation import scale_ulps
from tests.test_group_math import BATCHED_ULPS, GROUP_RATIO, exact_iteration
from titan_dmuon.group_math import block_bounds, group_newton_schulz
from titan_dmuon.muon_math import NS_METHODS, newton_schulz

SHAPES = [(64, 64), (96, 32), (24, 500)]


def _member_blocks(rank: int, world: int, ns_method: str) -> list[torch.Tensor]:
    """This rank's block of each test matrix's group Newton–Schulz, the sums by ``dist.all_reduce``."""
    out = []
    for shape in SHAPES:
        torch.manual_seed(7)
        matrices = torch.randn(2, *shape)
        tall = shape[0] > shape[1]
        lo, hi = block_bounds(max(shape), world)[rank : rank + 2]
        block = matrices[:, lo:hi] if tall else matrices[:, :, lo:hi]
        out.append(group_newton_schulz(block, shape=shape, group_size=world, ns_method=ns_method,
                                       all_reduce=lambda t: dist.all_reduce(t)))
    return out


@pytest.mark.parametrize("ns_method", NS_METHODS)
def test_group_newton_schulz_on_gloo(pool2, ns_method):
    per_rank = pool2.run(_member_blocks, ns_method)
    for i, shape in enumerate(SHAPES):
        torch.manual_seed(7)
        matrices = torch.randn(2, *shape)
        group = torch.cat([blocks[i] for blocks in per_rank], dim=1 if shape[0] > shape[1] else 2).double()
        one_owner = newton_schulz(matrices, ns_method=ns_method).double()
        exact = exact_iteration(matrices, ns_method)
        for j in range(2):
            allowed = GROUP_RATIO * scale_ulps(one_owner[j] - exact[j], exact[j]) + 2 * BATCHED_ULPS
            assert scale_ulps(group[j] - exact[j], exact[j]) <= allowed, (shape, j)


# ---- the runtime: a model with one dominant matrix, its NS and storage over an owner group -----------------
from fractions import Fraction  # noqa: E402

from torch import nn  # noqa: E402

from tests.helpers import (  # noqa: E402
    ADAMW,
    TOLERANCE,
    batches,
    distribute,
    full_state,
    max_diff,
    reference_train,
    train,
)
from titan_dmuon.group_plan import GroupOptions  # noqa: E402

# Rates that make a member's all-reduces cheap next to its FLOPs on these tiny matrices (at an H200's
# rates a 32-wide Gram matrix's all-reduce outweighs its Newton–Schulz, and the plan keeps one owner).
TINY_GROUPS = GroupOptions(ns_tflops=1e-3)
STEPS = 4
# The group's Newton–Schulz may be GROUP_RATIO times as far from exact arithmetic as the one owner's, on
# top of the one owner's own distance (tests/test_group_math.py): the update's deviation from the
# reference grows by at most GROUP_RATIO + 1 times what TOLERANCE allows one owner.
GROUP_TOLERANCE = (GROUP_RATIO + 1) * TOLERANCE
# AdamW's first steps are nearly sign(g) / sqrt(1 - beta2^t): a weight whose gradient is near 0 moves by up to
# 2 lr on a last-bit change of it (the group's update changes the next gradients by more than the last bit).
# A larger eps keeps AdamW's update Lipschitz in its gradient, for DMuon and the reference alike.
ADAMW_EPS = {"adamw_eps": 1e-4}


class DominantBlock(nn.Module):
    """One layer: three small matrices, or one matrix whose Newton–Schulz dominates the job's: tall
    (its group keeps row blocks) or wide (column blocks, which gathers put in place from a staging area)."""

    def __init__(self, dim: int, long: int | None, tall: bool) -> None:
        super().__init__()
        self.dim, self.tall = dim, tall
        if long is None:
            self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        else:
            self.big = nn.Linear(dim, long, bias=False) if tall else nn.Linear(long, dim, bias=False)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        h = self.norm(x)
        if not hasattr(self, "big"):
            return x + self.wq(h) * torch.sigmoid(self.wk(h)) + self.wv(h)
        if self.tall:
            up = self.big(h)
            return x + torch.tanh(up).view(*up.shape[:-1], -1, self.dim).mean(-2)
        repeats = self.big.in_features // (2 * self.dim)
        return x + self.big(torch.cat([h, torch.tanh(h)], -1).repeat_interleave(repeats, -1))


class DominantModel(nn.Module):
    def __init__(self, *, dim: int = 32, long: int = 2048, tall: bool = True, vocab: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([DominantBlock(dim, None, tall), DominantBlock(dim, long, tall)])
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def dominant_targets(model: DominantModel) -> list[nn.Parameter]:
    return [p for layer in model.layers for name, p in layer.named_parameters() if name.endswith("weight")
            and p.ndim == 2]


def dominant_model(seed: int = 0, tall: bool = True) -> DominantModel:
    torch.manual_seed(seed)
    return DominantModel(tall=tall)


def _train_groups(rank, world, mode, groups, tall=True):
    data = batches(STEPS)
    model = dominant_model(tall=tall)
    setup = distribute(model, mode, world, targets_fn=dominant_targets, owner_groups=groups, opt_kwargs=ADAMW_EPS)
    train(setup, data, rank, world)
    plan = setup.handle.plan
    big = next(e for e in plan.entries if e.fqn.endswith("big.weight"))
    return {"state": full_state(setup), "imbalance": plan.imbalance, "held": plan.numel_per_shard_rank,
            "group": None if big.group is None else big.group.size, "comm": setup.handle.pop_comm_stats()}


def _max_over_mean(values):
    return max(values) / (sum(values) / len(values))


@pytest.mark.parametrize("mode, tall", [("z2", True), ("z3", False), ("hsdp", True)])
def test_a_dominant_matrix_over_an_owner_group_trains_as_torch_muon(pool4, mode, tall):
    """4 ranks (HSDP: 2 x 2): the dominant matrix's NS and storage split over its group (1-D: NS FLOPs and
    dedicated elements max/mean <= 1.3; > 3 with one owner on 4 ranks), and the weights after a few steps
    within GROUP_TOLERANCE of single-process torch.optim.Muon + AdamW and of the one-owner DMuon."""
    grouped = pool4.run(_train_groups, mode, TINY_GROUPS, tall)[0]
    alone = pool4.run(_train_groups, mode, None, tall)[0]
    assert alone["group"] is None and grouped["group"] is not None
    if mode != "hsdp":  # (HSDP 2 x 2: a group spans the 2 shard ranks of one row; the other row idles in NS)
        assert alone["imbalance"] > 3 and _max_over_mean(alone["held"]) > 3
        assert grouped["imbalance"] <= 1.3 and _max_over_mean(grouped["held"]) <= 1.3
    model = dominant_model(tall=tall)
    reference, _, _ = reference_train(model, batches(STEPS), targets_fn=dominant_targets,
                                      adamw={**ADAMW, **ADAMW_EPS}, slices=4 if mode == "hsdp" else 1)
    assert max_diff(alone["state"], reference) <= TOLERANCE
    assert max_diff(grouped["state"], reference) <= GROUP_TOLERANCE
    assert max_diff(grouped["state"], alone["state"]) <= GROUP_TOLERANCE


def _ledger_of_groups(rank, world, mode):
    """DMuon's elements per step on this rank (2 steps recorded after 2 warm-up steps), by label."""
    from titan_dmuon import CommLedger
    from titan_dmuon.cost_model import design_elements_per_rank, owner_group_elements_per_rank
    from titan_dmuon.runtime import CommLabel

    data = batches(4)
    setup = distribute(dominant_model(), mode, world, targets_fn=dominant_targets, owner_groups=TINY_GROUPS,
                       opt_kwargs=ADAMW_EPS)
    train(setup, data[:2], rank, world)
    ledger = CommLedger()
    with ledger:
        train(setup, data[2:], rank, world)
    half = Fraction(1, 2)
    sends = {r.kind for r in ledger.select(source=CommLabel.GROUP_GRAM)}
    return {"dmuon": ledger.elements(source=CommLabel.DMUON) * half,
            "gram": ledger.elements(source=CommLabel.GROUP_GRAM) * half, "kinds": sends,
            "design": design_elements_per_rank(setup.handle),
            "design_gram": owner_group_elements_per_rank(setup.handle.plan)}


@pytest.mark.parametrize("mode", ["z3", "hsdp"])
def test_owner_groups_move_what_the_design_says(pool4, mode):
    """Counted by the CommLedger and averaged over the ranks: DMuon's traffic per step is
    ``design_elements_per_rank`` (forward broadcasts and backward reduces as one owner's, plus the
    groups' Gram and norm sums: ``owner_group_elements_per_rank``); the groups' sums go as point-to-point
    sends on the shard group (no process group of their own)."""
    results = pool4.run(_ledger_of_groups, mode)
    mean = {key: sum((r[key] for r in results), Fraction(0)) / len(results) for key in ("dmuon", "gram")}
    assert all(r["design"] == results[0]["design"] for r in results)
    assert results[0]["design_gram"] > 0 and mean["gram"] == results[0]["design_gram"]
    assert mean["dmuon"] == results[0]["design"]
    assert all(r["kinds"] <= {"send"} for r in results)
