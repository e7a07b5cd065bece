"""A tiny Llama-style transformer for examples, tests and benchmarks (plain PyTorch).

Its Muon targets are the attention and MLP projections, like TorchTitan's
llama3: ``muon_targets(model)`` lists them, ``qkv_splits(model)`` gives the row
split of fused q/k/v weights. With ``num_experts`` the MLP is a mixture of
experts with TorchTitan's 3-D expert layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True, frozen=True)
class ToyConfig:
    vocab_size: int = 64
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    hidden_dim: int = 48
    fused_qkv: bool = False
    num_experts: int = 0  # > 0: the MLP is a mixture of experts with 3-D expert weights
    top_k: int = 2
    routed_experts: int | None = None  # route tokens to the first k experts only (the rest get none)


class InnerAttention(nn.Module):
    """Causal SDPA on post-projection q, k, v in (batch, heads, positions, head dim): the
    ``inner_attention`` submodule QK-clip captures at (as TorchTitan's)."""

    def forward(self, q, k, v, *, scale=None):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=scale)


class Attention(nn.Module):
    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.inner_attention = InnerAttention()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        q_rows, kv_rows = cfg.n_heads * self.head_dim, cfg.n_kv_heads * self.head_dim
        self.splits = (q_rows, kv_rows, kv_rows)
        if cfg.fused_qkv:
            self.wqkv = nn.Linear(cfg.dim, sum(self.splits), bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, q_rows, bias=False)
            self.wk = nn.Linear(cfg.dim, kv_rows, bias=False)
            self.wv = nn.Linear(cfg.dim, kv_rows, bias=False)
        self.wo = nn.Linear(q_rows, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        if hasattr(self, "wqkv"):
            q, k, v = self.wqkv(x).split(self.splits, dim=-1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = q.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        out = self.inner_attention(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Top-k routed SwiGLU experts, weights stacked as TorchTitan stores them:
    w1, w3 ``(E, hidden, dim)``, w2 ``(E, dim, hidden)``; router ``gate`` ``(E, dim)``."""

    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        e, h, d = cfg.num_experts, cfg.hidden_dim, cfg.dim
        self.top_k, self.routed = cfg.top_k, cfg.routed_experts or cfg.num_experts
        self.gate = nn.Linear(d, e, bias=False)
        self.w1 = nn.Parameter(torch.randn(e, h, d) * d**-0.5)
        self.w2 = nn.Parameter(torch.randn(e, d, h) * h**-0.5)
        self.w3 = nn.Parameter(torch.randn(e, h, d) * d**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        logits = self.gate(tokens)
        logits[:, self.routed :] = float("-inf")  # unrouted experts get no token anywhere
        weights, experts = logits.softmax(-1).topk(self.top_k, dim=-1)
        out = torch.zeros_like(tokens)
        for e in range(self.routed):
            token, slot = (experts == e).nonzero(as_tuple=True)
            h = tokens[token]
            y = (F.silu(h @ self.w1[e].T) * (h @ self.w3[e].T)) @ self.w2[e].T
            out = out.index_add(0, token, y * weights[token, slot, None])
        return out.reshape(x.shape)


class Block(nn.Module):
    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim)
        if cfg.num_experts:
            self.moe = MoE(cfg)
        else:
            self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        mlp = self.moe if hasattr(self, "moe") else self.feed_forward
        return x + mlp(self.ffn_norm(x))


class ToyTransformer(nn.Module):
    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def muon_targets(model: ToyTransformer) -> list[nn.Parameter]:
    """Attention and MLP projection weights (experts and router included), in module order."""
    return [
        p
        for name, p in model.named_parameters()
        if any(k in name for k in (".attention.w", ".feed_forward.w", ".moe."))
    ]


def qkv_splits(model: ToyTransformer) -> dict[nn.Parameter, tuple[int, ...]]:
    return {
        layer.attention.wqkv.weight: layer.attention.splits
        for layer in model.layers
        if hasattr(layer.attention, "wqkv")
    }


def qk_clip_attention(model: ToyTransformer) -> list:
    """QK-clip's description of every attention layer (``DMuon(..., qk_clip_attention=...)``)."""
    from titan_dmuon.optim.qk_clip import QKClipAttention

    out = []
    for i, layer in enumerate(model.layers):
        a = layer.attention
        common = dict(
            n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim, name=f"layers.{i}", layout="BNLH"
        )
        if hasattr(a, "wqkv"):
            out.append(QKClipAttention.fused(a.inner_attention, wqkv=a.wqkv.weight, grouped=False, **common))
        else:
            out.append(QKClipAttention.separate(a.inner_attention, wq=a.wq.weight, wk=a.wk.weight, **common))
    return out


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
