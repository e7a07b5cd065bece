"""QK-clip for TorchTitan 0.3.0's attention modules: the descriptions DMuon needs, built from the model.

* ``GQAttention`` (llama3): GQA when ``n_kv_heads < n_heads`` (query rows only), MHA otherwise;
  separate ``QKVLinear`` (wq/wk) or ``FusedQKVLinear`` (wqkv, grouped rows) projections;
* DeepSeek-V3's ``Attention`` (MLA, also kimi_k2_7): ``wq`` (q_lora_rank 0) or ``wq_b``, and ``wkv_b``;
* refused: attention that normalises q and k (qwen3's ``q_norm``/``k_norm``: a rescale of the
  projection is undone by the norm), and any other attention layout.

Capture is at each attention's ``inner_attention`` submodule (post-RoPE q, k in (B, L, N, H),
``scale=`` the model's softmax scale), assuming causal attention over the whole sequence: with
document masking (flex ``block_causal``) S also counts cross-document pairs, an upper bound.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
from torch import nn

from titan_dmuon.optim.qk_clip import QKClipAttention, SequenceShards
from titan_dmuon.runtime import canonical_fqn


class QKClipNotSupported(ValueError):
    """This model's attention cannot be QK-clipped; the message says why."""


NORMALISED_QK = (
    "its attention normalises q and k per head (q_norm/k_norm, as qwen3's) before the logits, so rescaling the q/k "
    "projection weights does not change the logits: QK-clip cannot bound them; unset optimizer.qk_clip_threshold "
    "for this model"
)


def attention_descriptions(model: nn.Module, tp_size: int = 1) -> list[QKClipAttention]:
    """One QKClipAttention per attention module of ``model`` (a model part), in module order.

    Under tensor parallelism (``tp_size`` > 1) each rank's q/k weights are its TP-local shards, which
    hold whole heads (and, for GQA, whole kv groups with their query heads), and its inner attention
    sees exactly those heads: each rank describes and clips its own heads. Under context parallelism
    each inner attention sees this rank's part of every sequence (``record_sequence_shards``)."""
    sequence = model.__dict__.get(_SEQUENCE_SHARDS)
    return [dataclasses.replace(d, sequence=sequence) for d in _descriptions(model, tp_size)]


_SEQUENCE_SHARDS = "_dmuon_sequence_shards"  # (on the model part, as its handles are: DedicatedParams.of)


def record_sequence_shards(model: nn.Module, parallel_dims, parallelism) -> None:
    """Under context parallelism, note on the model part how its attention sees each sequence: this
    rank's part, placed by TorchTitan's load balancer (QK-clip's capture reads it)."""
    if parallel_dims.cp > 1:
        model.__dict__[_SEQUENCE_SHARDS] = SequenceShards(
            group=parallel_dims.get_mesh("cp").get_group(),
            order=functools.partial(load_balanced_order, parallelism.context_parallel_load_balancer, parallel_dims.cp),
        )


def load_balanced_order(load_balancer: str | None, cp_size: int, length: int, device) -> torch.Tensor:
    """The position in the sequence of each row of the cp ranks' parts of a ``length``-long sequence,
    laid end to end in rank order, as TorchTitan's ``cp_shard`` places them: with the head-tail load
    balancer (its default; chunks r and 2W-1-r of 2W on rank r) the order of PyTorch's
    ``_HeadTailLoadBalancer``, without one the sequence in order. (PTRR follows FlexAttention's block
    mask; QK-clip and the CPU attention refuse it before launch.)"""
    if load_balancer is None:
        return torch.arange(length, device=device)
    if load_balancer != "headtail":
        raise ValueError(f"context_parallel_load_balancer {load_balancer!r}: expected 'headtail' or none")
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    return _HeadTailLoadBalancer(length, cp_size, device)._generate_indices()[0]


def _descriptions(model: nn.Module, tp_size: int) -> list[QKClipAttention]:
    from torchtitan.models.common.attention import BaseAttention, FusedQKVLinear, GQAttention, QKVLinear

    out = []
    for name, module in model.named_modules():
        if not isinstance(module, BaseAttention):
            continue
        fqn = canonical_fqn(name)
        inner = getattr(module, "inner_attention", None)
        if not isinstance(inner, nn.Module):
            raise QKClipNotSupported(
                f"attention {fqn!r} ({type(module).__name__}) has no inner_attention submodule to capture at"
            )
        if isinstance(module, GQAttention):
            if module.q_norm is not None or module.k_norm is not None:
                raise QKClipNotSupported(f"attention {fqn!r}: {NORMALISED_QK}")
            if module.n_heads % tp_size or module.n_kv_heads % tp_size:
                raise QKClipNotSupported(
                    f"attention {fqn!r}: {module.n_heads} heads, {module.n_kv_heads} kv heads "
                    f"do not split over {tp_size} tensor-parallel ranks"
                )
            common = dict(
                n_heads=module.n_heads // tp_size,
                n_kv_heads=module.n_kv_heads // tp_size,
                head_dim=module.head_dim,
                name=fqn,
            )
            qkv = module.qkv_linear
            if isinstance(qkv, FusedQKVLinear):
                out.append(QKClipAttention.fused(inner, wqkv=qkv.wqkv.weight, grouped=True, **common))
            elif isinstance(qkv, QKVLinear):
                out.append(QKClipAttention.separate(inner, wq=qkv.wq.weight, wk=qkv.wk.weight, **common))
            else:
                raise QKClipNotSupported(
                    f"attention {fqn!r}: q/k projection {type(qkv).__name__} has no known row layout"
                )
        elif is_mla(module):
            wq = module.wq if module.q_lora_rank == 0 else module.wq_b
            out.append(
                QKClipAttention.mla(
                    inner,
                    wq=wq.weight,
                    wkv_b=module.wkv_b.weight,
                    n_heads=module.n_heads // tp_size,
                    qk_nope_head_dim=module.qk_nope_head_dim,
                    qk_rope_head_dim=module.qk_rope_head_dim,
                    v_head_dim=module.v_head_dim,
                    name=fqn,
                )
            )
        else:
            raise QKClipNotSupported(
                f"attention {fqn!r} ({type(module).__module__}.{type(module).__name__}) "
                "has a layout QK-clip does not know "
                "(supported: TorchTitan's GQAttention without q/k norms, DeepSeek-V3's MLA)"
            )
    return out


def is_mla(module: nn.Module) -> bool:
    """DeepSeek-V3's multi-head latent attention (also kimi_k2_7's), recognised by its attributes."""
    return all(
        hasattr(module, a)
        for a in ("wkv_b", "wkv_a", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank")
    )


def clip_weights(descriptions: list[QKClipAttention]) -> list[nn.Parameter]:
    """The weights the clip rescales (each must be a Muon target)."""
    seen, out = set(), []
    for d in descriptions:
        for part in d.rows:
            if id(part.param) not in seen:
                seen.add(id(part.param))
                out.append(part.param)
    return out


def pause_capture_in_metadata_inference(stages, optimizers) -> None:
    """torch.distributed.pipelining infers each stage's input and output shapes at the first step
    (and after a train/eval switch) by running the stage's forward with grad enabled on
    ``torch.empty`` inputs (every stage after the first): the capture would take the logits of
    uninitialised memory (NaN or arbitrary values) into the step's S. Each stage's metadata
    inference runs with the capture paused, and so does its backward (which recomputes
    activation-checkpointed blocks on those inputs). ``stages``: a schedule's pipeline stages on
    this rank; ``_forward_metadata_inference`` and ``_backward_metadata_inference`` are torch
    2.14's (a stage without them leaves nothing to pause)."""
    clips = [opt.qk_clip for opt in optimizers if getattr(opt, "qk_clip", None) is not None]
    if not clips:
        return
    for stage in stages:
        for name in ("_forward_metadata_inference", "_backward_metadata_inference"):
            infer = getattr(stage, name, None)
            if infer is None:
                continue

            def paused(*args, _infer=infer, **kwargs):
                with contextlib.ExitStack() as stack:
                    for clip in clips:
                        stack.enter_context(clip.paused())
                    return _infer(*args, **kwargs)

            setattr(stage, name, paused)
