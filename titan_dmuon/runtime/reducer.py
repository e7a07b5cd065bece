"""Backward: each layer's gradients reduced to their owners, off the compute stream.

A unit's gradients are copied (and cast to the reduce dtype) into one flat
buffer per bucket on the compute stream, which frees autograd's gradients at
once; the shard-stage reduces then go out as one launch from the reduce
stream. The compute stream never waits for them until the end of backward.

Under HSDP the shard owner forwards its reduced bucket across the replicate
group to the one global owner. That replicate stage is issued at the *next*
program point (the next unit's post-backward, or the end of backward) from the
replicate stream, after the shard stage it depends on: collectives go out at
the same points in the same order on every rank (gloo and NCCL match them by
order; chaining "whenever a reduce completes" once deadlocked HSDP), and on
the CPU the host waits only for the previous layer's reduce, which a layer of
backward compute has usually hidden.

Buffers outlive their collectives: each flat is recorded on the side streams
that use it and dropped only after those streams waited for its collective.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from titan_dmuon.runtime.comm import CommStats, Launch, Streams, wait_all
from titan_dmuon.runtime.unit import Bucket, Member, Unit


class Stage(enum.Enum):
    SHARD = "shard"  # reduced to the shard owner within the shard group
    REPLICATE = "replicate"  # (HSDP) reduced on to the global owner across the replicate group


@dataclass(eq=False)
class _Flight:
    """One launch in flight and the buffers it reads and writes."""

    stage: Stage
    works: list
    stream: object  # the side stream it was issued from
    items: list[tuple[Bucket, list[Member], torch.Tensor]]  # bucket, members with a gradient (flat order), flat


class GradientReducer:
    def __init__(
        self,
        *,
        shard_group,
        shard_size: int,
        shard_rank: int,
        replicate_group,
        replicate_size: int,
        replicate_rank: int,
        reduce_dtype: torch.dtype | None,
        divide_factor: float,
        streams: Streams,
        stats: CommStats,
    ) -> None:
        self.shard_group, self.shard_size, self.shard_rank = shard_group, shard_size, shard_rank
        self.replicate_group, self.replicate_size, self.replicate_rank = replicate_group, replicate_size, replicate_rank
        self.reduce_dtype = reduce_dtype
        self.divide_factor = divide_factor
        self.streams = streams
        self.stats = stats
        self._in_flight: list[_Flight] = []
        self._done: list[tuple[Bucket, list[Member], torch.Tensor]] = []  # reduced buckets this rank owns

    @torch.no_grad()
    def reduce(self, unit: Unit) -> None:
        """Post-backward of ``unit``: move earlier launches on, then launch this unit's shard stage."""
        self._advance()
        items = self._copy_in(unit)
        if not items:
            return
        streams = self.streams
        streams.wait(streams.reduce, None)  # the reduce stream starts after the copy-in
        with streams.use(streams.reduce):
            with Launch(self.shard_group, self.shard_size, items[0][2].device, "dmuon.shard_reduce", self.stats) as launch:
                for bucket, _, flat in items:
                    streams.keep_alive_on(flat, streams.reduce)
                    launch.reduce(flat, dst=bucket.shard_owner)
        self._in_flight.append(_Flight(Stage.SHARD, launch.works, streams.reduce, items))

    def _copy_in(self, unit: Unit) -> list[tuple[Bucket, list[Member], torch.Tensor]]:
        """One flat buffer per bucket, filled by copy_ (and cast) from the compute grads, which are freed."""
        items = []
        for bucket in unit.buckets:
            members = [m for m in bucket.members if m.compute.grad is not None]
            if not members:
                continue
            dtype = self.reduce_dtype or members[0].compute.grad.dtype
            flat = torch.empty(sum(m.entry.numel for m in members), dtype=dtype, device=members[0].compute.device)
            offset = 0
            for m in members:
                flat[offset : offset + m.entry.numel].view(m.entry.shape).copy_(m.compute.grad)
                m.compute.grad = None
                offset += m.entry.numel
            items.append((bucket, members, flat))
        return items

    def _advance(self) -> None:
        """Every launch issued so far moves one stage on; a program point, the same on every rank."""
        flights, self._in_flight = self._in_flight, []
        for flight in flights:
            # non-owners' flats hold partial sums (dist.reduce overwrites them): dropped below
            mine = [item for item in flight.items if item[0].shard_owner == self.shard_rank]
            if flight.stage is Stage.SHARD and self.replicate_size > 1:
                self._launch_replicate_stage(flight, mine)
                continue
            with self.streams.use(flight.stream):
                wait_all(flight.works)
            self._done += [item for item in mine if item[0].replicate_owner == self.replicate_rank]

    def _launch_replicate_stage(self, flight: _Flight, mine) -> None:
        streams = self.streams
        with streams.use(streams.replicate):
            wait_all(flight.works)  # the replicate stream (not the compute stream) waits for the shard stage
            for _, _, flat in flight.items:  # that wait, not the reduce stream, orders them after the shard
                streams.keep_alive_on(flat, streams.replicate)  # stage: non-owners' flats are freed below
            device = flight.items[0][2].device
            with Launch(self.replicate_group, self.replicate_size, device, "dmuon.replicate_reduce", self.stats) as launch:
                for bucket, _, flat in mine:
                    launch.reduce(flat, dst=bucket.replicate_owner)
        self._in_flight.append(_Flight(Stage.REPLICATE, launch.works, streams.replicate, mine))

    @torch.no_grad()
    def finish(self) -> None:
        """End of backward: finish every stage, then hand the global owners their gradients."""
        while self._in_flight:
            self._advance()
        streams = self.streams
        streams.wait(None, streams.reduce)
        streams.wait(None, streams.replicate)
        for _, members, flat in self._done:
            offset = 0
            for m in members:
                grad = flat[offset : offset + m.entry.numel].view(m.entry.shape).to(m.param.dtype)
                if self.divide_factor != 1.0:
                    grad.div_(self.divide_factor)
                if m.param.grad is None:
                    m.param.grad = grad  # a view of the bucket's buffer: no copy
                else:
                    m.param.grad.add_(grad)  # gradient accumulation across micro-batches
                offset += m.entry.numel
        self._done.clear()
