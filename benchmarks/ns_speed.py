"""Newton–Schulz time per method, side by side in one run: each ``ns_methods.NS_METHODS`` method against "torch".

    python benchmarks/ns_speed.py                        # llama3 debug, qwen3 MoE experts, llama3 8B shapes
    python benchmarks/ns_speed.py --shapes 8b --rounds 5
    python benchmarks/ns_speed.py --shapes 70b --device cuda

For each (short, long) shape of ``benchmarks/ns_accuracy.py``'s models, a batch of as many matrices as
DMuon stacks in one call (``ns_methods.MAX_STACK_BYTES`` of bf16; one for the big ones) goes through
``ns_methods.newton_schulz`` once per method per round; the rounds interleave the methods (machine noise
hits them alike) after one warm-up call each. The table gives each method's median time per call and the
median over rounds of "torch"'s time divided by its own (> 1: faster than torch.optim.Muon's iteration),
beside the ratio of FLOPs (``ns_methods.ns_flops``) and whether "gram" runs Gram Newton–Schulz on the shape.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.ns_accuracy import SHAPES  # noqa: E402
from titan_dmuon.math import ns_methods  # noqa: E402


def batch_size(short: int, long: int) -> int:
    """How many (short, long) matrices DMuon orthogonalises in one call."""
    return max(1, ns_methods.MAX_STACK_BYTES // (2 * short * long))


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_methods(short: int, long: int, rounds: int, device) -> dict[str, list[float]]:
    """Seconds per call of each method, ``rounds`` interleaved rounds after a warm-up call each."""
    g = torch.Generator(device=device).manual_seed(0)
    stack = torch.randn(batch_size(short, long), short, long, generator=g, device=device).bfloat16()
    times: dict[str, list[float]] = {m: [] for m in ns_methods.NS_METHODS}
    for method in times:
        ns_methods.newton_schulz(stack, ns_method=method)
    for _ in range(rounds):
        for method in times:
            sync(device)
            start = time.perf_counter()
            ns_methods.newton_schulz(stack, ns_method=method)
            sync(device)
            times[method].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["debug", "moe", "8b"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    shapes = sorted({s for group in args.shapes for s in SHAPES[group]})
    print(
        f"Newton–Schulz (5 steps, bf16) per call, {args.rounds} interleaved rounds, {device.type}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    methods = ns_methods.NS_METHODS
    print(
        "| shape | batch | gram runs | "
        + " | ".join(f"{m} (s)" for m in methods)
        + " | "
        + " | ".join(f"torch / {m}: time (FLOPs)" for m in methods[1:])
        + " |"
    )
    print("|---|---|---|" + "---|" * (2 * len(methods) - 1))
    for short, long in shapes:
        times = time_methods(short, long, args.rounds, device)
        cells = [f"{statistics.median(times[m]):.3g}" for m in methods]
        for m in methods[1:]:
            speedup = statistics.median(t / o for t, o in zip(times["torch"], times[m]))
            flops = ns_methods.ns_flops(short, long) / ns_methods.ns_flops(short, long, ns_method=m)
            cells.append(f"{speedup:.2f}x ({flops:.2f}x)")
        gram = "yes" if ns_methods.uses_gram(short, long) else "no"
        print(f"| {short} x {long} | {batch_size(short, long)} | {gram} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
