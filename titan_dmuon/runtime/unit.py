"""A unit: the dedicated weights of one layer, gathered into one packed buffer.

Between steps a unit's buffer has no storage and each dedicated weight lives
only on its owners (the registered ``nn.Parameter``; other ranks keep a
0-element placeholder). Before the layer runs, owners copy their weights into
the buffer (in the compute dtype) and broadcast their segment; the layer's
modules then see views of the buffer ("compute params") until its backward
is done. The buffer's life is a small state machine::

    FREE --gather()--> GATHERING --wait()--> READY --free()--> FREE

and the unit's place in the step is its ``Phase``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
from torch import nn

from titan_dmuon.plan import PlanEntry
from titan_dmuon.runtime.comm import CommStats, Launch, alloc_storage, free_storage, wait_all


class BufferState(enum.Enum):
    FREE = "free"  # no storage
    GATHERING = "gathering"  # broadcasts into it are in flight
    READY = "ready"  # holds this step's weights


class Phase(enum.Enum):
    IDLE = "idle"  # between steps, or after its backward
    FORWARD = "forward"  # between pre- and post-forward
    AWAITING_BACKWARD = "awaiting_backward"  # forward done; its gradients will come
    BACKWARD = "backward"  # its backward started; gradients are accumulating


@dataclass(eq=False)
class Member:
    """One dedicated weight as this rank sees it."""

    entry: PlanEntry
    module: nn.Module  # registers the weight under ``name``
    name: str
    param: nn.Parameter  # the registered parameter: full data on its shard owners, a placeholder elsewhere
    holds_full: bool  # this rank keeps the full weight between steps (one rank per replicate group)
    runs_ns: bool  # this rank is the global owner: it gets .grad and momentum and runs Newton–Schulz
    offset: int = 0  # into the unit's packed buffer
    compute: nn.Parameter | None = None  # view of the packed buffer used by forward and backward

    def refresh(self) -> None:
        """Follow a parameter that ``module._apply`` replaced (``to_empty()`` on a meta model)."""
        current = self.module._parameters.get(self.name)
        if current is not None and current is not self.param and current is not self.compute:
            self.param = current


@dataclass(eq=False)
class Bucket:
    """Members of a unit with the same shard owner and the same global owner: one reduce buffer."""

    shard_owner: int
    replicate_owner: int
    members: list[Member]


@dataclass(eq=False)
class Segment:
    """Members of a unit held by one shard index: a contiguous slice of the packed buffer."""

    shard_owner: int
    start: int
    stop: int
    buckets: list[Bucket]


@dataclass(eq=False)
class Unit:
    index: int
    module: nn.Module
    members: list[Member]  # in buffer order
    segments: list[Segment]
    numel: int
    buffer: torch.Tensor | None = None
    state: BufferState = BufferState.FREE
    phase: Phase = Phase.IDLE
    grads_ready: int = 0
    swapped_in: bool = False
    _works: list = field(default_factory=list)

    @property
    def buckets(self) -> list[Bucket]:
        return [b for s in self.segments for b in s.buckets]

    def allocate_compute_params(self, dtype: torch.dtype, on_grad_ready) -> None:
        """Views of one packed buffer, registered as leaf parameters for autograd (storage freed)."""
        device = self.members[0].param.device
        storage = torch.empty(self.numel, dtype=dtype, device=device)
        self.buffer = storage
        for m in self.members:
            view = torch.empty(0, dtype=dtype, device=device)
            # A separate tensor on the same storage: writes into the buffer do not bump the
            # version counter autograd checks on the compute param.
            view.set_(storage.untyped_storage(), m.offset, m.entry.shape)
            m.compute = nn.Parameter(view, requires_grad=m.param.requires_grad)
            m.compute.register_post_accumulate_grad_hook(lambda p, m=m: on_grad_ready(m))
        free_storage(storage)

    @torch.no_grad()
    def gather(self, *, shard_rank: int, shard_group, shard_size: int, source: str, stats: CommStats) -> int:
        """Start filling the buffer from the owners (no-op unless FREE); returns bytes allocated."""
        if self.state is not BufferState.FREE:
            return 0
        allocated = alloc_storage(self.buffer)
        for segment in self.segments:
            if segment.shard_owner == shard_rank:
                for bucket in segment.buckets:
                    for m in bucket.members:
                        self.buffer[m.offset : m.offset + m.entry.numel].view(m.entry.shape).copy_(m.param)
        with Launch(shard_group, shard_size, self.buffer.device, source, stats) as launch:
            for segment in self.segments:
                launch.broadcast(self.buffer[segment.start : segment.stop], src=segment.shard_owner)
        self._works = launch.works
        self.state = BufferState.GATHERING
        return allocated

    def wait(self) -> None:
        """The current stream waits for the broadcasts; the buffer is then READY."""
        if self.state is BufferState.GATHERING:
            wait_all(self._works)
            self.state = BufferState.READY

    def free(self) -> int:
        """Release the buffer (after its broadcasts); returns bytes freed."""
        self.wait()
        self.state = BufferState.FREE
        return free_storage(self.buffer) if self.buffer is not None else 0

    def swap_in(self) -> None:
        for m in self.members:
            m.module._parameters[m.name] = m.compute
        self.swapped_in = True

    def swap_out(self) -> None:
        for m in self.members:
            m.module._parameters[m.name] = m.param
        self.swapped_in = False
