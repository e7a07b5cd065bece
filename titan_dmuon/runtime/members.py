"""What a rank holds of each Muon target: plain records, no behaviour of their own."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from titan_dmuon.math.matrix_blocks import Block, block_rows, whole_columns
from titan_dmuon.math.ns_methods import ns_flops
from titan_dmuon.plan.ownership import OwnershipPlan
from titan_dmuon.plan.specs import OwnerGroup, PlanEntry


@dataclass(eq=False)
class Member:
    """One dedicated weight as this rank sees it."""

    entry: PlanEntry
    module: nn.Module  # registers the weight under ``name``
    name: str
    param: nn.Parameter  # the master weight: full on its shard owners (an owner group's member: its block),
    # a 0-element placeholder elsewhere
    holds_full: bool  # this rank keeps the full weight between steps (one rank per replicate group)
    runs_ns: bool  # this rank is the global owner (a member of the owner group): it gets .grad and momentum
    # (of its block) and runs Newton–Schulz (its part)
    unit: int = 0  # index of the unit (layer) whose buffer holds it
    offset: int = 0  # into the unit's packed buffer
    compute: nn.Parameter | None = None  # view of the packed buffer that forward and backward use
    accumulated_grad: torch.Tensor | None = None  # earlier micro-batches' gradients, sync off (reduce dtype)
    block: int | None = None  # owner groups: the block of the weight this rank keeps between steps, else None
    group_ranks: tuple[int, ...] = ()  # owner groups, on the members: the group's ranks in the default group

    @property
    def fqn(self) -> str:
        return self.entry.fqn

    @property
    def group(self) -> OwnerGroup | None:
        return self.entry.group

    @property
    def holds(self) -> bool:
        """Keeps the weight between steps: whole, or its block of an owner group."""
        return self.holds_full or self.block is not None

    @property
    def numel(self) -> int:
        return self.entry.numel

    @property
    def shape(self) -> tuple[int, ...]:
        return self.entry.shape

    @property
    def column_major(self) -> bool:
        """A wide weight split over an owner group by column blocks: laid out column-major in the unit's
        buffer (its compute param a transposed view), so each column block is one contiguous range."""
        return self.group is not None and self.group.long_dim == 1


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
class Piece:
    """What one shard index keeps of a dedicated weight: the whole weight, or one block of its owner
    group (rows of a tall matrix, columns of a wide one). A unit broadcasts each piece from its shard
    owner before the layer runs and reduces its gradient to it (and on to its global owner) after.

    ``offset``: where the piece's broadcast lands in the unit's packed buffer, inside the weight's own
    region (a column block is contiguous there too: its weight is laid out column-major)."""

    member: Member
    index: int | None  # its block of the owner group; None: the whole weight
    shard_owner: int
    replicate_owner: int
    offset: int = 0

    @property
    def bounds(self) -> tuple[int, int]:
        """A block's range along the long side."""
        return self.member.group.bounds[self.index], self.member.group.bounds[self.index + 1]

    @property
    def columns(self) -> bool:
        """A column block of a wide weight."""
        return self.index is not None and self.member.column_major

    @property
    def shape(self) -> tuple[int, ...]:
        if self.index is None:
            return self.member.shape
        lo, hi = self.bounds
        rows, cols = self.member.shape
        return (hi - lo, cols) if self.member.group.long_dim == 0 else (rows, hi - lo)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def of(self, full: torch.Tensor) -> torch.Tensor:
        """The piece's view of a tensor shaped as the whole weight (its rows, or its columns)."""
        if self.index is None:
            return full
        lo, hi = self.bounds
        return full[lo:hi] if self.member.group.long_dim == 0 else full[:, lo:hi]

    def in_buffer(self, buffer: torch.Tensor) -> torch.Tensor:
        """The piece's place in its unit's packed buffer, shaped as the piece (a column block: a transposed
        view of its contiguous range)."""
        flat = buffer[self.offset : self.offset + self.numel]
        if self.columns:
            rows, cols = self.shape
            return flat.view(cols, rows).t()
        return flat.view(self.shape)


@dataclass(eq=False)
class Bucket:
    """Pieces of a unit with the same shard owner and the same global owner: one reduce buffer."""

    shard_owner: int
    replicate_owner: int
    pieces: list[Piece]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.pieces)


@dataclass(eq=False)
class Segment:
    """A contiguous range of the unit's packed buffer that one shard index holds: one broadcast."""

    shard_owner: int
    start: int
    stop: int


def pieces_of(member: Member, plan: OwnershipPlan) -> list[Piece]:
    """What each shard index keeps of ``member``'s weight: the whole weight (one owner), or each block
    of its owner group in block order (offsets unset)."""
    entry = member.entry
    if entry.group is None:
        return [
            Piece(
                member=member,
                index=None,
                shard_owner=plan.shard_owner(entry),
                replicate_owner=plan.replicate_owner(entry),
            )
        ]
    return [
        Piece(member=member, index=i, shard_owner=rank % plan.shard_size, replicate_owner=rank // plan.shard_size)
        for i, rank in enumerate(entry.group.ranks)
    ]
