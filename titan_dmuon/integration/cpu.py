"""TorchTitan 0.3.0 on a machine without an accelerator: every accommodation, in one place.

Nothing here runs when an accelerator is present: on GPU clusters TorchTitan
keeps its own device selection, NCCL, memory monitor and attention backend.
On a CPU machine (the project's development and CI machine) seven blockers
are handled:

1. device type: TorchTitan picks "cuda" when it sees no accelerator and copies
   that choice into several modules at import time; ``enable`` sets "cpu" (so
   the backend becomes gloo) there and in every copy already made. Every
   DMuon door calls it: integration/train.py and check.py, titan_dmuon.config_registry
   (on import), with_dmuon, and DMuonTrainer before it builds anything.
2. the CUDA memory monitor and the CUDA barrier in ``set_pg_timeouts``: CPU
   equivalents (peak RSS of the process; a plain barrier).
3. FlexAttention has no CPU backward: ``use_sdpa_attention`` switches each
   layer's inner attention to causal SDPA in the model config.
4. gloo rejects FSDP2's PREMUL_SUM (used because TorchTitan sets the gradient
   divide factor to 1): ``force_sum_reductions`` asks FSDP2 for plain sums.
5. no tokenizer or dataset ships with TorchTitan: see ``assets.py``.
6. gloo's list ``all_to_all`` needs equal sizes, and TorchTitan's default ``spmd_types`` backend
   exchanges expert-parallel tokens with it (uneven splits): ``enable`` gives spmd_types a
   ``torch.distributed`` whose ``all_to_all`` on gloo goes through ``all_to_all_single`` with split
   sizes (gloo's alltoallv), by ``spmd_types.set_dist``, the hook it offers for this.
7. context parallelism: TorchTitan's spmd_types backend refuses SDPA under CP and FlexAttention
   has no CPU backward (its other backends' ring attention has no CPU kernel). Under CP
   ``use_sdpa_attention`` gives each layer ``ContextParallelCausalAttention``: the CPU's SDPA on
   spmd_types' all-gathered k and v with the causal mask of each cp rank's positions (TorchTitan's
   head-tail load balancer), bound to its cp rank by the parallelize step
   (``bind_context_parallel_attention``); both live in ``distributed/context_parallel.py``; validation
   refuses the rest before launch.
"""

from __future__ import annotations

import resource
import sys
import types
from collections import namedtuple

import torch

from titan_dmuon.integration.distributed.context_parallel import ContextParallelCausalAttention
from titan_dmuon.runtime.gloo_exit import install_exit_guard


def accelerator_present() -> bool:
    return torch.accelerator.is_available()


def enable() -> None:
    """Point TorchTitan at the CPU and gloo; a no-op with an accelerator, and idempotent.

    TorchTitan's choice lives in ``torchtitan.tools.utils`` and several of its
    modules copy it at import time (``from torchtitan.tools.utils import
    device_type``). TorchTitan's own entry point imports its trainer before it
    imports a config registry, so this cannot run first there: it sets the
    choice and rewrites the copies in every torchtitan module already imported
    (modules imported later copy "cpu" themselves).
    """
    if accelerator_present():
        return
    import torchtitan.tools.utils as titan_utils

    if titan_utils.device_type == "cpu":
        return  # already enabled
    install_exit_guard()  # (gloo's workers at interpreter exit)
    _uneven_all_to_all_on_gloo()
    stale_type, stale_module = titan_utils.device_type, titan_utils.device_module
    titan_utils.device_type, titan_utils.device_module = "cpu", torch.cpu
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "torchtitan" or name.startswith("torchtitan.")):
            continue
        namespace = vars(module)
        if namespace.get("device_type") is stale_type:
            namespace["device_type"] = "cpu"
        if namespace.get("device_module") is stale_module:
            namespace["device_module"] = torch.cpu

    import torchtitan.components.metrics as titan_metrics
    import torchtitan.distributed.utils as titan_dist_utils

    titan_metrics.build_device_memory_monitor = CpuMemoryMonitor
    titan_dist_utils.set_pg_timeouts = _set_pg_timeouts_cpu


def _uneven_all_to_all_on_gloo() -> None:
    """Blocker 6: spmd_types' collectives call ``torch.distributed`` through ``spmd_types._dist.dist``."""
    import spmd_types

    spmd_types.set_dist(_GlooAllToAll("titan_dmuon.integration.cpu.torch_distributed"))


class _GlooAllToAll(types.ModuleType):
    """``torch.distributed``, but its list ``all_to_all`` on a gloo group runs as one
    ``all_to_all_single`` with per-rank split sizes, which gloo supports for uneven splits."""

    def __getattr__(self, name: str):
        return getattr(torch.distributed, name)

    @staticmethod
    def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
        dist = torch.distributed
        if async_op or dist.get_backend(group) != "gloo":
            return dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)
        send = torch.cat([t.reshape(-1) for t in input_tensor_list])
        received = send.new_empty(sum(t.numel() for t in output_tensor_list))
        dist.all_to_all_single(
            received, send, [t.numel() for t in output_tensor_list], [t.numel() for t in input_tensor_list], group=group
        )
        offset = 0
        for t in output_tensor_list:
            t.copy_(received[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        return None


_MemStats = namedtuple(
    "DeviceMemStats",
    ["max_active_gib", "max_active_pct", "max_reserved_gib", "max_reserved_pct", "num_alloc_retries", "num_ooms"],
)


class CpuMemoryMonitor:
    """TorchTitan's DeviceMemoryMonitor interface, backed by the process's peak RSS."""

    device_name = "cpu"

    def __init__(self) -> None:
        import os

        self.device_capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        self.device_capacity_gib = self.device_capacity / 2**30

    def get_peak_stats(self):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        gib, pct = peak / 2**30, 100 * peak / self.device_capacity
        return _MemStats(gib, pct, gib, pct, 0, 0)

    def reset_peak_stats(self) -> None:
        """Peak RSS cannot be reset; it stays the process-lifetime peak."""


def _set_pg_timeouts_cpu(timeout, parallel_dims) -> None:
    torch.distributed.barrier()
    groups = [mesh.get_group() for mesh in parallel_dims.get_all_one_dimensional_meshes().values()] + [None]
    for group in groups:
        torch.distributed.set_timeout(timeout, group)


def use_sdpa_attention(model_config, *, context_parallel: bool = False) -> None:
    """Switch every attention layer of a TorchTitan decoder config to causal SDPA; under context
    parallelism to ``ContextParallelCausalAttention`` (which keeps the layer's sharding config: its
    k/v all-gather over the cp ranks). Idempotent, and either way round."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention

    replaced = [
        FlexAttention.Config,
        VarlenAttention.Config,
        ScaledDotProductAttention.Config if context_parallel else ContextParallelCausalAttention.Config,
    ]
    for kind in replaced:
        for _, old, parent, attr in list(model_config.traverse(kind)):
            new = (
                ContextParallelCausalAttention.Config(sharding_config=old.sharding_config)
                if context_parallel
                else ScaledDotProductAttention.Config()
            )
            if isinstance(attr, int):
                parent[attr] = new
            else:
                setattr(parent, attr, new)


def force_sum_reductions(model: torch.nn.Module) -> None:
    """gloo has no PREMUL_SUM: make FSDP2 reduce with SUM (the divide factor is 1 anyway)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
