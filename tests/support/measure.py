"""Counts a toy job's collectives and host syncs, for the tests that compare them with the design
(tests/distributed/test_ledger.py, test_moe.py, test_runtime.py, test_qk_clip.py)."""

from fractions import Fraction

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.helpers import baseline, batches, distribute, local_slice, make_mesh, toy_model, train
from titan_dmuon import CommLedger, clip_grad_norm_
from titan_dmuon.optim.optimizer import MUON_STEP_RANGE
from titan_dmuon.plan.cost_model import design_elements_per_rank
from titan_dmuon.runtime import CommLabel
from titan_dmuon.testing.toy_model import loss_fn

DMUON_MODES = {"dmuon_z2": "z2", "dmuon_z3": "z3", "dmuon_ddp": "ddp", "dmuon_hsdp": "hsdp"}


def ledger_figures(rank, world, config, dims, hsdp=False, **dedicate_kwargs):
    """Per-rank elements per step, over 2 steps recorded after 2 warm-up steps.

    Warm-up absorbs one-time traffic: DDP's bucket rebuild (2 tiny broadcasts
    in step 2) and DMuon-HSDP's first replica sync.
    """
    mesh = make_mesh("hsdp" if hsdp else "z3", world)
    model = toy_model(**dims)
    if config in DMUON_MODES:
        setup = distribute(model, DMUON_MODES[config], world, mesh=mesh, **dedicate_kwargs)
    else:
        kind, _, mode = config.rpartition("_")
        setup = baseline(model, kind, world, mesh=mesh, reshard=mode == "z3")
    data = batches(4, global_batch=world, vocab=dims["vocab_size"])
    train(setup, data[:2], rank, world)
    ledger = CommLedger()
    with ledger:
        for batch in data[2:]:
            xs, ys = local_slice(batch, rank, world)
            loss_fn(setup.module(xs), ys).backward()
            with ledger.phase("step"):
                setup.opt.step()
            setup.opt.zero_grad()
    half = Fraction(1, 2)
    handle = getattr(setup, "handle", None)
    return {
        "total": ledger.elements() * half,
        "dmuon": ledger.elements(source=CommLabel.DMUON) * half,
        "other": ledger.elements(source=CommLabel.OTHER) * half,
        "step": ledger.elements(phase="step") * half,
        "step_kinds": sorted({(r.source, r.kind) for r in ledger.select(phase="step")}),
        "dtypes": sorted({(r.source, str(r.dtype)) for r in ledger.records}),
        "launches": Fraction(ledger.launches(source=CommLabel.DMUON), 2),
        "other_launches": Fraction(ledger.launches(source=CommLabel.OTHER), 2),
        "kept": handle.kept_unit_numel if handle else 0,
        "design": design_elements_per_rank(handle) if handle else None,
        "first_unit": sum(e.numel for e in handle.plan.entries if e.unit == 0) if handle else 0,
        "units": len({e.unit for e in handle.plan.entries}) if handle else 0,
    }


class HostSyncCounter(TorchDispatchMode):
    """Counts ops that copy a tensor's value to the host (``.item()``, ``.tolist()``, ``bool(t)``).

    Tensors that are on the host by design on a GPU job too (AdamW's step counters,
    DeviceMesh's rank tensor) are listed in ``host_resident`` and not counted."""

    SYNCING = {
        torch.ops.aten._local_scalar_dense.default,
        torch.ops.aten.is_nonzero.default,
        torch.ops.aten.equal.default,
    }

    def __init__(self, host_resident):
        super().__init__()
        self.host_resident = host_resident
        self.syncs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.SYNCING:
            ptr = args[0].untyped_storage().data_ptr()
            if ptr not in self.host_resident:
                self.syncs.append(func.__name__)
        return func(*args, **(kwargs or {}))


def host_syncs_in_steady_steps(setup, rank, world, *, after_step=None) -> list:
    """Host syncs in 2 steady-state steps (forward, backward, DMuon's clip and step) after 2 warm-up
    steps (lazy init, layer order, optimizer state); ``after_step()`` runs outside the counted part."""
    data = batches(4)
    train(setup, data[:2], rank, world, max_norm=1.0)
    host_resident = {s["step"].untyped_storage().data_ptr() for s in setup.opt.state.values() if "step" in s}
    counter = HostSyncCounter(host_resident)
    for batch in data[2:]:
        x, y = local_slice(batch, rank, world)
        with counter:
            loss_fn(setup.module(x), y).backward()
            clip_grad_norm_(setup.model.parameters(), 1.0, dedicated=setup.handle)
            setup.opt.step()
            setup.opt.zero_grad()
        if after_step is not None:
            after_step()
    return counter.syncs


# ---- what the Muon step allocates (issue 40) ------------------------------------------------------------
def large_inside_the_muon_step(prof, limit: int):
    """[(op, bytes)] of the ops inside the one ``MUON_STEP_RANGE`` that allocated above ``limit`` bytes."""
    events = prof.events()
    ranges = [e.time_range for e in events if e.name == MUON_STEP_RANGE]
    assert len(ranges) == 1, ranges
    (step,) = ranges
    inside = [
        e
        for e in events
        if e.name != MUON_STEP_RANGE and step.start <= e.time_range.start and e.time_range.end <= step.end
    ]
    assert inside, "no op recorded inside the Muon step: the profiler read nothing"
    return [(_op_path(e), e.self_cpu_memory_usage) for e in inside if e.self_cpu_memory_usage > limit]


def _op_path(event) -> str:
    """The op and the ops it ran in, outermost first (what allocated, for the failure's message)."""
    names = []
    while event is not None and event.name != MUON_STEP_RANGE:
        names.append(event.name)
        event = event.cpu_parent
    return " < ".join(names)
