"""The ownership plan at the scale of the largest jobs: how long ``build_plan`` takes, and the step's
Newton–Schulz critical path it leaves.

Synthetic specs, names and shapes only (no model is built):

* llama3 405B with q, k, v as separate weights: 126 layers x (wq, wk, wv, wo, w1, w2, w3) = 882 weights;
  dim 16384, 128 heads, 8 kv heads, FFN hidden 53248 (TorchTitan 0.3.0's ``405B`` flavor; TorchTitan
  fuses q/k/v into one ``wqkv`` of three NS blocks, the same NS FLOPs in 630 weights).
* DeepSeek-V3 671B's routed experts, each expert's matrix dedicated on its own: 61 layers x 256 experts x
  (w1, w2, w3) = 46,848 weights; dim 7168, expert hidden 2048.

Per mesh (replicate R x shard N): ``build_plan``'s time (best of ``--repeats``) beside the scan of every rank
it replaced (``tests/plan_reference.py``, timed once; the plans are compared), then from the plan: the
busiest rank's NS FLOPs (``max(plan.ns_flops_per_rank)``: ``step()`` waits for it), max/mean, and its time at
``--ns-tflops``. One weight's NS runs on one rank, so the largest weight's NS time is the floor of that
critical path however many ranks there are; past total/largest ranks the extra ranks stop shortening it.

    .venv/bin/python benchmarks/plan_scale.py               # docs/performance.md's table
    .venv/bin/python benchmarks/plan_scale.py --no-before   # without the scan (its 8192-rank rows take ~30 s)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.plan_reference import reference_build_plan  # noqa: E402
from titan_dmuon.plan import MatrixSpec, build_plan  # noqa: E402
from titan_dmuon.sizing import H200_BF16_TFLOPS  # noqa: E402  (the rate python -m titan_dmuon.sizing uses too)


def llama3_405b_specs() -> list[MatrixSpec]:
    dim, n_heads, n_kv_heads, hidden = 16384, 128, 8, 53248
    kv_dim = n_kv_heads * (dim // n_heads)
    shapes = {"wq": (dim, dim), "wk": (kv_dim, dim), "wv": (kv_dim, dim), "wo": (dim, dim),
              "w1": (hidden, dim), "w2": (dim, hidden), "w3": (hidden, dim)}
    return [MatrixSpec(fqn=f"layers.{layer}.{name}", shape=shape, unit=layer, blocks=(((0, shape[0]),),))
            for layer in range(126) for name, shape in shapes.items()]


def deepseek_v3_expert_specs() -> list[MatrixSpec]:
    dim, expert_hidden, experts = 7168, 2048, 256
    shapes = {"w1": (expert_hidden, dim), "w2": (dim, expert_hidden), "w3": (expert_hidden, dim)}
    return [MatrixSpec(fqn=f"layers.{layer}.moe.experts.{name}.{e}", shape=shape, unit=layer,
                       blocks=(((0, shape[0]),),))
            for layer in range(61) for name, shape in shapes.items() for e in range(experts)]


MODELS = {"llama3 405B": llama3_405b_specs, "DeepSeek-V3 experts": deepseek_v3_expert_specs}
MESHES = {"llama3 405B": [(1, 64), (1, 1024), (8, 1024)],
          "DeepSeek-V3 experts": [(1, 64), (1, 1024), (8, 1024), (1, 8192)]}


def best_time(fn, repeats: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ns-tflops", type=float, default=H200_BF16_TFLOPS,
                        help="Newton–Schulz throughput per rank for the critical-path times (default: the H200's "
                             "bf16 matmul peak, so the times are lower bounds)")
    parser.add_argument("--repeats", type=int, default=3, help="build_plan timings per row (the best is shown)")
    parser.add_argument("--no-before", action="store_true", help="skip timing the scan of every rank")
    parser.add_argument("--quick", action="store_true", help="the 64-rank rows only (a smoke run)")
    args = parser.parse_args()

    rate = args.ns_tflops * 1e12
    print(f"| model | weights M | mesh R x N | build_plan (after) | scan of every rank (before) | before/after | "
          f"busiest rank's NS | max/mean | busiest rank's NS at {args.ns_tflops:g} TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    notes = []
    for model, make_specs in MODELS.items():
        specs = make_specs()
        costs = [s.ns_flops() for s in specs]
        total, largest = sum(costs), max(costs)
        notes.append(f"{model}: {total / 1e15:.1f} PFLOP of NS per step; the largest weight's NS (the floor) "
                     f"{largest / 1e12:.1f} TFLOP = {1e3 * largest / rate:.1f} ms at {args.ns_tflops:g} TFLOP/s; "
                     f"ranks beyond total/largest = {total / largest:,.0f} cannot shorten the critical path")
        for replicate_size, shard_size in MESHES[model][:1] if args.quick else MESHES[model]:
            after, plan = best_time(lambda: build_plan(specs, replicate_size=replicate_size, shard_size=shard_size),
                                    args.repeats)
            before_cells = ["–", "–"]
            if not args.no_before:
                before, reference = best_time(lambda: reference_build_plan(
                    specs, replicate_size=replicate_size, shard_size=shard_size), 1)
                if reference != plan:
                    raise SystemExit(f"{model} on {replicate_size} x {shard_size}: the plans differ")
                before_cells = [f"{before:.3f} s", f"{before / after:.0f}x"]
            busiest = max(plan.ns_flops_per_rank)
            print(f"| {model} | {len(specs):,} | {replicate_size} x {shard_size} | {after:.3f} s | "
                  + " | ".join(before_cells)
                  + f" | {busiest / 1e12:.1f} TFLOP | {plan.imbalance:.3f} | {1e3 * busiest / rate:.1f} ms |")
    print()
    for note in notes:
        print(note)
    if not args.no_before:
        print("Every plan equals the scan's (owners, NS homes, digest).")


if __name__ == "__main__":
    main()
