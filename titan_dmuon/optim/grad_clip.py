"""Gradient-norm clipping over FSDP2 shards, DDP-replicated grads and owner-held grads.

``torch.nn.utils.clip_grad_norm_`` cannot mix DTensor and plain gradients, and
would count a dedicated weight's gradient zero times (non-owners hold none)
or, for replicated tensors, several times. Here every element of the global
gradient is counted exactly once:

* a dedicated weight's gradient lives on its global owner only: summed over all ranks;
* a DTensor shard is summed over its mesh and divided by its replication factor;
* a plain replicated gradient (DDP) is identical on all ranks: counted locally, once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from titan_dmuon.runtime.handle import handles_for


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    *,
    dedicated=None,
    pp_mesh=None,
) -> torch.Tensor:
    """Clip in place to ``max_norm``; returns the exact global norm (a collective).

    ``dedicated``: the handle(s) of ``dedicate_params`` for these parameters (default: found from
    the parameters, which each handle stamps). ``pp_mesh``: with
    pipeline parallelism, the mesh of the stages; ``parameters`` are this rank's stages', and the
    norm adds up (or, for inf, takes the max) over the stages, as TorchTitan's clip does. No host
    sync unless ``error_if_nonfinite`` (which must read the norm, as torch's does)."""
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
    params = list(parameters)
    grads = _Gradients.of(params, handles_for(params, dedicated))
    total = _total_norm(grads, norm_type, _device_of(params), pp_mesh)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite, so it cannot be clipped; "
            "set error_if_nonfinite=False to skip this check"
        )
    _scale_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


@dataclass
class _Gradients:
    """This rank's gradients by how the global gradient counts them (see the module docstring), and
    the meshes of the owned and sharded ones."""

    owned: list[torch.Tensor] = field(default_factory=list)  # dedicated weights' (on their owner)
    sharded: list[DTensor] = field(default_factory=list)
    replicated: list[torch.Tensor] = field(default_factory=list)
    meshes: list = field(default_factory=list)

    @staticmethod
    def of(params: list[torch.Tensor], handles: list) -> _Gradients:
        grads = _Gradients()
        for p in params:
            handle = next((h for h in handles if h.member_of(p) is not None), None)
            if handle is not None:
                grads.meshes.append(handle.mesh)
                if p.grad is not None:
                    grads.owned.append(p.grad)
            elif p.grad is None:
                continue
            elif isinstance(p.grad, DTensor):
                grads.meshes.append(p.grad.device_mesh)
                grads.sharded.append(p.grad)
            else:
                grads.replicated.append(p.grad)
        return grads


def _total_norm(grads: _Gradients, norm_type: float, device: torch.device, pp_mesh) -> torch.Tensor:
    """The global norm: owned and sharded power sums reduced over their common mesh (a shard divided by
    its replication factor), plus the local replicated ones, then over the pipeline stages."""
    is_inf = math.isinf(norm_type)
    reduced = _power_sum(grads.owned, norm_type, device)
    by_factor: dict[int, list[torch.Tensor]] = {}
    for g in grads.sharded:
        by_factor.setdefault(_replication_factor(g), []).append(g.to_local())
    for factor, locals_ in by_factor.items():
        part = _power_sum(locals_, norm_type, device)
        reduced = torch.maximum(reduced, part) if is_inf else reduced + part / factor
    mesh = _common_mesh(grads.meshes)
    if mesh is not None:
        for dim in range(mesh.ndim):
            dist.all_reduce(reduced, op=dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM, group=mesh.get_group(dim))
    local = _power_sum(grads.replicated, norm_type, device)
    total = torch.maximum(reduced, local) if is_inf else reduced + local  # this rank's stages
    if pp_mesh is not None:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM, group=pp_mesh.get_group())
    return total if is_inf else total ** (1.0 / norm_type)


def _scale_(grads: _Gradients, coef: torch.Tensor) -> None:
    """Every gradient times ``coef`` (on its device), in place."""
    for tensors in (grads.owned, [g.to_local() for g in grads.sharded], grads.replicated):
        if tensors:
            torch._foreach_mul_(tensors, coef.to(tensors[0].device))


def _power_sum(tensors: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack([n.float() for n in torch._foreach_norm(tensors, norm_type)]).to(device)
    if math.isinf(norm_type):
        return norms.max()
    return (norms**norm_type).sum()


def _replication_factor(grad: DTensor) -> int:
    factor = 1
    for dim, placement in enumerate(grad.placements):
        if isinstance(placement, Replicate):
            factor *= grad.device_mesh.size(dim)
    return factor


def _common_mesh(meshes: list):
    if not meshes:
        return None
    distinct = list({id(m): m for m in meshes}.values())
    if len(distinct) == 1:
        return distinct[0]
    # (DeviceMesh.mesh is a CPU tensor: reading it never syncs with a device)
    ranks = {id(m): set(m.mesh.flatten().tolist()) for m in distinct}
    # the mesh over all of them: with tensor parallelism FSDP2's (dp x tp) mesh holds the dedication
    # mesh (dp); a sum over all its ranks counts every owner's (TP-shard) gradient once
    widest = [m for m in distinct if all(ranks[id(o)] <= ranks[id(m)] for o in distinct)]
    if not widest:
        raise NotImplementedError(
            "clip_grad_norm_ found gradients on device meshes over different ranks, none of which holds the "
            "others; it supports one data-parallel (x tensor-parallel) world"
        )
    return max(widest, key=lambda m: (len(ranks[id(m)]), m.ndim))


def _device_of(params: list[torch.Tensor]) -> torch.device:
    for p in params:
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            return g.device
    return params[0].device if params else torch.device("cpu")
