"""Context parallelism (CP): TorchTitan's CP on this CPU (the accommodation of integration/cpu.py),
and DMuon under CP, each against the same job without CP.

Every comparison starts both jobs from the same weights (TorchTitan's random init depends on the FSDP
mesh, which CP enlarges: a seed checkpoint or ``state=`` gives both the same start) and gives them the
same global batch: without CP each data-parallel rank takes whole sequences, with CP 2 each sequence
is cut in 4 chunks and rank r of the cp pair takes chunks r and 3-r (TorchTitan's head-tail load
balancer), its attention reading every key at or before its queries' positions. Parameters are kept
in fp32 (``param_dtype``) so the jobs compute the same sums in other orders: the step-1 loss and
gradient norm agree to 1e-5 and 1e-4 relative. With DMuon, bf16 Newton-Schulz turns last-bit gradient
differences into ~1 bf16 ulp of an update: weights within TOLERANCE (test_correctness.py's reasoning).
"""

from fractions import Fraction

import pytest
import torch

from tests import titan_harness as th  # noqa: I001 (enables the CPU accommodations first)

from tests.helpers import TOLERANCE, full_parameters, merge_rank_states  # noqa: E402

STEPS = 3
LAYERS = 2


def _model():
    return th.tiny_llama3(n_layers=LAYERS)


def _data(global_batch: int):
    return th.batches(STEPS, 1, batch=global_batch)


def _job(rank, world, state, settings: dict):
    """One job of the tiny llama3 from ``state`` (``settings``: cp, replicate, tp, optimizer, global_batch
    and the optimizer's options): losses, gradient norms, the full weights, DMuon's traffic per step
    (the last two steps) and its design figure, QK-clip's maxima."""
    settings = dict(settings)
    cp, replicate, tp = (settings.pop(k, 1) for k in ("cp", "replicate", "tp"))
    optimizer, global_batch = settings.pop("optimizer", "dmuon"), settings.pop("global_batch", 4)
    from titan_dmuon.cost_model import design_elements_per_rank
    from titan_dmuon.ledger import CommLedger

    dims = th.parallel_dims(world, replicate=replicate, tp=tp, cp=cp)
    model, container = th.build(_model(), dims, optimizer=optimizer, state=state, lr=0.02, param_dtype="float32",
                                **settings)
    data, norms = _data(global_batch), []
    losses = th.train(model, container, dims, data[:1], norms=norms)
    handles = container.dmuon_optimizers()[0].dedicated_handles() if optimizer == "dmuon" else []
    for handle in handles:
        handle.pop_comm_stats()
    with CommLedger() as counted:
        losses += th.train(model, container, dims, data[1:], norms=norms)
    out = {"losses": losses, "norms": norms, "weights": full_parameters(model, handles[0] if handles else None),
           "other": counted.elements(source="other") / (STEPS - 1)}
    if handles:
        (handle,) = handles
        stats = handle.pop_comm_stats()
        opt = container.dmuon_optimizers()[0]
        out.update(moved=sum(e for e, _, _ in stats.values()) / (STEPS - 1), design=design_elements_per_rank(handle),
                   shard_size=handle.mode.mesh.shard_size, momentum=_momentum(opt, handle), ns=opt.last_step_stats["ns_matrices"])
        if opt.qk_clip is not None:
            out["max_logits"] = opt.qk_clip.max_logits_by_layer()
    return out


def _momentum(opt, handle) -> dict:
    """The owners' momentum buffers by weight name (this rank's)."""
    names = {id(m.param): m.fqn for m in handle.members}
    return {names[id(p)]: s["momentum_buffer"].clone() for p, s in opt.state.items()
            if id(p) in names and "momentum_buffer" in s}


def _assert_same_training(a: list, b: list, *, weights=TOLERANCE):
    """Step-1 loss and norm to 1e-5/1e-4 (fp32 sums in other orders), the losses after, the weights."""
    assert a[0]["losses"][0] == pytest.approx(b[0]["losses"][0], rel=1e-5)
    assert a[0]["norms"][0] == pytest.approx(b[0]["norms"][0], rel=1e-4)
    assert a[0]["losses"] == pytest.approx(b[0]["losses"], rel=1e-4)
    wa, wb = merge_rank_states(r["weights"] for r in a), merge_rank_states(r["weights"] for r in b)
    assert wa.keys() == wb.keys()
    diff = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    assert diff < weights, diff


@pytest.fixture(scope="module")
def state():
    return th.initial_state(_model())


@pytest.fixture(scope="module")
def fsdp2(pool2, state):
    return {opt: pool2.run(_job, state, {"optimizer": opt}) for opt in ("AdamW", "dmuon")}


@pytest.fixture(scope="module")
def cp2(pool2, state):
    return {opt: pool2.run(_job, state, {"cp": 2, "optimizer": opt}) for opt in ("AdamW", "dmuon")}


def test_titans_adamw_under_cp_trains_as_without_cp(fsdp2, cp2):
    """The CPU accommodation, with TorchTitan's own AdamW: CP 2 (one sequence cut between the two
    ranks) trains as FSDP 2 (each rank a whole sequence) on the same global batch: step-1 loss and
    gradient norm to fp32 reduction order, weights after 3 steps within TOLERANCE, 5% of one step's
    update (lr 0.02; Adam divides each gradient element by its own running magnitude, so an element
    whose gradient is near 0 turns a last-bit difference into a visible one)."""
    _assert_same_training(cp2["AdamW"], fsdp2["AdamW"])


def test_dmuon_under_cp_trains_as_without_cp(fsdp2, cp2):
    """DMuon under CP 2 (its dedication group: the 2 cp ranks, which sum each weight's gradient)
    trains as DMuon on FSDP 2, Newton-Schulz once per matrix in the job."""
    _assert_same_training(cp2["dmuon"], fsdp2["dmuon"])
    assert [r["shard_size"] for r in cp2["dmuon"]] == [2, 2]
    assert sum(r["ns"] for r in cp2["dmuon"]) == sum(r["ns"] for r in fsdp2["dmuon"]) == 7 * LAYERS


def test_dmuon_traffic_under_cp_is_the_design(fsdp2, cp2):
    """DMuon's collectives under CP 2 are the design's figure for a shard group of 2 (Z3) and what it
    moves on FSDP 2; FSDP2's own traffic (the other parameters) and TorchTitan's CP all-gathers of k
    and v are the rest."""
    moved = [Fraction(r["moved"]) for r in cp2["dmuon"]]
    assert sum(moved) / 2 == cp2["dmuon"][0]["design"] == fsdp2["dmuon"][0]["design"] > 0
