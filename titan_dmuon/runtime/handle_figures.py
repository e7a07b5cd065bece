"""The figures a handle gives the training log: its communication, buffer memory, host time, waits.

Mixed into ``DedicatedParams`` (``handle.py``), whose ``_ctx`` (``RuntimeContext``: the counters the
runtime keeps) and ``mode`` it reads; the methods are the handle's own public names.
"""

from __future__ import annotations

import contextlib
from fractions import Fraction

from titan_dmuon.runtime.comm import CommLabel


class HandleFigures:
    """What a handle has counted and timed on this rank (read by the training log and the tests)."""

    def pop_comm_stats(self) -> dict[str, tuple[Fraction, Fraction, int]]:
        """{label: (elements, bytes, launches)} issued by DMuon on this rank since the last call."""
        return self._ctx.stats.pop()

    @property
    def buffer_bytes(self) -> int:
        """Packed-buffer memory allocated now on this rank."""
        return self._ctx.buffer_bytes

    @property
    def peak_buffer_bytes(self) -> int:
        """Its high-water mark since ``reset_peak_buffer_bytes()``."""
        return self._ctx.peak_buffer_bytes

    def reset_peak_buffer_bytes(self) -> None:
        self._ctx.peak_buffer_bytes = self._ctx.buffer_bytes

    def pop_host_seconds(self) -> float:
        """Host time spent in DMuon's hooks (forward and backward) since the last call."""
        seconds, self._ctx.host_seconds = self._ctx.host_seconds, 0.0
        return seconds

    @property
    def first_layer_wait_seconds(self) -> float:
        """How long the last forward's first layer waited for its weights, broadcast since the step
        updated them (a device-event span on an accelerator: the compute stream's stall; the host's
        wait on the CPU). Reading it syncs with the device once."""
        return self._ctx.first_wait.seconds()

    @property
    def kept_unit_numel(self) -> int:
        """Z3: elements of the unit kept from forward to backward (the last one forward runs).

        Known after the first step; 0 before, and in Z2 (where every unit is kept)."""
        ctx = self._ctx
        if not self.mode.reshard_after_forward or ctx.recording or not ctx.forward_order:
            return 0
        return ctx.forward_order[-1].numel

    @contextlib.contextmanager
    def outside_steps(self):
        """Forwards between training steps (an evaluation) inside, kept out of the step figures: their
        collectives and host time are not counted. They use the first layer's broadcast that each step
        starts for the next forward, so on the way out (the same program point on every rank) it is
        started again: the next step runs, and is counted, as after a step."""
        ctx, host = self._ctx, self._ctx.host_seconds
        try:
            with ctx.stats.left_out():
                yield
                first = self.first_of_next_forward()
                if first is not None:
                    first.gather(CommLabel.FORWARD_BROADCAST)
        finally:
            ctx.host_seconds = host

    def first_of_next_forward(self):
        """The unit whose broadcast each step starts for the next forward (None until the order is known)."""
        ctx = self._ctx
        known = self._step_hooks.initialized and not ctx.recording and ctx.forward_order
        return ctx.forward_order[0] if known else None
