"""One order on every rank: each communicator sees the same operations in the same order on all its ranks.

NCCL runs a communicator's operations in issue order, and a rank's operations on one stream run in its
issue order: two ranks that share two communicators and issue on them crosswise wait on each other for
ever (or, on one communicator, pair collectives of different sizes). This file simulates every rank of a
job in turn on the fake process group (one process; collectives move no data) and records, through the
``CommLedger``, each rank's sequence of collectives over the whole job: build, a step before any forward
(a resume's first call), then forward, backward and the step. ``check_issue_order`` then requires

* per communicator (its ranks), the same sequence of (kind, elements, dtype) on every one of its ranks;
* no cycle across communicators: the operations, linked by each communicator's order and each rank's
  order, can be run one after another (a topological order exists), so no two ranks wait on each other.

The layouts: Z2 and Z3 at 32 ranks, HSDP 2 x 32, one and two Muon param groups (attention
and MLP at different learning rates: ``[{"params": ..., "lr": ...}, ...]``), owner groups of different
sizes that share ranks, and a dedication mesh that is one slice of a larger world (pipeline-stage-like
copies, each with its own model and plan, no pipeline schedule). A planted crossing (a job's param groups
in a rank-dependent order) must fail the check. The checker is tests/support/issue_order.py's. What this
file does not build: tensor, expert and context parallelism and a real pipeline schedule, with everything
else a rank issues (FSDP2's, TorchTitan's, DCP's): tests/titan/test_issue_order_layouts.py records those on
real gloo ranks (4 of them), each op as it reaches the dispatcher.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.support.issue_order import check_issue_order
from titan_dmuon.plan.owner_groups import GroupOptions

# Cheap sums next to Newton–Schulz (so the plan splits these tiny matrices), nodes of 4 ranks, every figure
# given (none measured: on the fake process group a measurement would time collectives that move nothing).
ORDER_GROUPS = GroupOptions(
    ns_tflops=1e-3, node_size=4, latency_us=0.0, nic_latency_us=0.0, intra_node_gbps=360.0, nic_gbps=45.0, min_gain=0.0
)
DIM, ATTENTION, MLP, LAYERS = 16, 512, 1024, 4


class OrderBlock(nn.Module):
    """Attention-like (``attn_in``/``attn_out``/``gate``) and MLP-like (``mlp_in``/``mlp_out``/``proj``) weights."""

    def __init__(self, dim: int, attention: int, mlp: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn_in, self.attn_out = nn.Linear(dim, attention, bias=False), nn.Linear(attention, dim, bias=False)
        self.mlp_in, self.mlp_out = nn.Linear(dim, mlp, bias=False), nn.Linear(mlp, dim, bias=False)
        self.gate, self.proj = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return (
            x
            + self.attn_out(torch.tanh(self.attn_in(h))) * torch.sigmoid(self.gate(h))
            + self.proj(self.mlp_out(torch.tanh(self.mlp_in(h))))
        )


class OrderModel(nn.Module):
    def __init__(self, layers: int = LAYERS, mlp: int = MLP, vocab: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, DIM)
        self.layers = nn.ModuleList([OrderBlock(DIM, ATTENTION, mlp) for _ in range(layers)])
        self.head = nn.Linear(DIM, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _targets(model: OrderModel) -> tuple[list, list]:
    """The Muon targets as two param groups: attention's and the MLP's."""
    attention = [p for layer in model.layers for p in (layer.attn_in.weight, layer.attn_out.weight, layer.gate.weight)]
    mlp = [p for layer in model.layers for p in (layer.mlp_in.weight, layer.mlp_out.weight, layer.proj.weight)]
    return attention, mlp


def _mesh(layout: str, world: int):
    from torch.distributed.device_mesh import init_device_mesh

    if layout == "hsdp":
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    if layout == "stages":  # two copies of the dedication mesh, as two pipeline stages' data-parallel meshes
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))["dp"]
    return init_device_mesh("cpu", (world,))


def _one_rank(rank: int, world: int, layout: str, param_groups: int) -> list[tuple]:
    """This rank's collectives over a job: (kind, ranks, elements, dtype) in issue order."""
    from torch.distributed.fsdp import fully_shard

    from titan_dmuon import CommLedger, DMuon, dedicate_params
    from titan_dmuon.testing.toy_model import loss_fn

    torch.manual_seed(0)
    mesh = _mesh(layout, world)
    # (the copies of "stages" hold different models: their plans differ, as pipeline stages' do)
    stage = dist.get_rank() // (world // 2) if layout == "stages" else 0
    with CommLedger() as ledger:
        model = OrderModel(layers=LAYERS - stage, mlp=MLP // (1 + stage))
        attention, mlp = _targets(model)
        handle = dedicate_params(
            model, attention + mlp, mesh, reshard_after_forward=layout != "z2", owner_groups=ORDER_GROUPS
        )
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, ignored_params=handle.ignored_params, reshard_after_forward=layout != "z2")
        fully_shard(model, mesh=mesh, ignored_params=handle.ignored_params, reshard_after_forward=layout != "z2")
        chosen = {id(p) for p in attention + mlp}
        rest = [p for p in model.parameters() if id(p) not in chosen]
        if param_groups == 2:
            groups = [{"params": attention, "lr": 0.02}, {"params": mlp + rest, "lr": 0.01}]
        else:
            groups = [{"params": attention + mlp + rest}]
        opt = DMuon(groups, dedicated=handle)
        opt.step()  # (a resume's first call: before any forward, no gradients)
        tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            loss_fn(model(tokens), tokens).backward()
            opt.step()
            opt.zero_grad()
    grouped = [e for e in handle.plan.entries if e.group is not None]
    return [(r.kind, r.group_ranks, r.numel, str(r.dtype)) for r in ledger.records], [
        (e.fqn, e.group.ranks) for e in grouped
    ]


def record_job(_rank, _world, layout: str, world: int, param_groups: int, planted: bool = False):
    """Every rank of a ``world``-rank job in turn (fake process group): its collectives, and the plan's groups."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from titan_dmuon.optim import step_schedule

    original = step_schedule.Job.in_order
    if planted:  # a job's param groups in an order that depends on the rank (odd ranks: last first)
        step_schedule.Job.in_order = lambda self: original(self)[:: -1 if dist.get_rank() % 2 else 1]
    try:
        out = []
        for rank in range(world):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
            try:
                out.append(_one_rank(rank, world, layout, param_groups))
            finally:
                dist.destroy_process_group()
        return out
    finally:
        step_schedule.Job.in_order = original


def _overlapping_groups(groups: list) -> bool:
    """Two owner groups of different sizes share a rank."""
    return any(set(a) & set(b) and len(a) != len(b) for _, a in groups for _, b in groups)


# (at 16 ranks this model's plan keeps one group size; at 32 it mixes groups of 2 and 8, at 64 of 4 and 16)
LAYOUTS = [("z3", 32, 2), ("z2", 32, 2), ("hsdp", 64, 2), ("z3", 32, 1), ("stages", 64, 2)]


@pytest.mark.parametrize("layout, world, param_groups", LAYOUTS)
def test_every_communicator_sees_one_order(solo, layout, world, param_groups):
    """Each layout's job, every rank simulated: the check holds, and the layout did exercise owner groups
    of different sizes that share ranks (else it would prove nothing about their order)."""
    ranks = solo.run(record_job, layout, world, param_groups)[0]
    assert _overlapping_groups(ranks[0][1]), ranks[0][1]
    check_issue_order([ops for ops, _ in ranks])


def test_a_planted_crossing_fails_the_check(solo):
    """A job's param groups in a rank-dependent order (odd ranks take the last first; before issue 39 the
    order was the one in which this rank first met each param group in a chunk): ranks of two overlapping
    groups then issue their sums crosswise, and the check says so."""
    ranks = solo.run(record_job, "z3", 32, 2, True)[0]
    with pytest.raises(AssertionError, match="cross|another sequence"):
        check_issue_order([ops for ops, _ in ranks])


def test_the_check_catches_a_crossing_and_a_mismatch():
    """The checker itself, on hand-written sequences: crosswise on two communicators; sizes that differ."""
    a, b = (0, 1), (0, 1, 2, 3)
    both = [("all_reduce", a, 1, "f"), ("all_reduce", b, 2, "f")]
    fine = [both, both, [("all_reduce", b, 2, "f")], [("all_reduce", b, 2, "f")]]
    check_issue_order(fine)
    crossed = [fine[0], [("all_reduce", b, 2, "f"), ("all_reduce", a, 1, "f")], *fine[2:]]
    with pytest.raises(AssertionError, match="cross"):
        check_issue_order(crossed)
    mismatched = [fine[0], [("all_reduce", a, 3, "f"), ("all_reduce", b, 2, "f")], *fine[2:]]
    with pytest.raises(AssertionError, match="another sequence"):
        check_issue_order(mismatched)
