"""What the owner groups' tests share: the bounds of a group's Newton–Schulz against the exact-arithmetic iteration
(tests/unit/test_group_math.py, tests/distributed/test_owner_groups.py) and the tiny models whose Muon weights
dominate, so that groups form (tests/distributed/test_owner_groups.py, tests/titan/test_owner_groups_checkpoint.py)."""

from __future__ import annotations

import torch
from torch import nn

from tests.support.helpers import TOLERANCE
from titan_dmuon.math.group_newton_schulz import GRAM_ROUNDINGS
from titan_dmuon.math.ns_methods import ns_input_scale, ns_schedule
from titan_dmuon.plan.owner_groups import GroupOptions

NS_STEPS = 5  # the Newton–Schulz iterations the group tests evaluate
BATCHED_ULPS = 4.0  # as test_muon_math.py: one evaluation's GEMM-kernel rounding, bf16 ulps at the output's scale
GROUP_RATIO = (GRAM_ROUNDINGS + 2) / 3

STEPS = 4  # training steps of the owner-group jobs
# The group's Newton–Schulz may be GROUP_RATIO times as far from exact arithmetic as the one owner's, on
# top of the one owner's own distance (tests/unit/test_group_math.py): the update's deviation from the
# reference grows by at most GROUP_RATIO + 1 times what TOLERANCE allows one owner.
GROUP_TOLERANCE = (GROUP_RATIO + 1) * TOLERANCE


def exact_iteration(matrices: torch.Tensor, ns_method: str) -> torch.Tensor:
    """The method's polynomials in float64 (no rounding to speak of): what both evaluations approximate
    ("gram" computes "polar_express"'s polynomials)."""
    x = matrices.double()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.flatten(1).norm(dim=1) * ns_input_scale(ns_method))[:, None, None]
    for a, b, c in ns_schedule(ns_method, NS_STEPS):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


# Rates that make a member's all-reduces cheap next to its FLOPs on these tiny matrices (at an H200's
# rates a 32-wide Gram matrix's all-reduce outweighs its Newton–Schulz, and the plan keeps one owner);
# nodes of 2 ranks, so that a group of 4 spans two "nodes" and sums on two rings.
# Rates that make a member's all-reduces cheap next to its FLOPs on these tiny matrices (at an H200's
# rates a 32-wide Gram matrix's all-reduce outweighs its Newton–Schulz, and the plan keeps one owner), every
# figure given (none measured: the plan is the same on every machine); nodes of 2 ranks, so that a group
# of 4 spans two "nodes". An all-reduce's latency of 200 us keeps the 32 x 32 matrices (1 ms of NS at these
# rates) whole.
TINY_GROUPS = GroupOptions(
    ns_tflops=1e-3, node_size=2, latency_us=200.0, nic_latency_us=200.0, intra_node_gbps=360.0, nic_gbps=45.0
)


# AdamW's first steps are nearly sign(g) / sqrt(1 - beta2^t): a weight whose gradient is near 0 moves by up to
# 2 lr on a last-bit change of it (the group's update changes the next gradients by more than the last bit).
# A larger eps keeps AdamW's update Lipschitz in its gradient, for DMuon and the reference alike.
ADAMW_EPS = {"adamw_eps": 1e-4}


class DominantBlock(nn.Module):
    """One layer: three small matrices, or one matrix whose Newton–Schulz dominates the job's: tall
    (its group keeps row blocks) or wide (column blocks: the weight laid out column-major in the packed buffer)."""

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
    return [
        p for layer in model.layers for name, p in layer.named_parameters() if name.endswith("weight") and p.ndim == 2
    ]


def dominant_model(seed: int = 0, tall: bool = True) -> DominantModel:
    torch.manual_seed(seed)
    return DominantModel(tall=tall)
