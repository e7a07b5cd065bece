"""QK-clip (MuonClip) arithmetic: pure functions on tensors, no modules, no communication.

* :func:`max_logits`: the largest pre-softmax logit of each query head, ``scale * q . k`` over
  the causal positions, computed under no_grad in chunks of query positions (the logits of one
  chunk, at most ``chunk_elements`` of them, are alive at a time: never B x H x L x L);
* :func:`clip_factors`: gamma_h = tau / S_h where S_h > tau, else exactly 1;
* :func:`row_factors` / :func:`scale_rows`: a weight's rows scaled by gamma_h ** e, e given per row
  (rows of no head get exactly 1, so they are left bitwise as they were).

The rule (Kimi K2's MuonClip) in exponents per row role (``ROLE_EXPONENT``):
MHA (each query head has its own key head): q rows ``alpha``, k rows ``1 - alpha``; GQA (a key
head shared by several query heads): q rows 1, k rows untouched; MLA: non-rotary q ``alpha``,
non-rotary k ``1 - alpha``, rotary q 1, the shared rotary key untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

CHUNK_ELEMENTS = 1 << 22  # logits alive at a time in max_logits (16 MiB in fp32)
ROLES = ("q", "k", "q_nope", "q_rope", "k_nope")


@torch.no_grad()
def max_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    layout: str = "BLNH",
    chunk_elements: int = CHUNK_ELEMENTS,
    query_positions: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per query head, ``max over batch, i, j<=i of scale * q[b, i, h] . k[b, j, h // G]`` (fp32, [H]).

    ``layout``: "BLNH" (batch, positions, heads, head dim: TorchTitan's inner attention) or "BNLH"
    (SDPA's). GQA: ``k`` has H / G heads, query head h reads key head h // G (SDPA's
    ``enable_gqa``). Causal with more keys than queries aligns the last query with the last key;
    with ``query_positions`` and ``key_positions`` (where each row of q and of k sits in the sequence:
    under context parallelism a rank's part of the queries and every rank's keys) query i reads the
    keys at positions up to its own."""
    if layout == "BLNH":
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    elif layout != "BNLH":
        raise ValueError(f"layout must be 'BLNH' or 'BNLH', got {layout!r}")
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    if k.shape[0] != b or k.shape[3] != d or h % hkv:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} do not fit (B, N, L, H) with N_q a multiple of N_k"
        )
    g = h // hkv
    qg = q.reshape(b, hkv, g, lq, d)
    kt = k.reshape(b, hkv, 1, lk, d).transpose(-1, -2)
    best = torch.full((hkv, g), float("-inf"), dtype=torch.float32, device=q.device)
    rows = max(1, chunk_elements // max(1, b * h * lk))
    positioned = query_positions is not None or key_positions is not None
    if positioned and (
        query_positions is None
        or key_positions is None
        or query_positions.shape != (lq,)
        or key_positions.shape != (lk,)
    ):
        raise ValueError(
            f"query_positions and key_positions must both be given, one per row of q ({lq}) and of k ({lk})"
        )
    offset = lk - lq
    for start in range(0, lq, rows):
        stop = min(lq, start + rows)
        keys = min(lk, stop + offset) if causal and not positioned else lk
        if keys <= 0:
            continue
        logits = torch.matmul(qg[:, :, :, start:stop].float(), kt[..., :keys].float())  # b, hkv, g, rows, keys
        if causal and positioned:
            logits.masked_fill_(key_positions[None, :] > query_positions[start:stop, None], float("-inf"))
        elif causal:
            i = torch.arange(start, stop, device=q.device)[:, None]
            j = torch.arange(keys, device=q.device)[None, :]
            logits.masked_fill_(j > i + offset, float("-inf"))
        torch.maximum(best, logits.amax(dim=(0, 3, 4)), out=best)
    # scale > 0 and rounding is monotone: max(fl(scale * x)) == fl(scale * max(x))
    return best.reshape(h) * scale


def clip_factors(max_logit: torch.Tensor, threshold: float) -> torch.Tensor:
    """gamma = tau / S where S > tau, else exactly 1 (S = -inf: no logit seen; NaN: left alone)."""
    return torch.where(max_logit > threshold, threshold / max_logit, torch.ones_like(max_logit))


def role_exponent(role: str, *, alpha: float, shared_keys: bool) -> float | None:
    """The power of gamma a row of this role is scaled by, or None where it is left untouched.
    ``shared_keys``: GQA (a key head serves several query heads)."""
    if role not in ROLES:
        raise ValueError(f"unknown row role {role!r}; expected one of {ROLES}")
    if role == "q":
        return 1.0 if shared_keys else alpha
    if role == "k":
        return None if shared_keys else 1.0 - alpha
    return {"q_nope": alpha, "q_rope": 1.0, "k_nope": 1.0 - alpha}[role]


def row_map(
    rows: int, parts: Sequence[tuple[Sequence[Sequence[tuple[int, int]]], float | None]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(head, exponent) per row of a ``rows``-row weight: ``parts`` lists, per role, its row ranges
    per query head and its exponent (None: untouched). Rows of no head: head -1, exponent 0."""
    head = torch.full((rows,), -1, dtype=torch.int64)
    exponent = torch.zeros(rows, dtype=torch.float32)
    for ranges_per_head, e in parts:
        if e is None:
            continue
        for h, ranges in enumerate(ranges_per_head):
            for start, stop in ranges:
                if not 0 <= start < stop <= rows:
                    raise ValueError(f"row range ({start}, {stop}) outside a weight of {rows} rows")
                if (head[start:stop] >= 0).any():
                    raise ValueError(f"row range ({start}, {stop}) given twice")
                head[start:stop] = h
                exponent[start:stop] = e
    return head, exponent


def row_factors(gamma: torch.Tensor, head: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """Per row ``gamma[head] ** exponent``; exactly 1 on rows of no head and where gamma is 1."""
    g = gamma[head.clamp(min=0)]
    return torch.where(head >= 0, torch.pow(g, exponent), torch.ones_like(g))


@torch.no_grad()
def scale_rows(weight: torch.Tensor, gamma: torch.Tensor, head: torch.Tensor, exponent: torch.Tensor) -> None:
    """In place: each row of ``weight`` times its factor (x * 1.0 is x bitwise: unclipped rows stay)."""
    weight.mul_(row_factors(gamma, head, exponent).to(weight.dtype)[:, None])
