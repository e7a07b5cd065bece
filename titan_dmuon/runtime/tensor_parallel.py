"""The Muon step of tensor-parallel shards: Newton–Schulz once per matrix, on its NS home.

Under tensor parallelism a dedicated weight's owner is a data-parallel coordinate, and the T
ranks of its TP group hold its T shards (``PlanEntry.tp_dim``). Newton–Schulz needs the whole
matrix, so per batch of matrices (a step chunk):

1. every TP rank sends the bf16 Newton–Schulz input of its shards to each matrix's home
   (``PlanEntry.tp_home``): one all-to-all on the TP group;
2. each home assembles its matrices (shards concatenated along ``tp_dim``), orthogonalises every
   row block, and sends each rank its shard of the result: one all-to-all back.

Each direction moves (T-1)/T of the shards, (T-1)/T^2 of the owned full matrices per rank on
average: 2(T-1)/T^2 x owned elements per step, on the TP group only (intra-node on clusters).
Everything else (momentum, weight decay, the update) stays elementwise on the shards, so the result
is the single-device update of the full matrix: bitwise ``torch.optim.Muon``'s with ``ns_mode="exact"``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from titan_dmuon.muon_math import _put_rows, _take_rows
from titan_dmuon.plan import PlanEntry
from titan_dmuon.runtime.comm import CommStats, Launch
from titan_dmuon.runtime.mode import TensorParallelInfo


class TensorParallelNewtonSchulz:
    """Orthogonalises TP-sharded matrices on their homes; one object per handle."""

    def __init__(self, tp: TensorParallelInfo, stats: CommStats, device: torch.device) -> None:
        self.tp, self.stats, self.device = tp, stats, device

    def orthogonalise(
        self,
        entries: Sequence[PlanEntry],
        shards: Sequence[torch.Tensor],
        orthogonalise_fn: Callable[[list[torch.Tensor]], list[torch.Tensor]],
    ) -> tuple[list[torch.Tensor], int]:
        """``shards``: this rank's bf16 NS inputs of ``entries`` (the same entries, in the same order,
        on every rank of the TP group). Returns this rank's shards of the orthogonalised matrices and
        the number of Newton–Schulz matrices (row blocks) it ran."""
        size, me = self.tp.size, self.tp.rank
        numels = [e.numel for e in entries]
        homed = [i for i, e in enumerate(entries) if e.tp_home == me]
        per_source = sum(numels[i] for i in homed)
        # 1. shards to their homes
        order = [i for home in range(size) for i, e in enumerate(entries) if e.tp_home == home]
        send = torch.cat([shards[i].reshape(-1) for i in order]) if order else shards[0].new_empty(0)
        send_splits = [sum(numels[i] for i, e in enumerate(entries) if e.tp_home == home) for home in range(size)]
        received = send.new_empty(per_source * size)
        self._exchange("dmuon.tp_to_home", received, send, [per_source] * size, send_splits)
        # 2. assemble, orthogonalise each row block
        matrices, count = [], 0
        for k, i in enumerate(homed):
            entry, start = entries[i], sum(numels[j] for j in homed[:k])
            parts = [received[s * per_source + start : s * per_source + start + numels[i]].view(entry.shape)
                     for s in range(size)]
            matrices.append(torch.cat(parts, dim=entry.tp_dim))
        blocks = [(k, block) for k, i in enumerate(homed) for block in entries[i].blocks]
        results = orthogonalise_fn([_take_rows(matrices[k], block).contiguous() for k, block in blocks])
        count += len(blocks)
        for (k, block), result in zip(blocks, results):
            if len(entries[homed[k]].blocks) == 1:
                matrices[k] = result
            else:
                _put_rows(matrices[k], block, result)
        # 3. each rank's shard back
        send_back = (torch.cat([m.chunk(size, dim=entries[i].tp_dim)[s].reshape(-1)
                                for s in range(size) for m, i in zip(matrices, homed)])
                     if homed else send.new_empty(0))
        back = send.new_empty(sum(numels))
        self._exchange("dmuon.tp_from_home", back, send_back, send_splits, [per_source] * size)
        out: list[torch.Tensor | None] = [None] * len(entries)
        offset = 0
        for i in order:
            out[i] = back[offset : offset + numels[i]].view(entries[i].shape)
            offset += numels[i]
        return out, count

    def _exchange(self, source: str, output, input, output_splits, input_splits) -> None:
        with Launch(self.tp.group, self.tp.size, self.device, source, self.stats, coalesce=False) as launch:
            launch.all_to_all(output, input, output_splits, input_splits)
        launch.in_flight.wait()
