"""Blocks of a weight that Newton–Schulz treats as matrices of their own: row blocks (fused weights,
per-head blocks), column blocks, and where a tensor-parallel shard's rows and tiles lie.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Block = tuple[tuple[int, int], ...]  # ranges (start, stop) whose rows (of a column block: columns) form one matrix


def row_blocks(shape: Sequence[int], split_rows=None) -> list[Block]:
    """Blocks of rows orthogonalised separately; one block unless a split is given.

    ``split_rows`` is either row counts of consecutive blocks, e.g. ``[q, k, v]``,
    or, for interleaved layouts, one list of ``(start, stop)`` row ranges per
    block. The blocks must cover every row exactly once. A fused q/k/v weight
    split this way gets the same update as separate q, k, v weights.
    """
    return _blocks(shape[0], split_rows, "split_rows", "rows")


def column_blocks(shape: Sequence[int], split_cols=None) -> list[Block]:
    """Blocks of columns orthogonalised separately (e.g. an attention output projection per head:
    each head's ``head_dim`` columns); one block unless a split is given. ``split_cols`` as
    ``row_blocks``' ``split_rows``, over columns. With row blocks too, every (row block, column
    block) pair is one matrix."""
    return _blocks(shape[1], split_cols, "split_cols", "columns")


def _blocks(size: int, split, name: str, what: str) -> list[Block]:
    """``row_blocks``/``column_blocks`` over ``size`` rows or columns."""
    if split is None:
        return [((0, size),)]
    split = list(split)
    if all(isinstance(r, int) for r in split):
        if any(r <= 0 for r in split) or sum(split) != size:
            raise ValueError(f"{name} {split}: {what} counts must be positive and sum to {size}")
        starts = [0]
        for r in split:
            starts.append(starts[-1] + r)
        return [((a, b),) for a, b in zip(starts[:-1], starts[1:])]
    blocks = [tuple((int(a), int(b)) for a, b in block) for block in split]
    covered = sorted(r for block in blocks for r in block)
    position = 0
    for start, stop in covered:
        if start != position or stop <= start:
            raise ValueError(f"{name} blocks must cover {what} 0..{size} exactly once; got {covered}")
        position = stop
    if position != size:
        raise ValueError(f"{name} blocks must cover {what} 0..{size} exactly once; got {covered}")
    return blocks


def block_rows(block: Block) -> int:
    """The rows a row block spans (of a column block: its columns)."""
    return sum(stop - start for start, stop in block)


def whole_columns(shape: Sequence[int]) -> tuple[Block, ...]:
    """The column blocks of a matrix not split by columns: one, every column."""
    return (((0, shape[-1]),),)


def take_rows(matrix: torch.Tensor, block: Block) -> torch.Tensor:
    if len(block) == 1:
        return matrix[block[0][0] : block[0][1]]
    return torch.cat([matrix[start:stop] for start, stop in block])


def take_tile(matrix: torch.Tensor, rows: Block, cols: Block) -> torch.Tensor:
    """The matrix of a (row block, column block) pair: a view where both are one range, else a copy."""
    taken = take_rows(matrix, rows)
    if len(cols) == 1:
        return taken if cols[0] == (0, matrix.shape[-1]) else taken[:, cols[0][0] : cols[0][1]]
    return torch.cat([taken[:, start:stop] for start, stop in cols], dim=1)


def tile_ranges(rows: Block, cols: Block):
    """(rows of the matrix, columns of the matrix, rows of the tile, columns of the tile) of each
    rectangle a (row block, column block) pair is made of."""
    row_offset = 0
    for r0, r1 in rows:
        col_offset = 0
        for c0, c1 in cols:
            yield (
                slice(r0, r1),
                slice(c0, c1),
                slice(row_offset, row_offset + r1 - r0),
                slice(col_offset, col_offset + c1 - c0),
            )
            col_offset += c1 - c0
        row_offset += r1 - r0


def contiguous_tile(matrix: torch.Tensor, rows: Block, cols: Block) -> torch.Tensor:
    """The tile as one contiguous matrix: a view where it is contiguous, else a copy."""
    tile = take_tile(matrix, rows, cols)
    return tile if tile.is_contiguous() else tile.contiguous()


def put_rows(matrix: torch.Tensor, block: Block, rows: torch.Tensor) -> None:
    offset = 0
    for start, stop in block:
        matrix[start:stop].copy_(rows[offset : offset + stop - start])
        offset += stop - start


def put_tile(matrix: torch.Tensor, rows: Block, cols: Block, tile: torch.Tensor) -> None:
    for matrix_rows, matrix_cols, tile_rows, tile_cols in tile_ranges(rows, cols):
        matrix[matrix_rows, matrix_cols].copy_(tile[tile_rows, tile_cols])


def matrix_at(tensor: torch.Tensor, index: int) -> torch.Tensor:
    return tensor[index] if tensor.ndim == 3 else tensor


def local_tiles(
    rows: Block, cols: Block, *, tp_dim: int | None, tp_rank: int, local_shape: Sequence[int]
) -> list[tuple[slice, slice]]:
    """The rectangles of a (row block, column block) pair of the full matrix that one tensor-parallel
    shard of ``local_shape`` holds, in the shard's coordinates: a column-wise shard (``tp_dim`` 0) holds
    a range of rows, a row-wise one (1) a range of columns, a replicated matrix (None) everything."""
    local_rows = local_block_rows(rows, tp_dim=0 if tp_dim == 0 else None, tp_rank=tp_rank, local_rows=local_shape[0])
    local_cols = local_block_rows(cols, tp_dim=0 if tp_dim == 1 else None, tp_rank=tp_rank, local_rows=local_shape[1])
    return [(slice(r0, r1), slice(c0, c1)) for r0, r1, _ in local_rows for c0, c1, _ in local_cols]


def local_block_rows(block: Block, *, tp_dim: int | None, tp_rank: int, local_rows: int) -> list[tuple[int, int, int]]:
    """A full-matrix row block as seen by one tensor-parallel shard: ``(local_start, local_stop,
    offset)`` ranges of the shard's rows, ``offset`` being where they sit in the block's rows. A
    column-wise shard (``tp_dim`` 0) holds rows ``[tp_rank * local_rows, (tp_rank + 1) * local_rows)``
    of the full matrix; a row-wise one (``tp_dim`` 1) and a replicated matrix (None) every row."""
    if tp_dim is None or tp_dim == 1:
        out, offset = [], 0
        for start, stop in block:
            out.append((start, stop, offset))
            offset += stop - start
        return out
    first, last = tp_rank * local_rows, (tp_rank + 1) * local_rows
    out, offset = [], 0
    for start, stop in block:
        lo, hi = max(start, first), min(stop, last)
        if lo < hi:
            out.append((lo - first, hi - first, offset + lo - start))
        offset += stop - start
    return out
