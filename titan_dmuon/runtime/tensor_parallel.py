"""The Muon step of tensor-parallel shards: Newton–Schulz once per matrix, on its NS home.

Under tensor parallelism a dedicated weight's owner is a data-parallel coordinate, and the T
ranks of its TP group hold its T shards (``PlanEntry.tp_dim``). Newton–Schulz needs the whole
matrix, so per batch of matrices (a step chunk):

1. ``send_to_homes``: every TP rank sends the bf16 Newton–Schulz input of its shards to each
   matrix's home (``PlanEntry.tp_home``): one all-to-all on the TP group;
2. ``orthogonalise_at_homes``: each home assembles its matrices (shards concatenated along
   ``tp_dim``), orthogonalises every row block, and sends each rank its shard of the result: one
   all-to-all back;
3. ``received``: this rank's shards of the results.

The optimizer runs these for consecutive chunks as a pipeline: chunk k+1's shards go out while
chunk k's results come back and are applied (and sent on to the next forward), so the TP transfers
overlap the step's other work. On an accelerator the all-to-alls run on the handle's reduce stream
(idle during the step), ordered by events after the compute stream's writes of what they send,
and the compute stream waits for an event before reading what they received; the buffers are held
by the pending objects until then (no ``record_stream``), as FSDP2 holds its own.

Each direction moves (T-1)/T of the shards, (T-1)/T^2 of the owned full matrices per rank on
average: 2(T-1)/T^2 x owned elements per step, on the TP group only (intra-node on clusters).
Everything else (momentum, weight decay, the update) stays elementwise on the shards, so the result
is the single-device update of the full matrix: bitwise ``torch.optim.Muon``'s with ``ns_mode="exact"``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from titan_dmuon.muon_math import _put_rows, _take_rows
from titan_dmuon.plan import PlanEntry
from titan_dmuon.runtime.comm import CommStats, InFlight, Launch
from titan_dmuon.runtime.mode import TensorParallelInfo
from titan_dmuon.runtime.streams import Streams


@dataclass(eq=False)
class Exchange:
    """One all-to-all in flight, and the buffers it reads and writes (alive until it was waited for)."""

    entries: Sequence[PlanEntry]
    sent: torch.Tensor
    received: torch.Tensor
    in_flight: InFlight
    ns_matrices: int = 0


class TensorParallelNewtonSchulz:
    """Orthogonalises TP-sharded matrices on their homes; one object per handle."""

    def __init__(self, tp: TensorParallelInfo, stats: CommStats, streams: Streams) -> None:
        self.tp, self.stats, self.streams = tp, stats, streams

    def orthogonalise(
        self,
        entries: Sequence[PlanEntry],
        shards: Sequence[torch.Tensor],
        orthogonalise_fn: Callable[[list[torch.Tensor]], list[torch.Tensor]],
    ) -> tuple[list[torch.Tensor], int]:
        """The three steps at once: this rank's shards of the orthogonalised matrices, and the number
        of Newton–Schulz matrices (row blocks) it ran."""
        back = self.orthogonalise_at_homes(self.send_to_homes(entries, shards), orthogonalise_fn)
        return self.received(back), back.ns_matrices

    def send_to_homes(self, entries: Sequence[PlanEntry], shards: Sequence[torch.Tensor]) -> Exchange:
        """``shards``: this rank's bf16 NS inputs of ``entries`` (the same entries, in the same order, on
        every rank of the TP group), sent to their homes."""
        size, me = self.tp.size, self.tp.rank
        order = self._by_home(entries)
        send = torch.cat([shards[i].reshape(-1) for i in order])
        per_source = sum(e.numel for e in entries if e.tp_home == me)
        received = send.new_empty(per_source * size)
        in_flight = self._issue("dmuon.tp_to_home", received, send, [per_source] * size, self._home_splits(entries))
        return Exchange(entries=entries, sent=send, received=received, in_flight=in_flight)

    def orthogonalise_at_homes(
        self, sent: Exchange, orthogonalise_fn: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    ) -> Exchange:
        """Wait for ``sent``, orthogonalise the matrices homed here, send each rank its shards."""
        size, me, entries = self.tp.size, self.tp.rank, sent.entries
        sent.in_flight.wait()
        homed = [i for i, e in enumerate(entries) if e.tp_home == me]
        per_source = sum(entries[i].numel for i in homed)
        matrices, start = [], 0
        for i in homed:
            entry = entries[i]
            parts = [sent.received[s * per_source + start : s * per_source + start + entry.numel].view(entry.shape)
                     for s in range(size)]
            matrices.append(torch.cat(parts, dim=entry.tp_dim))
            start += entry.numel
        blocks = [(k, block) for k, i in enumerate(homed) for block in entries[i].blocks]
        results = orthogonalise_fn([_take_rows(matrices[k], block).contiguous() for k, block in blocks]) if blocks else []
        for (k, block), result in zip(blocks, results):
            if len(entries[homed[k]].blocks) == 1:
                matrices[k] = result
            else:
                _put_rows(matrices[k], block, result)
        send = (torch.cat([m.chunk(size, dim=entries[i].tp_dim)[s].reshape(-1)
                           for s in range(size) for m, i in zip(matrices, homed)])
                if homed else sent.sent.new_empty(0))
        received = sent.sent.new_empty(sum(e.numel for e in entries))
        in_flight = self._issue("dmuon.tp_from_home", received, send, self._home_splits(entries), [per_source] * size)
        return Exchange(entries=entries, sent=send, received=received, in_flight=in_flight, ns_matrices=len(blocks))

    def received(self, back: Exchange) -> list[torch.Tensor]:
        """Wait for ``back``: this rank's shards of the results, in ``entries`` order (views of its buffer)."""
        back.in_flight.wait()
        out: list[torch.Tensor | None] = [None] * len(back.entries)
        offset = 0
        for i in self._by_home(back.entries):
            out[i] = back.received[offset : offset + back.entries[i].numel].view(back.entries[i].shape)
            offset += back.entries[i].numel
        return out

    def _by_home(self, entries: Sequence[PlanEntry]) -> list[int]:
        return [i for home in range(self.tp.size) for i, e in enumerate(entries) if e.tp_home == home]

    def _home_splits(self, entries: Sequence[PlanEntry]) -> list[int]:
        return [sum(e.numel for e in entries if e.tp_home == home) for home in range(self.tp.size)]

    def _issue(self, source: str, output, input, output_splits, input_splits) -> InFlight:
        """The all-to-all from the reduce stream (after the current stream's writes of ``input``);
        the returned InFlight is what a reader of ``output`` waits for."""
        stream = self.streams.reduce
        if stream is not None:
            self.streams.wait_stream(stream)
        with self.streams.use(stream):
            with Launch(self.tp.group, self.tp.size, self.streams.device, source, self.stats, coalesce=False) as launch:
                launch.all_to_all(output, input, output_splits, input_splits)
        return launch.in_flight
