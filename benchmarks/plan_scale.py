"""The ownership plan at the scale of the largest jobs: how long ``build_plan`` takes, and the step's
Newton–Schulz critical path it leaves.

Synthetic specs, names and shapes only (no model is built):

* llama3 405B with q, k, v as separate weights: 126 layers x (wq, wk, wv, wo, w1, w2, w3) = 882 weights;
  dim 16384, 128 heads, 8 kv heads, FFN hidden 53248 (TorchTitan 0.3.0's ``405B`` flavor; TorchTitan
  fuses q/k/v into one ``wqkv`` of three NS blocks, the same NS FLOPs in 630 weights).
* DeepSeek-V3 671B's routed experts, each expert's matrix dedicated on its own: 61 layers x 256 experts x
  (w1, w2, w3) = 46,848 weights; dim 7168, expert hidden 2048.

Per mesh (replicate R x shard N): ``build_plan``'s time (best of ``--repeats``) beside the scan of every rank
it replaced (``tests/support/plan_reference.py``, timed once; the plans are compared), then from the plan: the
busiest rank's NS FLOPs (``max(plan.ns_flops_per_rank)``: ``step()`` waits for it), max/mean, and its time at
``--ns-tflops``. One weight's NS runs on one rank, so the largest weight's NS time is the floor of that
critical path however many ranks there are; past total/largest ranks the extra ranks stop shortening it.

The second table: the same meshes (and 1 x 8192 for llama3 405B) with and without owner groups
(``GroupOptions``: a dominant weight's NS and storage split over k ranks of its shard group): the weights
in groups and their sizes, the busiest rank's NS time per step (its FLOPs at ``--ns-tflops`` plus its
groups' Gram all-reduces at the stated bus bandwidths: ``plan.ns_seconds_per_rank``), that over the mean,
and the dedicated elements each shard rank keeps (``plan.numel_per_shard_rank``) max/mean.

The third (``--short-cube``): what a member of a group does with the short³ part of a standard step
(the polynomial b A + c A² of the s x s Gram matrix), per k, for llama3 405B's w1 and wq: every member
repeating it, none forming it (A applied twice to the block, the choice where the block is narrower
than s), or the members splitting A² by rows and all-gathering it (an extra all-gather of s² bf16 per
step): FLOPs per member, bytes per member, and the time at the stated rates.

    .venv/bin/python benchmarks/plan_scale.py               # docs/performance.md's table
    .venv/bin/python benchmarks/plan_scale.py --no-before   # without the scan (its 8192-rank rows take ~30 s)
    .venv/bin/python benchmarks/plan_scale.py --no-before --groups --short-cube   # docs/owner-groups.md
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support.plan_reference import reference_build_plan  # noqa: E402
from titan_dmuon.math.group_newton_schulz import GRAM_REDUCE_BYTES, packed_numel  # noqa: E402
from titan_dmuon.math.ns_methods import NS_STEPS  # noqa: E402
from titan_dmuon.plan.owner_groups import H200_BF16_TFLOPS, GroupOptions  # noqa: E402
from titan_dmuon.plan.ownership import build_plan
from titan_dmuon.plan.specs import MatrixSpec  # noqa: E402


def llama3_405b_specs() -> list[MatrixSpec]:
    dim, n_heads, n_kv_heads, hidden = 16384, 128, 8, 53248
    kv_dim = n_kv_heads * (dim // n_heads)
    shapes = {
        "wq": (dim, dim),
        "wk": (kv_dim, dim),
        "wv": (kv_dim, dim),
        "wo": (dim, dim),
        "w1": (hidden, dim),
        "w2": (dim, hidden),
        "w3": (hidden, dim),
    }
    return [
        MatrixSpec(fqn=f"layers.{layer}.{name}", shape=shape, unit=layer, blocks=(((0, shape[0]),),))
        for layer in range(126)
        for name, shape in shapes.items()
    ]


def deepseek_v3_expert_specs() -> list[MatrixSpec]:
    dim, expert_hidden, experts = 7168, 2048, 256
    shapes = {"w1": (expert_hidden, dim), "w2": (dim, expert_hidden), "w3": (expert_hidden, dim)}
    return [
        MatrixSpec(fqn=f"layers.{layer}.moe.experts.{name}.{e}", shape=shape, unit=layer, blocks=(((0, shape[0]),),))
        for layer in range(61)
        for name, shape in shapes.items()
        for e in range(experts)
    ]


MODELS = {"llama3 405B": llama3_405b_specs, "DeepSeek-V3 experts": deepseek_v3_expert_specs}
MESHES = {
    "llama3 405B": [(1, 64), (1, 1024), (8, 1024)],
    "DeepSeek-V3 experts": [(1, 64), (1, 1024), (8, 1024), (1, 8192)],
}
GROUP_MESHES = {
    "llama3 405B": [(1, 64), (1, 1024), (8, 1024), (1, 8192)],
    "DeepSeek-V3 experts": [(1, 64), (1, 1024), (8, 1024), (1, 8192)],
}


def best_time(fn, repeats: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--ns-tflops",
        type=float,
        default=H200_BF16_TFLOPS,
        help="Newton–Schulz throughput per rank for the critical-path times (default: the H200's "
        "bf16 matmul peak, so the times are lower bounds)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="build_plan timings per row (the best is shown)")
    parser.add_argument("--no-before", action="store_true", help="skip timing the scan of every rank")
    parser.add_argument("--quick", action="store_true", help="the 64-rank rows only (a smoke run)")
    parser.add_argument("--groups", action="store_true", help="also the table with and without owner groups")
    parser.add_argument("--short-cube", action="store_true", help="also the short-cube table (owner groups)")
    stated = GroupOptions().stated()  # (an H200's figures: the defaults where a plan is made without a device)
    parser.add_argument("--node-size", type=int, default=stated.node_size, help="ranks per node")
    parser.add_argument(
        "--intra-node-gbps",
        type=float,
        default=stated.intra_node_gbps,
        help="all-reduce bus bandwidth per rank inside a node, GB/s",
    )
    parser.add_argument(
        "--nic-gbps", type=float, default=stated.nic_gbps, help="network bandwidth per rank between nodes, GB/s"
    )
    parser.add_argument(
        "--latency-us",
        type=float,
        default=stated.latency_us,
        help="latency of one all-reduce inside a node, microseconds",
    )
    parser.add_argument(
        "--nic-latency-us",
        type=float,
        default=stated.nic_latency_us,
        help="latency of one all-reduce across nodes, microseconds",
    )
    args = parser.parse_args()
    options = GroupOptions(
        node_size=args.node_size,
        ns_tflops=args.ns_tflops,
        intra_node_gbps=args.intra_node_gbps,
        nic_gbps=args.nic_gbps,
        latency_us=args.latency_us,
        nic_latency_us=args.nic_latency_us,
        source="stated on the command line (defaults: an H200's)",
    )

    rate = args.ns_tflops * 1e12
    print(
        f"| model | weights M | mesh R x N | build_plan (after) | scan of every rank (before) | before/after | "
        f"busiest rank's NS | max/mean | busiest rank's NS at {args.ns_tflops:g} TFLOP/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    notes = []
    for model, make_specs in MODELS.items():
        specs = make_specs()
        costs = [s.ns_flops() for s in specs]
        total, largest = sum(costs), max(costs)
        notes.append(
            f"{model}: {total / 1e15:.1f} PFLOP of NS per step; the largest weight's NS (the floor) "
            f"{largest / 1e12:.1f} TFLOP = {1e3 * largest / rate:.1f} ms at {args.ns_tflops:g} TFLOP/s; "
            f"with one owner per weight, ranks beyond total/largest = {total / largest:,.0f} cannot shorten the "
            "critical path (owner groups can: --groups)"
        )
        for replicate_size, shard_size in MESHES[model][:1] if args.quick else MESHES[model]:
            after, plan = best_time(
                lambda: build_plan(specs, replicate_size=replicate_size, shard_size=shard_size), args.repeats
            )
            before_cells = ["–", "–"]
            if not args.no_before:
                before, reference = best_time(
                    lambda: reference_build_plan(specs, replicate_size=replicate_size, shard_size=shard_size), 1
                )
                if reference != plan:
                    raise SystemExit(f"{model} on {replicate_size} x {shard_size}: the plans differ")
                before_cells = [f"{before:.3f} s", f"{before / after:.0f}x"]
            busiest = max(plan.ns_flops_per_rank)
            print(
                f"| {model} | {len(specs):,} | {replicate_size} x {shard_size} | {after:.3f} s | "
                + " | ".join(before_cells)
                + f" | {busiest / 1e12:.1f} TFLOP | {plan.imbalance:.3f} | {1e3 * busiest / rate:.1f} ms |"
            )
    print()
    for note in notes:
        print(note)
    if not args.no_before:
        print("Every plan equals the scan's (owners, NS homes, digest).")
    if args.groups:
        print()
        groups_table(options, args.repeats, args.quick)
    if args.short_cube:
        print()
        short_cube_table(options)


def ns_seconds(plan, options: GroupOptions) -> list[float]:
    """Each rank's Newton–Schulz time per step: its FLOPs at ``options.ns_tflops`` plus its groups'
    all-reduces (``plan.ns_seconds_per_rank``); ``python -m titan_dmuon.sizing`` prints the same busiest
    rank for the same weights and mesh (``tests/unit/test_sizing_groups.py``)."""
    return plan.ns_seconds_per_rank(options)


def groups_table(options: GroupOptions, repeats: int, quick: bool) -> None:
    """Each model and mesh without and with owner groups (see the module's docstring)."""
    print(
        f"Owner groups at {options.ns_tflops:g} TFLOP/s per rank, all-reduces of {options.latency_us:g} us + bytes at "
        f"{options.intra_node_gbps:g} GB/s inside a node of {options.node_size} ranks and {options.nic_latency_us:g} "
        f"us + bytes at {options.nic_gbps:g} GB/s per rank between nodes:"
    )
    print()
    print(
        "| model | mesh R x N | groups | weights in groups (sizes) | busiest rank's NS (compute + all-reduces) | "
        "mean | max/mean | dedicated elements max/mean | build_plan |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for model, make_specs in MODELS.items():
        specs = make_specs()
        for replicate_size, shard_size in GROUP_MESHES[model][:1] if quick else GROUP_MESHES[model]:
            for chosen in (None, options):
                seconds, plan = best_time(
                    lambda: build_plan(specs, replicate_size=replicate_size, shard_size=shard_size, groups=chosen),
                    repeats,
                )
                times = ns_seconds(plan, options)
                mean = sum(times) / len(times)
                held = plan.numel_per_shard_rank
                grouped = [e.group.size for e in plan.entries if e.group is not None]
                sizes = ", ".join(f"{grouped.count(k)} x {k}" for k in sorted(set(grouped))) or "–"
                print(
                    f"| {model} | {replicate_size} x {shard_size} | {'on' if chosen else 'off'} | {sizes} | "
                    f"{1e3 * max(times):.1f} ms | {1e3 * mean:.1f} ms | {max(times) / mean:.3f} | "
                    f"{max(held) / (sum(held) / len(held)):.3f} | {seconds:.2f} s |"
                )


def short_cube_table(options: GroupOptions) -> None:
    """Per-member FLOPs and bytes of a standard step's three ways with the short³ part, per k."""
    rate, steps = options.flops_per_second(), NS_STEPS
    print(
        f"The short³ part, per member of a k-rank group, {steps} standard steps, at {options.ns_tflops:g} TFLOP/s "
        f"and the bus bandwidth of the group's link (inside a node up to {options.node_size} ranks):"
    )
    print()
    print(
        "| weight (s x l) | k | repeat b A + c A²: TFLOP, GB, ms | A applied twice: TFLOP, GB, ms | "
        "A² split + all-gather: TFLOP, GB, ms | chosen |"
    )
    print("|---|---|---|---|---|---|")
    for name, (short, long) in {"w1 (16384 x 53248)": (16384, 53248), "wq (16384 x 16384)": (16384, 16384)}.items():
        for k in (2, 4, 8, 16, 32):
            block = -(-long // k)
            gram = packed_numel(short) * GRAM_REDUCE_BYTES * steps  # summed over the group (an all-reduce)
            gather = short * short * 2 * steps  # A² in bf16, gathered (half an all-reduce's traffic and time)
            sums = (2 * (k - 1) / k * gram, options.all_reduce_seconds(gram, k))
            gathered = (sums[0] + (k - 1) / k * gather, sums[1] + options.all_reduce_seconds(gather, k) / 2)
            ways = {
                "repeat": (steps * (4 * short * short * block + 2 * short**3), *sums),
                "twice": (steps * 6 * short * short * block, *sums),
                "split": (steps * (4 * short * short * block + 2 * short**3 // k), *gathered),
            }
            cells = [
                f"{flops / 1e12:.1f}, {data / 1e9:.2f}, {1e3 * (flops / rate + seconds):.1f}"
                for flops, data, seconds in ways.values()
            ]
            chosen = "A twice" if block < short else "repeat"
            print(f"| {name} | {k} | " + " | ".join(cells) + f" | {chosen} |")


if __name__ == "__main__":
    main()
