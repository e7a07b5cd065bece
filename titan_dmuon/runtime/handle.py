"""``DedicatedParams``: the handle users hold, and the hooks that drive a step.

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
* end of backward: the reducer finishes; owners have ``.grad``;
* the optimizer step (``DMuon.step``) goes unit by unit in forward order and
  calls ``updated(U)`` after each: HSDP's replica broadcast of U, and for the
  first unit its broadcast for the next forward, overlapping the later units'
  Newton–Schulz.

Every hook runs eagerly, outside ``torch.compile``'s graphs (dynamo-disabled,
as FSDP2's are), and is labelled ``DMuon::...`` in profiler traces.
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from fractions import Fraction

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils._pytree import tree_flatten, tree_unflatten

from titan_dmuon.plan import OwnershipPlan
from titan_dmuon.runtime.comm import CommLabel, comm_source
from titan_dmuon.runtime.context import Phase, RuntimeContext, UnitOrderError
from titan_dmuon.runtime.members import LocalExperts, Member
from titan_dmuon.runtime.mode import DedicationMode
from titan_dmuon.runtime.state_dict import install_state_dict_hooks
from titan_dmuon.runtime.tensor_parallel import TensorParallelNewtonSchulz
from titan_dmuon.runtime.unit import BufferState, Unit


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
                self._ctx.host_seconds += time.perf_counter() - start

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


class _DedicatedRoot:
    """Mixed into the class of the module given to ``dedicate_params``: follows parameters that
    ``nn.Module._apply`` replaced (``to_empty()`` on a meta model registers new objects), in
    this one place, as FSDP2's ``_apply`` override does."""

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        for handle in self.__dict__.get("_dmuon_handles", ()):
            handle.follow_registered_params()
        return out


_ROOT_CLASSES: dict[type, type] = {}  # memo of the generated classes (as FSDP2's), not state


def _attach(module: nn.Module, handle: DedicatedParams) -> None:
    cls = type(module)
    if not issubclass(cls, _DedicatedRoot):
        if cls not in _ROOT_CLASSES:
            _ROOT_CLASSES[cls] = type(f"Dedicated{cls.__name__}", (_DedicatedRoot, cls), {})
        module.__class__ = _ROOT_CLASSES[cls]
    module.__dict__.setdefault("_dmuon_handles", []).append(handle)


class DedicatedParams:
    """Handle returned by :func:`titan_dmuon.dedicate_params`.

    ``ignored_params`` goes to every ``fully_shard(..., ignored_params=...)``
    call; pass the handle to ``DMuon(..., dedicated=handle)`` and
    ``clip_grad_norm_(..., dedicated=handle)``; ``plan`` says who owns what;
    ``pop_comm_stats`` returns this rank's DMuon communication since the last
    call; ``remove()`` takes the hooks off.
    """

    def __init__(
        self,
        *,
        module: nn.Module,
        plan: OwnershipPlan,
        ctx: RuntimeContext,
        members: list[Member],
        mp_policy: MixedPrecisionPolicy | None,
        local_experts: list[LocalExperts],
    ) -> None:
        self.module = module
        self.plan = plan
        self.mode: DedicationMode = ctx.mode
        self.local_experts = list(local_experts)
        self._ctx = ctx
        self._members = members
        self._units: list[Unit] = ctx.units
        self._param_dtype = mp_policy.param_dtype if mp_policy else None
        self._by_param: dict[int, Member] = {}
        self._experts_by_param: dict[int, LocalExperts] = {}
        self._hooks: list = [
            module.register_forward_pre_hook(self._root_pre_forward),
            module.register_forward_hook(self._root_post_forward),
        ]
        self.tensor_parallel_ns = (
            TensorParallelNewtonSchulz(self.mode.tp, ctx.stats, ctx.streams) if self.mode.tp else None
        )
        mesh = self.mode.mesh
        self.local_tp_experts = {  # TP-split experts kept on this data-parallel rank, with their homes, by name
            x.fqn: x for x in plan.local_tp_experts_of(mesh.replicate_rank * mesh.shard_size + mesh.shard_rank)}
        self._initialized = False
        self._callback_queued = False
        for owner in self.owning_modules:
            self._hooks += install_state_dict_hooks(self, owner)
        _attach(module, self)
        self.follow_registered_params()

    def __repr__(self) -> str:
        return f"DedicatedParams({len(self._members)} weights in {len(self._units)} units, {self.mode.name})"

    @staticmethod
    def of(module: nn.Module) -> list[DedicatedParams]:
        """The handles of ``dedicate_params`` calls made on ``module`` (e.g. a TorchTitan model part)."""
        return list(module.__dict__.get("_dmuon_handles", ()))

    # ---- what this rank holds -------------------------------------------------------------
    @property
    def mesh(self):
        return self.mode.mesh.mesh

    @property
    def reshard_after_forward(self) -> bool:
        return self.mode.reshard_after_forward

    @property
    def members(self) -> list[Member]:
        return list(self._members)

    @property
    def ignored_params(self) -> set[nn.Parameter]:
        return {m.param for m in self._members}

    @property
    def params(self) -> list[nn.Parameter]:
        return [m.param for m in self._members]

    @property
    def fqns(self) -> list[str]:
        """Canonical names (without activation-checkpoint or compile wrapper segments)."""
        return [m.fqn for m in self._members]

    @property
    def owning_modules(self) -> list[nn.Module]:
        """The modules that register dedicated weights (e.g. the Linear layers)."""
        out: list[nn.Module] = []
        for m in self._members:
            if not any(m.module is o for o in out):
                out.append(m.module)
        return out

    def member_of(self, param: torch.Tensor) -> Member | None:
        """This handle's record of ``param`` if it is one of its dedicated weights."""
        found = self._by_param.get(id(param))
        return found if found is not None and found.param is param else None

    def local_expert_of(self, param: torch.Tensor) -> LocalExperts | None:
        """This handle's record of ``param`` if it is a 3-D expert weight updated where it lives."""
        found = self._experts_by_param.get(id(param))
        if found is not None and found.param is param:
            return found
        self._experts_by_param = {id(e.param): e for e in self.local_experts}  # FSDP2 replaced them
        found = self._experts_by_param.get(id(param))
        return found if found is not None and found.param is param else None

    def members_of(self, module: nn.Module) -> list[Member]:
        return [m for m in self._members if m.module is module]

    def runs_newton_schulz(self, param: nn.Parameter) -> bool:
        """True on the one rank of the job that updates ``param``."""
        return self._member(param).runs_ns

    def holds_full(self, param: nn.Parameter) -> bool:
        """True on the ranks that keep the full weight between steps (one per replicate group)."""
        return self._member(param).holds_full

    def _member(self, param: nn.Parameter) -> Member:
        found = self.member_of(param)
        if found is None:
            raise KeyError("not a dedicated parameter of this handle")
        return found

    def follow_registered_params(self) -> None:
        """Follow parameters ``module._apply`` replaced by new objects (``to_empty()``)."""
        for m in self._members:
            current = m.module._parameters.get(m.name)
            if current is not None and current is not m.param and current is not m.compute:
                m.param = current
        self._by_param = {id(m.param): m for m in self._members}
        for m in self._members:
            m.param._dmuon_handle = weakref.ref(self)  # DMuon and the clip refuse it without this handle

    # ---- figures ----------------------------------------------------------------------------
    def pop_comm_stats(self) -> dict[str, tuple[Fraction, Fraction, int]]:
        """{label: (elements, bytes, launches)} issued by DMuon on this rank since the last call."""
        return self._ctx.stats.pop()

    @property
    def buffer_bytes(self) -> int:
        """Packed-buffer memory allocated now on this rank."""
        return self._ctx.buffer_bytes

    @property
    def peak_buffer_bytes(self) -> int:
        """Its high-water mark since ``reset_peak_buffer_bytes()``."""
        return self._ctx.peak_buffer_bytes

    def reset_peak_buffer_bytes(self) -> None:
        self._ctx.peak_buffer_bytes = self._ctx.buffer_bytes

    def pop_host_seconds(self) -> float:
        """Host time spent in DMuon's hooks (forward and backward) since the last call."""
        seconds, self._ctx.host_seconds = self._ctx.host_seconds, 0.0
        return seconds

    @property
    def first_layer_wait_seconds(self) -> float:
        """How long the last forward's first layer waited for its weights, broadcast since the step
        updated them (a device-event span on an accelerator: the compute stream's stall; the host's
        wait on the CPU). Reading it syncs with the device once."""
        return self._ctx.first_wait.seconds()

    @property
    def kept_unit_numel(self) -> int:
        """Z3: elements of the unit kept from forward to backward (the last one forward runs).

        Known after the first step; 0 before, and in Z2 (where every unit is kept)."""
        ctx = self._ctx
        if not self.mode.reshard_after_forward or ctx.recording or not ctx.forward_order:
            return 0
        return ctx.forward_order[-1].numel

    # ---- weights everywhere, checkpoints, initialisation ------------------------------------------------
    @torch.no_grad()
    def full_tensors(self) -> dict[str, torch.Tensor]:
        """Every dedicated weight in full on every rank (a collective; for export and tests)."""
        self.wait_for_replicate_broadcasts()
        mesh = self.mode.mesh
        out = {}
        for m in self._members:
            full = m.param.detach().clone() if m.holds_full else torch.empty(m.shape, dtype=m.param.dtype, device=m.param.device)
            if mesh.shard_size > 1:
                with comm_source(CommLabel.EXPORT):
                    dist.broadcast(full, group_src=self.plan.shard_owner(m.entry), group=mesh.shard_group)
            out[m.fqn] = self.tp_full(m, full)
        return out

    def tp_full(self, member: Member, shard: torch.Tensor) -> torch.Tensor:
        """The full matrix from this rank's TP-local ``shard`` of ``member`` (an all-gather on the TP
        group); ``shard`` itself without tensor parallelism."""
        tp = self.mode.tp
        if member.entry.tp_dim is None:
            return shard
        parts = [torch.empty_like(shard) for _ in range(tp.size)]
        with comm_source(CommLabel.EXPORT):
            dist.all_gather(parts, shard.contiguous(), group=tp.group)
        return torch.cat(parts, dim=member.entry.tp_dim)

    def tp_local(self, member: Member, full: torch.Tensor) -> torch.Tensor:
        """This rank's TP-local shard of a full value of ``member`` (a view)."""
        if member.entry.tp_dim is None:
            return full
        return full.chunk(self.mode.tp.size, dim=member.entry.tp_dim)[self.mode.tp.rank]

    def as_sharded(self, member: Member, local: torch.Tensor) -> torch.Tensor:
        """``local`` (this rank's TP shard of ``member``, e.g. its weight or momentum) as a DTensor of
        the full matrix on the TP mesh, for DCP, which then saves and reshards whole matrices; a
        plain tensor without tensor parallelism."""
        if member.entry.tp_dim is None:
            return local
        from torch.distributed.tensor import DTensor, Shard

        full = torch.Size(member.entry.full_shape)
        return DTensor.from_local(local, self.mode.tp.mesh, [Shard(member.entry.tp_dim)], run_check=False,
                                  shape=full, stride=torch.empty(full, device="meta").stride())

    @contextlib.contextmanager
    def initialising(self, module: nn.Module, *, sharded: bool, shard_dim=None, layout=None):
        """While ``module`` initialises its dedicated weights, give each the form it would have in
        the same model without DMuon, so that the initialiser draws the same random numbers:

        * ``sharded`` (FSDP2 or HSDP): a DTensor laid out as FSDP2 shards it, ``Shard(d)`` on
          the dedication mesh (``Replicate()`` across HSDP replicas), ``d = shard_dim(member)``
          (default 0, FSDP2's default); each rank draws its own shard exactly as FSDP2's would;
        * not sharded (DDP): the full weight on every rank.

        On exit the owners keep the assembled full weight (one all-gather per sharded weight:
        a collective, at the same point on every rank) and the other ranks their 0-element
        placeholders. Transient memory: one full weight per rank at a time.

        ``layout(member) -> (mesh, placements)`` overrides the DTensor layout of the full matrix
        (tensor parallelism: FSDP2's layout over the data-parallel and tp dims); each holder then
        keeps its TP-local shard.
        """
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        mesh = self.mesh
        members = self.members_of(module)
        stand_ins = []
        for m in members:
            full = torch.Size(m.entry.full_shape)
            if layout is not None or sharded:
                if layout is not None:
                    stand_in_mesh, placements = layout(m)
                else:
                    dim = shard_dim(m) if shard_dim is not None else 0
                    stand_in_mesh, placements = mesh, ((Shard(dim),) if mesh.ndim == 1 else (Replicate(), Shard(dim)))
                local_shape, _ = compute_local_shape_and_global_offset(full, stand_in_mesh, placements)
                local = torch.empty(local_shape, dtype=m.param.dtype, device=m.param.device)
                data = DTensor.from_local(local, stand_in_mesh, placements, run_check=False, shape=full,
                                          stride=torch.empty(full, device="meta").stride())
            else:
                data = torch.empty(full, dtype=m.param.dtype, device=m.param.device)
            stand_ins.append(nn.Parameter(data, requires_grad=m.param.requires_grad))
            m.module._parameters[m.name] = stand_ins[-1]
        completed = False
        try:
            yield
            completed = True
        finally:
            for m, stand_in in zip(members, stand_ins):
                m.module._parameters[m.name] = m.param
                if completed:
                    with torch.no_grad():
                        value = stand_in.data
                        full = value.full_tensor() if isinstance(value, DTensor) else value
                        if m.holds_full:
                            m.param.copy_(self.tp_local(m, full))
        if completed:
            self.weights_changed()

    def wait_for_replicate_broadcasts(self, *, host: bool = False) -> None:
        """Finish the post-step broadcasts to replicate peers (HSDP): the current stream waits,
        or with ``host=True`` the host (before a checkpoint reads the weights)."""
        if host:
            self._ctx.replicas.synchronize_all()
        else:
            self._ctx.replicas.wait_all()

    def discard_gathered_weights(self) -> None:
        """Drop buffers gathered ahead of a forward (e.g. before the weights are loaded anew)."""
        for unit in self._units:
            if not unit.swapped_in and unit.state is not BufferState.FREE:
                unit.free()

    def weights_changed(self) -> None:
        """The owners' weights were written outside ``step()`` (a load, an initialiser): gathers
        ahead of the next forward are dropped and later ones read the new values."""
        self.discard_gathered_weights()
        for unit in self._units:
            unit.weights_event = self._ctx.streams.record()

    # ---- gradient accumulation without sync (pipelining) ------------------------------------------
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

    # ---- the optimizer step (DMuon) -----------------------------------------------------------------
    def step_units(self) -> list[Unit]:
        """The units in the order ``DMuon.step`` updates them: forward order (known after a step)."""
        if self.holds_unreduced_gradients:
            raise RuntimeError(
                "the optimizer step came while gradients were held unreduced (gradient sync off): call "
                "handle.reduce_gradients() after the last micro-batch, or turn gradient sync back on "
                "(set_requires_gradient_sync(True)) before its backward"
            )
        return self._ctx.units_in_order()

    def before_update(self, unit: Unit) -> None:
        """The compute stream, about to write ``unit``'s weights, waits for the broadcasts that read
        them (HSDP: last step's broadcast to replicas)."""
        self._ctx.replicas.wait(unit)

    def updated(self, unit: Unit) -> None:
        """``unit``'s weights are updated: send them to their replicas (HSDP), and if it is the first
        unit forward runs, start its broadcast for the next forward now (a program point on every
        rank, whatever each rank owns of it)."""
        ctx = self._ctx
        unit.weights_event = ctx.streams.record()
        ctx.replicas.broadcast(unit, source=CommLabel.REPLICATE_BROADCAST)
        if self._initialized and not ctx.recording and ctx.forward_order and unit is ctx.forward_order[0]:
            if not unit.swapped_in:
                unit.free()  # (a buffer gathered before this step holds the old weights)
            unit.gather(CommLabel.FORWARD_BROADCAST)

    # ---- removal ----------------------------------------------------------------------------------
    def remove(self) -> None:
        """Take every DMuon hook off the model (after finishing what is in flight).

        Dedicated weights stay where they are: full on their owners, placeholders
        elsewhere; call ``full_tensors()`` first to have them everywhere.
        """
        self.wait_for_replicate_broadcasts()
        for unit in self._units:
            if unit.swapped_in:
                unit.swap_out()
            unit.free()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        handles = self.module.__dict__.get("_dmuon_handles", [])
        if self in handles:
            handles.remove(self)
        for m in self._members:
            m.param.__dict__.pop("_dmuon_handle", None)

    # ---- hooks ----------------------------------------------------------------------------------------
    def _lazy_init(self) -> None:
        """At the first forward, once the model is materialised: compute params, the unit hooks
        (registered now, so they run after FSDP2's own), and HSDP's first replica sync."""
        if self._initialized:
            return
        self.follow_registered_params()
        for m in self._members:
            if m.param.is_meta:
                raise RuntimeError(
                    f"dedicated parameter {m.fqn!r} is still on the meta device at the first forward: "
                    "call model.to_empty(device=...) and initialise the weights first"
                )
        device = self.mode.mesh.device
        for unit in self._units:
            unit.allocate_compute_params(self._param_dtype or unit.members[0].param.dtype, device)
            self._hooks.append(unit.module.register_forward_pre_hook(
                functools.partial(self._pre_forward, unit), with_kwargs=True))
            self._hooks.append(unit.module.register_forward_hook(functools.partial(self._post_forward, unit)))
            unit.weights_event = self._ctx.streams.record()
        self._initialized = True
        for unit in self._units:  # replicas may have been initialised differently: the global owner's copy wins
            self._ctx.replicas.broadcast(unit, source=CommLabel.REPLICATE_SYNC)

    @_hook("root_pre_forward")
    def _root_pre_forward(self, module, args) -> None:
        if _in_backward():
            return
        self._lazy_init()
        ctx = self._ctx
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
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: self._queue_final_callback(), mode="any")

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
        ctx = self._ctx
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
            ctx.reducer.finish()


def handles_for(params, dedicated) -> list[DedicatedParams]:
    """The handles ``dedicated`` names (one, a sequence, or None), checked against ``params``: a
    dedicated weight whose handle is not among them is refused, since it would otherwise be
    treated as a plain tensor (AdamW on an owner's full weight, a norm counting it wrongly)."""
    if dedicated is None:
        handles = []
    elif isinstance(dedicated, DedicatedParams):
        handles = [dedicated]
    else:
        handles = list(dedicated)
        if not all(isinstance(h, DedicatedParams) for h in handles):
            raise TypeError("dedicated= takes the handle(s) dedicate_params returned")
    for p in params:
        stamp = getattr(p, "_dmuon_handle", None)
        owner = stamp() if stamp is not None else None
        if owner is not None and owner not in handles:
            raise ValueError(
                f"a parameter of shape {tuple(owner.member_of(p).shape) if owner.member_of(p) else tuple(p.shape)} "
                "was dedicated by dedicate_params, but its handle was not passed: give it as dedicated=handle "
                "(DMuon(..., dedicated=handle), clip_grad_norm_(..., dedicated=handle))"
            )
    return handles
