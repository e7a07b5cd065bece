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
