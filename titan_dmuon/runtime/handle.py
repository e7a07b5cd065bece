"""``DedicatedParams``: what users call on a dedication, as FSDP2's ``FSDPModule``.

The handle ``dedicate_params`` returns: what this rank holds (queries), the
figures the training log reads, every weight in full (``full_tensors``),
gradient sync for pipelining, the all-reduce hook for fault tolerance, the
optimizer-step protocol ``DMuon.step`` follows (``step_units``,
``before_update``, ``updated``), and ``remove()``. The hooks that drive a step
are ``hooks.py``'s ``StepHooks`` (FSDP2's ``FSDPState``), a layer's buffer and
lifecycle ``unit.py``'s ``Unit`` (its ``FSDPParamGroup``); tensor-parallel
conversions live in ``tensor_parallel.py``, the same-seed initialisation in
``initialise.py``; the handle's methods of those names pass its mode on.
"""

from __future__ import annotations

import weakref
from fractions import Fraction

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from titan_dmuon.plan import OwnershipPlan
from titan_dmuon.runtime import initialise, tensor_parallel
from titan_dmuon.runtime.comm import CommLabel, comm_source
from titan_dmuon.runtime.context import RuntimeContext
from titan_dmuon.runtime.hooks import StepHooks
from titan_dmuon.runtime.members import LocalExperts, Member
from titan_dmuon.runtime.mode import DedicationMode
from titan_dmuon.runtime.state_dict import install_state_dict_hooks
from titan_dmuon.runtime.tensor_parallel import TensorParallelNewtonSchulz
from titan_dmuon.runtime.unit import BufferState, Unit


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
        self._by_param: dict[int, Member] = {}
        self._experts_by_param: dict[int, LocalExperts] = {}
        self._step_hooks = StepHooks(module=module, ctx=ctx, members=members,
                                     param_dtype=mp_policy.param_dtype if mp_policy else None,
                                     follow_params=self.follow_registered_params)
        self.tensor_parallel_ns = (
            TensorParallelNewtonSchulz(self.mode.tp, ctx.stats, ctx.streams) if self.mode.tp else None
        )
        mesh = self.mode.mesh
        self.local_tp_experts = {  # TP-split experts kept on this data-parallel rank, with their homes, by name
            x.fqn: x for x in plan.local_tp_experts_of(mesh.replicate_rank * mesh.shard_size + mesh.shard_rank)}
        self._state_dict_hooks = [h for owner in self.owning_modules for h in install_state_dict_hooks(self, owner)]
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
            like = m.param
            full = like.detach().clone() if m.holds_full else torch.empty(m.shape, dtype=like.dtype, device=like.device)
            if mesh.shard_size > 1:
                with comm_source(CommLabel.EXPORT):
                    dist.broadcast(full, group_src=self.plan.shard_owner(m.entry), group=mesh.shard_group)
            out[m.fqn] = self.tp_full(m, full)
        return out

    def tp_full(self, member: Member, shard: torch.Tensor) -> torch.Tensor:
        """``tensor_parallel.tp_full`` on this handle's TP group (a collective)."""
        return tensor_parallel.tp_full(self.mode.tp, member, shard)

    def tp_local(self, member: Member, full: torch.Tensor) -> torch.Tensor:
        """``tensor_parallel.tp_local``: this rank's TP-local shard of a full value of ``member``."""
        return tensor_parallel.tp_local(self.mode.tp, member, full)

    def as_sharded(self, member: Member, local: torch.Tensor) -> torch.Tensor:
        """``tensor_parallel.as_sharded``: a TP shard as a DTensor of the full matrix, for DCP."""
        return tensor_parallel.as_sharded(self.mode.tp, member, local)

    def initialising(self, module: nn.Module, *, sharded: bool, shard_dim=None, layout=None):
        """While ``module`` initialises its dedicated weights, give each the form it would have in
        the same model without DMuon, so that the initialiser draws the same random numbers
        (``initialise.initialising``):

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
        return initialise.initialising(self.members_of(module), self.mode, sharded=sharded, shard_dim=shard_dim,
                                       layout=layout, on_written=self.weights_changed)

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

    def finish_in_flight(self) -> None:
        """The host waits for every collective this handle launched and nobody waited for yet (HSDP's
        replica broadcasts; the next forward's first broadcast, which each step starts) and the
        gathered buffers are dropped. Call it before the process groups go (the end of training):
        a gloo worker still finishing one while the interpreter shuts down aborts the process.
        Hooks stay; the next forward gathers again."""
        self.wait_for_replicate_broadcasts(host=True)
        for unit in self._units:
            unit.synchronize()
        self.discard_gathered_weights()

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

    # ---- the optimizer step (DMuon) -----------------------------------------------------------------
    def step_units(self) -> list[Unit]:
        """The units in the order ``DMuon.step`` updates them: forward order (known after a step)."""
        if self.holds_unreduced_gradients:
            raise RuntimeError(
                "the optimizer step came while gradients were held unreduced (gradient sync off) or their "
                "reduces unfinished (set_is_last_backward(False)): call handle.set_is_last_backward(True) and "
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
        if self._step_hooks.initialized and not ctx.recording and ctx.forward_order and unit is ctx.forward_order[0]:
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
        self._step_hooks.remove()
        for hook in self._state_dict_hooks:
            hook.remove()
        self._state_dict_hooks.clear()
        handles = self.module.__dict__.get("_dmuon_handles", [])
        if self in handles:
            handles.remove(self)
        for m in self._members:
            m.param.__dict__.pop("_dmuon_handle", None)


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
