"""How DMuon issues collectives: labelled, counted, grouped into launches.

* Labels. ``CommLabel`` declares every name DMuon gives its collectives;
  ``comm_source`` tags the collectives issued inside it with one and ``Launch``
  tags each group of them with a launch id, so a measuring tool
  (``titan_dmuon.CommLedger``) can tell DMuon's traffic from FSDP2's and count
  launches. The runtime never imports the measuring tool; the tool reads these
  labels.
* Counts. ``CommStats`` keeps this rank's elements/bytes (in the design's
  units) and launches per label, for the training log: integer sums on the
  hot path, exact fractions only when read.
* Launches. A unit's collectives in one direction go out as one launch: a
  coalesced group where the backend can coalesce (NCCL: one ``ncclGroup``),
  else one by one (gloo). On an accelerator they are issued synchronously
  from the current (side) stream, so NCCL's kernels run on that stream (as
  FSDP2's do) and an event recorded after them is what consumers wait on; on
  the CPU they are asynchronous (gloo's threads) and consumers wait on the
  works. Either way ``InFlight.wait()`` is the one way to wait.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from fractions import Fraction

import torch
import torch.distributed as dist


class CommLabel(str, enum.Enum):
    """Every label DMuon gives its collectives, declared once: the runtime issues with these, the
    ledger and the tests select by them. Members are strings (``CommLabel.SHARD_REDUCE ==
    "dmuon.shard_reduce"``), printed as their value."""

    FORWARD_BROADCAST = "dmuon.forward_broadcast"  # a layer's weights from their owners, before its forward
    BACKWARD_BROADCAST = "dmuon.backward_broadcast"  # Z3: again, before its backward
    SHARD_REDUCE = "dmuon.shard_reduce"  # a layer's gradients to their shard owners
    REPLICATE_REDUCE = "dmuon.replicate_reduce"  # HSDP: on to the global owner across the replicate group
    REPLICATE_BROADCAST = "dmuon.replicate_broadcast"  # HSDP: an updated layer from its global owners to replicas
    REPLICATE_SYNC = "dmuon.replicate_sync"  # HSDP: the first forward's sync of replicas initialised apart
    TP_TO_HOME = "dmuon.tp_to_home"  # the step's TP shards to each matrix's NS home
    TP_FROM_HOME = "dmuon.tp_from_home"  # and the orthogonalised shards back
    TP_GRAD_REDUCE = "dmuon.tp_grad_reduce"  # a TP-replicated weight's partial gradients to its home
    GROUP_GRAM = "dmuon.group_gram"  # owner groups: each matrix's norm and Gram matrices summed over its group
    GROUP_WARM_UP = "dmuon.group_warm_up"  # owner groups: one number on each new group, when it is made
    EXPORT = "dmuon.export"  # full_tensors(): every weight in full on every rank
    CHECKPOINT = "dmuon.checkpoint"  # state_dict(): NorMuon's second moments of TP weights, merged on the TP group
    DMUON = "dmuon"  # not issued: selects every label above (``CommLedger.select(source=CommLabel.DMUON)``)
    OTHER = "other"  # not DMuon's: FSDP2, DDP, DTensor, the user's own collectives

    __str__ = str.__str__
    __format__ = str.__format__

    @classmethod
    def tensor_parallel(cls) -> tuple[CommLabel, ...]:
        """The labels of DMuon's traffic on the TP group."""
        return cls.TP_TO_HOME, cls.TP_FROM_HOME, cls.TP_GRAD_REDUCE


class LaunchId:
    """A launch's identity in the ledger's records: a fresh object per launch, compared by identity
    (unique while a record holds it; a process-wide counter would be module-level state)."""

    __slots__ = ()


_source: contextvars.ContextVar[str] = contextvars.ContextVar("dmuon_comm_source", default=CommLabel.OTHER.value)
_launch: contextvars.ContextVar[tuple[LaunchId, bool] | None] = contextvars.ContextVar(
    "dmuon_comm_launch", default=None
)


@contextlib.contextmanager
def comm_source(name: str) -> Iterator[None]:
    """Label the collectives issued inside (DMuon's runtime names its own with a ``CommLabel``)."""
    token = _source.set(str(name))
    try:
        yield
    finally:
        _source.reset(token)


def current_source() -> str:
    return _source.get()


def current_launch() -> tuple[LaunchId, bool] | None:
    """(id, coalesced) of the group of DMuon's collectives being issued, or None. One group is one
    launch where the backend coalesces (NCCL); gloo runs its collectives one by one."""
    return _launch.get()


@dataclass
class CommStats:
    """This rank's DMuon traffic since the last ``pop``.

    Per label: for each group size n, the summed sizes S and bytes of the collectives
    (each moves (n-1)/n * S elements per rank), and the launches (groups, what NCCL launches)."""

    _sizes: dict[tuple[str, int], list[int]] = field(default_factory=dict)  # (label, n) -> [S, bytes]
    _launches: dict[str, int] = field(default_factory=dict)
    _counting: bool = True

    @contextlib.contextmanager
    def left_out(self):
        """Collectives issued inside are not counted (forwards between training steps: an evaluation)."""
        self._counting = False
        try:
            yield
        finally:
            self._counting = True

    def add(self, source: str, group_size: int, numel: int, nbytes: int) -> None:
        if not self._counting:
            return
        row = self._sizes.get((source, group_size))
        if row is None:
            row = self._sizes[(source, group_size)] = [0, 0]
        row[0] += numel
        row[1] += nbytes

    def add_launch(self, source: str) -> None:
        if not self._counting:
            return
        self._launches[source] = self._launches.get(source, 0) + 1

    def pop(self) -> dict[str, tuple[Fraction, Fraction, int]]:
        """{label: (elements, bytes, launches)} per rank, in the design's units, since the last pop."""
        out: dict[str, list] = {}
        for (source, n), (numel, nbytes) in self._sizes.items():
            row = out.setdefault(source, [Fraction(0), Fraction(0), 0])
            row[0] += Fraction(n - 1, n) * numel
            row[1] += Fraction(n - 1, n) * nbytes
        for source, launches in self._launches.items():
            out.setdefault(source, [Fraction(0), Fraction(0), 0])[2] += launches
        self._sizes, self._launches = {}, {}
        return {k: tuple(v) for k, v in out.items()}


@dataclass(eq=False)
class InFlight:
    """Collectives issued and not yet waited for: gloo's works (CPU), or an event recorded on the
    stream that ran them (accelerator)."""

    works: list = field(default_factory=list)
    event: torch.Event | None = None

    def wait(self, stream=None) -> None:
        """``stream`` (default: the current one) waits for them; on the CPU the host blocks."""
        for work in self.works:
            work.wait()
        self.works = []
        if self.event is not None:
            (stream or torch.accelerator.current_stream(self.event.device)).wait_event(self.event)

    def synchronize(self) -> None:
        """The host waits for them (checkpoints only: another thread may read the result)."""
        self.wait()
        if self.event is not None:
            self.event.synchronize()


class Launch:
    """Collectives issued together on one process group, from the current stream.

    Use inside ``with Launch(...) as launch:``; ``launch.in_flight`` is what to wait on.
    A coalesced group is closed on every path, also when an issue raises: an open group
    would swallow FSDP2's next collectives on the same process group (a hang).
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        group_size: int,
        device: torch.device,
        source: str,
        stats: CommStats,
        *,
        coalesce: bool,
    ) -> None:
        self.group = group
        self.group_size = group_size
        self.device = device
        self.source = str(source)  # (a CommLabel's value: plain strings in the counts and the ledger)
        self.stats = stats
        self.in_flight = InFlight()
        self._async = device.type == "cpu"
        self._coalesce = coalesce and group_size > 1
        self._coalescing = False
        self._ops = 0
        self._tokens = None

    def __enter__(self) -> Launch:
        self._tokens = (_source.set(self.source), _launch.set((LaunchId(), self._coalesce)))
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self._coalescing:
                self._coalescing = False
                work = self.group._end_coalescing(self.device)
                if work is not None:
                    if self._async:
                        self.in_flight.works.append(work)
                    else:
                        work.wait()
        finally:
            source, launch = self._tokens
            _launch.reset(launch)
            _source.reset(source)
        if exc_type is None:
            if self._ops:
                self.stats.add_launch(self.source)
            if not self._async:
                # also when nothing was issued (a group of one): the stream's own work inside the
                # launch (the copy of the owners' weights into the buffer) is what consumers wait for
                self.in_flight.event = torch.accelerator.current_stream(self.device).record_event()

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self._issue(dist.broadcast, tensor, group_src=src)

    def reduce(self, tensor: torch.Tensor, dst: int) -> None:
        self._issue(dist.reduce, tensor, group_dst=dst)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """A sum over the group, counted as the design counts an all-reduce: 2(n-1)/n of it per rank."""
        if self.group_size > 1:
            self.stats.add(self.source, self.group_size, tensor.numel(), tensor.numel() * tensor.element_size())
        self._issue(dist.all_reduce, tensor)

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int]
    ) -> None:
        """Counted as the design counts an all-to-all: (n-1)/n of the input per rank (with uneven
        splits: exact as the mean over the group's ranks)."""
        if self.group_size == 1:
            output.copy_(input)
            return
        self.stats.add(self.source, self.group_size, input.numel(), input.numel() * input.element_size())
        work = dist.all_to_all_single(
            output, input, output_splits, input_splits, group=self.group, async_op=self._async
        )
        self._ops += 1
        if self._async and work is not None:
            self.in_flight.works.append(work)

    def _issue(self, fn, tensor: torch.Tensor, **kwargs) -> None:
        if self.group_size == 1:
            return
        if self._coalesce and not self._coalescing:
            self.group._start_coalescing(self.device)
            self._coalescing = True
        self.stats.add(self.source, self.group_size, tensor.numel(), tensor.numel() * tensor.element_size())
        work = fn(tensor, group=self.group, async_op=self._async, **kwargs)
        self._ops += 1
        if self._async and not self._coalesce and work is not None:
            self.in_flight.works.append(work)


def free_storage(tensor: torch.Tensor) -> int:
    """Release the tensor's memory (views keep their metadata); returns the bytes freed."""
    storage = tensor.untyped_storage()
    freed = storage.size()
    if freed:
        storage.resize_(0)
    return freed


def alloc_storage(tensor: torch.Tensor) -> int:
    """Re-allocate a freed tensor's memory in place; returns the bytes allocated."""
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if storage.size() == nbytes:
        return 0
    storage.resize_(nbytes)
    return nbytes
