"""How far DMuon's batched Newton–Schulz is from torch.optim.Muon's per-matrix call, on this machine.

    .venv/bin/python benchmarks/ns_deviation.py                     # this CPU's default kernels
    ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python benchmarks/ns_deviation.py   # another CPU's bf16 matmuls

For batches of B equally shaped matrices (the shapes of the toy model and of
TorchTitan's debug layers), the table gives the largest difference of the bf16
Newton–Schulz output from ``torch.optim._muon._zeropower_via_newtonschulz`` on
each matrix alone: in bf16 ulps at the output's largest magnitude (an element
near zero can be many of its own tiny ulps off while the update barely moves)
and as ``||difference||_F / ||output||_F``. The Muon update is ``adjusted_lr``
times this output, so these are the update's deviation per step.
``ns_mode="exact"`` is 0 by construction (the same call).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from titan_dmuon.math.ns_methods import NS_COEFFICIENTS, NS_EPS, NS_STEPS, newton_schulz  # noqa: E402

SHAPES = [(16, 32), (32, 16), (8, 8), (96, 32), (48, 32), (64, 64), (128, 64), (64, 256), (256, 768), (512, 256)]
BATCHES = [1, 2, 3, 4, 5, 6, 8, 12, 16]


def scale_ulps(difference: torch.Tensor, reference: torch.Tensor) -> float:
    """max |difference| in bf16 ulps at the reference's largest magnitude (bf16: 8 significant bits)."""
    top = reference.float().abs().max()
    ulp = 2.0 ** (torch.floor(torch.log2(top)) - 7)
    return float(difference.abs().max() / ulp)


def deviation(shape, batch: int, seed: int = 0) -> tuple[float, float]:
    """(max difference in bf16 ulps at the output's scale, relative Frobenius difference) of batched vs
    per-matrix Newton–Schulz on ``batch`` random matrices of ``shape``."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    torch.manual_seed(seed)
    stack = torch.randn(batch, *shape)
    batched = newton_schulz(stack).float()
    single = torch.stack([_zeropower_via_newtonschulz(m, NS_COEFFICIENTS, NS_STEPS, NS_EPS) for m in stack]).float()
    difference = batched - single
    return scale_ulps(difference, single), float(difference.norm() / single.norm())


def main() -> None:
    torch.set_num_threads(1)
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "default")
    print(f"batched vs per-matrix Newton–Schulz, ONEDNN_MAX_CPU_ISA={isa}, torch {torch.__version__}")
    print(f"{'shape':>12} {'batch sizes that differ':>26} {'max |diff| (ulps at scale)':>27} {'rel. Frobenius':>15}")
    worst = worst_rel = 0.0
    for shape in SHAPES:
        results = {b: deviation(shape, b) for b in BATCHES}
        differing = [b for b, (u, _) in results.items() if u]
        ulps = max(u for u, _ in results.values())
        rel = max(r for _, r in results.values())
        worst, worst_rel = max(worst, ulps), max(worst_rel, rel)
        print(f"{str(shape):>12} {str(differing or '-'):>26} {ulps:>27.2f} {rel:>15.2e}")
    print(f"largest deviation: {worst:.2f} bf16 ulps at the output's scale, {worst_rel:.2e} relative (Frobenius)")


if __name__ == "__main__":
    main()
