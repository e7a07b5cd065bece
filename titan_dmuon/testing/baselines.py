"""Naive FSDP2 + Muon: the baseline DMuon is measured against.

FSDP2 shards every weight; in ``step()`` each rank all-gathers the full
momentum-updated gradient of every Muon matrix, runs Newton–Schulz on it
(redundantly, on every rank) and applies its own rows. Per step that is
FSDP2's all-gather + reduce-scatter (+ re-gather in Z3) plus one more
all-gather of P_M: 3(N-1)/N (Z2) or 4(N-1)/N (Z3) elements per rank.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_dmuon.math.ns_methods import newton_schulz
from titan_dmuon.math.update_rules import adjusted_lr, momentum_update, scalar
from titan_dmuon.optim.optimizer import DMuon


class NaiveFSDPMuon(DMuon):
    """Muon on ``muon_params`` (FSDP2 DTensor shards) with a full-gradient all-gather in step."""

    def __init__(self, params: Iterable, *, muon_params: Iterable[torch.Tensor], **kwargs) -> None:
        self._muon_ids = {id(p) for p in muon_params}
        super().__init__(params, **kwargs)

    def _is_muon_param(self, p: torch.Tensor) -> bool:
        return id(p) in self._muon_ids

    def _muon_step(self, groups: list[dict]) -> None:
        for group in groups:
            self._naive_group_step(group)

    def _naive_group_step(self, group: dict) -> None:
        for p in group["params"]:
            if p.grad is None:
                continue
            if not isinstance(p, DTensor):
                raise TypeError("NaiveFSDPMuon expects FSDP2 (DTensor) parameters")
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            update = momentum_update(
                p.grad, state["momentum_buffer"], momentum=group["momentum"], nesterov=group["nesterov"]
            )
            full = update.full_tensor()  # the step's all-gather
            stack = full if full.ndim == 3 else full[None]  # 3-D: MoE experts, one matrix each
            orthogonal = newton_schulz(
                stack,
                steps=group["ns_steps"],
                coefficients=group["ns_coefficients"],
                eps=group["eps"],
                ns_method=self.ns_method,
            ).reshape(full.shape)
            mine = distribute_tensor(orthogonal, p.device_mesh, p.placements, src_data_rank=None)
            lr = scalar(group["lr"])
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(mine, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape[-2:]))
            self._ns.matrices += stack.shape[0]
