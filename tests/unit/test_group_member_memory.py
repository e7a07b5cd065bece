"""An owner-group member's step stays within the memory its batches are cut by (issue 39).

``grouped_update.member_batches`` cuts a member's equally shaped blocks into batches whose
``member_batch_elements`` (bf16 elements: per matrix its block, the iterates and the Gram workspace of
``member_workspace_elements``, and per batch one block's fp32 temporary) fit the one-owner path's batch at
``MAX_STACK_BYTES``; ``titan_dmuon.sizing`` reports the same count as a rank's group temporaries. Here one
member's ``update_grouped`` runs in one process (the group's all-reduce a stand-in that sums nothing: a
member's memory does not depend on what the others send) under PyTorch's profiler with memory profiling,
and the peak of what it allocated above what it started with must be within that count, for the
polynomial and Horner's order, tall and wide weights, standard and Gram Newton–Schulz, with batches cut.

Before this test the count held two block-sized buffers while the step kept up to four alive: the stack
(named by the caller), the previous iterate, Horner's A X_i of the step before and the next one, with the
first Gram matrix and the previous polynomial; and the norm's ``vector_norm(..., dtype=float32)`` copied
the whole batch to fp32 (two more blocks of bf16 per matrix). On these cases the peak was 1.46x the
count with the polynomial, 1.87x in Horner's order and 2.05x with Gram Newton–Schulz; each fails here.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from titan_dmuon.math.group_newton_schulz import (
    block_bounds,
    group_uses_gram,
    member_batch_elements,
    reassociates,
    widest_block,
)
from titan_dmuon.math.ns_methods import NS_COEFFICIENTS, workspace_elements
from titan_dmuon.optim import grouped_update
from titan_dmuon.optim.grouped_update import GroupedWeight, member_batches, update_grouped

MATRICES = 5
CAP_BYTES = 1  # (in place of MAX_STACK_BYTES: one matrix per one-owner batch, so a member stacks a few)


class _OwnerUpdate:
    """What ``update_grouped`` reads of the ``OwnerUpdate``: the method, momentum buffers (made before the
    measured step, as after a first step), the step's figures."""

    def __init__(self, ns_method: str, buffers: dict) -> None:
        self.ns_method, self._buffers = ns_method, buffers
        self.figures = SimpleNamespace(matrices=0, timing=lambda device: contextlib.nullcontext())

    def momentum_buffer(self, param):
        return self._buffers[id(param)]


class _Comm:
    def all_reduce(self, member):
        return lambda tensor: None


def _member_weights(shape, k, member_index=0):
    """MATRICES equally shaped weights of one group of ``k`` ranks, this member's blocks (the first: the
    widest), with gradients and momentum buffers."""
    rows, cols = shape
    tall = rows > cols
    bounds = block_bounds(max(shape), k)
    width = bounds[member_index + 1] - bounds[member_index]
    block = (width, cols) if tall else (rows, width)
    group = SimpleNamespace(ranks=tuple(range(k)), size=k, long_dim=0 if tall else 1, bounds=bounds)
    generator = torch.Generator().manual_seed(0)
    weights, buffers = [], {}
    for i in range(MATRICES):
        param = torch.randn(block, generator=generator)
        buffers[id(param)] = torch.randn(block, generator=generator)
        member = SimpleNamespace(fqn=f"layers.{i}.w", shape=shape, group=group)
        weights.append(GroupedWeight(param=param, grad=torch.randn(block, generator=generator), member=member))
    return weights, buffers


def _peak_bytes(prof) -> int:
    """The most bytes the profiled code held above what it started with (its allocations and frees in order)."""
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    assert events, "the profiler recorded no allocation"
    held = peak = 0
    for _, nbytes in events:
        held += nbytes
        peak = max(peak, held)
    return peak


GROUP = dict(lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, eps=1e-7, adjust_lr_fn=None, weight_decay=0.1)


@pytest.mark.parametrize(
    "shape, k, ns_method",
    [
        ((2048, 128), 4, "torch"),  # tall, blocks 512 >= 128: the polynomial
        ((128, 2048), 4, "torch"),  # wide, the same
        ((1024, 256), 8, "torch"),  # tall, blocks 128 < 256: Horner's order
        ((256, 1024), 8, "polar_express"),  # wide, Horner's order
        ((128, 4096), 2, "gram"),  # wide, Gram Newton–Schulz
    ],
)
def test_a_members_peak_is_within_its_batches_count(monkeypatch, shape, k, ns_method):
    """The member's step (momentum, Newton–Schulz, update) in several batches: its peak above the start is
    at most the largest batch's ``member_batch_elements`` in bytes; a batch of several is within the
    one-owner cap (one matrix goes alone whatever it holds, as on the one-owner path)."""
    monkeypatch.setattr(grouped_update, "MAX_STACK_BYTES", CAP_BYTES)
    short, long = min(shape), max(shape)
    width = widest_block(long, k)
    if ns_method == "gram":
        assert group_uses_gram(short, long, k)
    else:
        assert reassociates(short, width) == (shape in ((1024, 256), (256, 1024)))
    weights, buffers = _member_weights(shape, k)
    batches = member_batches(weights, ns_method, 5)
    assert len(batches) > 1, [len(b) for b in batches]  # (the cut is part of what is checked)
    counts = [2 * member_batch_elements(short, width, len(b), ns_method, 5) for b in batches]
    one_owner = max(1, CAP_BYTES // (2 * short * long)) * workspace_elements(short, long, "torch", 5) * 2
    assert all(len(b) == 1 or count <= one_owner for b, count in zip(batches, counts))  # (as the one-owner path)
    bound = max(counts)
    group = dict(GROUP, ns_coefficients=NS_COEFFICIENTS)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        update_grouped(_OwnerUpdate(ns_method, buffers), group, weights, _Comm())
    peak = _peak_bytes(prof)
    assert 0 < peak <= bound, (peak, bound, peak / bound)
