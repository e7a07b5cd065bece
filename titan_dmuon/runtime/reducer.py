"""Backward: each layer's gradients reduced to their owners, off the compute stream.

Every member of a unit is reduced every time, with zeros where this rank has
no gradient (a layer used on some ranks only, a path skipped for lack of
tokens): every rank issues the same collectives at the same point whatever
its gradients are, and the owner gets the sum over the ranks that had one,
which is what a single process computes on the whole batch. (A weight that
gets no gradient on any rank thus gets a zero one: weight decay and momentum
still apply, as with FSDP2's ``reduce_scatter_unused_params``; the owner
warns once when it meets one.)

A unit's gradients are copied (and cast to the reduce dtype) into one flat
buffer per bucket on the compute stream (one foreach copy), which frees
autograd's gradients at once; the shard-stage reduces then go out as one
launch from the reduce stream. Under HSDP the shard owner forwards its
reduced bucket across the replicate group to the one global owner; that
replicate stage is issued at the *next* program point (the next unit's
post-backward, or the end of backward) from the replicate stream, after the
shard stage it depends on. Collectives go out at the same points in the same
order on every rank (gloo and NCCL match them by order; chaining "whenever a
reduce completes" once deadlocked HSDP).

Under tensor parallelism a weight every tp rank holds whole (a router, MLA's ``wkv_a``) has a
partial gradient on each tp rank (its spmd type R: gradient P; FSDP2 would all-reduce it over
the tp dim): at the end of backward its global owners reduce this backward's gradient over the TP
group to the weight's NS home (``PlanEntry.tp_homes``), which alone keeps its momentum; the other
tp ranks' gradients are zeroed (they apply the home's orthogonalised update in the step).

With an all-reduce hook (``DedicatedParams.set_all_reduce_hook``, fault tolerance across replica
groups) each owner's reduced bucket goes through the hook once its shard stage is done, at the
same program point, on the replicate stream (unused without HSDP), before it becomes ``.grad``.
The compute stream waits for the hook's work only at the end of backward (``finish``), as FSDP2
waits for its all-reduce stream only in ``finalize_backward``: waiting at the next layer would
run backward at the inter-group network's speed.

Lifetimes, as FSDP2's reduce-scatter inputs: the flats live in the compute
stream's memory and are held by reference until the compute stream has
waited for the collective that reads them (at the next program point: at
most one layer in flight, FSDP2's default); owners keep theirs as ``.grad``.

The end of a backward whose completion comes later (a pipeline stage's last backward: the
schedule's sends to the neighbour stage follow it, and NCCL's point-to-point waits for the
current stream) issues every stage left from the side streams but leaves the compute stream's
waits, and the owners' ``.grad``, to ``finish`` after the schedule (``issue_rest``), as FSDP2
under pipelining reduces in ``perform_reduce_grad``, after the stage's sends.
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass

import torch

from titan_dmuon.runtime.comm import CommLabel, CommStats, InFlight, Launch
from titan_dmuon.runtime.members import Bucket, Member
from titan_dmuon.runtime.mode import DedicationMode, coalesces
from titan_dmuon.runtime.streams import Streams


class Stage(enum.Enum):
    SHARD = "shard"  # reduced to the shard owner within the shard group
    REPLICATE = "replicate"  # (HSDP) reduced on to the global owner across the replicate group


@dataclass(eq=False)
class _Flight:
    """One launch in flight and the buffers it reads and writes."""

    stage: Stage
    in_flight: InFlight
    items: list[tuple[Bucket, torch.Tensor]]  # bucket, its flat buffer (members in bucket order)


class GradientReducer:
    def __init__(
        self,
        *,
        mode: DedicationMode,
        streams: Streams,
        stats: CommStats,
        reduce_dtype: torch.dtype | None,
        divide_factor: float,
    ) -> None:
        self.mode = mode
        self.streams = streams
        self.stats = stats
        self.reduce_dtype = reduce_dtype
        self.divide_factor = divide_factor
        self.all_reduce_hook = None  # (flat) -> None: across replica groups, on each owner's reduced bucket
        self._in_flight: list[_Flight] = []
        self._unwaited: list[_Flight] = []  # moved on, the compute stream not yet waiting for them (issue_rest)
        self._hooks_done: list = []  # events after the all-reduce hook's work, for finish's compute wait
        self._done: list[tuple[Bucket, torch.Tensor]] = []  # reduced buckets this rank owns
        self._missing_on_owner: list[Member] = []
        self._warned: set[str] = set()
        self._tp_coalesces: bool | None = None  # the TP group's backend coalesces (decided at first use)

    @torch.no_grad()
    def reduce(self, unit) -> None:
        """Post-backward of ``unit``: move earlier launches on, then launch this unit's shard stage."""
        self._advance()
        items = self._copy_in(unit)
        mesh, streams = self.mode.mesh, self.streams
        streams.wait_stream(streams.reduce)  # the reduce stream starts after the copy-in
        with streams.use(streams.reduce):
            with Launch(
                mesh.shard_group,
                mesh.shard_size,
                mesh.device,
                CommLabel.SHARD_REDUCE,
                self.stats,
                coalesce=mesh.coalesces,
            ) as launch:
                for bucket, flat in items:
                    launch.reduce(flat, dst=bucket.shard_owner)
        self._in_flight.append(_Flight(Stage.SHARD, launch.in_flight, items))

    @torch.no_grad()
    def accumulate(self, unit) -> None:
        """Post-backward with gradient sync off: move the compute grads (the compute dtype, e.g.
        bf16) into accumulators in the reduce dtype (e.g. fp32), as FSDP2's no-sync does, so that
        many micro-batches do not add up in bf16. A weight gradient computed later (a split
        backward's weight pass) lands on the compute param again and joins at the next call or
        at the reduce."""
        dtype = self.reduce_dtype
        for m in unit.members:
            grad = m.compute.grad
            if grad is None or dtype is None or grad.dtype == dtype:
                continue
            if m.accumulated_grad is None:
                m.accumulated_grad = grad.to(dtype)
            else:
                m.accumulated_grad.add_(grad)
            m.compute.grad = None

    def _copy_in(self, unit) -> list[tuple[Bucket, torch.Tensor]]:
        """One flat buffer per bucket, filled by one foreach copy (and cast) from the compute
        grads (plus what sync off accumulated), which are freed; zeros for a member without a
        gradient on this rank. A piece of an owner group's weight takes its block of the gradient."""
        grads: dict[int, torch.Tensor | None] = {}
        for m in unit.members:
            grad, m.compute.grad = m.compute.grad, None
            if m.accumulated_grad is not None:
                if grad is not None:
                    m.accumulated_grad.add_(grad)
                grad, m.accumulated_grad = m.accumulated_grad, None
            grads[id(m)] = grad
            if grad is None and m.runs_ns:
                self._missing_on_owner.append(m)
        items, targets, sources, missing = [], [], [], []
        device = self.mode.mesh.device
        for bucket in unit.buckets:
            dtype = self.reduce_dtype or bucket.pieces[0].member.compute.dtype
            flat = torch.empty(bucket.numel, dtype=dtype, device=device)
            offset = 0
            for piece in bucket.pieces:
                view = flat[offset : offset + piece.numel].view(piece.shape)
                grad = grads[id(piece.member)]
                if grad is None:
                    missing.append(view)
                else:
                    targets.append(view)
                    sources.append(piece.of(grad))
                offset += piece.numel
            items.append((bucket, flat))
        if targets:
            torch._foreach_copy_(targets, sources)
        if missing:
            torch._foreach_zero_(missing)
        return items

    def _advance(self, *, wait: bool = True) -> None:
        """Every launch issued so far moves one stage on; a program point, the same on every rank.
        ``wait``: the compute stream waits for each launch it moved on (before the flats' memory,
        the compute stream's, can be reused; non-owners' flats hold partial sums and are dropped
        then), else the launch is kept, flats and all, for ``finish``."""
        mesh, streams = self.mode.mesh, self.streams
        flights, self._in_flight = self._in_flight, []
        for flight in flights:
            mine = [(b, f) for b, f in flight.items if b.shard_owner == mesh.shard_rank]
            if flight.stage is Stage.SHARD and mesh.hsdp:
                with streams.use(streams.replicate):
                    flight.in_flight.wait()  # the replicate stream (not compute) waits for the shard stage
                    with Launch(
                        mesh.replicate_group,
                        mesh.replicate_size,
                        mesh.device,
                        CommLabel.REPLICATE_REDUCE,
                        self.stats,
                        coalesce=mesh.coalesces,
                    ) as launch:
                        for bucket, flat in mine:
                            launch.reduce(flat, dst=bucket.replicate_owner)
                self._in_flight.append(_Flight(Stage.REPLICATE, launch.in_flight, mine))
            else:
                if self.all_reduce_hook is not None and mine:
                    self._across_groups(flight, mine)
                self._done += [(b, f) for b, f in mine if b.replicate_owner == mesh.replicate_rank]
            if wait:
                flight.in_flight.wait()
            else:
                self._unwaited.append(flight)

    def _across_groups(self, flight: _Flight, mine: list[tuple[Bucket, torch.Tensor]]) -> None:
        """The all-reduce hook on each bucket this rank owns (fault tolerance: the owners at this
        coordinate of every replica group average their reduced gradients), as FSDP2 runs its own
        after the reduce-scatter: on a side stream (the replicate stream, unused without HSDP) that
        waits for the shard stage. The compute stream waits for the hook's work in ``finish`` only
        (the flats are the owners' and stay held until then)."""
        streams = self.streams
        with streams.use(streams.replicate):
            flight.in_flight.wait()
            for _, flat in mine:
                self.all_reduce_hook(flat)
            done = streams.record()
        if done is not None:
            self._hooks_done.append(done)

    def _sum_over_tensor_parallel(self, partial: list[tuple[Member, torch.Tensor]]) -> None:
        """This backward's partial gradients of TP-replicated weights, reduced over the TP group to each
        weight's home (one launch, from the reduce stream after the compute stream's writes; the
        compute stream waits for it); zeros on the other tp ranks. The same weights on every rank of
        the TP group (one owner coordinate), at the same program point (the end of backward)."""
        tp = self.mode.tp
        if not partial or tp is None:
            return
        streams = self.streams
        if self._tp_coalesces is None:
            self._tp_coalesces = coalesces(tp.group, self.mode.mesh.device)
        streams.wait_stream(streams.reduce)
        with streams.use(streams.reduce):
            with Launch(
                tp.group,
                tp.size,
                self.mode.mesh.device,
                CommLabel.TP_GRAD_REDUCE,
                self.stats,
                coalesce=self._tp_coalesces,
            ) as launch:
                for m, grad in partial:
                    launch.reduce(grad, dst=m.entry.tp_homes[0])
        launch.in_flight.wait()
        others = [grad for m, grad in partial if m.entry.tp_homes[0] != tp.rank]
        if others:
            torch._foreach_zero_(others)

    @torch.no_grad()
    def issue_rest(self) -> None:
        """End of a backward whose completion comes later (``finish``): every stage left is issued from
        the side streams; the compute stream waits for none of them yet."""
        while self._in_flight:
            self._advance(wait=False)

    @property
    def awaiting_finish(self) -> bool:
        """Reduces issued whose gradients are not yet handed to the owners (``finish`` hands them)."""
        return bool(self._in_flight or self._unwaited or self._done or self._hooks_done)

    @torch.no_grad()
    def finish(self) -> None:
        """End of backward: finish every stage; the compute stream waits for what ``issue_rest`` and
        the all-reduce hook left in flight; then the global owners get their gradients."""
        while self._in_flight:
            self._advance()
        for flight in self._unwaited:
            flight.in_flight.wait()
        self._unwaited.clear()
        for done in self._hooks_done:
            self.streams.wait_event(None, done)
        self._hooks_done.clear()
        handed = []
        for bucket, flat in self._done:
            offset = 0
            for piece in bucket.pieces:  # (on the global owner: the whole weight, or its block of the group)
                grad = flat[offset : offset + piece.numel].view(piece.shape).to(piece.member.param.dtype)
                if self.divide_factor != 1.0:
                    grad.div_(self.divide_factor)
                handed.append((piece.member, grad))
                offset += piece.numel
        self._done.clear()
        self._sum_over_tensor_parallel([(m, g) for m, g in handed if m.entry.tp_replicated])
        for m, grad in handed:
            if m.param.grad is None:
                m.param.grad = grad  # a view of the bucket's buffer: no copy
            else:
                m.param.grad.add_(grad)  # gradient accumulation across micro-batches
        for m in self._missing_on_owner:
            if m.fqn not in self._warned:
                self._warned.add(m.fqn)
                warnings.warn(
                    f"dedicated weight {m.fqn!r} got no gradient on its owner rank in a backward pass; DMuon "
                    "reduced zeros from every rank without one, so its update uses the sum over the ranks that "
                    "had one, or a zero gradient where none had (weight decay and momentum still apply, as for "
                    "torch.optim.Muon with a zero gradient). Leave weights that no rank uses off Muon.",
                    stacklevel=2,
                )
        self._missing_on_owner.clear()
