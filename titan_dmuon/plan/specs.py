"""What the plan is made of: each Muon target as a matrix spec, its tensor-parallel matrices, its entry in
the plan (owner, NS home, owner group), a rank's local TP experts. Plain records, computed from shapes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from titan_dmuon.math.matrix_blocks import Block, block_rows, whole_columns
from titan_dmuon.math.ns_methods import NS_STEPS, ns_flops


def full_shape(shape: Sequence[int], tp_dim: int | None, tp_size: int) -> tuple[int, ...]:
    """The whole matrix of a tensor-parallel shard of ``shape`` split along ``tp_dim`` over ``tp_size``
    ranks (``shape`` itself when ``tp_dim`` is None)."""
    return tuple(n * tp_size if d == tp_dim else n for d, n in enumerate(shape))


@dataclass(frozen=True)
class TPMatrix:
    """One matrix of the Muon step's tensor-parallel exchange as this rank holds it: ``shape`` is its
    shard, split along ``dim`` of the full matrix (0: column-wise parallel, 1: row-wise), or the whole
    matrix when ``dim`` is None (replicated: every TP rank holds it, e.g. a router); ``home`` is the tp
    rank that runs its Newton–Schulz; ``blocks`` are rows of the full matrix and ``col_blocks`` its
    columns: each (row block, column block) pair is one Newton–Schulz matrix."""

    shape: tuple[int, int]
    dim: int | None
    home: int
    blocks: tuple[Block, ...]
    col_blocks: tuple[Block, ...]

    def tiles(self) -> list[tuple[Block, Block]]:
        """The (row block, column block) pairs of the full matrix, row blocks first."""
        return [(rows, cols) for rows in self.blocks for cols in self.col_blocks]

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


def tp_matrices(shape: Sequence[int], tp_dim: int | None, homes: Sequence[int], blocks, col_blocks) -> list[TPMatrix]:
    """The matrices of a TP shard of ``shape`` split along tensor dim ``tp_dim`` (None: replicated): one
    for a 2-D weight, one per expert for a stack ``(E, rows, cols)`` (``tp_dim`` 1 or 2), each with its
    home from ``homes``; ``blocks`` and ``col_blocks`` of the full matrix."""
    matrix = tuple(shape[-2:])
    dim = None if tp_dim is None else tp_dim - (len(shape) - 2)
    return [
        TPMatrix(shape=matrix, dim=dim, home=home, blocks=tuple(blocks), col_blocks=tuple(col_blocks)) for home in homes
    ]


@dataclass(frozen=True, kw_only=True)
class MatrixSpec:
    """One dedicated weight as every rank sees it: name, shape, layer unit, NS row (and column) blocks.

    A weight is a ``(rows, cols)`` matrix or a stack ``(E, rows, cols)`` of E
    independent matrices (MoE experts); ``blocks`` are the row blocks of each matrix,
    ``col_blocks`` its column blocks (() : every column as one block); each (row block,
    column block) pair is one Newton–Schulz matrix.
    """

    fqn: str
    shape: tuple[int, ...]
    unit: int
    blocks: tuple[Block, ...]
    tp_dim: int | None = None
    """Tensor parallelism: the tensor dim that the tp ranks split (0/1 of a matrix, 1/2 of an expert
    stack); ``shape`` is then this rank's TP-local shard, what DMuon broadcasts and reduces;
    ``blocks`` are rows of the full matrix, which Newton–Schulz orthogonalises. None with
    ``tp_size`` > 1: replicated, every tp rank holds the whole weight and a partial sum of its
    gradient."""
    tp_size: int = 1
    col_blocks: tuple[Block, ...] = ()
    groupable: bool = True
    """May be split over an owner group (False: a rule needs the whole matrix on one rank, e.g.
    QK-clip's per-head rescale); only 2-D weights of one NS block without tensor parallelism are."""

    @property
    def column_blocks(self) -> tuple[Block, ...]:
        """The column blocks of each (full) matrix: ``col_blocks``, or every column as one block."""
        return self.col_blocks or whole_columns(self.full_shape)

    @property
    def may_group(self) -> bool:
        """Whether the plan may give it an owner group: a 2-D matrix, one NS block (no row or column
        blocks), no tensor parallelism (a TP home stays one rank), not excluded by a rule (``groupable``)."""
        return (
            self.groupable
            and len(self.shape) == 2
            and len(self.blocks) == 1
            and not self.col_blocks
            and not self.tensor_parallel
        )

    @property
    def tensor_parallel(self) -> bool:
        """Under tensor parallelism: Newton–Schulz on a home rank of the TP group (step exchange)."""
        return self.tp_size > 1

    @property
    def tp_replicated(self) -> bool:
        """Every tp rank holds the whole weight (``tp_dim`` None under tensor parallelism)."""
        return self.tp_size > 1 and self.tp_dim is None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def full_shape(self) -> tuple[int, ...]:
        """The whole matrix (or stack): ``shape`` with the tensor-parallel dim times ``tp_size``."""
        return full_shape(self.shape, self.tp_dim, self.tp_size)

    @property
    def matrices(self) -> int:
        """Matrices in the stack (1 for a 2-D weight)."""
        return self.shape[0] if len(self.shape) == 3 else 1

    def ns_flops(self, ns_steps: int = NS_STEPS) -> int:
        return self.matrices * sum(
            ns_flops(block_rows(b), block_rows(c), ns_steps) for b in self.blocks for c in self.column_blocks
        )


@dataclass(frozen=True, kw_only=True)
class OwnerGroup:
    """The k ranks that own one matrix: member i (global rank ``ranks[i]``; one replicate row,
    consecutive shard indices) keeps the block ``bounds[i]:bounds[i + 1]`` along ``long_dim`` (0: rows
    of a tall matrix, 1: columns of a wide or square one) with its momentum, and runs its part of the
    matrix's Newton–Schulz (``math/group_newton_schulz.py``); ``member_flops`` are those parts' FLOPs."""

    ranks: tuple[int, ...]
    bounds: tuple[int, ...]
    long_dim: int
    member_flops: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.ranks)

    def member(self, rank: int) -> int | None:
        """The block index of global rank ``rank``, or None."""
        return self.ranks.index(rank) if rank in self.ranks else None


@dataclass(frozen=True, kw_only=True)
class PlanEntry(MatrixSpec):
    """A matrix with its owner (global rank r * N + s), or its owner group, and its one-owner NS cost.

    Under tensor parallelism the owner is a data-parallel coordinate: the T ranks (owner, tp =
    0..T-1) hold the T shards (or, replicated, T copies), and ``tp_homes`` has per matrix (per
    expert of a stack) the tp rank that assembles it and runs its Newton–Schulz."""

    owner: int
    ns_flops: int
    tp_homes: tuple[int, ...] = ()
    group: OwnerGroup | None = None
    """An owner group (``owner`` is its first member), or None: ``owner`` alone."""

    def block_numel(self, index: int) -> int:
        """Elements of member ``index``'s block (the whole weight without a group)."""
        if self.group is None:
            return self.numel
        lo, hi = self.group.bounds[index], self.group.bounds[index + 1]
        return (hi - lo) * self.shape[1 - self.group.long_dim]

    def tp_matrices(self) -> list[TPMatrix]:
        return tp_matrices(self.shape, self.tp_dim, self.tp_homes, self.blocks, self.column_blocks)


@dataclass(frozen=True, kw_only=True)
class LocalTPExperts:
    """The experts of a TP-split 3-D weight that FSDP2 keeps on data-parallel rank ``rank`` (dim-0
    shards: ``count`` whole experts from ``first``), with each one's NS home in that rank's TP group."""

    fqn: str
    rank: int
    first: int
    spec: MatrixSpec  # the whole stack as every rank sees it before FSDP2 shards it (TP-local)
    tp_homes: tuple[int, ...]

    def tp_matrices(self) -> list[TPMatrix]:
        return tp_matrices(self.spec.shape, self.spec.tp_dim, self.tp_homes, self.spec.blocks, self.spec.column_blocks)
