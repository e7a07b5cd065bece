"""What a rank holds of each Muon target: plain records, no behaviour of their own."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from titan_dmuon.muon_math import Block, block_rows, ns_flops, whole_columns
from titan_dmuon.plan import PlanEntry


@dataclass(eq=False)
class Member:
    """One dedicated weight as this rank sees it."""

    entry: PlanEntry
    module: nn.Module  # registers the weight under ``name``
    name: str
    param: nn.Parameter  # the master weight: full on its shard owners, a 0-element placeholder elsewhere
    holds_full: bool  # this rank keeps the full weight between steps (one rank per replicate group)
    runs_ns: bool  # this rank is the global owner: it gets .grad and momentum and runs Newton–Schulz
    unit: int = 0  # index of the unit (layer) whose buffer holds it
    offset: int = 0  # into the unit's packed buffer
    compute: nn.Parameter | None = None  # view of the packed buffer that forward and backward use
    accumulated_grad: torch.Tensor | None = None  # earlier micro-batches' gradients, sync off (reduce dtype)

    @property
    def fqn(self) -> str:
        return self.entry.fqn

    @property
    def numel(self) -> int:
        return self.entry.numel

    @property
    def shape(self) -> tuple[int, ...]:
        return self.entry.shape


@dataclass(eq=False)
class LocalExperts:
    """A 3-D expert weight left to FSDP2 / expert parallelism, sharded on dim 0: every rank
    holds whole experts and runs Muon on them itself (no collective of DMuon's)."""

    fqn: str
    module: nn.Module
    name: str
    blocks: tuple[Block, ...]  # row blocks of each expert's matrix (of the full matrix under tensor parallelism)
    tp_dim: int | None = None  # tensor parallelism splits each expert (dim 1 or 2 of the stack): NS on a TP home
    unit: int = 0  # the layer it belongs to (the index of that layer's unit when it has one)
    col_blocks: tuple[Block, ...] = ()  # column blocks of each expert's matrix (() : every column)

    @property
    def param(self) -> nn.Parameter:
        """The registered parameter now (FSDP2 replaces it by a DTensor parameter)."""
        return self.module._parameters[self.name]

    def expert_flops(self) -> int:
        """NS FLOPs of one expert's matrix."""
        cols = self.col_blocks or whole_columns(self.param.shape)
        return sum(ns_flops(block_rows(b), block_rows(c)) for b in self.blocks for c in cols)


@dataclass(eq=False)
class Bucket:
    """Members of a unit with the same shard owner and the same global owner: one reduce buffer."""

    shard_owner: int
    replicate_owner: int
    members: list[Member]

    @property
    def numel(self) -> int:
        return sum(m.numel for m in self.members)


@dataclass(eq=False)
class Segment:
    """Members of a unit held by one shard index: a contiguous slice of the packed buffer."""

    shard_owner: int
    start: int
    stop: int
    buckets: list[Bucket]
