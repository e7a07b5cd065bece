"""The runtime: hooks, packed buffers and collectives that move dedicated weights.

Life of a dedicated weight ``W`` owned by shard index s (one rank per shard group)
in a layer ``unit``:

* between steps only its owners hold ``W`` (the registered ``nn.Parameter``);
  every other rank keeps a 0-element placeholder, so per-rank memory is P_M/N;
* unit pre-forward: owners copy their weights into the unit's packed buffer
  (in the compute dtype) and broadcast their segment to the shard group;
  the modules see views of that buffer ("compute params") until backward ends;
* unit post-forward: Z3 frees the buffer (it is re-broadcast when the unit's
  backward starts), Z2 keeps it;
* unit post-backward (every compute param has its gradient): gradients are
  packed per owner and reduced to it asynchronously, the buffer is freed and
  the registered parameters are put back;
* end of backward: the reduces are completed; under HSDP the shard owner
  reduces further across the replicate group to the one global owner, which
  gets ``W.grad`` and runs Newton–Schulz. After the optimizer step the global
  owner broadcasts ``W`` to its replicate peers; the next forward waits for it.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from titan_dmuon.ledger import comm_source, theory_elements_per_rank
from titan_dmuon.muon_math import row_blocks
from titan_dmuon.plan import MatrixSpec, OwnershipPlan, PlanEntry, build_plan, validate_across_ranks

HSDP_DIM_NAMES = ("dp_replicate", "dp_shard")
_HSDP_ALIASES = {HSDP_DIM_NAMES, ("dp_replicate", "fsdp")}  # TorchTitan's legacy backend names the shard dim "fsdp"

# registered parameter -> (handle, member); how DMuon and the clip utility find them
_REGISTRY: WeakIdKeyDictionary = WeakIdKeyDictionary()
_HANDLES: weakref.WeakSet = weakref.WeakSet()


def dedicated_member(param: torch.Tensor):
    """(handle, member) if ``param`` is a dedicated weight, else None."""
    return _REGISTRY.get(param)


def refresh_registry() -> None:
    """Follow parameters that ``module._apply`` replaced by new objects.

    ``model.to_empty(device=...)`` on a meta-device model (TorchTitan's order:
    parallelize, then materialise) registers NEW ``nn.Parameter`` objects.
    Callers that look parameters up (DMuon, clip_grad_norm_) refresh first.
    """
    for handle in list(_HANDLES):
        handle._refresh_params()


@dataclass(eq=False)
class _Member:
    entry: PlanEntry
    param: nn.Parameter  # registered outside forward/backward; full data on shard owners only
    module: nn.Module
    name: str
    holds_full: bool  # this rank is the shard owner (keeps the full weight)
    runs_ns: bool  # this rank is the global owner (gets .grad, momentum, runs NS)
    offset: int = 0  # into the unit's packed buffer
    compute: nn.Parameter | None = None  # view of the packed buffer used by forward/backward


@dataclass(eq=False)
class _Segment:
    """Members of one unit owned by one shard index: one broadcast, one reduce."""

    shard_owner: int
    start: int
    stop: int
    members: list[_Member]  # sorted by replicate owner: one replicate-stage collective per owner


def _by_replicate_owner(plan: OwnershipPlan, members: list[_Member]) -> list[tuple[int, list[_Member]]]:
    return [(r, list(ms)) for r, ms in itertools.groupby(members, key=lambda m: plan.replicate_owner(m.entry))]


@dataclass(eq=False)
class _Unit:
    index: int
    module: nn.Module
    members: list[_Member]
    segments: list[_Segment]
    numel: int
    buffer: torch.Tensor | None = None
    works: list = field(default_factory=list)
    gathered: bool = False  # buffer holds the current weights (or will once `works` finish)
    swapped_in: bool = False
    awaiting_backward: bool = False
    grads_ready: int = 0


@dataclass(eq=False)
class _PendingReduce:
    segment: _Segment
    flat: torch.Tensor
    members: list[_Member]  # members with a gradient, in `flat` order
    work: object
    stage: str  # "shard" or "replicate"


class DedicatedParams:
    """Handle returned by :func:`dedicate_params`.

    ``ignored_params`` goes to every ``fully_shard(..., ignored_params=...)``
    call; ``plan`` says who owns what. ``pop_comm_stats`` returns this rank's
    DMuon communication (design units) since the last call, for logging.
    """

    def __init__(
        self,
        *,
        module: nn.Module,
        plan: OwnershipPlan,
        mesh: DeviceMesh,
        members: list[_Member],
        units: list[_Unit],
        reshard_after_forward: bool,
        mp_policy: MixedPrecisionPolicy | None,
        gradient_divide_factor: float,
    ) -> None:
        self.module = module
        self.plan = plan
        self.mesh = mesh
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype = mp_policy.param_dtype if mp_policy else None
        self.reduce_dtype = mp_policy.reduce_dtype if mp_policy else None
        self.gradient_divide_factor = gradient_divide_factor
        self._members = members
        self._units = units
        if mesh.ndim == 2:
            self.replicate_group: dist.ProcessGroup | None = mesh.get_group(0)
            self.shard_group = mesh.get_group(1)
            self.replicate_rank, self.shard_rank = mesh.get_local_rank(0), mesh.get_local_rank(1)
        else:
            self.shard_group = mesh.get_group()
            self.replicate_group = None
            self.replicate_rank = 0
            self.shard_rank = mesh.get_local_rank()
        self._initialized = False
        self._forward_order: list[_Unit] = []
        self._recording_order = True
        self._callback_queued = False
        self._pending_reduces: list[_PendingReduce] = []
        self._pending_replicate_broadcasts: dict[int, list] = {}  # unit index -> [(work, flat, members, src)]
        self._comm_stats: dict[str, tuple[Fraction, Fraction]] = {}  # source -> (elements, bytes)
        self._not_held_keys: set[str] = set()  # state-dict keys of weights other ranks hold
        self.buffer_bytes = 0  # packed-buffer memory allocated now on this rank
        self.peak_buffer_bytes = 0  # its high-water mark since reset_peak_buffer_bytes()

    # ---- public ------------------------------------------------------------------
    @property
    def ignored_params(self) -> set[nn.Parameter]:
        return {m.param for m in self._members}

    @property
    def params(self) -> list[nn.Parameter]:
        return [m.param for m in self._members]

    @property
    def fqns(self) -> list[str]:
        return [m.entry.fqn for m in self._members]

    def runs_newton_schulz(self, param: nn.Parameter) -> bool:
        """True on the one rank of the job that updates ``param``."""
        return _REGISTRY[param][1].runs_ns

    def holds_full(self, param: nn.Parameter) -> bool:
        """True on the ranks that keep the full weight between steps (one per replicate group)."""
        return _REGISTRY[param][1].holds_full

    def pop_comm_stats(self) -> dict[str, tuple[Fraction, Fraction]]:
        """{collective label: (elements, bytes)} issued by DMuon on this rank since the last call."""
        out, self._comm_stats = self._comm_stats, {}
        return out

    def reset_peak_buffer_bytes(self) -> None:
        self.peak_buffer_bytes = self.buffer_bytes

    def theory_elements_per_rank(self) -> Fraction:
        """The design's per-step elements per rank (averaged over ranks) for this configuration."""
        return theory_elements_per_rank(
            f"dmuon_z{3 if self.reshard_after_forward else 2}",
            shard_size=self.plan.shard_size,
            replicate_size=self.plan.replicate_size,
            numel=self.plan.total_numel,
        )

    @torch.no_grad()
    def full_tensors(self) -> dict[str, torch.Tensor]:
        """Every dedicated weight in full on every rank (a collective; for export and tests)."""
        self._refresh_params()
        self.wait_for_replicate_broadcasts()
        out = {}
        for m in self._members:
            full = m.param.detach().clone() if m.holds_full else torch.empty(m.entry.shape, dtype=m.param.dtype, device=m.param.device)
            if self.plan.shard_size > 1:
                with comm_source("dmuon.export"):
                    dist.broadcast(full, group_src=self.plan.shard_owner(m.entry), group=self.shard_group)
            out[m.entry.fqn] = full
        return out

    @property
    def owning_modules(self) -> list[nn.Module]:
        """The modules that register dedicated weights (e.g. the Linear layers)."""
        out: list[nn.Module] = []
        for m in self._members:
            if not any(m.module is o for o in out):
                out.append(m.module)
        return out

    @contextlib.contextmanager
    def full_size_placeholders(self, module: nn.Module):
        """Give this rank's 0-element placeholders of ``module``'s dedicated weights
        their full shape (uninitialised) for the duration; dropped on exit.

        For initialisers that draw every weight in full on every rank so that the
        random stream does not depend on the parallel layout (TorchTitan's
        ``init_weights``). Owners' weights are untouched.
        """
        self._refresh_params()
        placeholders = [m for m in self._members_of(module) if not m.holds_full]
        for m in placeholders:
            m.param.data = torch.empty(m.entry.shape, dtype=m.param.dtype, device=m.param.device)
        try:
            yield
        finally:
            for m in placeholders:
                m.param.data = torch.empty(0, dtype=m.param.dtype, device=m.param.device)

    def wait_for_replicate_broadcasts(self) -> None:
        """Finish the post-step broadcasts to replicate peers (HSDP), e.g. before a save."""
        for unit in self._units:
            self._finish_replicate_broadcast(unit)

    # ---- setup ---------------------------------------------------------------------
    def _refresh_params(self) -> None:
        for m in self._members:
            current = m.module._parameters.get(m.name)
            if current is None or current is m.param or current is m.compute:
                continue
            _REGISTRY.pop(m.param, None)
            m.param = current
            _REGISTRY[current] = (self, m)

    def _install_hooks(self) -> None:
        for unit in self._units:
            unit.module.register_forward_pre_hook(lambda mod, args, u=unit: self._pre_forward(u))
            unit.module.register_forward_hook(lambda mod, args, out, u=unit: self._post_forward(u, out))
        for module in self.owning_modules:  # (torch tags hooks with attributes: plain functions, not methods)
            module.register_state_dict_post_hook(lambda *args: self._on_state_dict(*args))
            module.register_load_state_dict_pre_hook(lambda *args: self._on_load_state_dict(*args))
            module.register_load_state_dict_post_hook(lambda *args: self._after_load_state_dict(*args))

    # ---- state dicts (DCP checkpoints) --------------------------------------------------
    # A dedicated weight appears in ``state_dict()`` only on the ranks that hold it, under
    # its normal name, with its current full value; other ranks leave the key out. DCP then
    # writes each weight once (from a holder: all holders agree once post-step broadcasts
    # have landed) and, on load, each rank requests exactly the weights it holds now, which
    # reshards across world sizes, Z2/Z3, FSDP/HSDP and ownership plans.
    def _members_of(self, module: nn.Module) -> list[_Member]:
        return [m for m in self._members if m.module is module]

    def _on_state_dict(self, module, state_dict, prefix, local_metadata) -> None:
        self._refresh_params()
        self.wait_for_replicate_broadcasts()
        for m in self._members_of(module):
            key = prefix + m.name
            if m.holds_full:  # the master weight, also while compute views are swapped in
                state_dict[key] = m.param if isinstance(state_dict.get(key), nn.Parameter) else m.param.detach()
            else:
                state_dict.pop(key, None)

    def _on_load_state_dict(self, module, state_dict, prefix, *args) -> None:
        self._refresh_params()
        self.wait_for_replicate_broadcasts()  # so that no older value lands after the load
        for m in self._members_of(module):
            if not m.holds_full:
                state_dict.pop(prefix + m.name, None)  # its holders load it
                self._not_held_keys.add(prefix + m.name)

    def _after_load_state_dict(self, module, incompatible_keys) -> None:
        """Weights this rank does not hold are not "missing" from what it was given."""
        missing = incompatible_keys.missing_keys
        missing[:] = [k for k in missing if k not in self._not_held_keys]

    def _lazy_init(self) -> None:
        """Allocate compute params on first forward, once the model is materialised."""
        if self._initialized:
            return
        self._refresh_params()
        for m in self._members:
            if m.param.is_meta:
                raise RuntimeError(
                    f"dedicated parameter {m.entry.fqn!r} is still on the meta device at the first forward: "
                    "call model.to_empty(device=...) and initialise the weights first"
                )
        for unit in self._units:
            device = unit.members[0].param.device
            dtype = self.param_dtype or unit.members[0].param.dtype
            storage = torch.empty(unit.numel, dtype=dtype, device=device)
            unit.buffer = storage
            for m in unit.members:
                view = torch.empty(0, dtype=dtype, device=device)
                # A separate tensor on the same storage: writes into the buffer do not bump the
                # version counter autograd checks on the compute param.
                view.set_(storage.untyped_storage(), m.offset, m.entry.shape)
                m.compute = nn.Parameter(view, requires_grad=m.param.requires_grad)
                m.compute.register_post_accumulate_grad_hook(lambda p, m=m: self._on_grad_ready(m))
            _free_storage(storage)  # allocated on first use
        self._initialized = True
        if self.replicate_group is not None and self.plan.replicate_size > 1:
            # Replicas may have been initialised differently: the global owner's copy wins.
            self._broadcast_to_replicas(source="dmuon.replicate_sync")

    # ---- forward -------------------------------------------------------------------
    def _pre_forward(self, unit: _Unit) -> None:
        if _in_backward():
            return  # activation-checkpoint recompute: the pre-backward hook already gathered
        self._lazy_init()
        if self._recording_order and unit not in self._forward_order:
            self._forward_order.append(unit)
        self._gather(unit, source="dmuon.forward_broadcast")
        self._wait_gathered(unit)
        nxt = self._neighbour(unit, +1)
        if nxt is not None and not self._recording_order:
            self._gather(nxt, source="dmuon.forward_broadcast")
        self._swap_in(unit)

    def _post_forward(self, unit: _Unit, output) -> None:
        if _in_backward():
            return
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if torch.is_grad_enabled() and tensors:
            unit.awaiting_backward = True
            unit.grads_ready = 0
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads, u=unit: self._pre_backward(u), mode="any")
            if self.reshard_after_forward:
                self._free(unit)
        else:
            self._free(unit)
            self._swap_out(unit)

    # ---- backward ------------------------------------------------------------------
    def _pre_backward(self, unit: _Unit) -> None:
        self._queue_final_callback()
        unit.awaiting_backward = True
        unit.grads_ready = 0
        self._gather(unit, source="dmuon.backward_broadcast")
        self._wait_gathered(unit)
        if self.reshard_after_forward:
            prev = self._neighbour(unit, -1)
            if prev is not None and prev.awaiting_backward:
                self._gather(prev, source="dmuon.backward_broadcast")

    def _on_grad_ready(self, member: _Member) -> None:
        self._queue_final_callback()
        unit = self._unit_of(member)
        if not unit.awaiting_backward:
            return
        unit.grads_ready += 1
        if unit.grads_ready == len(unit.members):
            self._post_backward(unit)

    def _post_backward(self, unit: _Unit) -> None:
        """Reduce the unit's gradients to their owners (async) and release its buffer.

        The reduces started before this unit are finished first, here: the
        replicate stage they chain into is then issued at the same point of the
        program on every rank. (Chaining "whenever a reduce happens to complete"
        reorders collectives on a process group that FSDP2 shares and deadlocks.)
        """
        self._drain_reduces()
        unit.awaiting_backward = False
        reduce_dtype = self.reduce_dtype or unit.members[0].param.dtype
        for segment in unit.segments:
            with_grad = [m for m in segment.members if m.compute.grad is not None]
            if not with_grad:
                continue
            flat = torch.cat([m.compute.grad.reshape(-1).to(reduce_dtype) for m in with_grad])
            for m in with_grad:
                m.compute.grad = None
            work = None
            if self.plan.shard_size > 1:
                work = self._collective(
                    "dmuon.shard_reduce", dist.reduce, flat, self.plan.shard_size,
                    group_dst=segment.shard_owner, group=self.shard_group,
                )
            self._pending_reduces.append(_PendingReduce(segment, flat, with_grad, work, "shard"))
        self._free(unit)
        self._swap_out(unit)

    def _queue_final_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        self._callback_queued = False
        self._recording_order = False
        order = self._forward_order + [u for u in self._units if u not in self._forward_order]
        for unit in reversed(order):
            if unit.awaiting_backward:
                self._post_backward(unit)  # some parameters got no gradient this time
            elif unit.gathered and not unit.swapped_in:
                self._free(unit)  # prefetched but never used
        while self._pending_reduces:
            self._drain_reduces()

    def _drain_reduces(self) -> None:
        """Finish the reduces issued so far: shard stage -> replicate stage -> owner's .grad."""
        pending, self._pending_reduces = self._pending_reduces, []
        for entry in pending:
            if entry.work is not None:
                entry.work.wait()
            if entry.segment.shard_owner != self.shard_rank:
                continue  # non-owners drop their (overwritten) copy
            if entry.stage == "shard" and self.plan.replicate_size > 1:
                self._start_replicate_reduce(entry)
            else:
                self._accumulate_grads(entry)

    def _start_replicate_reduce(self, pending: _PendingReduce) -> None:
        offset = 0
        for replicate_owner, members in _by_replicate_owner(self.plan, pending.members):
            numel = sum(m.entry.numel for m in members)
            # its own buffer: the owner keeps it as .grad, and the rest of the segment can go
            flat = pending.flat[offset : offset + numel].clone()
            offset += numel
            work = self._collective(
                "dmuon.replicate_reduce", dist.reduce, flat, self.plan.replicate_size,
                group_dst=replicate_owner, group=self.replicate_group,
            )
            self._pending_reduces.append(_PendingReduce(pending.segment, flat, members, work, "replicate"))

    def _accumulate_grads(self, pending: _PendingReduce) -> None:
        offset = 0
        for m in pending.members:
            numel = m.entry.numel
            if m.runs_ns:
                grad = pending.flat[offset : offset + numel].view(m.entry.shape).to(m.param.dtype)
                if self.gradient_divide_factor != 1.0:
                    grad.div_(self.gradient_divide_factor)
                if m.param.grad is None:
                    m.param.grad = grad
                else:
                    m.param.grad.add_(grad)
            offset += numel

    # ---- after the optimizer step (HSDP) ------------------------------------------------
    def after_step(self) -> None:
        """Send updated weights from global owners to replicate peers (async, HSDP only)."""
        self._refresh_params()
        if self.plan.replicate_size > 1:
            self._broadcast_to_replicas(source="dmuon.replicate_broadcast")

    @torch.no_grad()
    def _broadcast_to_replicas(self, *, source: str) -> None:
        for unit in self._units:
            self._finish_replicate_broadcast(unit)
            for segment in unit.segments:
                if segment.shard_owner != self.shard_rank:
                    continue
                for replicate_owner, members in _by_replicate_owner(self.plan, segment.members):
                    if replicate_owner == self.replicate_rank:
                        flat = torch.cat([m.param.detach().reshape(-1) for m in members])
                    else:
                        flat = torch.empty(sum(m.entry.numel for m in members), dtype=members[0].param.dtype, device=members[0].param.device)
                    work = self._collective(
                        source, dist.broadcast, flat, self.plan.replicate_size,
                        group_src=replicate_owner, group=self.replicate_group,
                    )
                    self._pending_replicate_broadcasts.setdefault(unit.index, []).append((work, flat, members, replicate_owner))

    @torch.no_grad()
    def _finish_replicate_broadcast(self, unit: _Unit) -> None:
        for work, flat, members, replicate_owner in self._pending_replicate_broadcasts.pop(unit.index, []):
            work.wait()
            if replicate_owner == self.replicate_rank:
                continue
            offset = 0
            for m in members:
                m.param.detach().copy_(flat[offset : offset + m.entry.numel].view(m.entry.shape))
                offset += m.entry.numel

    # ---- buffers -------------------------------------------------------------------
    @torch.no_grad()
    def _gather(self, unit: _Unit, *, source: str) -> None:
        """Start filling the unit's packed buffer from the owners (no-op if already done)."""
        if unit.gathered:
            return
        self._finish_replicate_broadcast(unit)
        buffer = unit.buffer
        self._track_buffer(_alloc_storage(buffer))
        for segment in unit.segments:
            if segment.shard_owner == self.shard_rank:
                for m in segment.members:
                    buffer[m.offset : m.offset + m.entry.numel].view(m.entry.shape).copy_(m.param)
            if self.plan.shard_size > 1:
                unit.works.append(
                    self._collective(
                        source, dist.broadcast, buffer[segment.start : segment.stop], self.plan.shard_size,
                        group_src=segment.shard_owner, group=self.shard_group,
                    )
                )
        unit.gathered = True

    def _wait_gathered(self, unit: _Unit) -> None:
        for work in unit.works:
            work.wait()
        unit.works.clear()

    def _free(self, unit: _Unit) -> None:
        self._wait_gathered(unit)
        if unit.buffer is not None:
            self._track_buffer(-_free_storage(unit.buffer))
        unit.gathered = False

    def _track_buffer(self, delta: int) -> None:
        self.buffer_bytes += delta
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, self.buffer_bytes)

    def _swap_in(self, unit: _Unit) -> None:
        for m in unit.members:
            m.module._parameters[m.name] = m.compute
        unit.swapped_in = True

    def _swap_out(self, unit: _Unit) -> None:
        for m in unit.members:
            m.module._parameters[m.name] = m.param
        unit.swapped_in = False

    def _neighbour(self, unit: _Unit, step: int) -> _Unit | None:
        if unit not in self._forward_order:
            return None
        i = self._forward_order.index(unit) + step
        return self._forward_order[i] if 0 <= i < len(self._forward_order) else None

    def _unit_of(self, member: _Member) -> _Unit:
        return self._units[member.entry.unit]

    def _collective(self, source: str, fn, tensor: torch.Tensor, group_size: int, **kwargs):
        elements = Fraction(group_size - 1, group_size) * tensor.numel()
        old_elements, old_bytes = self._comm_stats.get(source, (Fraction(0), Fraction(0)))
        self._comm_stats[source] = (old_elements + elements, old_bytes + elements * tensor.element_size())
        with comm_source(source):
            return fn(tensor, async_op=True, **kwargs)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _free_storage(tensor: torch.Tensor) -> int:
    """Release the tensor's memory (views keep their metadata); returns the bytes freed."""
    storage = tensor.untyped_storage()
    freed = storage.size()
    if freed:
        storage.resize_(0)
    return freed


def _alloc_storage(tensor: torch.Tensor) -> int:
    """Re-allocate a freed tensor's memory in place; returns the bytes allocated."""
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if storage.size() == nbytes:
        return 0
    storage.resize_(nbytes)
    return nbytes


# ---- dedicate_params -------------------------------------------------------------------
def dedicate_params(
    module: nn.Module,
    params: Iterable[nn.Parameter],
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    units: Sequence[nn.Module] | None = None,
    split_rows: Mapping[nn.Parameter, Sequence[int]] | None = None,
    gradient_divide_factor: float | None = None,
) -> DedicatedParams:
    """Give each of ``params`` one owner rank on ``mesh``; call before ``fully_shard``/DDP.

    Args:
        module: the model (or the part of it that contains ``params``).
        params: 2-D Muon-target weights of ``module``.
        mesh: 1-D DeviceMesh (FSDP shard group or DDP group) or 2-D mesh with
            dims ``("dp_replicate", "dp_shard")`` (HSDP).
        reshard_after_forward: True (Z3): free each layer's packed buffer after
            forward and re-broadcast it for backward. False (Z2): keep it.
        mp_policy: compute (``param_dtype``) and gradient-reduction
            (``reduce_dtype``) dtypes, as for FSDP2. Owners keep the master weights.
        units: modules that each get one packed buffer (usually the
            transformer blocks). Default: for each parameter, its outermost
            ancestor that is an element of an ``nn.ModuleList``/``nn.ModuleDict``,
            else the module that registers it.
        split_rows: per parameter, the row blocks orthogonalised separately:
            row counts (``[q_rows, k_rows, v_rows]`` for a fused q/k/v weight)
            or per block a list of ``(start, stop)`` row ranges (interleaved layouts).
        gradient_divide_factor: divide summed gradients by this; default the
            data-parallel world size (an average). TorchTitan, which normalises
            the loss by the global token count, uses 1.0.
    """
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(
            f"reshard_after_forward must be a bool (True = Z3, False = Z2), got {reshard_after_forward!r} "
            f"of type {type(reshard_after_forward).__name__}"
        )
    replicate_size, shard_size = _check_mesh(mesh)
    _check_not_wrapped(module)
    params = list(params)
    sites = _registration_sites(module)
    split_rows = dict(split_rows or {})
    seen: set[int] = set()
    resolved: list[tuple[str, nn.Parameter, nn.Module, str]] = []
    for p in params:
        if not isinstance(p, nn.Parameter):
            raise TypeError(f"dedicate_params expects nn.Parameter objects, got {type(p).__name__}")
        where = sites.get(id(p))
        if where is None:
            raise ValueError(
                f"a parameter of shape {tuple(p.shape)} is not a parameter of the given module; "
                "pass parameters obtained from module.parameters()"
            )
        fqn, owner_module, name = where[0]
        if len(where) > 1:
            raise ValueError(
                f"parameter {fqn!r} is registered in several places ({[w[0] for w in where]}); "
                "tied weights cannot be dedicated"
            )
        if id(p) in seen:
            raise ValueError(f"parameter {fqn!r} is listed twice")
        if p in _REGISTRY:
            raise ValueError(f"parameter {fqn!r} is already dedicated by an earlier dedicate_params call")
        if isinstance(p, DTensor):
            raise ValueError(f"parameter {fqn!r} is already a DTensor: call dedicate_params before fully_shard")
        if p.ndim != 2:
            raise ValueError(
                f"parameter {fqn!r} has shape {tuple(p.shape)}: only 2-D weights can be dedicated "
                "(Muon orthogonalises matrices; leave biases, norms and embeddings to AdamW)"
            )
        seen.add(id(p))
        resolved.append((fqn, p, owner_module, name))
    for p in split_rows:
        if id(p) not in seen:
            raise ValueError("split_rows names a parameter that is not being dedicated")
    unit_modules = _assign_units(module, resolved, units)

    specs = []
    unit_index: dict[int, int] = {}
    for (fqn, p, _, _), unit_module in zip(resolved, unit_modules):
        idx = unit_index.setdefault(id(unit_module), len(unit_index))
        try:
            blocks = tuple(row_blocks(p.shape, split_rows.get(p)))
        except ValueError as e:
            raise ValueError(f"parameter {fqn!r}: {e}") from None
        specs.append(MatrixSpec(fqn=fqn, shape=tuple(p.shape), unit=idx, blocks=blocks))
    plan = build_plan(specs, replicate_size=replicate_size, shard_size=shard_size)
    validate_across_ranks(plan, _mesh_groups(mesh), _mesh_device(mesh))

    if mesh.ndim == 2:
        my_replicate, my_shard = mesh.get_local_rank(0), mesh.get_local_rank(1)
    else:
        my_replicate, my_shard = 0, mesh.get_local_rank()
    members = []
    for (_, p, owner_module, name), entry in zip(resolved, plan.entries):
        holds_full = plan.shard_owner(entry) == my_shard
        runs_ns = holds_full and plan.replicate_owner(entry) == my_replicate
        members.append(_Member(entry=entry, param=p, module=owner_module, name=name, holds_full=holds_full, runs_ns=runs_ns))
        if not holds_full:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    by_unit: dict[int, list[_Member]] = {}
    for m in members:
        by_unit.setdefault(m.entry.unit, []).append(m)
    unit_objs = []
    modules_by_index = {idx: mod for mod in unit_modules for idx in [unit_index[id(mod)]]}
    for idx in range(len(unit_index)):
        ordered = sorted(by_unit[idx], key=lambda m: (plan.shard_owner(m.entry), plan.replicate_owner(m.entry)))
        segments, offset = [], 0
        for shard_owner, group in itertools.groupby(ordered, key=lambda m: plan.shard_owner(m.entry)):
            group = list(group)
            start = offset
            for m in group:
                m.offset = offset
                offset += m.entry.numel
            segments.append(_Segment(shard_owner=shard_owner, start=start, stop=offset, members=group))
        unit_objs.append(_Unit(index=idx, module=modules_by_index[idx], members=ordered, segments=segments, numel=offset))

    handle = DedicatedParams(
        module=module,
        plan=plan,
        mesh=mesh,
        members=members,
        units=unit_objs,
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy,
        gradient_divide_factor=float(gradient_divide_factor or plan.world_size),
    )
    for m in members:
        _REGISTRY[m.param] = (handle, m)
    _HANDLES.add(handle)
    handle._install_hooks()
    return handle


def _check_mesh(mesh) -> tuple[int, int]:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim == 1:
        return 1, mesh.size()
    if mesh.ndim == 2:
        names = tuple(mesh.mesh_dim_names or ())
        if names not in _HSDP_ALIASES:
            raise ValueError(
                f"a 2-D mesh must have dims named {HSDP_DIM_NAMES} (replicate x shard, HSDP); got {names or 'no names'}. "
                'Build it with init_device_mesh(device, (R, N), mesh_dim_names=("dp_replicate", "dp_shard"))'
            )
        return mesh.size(0), mesh.size(1)
    raise ValueError(f"mesh must be 1-D (DDP/FSDP) or 2-D (HSDP), got {mesh.ndim} dims {mesh.mesh_dim_names}")


def _mesh_groups(mesh: DeviceMesh) -> list[dist.ProcessGroup]:
    return [mesh.get_group(d) for d in range(mesh.ndim)]


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.accelerator.current_device_index())


def _check_not_wrapped(module: nn.Module) -> None:
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        raise ValueError("dedicate_params must be called before wrapping the model in DistributedDataParallel")
    for name, sub in module.named_modules():
        if isinstance(sub, FSDPModule):
            raise ValueError(
                f"module {name or '<root>'!r} is already sharded by fully_shard: call dedicate_params first, "
                "then fully_shard(..., ignored_params=handle.ignored_params)"
            )


_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_fqn(name: str) -> str:
    """A parameter name without activation-checkpoint / compile wrapper segments,
    so plans and checkpoints do not depend on those wrappers."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _registration_sites(module: nn.Module) -> dict[int, list[tuple[str, nn.Module, str]]]:
    sites: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for name, p in mod._parameters.items():
            if p is not None:
                fqn = canonical_fqn(f"{mod_name}.{name}" if mod_name else name)
                sites.setdefault(id(p), []).append((fqn, mod, name))
    return sites


def _assign_units(module: nn.Module, resolved, units: Sequence[nn.Module] | None) -> list[nn.Module]:
    """For each dedicated parameter, the module whose forward gathers it."""
    parent_of: dict[int, nn.Module] = {}
    containers = (nn.ModuleList, nn.ModuleDict)
    for mod in module.modules():
        for child in mod.children():
            parent_of[id(child)] = mod

    def ancestors(mod: nn.Module) -> list[nn.Module]:
        chain = [mod]
        while id(chain[-1]) in parent_of:
            chain.append(parent_of[id(chain[-1])])
        return chain

    if units is not None:
        unit_ids = {id(u) for u in units}
        out = []
        for fqn, _, owner_module, _ in resolved:
            found = [a for a in ancestors(owner_module) if id(a) in unit_ids]
            if not found:
                raise ValueError(f"parameter {fqn!r} is not inside any of the given units")
            out.append(found[0])
        return out
    out = []
    for _, _, owner_module, _ in resolved:
        chain = ancestors(owner_module)
        in_container = [a for a in chain if isinstance(parent_of.get(id(a)), containers)]
        out.append(in_container[-1] if in_container else owner_module)
    return out
