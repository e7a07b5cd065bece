"""The communication table of docs/performance.md, measured by the CommLedger.

    python benchmarks/comm_table.py [--n 2 4 8 16 64]

For each configuration and shard-group size N, the toy transformer (dims
divisible by 64) trains a few steps on the fake process group, one
simulated rank at a time; the ledger counts the collectives issued on the
Muon-target weights and the table shows elements per rank per step in
units of P_M, averaged over all ranks, next to the design's formula.
(tests/distributed/test_ledger.py proves the same counts on real gloo groups at N = 2, 4
and asserts them at 8, 16, 64.)
"""

from __future__ import annotations

import argparse
import os
import sys
from fractions import Fraction

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

from tests.support.helpers import baseline, batches, distribute, local_slice, make_mesh, toy_model  # noqa: E402
from titan_dmuon import CommLedger, baseline_elements_per_rank  # noqa: E402
from titan_dmuon.plan.cost_model import design_elements_per_rank  # noqa: E402
from titan_dmuon.runtime import CommLabel  # noqa: E402
from titan_dmuon.testing.toy_model import loss_fn, muon_targets  # noqa: E402

DIMS = dict(dim=64, hidden_dim=128, n_kv_heads=4, vocab_size=128, n_layers=4)
ROWS = [  # label, how to build, theory name, replicate size
    ("naive FSDP2+Muon, reshard_after_forward=False", ("naive", False), "naive_fsdp_z2", 1),
    ("naive FSDP2+Muon, reshard_after_forward=True", ("naive", True), "naive_fsdp_z3", 1),
    ("DDP + Muon (all-reduce)", ("ddp_muon", None), "ddp_muon", 1),
    ("DMuon-Z2", ("dmuon", "z2"), "dmuon_z2", 1),
    ("DMuon-Z3", ("dmuon", "z3"), "dmuon_z3", 1),
    ("DMuon under DDP", ("dmuon", "ddp"), "dmuon_ddp", 1),
    ("DMuon-Z3 on HSDP, R = 2", ("dmuon", "hsdp"), "dmuon_z3", 2),
]


def muon_elements(kind, mode, theory: str, rank: int, world: int, hsdp: bool) -> tuple[Fraction, int, Fraction]:
    """Elements on the Muon-target weights per step on this simulated rank, P_M, and the design's
    figure (DMuon: its cost model for the handle, with the layer Z3 keeps; the baselines': theirs)."""
    model = toy_model(**DIMS)
    p_m = sum(p.numel() for p in muon_targets(model))
    p_other = sum(p.numel() for p in model.parameters()) - p_m
    mesh = make_mesh("hsdp" if hsdp else "z3", world)
    setup = (
        distribute(model, mode, world, mesh=mesh)
        if kind == "dmuon"
        else baseline(model, kind, world, mesh=mesh, reshard=bool(mode))
    )
    data = batches(4, global_batch=world, vocab=DIMS["vocab_size"])
    ledger = CommLedger()
    for i, batch in enumerate(data):
        x, y = local_slice(batch, rank, world)
        if i == 2:
            ledger.__enter__()
        loss_fn(setup.module(x), y).backward()
        setup.opt.step()
        setup.opt.zero_grad()
    ledger.__exit__(None, None, None)
    if kind == "dmuon":
        return ledger.elements(source=CommLabel.DMUON) / 2, p_m, design_elements_per_rank(setup.handle)
    # baselines move every parameter: subtract what the same collectives cost for the rest
    n = world
    rest = {"naive": (3 if mode else 2) * Fraction(n - 1, n) * p_other, "ddp_muon": 2 * Fraction(n - 1, n) * p_other}[
        kind
    ]
    return ledger.elements() / 2 - rest, p_m, baseline_elements_per_rank(theory, shard_size=n, numel=p_m)


def measure(row, n: int, replicate: int) -> tuple[Fraction, int, Fraction]:
    (kind, mode), theory = row
    world = n * replicate
    ranks = range(world) if replicate > 1 else [0]  # 1-D: every rank moves the same
    total, p_m, design = Fraction(0), 0, Fraction(0)
    for rank in ranks:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            elements, p_m, design = muon_elements(kind, mode, theory, rank, world, replicate > 1)
        finally:
            dist.destroy_process_group()
        total += elements
    return total / len(ranks), p_m, design


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[2, 4, 8, 16, 64])
    args = parser.parse_args()
    header = "| configuration | " + " | ".join(f"N = {n}" for n in args.n) + " | design (elements/rank/step) |"
    lines = [header, "|---" * (len(args.n) + 2) + "|"]
    formulas = {
        "naive_fsdp_z2": "3(N-1)/N",
        "naive_fsdp_z3": "4(N-1)/N",
        "ddp_muon": "2(N-1)/N",
        "dmuon_z2": "2(N-1)/N",
        "dmuon_z3": "(3 - 1/L)(N-1)/N",
        "dmuon_ddp": "2(N-1)/N",
    }
    for label, build, theory, replicate in ROWS:
        cells = []
        for n in args.n:
            measured, p_m, expected = measure((build, theory), n, replicate)
            mark = "" if measured == expected else " (!= design)"
            cells.append(f"{float(measured / p_m):.4f}{mark}")
        formula = formulas[theory] + (" + 2(R-1)/R / N" if replicate > 1 else "")
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {formula} x P_M |")
    print(
        f"Muon-target communication per rank per step, in units of P_M, measured by the CommLedger "
        f"(L = {DIMS['n_layers']} layers of equal size; Z3 keeps the last one from forward to backward)"
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
