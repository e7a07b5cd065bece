"""The hooks that drive a step, as FSDP2's ``FSDPState`` drives its parameter groups.

One step, for a unit (a layer) U with dedicated weights:

* root pre-forward: the first unit's broadcast is in flight already (issued
  as soon as the previous step updated that unit) or is issued now;
* U pre-forward (a hook that runs after FSDP2's own, so after U's all-gather
  is issued): wait for U's broadcast, issue the next unit's, swap U's compute
  params in, and hook U's inputs so that their gradient marks U's backward done;
* U post-forward: Z3 frees U's buffer (except the last unit's, whose backward
  comes next), Z2 keeps it; a hook on U's outputs marks U's backward start;
* U pre-backward: (Z3) wait for U's re-broadcast and prefetch the unit before it;
* U post-backward (its inputs' gradient is computed, so every weight gradient
  of U is too): free U's buffer, put the registered params back, reduce U's
  gradients to their owners (every member, zeros where this rank has none);
* end of backward: the reducer finishes; owners have ``.grad`` (not the last backward, as a
  pipeline schedule runs them: the reduces left are issued, and finished after the schedule);
* the optimizer step (``DMuon.step``) goes unit by unit in forward order and
  calls ``DedicatedParams.updated(U)`` after each (``handle.py``).

The transitions themselves are the unit's (``unit.py``); the hooks here only
decide when each runs. Every hook runs eagerly, outside ``torch.compile``'s
graphs (dynamo-disabled, as FSDP2's are), and is labelled ``DMuon::...`` in
profiler traces.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from titan_dmuon.runtime.comm import CommLabel
from titan_dmuon.runtime.context import Phase, RuntimeContext, UnitOrderError
from titan_dmuon.runtime.fsdp_ignore import check_left_alone
from titan_dmuon.runtime.members import Member
from titan_dmuon.runtime.unit import BufferState, Unit
from titan_dmuon.runtime.usage_checks import check_compute_dtype


def _hook(label: str):
    """Keep a hook out of torch.compile's graphs (as FSDP2 does), name it in profiler traces, and
    count its host time (the handle's ``host_seconds``)."""

    def decorate(fn):
        @functools.wraps(fn)
        def labelled(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                with torch.profiler.record_function(f"DMuon::{label}"):
                    return fn(self, *args, **kwargs)
            finally:
                self.ctx.host_seconds += time.perf_counter() - start

        return torch._dynamo.disable(labelled, recursive=True, reason="DMuon hooks run eagerly")

    return decorate


def _in_backward() -> bool:
    """True inside autograd's backward (e.g. an activation-checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once their gradient is computed, which
    is after every weight gradient of the unit (autograd runs AccumulateGrad first), as
    FSDP2's RegisterPostBackwardFunction."""

    @staticmethod
    def forward(ctx, on_backward, *inputs):
        ctx.on_backward = on_backward
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.on_backward()
        return (None, *grads)


class StepHooks:
    """The root hooks on ``module`` (from construction) and each unit's (from the first forward).

    ``follow_params`` is called at the first forward, before anything reads the weights: the
    handle then follows parameters that ``to_empty()`` replaced after ``dedicate_params``."""

    def __init__(
        self,
        *,
        module: nn.Module,
        ctx: RuntimeContext,
        members: list[Member],
        param_dtype: torch.dtype | None,
        follow_params: Callable[[], None],
    ) -> None:
        self.ctx = ctx
        self._members = members
        self._param_dtype = param_dtype
        self._follow_params = follow_params
        self._removables = [
            module.register_forward_pre_hook(self._root_pre_forward),
            module.register_forward_hook(self._root_post_forward),
        ]
        self.initialized = False
        self._callback_queued = False

    def remove(self) -> None:
        for removable in self._removables:
            removable.remove()
        self._removables.clear()

    def lazy_init(self) -> None:
        """At the first forward, once the model is materialised: compute params, the unit hooks
        (registered now, so they run after FSDP2's own), and HSDP's first replica sync."""
        if self.initialized:
            return
        self._follow_params()
        check_left_alone(self._members)
        for m in self._members:
            if m.param.is_meta:
                raise RuntimeError(
                    f"dedicated parameter {m.fqn!r} is still on the meta device at the first forward: "
                    "call model.to_empty(device=...) and initialise the weights first"
                )
        ctx = self.ctx
        for unit in ctx.units:
            check_compute_dtype(unit, self._param_dtype or unit.members[0].param.dtype)
        for unit in ctx.units:
            unit.allocate_compute_params(self._param_dtype or unit.members[0].param.dtype, ctx.mode.mesh.device)
            self._removables.append(
                unit.module.register_forward_pre_hook(functools.partial(self._pre_forward, unit), with_kwargs=True)
            )
            self._removables.append(unit.module.register_forward_hook(functools.partial(self._post_forward, unit)))
            unit.weights_event = ctx.streams.record()
        self.initialized = True
        for unit in ctx.units:  # replicas may have been initialised differently: the global owner's copy wins
            ctx.replicas.broadcast(unit, source=CommLabel.REPLICATE_SYNC)

    @_hook("root_pre_forward")
    def _root_pre_forward(self, module, args) -> None:
        if _in_backward():
            return
        self.lazy_init()
        ctx = self.ctx
        ctx.begin_forward()
        if not ctx.recording and ctx.forward_order:
            ctx.forward_order[0].gather(CommLabel.FORWARD_BROADCAST)  # no-op when the step launched it

    @_hook("root_post_forward")
    def _root_post_forward(self, module, args, output) -> None:
        """Queue the end-of-backward callback as backward starts, ahead of FSDP2's (registered before
        it: dedicate_params comes before fully_shard), so that a layer whose gradient never comes is
        named before FSDP2 issues its final reduce-scatters, which would no longer match the peers'."""
        if _in_backward() or not torch.is_grad_enabled():
            return
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda grads: self._queue_final_callback(), mode="any"
            )

    @_hook("pre_forward")
    def _pre_forward(self, unit: Unit, module, args, kwargs):
        if _in_backward():
            return None  # activation-checkpoint recompute: the pre-backward hook already gathered
        unit.pre_forward()
        if not torch.is_grad_enabled():
            return None
        flat, spec = tree_flatten((args, kwargs))
        positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not positions:
            return None  # (its backward's end is the end-of-backward callback)
        hooked = _PostBackward.apply(functools.partial(self._post_backward, unit), *(flat[i] for i in positions))
        for i, tensor in zip(positions, hooked):
            flat[i] = tensor
        return tree_unflatten(flat, spec)

    @_hook("post_forward")
    def _post_forward(self, unit: Unit, module, args, output) -> None:
        if _in_backward():
            return
        unit.post_forward(output, functools.partial(self._pre_backward, unit))

    @_hook("pre_backward")
    def _pre_backward(self, unit: Unit) -> None:
        self._queue_final_callback()
        unit.pre_backward()

    @_hook("post_backward")
    def _post_backward(self, unit: Unit) -> None:
        self._queue_final_callback()
        unit.post_backward()

    def _queue_final_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    @_hook("finish_backward")
    def _finish_backward(self) -> None:
        self._callback_queued = False
        ctx = self.ctx
        ctx.recording = False
        for unit in reversed(ctx.units_in_order()):
            if unit.phase is Phase.BACKWARD:
                unit.post_backward()  # its inputs needed no gradient: no hook marked its end
            elif unit.phase is Phase.AWAITING_BACKWARD and ctx.gradient_sync:
                raise UnitOrderError(
                    f"layer {unit.name!r} ran forward but got no gradient in this backward pass: its output does "
                    "not reach the loss on this rank, and every rank must reduce every dedicated layer's "
                    "gradients. Make its output reach the loss, run it under torch.no_grad(), or leave its "
                    "weights off Muon"
                )
            elif unit.state is not BufferState.FREE and not unit.swapped_in and ctx.gradient_sync:
                unit.free()  # prefetched but never used
        if ctx.gradient_sync:
            ctx.reducer.finish() if ctx.is_last_backward else ctx.reducer.issue_rest()
