"""``runtime/tensor_parallel.py``'s conversions between a TP shard and its full matrix, on the fake
process group as tp rank 2 of 4 (its all-gather copies this rank's shard into every part, so the
full matrix is four copies of it, joined on the split dim). The step's exchange is tested in
``tests/titan/test_tensor_parallel.py`` (its traffic at T = 4, 8 on the fake process group, its values on gloo)."""

import torch
from torch import nn

from tests.support.runtime_parts import fake_pg
from titan_dmuon.runtime.comm import CommLabel

TP, RANK = 4, 2


def _member(tp_dim, local_shape):
    """A dedicated weight held as a TP shard of ``local_shape`` split on ``tp_dim`` (None: replicated)."""
    from titan_dmuon.plan.ownership import build_plan
    from titan_dmuon.plan.specs import MatrixSpec
    from titan_dmuon.runtime.members import Member

    rows = local_shape[0] * (TP if tp_dim == 0 else 1)
    spec = MatrixSpec(fqn="w", shape=local_shape, unit=0, blocks=(((0, rows),),), tp_dim=tp_dim, tp_size=TP)
    entry = build_plan([spec], replicate_size=1, shard_size=1).entries[0]
    owner = nn.Linear(local_shape[1], local_shape[0], bias=False)
    return Member(entry=entry, module=owner, name="weight", param=owner.weight, holds_full=True, runs_ns=True)


def _conversions():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from titan_dmuon import CommLedger
    from titan_dmuon.runtime.mode import TensorParallelInfo
    from titan_dmuon.runtime.tensor_parallel import as_sharded, tp_full, tp_local

    out = {}
    with fake_pg(TP, rank=RANK):
        tp = TensorParallelInfo.from_mesh(init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",)))
        for dim in (0, 1, None):
            member = _member(dim, (3, 5))
            full = torch.arange(torch.Size(member.entry.full_shape).numel(), dtype=torch.float32)
            full = full.view(member.entry.full_shape)
            local = tp_local(tp, member, full)
            shard = torch.randn(3, 5)
            with CommLedger() as ledger:
                gathered = tp_full(tp, member, shard)
            sharded = as_sharded(tp, member, shard)
            if dim is None:
                checks = {"local": local is full, "full": gathered is shard, "sharded": sharded is shard}
            else:
                checks = {
                    "local": torch.equal(local, full.chunk(TP, dim=dim)[RANK]),
                    "full": torch.equal(gathered, torch.cat([shard] * TP, dim=dim)),
                    "sharded": (
                        tuple(sharded.shape) == member.entry.full_shape
                        and tuple(sharded.placements) == (Shard(dim),)
                        and _same_storage(sharded.to_local(), shard)
                    ),
                }
            checks["local_is_view"] = _same_storage(local, full)
            checks["labels"] = [r.source for r in ledger.records]
            out[dim] = checks
    return out


def _same_storage(a, b) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _conversions_on_fake_pg(rank, world):
    return _conversions()


def test_a_tp_shard_to_its_full_matrix_and_back(solo):
    """``tp_local``: this rank's chunk of the full value on the split dim (a view); ``tp_full``: the
    shards joined on that dim by one all-gather on the TP group, labelled as an export; ``as_sharded``:
    the shard as a DTensor of the full matrix, ``Shard(dim)`` on the tp mesh, on the same storage. A
    weight TP replicates passes through unchanged, with no collective."""
    out = solo.run(_conversions_on_fake_pg)[0]
    for dim in (0, 1):
        assert out[dim] == {
            "local": True,
            "local_is_view": True,
            "full": True,
            "labels": [CommLabel.EXPORT],
            "sharded": True,
        }, dim
    assert out[None] == {"local": True, "local_is_view": True, "full": True, "labels": [], "sharded": True}
