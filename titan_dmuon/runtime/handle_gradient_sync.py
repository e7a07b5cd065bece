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
        every rank; what pipelining schedules call after the last micro-batch's backward)."""
        held = [u for u in reversed(self._ctx.units_in_order()) if u.holds_unreduced_grads]
        for unit in held:
            unit.reduce_held_gradients()
        if held:
            self._ctx.reducer.finish()

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
        return any(u.holds_unreduced_grads for u in self._units)
