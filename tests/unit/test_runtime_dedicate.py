"""``runtime/request.py`` and ``runtime/dedicate.py``, each step on its own: the request's checks (no
process group), the unit each weight goes to, the buffer layout of a unit, the load of experts kept in
place, and the plan, members and context on the fake process group."""

import pytest
import torch
from torch import nn

from tests.support.helpers import toy_model
from tests.support.runtime_parts import fake_pg, runtime_parts
from titan_dmuon.math.ns_methods import ns_flops
from titan_dmuon.plan.ownership import build_plan
from titan_dmuon.plan.specs import MatrixSpec
from titan_dmuon.runtime.dedicate import local_expert_load, make_members
from titan_dmuon.runtime.members import LocalExperts
from titan_dmuon.runtime.mode import MeshInfo
from titan_dmuon.runtime.request import Requested, registration_sites, requested_params
from titan_dmuon.runtime.unit_layout import assign_units, layout_unit
from titan_dmuon.testing.toy_model import muon_targets


class _Model(nn.Module):
    """Two blocks in a ModuleList (a Linear each, one nested deeper), a tied pair, a frozen matrix, a
    plain one."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4, bias=False), nn.Sequential(nn.Linear(4, 4))])
        self.head = nn.Linear(4, 8, bias=False)
        self.embed = nn.Embedding(8, 4)
        self.embed.weight = self.head.weight  # tied
        self.frozen = nn.Linear(4, 4, bias=False)
        self.frozen.weight.requires_grad_(False)
        self.out = nn.Linear(4, 4, bias=False)


def _refusal(model, params, split_rows=None):
    try:
        requested_params(params, registration_sites(model), split_rows or {})
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def test_the_request_is_refused_with_the_parameter_named():
    model = _Model()
    cases = {
        "not a parameter": ([torch.zeros(2, 2)], "expects nn.Parameter objects, got Tensor"),
        "not in the model": ([nn.Parameter(torch.zeros(3, 3))], "shape (3, 3) is not a parameter of the given module"),
        "tied": ([model.head.weight], "'head.weight' is registered in several places"),
        "twice": ([model.blocks[0].weight, model.blocks[0].weight], "'blocks.0.weight' is listed twice"),
        "1-D": ([model.blocks[1][0].bias], "'blocks.1.0.bias' has shape (4,): only 2-D weights and 3-D expert"),
        "frozen": ([model.frozen.weight], "'frozen.weight' is frozen"),
    }
    for what, (params, expected) in cases.items():
        message = _refusal(model, params)
        assert message is not None and expected in message, (what, message)
    message = _refusal(model, [model.blocks[0].weight], split_rows={model.blocks[1][0].weight: [2, 2]})
    assert message is not None and "split_rows names the parameter 'blocks.1.0.weight', which is not among" in message
    assert _refusal(model, [model.blocks[0].weight, model.out.weight], split_rows={model.out.weight: [2, 2]}) is None


def test_a_request_resolves_each_parameter_to_where_it_is_registered():
    model = _Model()
    inner = model.blocks[1][0]
    requested = requested_params([inner.weight], registration_sites(model), {})
    resolved = [(r.fqn, r.param, r.module, r.name) for r in requested]
    assert resolved == [("blocks.1.0.weight", inner.weight, inner, "weight")]


def test_each_weight_goes_to_the_unit_of_its_layer():
    """Default: the outermost ancestor that is an element of a ModuleList/ModuleDict (a block), else
    the module that registers the weight; with ``units``, the first given unit that contains it."""
    model = _Model()
    params = [model.blocks[0].weight, model.blocks[1][0].weight, model.out.weight]
    requested = requested_params(params, registration_sites(model), {})
    assert assign_units(model, requested, None) == [model.blocks[0], model.blocks[1], model.out]
    assert assign_units(model, requested, [model, model.blocks[1]]) == [model, model.blocks[1], model]
    with pytest.raises(ValueError, match="'blocks.0.weight' is not inside any of the given units"):
        assign_units(model, requested, [model.blocks[1]])


def _unit_layout():
    """A unit of six weights on HSDP 2 x 2, seen from global rank 0: its buffer's segments and buckets."""
    shapes = [(4, 2), (2, 6), (8, 2), (2, 2), (6, 4), (4, 4)]
    specs = [MatrixSpec(fqn=f"w{i}", shape=s, unit=0, blocks=(((0, s[0]),),)) for i, s in enumerate(shapes)]
    plan = build_plan(specs, replicate_size=2, shard_size=2)
    mesh = MeshInfo(
        mesh=None,
        shard_group=None,
        shard_size=2,
        shard_rank=0,
        replicate_group=None,
        replicate_size=2,
        replicate_rank=0,
        device=torch.device("cpu"),
    )
    layer = nn.Module()
    params = []
    for i, s in enumerate(shapes):
        setattr(layer, f"w{i}", nn.Parameter(torch.zeros(s)))
        params.append(getattr(layer, f"w{i}"))
    requested = [Requested(fqn=f"w{i}", param=p, module=layer, name=f"w{i}") for i, p in enumerate(params)]
    members = make_members(requested, plan, mesh)
    return plan, members, layout_unit(0, "layer", layer, members, plan, ctx=None)


def test_a_units_buffer_is_laid_out_by_shard_owner_then_global_owner():
    """One contiguous segment per shard owner (one broadcast each), in it one bucket per global owner
    (one reduce each), members back to back; a rank that does not hold a weight keeps a 0-element
    placeholder."""
    plan, members, unit = _unit_layout()
    assert [s.shard_owner for s in unit.segments] == sorted({plan.shard_owner(e) for e in plan.entries})
    offset = 0
    for segment in unit.segments:
        assert segment.start == offset
        buckets = [b for b in unit.buckets if b.shard_owner == segment.shard_owner]
        assert [b.replicate_owner for b in buckets] == sorted({b.replicate_owner for b in buckets})
        for bucket in buckets:
            for piece in bucket.pieces:
                m = piece.member
                assert (plan.shard_owner(m.entry), plan.replicate_owner(m.entry)) == (
                    segment.shard_owner,
                    bucket.replicate_owner,
                )
                assert m.offset == piece.offset == offset and piece.index is None
                offset += m.numel
        assert segment.stop == offset
    assert unit.numel == offset == sum(e.numel for e in plan.entries)
    assert len(unit.segments) == 2 and len(unit.buckets) == 4  # every (shard, replicate) owner pair has a weight
    for m in members:
        assert m.holds_full == (plan.shard_owner(m.entry) == 0) and m.param.numel() == (m.numel if m.holds_full else 0)
        assert m.runs_ns == (m.holds_full and plan.replicate_owner(m.entry) == 0)


def test_experts_kept_in_place_load_the_ranks_that_hold_them():
    """FSDP2's dim-0 shard (torch.chunk): 5 experts on 2 ranks are 3 + 2, on 4 ranks 2 + 2 + 1 + 0; the
    same on each replica."""
    module = nn.Module()
    module.w = nn.Parameter(torch.zeros(5, 6, 4))
    experts = LocalExperts(fqn="w", module=module, name="w", blocks=(((0, 6),),))
    one = ns_flops(6, 4)
    assert local_expert_load([experts], 1, 2) == [3 * one, 2 * one]
    assert local_expert_load([experts], 2, 4) == [2 * one, 2 * one, one, 0] * 2


def _dedication(world):
    with fake_pg(world):
        parts = runtime_parts(world, model=toy_model(n_layers=3), allocate=False)
        ctx, dedication = parts.ctx, parts.dedication
        model = parts.model
        return {
            "unit_modules": [model.layers[i] is m for i, m in enumerate(dedication.unit_modules)],
            "unit_names": [u.name for u in ctx.units],
            "members": sorted(m.fqn for m in dedication.members)
            == sorted(n for n, p in model.named_parameters() if any(p is q for q in muon_targets(model))),
            "in_units": all(m in ctx.units[m.entry.unit].members for m in dedication.members)
            and sum(len(u.members) for u in ctx.units) == len(dedication.members),
            "held": all(m.param.numel() == (m.numel if m.holds_full else 0) for m in dedication.members),
            "divide": ctx.reducer.divide_factor,
            "shared": ctx.reducer.streams is ctx.streams is ctx.replicas.streams,
        }


def _dedication_job(rank, world, fake_world):
    return _dedication(fake_world)


def test_the_dedication_and_its_context_on_four_ranks(solo):
    """``plan_dedication``: each transformer block a unit (in the model's order), every Muon target a
    member of its block's unit, the weights this rank does not hold emptied; ``build_context``: units
    named as in the model, gradients averaged over the 4 ranks, one set of streams shared."""
    out = solo.run(_dedication_job, 4)[0]
    assert out["unit_modules"] == [True, True, True] and out["unit_names"] == ["layers.0", "layers.1", "layers.2"]
    assert out["members"] and out["in_units"] and out["held"] and out["shared"]
    assert out["divide"] == 4.0
