"""``runtime/initialise.py`` on the fake process group: while a module initialises, each dedicated
weight has the form FSDP2 (or DDP) would give it, decided from the mode (HSDP: replicated across the
replicas); on exit the owners keep the values drawn, the other ranks their placeholders."""

import torch
from torch import nn

from tests.support.runtime_parts import fake_pg, runtime_parts


def _stand_ins(world, hsdp, *, sharded, shard_dim=None, replicated_layout=False):
    """The stand-ins seen inside ``initialising`` (placements, local and global shapes) for every
    dedicated weight of the toy model; each is filled with its index + 1, then what the owners kept.
    ``shard_dim``: FSDP2's dim for every weight; ``replicated_layout``: a ``layout`` that replicates."""
    from torch.distributed.tensor import DTensor, Replicate

    from titan_dmuon.runtime.initialise import initialising

    with fake_pg(world):
        parts = runtime_parts(world, hsdp=hsdp, allocate=False)
        members, written, seen = parts.dedication.members, [], []
        layout = (lambda m: (parts.mode.mesh.mesh, (Replicate(),))) if replicated_layout else None
        dims = None if shard_dim is None else (lambda m: shard_dim)
        with initialising(
            members, parts.mode, sharded=sharded, shard_dim=dims, layout=layout, on_written=lambda: written.append(True)
        ):
            for i, m in enumerate(members):
                stand_in = m.module._parameters[m.name]
                if isinstance(stand_in.data, DTensor):
                    seen.append((tuple(stand_in.placements), tuple(stand_in.to_local().shape), tuple(stand_in.shape)))
                else:
                    seen.append((None, tuple(stand_in.shape), tuple(stand_in.shape)))
                with torch.no_grad():
                    nn.init.constant_(stand_in, float(i + 1))
        kept = [
            (
                m.holds_full,
                m.param.numel() == (m.numel if m.holds_full else 0),
                bool((m.param == i + 1).all()) if m.holds_full else None,
            )
            for i, m in enumerate(members)
        ]
        restored = all(m.module._parameters[m.name] is m.param for m in members)
        return seen, kept, written, restored, [m.shape for m in members]


def _stand_ins_on_fake_pg(rank, world, fake_world, hsdp, kwargs):
    return _stand_ins(fake_world, hsdp, **kwargs)


def _check(seen, shapes, placements, divisor):
    for (got, local, full), shape in zip(seen, shapes):
        assert full == shape and got == placements
        assert local == ((shape[0] // divisor, *shape[1:]) if placements is not None else shape)


def test_fsdp2s_layout_on_one_dim_and_on_hsdp_with_the_owners_keeping_the_values(solo):
    """1-D mesh of 4: ``Shard(0)``, a quarter of the rows each; HSDP 2 x 2: ``(Replicate(), Shard(0))``,
    half the rows each (the placements come from the mode's HSDP fact); both: each owner keeps the full
    weight as drawn (here a constant per weight, so the fake all-gather assembles it), the others their
    0-element placeholders; ``on_written`` once; the registered parameters back."""
    from torch.distributed.tensor import Replicate, Shard

    for hsdp, placements, divisor in ((False, (Shard(0),), 4), (True, (Replicate(), Shard(0)), 2)):
        seen, kept, written, restored, shapes = solo.run(_stand_ins_on_fake_pg, 4, hsdp, {"sharded": True})[0]
        _check(seen, shapes, placements, divisor)
        assert any(holds for holds, _, _ in kept) and not all(holds for holds, _, _ in kept)
        assert all(placeholder_or_full and value in (True, None) for _, placeholder_or_full, value in kept)
        assert written == [True] and restored


def test_ddp_gives_the_full_weight_and_a_shard_dim_or_layout_is_followed(solo):
    """Not sharded (DDP): the full weight on every rank; ``shard_dim`` picks FSDP2's dim per weight; a
    ``layout`` (tensor parallelism's) replaces FSDP2's own."""
    from torch.distributed.tensor import Replicate, Shard

    seen, kept, written, _, shapes = solo.run(_stand_ins_on_fake_pg, 4, False, {"sharded": False})[0]
    _check(seen, shapes, None, 1)
    assert written == [True]
    seen, _, _, _, _ = solo.run(_stand_ins_on_fake_pg, 4, False, {"sharded": True, "shard_dim": 1})[0]
    assert all(got == (Shard(1),) and local == (full[0], full[1] // 4) for got, local, full in seen)
    seen, _, _, _, _ = solo.run(_stand_ins_on_fake_pg, 4, False, {"sharded": True, "replicated_layout": True})[0]
    assert all(got == (Replicate(),) and local == full for got, local, full in seen)


def _interrupted():
    from titan_dmuon.runtime.initialise import initialising

    with fake_pg(1):
        parts = runtime_parts(1, allocate=False)
        members, written = parts.dedication.members, []
        before = [m.param.detach().clone() for m in members]
        try:
            with initialising(members, parts.mode, sharded=True, on_written=lambda: written.append(True)):
                for m in members:
                    with torch.no_grad():
                        m.module._parameters[m.name].fill_(7.0)
                raise KeyError("an initialiser fails")
        except KeyError:
            pass
        unchanged = all(torch.equal(m.param, b) for m, b in zip(members, before))
        return unchanged, written, all(m.module._parameters[m.name] is m.param for m in members)


def _interrupted_job(rank, world):
    return _interrupted()


def test_an_initialiser_that_fails_leaves_the_weights_as_they_were(solo):
    assert solo.run(_interrupted_job)[0] == (True, [], True)
