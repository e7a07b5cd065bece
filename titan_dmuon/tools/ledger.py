"""A communication ledger: every collective issued on this rank, in the units of the design.

``CommLedger`` is a ``TorchDispatchMode``: it sees the c10d ops that DMuon,
FSDP2, DDP and DTensor issue, whatever layer issued them, and records the
kind, the group, the element count and the dtype. Elements are counted as a
bandwidth-optimal algorithm moves them, per rank of the group:

    broadcast / reduce / all-gather (output S) / reduce-scatter (input S) /
    all-to-all (S per rank):   (n-1)/n * S
    all-reduce of S:           2(n-1)/n * S

Counts are exact ``Fraction`` s so they can be compared with theory exactly.
The design's figures to compare with are in ``titan_dmuon.plan.cost_model``.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from titan_dmuon.runtime.comm import CommLabel, LaunchId, comm_source, current_launch, current_source
from titan_dmuon.runtime.gloo_exit import install_exit_guard

__all__ = ["CommLabel", "CommLedger", "CommRecord", "comm_source"]

_phase: contextvars.ContextVar[str] = contextvars.ContextVar("dmuon_comm_phase", default="")


@dataclass(frozen=True)
class CommRecord:
    kind: str  # broadcast, reduce, all_reduce, all_gather, reduce_scatter, all_to_all, send (point to point)
    source: str  # a CommLabel: DMuon's own collectives by name, CommLabel.OTHER for FSDP2/DDP/DTensor
    phase: str  # set by CommLedger.phase(), e.g. "step"
    group_ranks: tuple[int, ...]
    numel: int  # S in the formulas above
    dtype: torch.dtype
    launch: LaunchId | None = None  # identity of the DMuon group it went out in; None: on its own (FSDP2's, DDP's)
    coalesced: bool = False  # that group ran as one launch (NCCL); gloo runs a group one by one

    @property
    def group_size(self) -> int:
        return len(self.group_ranks)

    @property
    def elements(self) -> Fraction:
        n = self.group_size
        if self.kind == "send":  # (point to point: what this rank sends; receives are not counted)
            return Fraction(self.numel)
        factor = 2 if self.kind == "all_reduce" else 1
        return Fraction(factor * (n - 1) * self.numel, n)

    @property
    def bytes(self) -> Fraction:
        return self.elements * self.dtype.itemsize


def _numel(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel()
    return sum(_numel(t) for t in tensors)


# c10d op name -> (kind, S from the op's args)
_C10D_OPS = {
    "broadcast_": ("broadcast", lambda a: _numel(a[0])),
    "reduce_": ("reduce", lambda a: _numel(a[0])),
    "allreduce_": ("all_reduce", lambda a: _numel(a[0])),
    "allreduce_coalesced_": ("all_reduce", lambda a: _numel(a[0])),
    "_allgather_base_": ("all_gather", lambda a: _numel(a[0])),
    "allgather_": ("all_gather", lambda a: _numel(a[0])),
    "allgather_into_tensor_coalesced_": ("all_gather", lambda a: _numel(a[0])),
    "_reduce_scatter_base_": ("reduce_scatter", lambda a: _numel(a[1])),
    "reduce_scatter_": ("reduce_scatter", lambda a: _numel(a[1])),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", lambda a: _numel(a[1])),
    "alltoall_base_": ("all_to_all", lambda a: _numel(a[1])),
    "alltoall_": ("all_to_all", lambda a: _numel(a[1])),
    "send": ("send", lambda a: _numel(a[0])),
}
# _c10d_functional op name -> (kind, S from args, index of the group-name argument)
_FUNCTIONAL_OPS = {
    "broadcast": ("broadcast", lambda a: a[0].numel(), 2),
    "all_reduce": ("all_reduce", lambda a: a[0].numel(), 2),
    "all_reduce_coalesced": ("all_reduce", lambda a: _numel(a[0]), 2),
    "all_gather_into_tensor": ("all_gather", lambda a: a[0].numel() * a[1], 2),
    "all_gather_into_tensor_coalesced": ("all_gather", lambda a: _numel(a[0]) * a[1], 2),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a: a[0].numel(), 3),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", lambda a: _numel(a[0]), 3),
    "all_to_all_single": ("all_to_all", lambda a: a[0].numel(), 3),
}


def _dtype_of(tensors) -> torch.dtype:
    if isinstance(tensors, torch.Tensor):
        return tensors.dtype
    return _dtype_of(tensors[0])


class CommLedger(TorchDispatchMode):
    """Record every collective issued on this rank while active.

    >>> with CommLedger() as ledger:
    ...     train_one_step()
    >>> print(ledger.table())
    """

    def __init__(self) -> None:
        super().__init__()
        self.records: list[CommRecord] = []
        install_exit_guard()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Tag the collectives issued inside, e.g. ``with ledger.phase("step"): opt.step()``."""
        token = _phase.set(name)
        try:
            yield
        finally:
            _phase.reset(token)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(_is_dtensor_type(t) for t in types):
            return NotImplemented  # DTensor decomposes into plain collectives that come back here
        namespace = func.namespace
        if namespace == "c10d" and func._opname in _C10D_OPS:
            kind, size_of = _C10D_OPS[func._opname]
            group = dist.ProcessGroup.unbox(_find_script_object(args))
            self._record(kind, size_of(args), _dtype_of(args[0]), group)
        elif namespace == "_c10d_functional" and func._opname in _FUNCTIONAL_OPS:
            kind, size_of, name_index = _FUNCTIONAL_OPS[func._opname]
            from torch.distributed.distributed_c10d import _resolve_process_group

            group = _resolve_process_group(args[name_index])
            self._record(kind, size_of(args), _dtype_of(args[0]), group)
        return func(*args, **kwargs)

    def _record(self, kind: str, numel: int, dtype: torch.dtype, group: dist.ProcessGroup) -> None:
        ranks = tuple(dist.get_process_group_ranks(group))
        launch = current_launch()
        self.records.append(
            CommRecord(
                kind=kind,
                source=current_source(),
                phase=_phase.get(),
                group_ranks=ranks,
                numel=numel,
                dtype=dtype,
                launch=launch[0] if launch else None,
                coalesced=bool(launch and launch[1]),
            )
        )

    # ---- queries -----------------------------------------------------------------
    def select(
        self, *, source: str | None = None, phase: str | None = None, kind: str | None = None
    ) -> list[CommRecord]:
        """Records matching all given filters; ``source=CommLabel.DMUON`` matches every label of DMuon's."""
        out = []
        for r in self.records:
            if source is not None and not (r.source == source or r.source.startswith(source + ".")):
                continue
            if phase is not None and r.phase != phase:
                continue
            if kind is not None and r.kind != kind:
                continue
            out.append(r)
        return out

    def elements(self, **filters) -> Fraction:
        """Elements per rank of the records that match ``filters`` (as ``select``), in the design's units."""
        return sum((r.elements for r in self.select(**filters)), Fraction(0))

    def bytes(self, **filters) -> Fraction:
        """Bytes per rank of the records that match ``filters``: their elements times each one's element size."""
        return sum((r.bytes for r in self.select(**filters)), Fraction(0))

    def launches(self, **filters) -> int:
        """Collective launches that ran on this rank: a coalesced group (NCCL's ncclGroup) once,
        every other collective once (on gloo each of a DMuon group's collectives)."""
        records = self.select(**filters)
        return len({r.launch for r in records if r.coalesced}) + sum(not r.coalesced for r in records)

    def launch_groups(self, **filters) -> int:
        """Launches as NCCL runs them whatever the backend here: a DMuon group once, every other
        collective once."""
        records = self.select(**filters)
        return len({r.launch for r in records if r.launch is not None}) + sum(r.launch is None for r in records)

    def by_label(self) -> dict[tuple[str, str], tuple[int, Fraction, Fraction]]:
        """(source, kind) -> (calls, elements, bytes) on this rank."""
        table: dict[tuple[str, str], list] = defaultdict(lambda: [0, Fraction(0), Fraction(0)])
        for r in self.records:
            row = table[(r.source, r.kind)]
            row[0] += 1
            row[1] += r.elements
            row[2] += r.bytes
        return {k: tuple(v) for k, v in sorted(table.items())}

    def mean_over_ranks(self, group: dist.ProcessGroup | None = None, **filters) -> Fraction:
        """Elements per rank averaged over ``group`` (a collective; not itself recorded).

        Needed where collectives involve only some ranks (HSDP's replicate
        stage runs on owner ranks only).
        """
        mine = self.elements(**filters)
        with _suspended(self):
            device = _group_device(group)
            packed = torch.tensor([mine.numerator, mine.denominator], dtype=torch.float64, device=device)
            parts = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
            _all_gather_released(parts, packed, group)
        total = sum((Fraction(int(p[0].item()), int(p[1].item())) for p in parts), Fraction(0))
        return total / len(parts)

    def table(self, steps: int = 1) -> str:
        """A printable table per source and collective kind: calls, elements and bytes per rank
        (divided by ``steps``)."""
        lines = [f"{'source':<28}{'kind':<16}{'calls':>7}{'elements/rank':>18}{'bytes/rank':>16}"]
        for (source, kind), (calls, elements, nbytes) in self.by_label().items():
            lines.append(
                f"{source:<28}{kind:<16}{calls / steps:>7.1f}{float(elements) / steps:>18,.1f}"
                f"{float(nbytes) / steps:>16,.1f}"
            )
        return "\n".join(lines)


def _is_dtensor_type(t: type) -> bool:
    from torch.distributed.tensor import DTensor

    return issubclass(t, DTensor)


def _find_script_object(args):
    for a in args:
        if isinstance(a, torch.ScriptObject):
            return a
    raise TypeError("collective without a process group argument")


def _group_device(group: dist.ProcessGroup | None) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# How long mean_over_ranks waits for a backend thread to let go of its tensors (normally well
# under a millisecond; the bound only keeps an unforeseen extra owner from hanging the caller).
_RELEASE_TIMEOUT_S = 5.0


def _all_gather_released(parts: list[torch.Tensor], packed: torch.Tensor, group) -> None:
    """``dist.all_gather(parts, packed)`` that returns only once no backend thread holds the tensors.

    gloo runs a collective on a worker thread, and that thread drops its
    reference to the finished Work only after ``wait()`` has let the caller go,
    so the last reference to these tensors is often the worker's. Releasing a
    tensor that has a Python object takes the GIL (torch 2.14 decrefs the
    PyObject when the last C++ reference goes). Were this the last collective
    before the script exits (a ledger read after the last step), the worker
    could still be queued for the GIL when the interpreter starts finalizing;
    CPython then ends the thread inside the Work's noexcept destructor:
    std::terminate, "terminate called without an active exception", SIGABRT.
    So wait here, GIL released, until no C++ owner is left and the worker's
    decref is done (the Python refcounts are back to what they were before).
    NCCL's works are released by its watchdog, which ``destroy_process_group``
    joins; only CPU collectives wait.
    """
    tensors = [packed, *parts]
    before = [sys.getrefcount(t) for t in tensors]  # no C++ owner yet: the PyObjects' own count
    dist.all_gather(parts, packed, group=group)
    if packed.device.type != "cpu":
        return
    deadline = time.monotonic() + _RELEASE_TIMEOUT_S
    while time.monotonic() < deadline:
        if all(t._use_count() == 1 for t in tensors):  # no C++ owner left ...
            if [sys.getrefcount(t) for t in tensors] == before:  # ... and its GIL-side decref done
                return
            # not back to `before` with no C++ owner: someone on the Python side (another
            # dispatch mode) kept a reference; give a pending decref a moment, then stop
            deadline = min(deadline, time.monotonic() + 0.05)
        time.sleep(1e-4)  # releases the GIL for the worker


@contextlib.contextmanager
def _suspended(mode: TorchDispatchMode) -> Iterator[None]:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

    if mode in _get_current_dispatch_mode_stack():
        popped = _pop_mode()
        try:
            yield
        finally:
            _push_mode(popped)
    else:
        yield
