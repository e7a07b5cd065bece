"""``dedicate_params``: validate the request, build the ownership plan, lay out the units.

One function per job, in the order ``dedicate_params`` runs them:

* ``request.py``: every parameter given is found in the model and checked (``Requested``), and
  how tensor parallelism holds each (with a tp mesh);
* ``build_specs`` / ``local_experts``: the plan's matrix specs, and the expert stacks that stay
  where FSDP2 (or expert parallelism) keeps them, each in its layer's unit (``assign_units``);
* ``plan_ownership``: the plan, balanced against what the ranks already run, checked identical on
  every rank; ``make_members``: this rank's records (non-holders' weights emptied);
* ``build_context`` / ``layout_unit``: the runtime's shared state and each layer's buffer layout.

``plan_dedication`` runs the steps up to the members (``Dedication``), ``build_context`` the runtime
pieces; the handle is built from both. Tests build units and contexts the same way without a handle.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from titan_dmuon.math.matrix_blocks import Block, column_blocks, row_blocks
from titan_dmuon.plan.owner_groups import GroupOptions
from titan_dmuon.plan.ownership import OwnershipPlan, build_plan, validate_across_ranks
from titan_dmuon.plan.specs import MatrixSpec, full_shape
from titan_dmuon.runtime.comm import CommStats
from titan_dmuon.runtime.context import RuntimeContext
from titan_dmuon.runtime.device_profile import free_communication, measured
from titan_dmuon.runtime.fsdp_ignore import ignore_dedicated_in_fully_shard
from titan_dmuon.runtime.handle import DedicatedParams
from titan_dmuon.runtime.members import LocalExperts, Member, pieces_of
from titan_dmuon.runtime.mode import DedicationMode, MeshInfo
from titan_dmuon.runtime.owner_group_comm import OwnerGroupComm, needs_comm, plan_group_sizes
from titan_dmuon.runtime.reducer import GradientReducer
from titan_dmuon.runtime.replica_sync import ReplicaSync
from titan_dmuon.runtime.request import (
    Predicate,
    Requested,
    check_not_sharded,
    check_not_wrapped,
    check_tp_dims_complete,
    checked_tp_dims,
    chosen_params,
    registration_sites,
    requested_params,
)
from titan_dmuon.runtime.streams import Streams
from titan_dmuon.runtime.unit_layout import assign_units, layout_unit
from titan_dmuon.runtime.usage_checks import check_no_dmuon_yet, install_foreign_step_checks, let_ddp_skip_dedicated


@dataclass(frozen=True, kw_only=True, eq=False)
class Dedication:
    """What ``dedicate_params`` decided for this rank before any runtime object exists."""

    plan: OwnershipPlan
    members: list[Member]  # the dedicated weights as this rank holds them, in plan order
    unit_modules: list[nn.Module]  # the module of each unit, by unit index
    local_experts: list[LocalExperts]  # expert stacks updated where FSDP2 (or EP) keeps them


def dedicate_params(
    module: nn.Module,
    params: Iterable[nn.Parameter] | DeviceMesh | None = None,
    mesh: DeviceMesh | None = None,
    *,
    predicate: Predicate | None = None,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    units: Sequence[nn.Module] | None = None,
    split_rows: Mapping[nn.Parameter, Sequence[int]] | None = None,
    split_cols: Mapping[nn.Parameter, Sequence[int]] | None = None,
    gradient_divide_factor: float | None = None,
    expert_sharding: str = "auto",
    initial_load: Sequence[int] | None = None,
    tp_mesh: DeviceMesh | None = None,
    tp_shard_dims: Mapping[nn.Parameter, int] | None = None,
    owner_groups: GroupOptions | None = GroupOptions(),
    keep_whole: Iterable[nn.Parameter] = (),
) -> DedicatedParams:
    """Give each chosen weight one owner rank on ``mesh``; call before ``fully_shard``/DDP.

    ``dedicate_params(model, mesh, predicate=...)`` or ``dedicate_params(model, params, mesh)``.
    The ``fully_shard`` calls that follow leave the dedicated weights alone by themselves
    (``runtime/fsdp_ignore.py``; ``ignored_params=handle.ignored_params`` still works),
    ``DMuon(model)`` and ``clip_grad_norm_`` find the handle from the parameters, and
    ``titan_dmuon.set_requires_gradient_sync(model, flag)`` switches FSDP2's and DMuon's gradient
    sync together. Build DMuon last; a DMuon built earlier, a torch optimizer or torch's clip over the
    dedicated weights are refused before the first step (``runtime/usage_checks.py``).

    Args:
        module: the model (or the part of it that contains the weights).
        params: Muon-target weights of ``module``: 2-D matrices, and 3-D MoE expert
            weights ``(E, rows, cols)``, each expert's matrix orthogonalised on its own.
            Or leave it out and give ``predicate``.
        mesh: 1-D DeviceMesh (FSDP shard group or DDP group) or 2-D mesh with
            dims ``("dp_replicate", "dp_shard")`` (HSDP). Second when ``params`` is left out.
        predicate: which parameters of ``module`` to dedicate, instead of ``params``: a callable
            ``(name, param) -> bool``, or a regular expression searched for in each name (e.g.
            ``r"\\.(attention|feed_forward)\\.w"``). Names are canonical (no activation-checkpoint or
            compile wrapper segments). It must match at least one parameter, and only 2-D weights
            and 3-D expert stacks (not an ``nn.Embedding``'s table).
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
        split_cols: per parameter, the column blocks orthogonalised separately, as ``split_rows``
            over columns (e.g. an attention output projection: ``[head_dim] * n_heads``); with both,
            every (row block, column block) pair is one Newton–Schulz matrix. Each block's update
            gets the learning rate of its own shape, as a separate weight would (``adjusted_lr``).
        gradient_divide_factor: divide summed gradients by this; default the
            data-parallel world size (an average). TorchTitan, which normalises
            the loss by the global token count, uses 1.0.
        expert_sharding: where 3-D expert weights are updated. ``"local"``: they
            stay with FSDP2 (or expert parallelism), which must shard them on dim 0
            so every rank holds whole experts; each rank runs Muon on its own
            experts, no collective of DMuon's (they are not in ``ignored_params``).
            ``"dedicated"``: one owner per weight, like the 2-D ones (DDP, or fewer
            experts than ranks). ``"auto"``: local when the data-parallel world
            (R x N ranks) has no more ranks than the weight has experts, else
            dedicated (``DedicationMode.experts_stay_local``).
        initial_load: Newton–Schulz FLOPs per rank (``r * N + s`` order) that the ranks of this
            mesh already have from other handles, e.g. the other pipeline stages a rank holds
            (``handle.plan.ns_flops_per_rank``): the plan balances the total.
        tp_mesh: tensor parallelism: the 1-D mesh of the tensor-parallel ranks (see ``tp_shard_dims``).
        tp_shard_dims: with ``tp_mesh``, ``params`` are this rank's TP-local shards and ``tp_shard_dims[p]``
            the dim the ``tp_mesh`` ranks split (a matrix: 0 column-wise, 1 row-wise; an expert stack: 1 or 2),
            or None for a weight every tp rank holds whole (its gradient a partial sum); given for every
            dedicated weight. ``split_rows``/``split_cols`` then name rows and columns of the full matrix. How
            each matrix meets its Newton–Schulz home: docs/guides/tensor-parallel.md.
        owner_groups: let the plan split a dominant weight's Newton–Schulz and storage over k ranks of
            its shard group where its cost model says that shortens the busiest rank's step
            (``titan_dmuon.plan.owner_groups.GroupOptions``: the rates it uses, the node size;
            ``docs/owner-groups.md``; default: an H200 node's); None: one owner per weight (required
            by ``ns_mode="exact"``).
        keep_whole: weights that keep one owner whatever ``owner_groups`` says (a rule reads the
            whole matrix on its owner: QK-clip's q/k rows, per-row statistics).
    """
    if isinstance(params, DeviceMesh) and mesh is None:  # dedicate_params(model, mesh, predicate=...)
        params, mesh = None, params
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"dedicate_params needs a DeviceMesh (dedicate_params(model, mesh, predicate=...) or "
            f"dedicate_params(model, params, mesh)), got {type(mesh).__name__}"
        )
    check_no_dmuon_yet(module)
    mode = DedicationMode.build(
        mesh, reshard_after_forward=reshard_after_forward, expert_sharding=expert_sharding, tp_mesh=tp_mesh
    )
    dedication = plan_dedication(
        module,
        params,
        mode,
        predicate=predicate,
        units=units,
        split_rows=split_rows,
        split_cols=split_cols,
        initial_load=initial_load,
        tp_shard_dims=tp_shard_dims,
        owner_groups=owner_groups,
        keep_whole=keep_whole,
    )
    ctx = build_context(module, dedication, mode, mp_policy=mp_policy, gradient_divide_factor=gradient_divide_factor)
    handle = DedicatedParams(
        module=module,
        plan=dedication.plan,
        ctx=ctx,
        members=dedication.members,
        mp_policy=mp_policy,
        local_experts=dedication.local_experts,
    )
    ignore_dedicated_in_fully_shard()
    install_foreign_step_checks()
    let_ddp_skip_dedicated(module, handle)
    return handle


def plan_dedication(
    module: nn.Module,
    params: Iterable[nn.Parameter] | None,
    mode: DedicationMode,
    *,
    predicate: Predicate | None = None,
    units: Sequence[nn.Module] | None = None,
    split_rows: Mapping[nn.Parameter, Sequence[int]] | None = None,
    split_cols: Mapping[nn.Parameter, Sequence[int]] | None = None,
    initial_load: Sequence[int] | None = None,
    tp_shard_dims: Mapping[nn.Parameter, int] | None = None,
    owner_groups: GroupOptions | None = None,
    keep_whole: Iterable[nn.Parameter] = (),
) -> Dedication:
    """Everything ``dedicate_params`` decides before the runtime (its arguments of the same names):
    the request checked, the plan built and checked identical on every rank, this rank's members."""
    check_not_wrapped(module)
    sites = registration_sites(module)
    splits = Splits(rows=dict(split_rows or {}), cols=dict(split_cols or {}))
    requested = requested_params(chosen_params(module, params, predicate), sites, splits.rows, splits.cols)
    tp_dims = checked_tp_dims(mode, requested, tp_shard_dims, sites)
    kept = [r for r in requested if _stays_local(mode, r.param)]
    dedicated = [r for r in requested if not _stays_local(mode, r.param)]
    check_tp_dims_complete(mode, dedicated, tp_dims)
    check_not_sharded(dedicated)
    unit_modules = assign_units(module, dedicated, units)
    whole = {id(p) for p in keep_whole}
    specs, unit_index = build_specs(mode, dedicated, unit_modules, tp_dims, splits, whole)
    local = local_experts(mode, module, kept, units, unit_index, tp_dims, splits)
    plan = plan_ownership(mode, specs, local, initial_load, owner_groups)
    modules_by_index = {unit_index[id(m)]: m for m in unit_modules}
    return Dedication(
        plan=plan,
        members=make_members(dedicated, plan, mode.mesh),
        unit_modules=[modules_by_index[i] for i in range(len(unit_index))],
        local_experts=local,
    )


def build_context(
    module: nn.Module,
    dedication: Dedication,
    mode: DedicationMode,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    gradient_divide_factor: float | None = None,
) -> RuntimeContext:
    """The state a handle's units share (streams, counts, the reducer, the replica sync), with
    the units laid out: one per unit module, named as in ``module``."""
    streams, stats = Streams(mode.mesh.device), CommStats()
    ctx = RuntimeContext(mode=mode, stats=stats, streams=streams)
    ctx.reducer = GradientReducer(
        mode=mode,
        streams=streams,
        stats=stats,
        reduce_dtype=mp_policy.reduce_dtype if mp_policy else None,
        divide_factor=float(gradient_divide_factor or dedication.plan.world_size),
    )
    ctx.replicas = ReplicaSync(mode=mode, streams=streams, stats=stats)
    sizes = plan_group_sizes(dedication.plan.entries)
    if needs_comm(dedication.plan.groups, sizes, mode.mesh):
        ctx.owner_groups = OwnerGroupComm(mode.mesh, stats, sizes)  # (another copy's plan may have groups)
    names = {id(m): n for n, m in module.named_modules()}
    ctx.units = [
        layout_unit(
            index,
            names.get(id(unit_module), "<root>") or "<root>",
            unit_module,
            [m for m in dedication.members if m.entry.unit == index],
            dedication.plan,
            ctx,
        )
        for index, unit_module in enumerate(dedication.unit_modules)
    ]
    return ctx


# ---- what the plan is built from ----------------------------------------------------------------------
def _stays_local(mode: DedicationMode, p: nn.Parameter) -> bool:
    """A 3-D expert stack updated where FSDP2 (or EP) keeps its experts (``experts_stay_local``)."""
    return p.ndim == 3 and mode.experts_stay_local(p.shape[0])


@dataclass(frozen=True)
class Splits:
    """``dedicate_params``' ``split_rows`` and ``split_cols``, by parameter."""

    rows: dict
    cols: dict

    def blocks(self, mode: DedicationMode, r: Requested, tp_dims: dict) -> tuple[tuple[Block, ...], tuple[Block, ...]]:
        """The row blocks of ``r``'s (full) matrix and its column blocks (() where it has no column split)."""
        try:
            shape = full_shape(r.param.shape, tp_dims.get(id(r.param)), mode.tp.size if mode.tp else 1)
            rows = tuple(row_blocks(shape[-2:], self.rows.get(r.param)))
            cols = tuple(column_blocks(shape[-2:], self.cols[r.param])) if r.param in self.cols else ()
        except ValueError as e:
            raise ValueError(f"parameter {r.fqn!r}: {e}") from None
        return rows, cols


def build_specs(
    mode: DedicationMode,
    dedicated: list[Requested],
    unit_modules: list[nn.Module],
    tp_dims: dict,
    splits: Splits,
    keep_whole: set[int] = frozenset(),
) -> tuple[list[MatrixSpec], dict[int, int]]:
    """The plan's spec of each dedicated weight, and {id(unit module): unit index} (first-seen order);
    ``keep_whole``: ids of the weights that may not get an owner group."""
    specs, unit_index = [], {}
    for r, unit_module in zip(dedicated, unit_modules):
        index = unit_index.setdefault(id(unit_module), len(unit_index))
        blocks, col_blocks = splits.blocks(mode, r, tp_dims)
        specs.append(
            MatrixSpec(
                fqn=r.fqn,
                shape=tuple(r.param.shape),
                unit=index,
                blocks=blocks,
                col_blocks=col_blocks,
                tp_dim=tp_dims.get(id(r.param)),
                tp_size=mode.tp.size if id(r.param) in tp_dims else 1,
                groupable=id(r.param) not in keep_whole,
            )
        )
    return specs, unit_index


def local_experts(
    mode: DedicationMode,
    module: nn.Module,
    kept: list[Requested],
    units,
    unit_index: dict[int, int],
    tp_dims: dict,
    splits: Splits,
) -> list[LocalExperts]:
    """The expert stacks left in place, each with the unit of its layer (a layer without dedicated
    weights gets a number after the units)."""
    local_units: dict[int, int] = {}
    out = []
    for r, unit_module in zip(kept, assign_units(module, kept, units) if kept else []):
        index = unit_index.get(id(unit_module))
        if index is None:
            index = len(unit_index) + local_units.setdefault(id(unit_module), len(local_units))
        blocks, col_blocks = splits.blocks(mode, r, tp_dims)
        out.append(
            LocalExperts(
                fqn=r.fqn,
                module=r.module,
                name=r.name,
                blocks=blocks,
                col_blocks=col_blocks,
                tp_dim=tp_dims.get(id(r.param)),
                unit=index,
            )
        )
    return out


def plan_ownership(
    mode: DedicationMode,
    specs: list[MatrixSpec],
    local: list[LocalExperts],
    initial_load: Sequence[int] | None,
    owner_groups: GroupOptions | None = None,
) -> OwnershipPlan:
    """The plan, balanced against the NS load the ranks already have (experts kept in place, other
    handles' ``initial_load``), and checked identical on every rank (a collective)."""
    mesh = mode.mesh
    local_tp_specs = [
        MatrixSpec(
            fqn=e.fqn,
            shape=tuple(e.param.shape),
            unit=e.unit,
            blocks=e.blocks,
            col_blocks=e.col_blocks,
            tp_dim=e.tp_dim,
            tp_size=mode.tp.size,
        )
        for e in local
        if e.tp_dim is not None
    ]
    load = local_expert_load(local, mesh.replicate_size, mesh.shard_size) if local else [0] * mesh.world_size
    if initial_load is not None:
        if len(initial_load) != mesh.world_size:
            raise ValueError(f"initial_load has {len(initial_load)} entries for a mesh of {mesh.world_size} ranks")
        load = [a + int(b) for a, b in zip(load, initial_load)]

    def plan_with(groups: GroupOptions | None) -> OwnershipPlan:
        return build_plan(
            specs,
            replicate_size=mesh.replicate_size,
            shard_size=mesh.shard_size,
            initial_load=load if (local or initial_load is not None) else None,
            local_tp_specs=local_tp_specs,
            groups=groups,
        )

    if owner_groups is not None and owner_groups.enabled and owner_groups.unmeasured():
        # (measured only where a group could pay with free communication; else nothing to measure)
        trial = [e for e in plan_with(free_communication(owner_groups.stated())).entries if e.group is not None]
        if trial:
            largest = max(trial, key=lambda e: (e.ns_flops, e.fqn))
            owner_groups = measured(owner_groups, mesh, (min(largest.shape), max(largest.shape)))
    plan = plan_with(owner_groups)
    validate_across_ranks(plan, mesh.groups + ([mode.tp.group] if mode.tp else []), mesh.device)
    return plan


def local_expert_load(local: list[LocalExperts], replicate_size: int, shard_size: int) -> list[int]:
    """NS FLOPs per rank of experts that stay where FSDP2's dim-0 shard puts them
    (torch.chunk: ceil(E/N) whole experts per shard index, the last ones fewer or none)."""
    load = [0] * shard_size
    for experts in local:
        num_experts = experts.param.shape[0]
        per_expert = experts.expert_flops()
        chunk = -(-num_experts // shard_size)
        for s in range(shard_size):
            load[s] += per_expert * max(0, min(chunk, num_experts - s * chunk))
    return load * replicate_size


def make_members(dedicated: list[Requested], plan: OwnershipPlan, mesh: MeshInfo) -> list[Member]:
    """This rank's record of each dedicated weight; a rank that does not hold one keeps a 0-element
    placeholder (its storage freed now), and a member of an owner group its block (a copy)."""
    members = []
    for r, entry in zip(dedicated, plan.entries):
        block = None
        if entry.group is not None:
            shard_indices = [rank % mesh.shard_size for rank in entry.group.ranks]
            block = shard_indices.index(mesh.shard_rank) if mesh.shard_rank in shard_indices else None
            holds_full = False
            runs_ns = block is not None and plan.replicate_owner(entry) == mesh.replicate_rank
        else:
            holds_full = plan.shard_owner(entry) == mesh.shard_rank
            runs_ns = holds_full and plan.replicate_owner(entry) == mesh.replicate_rank
        member = Member(
            entry=entry,
            module=r.module,
            name=r.name,
            param=r.param,
            holds_full=holds_full,
            runs_ns=runs_ns,
            unit=entry.unit,
            block=block,
        )
        members.append(member)
        if block is not None:
            r.param.data = pieces_of(member, plan)[block].of(r.param.data).contiguous().clone()
        elif not holds_full:
            r.param.data = torch.empty(0, dtype=r.param.dtype, device=r.param.device)
    return members
