"""Dedicated weights under DistributedDataParallel.

DDP must neither all-reduce nor broadcast the dedicated weights (their owners
reduce and broadcast them), so they are put on DDP's ignore list before the
wrapper is built.
"""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from titan_dmuon.runtime import DedicatedParams


def wrap_ddp(module: nn.Module, handle: DedicatedParams, **ddp_kwargs) -> DistributedDataParallel:
    """``DistributedDataParallel(module)`` over the handle's 1-D mesh, skipping dedicated weights."""
    if handle.mode.mesh.hsdp:
        raise ValueError("wrap_ddp needs a handle built on a 1-D mesh (DDP has no shard/replicate split)")
    if handle.local_experts:
        raise ValueError(
            f"expert weights {[e.fqn for e in handle.local_experts]} were left to be updated where they live, but "
            "DDP replicates them on every rank (each would run Muon on all experts); under DDP dedicate them: "
            "dedicate_params(..., expert_sharding='dedicated')"
        )
    if handle.module is not module:
        raise ValueError("wrap_ddp must get the same module that was passed to dedicate_params")
    if ddp_kwargs.get("process_group") not in (None, handle.mesh.get_group()):
        raise ValueError("wrap_ddp uses the handle's mesh as the process group; do not pass another one")
    ddp_kwargs["process_group"] = handle.mesh.get_group()
    # DDP matches names as named_parameters() spells them, wrapper segments included
    # (an activation-checkpointed block adds "_checkpoint_wrapped_module.")
    dedicated = {id(p) for p in handle.params}
    names = [name for name, p in module.named_parameters() if id(p) in dedicated]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)
    return DistributedDataParallel(module, **ddp_kwargs)
