"""Context parallelism on a machine without an accelerator: the CPU's causal SDPA on the all-gathered keys and
values with the mask of each cp rank's positions (``ContextParallelCausalAttention``), and its binding to the
rank's place on the cp mesh. ``cpu.use_sdpa_attention`` puts it in the model config; nothing here runs where an
accelerator is present."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchtitan.protocols.module import Module as TitanModule

CONTEXT_PARALLEL_BACKEND = "spmd_types"
CONTEXT_PARALLEL_BACKEND_REASON = (
    "context parallelism runs here on TorchTitan's spmd_types backend, which all-gathers k and v over the cp ranks "
    "and leaves the causal mask of each rank's positions to the attention (ContextParallelCausalAttention); the "
    "other backends' SDPA path is PyTorch's ring attention, which has no CPU kernel (its CP dispatcher knows the "
    "CUDA flash, efficient and cuDNN ops, not aten._scaled_dot_product_flash_attention_for_cpu)"
)
PTRR_REASON = (
    "the PTRR load balancer places each rank's rows by FlexAttention's block masks, and FlexAttention has no CPU "
    "backward; use 'headtail' (the default) or none"
)


class ContextParallelCausalAttention(TitanModule):
    """Causal attention of one context-parallel rank's part of each sequence, by the CPU's SDPA.

    TorchTitan's spmd_types backend runs context parallelism by all-gathering k and v over the cp
    ranks around the inner attention (its ``set_gqa_inner_attention_local_map``: S(1) -> R, the
    gradients reduce-scattered back) and leaves the mask to the attention: FlexAttention takes a block
    mask sharded on the query positions, and TorchTitan refuses SDPA, whose ``is_causal`` would align
    the local queries with the first keys. This module is SDPA with the mask FlexAttention would get:
    query i attends key j where j's position in the sequence is at most i's, the positions being
    where TorchTitan's load balancer put each rank's rows (head-tail: rank r holds chunks r and
    2W-1-r of 2W; the gathered keys are the ranks' parts in rank order). ``bind`` gives it this
    rank's place (DMuon's parallelize step, which has the parallel dims)."""

    @dataclass(kw_only=True, slots=True)
    class Config(TitanModule.Config):
        pass

    def __init__(self, config: Config | None = None) -> None:
        super().__init__()
        self.cp_rank, self.cp_size, self.load_balancer = 0, 1, None

    def bind(self, *, cp_rank: int, cp_size: int, load_balancer: str | None) -> None:
        if load_balancer not in (None, "headtail"):  # (checked before launch: validation)
            raise ValueError(f"context_parallel_load_balancer = {load_balancer!r}: {PTRR_REASON}")
        self.cp_rank, self.cp_size, self.load_balancer = cp_rank, cp_size, load_balancer

    def sequence_positions(self, queries: int, keys: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Where in the sequence this rank's query rows and the gathered key rows are."""
        if keys != queries * self.cp_size:
            raise RuntimeError(
                f"context-parallel attention got {queries} query and {keys} key positions on "
                f"{self.cp_size} cp ranks: expected the keys of every cp rank (bind it first)"
            )
        from titan_dmuon.integration.models.attention_clip import load_balanced_order

        order = load_balanced_order(self.load_balancer, self.cp_size, keys, device)
        return order[self.cp_rank * queries : (self.cp_rank + 1) * queries], order

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False, **kwargs):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if attention_masks is not None:
            raise ValueError("context-parallel attention on the CPU is causal: it takes no attention_masks")
        query_pos, key_pos = self.sequence_positions(q_BLNH.shape[1], k_BLNH.shape[1], q_BLNH.device)
        allowed = query_pos[:, None] >= key_pos[None, :]
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH], set_priority=True):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


def bind_context_parallel_attention(model: torch.nn.Module, parallel_dims, parallelism) -> None:
    """Give each ``ContextParallelCausalAttention`` of ``model`` this rank's place on the cp mesh."""
    modules = [m for m in model.modules() if isinstance(m, ContextParallelCausalAttention)]
    if not modules:
        return
    from torchtitan.tools.logging import logger

    mesh = parallel_dims.get_mesh("cp")
    for module in modules:
        module.bind(
            cp_rank=mesh.get_local_rank(), cp_size=mesh.size(), load_balancer=parallelism.context_parallel_load_balancer
        )
    logger.info(
        f"titan_dmuon: context parallelism without an accelerator: {len(modules)} attention layers run as "
        f"ContextParallelCausalAttention (CPU SDPA with the causal mask of each cp rank's positions, "
        f"load balancer {parallelism.context_parallel_load_balancer}) in place of FlexAttention"
    )
