"""The Muon step's temporaries, kept between steps: a ``Workspace`` hands out the same memory for a name.

Every step allocated and freed the same large temporaries (Nesterov inputs, the per-shape-batch stacks,
Newton–Schulz's intermediates, NorMuon's, the tensor-parallel exchange's batches); the C allocator's heap
fragmented around them and a process's memory grew step after step (issue 40), and a CUDA graph needs
buffers that stay where they are. The math names each temporary (``ns_methods.Scratch``: no two buffers
alive at once share a name) and a ``Workspace`` keeps one flat buffer per (name, dtype, device), as large
as the largest request for that name: the largest batch of any shape class, as every shape class's
batches run one after another (``ns_methods.MAX_STACK_BYTES`` and ``tensor_parallel_update.MAX_EXCHANGE_BYTES``
cap them). A buffer grows during the first step that asks for more, then stays: from the second step on,
nothing above a few scalars is allocated. ``nbytes`` says what it holds.
"""

from __future__ import annotations

import math

import torch


class Workspace:
    """Flat buffers by (name, dtype, device), each as large as the largest request so far; a request
    gets a view of its first elements (so every view of a name starts where ``torch.empty`` would put a
    new tensor: aligned, contiguous)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}
        self.grown = 0  # how many times a buffer was (re)allocated: a graph captured before then is stale

    def __call__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer of ``shape`` for ``name`` (a ``Scratch``): the same memory each call."""
        numel = math.prod(shape)
        key = (name, dtype, torch.device(device))
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
            self.grown += 1
        return buffer[:numel].view(shape)

    def nbytes(self) -> int:
        """The bytes it holds (this rank's)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def by_buffer(self) -> dict[tuple[str, torch.dtype, torch.device], int]:
        """Its bytes per buffer: a workspace that served several sets of requests holds, per buffer, the
        most any of them asked for (``titan_dmuon.sizing`` merges the workspaces of separate calls so)."""
        return {key: buffer.numel() * buffer.element_size() for key, buffer in self._buffers.items()}

    def by_name(self) -> dict[str, int]:
        """Its bytes by name (summed over dtypes and devices)."""
        out: dict[str, int] = {}
        for (name, _, _), buffer in self._buffers.items():
            out[name] = out.get(name, 0) + buffer.numel() * buffer.element_size()
        return out
