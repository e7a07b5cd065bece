"""The units' layout: which dedicated weights each layer's packed buffer holds, in what order and where."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from titan_dmuon.plan.ownership import OwnershipPlan
from titan_dmuon.runtime.members import Bucket, Member, Piece, Segment, pieces_of
from titan_dmuon.runtime.request import Requested
from titan_dmuon.runtime.unit import Unit


# ---- the units ----------------------------------------------------------------------------------------
def layout_unit(index: int, name: str, module: nn.Module, members: list[Member], plan: OwnershipPlan, ctx) -> Unit:
    """Buffer order: the weights with one owner by shard owner (one broadcast segment each), then by global
    owner (one reduce bucket each); then the owner groups' weights (plan order), each block in place: a tall
    weight's row blocks, a wide one's column blocks (the weight laid out column-major, ``Member.column_major``),
    one segment each. Buckets: every piece by (shard owner, global owner)."""
    single = sorted(
        (m for m in members if m.group is None),
        key=lambda m: (plan.shard_owner(m.entry), plan.replicate_owner(m.entry)),
    )
    grouped = [m for m in members if m.group is not None]
    pieces, offset = [], 0
    for m in single + grouped:
        m.offset = offset
        # a block starts at its first row of a row-major weight, at its first column of a column-major one
        across = m.shape[0] if m.column_major else m.shape[-1]
        for piece in pieces_of(m, plan):
            piece.offset = offset + (piece.bounds[0] * across if piece.index is not None else 0)
            pieces.append(piece)
        offset += m.entry.numel
    segments: list[Segment] = []
    for piece in pieces:
        last = segments[-1] if segments else None
        if last and last.shard_owner == piece.shard_owner and last.stop == piece.offset:
            last.stop += piece.numel
        else:
            segments.append(Segment(shard_owner=piece.shard_owner, start=piece.offset, stop=piece.offset + piece.numel))
    by_owner: dict[tuple[int, int], list[Piece]] = {}
    for piece in pieces:
        by_owner.setdefault((piece.shard_owner, piece.replicate_owner), []).append(piece)
    buckets = [Bucket(shard_owner=s, replicate_owner=r, pieces=p) for (s, r), p in by_owner.items()]
    return Unit(
        index=index,
        name=name,
        module=module,
        members=single + grouped,
        pieces=pieces,
        segments=segments,
        buckets=buckets,
        numel=offset,
        ctx=ctx,
    )


def assign_units(module: nn.Module, requested: list[Requested], units: Sequence[nn.Module] | None) -> list[nn.Module]:
    """For each requested parameter, the module whose forward gathers it: the first of ``units``
    that contains it, else its outermost ancestor that is an element of an ``nn.ModuleList`` or
    ``nn.ModuleDict``, else the module that registers it."""
    parent_of: dict[int, nn.Module] = {}
    for mod in module.modules():
        for child in mod.children():
            parent_of[id(child)] = mod

    def ancestors(mod: nn.Module) -> list[nn.Module]:
        chain = [mod]
        while id(chain[-1]) in parent_of:
            chain.append(parent_of[id(chain[-1])])
        return chain

    if units is not None:
        unit_ids = {id(u) for u in units}
        out = []
        for r in requested:
            found = [a for a in ancestors(r.module) if id(a) in unit_ids]
            if not found:
                raise ValueError(f"parameter {r.fqn!r} is not inside any of the given units")
            out.append(found[0])
        return out
    containers = (nn.ModuleList, nn.ModuleDict)
    out = []
    for r in requested:
        in_container = [a for a in ancestors(r.module) if isinstance(parent_of.get(id(a)), containers)]
        out.append(in_container[-1] if in_container else r.module)
    return out
