"""Context parallelism's pieces in one process (titan_dmuon/integration/distributed/context_parallel.py and the CPU
accommodation of integration/cpu.py): the head-tail order, the CPU attention of each rank's part against causal
attention of the whole sequence, the max logits by position. (That none of it runs with an accelerator, a check
through TorchTitan's config and parallelize step: tests/titan/test_context_parallel.py.)"""

import pytest
import torch

from titan_dmuon.integration.distributed import context_parallel


def test_head_tail_order_puts_chunks_r_and_2w_minus_1_minus_r_on_rank_r():
    """The positions each cp rank holds, as TorchTitan's cp_shard cuts a sequence of 8 over 2 ranks with
    its default head-tail load balancer (chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and
    2), and over 2 ranks without one."""
    from titan_dmuon.integration.models.attention_clip import load_balanced_order

    assert load_balanced_order("headtail", 2, 8, "cpu").tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert load_balanced_order(None, 2, 8, "cpu").tolist() == list(range(8))


@pytest.mark.parametrize("cp, balancer", [(2, "headtail"), (4, "headtail"), (2, None)])
def test_cpu_attention_of_each_ranks_part_is_causal_attention_of_the_sequence(cp, balancer):
    """ContextParallelCausalAttention on each cp rank (its queries, every rank's keys and values laid end
    to end in rank order, as TorchTitan's spmd_types backend gathers them) gives that rank's rows of
    causal SDPA over the whole sequence (GQA: 4 query heads, 2 key heads; fp32, the same sums with other
    masked entries: 1e-6)."""
    from titan_dmuon.integration.models.attention_clip import load_balanced_order

    g = torch.Generator().manual_seed(0)
    length = 8 * cp
    q, k, v = (torch.randn(2, length, heads, 16, generator=g) for heads in (4, 2, 2))
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    order = load_balanced_order(balancer, cp, length, "cpu")
    part = length // cp
    for rank in range(cp):
        attention = context_parallel.ContextParallelCausalAttention()
        attention.bind(cp_rank=rank, cp_size=cp, load_balancer=balancer)
        mine = order[rank * part : (rank + 1) * part]
        out = attention(q[:, mine], k[:, order], v[:, order], enable_gqa=True)
        torch.testing.assert_close(out, expected[:, mine], rtol=1e-6, atol=1e-6)


def test_max_logits_by_positions_cover_the_whole_sequence():
    """QK-clip's per-head max logit of each cp rank's queries against every rank's keys, masked by
    sequence position, has the whole sequence's causal max as its max over the ranks (GQA)."""
    from titan_dmuon.integration.models.attention_clip import load_balanced_order
    from titan_dmuon.math.qk_clip_factors import max_logits

    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 16, 4, 8, generator=g), torch.randn(2, 16, 2, 8, generator=g)
    order = load_balanced_order("headtail", 2, 16, "cpu")
    parts = [
        max_logits(
            q[:, order[r * 8 : (r + 1) * 8]],
            k[:, order],
            scale=0.5,
            query_positions=order[r * 8 : (r + 1) * 8],
            key_positions=order,
        )
        for r in range(2)
    ]
    torch.testing.assert_close(torch.maximum(*parts), max_logits(q, k, scale=0.5), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="one per row of q"):
        max_logits(q, k, scale=0.5, query_positions=order)
