"""Owner groups on real process groups (gloo): Newton–Schulz of one matrix split over the ranks.

The bound is ``tests/unit/test_group_math.py``'s (the group's distance from the exact-arithmetic iteration
within GROUP_RATIO of the one-owner's, plus each evaluation's kernel rounding); here the all-reduce is
gloo's, whose order of summation is its own.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from benchmarks.ns_deviation import scale_ulps
from tests.support.helpers import (
    ADAMW,
    TOLERANCE,
    batches,
    distribute,
    full_state,
    max_diff,
    reference_train,
    train,
)
from tests.support.owner_groups_parts import (
    ADAMW_EPS,
    BATCHED_ULPS,
    GROUP_RATIO,
    GROUP_TOLERANCE,
    STEPS,
    TINY_GROUPS,
    dominant_model,
    dominant_targets,
    exact_iteration,
)
from titan_dmuon.math.group_newton_schulz import block_bounds, group_newton_schulz
from titan_dmuon.math.ns_methods import NS_METHODS, newton_schulz
from titan_dmuon.plan.owner_groups import GroupOptions

SHAPES = [(64, 64), (96, 32), (24, 500)]


def _member_blocks(rank: int, world: int, ns_method: str) -> list[torch.Tensor]:
    """This rank's block of each test matrix's group Newton–Schulz, the sums by ``dist.all_reduce``."""
    out = []
    for shape in SHAPES:
        torch.manual_seed(7)
        matrices = torch.randn(2, *shape)
        tall = shape[0] > shape[1]
        lo, hi = block_bounds(max(shape), world)[rank : rank + 2]
        block = matrices[:, lo:hi] if tall else matrices[:, :, lo:hi]
        out.append(
            group_newton_schulz(
                block, shape=shape, group_size=world, ns_method=ns_method, all_reduce=lambda t: dist.all_reduce(t)
            )
        )
    return out


@pytest.mark.parametrize("ns_method", NS_METHODS)
def test_group_newton_schulz_on_gloo(pool2, ns_method):
    per_rank = pool2.run(_member_blocks, ns_method)
    for i, shape in enumerate(SHAPES):
        torch.manual_seed(7)
        matrices = torch.randn(2, *shape)
        group = torch.cat([blocks[i] for blocks in per_rank], dim=1 if shape[0] > shape[1] else 2).double()
        one_owner = newton_schulz(matrices, ns_method=ns_method).double()
        exact = exact_iteration(matrices, ns_method)
        for j in range(2):
            allowed = GROUP_RATIO * scale_ulps(one_owner[j] - exact[j], exact[j]) + 2 * BATCHED_ULPS
            assert scale_ulps(group[j] - exact[j], exact[j]) <= allowed, (shape, j)


# ---- the runtime: a model with one dominant matrix, its NS and storage over an owner group -----------------


def _train_groups(rank, world, mode, groups, tall=True):
    data = batches(STEPS)
    model = dominant_model(tall=tall)
    setup = distribute(model, mode, world, targets_fn=dominant_targets, owner_groups=groups, opt_kwargs=ADAMW_EPS)
    train(setup, data, rank, world)
    plan = setup.handle.plan
    big = next(e for e in plan.entries if e.fqn.endswith("big.weight"))
    return {
        "state": full_state(setup),
        "imbalance": plan.imbalance,
        "held": plan.numel_per_shard_rank,
        "group": None if big.group is None else big.group.size,
        "comm": setup.handle.pop_comm_stats(),
    }


def _max_over_mean(values):
    return max(values) / (sum(values) / len(values))


@pytest.mark.parametrize("mode, tall", [("z2", True), ("z3", False), ("hsdp", True)])
def test_a_dominant_matrix_over_an_owner_group_trains_as_torch_muon(pool4, mode, tall):
    """4 ranks (HSDP: 2 x 2): the dominant matrix's NS and storage split over its group (1-D: NS FLOPs and
    dedicated elements max/mean <= 1.3; > 3 with one owner on 4 ranks), and the weights after a few steps
    within GROUP_TOLERANCE of single-process torch.optim.Muon + AdamW and of the one-owner DMuon."""
    grouped = pool4.run(_train_groups, mode, TINY_GROUPS, tall)[0]
    alone = pool4.run(_train_groups, mode, None, tall)[0]
    assert alone["group"] is None and grouped["group"] is not None
    if mode != "hsdp":  # (HSDP 2 x 2: a group spans the 2 shard ranks of one row; the other row idles in NS)
        assert alone["imbalance"] > 3 and _max_over_mean(alone["held"]) > 3
        assert grouped["imbalance"] <= 1.3 and _max_over_mean(grouped["held"]) <= 1.3
    model = dominant_model(tall=tall)
    reference, _, _ = reference_train(
        model,
        batches(STEPS),
        targets_fn=dominant_targets,
        adamw={**ADAMW, **ADAMW_EPS},
        slices=4 if mode == "hsdp" else 1,
    )
    assert max_diff(alone["state"], reference) <= TOLERANCE
    assert max_diff(grouped["state"], reference) <= GROUP_TOLERANCE
    assert max_diff(grouped["state"], alone["state"]) <= GROUP_TOLERANCE


def _train_groups_accumulating(rank, world, sync, groups, bf16=False):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    data = batches(STEPS)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    setup = distribute(
        dominant_model(),
        "z3",
        world,
        targets_fn=dominant_targets,
        owner_groups=groups,
        opt_kwargs=ADAMW_EPS,
        mp_policy=policy,
    )
    train(setup, data, rank, world, accumulate=2, sync=sync)
    big = next(e for e in setup.handle.plan.entries if e.fqn.endswith("big.weight"))
    return {
        "state": full_state(setup),
        "group": None if big.group is None else big.group.size,
        "held": setup.handle.holds_unreduced_gradients,
    }


@pytest.mark.parametrize("sync", ["last", "deferred"])
def test_owner_groups_accumulate_and_reduce_once_as_pipelining_does(pool4, sync):
    """Z3, 4 ranks, two micro-batches per step with DMuon's gradient sync off until the last
    (FSDP2's gradient accumulation: "last") or off for both and one ``reduce_gradients()`` after them
    (a pipeline stage's pattern: "deferred"): each block's gradient is summed on its member and reduced
    once, and the weights match single-process torch.optim.Muon + AdamW on the whole batch and the
    one-owner job within GROUP_TOLERANCE (a block left unreduced, or reduced twice, is off by its
    whole gradient). In bf16 with fp32 reduces the same job equals the one that reduces every
    micro-batch (planted: the fp32 accumulator dropping the second micro-batch fails the "deferred" case)."""
    grouped = pool4.run(_train_groups_accumulating, sync, TINY_GROUPS)[0]
    alone = pool4.run(_train_groups_accumulating, sync, None)[0]
    assert grouped["group"] is not None and alone["group"] is None
    assert not grouped["held"] and not alone["held"]
    reference, _, _ = reference_train(
        dominant_model(), batches(STEPS), targets_fn=dominant_targets, adamw={**ADAMW, **ADAMW_EPS}
    )
    assert max_diff(grouped["state"], reference) <= GROUP_TOLERANCE
    assert max_diff(grouped["state"], alone["state"]) <= GROUP_TOLERANCE
    # bf16 compute, fp32 reduce: the micro-batches' gradients add up in fp32 accumulators (FSDP2's no-sync),
    # and the step equals the one that reduced each micro-batch (the same sums in another order)
    each = pool4.run(_train_groups_accumulating, "each", TINY_GROUPS, True)[0]
    accumulated = pool4.run(_train_groups_accumulating, sync, TINY_GROUPS, True)[0]
    assert accumulated["group"] is not None and not accumulated["held"]
    assert max_diff(accumulated["state"], each["state"]) <= TOLERANCE


def _ledger_of_groups(rank, world, mode):
    """DMuon's elements per step on this rank (2 steps recorded after 2 warm-up steps), by label."""
    from titan_dmuon import CommLedger
    from titan_dmuon.plan.cost_model import design_elements_per_rank, owner_group_elements_per_rank
    from titan_dmuon.runtime import CommLabel

    data = batches(4)
    setup = distribute(
        dominant_model(), mode, world, targets_fn=dominant_targets, owner_groups=TINY_GROUPS, opt_kwargs=ADAMW_EPS
    )
    train(setup, data[:2], rank, world)
    ledger = CommLedger()
    with ledger:
        train(setup, data[2:], rank, world)
    from titan_dmuon.math.group_newton_schulz import gram_all_reduces

    half = Fraction(1, 2)
    sums = ledger.select(source=CommLabel.GROUP_GRAM)
    mine = [e for e in setup.handle.plan.entries if e.group is not None and rank in e.group.ranks]
    return {
        "dmuon": ledger.elements(source=CommLabel.DMUON) * half,
        "gram": ledger.elements(source=CommLabel.GROUP_GRAM) * half,
        "kinds": {r.kind for r in sums},
        "groups": {r.group_ranks for r in sums},
        "mine": {e.group.ranks for e in mine},
        "launches": ledger.launches(source=CommLabel.GROUP_GRAM) * half,
        # (one call per batch: a unit's equally shaped weights of one group; each unit is its own chunk here)
        "design_launches": sum(
            gram_all_reduces(*shape, len(ranks)) for _, ranks, shape in {(e.unit, e.group.ranks, e.shape) for e in mine}
        ),
        "design": design_elements_per_rank(setup.handle),
        "design_gram": owner_group_elements_per_rank(setup.handle.plan),
    }


@pytest.mark.parametrize("mode", ["z3", "hsdp"])
def test_owner_groups_move_what_the_design_says(pool4, mode):
    """Counted by the CommLedger and averaged over the ranks: DMuon's traffic per step is
    ``design_elements_per_rank`` (forward broadcasts and backward reduces as one owner's, plus the
    groups' Gram and norm sums: ``owner_group_elements_per_rank``); each sum is one all-reduce on its group's
    own process group (its ranks, not the shard group's; no point-to-point ring), one launch per step of the
    iteration with the norm in the first (``gram_all_reduces``; a ring took 2 (k - 1) rounds per sum and
    one more sum for the norm)."""
    results = pool4.run(_ledger_of_groups, mode)
    mean = {key: sum((r[key] for r in results), Fraction(0)) / len(results) for key in ("dmuon", "gram")}
    assert all(r["design"] == results[0]["design"] for r in results)
    assert results[0]["design_gram"] > 0 and mean["gram"] == results[0]["design_gram"]
    assert mean["dmuon"] == results[0]["design"]
    for rank, r in enumerate(results):
        assert r["kinds"] == ({"all_reduce"} if r["mine"] else set()), rank
        assert r["groups"] == r["mine"]  # (the mesh's global ranks are the plan's r N + s here)
        assert r["launches"] == r["design_launches"]


def _clip_and_initialise(rank, world):
    """The global norm clipped at each step (a group's blocks are each counted once, on their members), and
    an initialiser run in FSDP2's form of each weight, whose values each member keeps its block of."""
    data = batches(2)
    setup = distribute(
        dominant_model(), "z3", world, targets_fn=dominant_targets, owner_groups=TINY_GROUPS, opt_kwargs=ADAMW_EPS
    )
    norms = [norm for _, norm, _ in train(setup, data, rank, world, max_norm=0.1)]
    layer = setup.model.layers[1]
    with setup.handle.initialising(layer.big, sharded=True), torch.no_grad():
        torch.manual_seed(5 + rank)  # (each rank draws its own shard, as with FSDP2)
        layer.big.weight.normal_()
        drawn = layer.big.weight.data.full_tensor()
    return norms, drawn, setup.handle.full_tensors()["layers.1.big.weight"]


def test_the_clip_counts_each_block_once_and_initialisers_keep_their_values(pool4):
    """clip_grad_norm_ over a model with an owner group: the same global norm as single-process
    torch.nn.utils.clip_grad_norm_ at step 1 (the same weights; gradients summed in another order: 1e-5,
    as test_correctness), within 1e-3 after (weights within GROUP_TOLERANCE); a block counted twice or not
    at all is off by far more. An initialiser's values (FSDP2's shards, assembled) are what the members keep."""
    results = pool4.run(_clip_and_initialise)
    _, ref_norms = reference_train(
        dominant_model(), batches(2), targets_fn=dominant_targets, max_norm=0.1, adamw={**ADAMW, **ADAMW_EPS}
    )[1:]
    for norms, drawn, kept in results:
        assert norms[0] == pytest.approx(ref_norms[0], rel=1e-5) and norms == pytest.approx(ref_norms, rel=1e-3)
        assert all(n > 0.1 for n in ref_norms)  # clipping was active
        assert torch.equal(drawn, kept)


WHOLE_MATRIX_RULES = {  # DMuon keyword -> what its refusal names
    "ns_mode": ("exact", "ns_mode 'exact'"),
    "normuon_beta2": (0.95, "NorMuon"),
    "ns_dtype": ("float16", "ns_dtype 'float16'"),
}


def _whole_matrix_rules_with_groups(rank, world):
    out = {}
    for key, (value, _) in WHOLE_MATRIX_RULES.items():
        try:
            distribute(
                dominant_model(),
                "z3",
                world,
                targets_fn=dominant_targets,
                owner_groups=TINY_GROUPS,
                opt_kwargs={key: value},
            )
            out[key] = None
        except ValueError as e:
            out[key] = str(e)
    return out


def test_whole_matrix_rules_refuse_owner_groups_on_every_rank(pool4):
    """ns_mode 'exact' (torch.optim.Muon's own update), NorMuon (statistics of whole rows) and the float16
    iteration (the group's Newton–Schulz is bf16) are properties of one owner: DMuon refuses a grouped
    weight under each when it is built, on every rank (also those outside the group), naming how to fix it
    (before, NorMuon and float16 ran the group's bf16 Muon on it without a word)."""
    for messages in pool4.run(_whole_matrix_rules_with_groups):
        for key, (_, named) in WHOLE_MATRIX_RULES.items():
            message = messages[key]
            assert message is not None and named in message, (key, message)
            assert "owner_groups=None" in message and "layers.1.big.weight" in message


def _groups_made(rank, world, mode):
    """The owner groups' process groups this rank holds, and what the ledger saw while they were made."""
    from titan_dmuon import CommLedger
    from titan_dmuon.runtime import CommLabel

    with CommLedger() as ledger:
        setup = distribute(
            dominant_model(), mode, world, targets_fn=dominant_targets, owner_groups=TINY_GROUPS, opt_kwargs=ADAMW_EPS
        )
    comm = setup.handle.owner_groups
    warm = [(r.kind, r.group_ranks, r.numel) for r in ledger.select(source=CommLabel.GROUP_WARM_UP)]
    return {
        "groups": {ranks: tuple(dist.get_process_group_ranks(g)) for ranks, g in comm.groups.items()},
        "warm": warm,
        "sizes": sorted({e.group.size for e in setup.handle.plan.entries if e.group}),
    }


@pytest.mark.parametrize("mode", ["z3", "hsdp"])
def test_each_group_size_gets_its_process_groups_once_and_warms_them_up(pool4, mode):
    """Every aligned slot of each size the plan uses, in every replicate row, is a process group made on
    every rank (this rank keeps those it is in: one per size), and each is warmed up by one all-reduce of
    one number, smallest first, when DMuon is built: every communicator exists before the first sum (a
    resume's first step may sum before any other collective of the group)."""
    results = pool4.run(_groups_made, mode)
    shard = 4 if mode == "z3" else 2
    for rank, r in enumerate(results):
        assert r["sizes"] and r["sizes"] == results[0]["sizes"]
        expected = {}
        for k in r["sizes"]:
            start = (rank // k) * k if mode == "z3" else (rank // shard) * shard + (rank % shard) // k * k
            expected[tuple(range(start, start + k))] = tuple(range(start, start + k))
        assert r["groups"] == expected, rank
        assert r["warm"] == [("all_reduce", ranks, 1) for ranks in sorted(expected, key=lambda t: (len(t), t))]


def _stages_make_the_same_groups(rank, world):
    """Two copies of a 2-rank dedication mesh in a 4-rank world (as two pipeline stages): the first copy's
    plan has a group of 2, the second dedicates nothing and joins."""
    from torch.distributed.device_mesh import init_device_mesh

    from titan_dmuon.runtime.comm import CommStats
    from titan_dmuon.runtime.mode import MeshInfo
    from titan_dmuon.runtime.owner_group_comm import OwnerGroupComm, join_owner_groups

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))["dp"]
    if rank < 2:
        comm = OwnerGroupComm(MeshInfo.from_mesh(mesh), CommStats(), {2})
        made = {ranks: tuple(dist.get_process_group_ranks(g)) for ranks, g in comm.groups.items()}
    else:
        join_owner_groups(mesh, GroupOptions())
        made = None
    after = dist.new_group(ranks=[0, 1, 2, 3])  # (a group every rank makes later gets one name everywhere)
    probe = torch.ones(1)
    dist.all_reduce(probe, group=after)
    return made, float(probe), after.group_name


def test_pipeline_stages_make_the_union_of_their_sizes(pool4):
    """The sizes are agreed over the world and every rank makes every copy's groups in one order, the stage
    that dedicates nothing too: no hang, and a group made after them by every rank has one name."""
    results = pool4.run(_stages_make_the_same_groups)
    assert results[0][0] == {(0, 1): (0, 1)} and results[1][0] == {(0, 1): (0, 1)}
    assert all(probe == 4.0 for _, probe, _ in results)
    assert len({name for _, _, name in results}) == 1


# ---- a state dict of another layout, loaded with load_state_dict ------------------------------------------
def _two_dominant(seed: int):
    """Two dominant matrices: on 4 ranks each splits over a group of 2 (ranks 0-1, 2-3), so every weight
    has ranks outside its group."""
    from tests.support.owner_groups_parts import DominantBlock

    model = dominant_model(seed)
    model.layers.append(DominantBlock(model.layers[0].dim, 2048, True))
    return model


def _load_another_layout(rank, world, which):
    """A trained job's dedicated weights (``which``: the grouped matrix only, or every one) handed to a
    fresh job's ``load_state_dict`` as DTensors ``Shard(0)`` over all 4 ranks (as another FSDP2 model's
    state dict gives them), on every rank; what each rank then holds, in full."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from titan_dmuon.runtime import canonical_fqn

    trained = distribute(
        _two_dominant(0), "z3", world, targets_fn=dominant_targets, owner_groups=TINY_GROUPS, opt_kwargs=ADAMW_EPS
    )
    train(trained, batches(2), rank, world)
    wanted = full_state(trained)
    fresh = distribute(
        _two_dominant(1), "z3", world, targets_fn=dominant_targets, owner_groups=TINY_GROUPS, opt_kwargs=ADAMW_EPS
    )
    dedicated = set(fresh.handle.full_tensors())
    grouped = [e.fqn for e in fresh.handle.plan.entries if e.group is not None]
    assert [e.group.size for e in fresh.handle.plan.entries if e.group is not None] == [2, 2]
    given_whole = set(grouped) if which == "grouped" else dedicated
    mesh = init_device_mesh("cpu", (world,))
    given = fresh.model.state_dict()  # (FSDP2's own weights as they are; a dedicated one only on its holders)
    for key, _ in fresh.model.named_parameters():  # (every rank, one order: distribute_tensor scatters)
        if canonical_fqn(key) in given_whole:
            given[key] = distribute_tensor(wanted[canonical_fqn(key)], mesh, [Shard(0)])
    fresh.model.load_state_dict(given, strict=False)
    loaded = full_state(fresh)
    return {
        "given": sorted(given_whole),
        "unequal": [n for n in given_whole if not torch.equal(loaded[n], wanted[n])],
        "dedicated": sorted(dedicated),
        "grouped": grouped,
    }


@pytest.mark.parametrize("which", ["grouped", "all"])
def test_another_layouts_dtensors_load_on_every_rank(pool4, which):
    """A DTensor laid out otherwise than ``state_dict()`` gives it is gathered whole by every rank of its
    mesh, holder or not, and each holder keeps its part: every dedicated weight (an owner group's and the
    one-owner ones) loads bit for bit. Bugs: only the group's members called ``full_tensor()``, an
    all-gather the other ranks never joined (``grouped``: on NCCL a hang; here gloo's timeout); a one-owner
    weight's holder copied the DTensor into its plain tensor (``all``: "mixed torch.Tensor and DTensor")."""
    results = pool4.run(_load_another_layout, which, timeout=90.0)
    assert results[0]["grouped"] and len(results[0]["dedicated"]) > len(results[0]["grouped"])
    assert results[0]["given"] == (results[0]["grouped"] if which == "grouped" else results[0]["dedicated"])
    assert [r["unequal"] for r in results] == [[]] * 4
