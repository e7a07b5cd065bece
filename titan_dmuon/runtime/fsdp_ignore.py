"""``fully_shard`` leaves dedicated weights alone without being told: the user passes nothing.

What FSDP2 (torch 2.11-2.15) offers for parameters it must not manage is one argument of each
call, ``fully_shard(..., ignored_params=...)``; it has no module-level ignore. Its walk over a
module stops only at submodules that carry a ``fully_shard`` state of their own, or that the
composable ``replicate`` registered. An empty nested ``fully_shard(linear, ignored_params={w})``
on each module that registers a dedicated weight would hide it from later calls with the public
API alone, but it puts FSDP2's hooks on those inner modules, inside the blocks users compile: a
``fullgraph=True`` compile of such a block then fails (``Call to torch._dynamo.disable()``), every
forward runs two more hooks per such module, and a Linear's bias would become an FSDP group (an
all-gather) of its own.

So DMuon passes FSDP2's own argument for the user. ``fully_shard`` reads ``ignored_params``
through one function, ``_get_modules_and_states(module, device, ignored_params, ...)`` of
``torch.distributed.fsdp._fully_shard._fully_shard`` (the same name and arguments in 2.11-2.15);
``ignore_dedicated_in_fully_shard`` wraps it, once per process, to add the dedicated weights under
the module being sharded (parameters stamped by a live handle) to that set. Every call then does
exactly what ``fully_shard(..., ignored_params=handle.ignored_params)`` does, which keeps working
(the same set); a model without dedicated weights is untouched. On a torch without that function
nothing is wrapped, and a weight FSDP2 took is named at the first forward (``hooks.py``), with the fix.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

_WRAPPED = "adds_dmuon_dedicated_weights"  # set on the wrapper: installed once, whatever the number of handles


# The modules whose calls read ``ignored_params`` through their own name of ``_get_modules_and_states``:
# FSDP2's ``fully_shard``, and the FSDP2-based composable ``replicate`` (torch >= 2.9), which imports the
# function by name, so wrapping the first alone left ``replicate`` taking the dedicated weights.
WRAPPED_MODULES = (
    "torch.distributed.fsdp._fully_shard._fully_shard",
    "torch.distributed._composable.replicate_with_fsdp",
)


def ignore_dedicated_in_fully_shard() -> bool:
    """Make every later ``fully_shard`` (and FSDP2's ``replicate``) call ignore the dedicated weights under
    its module; False when this torch has no ``_get_modules_and_states`` in ``fully_shard`` to wrap (then
    pass ``ignored_params`` yourself)."""
    import importlib

    wrapped = False
    for name in WRAPPED_MODULES:
        try:
            owner = importlib.import_module(name)
        except ImportError:
            continue
        original = getattr(owner, "_get_modules_and_states", None)
        if original is None:
            continue
        if not getattr(original, _WRAPPED, False):
            owner._get_modules_and_states = _ignoring_dedicated(original)
        wrapped = wrapped or name == WRAPPED_MODULES[0]
    return wrapped


def _ignoring_dedicated(original):
    @functools.wraps(original)
    def get_modules_and_states(module, device, ignored_params, *args, **kwargs):
        dedicated = dedicated_params_under(module)
        if dedicated:
            ignored_params = set(ignored_params or ()) | dedicated
        return original(module, device, ignored_params, *args, **kwargs)

    setattr(get_modules_and_states, _WRAPPED, True)
    return get_modules_and_states


def dedicated_params_under(module: nn.Module | list[nn.Module]) -> set[nn.Parameter]:
    """The dedicated weights registered under ``module`` (or a list of modules, as ``fully_shard`` takes)."""
    roots = [module] if isinstance(module, nn.Module) else list(module)
    return {p for root in roots for p in root.parameters() if is_dedicated(p)}


def is_dedicated(p: torch.Tensor) -> bool:
    """``p`` is a dedicated weight of a live handle (``DedicatedParams.follow_registered_params`` stamps it)."""
    stamp = getattr(p, "_dmuon_handle", None)
    return stamp is not None and stamp() is not None


def check_left_alone(members) -> None:
    """Each of ``members`` (dedicated weights) is still the plain tensor DMuon registered: FSDP2 did not shard it (a
    ``fully_shard`` call that did not ignore it: on a torch where nothing could be wrapped, or before
    ``dedicate_params``). Checked where every rank runs it before any collective of the step."""
    from torch.distributed.tensor import DTensor

    for m in members:
        if isinstance(m.module._parameters.get(m.name), DTensor):
            raise RuntimeError(
                f"dedicated weight {m.fqn!r} was sharded by fully_shard (it is a DTensor now): call "
                "dedicate_params before fully_shard; on a torch whose fully_shard DMuon cannot reach, pass "
                "fully_shard(..., ignored_params=handle.ignored_params)"
            )
