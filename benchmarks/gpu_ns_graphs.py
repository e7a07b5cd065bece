"""Row (8) of ``gpu_check.py``: Newton–Schulz batches replayed from CUDA graphs (``ns_graphs``) against eager.

One transformer layer's Muon step (``muon_update.muon_step`` with the step's ``Workspace``) run a few
steps eagerly and a few with ``NSGraphs`` (run, captured, then replayed): the weights must be bitwise
equal (the same kernels on the same buffers), and the host time per step is the launches' cost (no
sync inside a step; one between steps). Off CUDA ``NSGraphs`` runs eagerly: the row checks the plumbing.
"""

from __future__ import annotations

import statistics
import time

import torch

from titan_dmuon.math.matrix_blocks import row_blocks
from titan_dmuon.math.muon_update import muon_step
from titan_dmuon.optim.ns_graphs import NSGraphs
from titan_dmuon.optim.workspace import Workspace

CHECK = "(8) Newton–Schulz from CUDA graphs"


def _run(shapes, device, steps: int, graphs: bool):
    """(weights after ``steps`` Muon steps, host seconds of each step, the graphs' counts or None)."""
    g = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(s, device=device, generator=g) for s in shapes]
    grads = [torch.randn(s, device=device, generator=g) for s in shapes]
    buffers = [torch.zeros_like(p) for p in params]
    workspace = Workspace()
    runner = NSGraphs(workspace) if graphs else None
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        muon_step(
            params,
            grads,
            buffers,
            [row_blocks(p.shape) for p in params],
            lr=0.02,
            weight_decay=0.1,
            momentum=0.95,
            nesterov=True,
            ns_steps=5,
            scratch=workspace,
            ns_runner=runner,
        )
        seconds.append(time.perf_counter() - start)
        if device.type == "cuda":
            torch.cuda.synchronize()  # (between steps: a step's host time is its launches)
    counts = None if runner is None else (runner.eager, runner.captured, runner.replayed)
    return params, seconds, counts


def ns_graph_rows(shapes: list[tuple[int, int]], what: str, device, steps: int = 6) -> list[tuple]:
    """Two rows: graph vs eager weights after ``steps`` steps (bitwise), and the host time per step
    (median of the steps after the capture)."""
    eager, eager_s, _ = _run(shapes, device, steps, graphs=False)
    graph, graph_s, (ran, captured, replayed) = _run(shapes, device, steps, graphs=True)
    diff = max(float((a - b).abs().max()) for a, b in zip(eager, graph))
    equal = all(torch.equal(a, b) for a, b in zip(eager, graph))
    eager_ms, graph_ms = (1e3 * statistics.median(s[2:]) for s in (eager_s, graph_s))
    how = (
        f"graphs: {ran} batches run eagerly, {captured} captured, {replayed} replays"
        if device.type == "cuda"
        else f"{device.type}: NSGraphs runs eagerly (the same path, no graph)"
    )
    return [
        (
            CHECK,
            f"{what}: weights after {steps} steps, graph vs eager",
            "bitwise equal" if equal else f"FAIL: max |diff| {diff:.3g}",
            how,
        ),
        (
            CHECK,
            f"{what}: host ms per step (median of steps 3-{steps})",
            f"{graph_ms:.2f} ms graph",
            f"{eager_ms:.2f} ms eager: {eager_ms / graph_ms:.2f}x",
        ),
    ]
