"""``python -m titan_dmuon.sizing``: its memory figures against what is measured (its tables:
tests/unit/test_sizing.py).

Memory: the tool's parameters, gradients, optimizer state and DMuon buffers (between steps, peak)
per rank equal, byte for byte, what ``benchmarks/memory_table.py`` measures of the same model and
layout (each rank simulated on the fake process group, bf16 compute / fp32 reduce, the largest
rank of each figure) and what the handle's buffer counters read, and its persistent total equals
the allocator's count of the bytes alive between steps. Tolerance zero, because both sides count
the same deterministic things: storages of the tensors each rank holds (FSDP2's padded dim-0
shards, owners' whole weights, AdamW's moments of the unpadded shard and its step counts), and
DMuon's packed-buffer bytes, which do not depend on timing, kernels or the allocator's caching.
What the tool only estimates (FSDP2's gathered weights, activations) is not asserted."""

from __future__ import annotations

import pytest
import torch

from tests.support.sizing_parts import DIMS, layout_of, toy_weights
from titan_dmuon.sizing.figures import size_job
from titan_dmuon.sizing.records import Layout

CASES = [  # (model, optimizer, mode, world): memory_table.py's rows, and experts kept (N <= E) and dedicated (N > E)
    ("dense", "fsdp_adamw", "z3", 2),
    ("dense", "dmuon", "z2", 2),
    ("dense", "dmuon", "z3", 2),
    ("dense", "dmuon", "z3", 4),
    ("dense", "fsdp_adamw", "hsdp", 4),
    ("dense", "dmuon", "hsdp", 4),
    ("moe", "fsdp_adamw", "z3", 2),
    ("moe", "dmuon", "z3", 2),
    ("moe", "dmuon", "hsdp", 4),
    ("moe", "dmuon", "z3", 8),
]


def _measured(rank: int, world: int, dims: dict, optimizer: str, mode: str, ranks: int) -> dict:
    """Each rank of a ``ranks``-rank job simulated in turn on the fake process group: 3 steps as
    memory_table.py runs them, then its storage breakdown and the handle's buffer counters (peak
    since step 2, when the layer order is known and prefetching runs)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from benchmarks.memory_table import storage_breakdown
    from tests.support.helpers import baseline, batches, distribute, local_slice, make_mesh, toy_model
    from tests.support.runtime_parts import fake_pg
    from titan_dmuon.testing.toy_model import loss_fn

    per_rank = []
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for r in range(ranks):
        with fake_pg(ranks, r):
            model = toy_model(**dims)
            if optimizer == "dmuon":
                setup = distribute(model, mode, ranks, mp_policy=policy)
            else:
                setup = baseline(
                    model,
                    optimizer,
                    ranks,
                    mesh=make_mesh("hsdp" if mode == "hsdp" else "z3", ranks),
                    reshard=mode != "z2",
                    mp_policy=policy,
                )
            for i, batch in enumerate(batches(3, global_batch=2 * ranks, seq=8, vocab=dims["vocab_size"])):
                if i == 1 and setup.handle is not None:
                    setup.handle.reset_peak_buffer_bytes()
                x, y = local_slice(batch, r, ranks)
                setup.opt.zero_grad()
                loss_fn(setup.module(x), y).backward()
                setup.opt.step()
            figures = storage_breakdown(setup)
            figures["peak_buffers"] = setup.handle.peak_buffer_bytes if setup.handle is not None else 0
            per_rank.append(figures)
    return {k: max(f[k] for f in per_rank) for k in per_rank[0]}


@pytest.mark.parametrize("model,optimizer,mode,world", CASES)
def test_memory_equals_the_measured(solo, model, optimizer, mode, world):
    measured = solo.run(_measured, DIMS[model], optimizer, mode, world)[0]
    name = (
        "FSDP2 + AdamW, " + ("Z2" if mode == "z2" else "Z3")
        if optimizer == "fsdp_adamw"
        else "DMuon-Z2"
        if mode == "z2"
        else "DMuon-Z3"
    )
    predicted = size_job(toy_weights(DIMS[model]), layout_of(mode, world)).stages[0].memory[name]
    assert {
        "params": predicted.params,
        "grads": predicted.grads,
        "opt_state": predicted.optimizer_state,
        "dmuon_buffers": predicted.buffers_between_steps,
        "peak_buffers": predicted.buffers_peak,
    } == {k: measured[k] for k in ("params", "grads", "opt_state", "dmuon_buffers", "peak_buffers")}


def _allocator_persistent(rank: int, world: int, mode: str, ranks: int) -> int:
    """memory_table.py's own run (under the profiler): bytes alive between steps, the largest rank."""
    from benchmarks.memory_table import on_fake_pg

    return max(on_fake_pg(r, ranks, ("dmuon", mode), DIMS["dense"], 2, 8)["persistent"] for r in range(ranks))


def test_persistent_equals_the_allocators_count(solo):
    """The allocator's events (everything alive after the step, nothing named in advance) give the
    tool's persistent total: nothing the tool leaves out stays alive between steps. Tolerance: the
    run also keeps a few bytes that are neither model nor optimizer (8 here, in FSDP2 + AdamW's run
    too: memory_table.py's "other" column), less than the smallest weight (a 64-element norm, 256
    bytes) that a wrong count would miss; the breakdown itself is asserted exactly above."""
    predicted = size_job(toy_weights(DIMS["dense"]), Layout(shard=2)).stages[0].memory["DMuon-Z3"]
    smallest_weight = 4 * DIMS["dense"]["dim"]
    assert 0 <= solo.run(_allocator_persistent, "z3", 2)[0] - predicted.persistent < smallest_weight
