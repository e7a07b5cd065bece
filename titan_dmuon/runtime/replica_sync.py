"""HSDP: after a layer's weights are updated, its global owners send them to their replicate peers.

In every replicate group the rank at a weight's shard index holds the full
weight (an owner group's member: its block); only one of them (the global owner,
the group's member) ran Newton–Schulz. As soon as a
layer's update is applied (``DMuon.step`` goes layer by layer in forward order)
its new values are broadcast across the replicate group, straight into the
peers' persistent weights (no staging copy), one launch per unit, from the
replicate stream after the update's event. Who reads them waits on the stream
that reads: the layer's next gather (gather stream), the global owner's next
update of it (compute stream), a checkpoint (the host: DCP may stage it from
another thread and stream).
"""

from __future__ import annotations

import torch

from titan_dmuon.runtime.comm import CommLabel, CommStats, InFlight, Launch
from titan_dmuon.runtime.mode import DedicationMode
from titan_dmuon.runtime.streams import Streams


class ReplicaSync:
    def __init__(self, *, mode: DedicationMode, streams: Streams, stats: CommStats) -> None:
        self.mode = mode
        self.streams = streams
        self.stats = stats
        self._in_flight: dict[int, InFlight] = {}  # unit index -> its broadcasts

    @torch.no_grad()
    def broadcast(self, unit, *, source: CommLabel) -> None:
        """Send ``unit``'s held weights from their global owners (a program point on every rank)."""
        mesh = self.mode.mesh
        if not mesh.hsdp:
            return
        self.wait(unit)
        holding = [b for b in unit.buckets if b.shard_owner == mesh.shard_rank]
        if not holding:
            return
        with self.streams.use(self.streams.replicate):
            self.streams.wait_event(None, unit.weights_event)
            with Launch(
                mesh.replicate_group, mesh.replicate_size, mesh.device, source, self.stats, coalesce=mesh.coalesces
            ) as launch:
                for bucket in holding:
                    for piece in bucket.pieces:  # (this rank's weight, or its block of an owner group)
                        launch.broadcast(piece.member.param.detach(), src=bucket.replicate_owner)
        self._in_flight[unit.index] = launch.in_flight

    def wait(self, unit, stream=None) -> None:
        """``stream`` (default: the current one) waits for ``unit``'s broadcasts."""
        in_flight = self._in_flight.pop(unit.index, None)
        if in_flight is not None:
            in_flight.wait(stream)

    def wait_all(self, stream=None) -> None:
        for unit_index in list(self._in_flight):
            self._in_flight.pop(unit_index).wait(stream)

    def synchronize_all(self) -> None:
        """The host waits for every broadcast in flight (before a checkpoint reads the weights)."""
        for unit_index in list(self._in_flight):
            self._in_flight.pop(unit_index).synchronize()
