"""Newton–Schulz on an owner group (``titan_dmuon.math.group_newton_schulz``) against the one-owner iteration.

The bound, in two parts (``docs/owner-groups.md``):

* The Gram matrix (``test_the_summed_gram_matrix_is_within_its_bound``): the group's summed Gram matrix
  differs from the one the single owner computes by at most (3 u + (k - 1 + 2 l) 2^-24) sqrt(A_jj A_ll)
  per entry (u = 2^-8, bf16; 2^-24, the fp32 sums of the k parts and of each GEMM's l products), derived
  in ``math/group_newton_schulz.py``'s docstring, for every k. Every other operation of a step is the one-owner's.
* The update (``test_the_group_is_as_accurate_as_one_owner``): bf16 Newton–Schulz has no useful
  a-priori forward bound (a perturbation along a small singular value grows by up to the product of the
  steps' linear coefficients, ~480 for torch's quintic), for its own round-off as for the group's. So the
  group is held to the one-owner's own accuracy on each input: its distance from the exact-arithmetic
  iteration (float64, written here) is at most GROUP_RATIO times the one-owner's, plus 2 BATCHED_ULPS
  (each of the two evaluations' kernel rounding, as test_muon_math.py allows one), in bf16 ulps at the
  output's scale. GROUP_RATIO is the ratio of the round-offs a step adds: the group's Gram matrix
  (GRAM_ROUNDINGS u), the polynomial or its reassociated product, and X (u each), against the
  one-owner's three (u each). Normalising by a member's own norm (the norm not summed) is tens of
  ulps beyond it (``test_the_bound_catches_a_norm_left_unsummed``).

Members are simulated in one process, one thread each, with a callable that sums their parts in member
order (so the result does not depend on the threads' timing); ``tests/distributed/test_owner_groups.py`` runs the
same on gloo.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.ns_deviation import scale_ulps
from tests.support.owner_groups_parts import BATCHED_ULPS, GROUP_RATIO, NS_STEPS, exact_iteration
from titan_dmuon.math import group_newton_schulz as group_math
from titan_dmuon.math.group_newton_schulz import (
    GRAM_ROUNDINGS,
    block_bounds,
    gram_all_reduces,
    group_newton_schulz,
    group_ns_flops,
    pack_symmetric,
    packed_numel,
    reassociates,
    summed_gram,
    unpack_symmetric,
)
from titan_dmuon.math.ns_methods import NS_METHODS, newton_schulz, ns_flops

U = 2.0**-8  # bf16 unit round-off


def simulate_group(
    matrices: torch.Tensor, group_size: int, *, ns_method: str = "torch", normalise=None, calls: list | None = None
) -> torch.Tensor:
    """``group_newton_schulz`` of ``matrices`` (B, rows, cols) by ``group_size`` members, one thread each,
    reassembled. The all-reduce sums the members' parts in member order and gives every member the same
    sum; ``calls`` collects each all-reduce's numel (member 0's)."""
    rows, cols = matrices.shape[-2:]
    tall = rows > cols
    bounds = block_bounds(max(rows, cols), group_size)
    parts: list = [None] * group_size
    barrier = threading.Barrier(group_size)
    results: list = [None] * group_size
    failures: list = []

    def member(i: int) -> None:
        def all_reduce(tensor: torch.Tensor) -> None:
            parts[i] = tensor.clone()
            if i == 0 and calls is not None:
                calls.append(tensor.numel())
            barrier.wait()
            total = parts[0].clone()
            for part in parts[1:]:
                total += part
            barrier.wait()
            tensor.copy_(total)

        lo, hi = bounds[i], bounds[i + 1]
        block = matrices[:, lo:hi] if tall else matrices[:, :, lo:hi]
        try:
            results[i] = group_newton_schulz(
                block,
                shape=(rows, cols),
                group_size=group_size,
                ns_method=ns_method,
                all_reduce=all_reduce if normalise is None else normalise(all_reduce),
            )
        except BaseException as e:  # (a failing member must not leave the others at the barrier)
            failures.append(e)
            barrier.abort()

    threads = [threading.Thread(target=member, args=(i,)) for i in range(group_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    return torch.cat(results, dim=1 if tall else 2)


def test_blocks_cover_the_long_side_contiguously():
    """torch.chunk's sizes (DTensor's Shard): ceil(l/k) each, the last shorter; never an empty block."""
    assert block_bounds(10, 3) == (0, 4, 8, 10)
    assert block_bounds(8, 4) == (0, 2, 4, 6, 8)
    assert block_bounds(5, 1) == (0, 5)
    for long, k in [(10, 3), (11, 4), (53248, 16), (100, 7)]:
        bounds = block_bounds(long, k)
        chunks = torch.arange(long).chunk(k)
        assert [len(c) for c in chunks] == [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]
    for long, k in [(3, 4), (5, 4), (9, 4), (10, 6)]:
        with pytest.raises(ValueError, match="cannot split"):
            block_bounds(long, k)


@pytest.mark.parametrize("n", [1, 2, 5, 8, 9])
def test_packing_keeps_the_upper_triangle(n):
    """n (n + 1) / 2 numbers, read from the upper triangle only, back as the symmetric matrix."""
    torch.manual_seed(0)
    upper = torch.randn(3, n, n).triu()
    symmetric = upper + upper.triu(1).mT
    packed = pack_symmetric(upper + torch.randn(3, n, n).tril(-1) * 100)  # the lower triangle is not read
    assert packed.shape == (3, packed_numel(n)) and packed.dtype == torch.float32
    assert torch.equal(unpack_symmetric(packed, n, torch.float32), symmetric)


def _parts(x: torch.Tensor, group_size: int) -> list[torch.Tensor]:
    bounds = block_bounds(x.size(-1), group_size)
    return [x[:, :, lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]


def _summed(blocks: list[torch.Tensor], reduce_dtype=torch.float32) -> torch.Tensor:
    """Member 0's ``summed_gram``, the others' parts added in member order."""
    others = [pack_symmetric(b @ b.mT, reduce_dtype) for b in blocks[1:]]

    def all_reduce(tensor):
        for part in others:
            tensor.add_(part.to(tensor.dtype))

    if reduce_dtype is torch.float32:
        return summed_gram(blocks[0], all_reduce)
    packed = pack_symmetric(blocks[0] @ blocks[0].mT, reduce_dtype)
    for part in others:  # a bf16 reduction: every partial sum rounded, as a ring's hops round
        packed = (packed.float() + part.float()).to(reduce_dtype)
    return unpack_symmetric(packed, blocks[0].size(-2))


def _gram_bound(x: torch.Tensor, group_size: int) -> torch.Tensor:
    exact = x.double() @ x.double().mT
    diagonal = exact.diagonal(dim1=-2, dim2=-1)
    scale = (diagonal[:, :, None] * diagonal[:, None, :]).sqrt()
    return (GRAM_ROUNDINGS * U + (group_size - 1 + 2 * x.size(-1)) * 2.0**-24) * scale


@pytest.mark.parametrize("group_size", [1, 3, 32])
@pytest.mark.parametrize("shape", [(16, 64), (33, 96)])
def test_the_summed_gram_matrix_is_within_its_bound(group_size, shape):
    """Against the one-owner's bf16 X Xᵀ of the same normalised bf16 X, on inputs whose rows differ
    in scale by 10^3 (so entries of many magnitudes, and cancellations in the off-diagonal ones)."""
    torch.manual_seed(group_size)
    x = (torch.randn(2, *shape) * torch.logspace(0, 3, shape[0])[:, None]).bfloat16()
    x = x / torch.linalg.vector_norm(x.flatten(1), dim=1)[:, None, None]
    one_owner = (x @ x.mT).double()
    group = _summed(_parts(x, group_size)).double()
    assert (group - one_owner).abs().le(_gram_bound(x, group_size)).all()
    assert torch.equal(group, group.mT)


def test_the_gram_bound_catches_a_bf16_reduction():
    """Summed in bf16 (each partial sum rounded, as a ring all-reduce's hops round), the error grows
    with k past the bound that holds for every k in fp32."""
    torch.manual_seed(0)
    x = (torch.randn(2, 16, 512) * torch.logspace(0, 3, 16)[:, None]).bfloat16()
    x = x / torch.linalg.vector_norm(x.flatten(1), dim=1)[:, None, None]
    group = _summed(_parts(x, 64), torch.bfloat16).double()
    assert (group - (x @ x.mT).double()).abs().gt(_gram_bound(x, 64)).any()


SHAPES = [(64, 64), (96, 32), (24, 500)]


@pytest.mark.parametrize("ns_method", NS_METHODS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group_size", [3, 8])
def test_the_group_is_as_accurate_as_one_owner(ns_method, shape, group_size):
    """The module's second bound, per matrix. Tall, wide and square; blocks narrower than the short side
    (the reassociated step) and wider; "gram" where Gram Newton–Schulz runs on the group and where not."""
    torch.manual_seed(group_size)
    matrices = torch.randn(2, *shape)
    exact = exact_iteration(matrices, ns_method)
    one_owner = newton_schulz(matrices, ns_method=ns_method).double()
    group = simulate_group(matrices, group_size, ns_method=ns_method).double()
    assert group.shape == one_owner.shape
    for i in range(matrices.size(0)):
        allowed = GROUP_RATIO * scale_ulps(one_owner[i] - exact[i], exact[i]) + 2 * BATCHED_ULPS
        assert scale_ulps(group[i] - exact[i], exact[i]) <= allowed


def test_the_bound_catches_a_norm_left_unsummed():
    """A member that divides its block by its own norm (the norm's all-reduce skipped) is well past it."""

    def unsummed_norm(all_reduce):
        first = [True]

        def skip_the_norm(tensor):
            own = tensor[:, -1].clone()
            all_reduce(tensor)
            if first.pop() if first else False:  # (the first sum: packed Gram matrices, then the squared norms)
                tensor[:, -1] = own

        return skip_the_norm

    torch.manual_seed(0)
    matrices = torch.randn(2, 64, 64)
    exact = exact_iteration(matrices, "torch")
    one_owner = newton_schulz(matrices).double()
    wrong = simulate_group(matrices, 2, normalise=unsummed_norm).double()
    allowed = GROUP_RATIO * scale_ulps(one_owner[0] - exact[0], exact[0]) + 2 * BATCHED_ULPS
    assert scale_ulps(wrong[0] - exact[0], exact[0]) > 2 * allowed


@pytest.mark.parametrize("ns_method", NS_METHODS)
@pytest.mark.parametrize(
    "shape, group_size",
    [((1024, 4096), 2), ((1024, 4096), 8), ((4096, 1024), 3), ((2048, 2048), 4), ((40, 16), 2), ((16, 40), 5)],
)
def test_group_flops_are_the_flops_run(ns_method, shape, group_size):
    """Counted on meta tensors for one member's block (its width from ``block_bounds``): every matmul it
    runs is in ``group_ns_flops``; the all-reduces are ``gram_all_reduces`` Gram matrices, the first with the norm."""
    short, long = min(shape), max(shape)
    width = block_bounds(long, group_size)[1]
    block = torch.empty(
        (1, width, short) if shape[0] > shape[1] else (1, short, width), device="meta", dtype=torch.bfloat16
    )
    sizes = []
    with FlopCounterMode(display=False) as counter:
        group_newton_schulz(
            block, shape=shape, group_size=group_size, ns_method=ns_method, all_reduce=lambda t: sizes.append(t.numel())
        )
    assert counter.get_total_flops() == group_ns_flops(short, long, width, group_size, ns_method=ns_method)
    count = gram_all_reduces(short, long, group_size, ns_method=ns_method)
    assert sizes == [packed_numel(short) + 1] + [packed_numel(short)] * (count - 1)  # (the norm rides with the first)


def test_one_owner_costs_are_the_plans():
    """A group of one costs what the plan charges one owner; members repeat the s³ part where their
    block is at least as long as the short side and apply the Gram matrix twice where that is cheaper."""
    for short, long in [(16, 64), (1024, 4096), (4096, 4096), (2048, 3000)]:
        for method in NS_METHODS:
            assert group_ns_flops(short, long, long, 1, ns_method=method) == ns_flops(short, long, ns_method=method)
        for k in (2, 4, 8):
            width = block_bounds(long, k)[1]
            repeat, twice = 4 * short * short * width + 2 * short**3, 6 * short * short * width
            assert reassociates(short, width) == (twice < repeat)
            assert group_ns_flops(short, long, width, k) == NS_STEPS * min(repeat, twice)


def test_a_group_of_one_is_the_one_owner_iteration():
    """k = 1 with nothing to sum: the one-owner's operations, its Gram matrix read from the upper
    triangle (held to the batched bound: a kernel need not round X Xᵀ symmetrically)."""
    torch.manual_seed(0)
    for ns_method in NS_METHODS:
        matrices = torch.randn(3, 48, 80)
        one_owner = newton_schulz(matrices, ns_method=ns_method).float()
        alone = group_newton_schulz(
            matrices, shape=(48, 80), group_size=1, all_reduce=lambda t: None, ns_method=ns_method
        ).float()
        assert scale_ulps(alone - one_owner, one_owner) <= BATCHED_ULPS


def test_bad_blocks_are_refused():
    with pytest.raises(ValueError, match="not a block along the long side"):
        group_newton_schulz(torch.randn(1, 8, 40), shape=(8, 32), group_size=2, all_reduce=lambda t: None)
    with pytest.raises(ValueError, match="expects"):
        group_newton_schulz(torch.randn(8, 40), shape=(8, 40), group_size=2, all_reduce=lambda t: None)


def test_module_keeps_no_state():
    assert not [n for n, v in vars(group_math).items() if isinstance(v, (list, dict, set)) and not n.startswith("__")]
