"""``DedicatedParams``: what users call on a dedication, as FSDP2's ``FSDPModule``.

The handle ``dedicate_params`` returns: what this rank holds (queries), the
optimizer-step protocol ``DMuon.step`` follows (``step_units``,
``before_update``, ``updated``), the collectives in flight, and ``remove()``
here; three groups of its methods in their own modules, mixed in:
``handle_figures.py`` (the figures the training log reads),
``handle_weights.py`` (every weight in full, TP shards as full matrices, the
same-seed initialisation) and ``handle_gradient_sync.py`` (gradient sync for
pipelining, the all-reduce hook for fault tolerance). The hooks that drive a
step are ``hooks.py``'s ``StepHooks`` (FSDP2's ``FSDPState``), a layer's buffer
and lifecycle ``unit.py``'s ``Unit`` (its ``FSDPParamGroup``).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from titan_dmuon.plan.ownership import OwnershipPlan
from titan_dmuon.runtime.comm import CommLabel
from titan_dmuon.runtime.context import RuntimeContext
from titan_dmuon.runtime.handle_figures import HandleFigures
from titan_dmuon.runtime.handle_gradient_sync import GradientSync
from titan_dmuon.runtime.handle_weights import HandleWeights
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


class DedicatedParams(HandleFigures, HandleWeights, GradientSync):
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
        self._step_hooks = StepHooks(
            module=module,
            ctx=ctx,
            members=members,
            param_dtype=mp_policy.param_dtype if mp_policy else None,
            follow_params=self.follow_registered_params,
        )
        self.tensor_parallel_ns = (
            TensorParallelNewtonSchulz(self.mode.tp, ctx.stats, ctx.streams) if self.mode.tp else None
        )
        mesh = self.mode.mesh
        self.local_tp_experts = {  # TP-split experts kept on this data-parallel rank, with their homes, by name
            x.fqn: x for x in plan.local_tp_experts_of(mesh.replicate_rank * mesh.shard_size + mesh.shard_rank)
        }
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
        """The data-parallel DeviceMesh the weights are dedicated on (1-D, or HSDP's replicate x shard)."""
        return self.mode.mesh.mesh

    @property
    def owner_groups(self):
        """The owner groups this rank is in (``owner_group_comm.OwnerGroupComm``), or None (none in the plan)."""
        return self._ctx.owner_groups

    @property
    def reshard_after_forward(self) -> bool:
        """True for Z3 (each layer's buffer freed after forward), False for Z2."""
        return self.mode.reshard_after_forward

    @property
    def members(self) -> list[Member]:
        """What this rank holds of each dedicated weight (one record per weight, in dedication order)."""
        return list(self._members)

    @property
    def ignored_params(self) -> set[nn.Parameter]:
        """The dedicated weights, for ``fully_shard(..., ignored_params=...)`` (FSDP2 must leave them alone)."""
        return {m.param for m in self._members}

    @property
    def params(self) -> list[nn.Parameter]:
        """The dedicated weights (master weights: whole on their shard owners, empty placeholders elsewhere)."""
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
        """The records of the dedicated weights ``module`` registers itself."""
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

    # ---- in-flight collectives, weights written outside the step -----------------------------------------
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
        if unit is self.first_of_next_forward():
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


def handles_for(params, dedicated, *, module: nn.Module | None = None) -> list[DedicatedParams]:
    """The handles ``dedicated`` names (one or a sequence), checked against ``params``: a dedicated
    weight whose handle is not among them is refused, since it would otherwise be treated as a plain
    tensor (AdamW on an owner's full weight, a norm counting it wrongly). ``dedicated=None``: the
    handles found from ``params`` (each dedicated weight is stamped by its handle), then those of
    ``dedicate_params`` calls on ``module`` or its submodules (a handle whose Muon weights are all
    experts kept in place stamps none), in that order, the same on every rank."""
    if dedicated is None:
        found = [stamp() for p in params if (stamp := getattr(p, "_dmuon_handle", None)) is not None]
        if module is not None:
            found += [h for sub in module.modules() for h in DedicatedParams.of(sub)]
        return list(dict.fromkeys(h for h in found if h is not None))
    if isinstance(dedicated, DedicatedParams):
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
