"""The Muon step of tensor-parallel shards: Newton–Schulz once per matrix, on its NS home.

Under tensor parallelism a dedicated weight's owner is a data-parallel coordinate, and the T
ranks of its TP group hold its T shards (``PlanEntry.tp_dim``), or T copies of a weight TP
replicates (a router, MLA's ``wkv_a``); experts FSDP2 keeps in place are held the same way by the
TP group of each data-parallel rank. Newton–Schulz needs the whole matrix, and each matrix (each
expert of a stack: ``TPMatrix``) has one home in the TP group (``PlanEntry.tp_homes``), so per batch
of matrices (of at most ``tensor_parallel_update.MAX_EXCHANGE_BYTES``):

1. ``send_to_homes``: every TP rank sends the bf16 Newton–Schulz input of its shards to each
   matrix's home (one all-to-all on the TP group; a replicated matrix's home has its input already);
2. ``orthogonalise_at_homes``: each home assembles its matrices (shards concatenated along their
   split dim), orthogonalises every (row block, column block) pair, applies the optimizer's rule to
   each result where it has one (NorMuon, whose statistics cover whole rows: exact here, where the
   whole matrix is), and sends each rank its shard of the result (the whole result of a replicated
   matrix), in the Newton–Schulz dtype: one all-to-all back;
3. ``received``: this rank's shards of the results.

The step runs these for consecutive batches of matrices as a pipeline (``tensor_parallel_update.py``:
batch k+1's shards are sent before batch k's Newton–Schulz, batch k's results applied after batch
k+1's), so the TP transfers overlap Newton–Schulz. On an accelerator the all-to-alls run on the
handle's reduce stream (idle during the step), each after an event recorded once the compute stream
has written what it sends, and the compute stream waits for an event before reading what they
received; the buffers are held by the ``Exchange`` objects until then (no ``record_stream``), as
FSDP2 holds its own.

A sharded matrix moves (T-1)/T of its shards each way: 2(T-1)/T^2 of its full elements; a
replicated one (T-1) copies of it, back only. Everything else (momentum, weight decay, the update)
stays elementwise on the shards, so the result is the single-device update of the full matrix:
bitwise ``torch.optim.Muon``'s with ``ns_mode="exact"``.

Outside the step a TP shard is turned into its full matrix and back by ``tp_full`` (export),
``tp_local`` (loads, initialisation) and ``as_sharded`` (DCP's view of a shard as the full matrix).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from titan_dmuon.math.matrix_blocks import block_rows, put_tile, tile_ranges
from titan_dmuon.math.ns_methods import Scratch, fresh
from titan_dmuon.plan.specs import TPMatrix
from titan_dmuon.runtime.comm import CommLabel, CommStats, InFlight, Launch, comm_source
from titan_dmuon.runtime.members import Member
from titan_dmuon.runtime.mode import TensorParallelInfo
from titan_dmuon.runtime.streams import Streams


def tp_full(tp: TensorParallelInfo | None, member: Member, shard: torch.Tensor) -> torch.Tensor:
    """The full matrix from this rank's TP-local ``shard`` of ``member`` (an all-gather on the TP
    group: a collective); ``shard`` itself for a weight TP does not split."""
    if member.entry.tp_dim is None:
        return shard
    parts = [torch.empty_like(shard) for _ in range(tp.size)]
    with comm_source(CommLabel.EXPORT):
        dist.all_gather(parts, shard.contiguous(), group=tp.group)
    return torch.cat(parts, dim=member.entry.tp_dim)


def tp_local(tp: TensorParallelInfo | None, member: Member, full: torch.Tensor) -> torch.Tensor:
    """This rank's TP-local shard of a full value of ``member`` (a view); ``full`` itself for a
    weight TP does not split."""
    if member.entry.tp_dim is None:
        return full
    return full.chunk(tp.size, dim=member.entry.tp_dim)[tp.rank]


def as_sharded(tp: TensorParallelInfo | None, member: Member, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's TP shard of ``member``, e.g. its weight or momentum) as a DTensor of
    the full matrix on the TP mesh, for DCP, which then saves and reshards whole matrices; ``local``
    itself for a weight TP does not split."""
    if member.entry.tp_dim is None:
        return local
    full = torch.Size(member.entry.full_shape)
    return DTensor.from_local(
        local,
        tp.mesh,
        [Shard(member.entry.tp_dim)],
        run_check=False,
        shape=full,
        stride=torch.empty(full, device="meta").stride(),
    )


@dataclass(eq=False)
class Exchange:
    """One all-to-all in flight, and the buffers it reads and writes (alive until it was waited for;
    a send to the homes drops them once ``orthogonalise_at_homes`` has read them)."""

    matrices: Sequence[TPMatrix]
    sent: torch.Tensor | None
    received: torch.Tensor | None
    in_flight: InFlight
    ns_matrices: int = 0
    own: dict[int, torch.Tensor] = field(default_factory=dict)  # replicated matrices homed here: their inputs


class TensorParallelNewtonSchulz:
    """Orthogonalises TP-sharded (and TP-replicated) matrices on their homes; one object per handle."""

    def __init__(self, tp: TensorParallelInfo, stats: CommStats, streams: Streams) -> None:
        self.tp, self.stats, self.streams = tp, stats, streams

    def orthogonalise(
        self,
        matrices: Sequence[TPMatrix],
        shards: Sequence[torch.Tensor | None],
        orthogonalise_fn: Callable[[list[torch.Tensor]], list[torch.Tensor]],
        **at_homes,
    ) -> tuple[list[torch.Tensor], int]:
        """The three steps at once: this rank's shards of the orthogonalised matrices, and the number
        of Newton–Schulz matrices (blocks) it ran (``orthogonalise_fn``: inputs to results;
        ``at_homes``: ``orthogonalise_at_homes``' options)."""

        def each_result(inputs: list[torch.Tensor], consume) -> None:
            for j, result in enumerate(orthogonalise_fn(inputs)):
                consume(j, result)

        back = self.orthogonalise_at_homes(self.send_to_homes(matrices, shards), each_result, **at_homes)
        return self.received(back), back.ns_matrices

    def send_to_homes(
        self,
        matrices: Sequence[TPMatrix],
        shards: Sequence[torch.Tensor | None],
        *,
        scratch: Scratch = fresh,
        slot: int = 0,
    ) -> Exchange:
        """``shards``: this rank's bf16 NS inputs of ``matrices`` (the same matrices, in the same order,
        on every rank of the TP group), sent to their homes. A replicated matrix's input is needed on
        its home only (None elsewhere): it stays there (copied: ``shards`` may be reused at once). The
        buffers are ``scratch``'s, named by ``slot``: the step alternates two, as a batch's send is in
        flight while the next one is made."""
        size, me = self.tp.size, self.tp.rank
        sharded = [i for i in self._by_home(matrices) if matrices[i].dim is not None]
        homed_here = [i for i, m in enumerate(matrices) if m.dim is None and m.home == me]
        kept = _packed([shards[i] for i in homed_here], scratch, f"tp_kept{slot}", torch.bfloat16, self.streams.device)
        own = {
            i: kept[offset : offset + matrices[i].numel]
            for i, offset in zip(homed_here, _offsets([matrices[i].numel for i in homed_here]))
        }
        send = _packed(
            [shards[i] for i in sharded], scratch, f"tp_to_home_send{slot}", torch.bfloat16, self.streams.device
        )
        per_source = sum(m.numel for m in matrices if m.dim is not None and m.home == me)
        received = scratch(f"tp_to_home_received{slot}", (per_source * size,), send.dtype, send.device)
        if sharded:  # (the same on every rank: nothing to send when the chunk holds replicated matrices only)
            in_flight = self._issue(
                CommLabel.TP_TO_HOME,
                received,
                send,
                [per_source] * size,
                self._home_splits(matrices, sharded_only=True),
            )
        else:
            in_flight = InFlight()
        return Exchange(matrices=matrices, sent=send, received=received, in_flight=in_flight, own=own)

    def orthogonalise_at_homes(
        self,
        sent: Exchange,
        orthogonalise_fn: Callable[..., list[torch.Tensor] | None],
        *,
        dtype: torch.dtype = torch.bfloat16,
        rule: Callable[[int, int, torch.Tensor], torch.Tensor] | None = None,
        scratch: Scratch = fresh,
        slot: int = 0,
    ) -> Exchange:
        """Wait for ``sent``, orthogonalise the matrices homed here, send each rank its shards.

        ``sent``'s buffers are dropped once read (the current stream, which reuses their memory,
        waited for their transfer). ``orthogonalise_fn(inputs, consume=)`` passes each result, in
        ``dtype`` (the Newton–Schulz dtype, what travels back; the same on every rank), to
        ``consume(j, result)`` (``muon_update.orthogonalise``). ``rule(i, t, result)``: what the optimizer
        does to the result of tile ``t`` (``TPMatrix.tiles`` order) of ``matrices[i]`` before it travels
        back (NorMuon), or None. The assembled matrices, their tiles and results are ``scratch``'s; the
        buffers sent back too, named by ``slot`` (two alternate: a batch's results are in flight while
        the next batch's are made)."""
        size, me, matrices = self.tp.size, self.tp.rank, sent.matrices
        device = self.streams.device
        sent.in_flight.wait()
        homed = [i for i, m in enumerate(matrices) if m.home == me]
        per_source = sum(matrices[i].numel for i in homed if matrices[i].dim is not None)
        sizes = [matrices[i].numel * (1 if matrices[i].dim is None else size) for i in homed]
        assembled = scratch("tp_assembled", (sum(sizes),), torch.bfloat16, device)
        full, start = [], 0
        for i, offset, numel in zip(homed, _offsets(sizes), sizes):
            matrix = matrices[i]
            if matrix.dim is None:
                full.append(sent.own[i].view(matrix.shape))
                continue
            parts = [
                sent.received[s * per_source + start : s * per_source + start + matrix.numel].view(matrix.shape)
                for s in range(size)
            ]
            shape = list(matrix.shape)
            shape[matrix.dim] *= size
            full.append(torch.cat(parts, dim=matrix.dim, out=assembled[offset : offset + numel].view(shape)))
            start += matrix.numel
        sent.sent = sent.received = None
        sent.own = {}
        tiles = [(k, t, rows, cols) for k, i in enumerate(homed) for t, (rows, cols) in enumerate(matrices[i].tiles())]
        inputs = _tiles_of(full, tiles, scratch)
        results = scratch("tp_results", (sum(sizes),), dtype, device)
        out = [results[offset : offset + numel].view(m.shape) for m, offset, numel in zip(full, _offsets(sizes), sizes)]

        def consume(j: int, result: torch.Tensor) -> None:
            k, t, rows, cols = tiles[j]
            if rule is not None:
                result = rule(homed[k], t, result)
            if len(matrices[homed[k]].tiles()) == 1:
                out[k].copy_(result)  # (the whole matrix)
            else:
                put_tile(out[k], rows, cols, result)

        if tiles:
            orthogonalise_fn(inputs, consume=consume)
        parts = [self._part_for(m, matrices[i], s) for s in range(size) for m, i in zip(out, homed)]
        send = _packed(parts, scratch, f"tp_back_send{slot}", dtype, device)
        received = scratch(f"tp_back_received{slot}", (sum(m.numel for m in matrices),), dtype, device)
        per_destination = sum(matrices[i].numel for i in homed)
        in_flight = self._issue(
            CommLabel.TP_FROM_HOME, received, send, self._home_splits(matrices), [per_destination] * size
        )
        return Exchange(matrices=matrices, sent=send, received=received, in_flight=in_flight, ns_matrices=len(tiles))

    def received(self, back: Exchange) -> list[torch.Tensor]:
        """Wait for ``back``: this rank's shards of the results, in ``matrices`` order (views of its buffer)."""
        back.in_flight.wait()
        out: list[torch.Tensor | None] = [None] * len(back.matrices)
        offset = 0
        for i in self._by_home(back.matrices):
            matrix = back.matrices[i]
            out[i] = back.received[offset : offset + matrix.numel].view(matrix.shape)
            offset += matrix.numel
        return out

    def _part_for(self, result: torch.Tensor, matrix: TPMatrix, rank: int) -> torch.Tensor:
        """What ``rank`` gets of a result: its shard, or all of a replicated matrix."""
        return result if matrix.dim is None else result.chunk(self.tp.size, dim=matrix.dim)[rank]

    def _by_home(self, matrices: Sequence[TPMatrix]) -> list[int]:
        return [i for home in range(self.tp.size) for i, m in enumerate(matrices) if m.home == home]

    def _home_splits(self, matrices: Sequence[TPMatrix], *, sharded_only: bool = False) -> list[int]:
        return [
            sum(m.numel for m in matrices if m.home == home and not (sharded_only and m.dim is None))
            for home in range(self.tp.size)
        ]

    def _issue(self, source: CommLabel, output, input, output_splits, input_splits) -> InFlight:
        """The all-to-all from the reduce stream, which waits for an event recorded now on the current
        stream (after its writes of ``input`` and the allocation of ``output``), not for what that
        stream queues later; the returned InFlight is what a reader of ``output`` waits for. The
        reduce stream runs its all-to-alls in issue order: the step issues a batch's send to the homes
        before the previous batch's Newton–Schulz (``tensor_parallel_update.py``), so it does not queue
        behind that batch's results."""
        stream = self.streams.reduce
        if stream is not None:
            self.streams.wait_event(stream, self.streams.record())
        with self.streams.use(stream):
            with Launch(self.tp.group, self.tp.size, self.streams.device, source, self.stats, coalesce=False) as launch:
                launch.all_to_all(output, input, output_splits, input_splits)
        return launch.in_flight


def _offsets(sizes: Sequence[int]) -> list[int]:
    """Where each of ``sizes`` starts when packed one after another."""
    out, offset = [], 0
    for numel in sizes:
        out.append(offset)
        offset += numel
    return out


def _packed(
    tensors: Sequence[torch.Tensor], scratch: Scratch, name: str, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``tensors`` one after another in a flat ``scratch`` buffer (``torch.cat`` of them flattened)."""
    sizes = [t.numel() for t in tensors]
    flat = scratch(name, (sum(sizes),), dtype, device)
    for tensor, offset, numel in zip(tensors, _offsets(sizes), sizes):
        flat[offset : offset + numel].view(tensor.shape).copy_(tensor)
    return flat


def _tiles_of(full: Sequence[torch.Tensor], tiles, scratch: Scratch) -> list[torch.Tensor]:
    """Each tile of the assembled matrices as a contiguous matrix: a view where it is a range of whole
    rows, else gathered into a flat ``scratch`` buffer (as ``take_tile(...).contiguous()``)."""

    def is_rows(k, rows, cols) -> bool:
        return len(rows) == 1 and cols == ((0, full[k].shape[1]),)

    gathered = [j for j, (k, _, rows, cols) in enumerate(tiles) if not is_rows(k, rows, cols)]
    sizes = [block_rows(tiles[j][2]) * block_rows(tiles[j][3]) for j in gathered]
    out = [full[k][rows[0][0] : rows[0][1]] if is_rows(k, rows, cols) else None for k, _, rows, cols in tiles]
    if gathered:
        flat = scratch("tp_tiles", (sum(sizes),), full[0].dtype, full[0].device)
        for j, offset, numel in zip(gathered, _offsets(sizes), sizes):
            k, _, rows, cols = tiles[j]
            tile = out[j] = flat[offset : offset + numel].view(block_rows(rows), block_rows(cols))
            for matrix_rows, matrix_cols, tile_rows, tile_cols in tile_ranges(rows, cols):
                tile[tile_rows, tile_cols].copy_(full[k][matrix_rows, matrix_cols])
    return out
