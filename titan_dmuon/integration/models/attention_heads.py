"""Per-head Newton–Schulz (``[optimizer] ns_blocks = "heads"``): TorchTitan 0.3.0's attention
projections in blocks of one head each, as ``dedicate_params``' ``split_rows`` and ``split_cols``.

* ``GQAttention`` (llama3, qwen3 dense and MoE): wq's rows per query head and wk's, wv's per kv head
  (``head_dim`` rows each); a fused wqkv's per head (its layout, [kv group][query heads, k head,
  v head][head_dim], makes every ``head_dim`` rows one head's q, k or v); wo's columns per query head
  (its input is the heads' outputs, head after head).
* MLA (deepseek_v3, kimi_k2_7): wq (``q_lora_rank`` 0) or wq_b by the rows of each head
  (``qk_nope_head_dim + qk_rope_head_dim``), wkv_b by the rows of each head (its k_nope and v rows
  together, ``qk_nope_head_dim + v_head_dim``: the blocks of TorchTitan's Kimi recipes' ``BlockShard``),
  wo by the columns of each head (``v_head_dim``). wq_a and wkv_a (the low-rank projections every head
  shares) stay whole.
* refused: any other attention layout (a head structure DMuon does not know would be split wrongly).

Blocks are rows and columns of the full matrix: under tensor parallelism (``tp_size``) the module's
head counts are the model's, and each rank's weight is its shard (whole heads).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from titan_dmuon.integration.models.attention_clip import is_mla
from titan_dmuon.runtime import canonical_fqn

NS_BLOCKS = ("matrix", "heads")  # [optimizer] ns_blocks: whole matrices (fused q/k/v: q, k, v), or per head


class HeadBlocksNotSupported(ValueError):
    """This model's attention cannot be split by heads; the message says why."""


@dataclass(frozen=True)
class HeadBlocks:
    """Per attention weight, its blocks: ``split_rows`` (row counts, of the full matrix) and ``split_cols``
    (column counts), keyed by the parameter, as ``dedicate_params`` takes them."""

    split_rows: dict = field(default_factory=dict)
    split_cols: dict = field(default_factory=dict)


def head_blocks(model: nn.Module, tp_size: int = 1) -> HeadBlocks:
    """The per-head blocks of every attention module of ``model`` (a model part), in module order.
    HeadBlocksNotSupported names an attention module of another layout."""
    from torchtitan.models.common.attention import BaseAttention, FusedQKVLinear, GQAttention, QKVLinear

    out = HeadBlocks()
    for name, module in model.named_modules():
        if not isinstance(module, BaseAttention):
            continue
        fqn = canonical_fqn(name)
        if isinstance(module, GQAttention):
            hd, qkv = module.head_dim, module.qkv_linear
            if isinstance(qkv, FusedQKVLinear):
                rows = module.n_kv_heads * (module.n_heads // module.n_kv_heads + 2)
                _rows(out, fqn, "qkv_linear.wqkv", qkv.wqkv.weight, [hd] * rows, tp_size)
            elif isinstance(qkv, QKVLinear):
                _rows(out, fqn, "qkv_linear.wq", qkv.wq.weight, [hd] * module.n_heads, tp_size)
                _rows(out, fqn, "qkv_linear.wk", qkv.wk.weight, [hd] * module.n_kv_heads, tp_size)
                _rows(out, fqn, "qkv_linear.wv", qkv.wv.weight, [hd] * module.n_kv_heads, tp_size)
            else:
                raise HeadBlocksNotSupported(
                    f"attention {fqn!r}: q/k/v projection {type(qkv).__name__} has no known row layout"
                )
            _columns(out, fqn, "wo", module.wo.weight, [hd] * module.n_heads, tp_size)
        elif is_mla(module):
            heads = module.n_heads
            wq, wq_name = (module.wq, "wq") if module.q_lora_rank == 0 else (module.wq_b, "wq_b")
            _rows(out, fqn, wq_name, wq.weight, [module.qk_nope_head_dim + module.qk_rope_head_dim] * heads, tp_size)
            _rows(
                out, fqn, "wkv_b", module.wkv_b.weight, [module.qk_nope_head_dim + module.v_head_dim] * heads, tp_size
            )
            _columns(out, fqn, "wo", module.wo.weight, [module.v_head_dim] * heads, tp_size)
        else:
            raise HeadBlocksNotSupported(
                f"attention {fqn!r} ({type(module).__module__}.{type(module).__name__}) has a layout per-head "
                "Newton–Schulz does not know (supported: TorchTitan's GQAttention, DeepSeek-V3's MLA)"
            )
    return out


def _rows(out: HeadBlocks, fqn: str, name: str, weight: nn.Parameter, counts: list[int], tp: int) -> None:
    """``weight``'s rows in ``counts`` (the full matrix's: a column-wise TP shard holds 1/tp of them)."""
    rows = weight.shape[0] * tp
    if sum(counts) != rows:
        raise HeadBlocksNotSupported(f"attention {fqn!r}: {name} has {rows} rows, but its heads make {sum(counts)}")
    out.split_rows[weight] = counts


def _columns(out: HeadBlocks, fqn: str, name: str, weight: nn.Parameter, counts: list[int], tp: int) -> None:
    """``weight``'s columns in ``counts`` (the full matrix's: a row-wise TP shard holds 1/tp of them)."""
    cols = weight.shape[1] * tp
    if sum(counts) != cols:
        raise HeadBlocksNotSupported(f"attention {fqn!r}: {name} has {cols} columns, but its heads make {sum(counts)}")
    out.split_cols[weight] = counts
