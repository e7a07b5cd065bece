"""``runtime/members.py``: the records of what a rank holds read their figures from the plan and the model."""

import torch
from torch import nn

from titan_dmuon.math.matrix_blocks import block_rows
from titan_dmuon.math.ns_methods import ns_flops
from titan_dmuon.plan.ownership import build_plan
from titan_dmuon.plan.specs import MatrixSpec
from titan_dmuon.runtime.members import Bucket, LocalExperts, Member, Piece


def _entries():
    specs = [
        MatrixSpec(fqn="a.weight", shape=(6, 4), unit=0, blocks=(((0, 6),),)),
        MatrixSpec(fqn="b.weight", shape=(3, 5), unit=1, blocks=(((0, 3),),)),
    ]
    return build_plan(specs, replicate_size=1, shard_size=2).entries


def test_a_member_reads_its_name_and_size_from_its_plan_entry():
    a, b = _entries()
    owner = nn.Linear(4, 6, bias=False)
    member = Member(entry=a, module=owner, name="weight", param=owner.weight, holds_full=True, runs_ns=True)
    assert (member.fqn, member.shape, member.numel) == ("a.weight", (6, 4), 24)
    other = Member(
        entry=b, module=owner, name="weight", param=nn.Parameter(torch.empty(0)), holds_full=False, runs_ns=False
    )
    pieces = [Piece(member=m, index=None, shard_owner=0, replicate_owner=0) for m in (member, other)]
    bucket = Bucket(shard_owner=0, replicate_owner=0, pieces=pieces)
    assert bucket.numel == 24 + 15  # the full sizes, also of a weight this rank holds a placeholder of
    assert [p.shape for p in pieces] == [(6, 4), (3, 5)] and pieces[0].of(owner.weight) is owner.weight


def test_local_experts_follow_the_registered_parameter_and_count_each_experts_flops():
    """FSDP2 replaces the registered parameter (a DTensor after ``fully_shard``): the record reads it
    now, not the one it was made with; one expert's NS FLOPs sum over its row blocks."""
    module = nn.Module()
    module.w1 = nn.Parameter(torch.zeros(4, 6, 8))
    blocks = (((0, 2),), ((2, 6),))
    experts = LocalExperts(fqn="moe.w1", module=module, name="w1", blocks=blocks)
    assert experts.param is module.w1
    module.w1 = nn.Parameter(torch.zeros(2, 6, 8))  # what fully_shard does to it
    assert experts.param is module.w1 and experts.param.shape[0] == 2
    assert experts.expert_flops() == ns_flops(block_rows(blocks[0]), 8) + ns_flops(block_rows(blocks[1]), 8)
