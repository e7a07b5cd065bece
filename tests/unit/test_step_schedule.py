"""``optim/step_schedule.py``: the order of DMuon's Muon step. One process, stand-ins for the handles and the
update rule that record what the schedule asks of them (the rule's arithmetic: tests/unit/test_whole_update.py).

The rules, as the module states them: per handle, the dedicated weights in forward order in chunks of
1, 1, 2, 4, ... units; each chunk's units told ``before_update``, its weights updated (one call per param
group, in the groups' order), then its units sent on (``updated``, after QK-clip's rescale of each); every
rank calls ``before_update``/``updated`` for every unit in the same order whatever it owns (they issue
collectives on groups the ranks share); the experts a rank keeps in place follow, with nothing sent on.
"""

from types import SimpleNamespace

import pytest
import torch

from titan_dmuon.optim.step_schedule import StepSchedule, pipeline_chunks, whole_local_experts
from titan_dmuon.optim.whole_update import OwnedWeight


def _chunks_by_rule(count: int) -> list[list[int]]:
    """The rule written out: sizes 1, 1, 2, 4, 8, ..., the last one cut short."""
    sizes, chunks, start = [1, 1], [], 0
    while len(sizes) < count + 2:
        sizes.append(2 * sizes[-1])
    for size in sizes:
        if start >= count:
            break
        chunks.append(list(range(start, min(count, start + size))))
        start += size
    return chunks


@pytest.mark.parametrize("count", range(0, 19))
def test_pipeline_chunks_are_1_1_2_4_8_in_forward_order(count):
    assert pipeline_chunks(list(range(count))) == _chunks_by_rule(count)


class _Log:
    def __init__(self):
        self.events = []


class _Handle:
    """A handle of ``units`` step units (forward order) whose weights this rank owns when ``owned(unit)``:
    what the schedule reads of a ``DedicatedParams``, and a record of what it is told."""

    def __init__(self, log, params_by_unit, owned, *, experts=()):
        self.log, self.mode, self.owner_groups = log, SimpleNamespace(tp=None), None
        self.local_tp_experts = {}
        self._units = [SimpleNamespace(index=u) for u in range(len(params_by_unit))]
        self._members = {}
        for unit, params in zip(self._units, params_by_unit):
            for p in params:
                entry = SimpleNamespace(tensor_parallel=False, blocks=(((0, p.shape[0]),),), col_blocks=())
                self._members[id(p)] = SimpleNamespace(
                    unit=unit.index, runs_ns=owned(unit.index), group=None, entry=entry
                )
        self._experts = {
            id(p): SimpleNamespace(tp_dim=None, blocks=(((0, p.shape[1]),),), col_blocks=(), fqn=f"e{i}")
            for i, p in enumerate(experts)
        }

    def step_units(self):
        return list(self._units)

    def member_of(self, p):
        return self._members.get(id(p))

    def local_expert_of(self, p):
        return self._experts.get(id(p))

    def before_update(self, unit):
        self.log.events.append(("before_update", unit.index))

    def updated(self, unit):
        self.log.events.append(("updated", unit.index))


class _Rule:
    """The update rule as the schedule calls it: records (param group's name, weight names) per call."""

    def __init__(self, log, names):
        self.log, self.names = log, names

    def update(self, group, weights):
        assert all(isinstance(w, OwnedWeight) for w in weights)
        self.log.events.append(("update", group["name"], [self.names[id(w.param)] for w in weights]))


def _model(units: int, per_unit: int = 2):
    params = [[torch.zeros(4, 4, requires_grad=True) for _ in range(per_unit)] for _ in range(units)]
    for unit in params:
        for p in unit:
            p.grad = torch.ones_like(p)
    names = {id(p): f"u{u}.w{k}" for u, unit in enumerate(params) for k, p in enumerate(unit)}
    return params, names


def _expected_events(units, owned, groups_of):
    """The rule: per chunk, before_update of its units, one update per param group (in the groups' order)
    with the chunk's owned weights of that group in forward order, then updated of its units."""
    events = []
    for chunk in _chunks_by_rule(units):
        events += [("before_update", u) for u in chunk]
        for name, members in groups_of:
            weights = [w for u in chunk if owned(u) for w in members if w.startswith(f"u{u}.")]
            if weights:
                events.append(("update", name, weights))
        events += [("updated", u) for u in chunk]
    return events


def _run(units, owned, *, split_groups=False, qk_clip=None, experts=()):
    params, names = _model(units)
    log = _Log()
    handle = _Handle(log, params, owned, experts=experts)
    flat = [p for unit in params for p in unit]
    if split_groups:  # each unit's first weight in group "a", its second in group "b"
        groups = [
            {"name": "a", "params": [unit[0] for unit in params]},
            {"name": "b", "params": [unit[1] for unit in params]},
        ]
    else:
        groups = [{"name": "a", "params": list(flat)}]
    for i, e in enumerate(experts):
        names[id(e)] = f"expert{i}"
        groups[-1]["params"].append(e)
    schedule = StepSchedule(_Rule(log, names), [handle], qk_clip=qk_clip, dedicated_ids={id(p) for p in flat})
    schedule.run(groups)
    groups_of = [(g["name"], [names[id(p)] for p in g["params"]]) for g in groups]
    return log.events, groups_of


@pytest.mark.parametrize("units", [1, 2, 5, 9])
@pytest.mark.parametrize("split_groups", [False, True])
def test_chunks_update_then_send_their_units_in_forward_order(units, split_groups):
    events, groups_of = _run(units, lambda u: True, split_groups=split_groups)
    assert events == _expected_events(units, lambda u: True, groups_of)


@pytest.mark.parametrize("units", [3, 6])
def test_every_rank_tells_every_unit_in_the_same_order_whatever_it_owns(units):
    """Ranks that own the even units, the odd ones, all or none issue the same before_update/updated
    sequence (the handle's collectives); only their update calls differ, each with its own weights."""
    owners = [lambda u: u % 2 == 0, lambda u: u % 2 == 1, lambda u: True, lambda u: False]
    told = []
    for owned in owners:
        events, groups_of = _run(units, owned)
        assert events == _expected_events(units, owned, groups_of)
        told.append([e for e in events if e[0] != "update"])
    assert all(t == told[0] for t in told)
    assert sum(e[0] == "update" for e in _run(units, lambda u: False)[0]) == 0


def test_weights_without_a_gradient_or_not_run_here_are_left_alone():
    params, names = _model(2)
    params[0][1].grad = None  # no gradient this step (e.g. an unused branch)
    log = _Log()
    handle = _Handle(log, params, lambda u: u == 0)
    flat = [p for unit in params for p in unit]
    StepSchedule(_Rule(log, names), [handle], dedicated_ids={id(p) for p in flat}).run([{"name": "a", "params": flat}])
    assert [e for e in log.events if e[0] == "update"] == [("update", "a", ["u0.w0"])]


def test_qk_clip_rescales_each_unit_before_it_is_sent_on_and_finishes_once():
    log = _Log()
    qk_clip = SimpleNamespace(
        rescale=lambda handle, index: log.events.append(("rescale", index)),
        finish=lambda: log.events.append(("finish",)),
    )
    params, names = _model(4)
    handle = _Handle(log, params, lambda u: True)
    flat = [p for unit in params for p in unit]
    StepSchedule(_Rule(log, names), [handle], qk_clip=qk_clip, dedicated_ids={id(p) for p in flat}).run(
        [{"name": "a", "params": flat}]
    )
    sent = [e for e in log.events if e[0] in ("rescale", "updated", "finish")]
    expected = []
    for chunk in _chunks_by_rule(4):
        expected += [("rescale", u) for u in chunk] + [("updated", u) for u in chunk]
    assert sent == expected + [("finish",)]


def test_local_experts_are_updated_last_whole_and_nothing_is_sent_after_them():
    experts = [torch.zeros(3, 4, 4), torch.zeros(2, 4, 4)]
    for e in experts:
        e.grad = torch.ones_like(e)
    events, _ = _run(3, lambda u: True, experts=experts)
    last_updated = max(i for i, e in enumerate(events) if e[0] == "updated")
    assert events[last_updated + 1 :] == [("update", "a", ["expert0", "expert1"])]


def test_a_replaced_dedicated_parameter_is_named_not_skipped():
    """A dedicated parameter that no handle knows any more (``model.to_empty()`` after DMuon was built)
    would silently never be updated: the step refuses, saying how to fix it."""
    params, names = _model(2)
    log = _Log()
    handle = _Handle(log, params, lambda u: True)
    dedicated = {id(p) for unit in params for p in unit}
    replaced = torch.zeros(4, 4, requires_grad=True)
    dedicated.add(id(replaced))
    schedule = StepSchedule(_Rule(log, names), [handle], dedicated_ids=dedicated)
    with pytest.raises(RuntimeError, match="Build DMuon after the model is materialised"):
        schedule.run([{"name": "a", "params": [p for unit in params for p in unit] + [replaced]}])


def test_whole_local_experts_of_a_plain_tensor_is_the_tensor():
    stack = torch.zeros(2, 4, 4)
    assert whole_local_experts(stack) is stack
