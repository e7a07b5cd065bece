"""TP 2 x HSDP (2 x 2) on TorchTitan's tiny MoE models, against HSDP 2 x 4 without TP: 8 gloo ranks.

    python benchmarks/tp_moe_hsdp.py

The check of tests/titan/test_tensor_parallel_moe.py at 8 ranks (too slow for the suite on 2 CPU
cores): for the tiny qwen3 MoE (8 experts: kept per data-parallel rank, split by TP) and
deepseek_v3 (2 experts: dedicated, split by TP; MLA's wq_a/wkv_a and the router replicated), from
the same weights and batches, it prints the step-1 loss and gradient norm of both layouts, the
largest difference of the Muon and of the AdamW weights after 3 steps (the suite's tolerances:
2e-3, and 2 lr per step), the Newton-Schulz matrices of the last step summed over the ranks
(each matrix and expert once per replica group's owners: once in the job), and DMuon's traffic
averaged over the ranks next to the design.
"""

from __future__ import annotations

import os
import sys
from fractions import Fraction

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support import titan_harness as th  # noqa: E402, I001
from tests.support.helpers import merge_rank_states  # noqa: E402
from tests.support.pool import WorkerPool  # noqa: E402
from tests.support.tp_moe_jobs import LAYOUTS, MUON_WEIGHTS, tp_moe_model, train_tp_moe  # noqa: E402


def main() -> None:
    pool = WorkerPool(8)
    try:
        print(
            f"{'model':<12}{'layout':<22}{'step-1 loss':>13}{'grad norm':>11}{'NS/step':>9}"
            f"{'comm/rank':>12}{'design':>12}{'max Muon diff':>15}{'max AdamW diff':>16}"
        )
        for family, experts in LAYOUTS.items():
            state = th.initial_state(tp_moe_model(family, experts))
            runs = {"HSDP 2 x 4": pool.run(train_tp_moe, family, experts, state, 1, 1, None, 3, "dmuon", 2)}
            fresh = WorkerPool(8)  # (a worker's spmd_types annotations name the meshes of its first TP layout)
            try:
                runs["TP 2 x HSDP 2 x 2"] = fresh.run(train_tp_moe, family, experts, state, 2, 1, None, 3, "dmuon", 2)
            finally:
                fresh.close()
            reference = merge_rank_states(r["weights"] for r in runs["HSDP 2 x 4"])
            for layout, results in runs.items():
                weights = merge_rank_states(r["weights"] for r in results)
                diff = {k: (weights[k] - reference[k]).abs().max().item() for k in weights}
                muon = max(d for k, d in diff.items() if k.endswith(MUON_WEIGHTS))
                adamw = max(d for k, d in diff.items() if not k.endswith(MUON_WEIGHTS))
                moved = sum(Fraction(r["moved"]) for r in results) / len(results)
                print(
                    f"{family:<12}{layout:<22}{results[0]['losses'][0]:>13.6f}{results[0]['norms'][0]:>11.6f}"
                    f"{sum(r['ns'] for r in results):>9}{float(moved):>12.1f}{float(results[0]['design']):>12.1f}"
                    f"{muon:>15.2e}{adamw:>16.2e}"
                )
    finally:
        pool.close()


if __name__ == "__main__":
    main()
