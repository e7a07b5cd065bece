"""``runtime/replica_sync.py`` on the fake process group: after an update, each unit's held weights go
from their global owner to its replicate peers, in place, one launch per unit; nothing without HSDP."""

from fractions import Fraction

from tests.support.runtime_parts import fake_pg, runtime_parts
from titan_dmuon.runtime.comm import CommLabel


def _replica_broadcasts(world, hsdp):
    """This rank (global rank 0: replicate 0, shard 0) broadcasts every unit once: what each launch
    sent (source rank in the replicate group, the tensor's storage) and what the counts say."""
    from titan_dmuon.runtime.comm import Launch

    with fake_pg(world):
        parts = runtime_parts(world, hsdp=hsdp, allocate=False)
        ctx, sent = parts.ctx, []
        real = Launch.broadcast

        def recording(self, tensor, src):
            sent.append((src, tensor.untyped_storage().data_ptr()))
            real(self, tensor, src)

        Launch.broadcast = recording
        try:
            for unit in ctx.units:
                ctx.replicas.broadcast(unit, source=CommLabel.REPLICATE_BROADCAST)
            ctx.replicas.wait_all()
        finally:
            Launch.broadcast = real
        mesh = parts.mode.mesh
        held = [
            (b.replicate_owner, p.member.param.untyped_storage().data_ptr(), p.numel)
            for u in ctx.units
            for b in u.buckets
            if b.shard_owner == mesh.shard_rank
            for p in b.pieces
        ]
        units_holding = sum(any(s.shard_owner == mesh.shard_rank for s in u.segments) for u in ctx.units)
        return sent, held, units_holding, mesh.replicate_size, ctx.stats.pop()


def _replica_broadcasts_on_fake_pg(rank, world, fake_world, hsdp):
    return _replica_broadcasts(fake_world, hsdp)


def test_hsdp_broadcasts_each_held_weight_from_its_global_owner_in_place(solo):
    """HSDP 2 x 2: every weight this rank holds (its shard index's), from the replicate rank that ran
    its Newton-Schulz, straight from the persistent weight (no staging copy); one launch per unit that
    holds any; (R-1)/R of the held elements counted under the replicate label."""
    sent, held, units_holding, replicas, stats = solo.run(_replica_broadcasts_on_fake_pg, 4, True)[0]
    assert sent == [(owner, storage) for owner, storage, _ in held]
    assert {owner for owner, _, _ in held} == {0, 1}  # both replicate ranks own some: the source matters
    elements = Fraction(replicas - 1, replicas) * sum(numel for _, _, numel in held)
    assert stats == {CommLabel.REPLICATE_BROADCAST: (elements, 4 * elements, units_holding)}
    assert units_holding > 0


def test_without_hsdp_there_is_no_replica_to_send_to(solo):
    sent, _, _, _, stats = solo.run(_replica_broadcasts_on_fake_pg, 4, False)[0]
    assert sent == [] and stats == {}
