"""A unit: the dedicated weights of one layer, gathered into one packed buffer, and its lifecycle.

Between steps a unit's buffer has no storage and each dedicated weight lives
only on its owners (the registered ``nn.Parameter``; other ranks keep a
0-element placeholder). Before the layer runs, owners copy their weights into
the buffer (in the compute dtype) and broadcast their segment; the layer's
modules then see views of the buffer ("compute params") until its backward
is done. The buffer is a small state machine::

    FREE --gather()--> GATHERING --wait()--> READY --free()--> FREE

and the unit's place in the step is its ``Phase`` (declared with the context,
which checks the units' order by it). The four transitions (``pre_forward``,
``post_forward``, ``pre_backward``, ``post_backward``) are methods of the unit,
as FSDP2's ``FSDPParamGroup`` owns its own; the hooks in ``hooks.py`` only call
them. What units share (streams, the reducer, the forward order, counters) is
the ``RuntimeContext``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from titan_dmuon.runtime.comm import CommLabel, InFlight, Launch, alloc_storage, free_storage
from titan_dmuon.runtime.context import Phase, RuntimeContext
from titan_dmuon.runtime.members import Bucket, Member, Piece, Segment


class BufferState(enum.Enum):
    FREE = "free"  # no storage
    GATHERING = "gathering"  # broadcasts into it are in flight
    READY = "ready"  # holds this step's weights; the compute stream has waited for them


@dataclass(eq=False)
class Unit:
    index: int
    name: str  # the unit module's name in the model, for messages
    module: nn.Module
    members: list[Member]  # in buffer order
    pieces: list[Piece]  # what each shard index holds of them (owner groups: a block each), in broadcast order
    segments: list[Segment]
    buckets: list[Bucket]
    numel: int
    ctx: RuntimeContext
    buffer: torch.Tensor | None = None
    state: BufferState = BufferState.FREE
    phase: Phase = Phase.IDLE
    swapped_in: bool = False
    holds_unreduced_grads: bool = False  # gradient sync off: gradients accumulate on the compute params
    weights_event: object = None  # the last write of the owners' weights (a step, a load): gathers wait for it
    _in_flight: InFlight | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        return f"Unit({self.index}, {self.name!r}, {self.state.value}, {self.phase.value})"

    # ---- the packed buffer ------------------------------------------------------------
    def allocate_compute_params(self, dtype: torch.dtype, device: torch.device) -> None:
        """Views of one packed buffer, registered as leaf parameters for autograd (storage freed). A wide
        weight split by column blocks is a column-major view (its blocks contiguous, so they are broadcast
        in place); a Linear's weight gradient then comes out column-major too (matmul's backward keeps the
        layout), so autograd adds no copy."""
        storage = torch.empty(self.numel, dtype=dtype, device=device)
        self.buffer = storage
        for m in self.members:
            view = torch.empty(0, dtype=dtype, device=device)
            # A separate tensor on the same storage: writes into the buffer do not bump the
            # version counter autograd checks on the compute param.
            if m.column_major:
                view.set_(storage.untyped_storage(), m.offset, m.shape, (1, m.shape[0]))
            else:
                view.set_(storage.untyped_storage(), m.offset, m.shape)
            m.compute = nn.Parameter(view, requires_grad=m.param.requires_grad)
            # the registered param's annotations (TorchTitan's SPMD types of a TP shard) go with it
            m.compute.__dict__.update({k: v for k, v in m.param.__dict__.items() if k != "_dmuon_handle"})
        free_storage(storage)

    @torch.no_grad()
    def gather(self, source: CommLabel) -> None:
        """Start filling the buffer from the owners (no-op unless FREE), on the gather stream:
        after the last write of the weights it reads, never after the compute stream's queue."""
        if self.state is not BufferState.FREE:
            return
        ctx, mesh, streams = self.ctx, self.ctx.mode.mesh, self.ctx.streams
        with streams.use(streams.gather):
            streams.wait_event(None, self.weights_event)
            ctx.replicas.wait(self)  # HSDP: this rank's held weights came from their global owner
            ctx.track_buffer(alloc_storage(self.buffer))
            mine = [p for p in self.pieces if p.shard_owner == mesh.shard_rank]
            if mine:
                torch._foreach_copy_([p.in_buffer(self.buffer) for p in mine], [p.member.param for p in mine])
            with Launch(
                mesh.shard_group, mesh.shard_size, mesh.device, source, ctx.stats, coalesce=mesh.coalesces
            ) as launch:
                for segment in self.segments:
                    launch.broadcast(self.buffer[segment.start : segment.stop], src=segment.shard_owner)
        self._in_flight = launch.in_flight
        self.state = BufferState.GATHERING

    def wait(self) -> None:
        """The compute stream waits for the broadcasts (on the CPU: the host); the buffer is READY."""
        if self.state is BufferState.GATHERING:
            self._in_flight.wait()
            self._in_flight = None
            self.state = BufferState.READY

    def synchronize(self) -> None:
        """The host waits for the broadcasts in flight, if any (before the process groups go: a stream
        wait would leave them running on an accelerator). The state stays: ``free`` releases."""
        if self.state is BufferState.GATHERING:
            self._in_flight.synchronize()

    def free(self) -> None:
        """Release the buffer. Its memory belongs to the gather stream, which reuses it: if compute
        read it, the gather stream first waits for compute's last use (an event, no host wait)."""
        if self.state is BufferState.FREE:
            return
        streams = self.ctx.streams
        if self.state is BufferState.GATHERING:  # prefetched, never used: only its broadcast touched it
            self._in_flight.wait(streams.gather)
            self._in_flight = None
        else:
            streams.wait_event(streams.gather, streams.record())
        self.ctx.track_buffer(-free_storage(self.buffer))
        self.state = BufferState.FREE

    def swap_in(self) -> None:
        for m in self.members:
            m.module._parameters[m.name] = m.compute
        self.swapped_in = True

    def swap_out(self) -> None:
        for m in self.members:
            m.module._parameters[m.name] = m.param
        self.swapped_in = False

    # ---- the lifecycle ------------------------------------------------------------------
    def pre_forward(self) -> None:
        """Its weights in place before the layer runs; the next unit's broadcast starts (after
        FSDP2's all-gather for this one, which FSDP2's own pre-forward hook issued just before)."""
        ctx = self.ctx
        ctx.enter_forward(self)
        self.gather(CommLabel.FORWARD_BROADCAST)  # no-op when prefetched
        if not ctx.recording and self is ctx.forward_order[0]:
            with ctx.first_wait.timing():  # the first layer's broadcast was issued in the step: exposed?
                self.wait()
        else:
            self.wait()
        following = ctx.neighbour(self, +1)
        if following is not None:
            following.gather(CommLabel.FORWARD_BROADCAST)
        self.phase = Phase.FORWARD
        self.swap_in()

    def post_forward(self, output, on_backward) -> None:
        """Z3 frees the buffer (not the last unit's: its backward comes next); a hook on the
        outputs (``on_backward``) marks the start of this unit's backward."""
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if torch.is_grad_enabled() and tensors:
            self.phase = Phase.AWAITING_BACKWARD
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: on_backward(), mode="any")
            # Z3 frees, unless sync is off or was (the weights stayed from the earlier micro-batches:
            # holding them to the reduce costs no memory beyond theirs, and saves a broadcast)
            if (
                self.ctx.mode.reshard_after_forward
                and self.ctx.gradient_sync
                and not self.holds_unreduced_grads
                and not self.ctx.is_last_in_forward(self)
            ):
                self.free()
        else:  # no backward will come (evaluation, no_grad)
            self.phase = Phase.IDLE
            if self.ctx.gradient_sync:
                self.free()
            self.swap_out()

    def pre_backward(self) -> None:
        ctx = self.ctx
        ctx.check_backward_order(self)
        self.phase = Phase.BACKWARD
        self.gather(CommLabel.BACKWARD_BROADCAST)
        self.wait()
        if ctx.mode.reshard_after_forward and ctx.gradient_sync:
            preceding = ctx.neighbour(self, -1)
            if preceding is not None and preceding.phase is Phase.AWAITING_BACKWARD:
                preceding.gather(CommLabel.BACKWARD_BROADCAST)

    def post_backward(self) -> None:
        """Every gradient of the layer is computed (its inputs' gradients are): release the
        buffer, put the registered params back, and reduce the gradients to their owners, or,
        with gradient sync off, keep them accumulating on the compute params.

        The buffer goes first (the gradients are separate tensors), so it is never alive
        together with the reduce buffers, as FSDP2 reshards before its reduce-scatter copy-in."""
        if self.phase is not Phase.BACKWARD:
            return  # (already done: the end-of-backward callback after the input-gradient hook)
        self.phase = Phase.IDLE
        if self.ctx.gradient_sync:  # (with what earlier backward passes held, sync off)
            self.holds_unreduced_grads = False
            self.swap_out()
            self.free()
            self.ctx.reducer.reduce(self)
        else:
            # the compute params stay in: pipelining's split backward computes the weight gradients
            # later, for the module's parameters as they are then
            self.holds_unreduced_grads = True
            self.ctx.reducer.accumulate(self)

    def reduce_held_gradients(self) -> None:
        """Gradient sync was off: reduce what accumulated (every member: zeros where none), free."""
        self.holds_unreduced_grads = False
        if self.swapped_in:
            self.swap_out()
        self.free()
        self.ctx.reducer.reduce(self)
