"""The Muon step's memory on each rank of a plan: the workspace the step keeps between steps for the
weights a rank updates whole (``optim/workspace.py``, run on the meta device), the owner groups' step
temporaries (their Gram workspace, as ``optim/grouped_update.py`` counts and cuts it)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from titan_dmuon.math.group_newton_schulz import member_batch_elements, widest_block
from titan_dmuon.math.matrix_blocks import row_blocks
from titan_dmuon.math.muon_update import muon_step
from titan_dmuon.math.ns_methods import NS_STEPS
from titan_dmuon.optim.grouped_update import member_batch_size
from titan_dmuon.optim.step_schedule import pipeline_chunks
from titan_dmuon.optim.workspace import Workspace
from titan_dmuon.plan.ownership import OwnershipPlan
from titan_dmuon.sizing.records import Weight
from titan_dmuon.sizing.stage_weights import StageWeights, chunk_rows

GROUP_WORKSPACE_BYTES = 2  # member_batch_elements counts bf16 elements (an fp32 number as two)


def workspace_bytes(calls: Sequence[Sequence[tuple[tuple[int, ...], Sequence]]], cache: dict | None = None) -> int:
    """Bytes of the Muon step's workspace (``optim/workspace.py``, ns_method 'torch', bf16) on a rank whose
    step runs ``calls``: per ``OwnerUpdate.update`` call, the (shape, row blocks) of each weight it updates
    whole (a stack of experts 3-D). Each call's batches run once on the meta device; one workspace serves
    them all, so each buffer is the most any call asks (``Workspace.by_buffer``). ``cache``: each call's
    buffers by its matrices, shared by the ranks (and plans) of a job: the meta runs are its cost."""
    cache = {} if cache is None else cache
    merged: dict = {}
    for matrices in calls:
        chosen = tuple((tuple(shape), tuple(blocks or ())) for shape, blocks in matrices if math.prod(shape))
        if chosen not in cache:
            workspace = Workspace()
            params = [torch.empty(shape, device="meta") for shape, _ in chosen]
            muon_step(
                params,
                [torch.empty_like(p) for p in params],
                [torch.empty_like(p) for p in params],
                [blocks or row_blocks(shape[-2:]) for shape, blocks in chosen],
                lr=0.0,
                weight_decay=0.0,
                momentum=0.95,
                nesterov=True,
                ns_steps=NS_STEPS,
                scratch=workspace,
            )
            cache[chosen] = workspace.by_buffer()
        for key, nbytes in cache[chosen].items():
            merged[key] = max(merged.get(key, 0), nbytes)
    return sum(merged.values())


def workspace_bound(weights: Sequence[Weight]) -> int:
    """The workspace on any rank, at most: every Muon weight's batches in one call. A buffer is as large
    as the largest batch of any shape class asks (``MAX_STACK_BYTES`` caps a batch), so a rank that
    updates fewer weights needs no more; tensor parallelism's exchange buffers are not counted."""
    return workspace_bytes([[(w.shape, w.blocks) for w in weights if w.muon and len(w.shape) in (2, 3)]])


def rank_workspaces(stage: StageWeights, plan: OwnershipPlan, shards: int, cache: dict | None = None) -> list[int]:
    """Each rank's workspace, its step's calls as ``step_schedule`` makes them: the dedicated weights it
    owns whole, a chunk of layers per call (``pipeline_chunks``), then its experts of the stacks that stay
    where FSDP2 shards them, in one call (``workspace_bytes``); owner groups' blocks do not use it
    (``group_temporaries``); tensor-parallel weights (their exchange and homes' buffers) are not counted."""
    chunks = pipeline_chunks(sorted({e.unit for e in plan.entries}))
    dp_shard = plan.shard_size
    whole: dict[int, list] = {}  # (each rank's weights held whole, in plan order)
    for e in plan.entries:
        if e.group is None and not e.tensor_parallel:
            whole.setdefault(e.owner, []).append(e)
    cache = {} if cache is None else cache
    out, known = [], {}  # (ranks with the same calls have the same workspace)
    for g in range(plan.world_size):
        calls = [[(tuple(e.shape), e.blocks) for e in whole.get(g, ()) if e.unit in chunk] for chunk in chunks]
        calls.append(
            [
                ((chunk_rows(w.shape[0], shards)[(g % dp_shard) % shards], *w.shape[1:]), w.blocks)
                for w in stage.local
                if stage.layout.tp == 1 or w.tp_dim is None
            ]
        )
        key = tuple(tuple((shape, tuple(blocks or ())) for shape, blocks in call) for call in calls)
        if key not in known:
            known[key] = workspace_bytes(calls, cache)
        out.append(known[key])
    return out


def group_temporaries(plan: OwnershipPlan, ns_method: str = "torch", steps: int = NS_STEPS) -> list[int]:
    """Each rank's largest owner-group batch in the step, in bytes: per job (``pipeline_chunks``) the
    blocks of one group and shape run together, ``member_batch_size`` of them at a time, each holding
    ``member_workspace_elements`` (its block and next value, the summed Gram matrix and its polynomial,
    the packed fp32 sum), with one block's fp32 temporary per batch (``member_batch_elements``, what
    ``tests/unit/test_group_member_memory.py`` holds a member's peak to). Allocated in the step and freed
    after it: not in the workspace kept between steps."""
    chunks = pipeline_chunks(sorted({e.unit for e in plan.entries}))
    chunk_of = {unit: c for c, chunk in enumerate(chunks) for unit in chunk}
    batches: dict[tuple, int] = {}  # (rank, job, group's ranks, shape) -> matrices
    for e in plan.entries:
        if e.group is not None:
            for rank in e.group.ranks:
                key = (rank, chunk_of[e.unit], e.group.ranks, tuple(e.shape))
                batches[key] = batches.get(key, 0) + 1
    out = [0] * plan.world_size
    for (rank, _, ranks, shape), count in batches.items():
        short, long = min(shape), max(shape)
        per_batch = min(count, member_batch_size(shape, len(ranks), ns_method, steps))
        batch = member_batch_elements(short, widest_block(long, len(ranks)), per_batch, ns_method, steps)
        out[rank] = max(out[rank], batch * GROUP_WORKSPACE_BYTES)
    return out
