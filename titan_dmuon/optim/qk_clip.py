"""QK-clip (MuonClip) for DMuon: what the model tells DMuon, and the runtime that applies it.

``QKClipAttention`` describes one attention module: where its post-RoPE q and k can be seen
(``capture``: a submodule called as ``capture(q, k, v, ..., scale=...)``, e.g. TorchTitan's
``inner_attention``), its heads, and which rows of which weights hold each head's q (and k).
Build one per layer with :meth:`QKClipAttention.separate` (wq, wk), :meth:`QKClipAttention.fused`
(one wqkv) or :meth:`QKClipAttention.mla` (DeepSeek's multi-head latent attention), and give the
list to ``DMuon(..., qk_clip_threshold=tau, qk_clip_attention=[...])``.

``QKClip`` (built by DMuon):

* capture: a forward hook on each ``capture`` module (eager, dynamo-disabled, under no_grad: the
  loss and gradients are untouched) folds the call's per-head max logit into a running
  [layers x heads] max on the device, over every micro-batch of the step. It runs once per
  forward: not again in an activation-checkpoint recompute (the forward captured those logits;
  a reentrant checkpoint's forward runs under no_grad, so its recompute is captured instead),
  not under no_grad (evaluation), and outside the dispatch modes in effect, so that a
  selectively checkpointed region records what it records without the clip;
* step: at the start of ``DMuon.step`` one async MAX all-reduce per dedication handle of its
  [layers x heads] maxima over the handle's data-parallel ranks (HSDP: the shard group, then the
  replicate group; pipelining: each stage's own handle), waited before the first rescale;
* rescale: after a unit's Muon update and before the handle sends it on, the owner of each q/k
  weight (``member.runs_ns``) multiplies its rows by gamma_h ** e (``math/qk_clip_factors.py``), computed on
  the device: no host sync, unclipped heads multiplied by exactly 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from titan_dmuon.math.qk_clip_factors import clip_factors, max_logits, role_exponent, row_map, scale_rows

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True, eq=False)
class QKRows:
    """The rows of ``param`` that hold one role (``qk_clip_factors.ROLES``) of each query head:
    ``heads[h]`` is a tuple of ``(start, stop)`` row ranges."""

    param: nn.Parameter
    role: str
    heads: tuple[Ranges, ...]


@dataclass(frozen=True, eq=False)
class SequenceShards:
    """Context parallelism as QK-clip sees it: every rank of ``group`` holds a part of each sequence
    and its capture module sees that part's q and k. ``order(length, device)``: the position in the
    sequence of each row of the ranks' parts laid end to end in rank order (an int tensor of
    ``length``; TorchTitan's head-tail load balancer puts chunks r and 2W-1-r of 2W on rank r).
    Each call's capture gathers k over ``group`` (no grad, one all-gather per attention layer and
    forward) and takes this rank's queries against every key at or before their positions; the
    step's MAX over the handle's data-parallel ranks, which include ``group``, completes the max."""

    group: dist.ProcessGroup
    order: Callable[[int, torch.device], torch.Tensor]
    rank: int = dataclasses.field(init=False)
    size: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rank", dist.get_rank(self.group))
        object.__setattr__(self, "size", dist.get_world_size(self.group))

    def gather(self, q: torch.Tensor, k: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(every rank's k, laid end to end in rank order; this rank's query positions; the key positions)."""
        seq_dim = 1 if layout == "BLNH" else 2
        parts = k.new_empty((self.size * k.shape[0], *k.shape[1:]))  # (ranks x batch): gathered along dim 0
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (the name before torch 2.13)
        gather(parts, k.contiguous(), group=self.group)
        keys = torch.cat(parts.view(self.size, *k.shape).unbind(0), dim=seq_dim)
        local = q.shape[seq_dim]
        order = self.order(keys.shape[seq_dim], q.device)
        return keys, order[self.rank * local : (self.rank + 1) * local], order


@dataclass(frozen=True, eq=False)
class QKClipAttention:
    """One attention module as QK-clip sees it.

    ``capture``: the module whose forward receives the post-RoPE ``q, k`` as its first two
    arguments (``layout`` "BLNH": batch, positions, heads, head dim; or "BNLH") and the softmax
    scale as the keyword ``scale`` (None or absent: ``head_dim ** -0.5``). Causal attention.
    ``rows``: where each head's q (and k) rows are; the weights must be dedicated (DMuon's).
    ``sequence``: under context parallelism, where the capture module's rows sit in the sequence."""

    capture: nn.Module
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rows: tuple[QKRows, ...]
    layout: str = "BLNH"
    causal: bool = True
    name: str = ""
    sequence: SequenceShards | None = None  # context parallelism: the capture sees a part of each sequence

    def __post_init__(self) -> None:
        if not isinstance(self.capture, nn.Module):
            raise TypeError(
                f"QKClipAttention.capture must be an nn.Module (the inner attention), got {type(self.capture).__name__}"
            )
        if self.n_heads < 1 or self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a positive multiple of n_kv_heads ({self.n_kv_heads})")
        object.__setattr__(self, "rows", tuple(self.rows))
        for part in self.rows:
            if len(part.heads) != self.n_heads:
                raise ValueError(f"{part.role} rows: {len(part.heads)} heads given, the attention has {self.n_heads}")

    @property
    def shared_keys(self) -> bool:
        """GQA: a key head serves several query heads."""
        return self.n_kv_heads < self.n_heads

    @classmethod
    def separate(cls, capture, *, wq, wk, n_heads, n_kv_heads=None, head_dim, name="", layout="BLNH"):
        """q and k projections of their own, rows head-major (head h: rows h*head_dim to (h+1)*head_dim);
        with fewer key heads than query heads (GQA) ``wk`` is left untouched."""
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        q = QKRows(wq, "q", tuple(((h * head_dim, (h + 1) * head_dim),) for h in range(n_heads)))
        rows = [q]
        if n_kv_heads == n_heads:
            rows.append(QKRows(wk, "k", q.heads))
        return cls(capture, n_heads, n_kv_heads, head_dim, tuple(rows), layout=layout, name=name)

    @classmethod
    def fused(cls, capture, *, wqkv, n_heads, n_kv_heads=None, head_dim, grouped=True, name="", layout="BLNH"):
        """One fused q/k/v weight. ``grouped`` (TorchTitan's FusedQKVLinear): rows are
        ``[kv group][its n_heads/n_kv_heads q heads, 1 k head, 1 v head][head_dim]``; else
        ``[all q heads | all k heads | all v heads]``, each head-major."""
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        hpk, hd = n_heads // n_kv_heads, head_dim
        if grouped:
            r = hpk + 2
            q_heads = tuple(
                ((g * r * hd + j * hd, g * r * hd + (j + 1) * hd),) for g in range(n_kv_heads) for j in range(hpk)
            )
            k_heads = tuple(
                ((g * r * hd + hpk * hd, g * r * hd + (hpk + 1) * hd),) for g in range(n_kv_heads) for _ in range(hpk)
            )
        else:
            q_heads = tuple(((h * hd, (h + 1) * hd),) for h in range(n_heads))
            k_base = n_heads * hd
            k_heads = tuple(((k_base + (h // hpk) * hd, k_base + (h // hpk + 1) * hd),) for h in range(n_heads))
        rows = [QKRows(wqkv, "q", q_heads)]
        if n_kv_heads == n_heads:
            rows.append(QKRows(wqkv, "k", k_heads))
        return cls(capture, n_heads, n_kv_heads, head_dim, tuple(rows), layout=layout, name=name)

    @classmethod
    def mla(
        cls, capture, *, wq, wkv_b, n_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, name="", layout="BLNH"
    ):
        """DeepSeek-V3's multi-head latent attention (TorchTitan's layout): ``wq`` (or ``wq_b``) rows
        per head [nope | rope], ``wkv_b`` rows per head [k nope | v]; the shared rotary key comes
        from ``wkv_a`` and is left untouched, as v."""
        nope, qk = qk_nope_head_dim, qk_nope_head_dim + qk_rope_head_dim
        kv = nope + v_head_dim
        rows = (
            QKRows(wq, "q_nope", tuple(((h * qk, h * qk + nope),) for h in range(n_heads))),
            QKRows(wq, "q_rope", tuple(((h * qk + nope, (h + 1) * qk),) for h in range(n_heads))),
            QKRows(wkv_b, "k_nope", tuple(((h * kv, h * kv + nope),) for h in range(n_heads))),
        )
        return cls(capture, n_heads, n_heads, qk, rows, layout=layout, name=name)


@dataclass(eq=False)
class _Weight:
    """One q/k weight this rank owns (runs Newton–Schulz for): its row map on the device."""

    param: nn.Parameter
    slot: int  # the attention's row in its handle's [layers x heads] table
    head: torch.Tensor
    exponent: torch.Tensor


@dataclass(eq=False)
class _HandleClip:
    """The attention layers of one dedication handle (a model part / pipeline stage)."""

    handle: object
    attentions: list[QKClipAttention]
    running: torch.Tensor  # [layers x heads], the step's running max (fp32, -inf: nothing seen)
    # per layer: forwards captured whose activation-checkpoint recompute has not come yet
    captured: list[int] = dataclasses.field(default_factory=list)
    weights_by_unit: dict[int, list[_Weight]] = dataclasses.field(default_factory=dict)
    reduced: torch.Tensor | None = None
    work: object = None
    gamma: torch.Tensor | None = None


# the keys of ``QKClip.stats`` (in ``DMuon.last_step_stats``)
MAX_LOGIT_STAT = "qk_max_logit"
CLIPPED_HEADS_STAT = "qk_clipped_heads"


class QKClip:
    """The capture hooks and the per-step rescale; DMuon builds and drives it."""

    def __init__(
        self, attentions: Sequence[QKClipAttention], handles: Sequence, *, threshold: float, alpha: float
    ) -> None:
        attentions = list(attentions)
        if not attentions:
            raise ValueError(
                "qk_clip_threshold is set but no attention layer was described: "
                "pass qk_clip_attention=[QKClipAttention...] "
                "(TorchTitan: built from the model; see docs/qk-clip.md)"
            )
        self.threshold, self.alpha = float(threshold), float(alpha)
        by_handle: dict[int, _HandleClip] = {}
        placed: list[tuple[_HandleClip, int, QKClipAttention]] = []
        for attention in attentions:
            if not isinstance(attention, QKClipAttention):
                raise TypeError(f"qk_clip_attention takes QKClipAttention objects, got {type(attention).__name__}")
            owners = {id(_handle_of(part.param, handles, attention)) for part in attention.rows}
            if len(owners) != 1:
                raise ValueError(
                    f"attention {attention.name!r}: its q/k weights are in different dedicate_params handles"
                )
            handle = _handle_of(attention.rows[0].param, handles, attention)
            entry = by_handle.get(id(handle))
            if entry is None:
                entry = by_handle[id(handle)] = _HandleClip(handle, [], torch.empty(0))
            placed.append((entry, len(entry.attentions), attention))
            entry.attentions.append(attention)
        self._clips = list(by_handle.values())
        self._capturing = [True]  # (shared with the hooks: paused() turns it off)
        self._hooks = []
        for clip in self._clips:
            heads = max(a.n_heads for a in clip.attentions)
            clip.running = torch.full((len(clip.attentions), heads), float("-inf"), device=clip.handle.mode.mesh.device)
            clip.captured = [0] * len(clip.attentions)
        for clip, slot, attention in placed:
            self._hooks.append(
                attention.capture.register_forward_hook(
                    functools.partial(_capture, self._capturing, clip, slot, attention), with_kwargs=True
                )
            )
            for param, parts in _parts_by_param(attention, self.alpha).items():
                member = clip.handle.member_of(param)
                if member.group is not None:  # (every rank: the plan is the same everywhere)
                    raise ValueError(
                        f"QK-clip rescales {member.fqn!r} by rows of heads on its owner, but the plan split it over "
                        f"an owner group of {member.group.size} ranks: pass the attention's q/k weights in "
                        "dedicate_params(..., keep_whole=...) (or owner_groups=None)"
                    )
                if not member.runs_ns:
                    continue  # another rank rescales it; this one receives it by the broadcast
                head, exponent = row_map(member.shape[0], parts)
                device = clip.running.device
                clip.weights_by_unit.setdefault(member.unit, []).append(
                    _Weight(param, slot, head.to(device), exponent.to(device))
                )
        self._max_logit: torch.Tensor | None = None
        self._clipped: torch.Tensor | None = None

    @contextlib.contextmanager
    def paused(self):
        """Forwards inside are not the step's training batch and are not captured: e.g.
        torch.distributed.pipelining's metadata inference, which runs a later stage's forward on
        uninitialised tensors (``torch.empty``) at the first step (see
        ``integration.training.attention_clip.pause_capture_in_metadata_inference``), and the backward
        of such a forward (its recomputes of checkpointed blocks would count as a reentrant checkpoint's)."""
        previous, self._capturing[0] = self._capturing[0], False
        try:
            yield
        finally:
            self._capturing[0] = previous

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def start(self) -> None:
        """Start each handle's MAX all-reduce of the step's maxima, and reset the running max."""
        for clip in self._clips:
            clip.reduced = clip.running.clone()
            clip.running.fill_(float("-inf"))
            clip.captured = [0] * len(clip.attentions)
            clip.gamma = None
            mesh = clip.handle.mode.mesh
            clip.work = (
                dist.all_reduce(clip.reduced, op=dist.ReduceOp.MAX, group=mesh.shard_group, async_op=True)
                if mesh.shard_size > 1
                else None
            )

    def _gamma(self, clip: _HandleClip) -> torch.Tensor:
        if clip.gamma is None:
            if clip.work is not None:
                clip.work.wait()
                clip.work = None
            mesh = clip.handle.mode.mesh
            if mesh.hsdp and mesh.replicate_size > 1:
                dist.all_reduce(clip.reduced, op=dist.ReduceOp.MAX, group=mesh.replicate_group)
            clip.gamma = clip_factors(clip.reduced, self.threshold)
        return clip.gamma

    def handles(self) -> list:
        return [clip.handle for clip in self._clips]

    @torch.no_grad()
    def rescale(self, handle, unit_index: int) -> None:
        """Scale the q/k rows this rank owns in ``unit_index`` of ``handle`` (after their update)."""
        for clip in self._clips:
            if clip.handle is not handle:
                continue
            # every rank waits at its handle's first unit, whatever it owns: under HSDP the wait
            # includes the replicate group's all-reduce, which must come at the same point on every rank
            gamma = self._gamma(clip)
            weights = clip.weights_by_unit.get(unit_index)
            if not weights:
                continue
            for w in weights:
                scale_rows(w.param, gamma[w.slot], w.head, w.exponent)

    def finish(self) -> None:
        """After the step: the step's figures (device tensors), every reduce waited."""
        maxima, clipped = [], []
        for clip in self._clips:
            self._gamma(clip)
            top, count = clip.reduced.max().reshape(1), (clip.reduced > self.threshold).sum().reshape(1)
            tp = clip.handle.mode.tp
            if tp is not None:  # each tensor-parallel rank clips its own heads: the figures over the TP group
                dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp.group)
                dist.all_reduce(count, op=dist.ReduceOp.SUM, group=tp.group)
            maxima.append(top[0])
            clipped.append(count[0])
        self._max_logit = torch.stack(maxima).max()
        self._clipped = torch.stack(clipped).sum()

    def max_logits_by_layer(self) -> dict[str, torch.Tensor]:
        """The last step's S per query head before clipping, by attention name (copies on the
        device; this rank's heads under tensor parallelism)."""
        return {
            attention.name: clip.reduced[slot, : attention.n_heads].clone()
            for clip in self._clips
            if clip.reduced is not None
            for slot, attention in enumerate(clip.attentions)
        }

    def stats(self) -> dict[str, float]:
        """The last step's largest logit before clipping and heads clipped (reads the device)."""
        if self._max_logit is None:
            return {}
        return {MAX_LOGIT_STAT: float(self._max_logit.item()), CLIPPED_HEADS_STAT: int(self._clipped.item())}


def _handle_of(param, handles, attention: QKClipAttention):
    for handle in handles:
        if handle.member_of(param) is not None:
            return handle
        if handle.local_expert_of(param) is not None:
            break
    raise ValueError(
        f"QK-clip: a q/k weight of attention {attention.name or '?'} (shape {tuple(param.shape)}) is not a dedicated "
        "weight of DMuon: the clip rescales q/k rows on the weight's owner after its Muon update, so each q/k weight "
        "must be given to dedicate_params (not left to AdamW / FSDP2)"
    )


def _parts_by_param(attention: QKClipAttention, alpha: float) -> dict:
    out: dict = {}
    for part in attention.rows:
        e = role_exponent(part.role, alpha=alpha, shared_keys=attention.shared_keys)
        out.setdefault(part.param, []).append((part.heads, e))
    return out


def _counts(clip: _HandleClip, slot: int) -> bool:
    """Whether this call of layer ``slot``'s attention is captured: once per forward of the step's
    training batch. Under no_grad it is evaluation, or a reentrant checkpoint's forward (whose
    recompute, inside backward with grad enabled, is then the one captured). Inside backward it is
    an activation-checkpoint recompute: of a forward captured already (non-reentrant, TorchTitan's:
    skipped, so full AC costs one capture), or else of a reentrant checkpoint's."""
    if not torch.is_grad_enabled():
        return False
    if torch._C._current_graph_task_id() == -1:
        clip.captured[slot] += 1
        return True
    if clip.captured[slot] > 0:
        clip.captured[slot] -= 1
        return False
    return True


@torch._dynamo.disable(recursive=True, reason="DMuon's QK-clip capture runs eagerly")
def _capture(
    capturing: list, clip: _HandleClip, slot: int, attention: QKClipAttention, module, args, kwargs, output
) -> None:
    if not capturing[0] or not _counts(clip, slot):
        return
    q, k = (args[0], args[1]) if len(args) >= 2 else (kwargs.get("q", args[0] if args else None), kwargs.get("k"))
    if q is None or k is None:
        raise RuntimeError(
            f"QK-clip: the capture module of attention {attention.name!r} got no q and k positional arguments"
        )
    scale = kwargs.get("scale")
    scale = attention.head_dim**-0.5 if scale is None else float(scale)
    # outside the dispatch modes in effect (selective activation checkpointing's caching mode): the
    # checkpointed region records the model's ops only, not the capture's logits
    with torch.no_grad(), _disable_current_modes():
        q, k, positions = _plain(q), _plain(k), {}
        if attention.sequence is not None and attention.sequence.size > 1:
            k, positions["query_positions"], positions["key_positions"] = attention.sequence.gather(
                q, k, attention.layout
            )
        m = max_logits(q, k, scale=scale, causal=attention.causal, layout=attention.layout, **positions)
        row = clip.running[slot, : m.shape[0]]
        torch.maximum(row, m, out=row)


def _plain(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    t = t.detach()
    return t.to_local() if isinstance(t, DTensor) else t
