"""HSDP: after the optimizer step, each weight's global owner sends it to its replicate peers.

In every replicate group the rank at a weight's shard index holds the full
weight; only one of them (the global owner) ran Newton–Schulz. After the step
it broadcasts the new value across the replicate group, straight into the
peers' persistent weights (no staging copy), one launch per unit. The
broadcasts run while the next step starts; the unit's next gather, a
state-dict read or the next optimizer step waits for them first.
"""

from __future__ import annotations

from titan_dmuon.runtime.comm import CommStats, Launch, wait_all
from titan_dmuon.runtime.unit import Unit


class ReplicaSync:
    def __init__(self, *, replicate_group, replicate_size: int, shard_rank: int, stats: CommStats) -> None:
        self.replicate_group = replicate_group
        self.replicate_size = replicate_size
        self.shard_rank = shard_rank
        self.stats = stats
        self._works: dict[int, list] = {}  # unit index -> launch in flight

    def start(self, units: list[Unit], *, source: str) -> None:
        """Broadcast every held weight from its global owner (a program point on every rank)."""
        if self.replicate_size == 1:
            return
        for unit in units:
            self.wait(unit)
            holding = [b for s in unit.segments if s.shard_owner == self.shard_rank for b in s.buckets]
            if not holding:
                continue
            device = holding[0].members[0].param.device
            with Launch(self.replicate_group, self.replicate_size, device, source, self.stats) as launch:
                for bucket in holding:
                    for m in bucket.members:
                        launch.broadcast(m.param.detach(), src=bucket.replicate_owner)
            self._works[unit.index] = launch.works

    def wait(self, unit: Unit) -> None:
        wait_all(self._works.pop(unit.index, []))

    def wait_all(self) -> None:
        for works in self._works.values():
            wait_all(works)
        self._works.clear()
