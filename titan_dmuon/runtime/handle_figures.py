"""The figures a handle gives the training log: its communication, buffer memory, host time, waits.

Mixed into ``DedicatedParams`` (``handle.py``), whose ``_ctx`` (``RuntimeContext``: the counters the
runtime keeps) and ``mode`` it reads; the methods are the handle's own public names.
"""

from __future__ import annotations

from fractions import Fraction


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
