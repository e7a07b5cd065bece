"""Newton–Schulz batches replayed from CUDA graphs (``ns_graphs``): the host launches one graph per batch.

A batch's Newton–Schulz is ~30 kernels per method step; on a GPU their launches can cost more host time
than the GEMMs take (the original DMuon replays its Newton–Schulz per shape from a CUDA graph). A graph
needs static inputs and outputs: the step's ``Workspace`` gives every batch of a shape class the same
buffers, so a batch is captured once, keyed by its input buffer, shape and method, and replayed every
step after. A key is run eagerly the first time (its buffers are made then), captured the second, replayed
from then on; a workspace buffer that grows (a larger batch) drops every graph (their addresses moved).
Tensors off CUDA run eagerly through the same path (what the CPU tests exercise).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from titan_dmuon.optim.workspace import Workspace


class NSGraphs:
    """Runs ``fn(x, **kwargs)`` (``ns_methods.orthogonalise_wide_`` on a workspace stack) from a CUDA
    graph per key once its buffers are static; counts what it did (``eager``, ``captured``, ``replayed``)."""

    def __init__(self, workspace: Workspace) -> None:
        self.workspace = workspace
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor] | None] = {}
        self._grown = workspace.grown
        self._pool = None
        self.eager = self.captured = self.replayed = 0

    def __call__(self, fn: Callable[..., torch.Tensor], x: torch.Tensor, kwargs: dict) -> torch.Tensor:
        if x.device.type != "cuda":
            self.eager += 1
            return fn(x, **kwargs)
        if self.workspace.grown != self._grown:  # (buffers moved: every graph read or wrote the old ones)
            self._graphs.clear()
            self._grown = self.workspace.grown
        key = (
            fn,
            x.data_ptr(),
            tuple(x.shape),
            x.dtype,
            tuple(sorted((k, v) for k, v in kwargs.items() if k != "scratch")),
        )
        if key not in self._graphs:
            self.eager += 1
            out = fn(x, **kwargs)
            if self.workspace.grown == self._grown:  # (its buffers were all there: static from now on)
                self._graphs[key] = None
            return out
        entry = self._graphs[key]
        if entry is None:
            entry = self._graphs[key] = self._capture(fn, x, kwargs)
            self.captured += 1
        graph, out = entry
        graph.replay()
        self.replayed += 1
        return out

    def _capture(self, fn, x: torch.Tensor, kwargs: dict) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The graph of ``fn(x, **kwargs)`` (captured, not run: the replay that follows runs it)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = fn(x, **kwargs)
        return graph, out
