"""What a handle's units share: the mode, the streams, the reducer, the forward order, counters.

As FSDP2's ``FSDPCommContext`` is shared by its parameter groups. The forward
order is recorded in the first step; from then on prefetching follows it and
every forward and backward is checked against it, so that a rank that skips a
layer (or whose gradient does not reach one) stops with an error naming the
layer before it issues a collective its peers do not (which would hang them).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from titan_dmuon.runtime.comm import CommStats
from titan_dmuon.runtime.mode import DedicationMode
from titan_dmuon.runtime.streams import DeviceTimer, Streams

if TYPE_CHECKING:
    from titan_dmuon.runtime.owner_group_comm import OwnerGroupComm
    from titan_dmuon.runtime.reducer import GradientReducer
    from titan_dmuon.runtime.replica_sync import ReplicaSync


class Phase(enum.Enum):
    """A unit's place in the step."""

    IDLE = "idle"  # between steps, or after its backward
    FORWARD = "forward"  # between pre- and post-forward
    AWAITING_BACKWARD = "awaiting_backward"  # forward done; its gradients will come
    BACKWARD = "backward"  # its backward started; gradients are accumulating


class UnitOrderError(RuntimeError):
    """A layer ran (or got its gradient) out of the order every rank follows."""


@dataclass(eq=False)
class RuntimeContext:
    mode: DedicationMode
    stats: CommStats
    streams: Streams
    reducer: GradientReducer | None = None
    replicas: ReplicaSync | None = None  # HSDP only
    owner_groups: OwnerGroupComm | None = None  # the process groups of the owner groups this rank is in
    units: list = field(default_factory=list)
    forward_order: list = field(default_factory=list)
    recording: bool = True  # the first forward+backward records the order of the units
    gradient_sync: bool = True  # False: gradients accumulate on every rank until reduced
    is_last_backward: bool = True  # False: a backward's end leaves its reduces in flight (pipelining)
    buffer_bytes: int = 0  # packed-buffer memory allocated now on this rank
    peak_buffer_bytes: int = 0  # its high-water mark since the last reset
    host_seconds: float = 0.0  # host time in DMuon's hooks since the last read (Python and launches)
    first_wait: DeviceTimer | None = None  # how long the first layer waited for its weights at a forward
    _position: int = -1  # index in forward_order of the last unit whose forward ran this pass

    def __post_init__(self) -> None:
        self.first_wait = DeviceTimer(self.mode.mesh.device)

    # ---- order ------------------------------------------------------------------------------
    def begin_forward(self) -> None:
        self._position = -1

    def enter_forward(self, unit) -> None:
        """Record the order in the first step; later, every unit must come in that order."""
        if self.recording:
            if unit not in self.forward_order:
                self.forward_order.append(unit)
            return
        if unit not in self.forward_order:
            raise UnitOrderError(
                f"layer {unit.name!r} ran forward for the first time after the first step: DMuon records the "
                "order of the dedicated layers in the first step and every later step must run the same layers"
            )
        position = self.forward_order.index(unit)
        if position != self._position + 1:
            skipped = [u.name for u in self.forward_order[self._position + 1 : position]]
            what = f"layer(s) {skipped} did not run before it" if skipped else "it ran out of order (or twice)"
            raise UnitOrderError(
                f"layer {unit.name!r} ran forward but {what} in this forward pass. DMuon broadcasts each dedicated "
                "layer's weights in the order of the first step, on every rank; a rank that skips or reorders a "
                "layer would wait forever for its peers. Run the same dedicated layers in the same order on every "
                "rank and in every step (or leave the weights of optional layers off Muon)"
            )
        self._position = position

    def check_backward_order(self, unit) -> None:
        """On entering ``unit``'s backward, every layer after it in forward order has had its own."""
        if not self.gradient_sync or unit not in self.forward_order:
            return
        for later in self.forward_order[self.forward_order.index(unit) + 1 :]:
            if later.phase is Phase.AWAITING_BACKWARD:
                raise UnitOrderError(
                    f"layer {later.name!r} ran forward but got no gradient before layer {unit.name!r}'s backward: "
                    "its output does not reach the loss on this rank. Every rank must reduce every dedicated "
                    "layer's gradients at the same point; make its output reach the loss, run it under "
                    "torch.no_grad(), or leave its weights off Muon"
                )

    def neighbour(self, unit, step: int):
        """The unit ``step`` places after ``unit`` in forward order (None while recording)."""
        if self.recording or unit not in self.forward_order:
            return None
        i = self.forward_order.index(unit) + step
        return self.forward_order[i] if 0 <= i < len(self.forward_order) else None

    def is_last_in_forward(self, unit) -> bool:
        return not self.recording and bool(self.forward_order) and unit is self.forward_order[-1]

    def units_in_order(self) -> list:
        """Units in forward order (known after the first step), then any not seen in forward."""
        return self.forward_order + [u for u in self.units if u not in self.forward_order]

    # ---- memory ---------------------------------------------------------------------------------
    def track_buffer(self, delta: int) -> None:
        self.buffer_bytes += delta
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, self.buffer_bytes)
