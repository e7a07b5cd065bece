"""What ``dedicate_params`` is asked: the parameters found in the model and checked.

Every check of the request raises a one-line error that names the parameter and says how to fix
it, on every rank, before the plan is built or anything is issued.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from titan_dmuon.runtime.mode import DedicationMode

Sites = dict[int, list[tuple[str, nn.Module, str]]]  # id(param) -> every (canonical name, module, attribute)


@dataclass(frozen=True, eq=False)
class Requested:
    """A parameter given to ``dedicate_params``, and where the model registers it."""

    fqn: str  # canonical name
    param: nn.Parameter
    module: nn.Module  # registers it under ``name``
    name: str


Predicate = Callable[[str, nn.Parameter], bool] | str


def chosen_params(
    module: nn.Module, params: Iterable[nn.Parameter] | None, predicate: Predicate | None
) -> list[nn.Parameter]:
    """The weights to dedicate: ``params`` as given, or every parameter of ``module`` that ``predicate``
    selects (a callable ``(name, param) -> bool``, or a regular expression searched for in the name;
    names are canonical: no activation-checkpoint or compile wrapper segments), in module order.

    A predicate is a broad net, so what it catches is checked here: it must catch something, and
    only matrices Muon is for (2-D weights, 3-D expert stacks; not an ``nn.Embedding``'s table)."""
    if (params is None) == (predicate is None):
        raise ValueError(
            "dedicate_params takes the weights to dedicate one way: a list of parameters, or predicate= (a "
            "callable (name, param) -> bool, or a regular expression searched for in parameter names)"
            + ("; it got both" if params is not None else "; it got neither")
        )
    if params is not None:
        return list(params)
    matches = _predicate_fn(predicate)
    label = f"predicate {predicate!r}" if isinstance(predicate, str) else "the predicate"
    embeddings = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    chosen, names = [], []
    for name, p in module.named_parameters():
        fqn = canonical_fqn(name)
        names.append(fqn)
        if not matches(fqn, p):
            continue
        if p.ndim not in (2, 3) or id(p) in embeddings:
            what = "an nn.Embedding's table" if id(p) in embeddings else f"of shape {tuple(p.shape)}"
            raise ValueError(
                f"{label} matches {fqn!r}, {what}: Muon is for hidden-layer matrices (2-D weights, "
                "3-D expert stacks); leave norms, biases, embeddings and the output head to AdamW by narrowing the "
                "predicate" + (" (or pass the weight in a list to dedicate it anyway)" if id(p) in embeddings else "")
            )
        chosen.append(p)
    if not chosen:
        raise ValueError(f"{label} matches no parameter of the model; its names look like {names[:3]!r}")
    return chosen


def _predicate_fn(predicate: Predicate) -> Callable[[str, nn.Parameter], bool]:
    if not isinstance(predicate, str):
        if not callable(predicate):
            raise TypeError(
                f"predicate must be a callable (name, param) -> bool or a regular expression, got "
                f"{type(predicate).__name__}"
            )
        return lambda name, p: bool(predicate(name, p))
    try:
        pattern = re.compile(predicate)
    except re.error as e:
        raise ValueError(f"predicate {predicate!r} is not a valid regular expression: {e}") from None
    return lambda name, p: pattern.search(name) is not None


def requested_params(
    params: Iterable[nn.Parameter], sites: Sites, split_rows: Mapping, split_cols: Mapping = ()
) -> list[Requested]:
    """Each of ``params`` checked (a trainable 2-D or 3-D parameter of the model, registered once,
    listed once, not dedicated yet) with where it is registered; ``split_rows`` and ``split_cols``
    name only them."""
    requested: list[Requested] = []
    seen: set[int] = set()
    for p in params:
        requested.append(_checked_param(p, sites, seen))
        seen.add(id(p))
    for name, split in (("split_rows", split_rows), ("split_cols", split_cols)):
        for p in split:
            if id(p) not in seen:
                where = sites.get(id(p))
                label = repr(where[0][0]) if where else f"of shape {tuple(p.shape)}"
                raise ValueError(
                    f"{name} names the parameter {label}, which is not among the parameters being dedicated; "
                    f"give {name} only for parameters you pass to dedicate_params"
                )
    return requested


def _checked_param(p, sites: Sites, seen: set[int]) -> Requested:
    """``p`` found in the model and checked against the parameters ``seen`` before it."""
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
    return Requested(fqn=fqn, param=p, module=owner_module, name=name)


def check_not_sharded(dedicated: list[Requested]) -> None:
    """Dedication comes before ``fully_shard``, which would have made the weights DTensors."""
    for r in dedicated:
        if isinstance(r.param, DTensor):
            raise ValueError(f"parameter {r.fqn!r} is already a DTensor: call dedicate_params before fully_shard")


def checked_tp_dims(
    mode: DedicationMode, requested: list[Requested], tp_shard_dims: Mapping | None, sites: Sites
) -> dict[int, int | None]:
    """{id(param): the tensor dim tensor parallelism splits, None for a replicated weight}, checked."""
    tp_shard_dims = dict(tp_shard_dims or {})
    if tp_shard_dims and mode.tp is None:
        raise ValueError("tp_shard_dims was given without a tp_mesh of more than one rank; pass tp_mesh=")
    names = {id(r.param): (r.fqn, r.param.ndim) for r in requested}
    for p, d in tp_shard_dims.items():
        if id(p) not in names:
            where = sites.get(id(p))
            raise ValueError(
                f"tp_shard_dims names {where[0][0] if where else 'a parameter'!r}, which is not among "
                "the parameters being dedicated"
            )
        fqn, ndim = names[id(p)]
        allowed = (0, 1) if ndim == 2 else (1, 2)
        if d is not None and d not in allowed:
            kind = (
                "a matrix: 0 (column-wise) or 1 (row-wise)"
                if ndim == 2
                else "an expert stack: 1 or 2 (each expert split)"
            )
            raise ValueError(f"tp_shard_dims[{fqn!r}] = {d!r}: expected, for {kind}, or None (replicated)")
    return {id(p): d for p, d in tp_shard_dims.items()}


def check_tp_dims_complete(mode: DedicationMode, dedicated: list[Requested], dims: dict[int, int | None]) -> None:
    """With a tp mesh every dedicated weight says how tensor parallelism holds it."""
    if mode.tp is None:
        return
    for r in dedicated:
        if id(r.param) not in dims:
            raise ValueError(
                f"{r.fqn!r} has no entry in tp_shard_dims: with tp_mesh every dedicated weight is a "
                "TP-local shard and needs its dim (0 or 1 of a matrix, 1 or 2 of an expert stack), or "
                "None when every tp rank holds it whole"
            )


def check_not_wrapped(module: nn.Module) -> None:
    """Dedication comes before DDP and ``fully_shard``, which must leave the dedicated weights alone."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        raise ValueError("dedicate_params must be called before wrapping the model in DistributedDataParallel")
    for name, sub in module.named_modules():
        if isinstance(sub, FSDPModule):
            raise ValueError(
                f"module {name or '<root>'!r} is already sharded by fully_shard: call dedicate_params first, "
                "then fully_shard (which then leaves the dedicated weights alone)"
            )


_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def canonical_fqn(name: str) -> str:
    """A parameter name without activation-checkpoint / compile wrapper segments,
    so plans and checkpoints do not depend on those wrappers."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def registration_sites(module: nn.Module) -> Sites:
    """Where each parameter of ``module`` is registered (a tied one: several places)."""
    sites: Sites = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for name, p in mod._parameters.items():
            if p is not None:
                fqn = canonical_fqn(f"{mod_name}.{name}" if mod_name else name)
                sites.setdefault(id(p), []).append((fqn, mod, name))
    return sites
