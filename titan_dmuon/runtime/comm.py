"""How DMuon issues collectives: labelled, counted, grouped into launches, on the right stream.

* Labels. ``comm_source`` tags every collective DMuon issues with a name
  (``dmuon.forward_broadcast``, ...) and ``Launch`` tags each group of them
  with a launch id, so a measuring tool (``titan_dmuon.CommLedger``) can tell
  DMuon's traffic from FSDP2's and count launches. The runtime never imports
  the measuring tool; the tool reads these labels.
* Counts. ``CommStats`` keeps this rank's elements/bytes (in the design's
  units) and launches per label, for the training log.
* Launches. A unit's collectives in one direction go out as one launch: a
  coalesced group where the backend can coalesce (NCCL: one ``ncclGroup``),
  else one by one (gloo).
* Streams. On an accelerator the gradient reduces run off the compute stream
  (FSDP2 runs its reduce-scatters on a side stream the same way); on the CPU
  there are no streams and every stream operation is a no-op.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from fractions import Fraction

import torch
import torch.distributed as dist

_source: contextvars.ContextVar[str] = contextvars.ContextVar("dmuon_comm_source", default="other")
_launch: contextvars.ContextVar[tuple[int, bool] | None] = contextvars.ContextVar("dmuon_comm_launch", default=None)
_launch_ids = itertools.count(1)


@contextlib.contextmanager
def comm_source(name: str) -> Iterator[None]:
    """Label the collectives issued inside (DMuon's runtime names its own this way)."""
    token = _source.set(name)
    try:
        yield
    finally:
        _source.reset(token)


def current_source() -> str:
    return _source.get()


def current_launch() -> tuple[int, bool] | None:
    """(id, coalesced) of the group of DMuon's collectives being issued, or None. One group is one
    launch where the backend coalesces (NCCL); gloo runs its collectives one by one."""
    return _launch.get()


@dataclass
class CommStats:
    """This rank's DMuon traffic since the last ``pop``: {label: [elements, bytes, launches]}
    (launches: groups, i.e. what NCCL launches; gloo runs a group's collectives one by one)."""

    by_source: dict[str, list] = field(default_factory=dict)

    def add(self, source: str, elements: Fraction, nbytes: Fraction, launches: int) -> None:
        row = self.by_source.setdefault(source, [Fraction(0), Fraction(0), 0])
        row[0] += elements
        row[1] += nbytes
        row[2] += launches

    def pop(self) -> dict[str, tuple[Fraction, Fraction, int]]:
        out = {k: tuple(v) for k, v in self.by_source.items()}
        self.by_source = {}
        return out


def _coalesces(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether this group's backend runs a group of collectives as one launch.

    NCCL does (``ncclGroupStart/End``); gloo cannot; the fake backend used to
    count launches at large world sizes accepts coalescing like NCCL."""
    if dist.get_backend(group) == "fake":
        return True
    try:
        return bool(group._get_backend(device).supports_coalescing)
    except RuntimeError:
        return False


class Launch:
    """Collectives issued together on one process group (one launch where the backend coalesces).

    Use inside ``with Launch(...) as launch:``; ``launch.works`` is what to wait on.
    """

    def __init__(self, group: dist.ProcessGroup, group_size: int, device: torch.device, source: str, stats: CommStats):
        self.group = group
        self.group_size = group_size
        self.device = device
        self.source = source
        self.stats = stats
        self.works: list = []
        self._ops = 0
        self._coalesce = group_size > 1 and _coalesces(group, device)
        self._stack = contextlib.ExitStack()
        self._cm = None

    def __enter__(self) -> Launch:
        self._stack.enter_context(comm_source(self.source))
        token = _launch.set((next(_launch_ids), self._coalesce))
        self._stack.callback(_launch.reset, token)
        return self

    def _open_group(self) -> None:
        """Entered at the first collective: an empty coalesced group would still be a launch."""
        self._cm = self._stack.enter_context(dist._coalescing_manager(self.group, self.device, async_ops=True))

    def __exit__(self, *exc) -> None:
        self._stack.close()
        if self._cm is not None and self._ops:
            self.works.append(self._cm)
        if self._ops:
            self.stats.add(self.source, Fraction(0), Fraction(0), 1)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self._issue(dist.broadcast, tensor, group_src=src)

    def reduce(self, tensor: torch.Tensor, dst: int) -> None:
        self._issue(dist.reduce, tensor, group_dst=dst)

    def _issue(self, fn, tensor: torch.Tensor, **kwargs) -> None:
        if self.group_size == 1:
            return
        if self._coalesce and self._cm is None:
            self._open_group()
        elements = Fraction(self.group_size - 1, self.group_size) * tensor.numel()
        self.stats.add(self.source, elements, elements * tensor.element_size(), 0)
        work = fn(tensor, group=self.group, async_op=True, **kwargs)
        self._ops += 1
        if not self._coalesce:
            self.works.append(work)


def wait_all(works: list) -> None:
    """Make the current stream wait for ``works`` (on the CPU/gloo: block until done)."""
    for work in works:
        work.wait()
    works.clear()


# ---- streams -------------------------------------------------------------------------
class Streams:
    """The compute stream plus side streams for the gradient reduces (shard and replicate stage).

    On the CPU every method is a no-op, so the runtime reads the same on both.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._module = None if device.type == "cpu" else torch.get_device_module(device)
        if self._module is not None:
            # high priority, as FSDP2's reduce-scatter stream: its copies must not queue behind compute
            self.reduce = self._module.Stream(device=device, priority=-1)
            self.replicate = self._module.Stream(device=device)
        else:
            self.reduce = self.replicate = None

    def use(self, stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if stream is None else self._module.stream(stream)

    def current(self):
        return None if self._module is None else self._module.current_stream(self.device)

    def wait(self, waiter, waited) -> None:
        """``waiter`` (a stream; None = current) waits for all work queued so far on ``waited``."""
        if self._module is None:
            return
        (waiter or self.current()).wait_stream(waited or self.current())

    def keep_alive_on(self, tensor: torch.Tensor, stream) -> None:
        """The caching allocator must not reuse ``tensor``'s memory before ``stream`` is done with it."""
        if self._module is not None and stream is not None:
            tensor.record_stream(stream)


def free_storage(tensor: torch.Tensor) -> int:
    """Release the tensor's memory (views keep their metadata); returns the bytes freed."""
    storage = tensor.untyped_storage()
    freed = storage.size()
    if freed:
        storage.resize_(0)
    return freed


def alloc_storage(tensor: torch.Tensor) -> int:
    """Re-allocate a freed tensor's memory in place; returns the bytes allocated."""
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if storage.size() == nbytes:
        return 0
    storage.resize_(nbytes)
    return nbytes
