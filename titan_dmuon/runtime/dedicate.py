"""``dedicate_params``: validate the request, build the ownership plan, lay out the units."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from titan_dmuon.muon_math import row_blocks
from titan_dmuon.plan import MatrixSpec, OwnershipPlan, build_plan, full_shape, validate_across_ranks
from titan_dmuon.runtime.comm import CommStats
from titan_dmuon.runtime.context import RuntimeContext
from titan_dmuon.runtime.handle import DedicatedParams
from titan_dmuon.runtime.members import Bucket, LocalExperts, Member, Segment
from titan_dmuon.runtime.mode import DedicationMode
from titan_dmuon.runtime.reducer import GradientReducer
from titan_dmuon.runtime.replica_sync import ReplicaSync
from titan_dmuon.runtime.streams import Streams
from titan_dmuon.runtime.unit import Unit


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
    expert_sharding: str = "auto",
    initial_load: Sequence[int] | None = None,
    tp_mesh: DeviceMesh | None = None,
    tp_shard_dims: Mapping[nn.Parameter, int] | None = None,
) -> DedicatedParams:
    """Give each of ``params`` one owner rank on ``mesh``; call before ``fully_shard``/DDP.

    Args:
        module: the model (or the part of it that contains ``params``).
        params: Muon-target weights of ``module``: 2-D matrices, and 3-D MoE expert
            weights ``(E, rows, cols)``, each expert's matrix orthogonalised on its own.
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
        tp_mesh, tp_shard_dims: tensor parallelism. ``params`` are then this rank's TP-local shards
            of the full weights, ``tp_shard_dims[p]`` the tensor dim the ``tp_mesh`` ranks split (a
            matrix: 0 column-wise parallel, 1 row-wise; an expert stack ``(E, rows, cols)``: 1 or 2,
            each expert split alike), or None for a weight every tp rank holds whole (replicated,
            e.g. a router) and of whose gradient each tp rank computes a partial sum (TorchTitan's
            spmd_types: a weight typed R, its gradient P; DMuon sums it over the TP group on the
            weight's NS home at the end of backward), given for every dedicated weight
            (3-D weights left to FSDP2: only when TP splits their experts); ``split_rows`` then
            names rows of the full matrix. Each weight has one data-parallel owner coordinate, whose
            T tp ranks hold its T shards (or copies); in the Muon step each matrix (each expert) is
            assembled on one of them (its NS home) with an all-to-all on the TP group, orthogonalised
            there, and the result sent back. Experts left to FSDP2 are assembled likewise in the TP
            group of each data-parallel rank that holds them.
    """
    mode = DedicationMode.build(mesh, reshard_after_forward=reshard_after_forward, expert_sharding=expert_sharding,
                                tp_mesh=tp_mesh)
    mesh_info = mode.mesh
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
        if getattr(p, "_dmuon_handle", None) is not None and p._dmuon_handle() is not None:
            raise ValueError(f"parameter {fqn!r} is already dedicated by an earlier dedicate_params call")
        if p.ndim not in (2, 3):
            raise ValueError(
                f"parameter {fqn!r} has shape {tuple(p.shape)}: only 2-D weights and 3-D expert weights "
                "(experts, rows, cols) can be dedicated (Muon orthogonalises matrices; leave biases, norms "
                "and embeddings to AdamW)"
            )
        if not p.requires_grad:
            raise ValueError(
                f"parameter {fqn!r} is frozen (requires_grad=False): it gets no gradient and no Muon update; "
                "leave frozen weights out of the parameters given to dedicate_params"
            )
        seen.add(id(p))
        resolved.append((fqn, p, owner_module, name))
    for p in split_rows:
        if id(p) not in seen:
            where = sites.get(id(p))
            label = repr(where[0][0]) if where else f"of shape {tuple(p.shape)}"
            raise ValueError(
                f"split_rows names the parameter {label}, which is not among the parameters being dedicated; "
                "give split_rows only for parameters you pass to dedicate_params"
            )

    tp_dims = _checked_tp_dims(mode, resolved, tp_shard_dims, sites)

    def blocks_of(fqn, p):
        try:
            shape = full_shape(p.shape, tp_dims.get(id(p)), mode.tp.size if mode.tp else 1)
            return tuple(row_blocks(shape[-2:], split_rows.get(p)))
        except ValueError as e:
            raise ValueError(f"parameter {fqn!r}: {e}") from None

    def stays_local(p) -> bool:
        return p.ndim == 3 and mode.experts_stay_local(p.shape[0])

    kept = [r for r in resolved if stays_local(r[1])]
    resolved = [r for r in resolved if not stays_local(r[1])]
    _check_tp_dims_complete(mode, resolved, tp_dims)
    for fqn, p, _, _ in resolved:
        if isinstance(p, DTensor):
            raise ValueError(f"parameter {fqn!r} is already a DTensor: call dedicate_params before fully_shard")
    unit_modules = _assign_units(module, resolved, units)

    specs = []
    unit_index: dict[int, int] = {}
    for (fqn, p, _, _), unit_module in zip(resolved, unit_modules):
        idx = unit_index.setdefault(id(unit_module), len(unit_index))
        specs.append(MatrixSpec(fqn=fqn, shape=tuple(p.shape), unit=idx, blocks=blocks_of(fqn, p), tp_dim=tp_dims.get(id(p)),
                                tp_size=mode.tp.size if id(p) in tp_dims else 1))
    # experts left in place: the unit of their layer (a layer without dedicated weights gets a number after them)
    local_units: dict[int, int] = {}
    local = []
    for (fqn, p, m, n), unit_module in zip(kept, _assign_units(module, kept, units) if kept else []):
        idx = unit_index.get(id(unit_module))
        if idx is None:
            idx = len(unit_index) + local_units.setdefault(id(unit_module), len(local_units))
        local.append(LocalExperts(fqn=fqn, module=m, name=n, blocks=blocks_of(fqn, p), tp_dim=tp_dims.get(id(p)),
                                  unit=idx))
    local_tp_specs = [MatrixSpec(fqn=e.fqn, shape=tuple(p.shape), unit=e.unit, blocks=e.blocks, tp_dim=e.tp_dim,
                                 tp_size=mode.tp.size) for e, (_, p, _, _) in zip(local, kept) if e.tp_dim is not None]
    replicate_size, shard_size = mesh_info.replicate_size, mesh_info.shard_size
    load = _local_expert_load(local, replicate_size, shard_size) if local else [0] * mesh_info.world_size
    if initial_load is not None:
        if len(initial_load) != mesh_info.world_size:
            raise ValueError(f"initial_load has {len(initial_load)} entries for a mesh of {mesh_info.world_size} ranks")
        load = [a + int(b) for a, b in zip(load, initial_load)]
    plan = build_plan(specs, replicate_size=replicate_size, shard_size=shard_size,
                      initial_load=load if (local or initial_load is not None) else None, local_tp_specs=local_tp_specs)
    validate_across_ranks(plan, mesh_info.groups + ([mode.tp.group] if mode.tp else []), mesh_info.device)

    members = []
    for (_, p, owner_module, name), entry in zip(resolved, plan.entries):
        holds_full = plan.shard_owner(entry) == mesh_info.shard_rank
        runs_ns = holds_full and plan.replicate_owner(entry) == mesh_info.replicate_rank
        members.append(Member(entry=entry, module=owner_module, name=name, param=p, holds_full=holds_full,
                              runs_ns=runs_ns, unit=entry.unit))
        if not holds_full:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    streams = Streams(mesh_info.device)
    stats = CommStats()
    ctx = RuntimeContext(mode=mode, stats=stats, streams=streams)
    ctx.reducer = GradientReducer(
        mode=mode, streams=streams, stats=stats, reduce_dtype=mp_policy.reduce_dtype if mp_policy else None,
        divide_factor=float(gradient_divide_factor or plan.world_size),
    )
    ctx.replicas = ReplicaSync(mode=mode, streams=streams, stats=stats)
    module_names = {id(m): n for n, m in module.named_modules()}
    modules_by_index = {unit_index[id(mod)]: mod for mod in unit_modules}
    ctx.units = [
        _layout_unit(idx, module_names.get(id(modules_by_index[idx]), "<root>") or "<root>", modules_by_index[idx],
                     [m for m in members if m.entry.unit == idx], plan, ctx)
        for idx in range(len(unit_index))
    ]
    return DedicatedParams(module=module, plan=plan, ctx=ctx, members=members, mp_policy=mp_policy, local_experts=local)


def _checked_tp_dims(mode: DedicationMode, resolved, tp_shard_dims, sites) -> dict[int, int | None]:
    """{id(param): the tensor dim tensor parallelism splits, None for a replicated weight}, checked."""
    tp_shard_dims = dict(tp_shard_dims or {})
    if tp_shard_dims and mode.tp is None:
        raise ValueError("tp_shard_dims was given without a tp_mesh of more than one rank; pass tp_mesh=")
    names = {id(p): (fqn, p.ndim) for fqn, p, _, _ in resolved}
    for p, d in tp_shard_dims.items():
        if id(p) not in names:
            where = sites.get(id(p))
            raise ValueError(f"tp_shard_dims names {where[0][0] if where else 'a parameter'!r}, which is not among "
                             "the parameters being dedicated")
        fqn, ndim = names[id(p)]
        allowed = (0, 1) if ndim == 2 else (1, 2)
        if d is not None and d not in allowed:
            kind = ("a matrix: 0 (column-wise) or 1 (row-wise)" if ndim == 2
                    else "an expert stack: 1 or 2 (each expert split)")
            raise ValueError(f"tp_shard_dims[{fqn!r}] = {d!r}: expected, for {kind}, or None (replicated)")
    return {id(p): d for p, d in tp_shard_dims.items()}


def _check_tp_dims_complete(mode: DedicationMode, resolved, dims: dict[int, int | None]) -> None:
    """With a tp mesh every dedicated weight says how tensor parallelism holds it."""
    if mode.tp is None:
        return
    for fqn, p, _, _ in resolved:
        if id(p) not in dims:
            raise ValueError(f"{fqn!r} has no entry in tp_shard_dims: with tp_mesh every dedicated weight is a "
                             "TP-local shard and needs its dim (0 or 1 of a matrix, 1 or 2 of an expert stack), or "
                             "None when every tp rank holds it whole")


def _local_expert_load(local: list[LocalExperts], replicate_size: int, shard_size: int) -> list[int]:
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


def _layout_unit(index: int, name: str, module: nn.Module, members: list[Member], plan: OwnershipPlan, ctx) -> Unit:
    """Buffer order: by shard owner (one broadcast segment each), then by global owner (one reduce bucket each)."""
    ordered = sorted(members, key=lambda m: (plan.shard_owner(m.entry), plan.replicate_owner(m.entry)))
    segments, offset = [], 0
    for shard_owner, in_segment in itertools.groupby(ordered, key=lambda m: plan.shard_owner(m.entry)):
        start, buckets = offset, []
        for replicate_owner, in_bucket in itertools.groupby(in_segment, key=lambda m: plan.replicate_owner(m.entry)):
            in_bucket = list(in_bucket)
            for m in in_bucket:
                m.offset = offset
                offset += m.entry.numel
            buckets.append(Bucket(shard_owner=shard_owner, replicate_owner=replicate_owner, members=in_bucket))
        segments.append(Segment(shard_owner=shard_owner, start=start, stop=offset, buckets=buckets))
    return Unit(index=index, name=name, module=module, members=ordered, segments=segments, numel=offset, ctx=ctx)


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


_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def canonical_fqn(name: str) -> str:
    """A parameter name without activation-checkpoint / compile wrapper segments,
    so plans and checkpoints do not depend on those wrappers."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


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
