"""``DedicatedParams``: the hooks that drive a step, and the handle users hold.

One step, for a unit (a layer) U with dedicated weights:

* root pre-forward: the first unit's broadcast is in flight already (issued
  at the end of the previous step) or is issued now;
* U pre-forward: wait for U's broadcast, issue the next unit's (prefetch),
  swap U's compute params in;
* U post-forward: Z3 frees U's buffer (except the last unit, whose backward
  comes next), Z2 keeps it; a hook on U's outputs marks U's backward start;
* U pre-backward: (Z3) wait for U's re-broadcast and prefetch the unit before it;
* U post-backward (every compute param has its gradient): the reducer
  launches U's reduces; U's buffer is freed and its registered params put back;
* end of backward: the reducer finishes; owners have ``.grad``;
* after the optimizer step (``after_step``, called by DMuon): HSDP replica
  broadcasts, then the first unit's broadcast for the next step.

Every hook runs eagerly, outside ``torch.compile``'s graphs (the unit hooks
around the unit's ``__call__``, see ``_UnitCall``), and is labelled
``DMuon::...`` in profiler traces.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils._pytree import tree_flatten

from titan_dmuon.muon_math import block_rows, ns_flops
from titan_dmuon.plan import OwnershipPlan
from titan_dmuon.runtime.comm import CommStats, Streams, comm_source
from titan_dmuon.runtime.reducer import GradientReducer
from titan_dmuon.runtime.replica_sync import ReplicaSync
from titan_dmuon.runtime.state_dict import install_state_dict_hooks
from titan_dmuon.runtime.unit import BufferState, Member, Phase, Unit


def _hook(label: str):
    """Keep a hook out of torch.compile's graphs (as FSDP2 does) and name it in profiler traces."""

    def decorate(fn):
        @functools.wraps(fn)
        def labelled(*args, **kwargs):
            with torch.profiler.record_function(f"DMuon::{label}"):
                return fn(*args, **kwargs)

        return torch._dynamo.disable(labelled, recursive=True, reason="DMuon hooks run eagerly")

    return decorate


@dataclass(eq=False)
class LocalExperts:
    """A 3-D expert weight left to FSDP2 / expert parallelism, sharded on dim 0: every rank
    holds whole experts and runs Muon on them itself (no collective of DMuon's)."""

    fqn: str
    module: nn.Module
    name: str
    blocks: tuple  # row blocks of each expert's matrix

    @property
    def param(self) -> nn.Parameter:
        """The registered parameter now (FSDP2 replaces it by a DTensor parameter)."""
        return self.module._parameters[self.name]

    def spec_flops(self, shape) -> int:
        """NS FLOPs of one expert's matrix."""
        return sum(ns_flops(block_rows(b), shape[-1]) for b in self.blocks)


def _local_shape_and_offset(shape, mesh, placements):
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(torch.Size(shape), mesh, placements)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _UnitCall:
    """Mixed into each unit module's class: DMuon's pre/post-forward run around ``__call__``.

    Not as module hooks: TorchTitan compiles every block (``block.compile(fullgraph=True)``
    compiles ``_call_impl``, hooks included), and a hook that must run eagerly would break
    that graph. Around ``__call__`` they run outside the compiled region, as plain Python.
    """

    def __call__(self, *args, **kwargs):
        calls = self.__dict__.get("_dmuon_calls", ())
        for pre, _ in calls:
            pre()
        output = super().__call__(*args, **kwargs)
        for _, post in calls:
            post(output)
        return output


_unit_classes: dict[type, type] = {}


def _attach_unit_call(module: nn.Module, pre, post) -> "_UnitCallHandle":
    cls = type(module)
    if not issubclass(cls, _UnitCall):
        if cls not in _unit_classes:
            _unit_classes[cls] = type(f"DMuon{cls.__name__}", (_UnitCall, cls), {})
        module.__class__ = _unit_classes[cls]
    module.__dict__.setdefault("_dmuon_calls", []).append((pre, post))
    return _UnitCallHandle(module, (pre, post))


class _UnitCallHandle:
    def __init__(self, module: nn.Module, entry) -> None:
        self.module, self.entry = module, entry

    def remove(self) -> None:
        calls = self.module.__dict__.get("_dmuon_calls", [])
        if self.entry in calls:
            calls.remove(self.entry)


class DedicatedParams:
    """Handle returned by :func:`titan_dmuon.dedicate_params`.

    ``ignored_params`` goes to every ``fully_shard(..., ignored_params=...)``
    call; ``plan`` says who owns what; ``pop_comm_stats`` returns this rank's
    DMuon communication since the last call; ``remove()`` takes the hooks off.
    """

    def __init__(
        self,
        *,
        module: nn.Module,
        plan: OwnershipPlan,
        mesh: DeviceMesh,
        members: list[Member],
        units: list[Unit],
        reshard_after_forward: bool,
        mp_policy: MixedPrecisionPolicy | None,
        gradient_divide_factor: float,
        local_experts: list[LocalExperts] = (),
    ) -> None:
        self.module = module
        self.local_experts = list(local_experts)
        self.plan = plan
        self.mesh = mesh
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype = mp_policy.param_dtype if mp_policy else None
        self._members = members
        self._units = units
        if mesh.ndim == 2:
            replicate_group, self.shard_group = mesh.get_group(0), mesh.get_group(1)
            self.replicate_rank, self.shard_rank = mesh.get_local_rank(0), mesh.get_local_rank(1)
        else:
            replicate_group, self.shard_group = None, mesh.get_group()
            self.replicate_rank, self.shard_rank = 0, mesh.get_local_rank()
        self._stats = CommStats()
        self._streams: Streams | None = None  # made at the first forward, on the weights' device
        self._reducer_args = dict(
            shard_group=self.shard_group, shard_size=plan.shard_size, shard_rank=self.shard_rank,
            replicate_group=replicate_group, replicate_size=plan.replicate_size, replicate_rank=self.replicate_rank,
            reduce_dtype=mp_policy.reduce_dtype if mp_policy else None, divide_factor=gradient_divide_factor,
            stats=self._stats,
        )
        self._reducer: GradientReducer | None = None
        self._replicas = ReplicaSync(
            replicate_group=replicate_group, replicate_size=plan.replicate_size, shard_rank=self.shard_rank, stats=self._stats
        )
        self._by_id: dict[int, Member] = {id(m.param): m for m in members}
        self._hooks: list = []
        self._initialized = False
        self._forward_order: list[Unit] = []
        self._recording_order = True
        self._callback_queued = False
        self.buffer_bytes = 0  # packed-buffer memory allocated now on this rank
        self.peak_buffer_bytes = 0  # its high-water mark since reset_peak_buffer_bytes()
        self._install_hooks()

    # ---- public ------------------------------------------------------------------------
    @property
    def ignored_params(self) -> set[nn.Parameter]:
        self.refresh()
        return {m.param for m in self._members}

    @property
    def params(self) -> list[nn.Parameter]:
        self.refresh()
        return [m.param for m in self._members]

    @property
    def fqns(self) -> list[str]:
        """Canonical names (without activation-checkpoint or compile wrapper segments)."""
        return [m.entry.fqn for m in self._members]

    def member_of(self, param: torch.Tensor) -> Member | None:
        """This handle's record of ``param`` if it is one of its dedicated weights (as of the last
        ``refresh()``: callers that look many parameters up refresh once first)."""
        found = self._by_id.get(id(param))
        return found if found is not None and found.param is param else None

    def local_expert_of(self, param: torch.Tensor) -> LocalExperts | None:
        """This handle's record of ``param`` if it is a 3-D expert weight updated where it lives."""
        return next((e for e in self.local_experts if e.param is param), None)

    def members_of(self, module: nn.Module) -> list[Member]:
        return [m for m in self._members if m.module is module]

    def runs_newton_schulz(self, param: nn.Parameter) -> bool:
        """True on the one rank of the job that updates ``param``."""
        return self._member(param).runs_ns

    def holds_full(self, param: nn.Parameter) -> bool:
        """True on the ranks that keep the full weight between steps (one per replicate group)."""
        return self._member(param).holds_full

    def pop_comm_stats(self) -> dict[str, tuple[Fraction, Fraction, int]]:
        """{label: (elements, bytes, launches)} issued by DMuon on this rank since the last call."""
        return self._stats.pop()

    def reset_peak_buffer_bytes(self) -> None:
        self.peak_buffer_bytes = self.buffer_bytes

    @property
    def kept_unit_numel(self) -> int:
        """Z3: elements of the unit kept from forward to backward (the last one forward runs).

        Known after the first step; 0 before, and in Z2 (where every unit is kept)."""
        if not self.reshard_after_forward or self._recording_order or not self._forward_order:
            return 0
        return self._forward_order[-1].numel

    @property
    def owning_modules(self) -> list[nn.Module]:
        """The modules that register dedicated weights (e.g. the Linear layers)."""
        out: list[nn.Module] = []
        for m in self._members:
            if not any(m.module is o for o in out):
                out.append(m.module)
        return out

    @torch.no_grad()
    def full_tensors(self) -> dict[str, torch.Tensor]:
        """Every dedicated weight in full on every rank (a collective; for export and tests)."""
        self.refresh()
        self.wait_for_replicate_broadcasts()
        out = {}
        for m in self._members:
            if m.holds_full:
                full = m.param.detach().clone()
            else:
                full = torch.empty(m.entry.shape, dtype=m.param.dtype, device=m.param.device)
            if self.plan.shard_size > 1:
                with comm_source("dmuon.export"):
                    dist.broadcast(full, group_src=self.plan.shard_owner(m.entry), group=self.shard_group)
            out[m.entry.fqn] = full
        return out

    @contextlib.contextmanager
    def initialising(self, module: nn.Module, *, sharded: bool, shard_dim=None):
        """While ``module`` initialises its dedicated weights, give each the form it would have in
        the same model without DMuon, so that the initialiser draws the same random numbers:

        * ``sharded`` (FSDP2 or HSDP): a DTensor laid out as FSDP2 shards it, ``Shard(d)`` on
          the dedication mesh (``Replicate()`` across HSDP replicas), ``d = shard_dim(member)``
          (default 0, FSDP2's default); each rank draws its own shard exactly as FSDP2's would;
        * not sharded (DDP): the full weight on every rank.

        On exit the owners keep the assembled full weight (one all-gather per sharded weight:
        a collective, at the same point on every rank) and the other ranks their 0-element
        placeholders. Transient memory: one full weight per rank at a time. Initialisers that
        run unchanged under FSDP2 run unchanged here, and so do ranks' random streams.
        """
        from torch.distributed.tensor import DTensor, Replicate, Shard

        self.refresh()
        members = self.members_of(module)
        stand_ins = []
        for m in members:
            if sharded:
                dim = shard_dim(m) if shard_dim is not None else 0
                placements = (Shard(dim),) if self.mesh.ndim == 1 else (Replicate(), Shard(dim))
                local_shape, _ = _local_shape_and_offset(m.entry.shape, self.mesh, placements)
                local = torch.empty(local_shape, dtype=m.param.dtype, device=m.param.device)
                data = DTensor.from_local(local, self.mesh, placements, run_check=False, shape=torch.Size(m.entry.shape),
                                          stride=torch.empty(m.entry.shape, device="meta").stride())
            else:
                data = torch.empty(m.entry.shape, dtype=m.param.dtype, device=m.param.device)
            stand_ins.append(nn.Parameter(data, requires_grad=m.param.requires_grad))
            m.module._parameters[m.name] = stand_ins[-1]
        completed = False
        try:
            yield
            completed = True
        finally:
            for m, stand_in in zip(members, stand_ins):
                m.module._parameters[m.name] = m.param
                if not completed:
                    continue
                with torch.no_grad():
                    full = stand_in.data.full_tensor() if sharded else stand_in.data
                    if m.holds_full:
                        m.param.copy_(full)

    def wait_for_replicate_broadcasts(self) -> None:
        """Finish the post-step broadcasts to replicate peers (HSDP), e.g. before a save."""
        self._replicas.wait_all()

    def discard_gathered_weights(self) -> None:
        """Drop buffers gathered ahead of a forward (e.g. before the weights are loaded anew)."""
        for unit in self._units:
            if not unit.swapped_in and unit.state is not BufferState.FREE:
                self._free(unit)

    def after_step(self) -> None:
        """After the optimizer step: HSDP replica broadcasts, then the first unit's broadcast
        for the next step, so the next forward starts with it in flight."""
        self.refresh()
        self._replicas.start(self._units, source="dmuon.replicate_broadcast")
        self._gather_first_unit()

    def refresh(self) -> None:
        """Follow parameters that ``module._apply`` replaced by new objects.

        ``model.to_empty(device=...)`` on a meta-device model (TorchTitan's order:
        parallelize, then materialise) registers NEW ``nn.Parameter`` objects.
        """
        for m in self._members:
            old = m.param
            m.refresh()
            if m.param is not old:
                self._by_id.pop(id(old), None)
                self._by_id[id(m.param)] = m

    def remove(self) -> None:
        """Take every DMuon hook off the model (after finishing what is in flight).

        Dedicated weights stay where they are: full on their owners, placeholders
        elsewhere; call ``full_tensors()`` first to have them everywhere.
        """
        self.wait_for_replicate_broadcasts()
        for unit in self._units:
            if unit.swapped_in:
                unit.swap_out()
            self._free(unit)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    # ---- setup -----------------------------------------------------------------------------
    def _member(self, param: nn.Parameter) -> Member:
        self.refresh()
        found = self.member_of(param)
        if found is None:
            raise KeyError("not a dedicated parameter of this handle")
        return found

    def _install_hooks(self) -> None:
        hooks = self._hooks
        hooks.append(self.module.register_forward_pre_hook(lambda mod, args: self._root_pre_forward()))
        for unit in self._units:
            hooks.append(
                _attach_unit_call(unit.module, lambda u=unit: self._pre_forward(u), lambda out, u=unit: self._post_forward(u, out))
            )
        for module in self.owning_modules:
            hooks += install_state_dict_hooks(self, module)

    def _lazy_init(self) -> None:
        """Allocate compute params on first forward, once the model is materialised."""
        if self._initialized:
            return
        self.refresh()
        for m in self._members:
            if m.param.is_meta:
                raise RuntimeError(
                    f"dedicated parameter {m.entry.fqn!r} is still on the meta device at the first forward: "
                    "call model.to_empty(device=...) and initialise the weights first"
                )
        device = self._members[0].param.device
        self._streams = Streams(device)
        self._reducer = GradientReducer(streams=self._streams, **self._reducer_args)
        # Tensor hooks are held by autograd's C++ side, out of the garbage collector's sight:
        # a strong reference back to this handle would keep the whole model alive forever.
        on_grad_ready = weakref.WeakMethod(self._on_grad_ready)
        for unit in self._units:
            dtype = self.param_dtype or unit.members[0].param.dtype
            unit.allocate_compute_params(dtype, lambda member: on_grad_ready()(member))
        self._initialized = True
        # Replicas may have been initialised differently: the global owner's copy wins.
        self._replicas.start(self._units, source="dmuon.replicate_sync")

    # ---- forward -----------------------------------------------------------------------------
    @_hook("root_pre_forward")
    def _root_pre_forward(self) -> None:
        if _in_backward():
            return
        self._lazy_init()
        self._gather_first_unit()  # no-op when the end of the last step launched it

    @_hook("pre_forward")
    def _pre_forward(self, unit: Unit) -> None:
        if _in_backward():
            return  # activation-checkpoint recompute: the pre-backward hook already gathered
        self._lazy_init()
        if self._recording_order and unit not in self._forward_order:
            self._forward_order.append(unit)
        self._gather(unit, source="dmuon.forward_broadcast")
        unit.wait()
        following = self._neighbour(unit, +1)
        if following is not None and not self._recording_order:
            self._gather(following, source="dmuon.forward_broadcast")
        unit.phase = Phase.FORWARD
        unit.swap_in()

    @_hook("post_forward")
    def _post_forward(self, unit: Unit, output) -> None:
        if _in_backward():
            return
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if torch.is_grad_enabled() and tensors:
            unit.phase = Phase.AWAITING_BACKWARD
            unit.grads_ready = 0
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads, u=unit: self._pre_backward(u), mode="any")
            if self.reshard_after_forward and not self._is_last_in_forward(unit):
                self._free(unit)
        else:  # no backward will come (evaluation, no_grad)
            unit.phase = Phase.IDLE
            self._free(unit)
            unit.swap_out()

    def _is_last_in_forward(self, unit: Unit) -> bool:
        return not self._recording_order and bool(self._forward_order) and unit is self._forward_order[-1]

    # ---- backward ------------------------------------------------------------------------------
    @_hook("pre_backward")
    def _pre_backward(self, unit: Unit) -> None:
        self._queue_final_callback()
        unit.phase = Phase.BACKWARD
        unit.grads_ready = 0
        self._gather(unit, source="dmuon.backward_broadcast")
        unit.wait()
        if self.reshard_after_forward:
            preceding = self._neighbour(unit, -1)
            if preceding is not None and preceding.phase is Phase.AWAITING_BACKWARD:
                self._gather(preceding, source="dmuon.backward_broadcast")

    @_hook("post_accumulate_grad")
    def _on_grad_ready(self, member: Member) -> None:
        self._queue_final_callback()
        unit = self._units[member.entry.unit]
        if unit.phase not in (Phase.AWAITING_BACKWARD, Phase.BACKWARD):
            return
        unit.grads_ready += 1
        if unit.grads_ready == len(unit.members):
            self._post_backward(unit)

    @_hook("post_backward")
    def _post_backward(self, unit: Unit) -> None:
        """Release the unit's buffer, then launch its reduces to the owners.

        The buffer goes first (the gradients are separate tensors), so it is never
        alive together with the reduce buffers, as FSDP2 reshards before its
        reduce-scatter copy-in."""
        unit.phase = Phase.IDLE
        self._free(unit)
        unit.swap_out()
        self._reducer.reduce(unit)

    def _queue_final_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    @_hook("finish_backward")
    def _finish_backward(self) -> None:
        self._callback_queued = False
        self._recording_order = False
        order = self._forward_order + [u for u in self._units if u not in self._forward_order]
        for unit in reversed(order):
            if unit.phase in (Phase.AWAITING_BACKWARD, Phase.BACKWARD):
                self._post_backward(unit)  # some parameters got no gradient this time
            elif unit.state is not BufferState.FREE and not unit.swapped_in:
                self._free(unit)  # prefetched but never used
        self._reducer.finish()

    # ---- buffers ------------------------------------------------------------------------------------
    def _gather(self, unit: Unit, *, source: str) -> None:
        if unit.state is not BufferState.FREE:
            return
        self._replicas.wait(unit)  # its holders' weights are current
        self._track_buffer(
            unit.gather(
                shard_rank=self.shard_rank, shard_group=self.shard_group, shard_size=self.plan.shard_size,
                source=source, stats=self._stats,
            )
        )

    def _gather_first_unit(self) -> None:
        """Launch the broadcast of the first unit forward runs (known once a step has run)."""
        if self._initialized and not self._recording_order and self._forward_order:
            self._gather(self._forward_order[0], source="dmuon.forward_broadcast")

    def _free(self, unit: Unit) -> None:
        self._track_buffer(-unit.free())

    def _track_buffer(self, delta: int) -> None:
        self.buffer_bytes += delta
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, self.buffer_bytes)

    def _neighbour(self, unit: Unit, step: int) -> Unit | None:
        if unit not in self._forward_order:
            return None
        i = self._forward_order.index(unit) + step
        return self._forward_order[i] if 0 <= i < len(self._forward_order) else None
