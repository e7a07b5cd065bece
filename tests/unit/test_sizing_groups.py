"""``python -m titan_dmuon.sizing`` with owner groups (issue 39): the plan the runtime would build (the same
``build_plan``, groups on by default, an H200's stated figures), its busiest rank's Newton–Schulz time, the
groups' Gram all-reduces and memory, and the Z2/Z3 check on that plan. Each expectation is written here
from the rule the docs state (docs/owner-groups.md, docs/sizing.md), not read off a run."""

from __future__ import annotations

import pytest

from benchmarks.plan_scale import llama3_405b_specs, ns_seconds
from titan_dmuon.plan.owner_groups import GroupOptions
from titan_dmuon.plan.ownership import build_plan
from titan_dmuon.sizing import command, render
from titan_dmuon.sizing.figures import size_job
from titan_dmuon.sizing.records import Layout, Precision, Weight

# The H200's stated figures (docs/owner-groups.md, "Whose figures"): the rule's constants, written out
TFLOPS, INTRA_GBPS, INTRA_LATENCY_S = 790.0, 360.0, 15e-6
STEPS = 5  # ns_method "torch": one Gram all-reduce per step
SHORT, LONG = 4096, 16384  # one matrix whose Newton–Schulz dominates 4 ranks (7.8 ms whole at 790 TFLOP/s)


def _one_matrix(shape) -> list[Weight]:
    return [Weight(fqn="layers.0.w", shape=shape, muon=True, layer=0)]


def _grouped(shape, **kwargs):
    """The one-matrix job on 4 ranks, and the size of the group the plan gave the matrix."""
    sized = size_job(_one_matrix(shape), Layout(shard=4), **kwargs)
    (entry,) = sized.stages[0].runs.plan.entries
    assert entry.group is not None and entry.group.size in (2, 4), "a dominant matrix on 4 ranks gets a group"
    return sized, entry.group.size


def _member_flops(k: int) -> int:
    """docs/owner-groups.md: per standard step a member of a block b wide runs 4 s² b + 2 s³, or applies
    the Gram matrix twice (6 s² b) where b < s; the first block is the widest, ceil(l / k)."""
    b = -(-LONG // k)
    return STEPS * (6 * SHORT * SHORT * b if b < SHORT else 4 * SHORT * SHORT * b + 2 * SHORT**3)


def _gram_elements() -> int:
    """What a member gives its group's all-reduces per step: the packed fp32 Gram matrix once a step,
    s (s + 1) / 2 numbers, and its squared norm once."""
    return STEPS * SHORT * (SHORT + 1) // 2 + 1


@pytest.mark.parametrize("shape", [(SHORT, LONG), (LONG, SHORT)], ids=["wide", "tall"])
def test_the_busiest_member_s_time_is_its_flops_and_its_all_reduces(shape):
    """A member's Newton–Schulz time: its block's FLOPs at 790 TFLOP/s plus 5 all-reduces inside a node,
    each 15 us + 2 (k - 1) / k of its bytes at 360 GB/s. One owner: the whole matrix's FLOPs at the rate."""
    sized, k = _grouped(shape)
    comm = STEPS * INTRA_LATENCY_S + 2 * (k - 1) / k * 4 * _gram_elements() / (INTRA_GBPS * 1e9)
    assert sized.ns_seconds_max() == pytest.approx(_member_flops(k) / (TFLOPS * 1e12) + comm, rel=1e-12)
    whole = STEPS * (4 * SHORT * SHORT * LONG + 2 * SHORT**3)
    assert sized.ns_seconds_max("one_owner") == pytest.approx(whole / (TFLOPS * 1e12), rel=1e-12)
    assert sized.ns_seconds_max() < sized.ns_seconds_max("one_owner")


def test_the_groups_all_reduces_in_the_design_s_units():
    """design-facts.md: an all-reduce of S moves 2 (k - 1) / k S per rank. Each of the k members gives S =
    the Gram elements above; the traffic table's figure is the mean over the 4 ranks, added to DMuon's
    (the broadcasts and reduces move the same elements as one owner: each block to or from its member)."""
    sized, k = _grouped((SHORT, LONG))
    stage = sized.stages[0]
    member = 2 * (k - 1) * _gram_elements() / k
    assert stage.runs.group_traffic_max.elements == member
    assert stage.runs.group_traffic.elements == k * member / 4
    assert stage.runs.group_traffic.bytes == 4 * k * member / 4  # fp32
    for name in ("DMuon-Z2", "DMuon-Z3"):
        assert stage.traffic[name].elements == stage.one_owner.traffic[name].elements + k * member / 4
    assert stage.one_owner.group_traffic.elements == 0


@pytest.mark.parametrize("shape", [(SHORT, LONG), (LONG, SHORT)], ids=["wide", "tall"])
def test_a_member_keeps_its_block_and_every_block_is_gathered_in_place(shape):
    """docs/owner-groups.md: a member keeps its block of the fp32 weight, gradient and momentum (1/k of the
    matrix; k divides 16384); a tall weight's row blocks and a wide one's column blocks land in place in the
    packed buffer (the wide weight laid out column-major), so the buffers' peak is the one-owner plan's (a
    staging area as large as the weight was added to a wide one's before); the step's
    Gram workspace of one matrix (a block at least s wide: the polynomial) is its block and next value, the
    Gram matrix and its polynomial (s x s each) and the packed fp32 sum (s (s + 1) / 2 fp32, two bf16
    elements each), in bf16, and the batch's one block in fp32 (the Nesterov input, a matrix's squares).
    The whole-weight workspace kept between steps is for weights held whole: none here."""
    sized, k = _grouped(shape)
    numel, block = SHORT * LONG, SHORT * LONG // k
    b = LONG // k
    for name in ("DMuon-Z2", "DMuon-Z3"):
        runs, alone = sized.stages[0].runs.memory[name], sized.stages[0].one_owner.memory[name]
        assert (runs.params, runs.grads, runs.optimizer_state) == (4 * block, 4 * block, 4 * block)
        assert (alone.params, alone.grads, alone.optimizer_state) == (4 * numel, 4 * numel, 4 * numel)
        assert runs.buffers_peak == alone.buffers_peak == 2 * numel
        assert b >= SHORT  # (the polynomial, not Horner's order)
        assert runs.group_temporaries == 2 * (2 * SHORT * b + 2 * SHORT * SHORT + SHORT * (SHORT + 1) + 2 * SHORT * b)
        assert runs.workspace == 0 < alone.workspace and alone.group_temporaries == 0
        assert sized.stages[0].memory[name] == runs  # the table's DMuon columns: the plan that runs


def test_the_budget_is_checked_on_the_plan_that_runs():
    """With a device between the two plans' peaks, the plan with groups fits and the one-owner plan does
    not: on by default the recommendation is the mode that fits, said in one line per mode; with groups
    off, neither fits."""
    sized, _ = _grouped((SHORT, LONG))
    runs, alone = (sized.stages[0].runs.memory["DMuon-Z3"].peak, sized.stages[0].one_owner.memory["DMuon-Z3"].peak)
    assert runs < alone
    device = (runs + alone) / 2
    on = size_job(_one_matrix((SHORT, LONG)), Layout(shard=4), device_memory=device, activation_share=0)
    assert on.recommendation == "DMuon-Z2"
    z2 = [r for r in on.reasons if r.startswith(("Z2 fits", "Z2 does not fit"))]
    assert len(z2) == 1 and z2[0].startswith("Z2 fits") and "one owner per weight" in z2[0] and "over" in z2[0]
    off = size_job(
        _one_matrix((SHORT, LONG)),
        Layout(shard=4),
        device_memory=device,
        activation_share=0,
        groups=GroupOptions(enabled=False),
    )
    assert off.recommendation == "DMuon-Z3" and "neither fits" in off.reasons[-1]
    assert [r.split(":")[0] for r in off.reasons if r.startswith("Z")][2:] == ["Z2 does not fit", "Z3 does not fit"]


def test_keep_whole_and_groups_off_plan_one_owner():
    """``keep_whole`` (QK-clip's attention weights) and ``--no-owner-groups`` give the one-owner plan,
    and the report says why."""
    kept = size_job(_one_matrix((SHORT, LONG)), Layout(shard=4), keep_whole=(r"\.w$",))
    assert kept.stages[0].runs is kept.stages[0].one_owner and not kept.grouped
    assert (
        "one owner whatever the cost (kept whole: a rule reads the whole matrix (QK-clip)): layers.*.w (1 weights)"
        in render.render(kept, title="t")
    )
    off = size_job(_one_matrix((SHORT, LONG)), Layout(shard=4), groups=GroupOptions(enabled=False))
    assert off.stages[0].runs.plan.entries[0].group is None


def test_the_report_shows_both_plans(capsys):
    sized, k = _grouped((SHORT, LONG))
    report = render.render(sized, title="one matrix")
    for line in (
        "| | one owner per weight | owner groups (the plan that runs) |",
        f"| owner groups: weights x ranks | – | 1 x {k} |",
        f"- in owner groups of {k} ranks: layers.*.w (1 weights)",
        "owner groups' step temporaries",
        "of which owner groups' Gram all-reduces",
    ):
        assert line in report, line
    command.main(["--model", "llama3", "--flavor", "debugmodel", "--world", "2", "--no-owner-groups"])
    assert "owner groups are off (--no-owner-groups)" in capsys.readouterr().out


def test_sizing_agrees_with_plan_scale_on_llama3_405b_at_8_x_1024():
    """The same weights and mesh as ``benchmarks/plan_scale.py --groups`` (llama3 405B with q, k, v apart, 8 x
    1024 ranks, an H200's figures): the same busiest rank's Newton–Schulz time, one owner and with groups,
    and with groups under the one-matrix floor (the largest weight's Newton–Schulz at 790 TFLOP/s)."""
    specs = llama3_405b_specs()
    weights = [Weight(fqn=s.fqn, shape=s.shape, muon=True, layer=s.unit) for s in specs]
    sized = size_job(weights, Layout(replicate=8, shard=1024), precision=Precision())
    options = GroupOptions().stated()
    for chosen, which in ((None, "one_owner"), (options, "runs")):
        plan = build_plan(specs, replicate_size=8, shard_size=1024, groups=chosen)
        assert sized.ns_seconds_max(which) == max(ns_seconds(plan, options))
    floor = max(s.ns_flops() for s in specs) / (TFLOPS * 1e12)
    assert sized.ns_seconds_max("one_owner") == pytest.approx(floor, rel=1e-12)
    assert sized.ns_seconds_max() < floor / 2
