"""The plain-PyTorch user's order and pieces, checked before the first step: one line each.

A DMuon job needs ``dedicate_params`` (first), ``fully_shard``/DDP, then ``DMuon`` (last) as the one
optimizer of the dedicated weights, and DMuon's ``clip_grad_norm_``. Done another way most mistakes
would train silently wrong (AdamW only, a third of the parameters stepped, a norm counted on owners
only), so each is refused here where it can be seen: at ``dedicate_params``, at DMuon's construction or
its first step, and at a foreign optimizer's first step or a call of torch's clip with dedicated weights.
Every check is host-side bookkeeping on the parameters (attributes, identities), no collective and no
device sync; what runs every step is one dictionary lookup per optimizer step.

The marks: each dedicated weight carries ``_dmuon_handle`` (``handle.follow_registered_params``),
each parameter a DMuon was built over ``_dmuon_optimizer`` (a weak reference to the latest one).
"""

from __future__ import annotations

import functools
import warnings
import weakref

import torch
from torch import nn

from titan_dmuon.runtime.fsdp_ignore import is_dedicated

_OPTIMIZER_MARK = "_dmuon_optimizer"  # on a parameter: a weak reference to the last DMuon built over it
_CHECKED = "_dmuon_checked_first_step"  # on a foreign optimizer: its first step was checked
_WRAPPED = "refuses_dmuon_dedicated_weights"  # on torch's clip functions once wrapped (installed once per process)


# ---- at DMuon's construction ---------------------------------------------------------------------------------
def mark_held_by(optimizer, params) -> None:
    """Stamp each parameter with the DMuon built over it (the latest one wins)."""
    ref = weakref.ref(optimizer)
    for p in params:
        setattr(p, _OPTIMIZER_MARK, ref)


def holder_of(p: torch.Tensor):
    """The live DMuon last built over ``p``, or None."""
    ref = getattr(p, _OPTIMIZER_MARK, None)
    return ref() if ref is not None else None


def warn_if_nothing_dedicated(has_muon_groups: bool) -> None:
    """DMuon found no handle and no Muon weight: it would be AdamW. Legitimate for a model (or a pipeline
    stage) without hidden-layer matrices, hence a warning."""
    if not has_muon_groups:
        warnings.warn(
            "DMuon found no dedicated weights, so every parameter gets AdamW: call dedicate_params(model, mesh, "
            "predicate=...) before fully_shard and build DMuon after it (pass dedicated=[] to silence this for a "
            "model without Muon weights)",
            UserWarning,
            stacklevel=3,
        )


def check_every_member_given(handles, params) -> None:
    """Each dedicated weight of the handles DMuon steps is among its parameters: one left out would get its
    gradient reduced every step and never an update (nothing else may step it)."""
    given = {id(p) for p in params}
    for handle in handles:
        missing = [m.fqn for m in handle.members if id(m.param) not in given]
        if missing:
            raise ValueError(
                f"DMuon was given {len(handle.members) - len(missing)} of the {len(handle.members)} weights its "
                f"dedicate_params handle holds; {missing[:3]} would never be updated (no other optimizer may step "
                "a dedicated weight): give DMuon all of the model's parameters (DMuon(model, ...)), or leave these "
                "weights out of dedicate_params"
            )


def registered_params(roots: list[nn.Module], params) -> list[tuple[str, nn.Module, str, torch.Tensor]]:
    """(fqn, module, name, param) of each of ``params`` registered under ``roots`` now, for
    ``check_still_registered`` at the first step."""
    wanted = {id(p) for p in params}
    seen: set[int] = set()
    out = []
    for root in roots:
        for prefix, module in root.named_modules():
            for name, p in module._parameters.items():
                if p is not None and id(p) in wanted and id(p) not in seen:
                    seen.add(id(p))
                    out.append((f"{prefix}.{name}" if prefix else name, module, name, p))
    return out


# ---- at DMuon's first step -----------------------------------------------------------------------------------
def check_still_registered(registered) -> None:
    """Every parameter DMuon found in the model is still the model's: ``fully_shard`` (or ``to_empty()``,
    ``.to()`` making new tensors) after DMuon leaves it stepping tensors that no longer train."""
    for fqn, module, name, p in registered:
        if module._parameters.get(name) is not p:
            raise RuntimeError(
                f"parameter {fqn!r} was replaced in the model after DMuon was built (by fully_shard, to_empty() or "
                ".to()), so DMuon would step a tensor the model no longer uses: build DMuon last, after "
                "dedicate_params, fully_shard and materialising the model"
            )


def check_sole_dmuon(optimizer, dedicated) -> None:
    """No later DMuon holds these dedicated weights: two DMuon stepping one weight update it twice."""
    for handle, p in dedicated:
        holder = holder_of(p)
        if holder is not None and holder is not optimizer:
            raise RuntimeError(
                f"dedicated weight {handle.member_of(p).fqn!r} is held by two DMuon optimizers, and both would "
                "update it: keep one DMuon over the model (drop the other, or build it over other parameters)"
            )


# ---- the first forward ---------------------------------------------------------------------------------------
def check_compute_dtype(unit, dtype: torch.dtype) -> None:
    """A layer that ``fully_shard`` gave an ``mp_policy`` computes its dedicated weights in the same dtype:
    FSDP2 casts the layer's other weights (and its inputs) to its ``param_dtype``, so a dedicated weight in
    another dtype fails in the first matmul with a message that names neither setting."""
    from torch.distributed.fsdp import FSDPModule

    state = getattr(unit.module, "_get_fsdp_state", None) if isinstance(unit.module, FSDPModule) else None
    policy = getattr(state(), "_mp_policy", None) if state is not None else None  # (FSDP2's; absent: no check)
    fsdp_dtype = policy.param_dtype if policy is not None else None
    if fsdp_dtype is not None and fsdp_dtype != dtype:
        raise ValueError(
            f"layer {unit.name!r} computes in {fsdp_dtype} under fully_shard's mp_policy, but its dedicated "
            f"weights in {dtype}: pass the same mp_policy to dedicate_params(..., mp_policy=...) as to fully_shard"
        )


# ---- dedicate_params ---------------------------------------------------------------------------------------
def check_no_dmuon_yet(module: nn.Module) -> None:
    """No DMuon was built over the model before ``dedicate_params``: it would step AdamW on the
    weights it saw (the dedicated ones emptied on non-owners, FSDP2's replaced by shards)."""
    for name, p in module.named_parameters():
        if holder_of(p) is not None:
            raise ValueError(
                f"parameter {name!r} is already held by a DMuon optimizer, built before dedicate_params: call "
                "dedicate_params first, then fully_shard, and build DMuon last"
            )


def let_ddp_skip_dedicated(module: nn.Module, handle) -> None:
    """Put the dedicated weights on DDP's ignore list of ``module``, as ``wrap_ddp`` does, so that a
    ``DistributedDataParallel(model)`` built by hand leaves them alone too: DDP compares every parameter's
    shape across ranks when it is built, and a non-owner's 0-element placeholder made one rank raise while
    the others waited (a hang). Only where ``wrap_ddp`` would accept the handle (a 1-D mesh, no experts left
    in place); the names are the module's, as DDP matches them."""
    from torch.nn.parallel import DistributedDataParallel

    if handle.mode.mesh.hsdp or handle.local_experts:
        return
    dedicated = {id(p) for p in handle.params}
    names = [name for name, p in module.named_parameters() if id(p) in dedicated]
    known = list(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, known + names)


def install_foreign_step_checks() -> None:
    """Every optimizer's first step (torch's global step pre-hook, installed once per process) and torch's
    clip functions refuse dedicated weights that DMuon does not step."""
    import torch.optim.optimizer as torch_optimizer  # (torch.optim does not export the module's name)

    hooks = getattr(torch_optimizer, "_global_optimizer_pre_hooks", {})
    if not any(h is refuse_foreign_optimizer for h in hooks.values()):
        torch_optimizer.register_optimizer_step_pre_hook(refuse_foreign_optimizer)
    _wrap_torch_clip()


# ---- another optimizer, torch's clip ------------------------------------------------------------------------
def refuse_foreign_optimizer(optimizer, args, kwargs) -> None:
    """At an optimizer's first step: a torch optimizer over a dedicated weight, or any optimizer over one that
    no DMuon holds, would update an owner's full weight (and the non-owners' 0-element placeholders) as a
    plain tensor. DMuon, and containers that step DMuon (TorchTitan's, torchft's), pass."""
    if optimizer.__dict__.get(_CHECKED) or getattr(optimizer, "steps_dedicated_weights", False):
        return
    from_torch = type(optimizer).__module__.startswith("torch.optim")
    for group in optimizer.param_groups:
        for p in group["params"]:
            if is_dedicated(p) and (from_torch or holder_of(p) is None):
                handle = p._dmuon_handle()
                raise RuntimeError(
                    f"{type(optimizer).__name__} would step the dedicated weight {handle.member_of(p).fqn!r} "
                    "(dedicate_params), which only DMuon may update (its owner holds it whole, the other ranks "
                    "0-element placeholders): use DMuon(model, ...) as the optimizer of the whole model, or leave the "
                    f"dedicated weights out of the {type(optimizer).__name__}"
                )
    optimizer.__dict__[_CHECKED] = True


def _first_dedicated(parameters) -> torch.Tensor | None:
    return next((p for p in parameters if is_dedicated(p)), None)


def _refusing(original, public_name: str):
    """``original`` (torch's clip function taking parameters first) refusing dedicated weights."""
    if getattr(original, _WRAPPED, False):
        return original

    @functools.wraps(original)
    def clip(parameters, *args, **kwargs):
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        found = _first_dedicated(parameters)
        if found is not None:
            raise RuntimeError(
                f"{public_name} was given the dedicated weight {found._dmuon_handle().member_of(found).fqn!r} "
                "(dedicate_params), whose gradient lives on its owner only, beside FSDP2's DTensor shards: it "
                "cannot count it; use titan_dmuon.clip_grad_norm_(model.parameters(), max_norm), which counts "
                "every element once"
            )
        return original(parameters, *args, **kwargs)

    setattr(clip, _WRAPPED, True)
    return clip


def _wrap_torch_clip() -> None:
    """Wrap ``torch.nn.utils.clip_grad_norm_`` and ``clip_grads_with_norm_`` where torch keeps them
    (``torch.nn.utils`` and ``torch.nn.utils.clip_grad``, whose ``clip_grad_norm_`` looks the latter up at
    each call, so a ``clip_grad_norm_`` imported before ``dedicate_params`` is caught too)."""
    from torch.nn.utils import clip_grad

    for module in (torch.nn.utils, clip_grad):
        for name, public in (
            ("clip_grad_norm_", "torch.nn.utils.clip_grad_norm_"),
            ("clip_grads_with_norm_", "torch.nn.utils.clip_grads_with_norm_"),
            ("_clip_grads_with_norm_", "torch.nn.utils.clip_grad_norm_"),
        ):
            original = getattr(module, name, None)
            if original is not None:
                setattr(module, name, _refusing(original, public))
