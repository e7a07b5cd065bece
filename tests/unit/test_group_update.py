"""The grouped update's batches (``titan_dmuon/optim/grouped_update.py``): one order on every member, and a
member's Newton–Schulz workspace under the one-owner path's cap.

Before issue 39 a member stacked every equally shaped block of a group at once (fp32 Nesterov
temporaries, an fp32 and a bf16 stack, a clone) with each matrix's short x short Gram workspace beside
it: ~1.6 GB per 16384-row matrix, uncapped. Now a batch is cut so that its workspace
(``member_batch_elements``) stays within what the one-owner path allows a batch at
``MAX_STACK_BYTES`` (``workspace_elements`` of the matrices it stacks), and every member cuts alike.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from titan_dmuon.math.group_newton_schulz import block_bounds, member_batch_elements, widest_block
from titan_dmuon.math.ns_methods import MAX_STACK_BYTES, workspace_elements
from titan_dmuon.optim.grouped_update import batch_order, member_batches


def _weights(shape, group_ranks, names, member_index=0):
    """GroupedWeight stand-ins: a member (its block of ``shape`` on ``group_ranks``) per name."""
    k = len(group_ranks)
    long_dim = 0 if shape[0] > shape[1] else 1
    bounds = block_bounds(max(shape), k)
    group = SimpleNamespace(ranks=group_ranks, size=k, long_dim=long_dim, bounds=bounds)
    width = bounds[member_index + 1] - bounds[member_index]
    block = (width, shape[1]) if long_dim == 0 else (shape[0], width)
    return [
        SimpleNamespace(
            param=SimpleNamespace(shape=block), grad=None, member=SimpleNamespace(fqn=name, shape=shape, group=group)
        )
        for name in names
    ]


@pytest.mark.parametrize("shape, k", [((53248, 16384), 8), ((16384, 16384), 16), ((2048, 64), 4), ((64, 6000), 3)])
def test_a_members_batch_stays_under_the_one_owner_cap(shape, k):
    """At llama3 405B's w1 and wq and at small shapes: each batch's workspace on a member within the
    one-owner cap (a batch of one where one matrix alone exceeds it, as the one-owner path), the same
    cut on the first and the last member (whose block is narrower)."""
    short, long = min(shape), max(shape)
    names = [f"layers.{i}.w" for i in range(40)]
    first = member_batches(_weights(shape, tuple(range(k)), names, 0), "torch", 5)
    last = member_batches(_weights(shape, tuple(range(k)), names, k - 1), "torch", 5)
    assert [len(b) for b in first] == [len(b) for b in last]
    assert sum(len(b) for b in first) == 40
    cap = max(1, MAX_STACK_BYTES // (2 * short * long)) * workspace_elements(short, long, "torch", 5)
    width = widest_block(long, k)
    for batch in first:
        assert len(batch) == 1 or member_batch_elements(short, width, len(batch), "torch", 5) <= cap
    if member_batch_elements(short, width, 40, "torch", 5) > cap:
        assert len(first) > 1  # (the cap did cut)


def test_batches_go_in_name_order_whatever_order_they_came_in():
    """The same batches in the same order on every member, from weights listed in any order."""
    names = ["layers.3.w1", "layers.1.w1", "layers.2.w1", "layers.0.w1"]
    a = batch_order(_weights((2048, 64), (0, 1, 2, 3), names))
    b = batch_order(_weights((2048, 64), (0, 1, 2, 3), names[::-1]))
    assert [[w.member.fqn for w in batch] for batch in a] == [[w.member.fqn for w in batch] for batch in b]
    assert [w.member.fqn for w in a[0]] == sorted(names)
