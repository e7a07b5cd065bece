"""A handle's gradient sync: accumulation without it (pipelining), and the all-reduce hook (TorchFT).

Mixed into ``DedicatedParams`` (``handle.py``), whose ``_ctx`` (``RuntimeContext``: the reducer,
the units), ``_units`` and ``mode`` it reads; the methods are the handle's own public names, as
FSDP2's ``FSDPModule`` methods of the same names.
"""

from __future__ import annotations

import torch


class GradientSync:
    """When a handle's backward reduces gradients to their owners, and what runs on them there."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """False: backward passes keep each layer's gradients on every rank, accumulating, and keep
        its gathered weights (each weight is broadcast once, not once per micro-batch); they are
        reduced by the next backward with sync on, or by ``reduce_gradients()``. As FSDP2's
        method of the same name. Memory: every dedicated weight and its accumulated gradient
        in full on every rank until the reduce (Z2's weights plus a gradient of the same size)."""
        self._ctx.gradient_sync = bool(requires_gradient_sync)

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Reduce the gradients that accumulated with sync off (a collective at the same point on
        every rank; what pipelining schedules call after the last micro-batch's backward), and, when
        this is the last backward (``set_is_last_backward``), finish every reduce in flight."""
        held = [u for u in reversed(self._ctx.units_in_order()) if u.holds_unreduced_grads]
        for unit in held:
            unit.reduce_held_gradients()
        reducer = self._ctx.reducer
        reducer.finish() if self._ctx.is_last_backward else reducer.issue_rest()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """False (a pipeline schedule's backward passes): the end of a backward with gradient sync,
        and ``reduce_gradients()``, issue what is left of the reduces but leave the compute stream's
        waits for them, and the owners' ``.grad``, to ``reduce_gradients()`` after it is True again
        (after the schedule), so that the stage's sends do not queue behind them. As FSDP2's method
        of the same name, which torch.distributed.pipelining sets False during the schedule."""
        self._ctx.is_last_backward = bool(is_last_backward)

    def set_all_reduce_hook(self, hook) -> None:
        """As FSDP2's method of the same name (``FSDPModule.set_all_reduce_hook``), for fault-tolerant
        replica groups (TorchFT): ``hook(reduced)`` runs on each owner's reduced gradient buffer (one
        per layer and owner, in the reduce dtype, changed in place) before it becomes ``.grad``, on
        every owner at the same program point. Every replica group dedicates on its own mesh with
        the same plan, so the owners at one coordinate of every group pass the same buffers in the
        same order: a hook that all-reduces them across the groups (TorchFT's ``Manager.allreduce``)
        averages each owner's gradient with its peers'. None removes it."""
        if hook is not None and self.mode.mesh.hsdp:
            raise NotImplementedError(
                "set_all_reduce_hook on an HSDP handle: HSDP reduces each gradient to one global owner across "
                "the replicate dim, so no other rank holds it to average with; dedicate on each replica group's "
                "own 1-D mesh (every group then has an owner of every weight)"
            )
        self._ctx.reducer.all_reduce_hook = hook

    @property
    def holds_unreduced_gradients(self) -> bool:
        """Gradients held with sync off, or reduces not finished (``set_is_last_backward(False)``)."""
        return self._ctx.reducer.awaiting_finish or any(u.holds_unreduced_grads for u in self._units)
