"""The streams DMuon's collectives run on, and the events that order them (FSDP2's pattern).

* ``gather``: owners copy their weights into a layer's buffer and broadcast it. It never waits
  for the compute stream's queued kernels as such: it waits for the optimizer's update of the
  weights it reads (an event per layer) and, before reusing memory that compute has read, for
  the event recorded when compute was done with it.
* ``reduce``: a layer's gradient reduces to their owners, after the compute stream's copy-in.
* ``replicate`` (HSDP): the replicate-group reduces, and the post-step broadcasts to replicas.

Buffers are kept alive by references and freed only after the stream that will reuse their
memory has waited for their last use (no ``record_stream``). High priority for the side
streams, as FSDP2's: their copies must not queue behind compute. On the CPU there are no
streams: every method is a no-op and events are None, so the runtime reads the same on both.
"""

from __future__ import annotations

import contextlib
import time

import torch


class Streams:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._module = None if device.type == "cpu" else torch.get_device_module(device)
        if self._module is None:
            self.gather = self.reduce = self.replicate = None
        else:
            self.gather = self._module.Stream(device=device, priority=-1)
            self.reduce = self._module.Stream(device=device, priority=-1)
            self.replicate = self._module.Stream(device=device)

    def use(self, stream) -> contextlib.AbstractContextManager:
        """Make ``stream`` current for the block (a no-op on the CPU)."""
        return contextlib.nullcontext() if stream is None else self._module.stream(stream)

    def record(self, stream=None) -> torch.Event | None:
        """An event at the end of what is queued on ``stream`` (default: the current one)."""
        if self._module is None:
            return None
        return (stream or self._module.current_stream(self.device)).record_event()

    def wait_event(self, stream, event: torch.Event | None) -> None:
        """``stream`` (None: the current one) waits for ``event`` (None: nothing to wait for)."""
        if event is not None:
            (stream or self._module.current_stream(self.device)).wait_event(event)

    def wait_stream(self, waiter, waited=None) -> None:
        """``waiter`` waits for all work queued so far on ``waited`` (None: the current stream)."""
        if self._module is not None:
            waiter.wait_stream(waited or self._module.current_stream(self.device))


def synchronize_device(device: torch.device) -> None:
    """The host waits for everything queued on ``device``, every stream (a no-op on the CPU, where
    the work is done when its call returns). For checkpoints and recovery only: DCP's background
    stager and TorchFT's checkpoint transfer copy live tensors from another thread and stream,
    which nothing orders after the step's writes (the step itself never syncs the host). The
    device is named: TorchFT calls from its quorum thread, whose current device may be another."""
    if device.type != "cpu":
        torch.get_device_module(device).synchronize(device)


class DeviceTimer:
    """Times work queued on a device without syncing the host: events are recorded now
    and read at log time (on the CPU, where work is synchronous, a host clock)."""

    def __init__(self, device: torch.device) -> None:
        self._module = None if device.type == "cpu" else torch.get_device_module(device)
        self._spans: list = []

    @contextlib.contextmanager
    def timing(self, *, accumulate: bool = False):
        if not accumulate:
            self._spans = []
        if self._module is None:
            start = time.perf_counter()
            yield
            self._spans.append(time.perf_counter() - start)
            return
        begin, end = self._module.Event(enable_timing=True), self._module.Event(enable_timing=True)
        begin.record()
        yield
        end.record()
        self._spans.append((begin, end))

    def seconds(self) -> float:
        """The timed spans since the last non-accumulating ``timing()``; waits for them on a device."""
        total = 0.0
        for span in self._spans:
            if isinstance(span, float):
                total += span
            else:
                span[1].synchronize()
                total += span[0].elapsed_time(span[1]) / 1e3
        return total
