"""Per-head blocks of TorchTitan's attention projections (``integration/training/attention_heads.py``),
checked against what TorchTitan's own forward does with them, not against the rule that built them.

For each row block of a q/k/v projection (llama3's fused wqkv and separate wq/wk/wv, qwen3 dense and
MoE, MLA's wq / wq_b and wkv_b): perturbing exactly those rows changes the input of the inner attention
(q, k, v as (B, L, heads, head_dim)) in exactly one head of one of them, and every head of each is some
block's. For the output projection's column blocks: zeroing head h's output of the inner attention gives
the same result as zeroing wo's block h of columns.
"""

import pytest
import torch

from tests.support import titan_harness
from titan_dmuon.integration import cpu
from titan_dmuon.integration.models.attention_heads import HeadBlocksNotSupported, head_blocks
from titan_dmuon.math.matrix_blocks import column_blocks, row_blocks

DIM = 64  # the tiny models' (titan_harness)

FAMILIES = {
    "llama3 fused wqkv": lambda: titan_harness.tiny_llama3(fuse_qkv=True, n_layers=1),
    "llama3 wq/wk/wv": lambda: titan_harness.tiny_llama3(fuse_qkv=False, n_layers=1),
    "qwen3": lambda: titan_harness.tiny_qwen3(n_layers=1),
    "qwen3 moe": lambda: titan_harness.tiny_qwen3_moe(n_layers=1),
    "deepseek_v3": lambda: titan_harness.tiny_deepseek_v3(),
    "deepseek_v3 q_lora": lambda: titan_harness.tiny_deepseek_v3(q_lora_rank=24),
}


def _model(family: str):
    config, _ = FAMILIES[family]()
    cpu.use_sdpa_attention(config)
    torch.manual_seed(0)
    model = config.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def _attention(model):
    from torchtitan.models.common.attention import BaseAttention

    return next(m for m in model.modules() if isinstance(m, BaseAttention))


def _inner_inputs(attention, x):
    """q, k, v as the attention's inner attention gets them."""
    captured = {}
    handle = attention.inner_attention.register_forward_hook(
        lambda module, args, kwargs, out: captured.update(qkv=[a.detach().clone() for a in args[:3]]), with_kwargs=True
    )
    try:
        with torch.no_grad():
            attention(x, None)
    finally:
        handle.remove()
    return captured["qkv"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_row_blocks_are_heads_in_torchtitans_forward(family):
    model = _model(family)
    attention = _attention(model)
    blocks = head_blocks(model)
    names = {id(p): n for n, p in model.named_parameters()}
    x = torch.randn(1, 8, DIM, generator=torch.Generator().manual_seed(0))
    base = _inner_inputs(attention, x)
    own = {id(p) for p in attention.parameters()}
    hit: dict[tuple[int, int], str] = {}  # (q/k/v index, head) -> the block that moves it
    for weight, split in blocks.split_rows.items():
        if id(weight) not in own:
            continue
        for block in row_blocks(weight.shape, split):
            with torch.no_grad():
                saved = weight.detach().clone()
                for a, b in block:
                    weight[a:b] += torch.randn(b - a, weight.shape[1])
                moved = _inner_inputs(attention, x)
                weight.copy_(saved)
            changed = [
                (t, h)
                for t in range(3)
                for h in range(base[t].shape[2])
                if not torch.equal(base[t][:, :, h], moved[t][:, :, h])
            ]
            label = f"{names[id(weight)]} rows {block}"
            assert changed and len({h for _, h in changed}) == 1, (label, changed)
            for pair in changed:
                assert pair not in hit, (label, hit.get(pair))
                hit[pair] = label
            if names[id(weight)].endswith("wkv_b.weight"):  # one head's k_nope and v rows together (Kimi's blocks)
                assert {t for t, _ in changed} == {1, 2}, (label, changed)
    heads = {(t, h) for t in range(3) for h in range(base[t].shape[2])}
    assert set(hit) == heads, (family, sorted(heads - set(hit)))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_column_blocks_of_the_output_projection_are_heads(family):
    model = _model(family)
    attention = _attention(model)
    blocks = head_blocks(model)
    wo = attention.wo.weight
    split = column_blocks(wo.shape, blocks.split_cols[wo])
    x = torch.randn(1, 8, DIM, generator=torch.Generator().manual_seed(0))
    for h, block in enumerate(split):

        def zero_head(module, args, kwargs, out, h=h):
            out = out.clone()
            out[:, :, h] = 0
            return out

        handle = attention.inner_attention.register_forward_hook(zero_head, with_kwargs=True)
        with torch.no_grad():
            by_head = attention(x, None)
        handle.remove()
        with torch.no_grad():
            saved = wo.detach().clone()
            for a, b in block:
                wo[:, a:b] = 0
            by_columns = attention(x, None)
            wo.copy_(saved)
        torch.testing.assert_close(by_head, by_columns, rtol=1e-5, atol=1e-5)
    assert len(split) == attention.n_heads


def test_what_stays_whole_and_what_is_refused():
    """MLA's low-rank wq_a/wkv_a (every head's) stay whole; attention of an unknown layout is refused."""
    model = _model("deepseek_v3 q_lora")
    attention = _attention(model)
    blocks = head_blocks(model)
    for weight in (attention.wq_a.weight, attention.wkv_a.weight):
        assert weight not in blocks.split_rows and weight not in blocks.split_cols
    from torchtitan.models.common.attention import BaseAttention

    class Unknown(BaseAttention):
        def __init__(self):
            torch.nn.Module.__init__(self)
            self.proj = torch.nn.Linear(4, 4)

    holder = torch.nn.Module()
    holder.attention = Unknown()
    with pytest.raises(HeadBlocksNotSupported, match="'attention'.*does not know"):
        head_blocks(holder)
