"""A pipeline stage's weights as DMuon splits them on a layout: TP-local shapes, FSDP2's dim-0 chunks, the
runtime's mode (sizes only), which experts stay where they are, each dedicated weight's matrix spec.
Shared by the plans (``plans.py``) and the memory and traffic figures (``figures.py``)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from titan_dmuon.math.matrix_blocks import block_rows
from titan_dmuon.math.ns_methods import ns_flops
from titan_dmuon.plan.specs import MatrixSpec
from titan_dmuon.runtime.mode import DedicationMode, MeshInfo, TensorParallelInfo
from titan_dmuon.sizing.records import Layout, Weight


def local_shape(w: Weight, layout: Layout) -> tuple[int, ...]:
    """This rank's TP-local shape (expert parallelism keeps experts whole: TP folds into it)."""
    if layout.tp == 1 or w.tp_dim is None or (w.experts and layout.ep > 1):
        return w.shape
    return tuple(-(-n // layout.tp) if d == w.tp_dim else n for d, n in enumerate(w.shape))


def chunk_rows(total: int, chunks: int) -> list[int]:
    """torch.chunk's rows per chunk (ceil-sized, the last ones fewer or none): FSDP2's dim-0 shards."""
    size = -(-total // chunks)
    return [max(0, min(size, total - i * size)) for i in range(chunks)]


def layer_groups(weights: Sequence[Weight], numel) -> tuple[int, list[int]]:
    """Elements of the weights outside layers, and of each layer in order (``numel(weight)``)."""
    root, layers = 0, {}
    for w in weights:
        if w.layer is None:
            root += numel(w)
        else:
            layers[w.layer] = layers.get(w.layer, 0) + numel(w)
    return root, [layers[k] for k in sorted(layers)]


def dedication_mode(layout: Layout, *, reshard_after_forward: bool) -> DedicationMode:
    """The runtime's mode for the cost model: sizes only (no process groups are needed to count)."""
    replicate, shard = (1, layout.replicate) if layout.ddp else (layout.replicate, layout.shard)
    mesh = MeshInfo(
        mesh=None,
        shard_group=None,
        shard_size=shard,
        shard_rank=0,
        replicate_group=None,
        replicate_size=replicate,
        replicate_rank=0,
        device=torch.device("cpu"),
    )
    tp = TensorParallelInfo(mesh=None, group=None, size=layout.tp, rank=0) if layout.tp > 1 else None
    return DedicationMode(mesh=mesh, reshard_after_forward=reshard_after_forward and not layout.ddp, tp=tp)


def stays_local(w: Weight, layout: Layout) -> bool:
    """The runtime's rule (``DedicationMode.experts_stay_local``, "auto"): experts stay where FSDP2 or
    expert parallelism keeps them whole when there are at least as many as data-parallel ranks."""
    return bool(w.experts) and (
        layout.ep > 1 or dedication_mode(layout, reshard_after_forward=True).experts_stay_local(w.experts)
    )


def matrix_spec(w: Weight, layout: Layout, unit: int, keep_whole: Sequence[str] = ()) -> MatrixSpec:
    """The spec ``dedicate_params`` makes of ``w``; ``keep_whole`` (regexes, as ``dedicate_params``'s
    ``keep_whole``): weights that keep one owner whatever the owner groups' cost model says."""
    local = local_shape(w, layout)
    full = w.shape[-2:]
    blocks = w.blocks or (((0, full[0]),),)
    split = layout.tp > 1 and not (w.experts and layout.ep > 1)
    return MatrixSpec(
        fqn=w.fqn,
        shape=local,
        unit=unit,
        blocks=blocks,
        tp_dim=w.tp_dim if split else None,
        tp_size=layout.tp if split else 1,
        groupable=not any(re.search(pattern, w.fqn) for pattern in keep_whole),
    )


def one_expert(w: Weight) -> int:
    """One expert's Newton–Schulz FLOPs (each runs whole on one rank, or under TP on one home)."""
    return sum(ns_flops(block_rows(b), w.shape[-1]) for b in (w.blocks or (((0, w.shape[-2]),),)))


@dataclass(frozen=True, kw_only=True)
class StageWeights:
    """A stage's weights as DMuon splits them, on the layout."""

    layout: Layout
    all: list[Weight]
    dedicated: list[Weight]  # Muon targets with one owner (or one owner group) each
    local: list[Weight]  # routed-expert stacks updated where FSDP2 / expert parallelism keeps them
    others: list[Weight]  # AdamW's, under FSDP2

    @classmethod
    def of(cls, weights: Sequence[Weight], layout: Layout) -> StageWeights:
        local = [w for w in weights if w.muon and stays_local(w, layout)]
        return cls(
            layout=layout,
            all=list(weights),
            dedicated=[w for w in weights if w.muon and w not in local],
            local=local,
            others=[w for w in weights if not w.muon],
        )

    def numel(self, w: Weight) -> int:
        return math.prod(local_shape(w, self.layout))

    def unit_sizes(self) -> list[int]:
        """Elements of each layer's packed buffer (its dedicated weights, TP-local), in layer order."""
        return layer_groups(self.dedicated, self.numel)[1]

    def units(self) -> dict[int, int]:
        """{layer: its unit index} of the dedicated weights (weights outside layers: the last unit)."""
        return {layer: u for u, layer in enumerate(sorted({w.layer for w in self.dedicated if w.layer is not None}))}
