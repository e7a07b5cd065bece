"""One order on every rank: what each communicator sees, recorded on a rank and compared across ranks.

NCCL runs a communicator's operations in issue order and matches them across its ranks by position: every
member must issue the same operations (kind, sizes, dtype) in the same order, else it pairs collectives of
different sizes or waits for ever. Two checkers use ``check_issue_order``:

* tests/distributed/test_issue_order.py: DMuon's own collectives (the ``CommLedger``) with every rank of a
  16-64-rank job simulated on the fake process group (Z2, Z3, HSDP, copies of the dedication mesh);
* tests/titan/test_issue_order_layouts.py: everything a real gloo rank issues (``IssueRecorder``: FSDP2's,
  TorchTitan's TP/EP/CP/PP exchanges, DMuon's, DCP's) in TorchTitan's layouts the simulation does not
  build: TP, EP, CP and a real pipeline schedule, and a resume's first step.

``IssueRecorder`` is a ``TorchDispatchMode``: every collective and point-to-point op reaches the dispatcher
as a ``c10d`` op (``torch.distributed``'s functions) or a ``_c10d_functional`` op (DTensor's and the
functional collectives), whoever issues it. It defers ops on DTensors to DTensor, so the collectives a
DTensor op issues inside its own dispatch are recorded too (a mode that ran them itself would see the
DTensor op only); other subclasses (a Parameter, DTensor's fake tensors) it runs as they are.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode


class Communicator(NamedTuple):
    """A process group (its global ranks and name), or one direction between two ranks of it (``p2p``):
    NCCL matches a rank's sends to a peer with that peer's receives from it, in order."""

    ranks: tuple[int, ...]
    name: str = ""
    p2p: bool = False


# c10d op -> which argument holds what every member issues alike (None: only the dtype, as an all-to-all's
# splits differ by rank); gathers and scatters name the side that is the same on the root and elsewhere
C10D_PAYLOAD = {
    "allreduce_": 0,
    "allreduce_coalesced_": 0,
    "broadcast_": 0,
    "reduce_": 0,
    "allgather_": 0,
    "_allgather_base_": 0,
    "allgather_coalesced_": 0,
    "allgather_into_tensor_coalesced_": 0,
    "reduce_scatter_": 1,
    "_reduce_scatter_base_": 1,
    "reduce_scatter_tensor_coalesced_": 1,
    "gather_": 1,
    "scatter_": 0,
    "alltoall_": None,
    "alltoall_base_": None,
    "barrier": None,
}
FUNCTIONAL_PAYLOAD = {  # _c10d_functional (and its autograd twin): the input, the group's name last
    "all_reduce": 0,
    "all_reduce_": 0,
    "all_reduce_coalesced": 0,
    "all_reduce_coalesced_": 0,
    "all_gather_into_tensor": 0,
    "all_gather_into_tensor_coalesced": 0,
    "reduce_scatter_tensor": 0,
    "reduce_scatter_tensor_coalesced": 0,
    "broadcast": 0,
    "broadcast_": 0,
    "all_to_all_single": None,
}
NOT_ISSUES = {"wait_tensor", "_wrap_tensor_autograd", "monitored_barrier_"}


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _described(value) -> tuple[tuple, str]:
    """(shapes, dtypes) of the tensors in ``value`` (a tensor or nested lists of them)."""
    tensors = _tensors(value)
    return tuple(tuple(t.shape) for t in tensors), ",".join(sorted({str(t.dtype) for t in tensors}))


def _group(args) -> dist.ProcessGroup:
    for a in args:
        if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type().qualified_name()):
            return dist.ProcessGroup.unbox(a)
    raise AssertionError(f"no process group among {args}")


class IssueRecorder(TorchDispatchMode):
    """``records``: this rank's (kind, ``Communicator``, payload, dtype) in issue order while the mode is on."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # (DTensor runs it with this mode on: its own collectives are seen)
        namespace, name = func.namespace, func._schema.name.split("::")[-1]
        if namespace == "c10d" and name not in NOT_ISSUES:
            self._c10d(name, args)
        elif namespace in ("_c10d_functional", "_c10d_functional_autograd") and name not in NOT_ISSUES:
            self._functional(name, args, kwargs)
        return func(*args, **kwargs)

    def _c10d(self, name: str, args) -> None:
        group = _group(args)
        if name in ("send", "recv_"):  # (tensors, group, peer's rank in the group, tag)
            me, peer = dist.get_rank(), dist.get_global_rank(group, args[2])
            ends = (me, peer) if name == "send" else (peer, me)
            shapes, dtype = _described(args[0])
            self.records.append(("p2p", Communicator(ends, group.group_name, p2p=True), shapes, dtype))
            return
        if name not in C10D_PAYLOAD:
            raise AssertionError(f"c10d.{name}: an operation the recorder does not know; add it to C10D_PAYLOAD")
        where = C10D_PAYLOAD[name]
        shapes, dtype = _described(args[where] if where is not None else args[0])
        communicator = Communicator(tuple(dist.get_process_group_ranks(group)), group.group_name)
        self.records.append((name, communicator, shapes if where is not None else (), dtype))

    def _functional(self, name: str, args, kwargs) -> None:
        if name not in FUNCTIONAL_PAYLOAD:
            raise AssertionError(f"_c10d_functional.{name}: not known to the recorder; add it to FUNCTIONAL_PAYLOAD")
        group_name = kwargs.get("group_name", args[-1])
        group = dist.distributed_c10d._resolve_process_group(group_name)
        where = FUNCTIONAL_PAYLOAD[name]
        shapes, dtype = _described(args[where] if where is not None else args[0])
        communicator = Communicator(tuple(dist.get_process_group_ranks(group)), group.group_name)
        self.records.append((name, communicator, shapes if where is not None else (), dtype))


def _members(communicator) -> tuple[int, ...]:
    return communicator.ranks if isinstance(communicator, Communicator) else communicator


def check_issue_order(sequences: list[list[tuple]]) -> None:
    """AssertionError unless every communicator has one sequence on all its ranks and the ranks' orders of
    collectives admit one global order (``sequences[rank]``: (kind, communicator, payload, dtype) in issue
    order; a communicator is a ``Communicator`` or a tuple of ranks). Point-to-point directions are held to
    their sequence only: a pipeline schedule posts a batch's sends and receives together, in any order."""
    by_comm: dict[tuple, dict[int, list]] = {}
    at: dict[tuple, dict[int, list]] = {}  # each op's position in its rank's issue order
    for rank, ops in enumerate(sequences):
        for position, (kind, communicator, payload, dtype) in enumerate(ops):
            by_comm.setdefault(communicator, {}).setdefault(rank, []).append((kind, payload, dtype))
            at.setdefault(communicator, {}).setdefault(rank, []).append(position)
    failures = []  # (where the first difference was issued, message): the earliest is the cause
    for communicator, per_rank in by_comm.items():
        ranks = _members(communicator)
        assert set(per_rank) <= set(ranks), f"communicator {communicator}: ranks {sorted(per_rank)} used it"
        first = per_rank.get(ranks[0], [])
        for rank in ranks:
            mine = per_rank.get(rank, [])
            if mine == first:
                continue
            i = next((i for i, (a, b) in enumerate(zip(first, mine)) if a != b), min(len(first), len(mine)))
            issued = min(at[communicator][r][i] for r in (ranks[0], rank) if i < len(per_rank.get(r, [])))
            failures.append(
                (
                    issued,
                    f"communicator {communicator}: rank {rank} issues another sequence than rank {ranks[0]} "
                    f"({len(mine)} and {len(first)} operations; the first difference at {i}: "
                    f"{mine[i] if i < len(mine) else None} against {first[i] if i < len(first) else None})",
                )
            )
    assert not failures, min(failures)[1]
    # nodes: (communicator, index); edges: each rank's consecutive collectives (a communicator's order is
    # implied: the rank's own sequence on it is its index order)
    after: dict[tuple, set] = {}
    waiting: dict[tuple, int] = {}
    for ops in sequences:
        seen: dict[tuple, int] = {}
        previous = None
        for _, communicator, _, _ in ops:
            if isinstance(communicator, Communicator) and communicator.p2p:
                continue
            node = (communicator, seen.get(communicator, 0))
            seen[communicator] = node[1] + 1
            waiting.setdefault(node, 0)
            if previous is not None and node not in after.setdefault(previous, set()):
                after[previous].add(node)
                waiting[node] += 1
            previous = node
    ready = [node for node, count in waiting.items() if count == 0]
    done = 0
    while ready:
        node = ready.pop()
        done += 1
        for following in after.get(node, ()):
            waiting[following] -= 1
            if waiting[following] == 0:
                ready.append(following)
    assert done == len(waiting), f"the ranks' orders cross: {len(waiting) - done} operations wait on each other"
