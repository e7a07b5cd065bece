"""One switch for gradient accumulation: FSDP2's, DDP's and DMuon's gradient sync together.

FSDP2 (``FSDPModule.set_requires_gradient_sync``), DDP (``no_sync``) and each DMuon handle
(``DedicatedParams.set_requires_gradient_sync``) each defer their gradient reduction on their own
switch; a model under DMuon has two of them, and switching one only would reduce half the
gradients per micro-batch (correct, but the traffic that accumulation exists to save).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from titan_dmuon.runtime import DedicatedParams


def set_requires_gradient_sync(module: nn.Module, requires_gradient_sync: bool) -> None:
    """As FSDP2's ``FSDPModule.set_requires_gradient_sync``, for the whole of ``module``: every FSDP2
    module in it, every DDP wrapper (its ``no_sync`` flag) and every DMuon handle of a
    ``dedicate_params`` call on it or a submodule. False: the next backwards keep their gradients
    unreduced, accumulating; the first backward with True reduces them all (call it before the last
    micro-batch's forward, as DDP needs)."""
    flag = bool(requires_gradient_sync)
    switched = 0
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_requires_gradient_sync(flag, recurse=False)
            switched += 1
        if isinstance(sub, DistributedDataParallel):
            sub.require_backward_grad_sync = flag
            switched += 1
        for handle in DedicatedParams.of(sub):
            handle.set_requires_gradient_sync(flag)
            switched += 1
    if not switched:
        raise ValueError(
            f"set_requires_gradient_sync found no FSDP2 module, DDP wrapper or DMuon dedication in the "
            f"{type(module).__name__} it was given: pass the model that fully_shard/DDP and dedicate_params were "
            "applied to"
        )
