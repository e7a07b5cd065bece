"""Training with each Newton–Schulz method and each variant: llama3 debug loss curves, AdamW vs DMuon.

    python benchmarks/convergence.py [--steps 200] [--ngpu 2] [--last 20] [--out bench_out]
    python benchmarks/convergence.py --runs variants --local-batch-size 8   # AdamW, DMuon and its variants
    python benchmarks/convergence.py --from-raw bench_out/convergence_raw.json   # tables and PNG again

TorchTitan's llama3 debug model trains through run_train.sh on the bundled dataset (local batch 2 x 256
tokens per rank, ``[debug] seed = 0``, the same data order for every run) with FSDP2 + AdamW and with
DMuon-Z3 for each ``ns_methods.NS_METHODS`` method, plus DMuon with the default method from another seed
(``seed = 1``: other initial weights), so the table shows how far two runs of one method land apart
beside how far the methods do. The variants (``--runs variants``, or ``all``, the default): DMuon with
NorMuon (``normuon_beta2 = 0.95``), with per-head Newton–Schulz (``ns_blocks = "heads"``) and with float16
iteration (``ns_dtype = "float16"``). ``--local-batch-size`` sets the batch per rank (the template's 2 x 256
tokens by default). Prints the mean loss over the last ``--last`` steps per run (and its markdown), each
run's median optimizer-step time (steps after the first ``--last``, from the job's own log) beside DMuon's,
and writes one PNG of the loss curves (raw, faint; and a moving average of ``--last`` steps). The float16
rows are slow on a CPU without float16 GEMMs (AVX512-FP16, AMX-FP16): the step times are a GPU's question.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_debug_model import ADAMW, DMUON, NS_METHODS, ROOT, job_toml, train_args  # noqa: E402

LOSS = re.compile(r"step:\s+(\d+)\s+loss:\s+([\d.]+)")
OPTIMIZER_MS = re.compile(r"titan_dmuon: step [\d.]+s, optimizer ([\d.]+) ms")
BASE = f"DMuon, ns_method {NS_METHODS[0]}"  # the run the others' optimizer time is compared with
VARIANTS = {  # name -> the [optimizer] keys added to DMuon's
    "DMuon + NorMuon (normuon_beta2 0.95)": "normuon_beta2 = 0.95",
    "DMuon, per-head NS (ns_blocks heads)": 'ns_blocks = "heads"',
    "DMuon, float16 NS (ns_dtype float16)": 'ns_dtype = "float16"',
}


def runs(chosen: str = "all") -> dict[str, tuple[str, int]]:
    """name -> ([optimizer] table, seed): AdamW and DMuon always; ``chosen`` "methods" adds the other
    Newton–Schulz methods and DMuon from another seed, "variants" the variants, "all" both."""
    out = {"FSDP2+AdamW": (ADAMW, 0)}
    for method in NS_METHODS if chosen in ("methods", "all") else NS_METHODS[:1]:
        out[f"DMuon, ns_method {method}"] = (DMUON + f'\nns_method = "{method}"', 0)
    if chosen in ("methods", "all"):
        out[f"{BASE}, seed 1"] = (DMUON + f'\nns_method = "{NS_METHODS[0]}"', 1)
    if chosen in ("variants", "all"):
        for name, keys in VARIANTS.items():
            out[name] = (DMUON + "\n" + keys, 0)
    return out


def train(name: str, optimizer: str, seed: int, args, workdir: str) -> tuple[list[float], float | None]:
    """The run's loss per step, and its median optimizer-step time in ms from the job's log (None if it logs none)."""
    tag = re.sub(r"\W+", "_", name)
    path = os.path.join(workdir, tag + ".toml")
    with open(path, "w") as f:
        f.write(job_toml(optimizer, steps=args.steps, warmup_steps=10, seed=seed))
    env = {**os.environ, "CONFIG_FILE": path, "NGPU": str(args.ngpu), "PYTHON": sys.executable}
    extra = ["--training.local_batch_size", str(args.local_batch_size)] if args.local_batch_size else []
    out = subprocess.run(
        ["./run_train.sh", *train_args(workdir, None, tag), *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=12 * 3600,
    )
    if out.returncode != 0:
        sys.exit(f"{name} failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    losses = {int(m[1]): float(m[2]) for m in LOSS.finditer(out.stdout + out.stderr)}
    if sorted(losses) != list(range(1, args.steps + 1)):
        sys.exit(f"{name}: expected a loss for each of steps 1..{args.steps}, got {sorted(losses)[:5]}...")
    times = [float(m[1]) for m in OPTIMIZER_MS.finditer(out.stdout + out.stderr)][min(args.last, args.steps - 1) :]
    return [losses[s] for s in range(1, args.steps + 1)], (statistics.median(times) if times else None)


def table(curves: dict[str, list[float]], last: int, times: dict[str, float | None] | None = None) -> tuple[str, str]:
    """The text and markdown tables: mean loss over the last ``last`` steps (and vs AdamW), the final loss,
    and (``times``) the median optimizer-step time and its ratio to DMuon's."""
    times = times or {}
    base = statistics.fmean(curves["FSDP2+AdamW"][-last:])
    base_time = times.get(BASE)
    text = [
        f"{'run':<42}{'mean loss, last ' + str(last):>22}{'vs AdamW':>10}{'final loss':>12}"
        f"{'optimizer ms':>14}{'vs DMuon':>10}"
    ]
    steps = len(next(iter(curves.values())))
    md = [
        f"| run | mean loss over the last {last} steps | vs AdamW | loss at step {steps} | optimizer step, ms "
        "(median) | vs DMuon's |",
        "|---|---|---|---|---|---|",
    ]
    for name, losses in curves.items():
        mean = statistics.fmean(losses[-last:])
        ms = times.get(name)
        ms_text = f"{ms:.1f}" if ms is not None else "-"
        ratio = f"{ms / base_time:.2f}x" if ms is not None and base_time else "-"
        text.append(f"{name:<42}{mean:>22.4f}{mean - base:>+10.4f}{losses[-1]:>12.4f}{ms_text:>14}{ratio:>10}")
        md.append(f"| {name} | {mean:.4f} | {mean - base:+.4f} | {losses[-1]:.4f} | {ms_text} | {ratio} |")
    seeds = [statistics.fmean(curves[n][-last:]) for n in curves if n.startswith(BASE)]
    if len(seeds) < 2:
        return "\n".join(text), "\n".join(md)
    note = f"two seeds of ns_method {NS_METHODS[0]!r}: {abs(seeds[0] - seeds[1]):.4f} apart (the noise between runs)"
    return "\n".join(text + [note]), "\n".join(md + ["", note])


def plot(curves: dict[str, list[float]], last: int, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))  # 825 px at 110 dpi: legible at a docs page's width
    for name, losses in curves.items():
        steps = range(1, len(losses) + 1)
        (line,) = ax.plot(steps, losses, alpha=0.25, linewidth=0.8)
        window = [statistics.fmean(losses[max(0, i - last + 1) : i + 1]) for i in range(len(losses))]
        ax.plot(
            steps,
            window,
            color=line.get_color(),
            linewidth=1.8,
            label=name,
            linestyle="--" if "seed 1" in name else "-",
        )
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (faint: per step; bold: mean of the last {last})")
    ax.set_ylim(top=min(max(c[min(5, len(c) - 1)] for c in curves.values()) * 1.05, ax.get_ylim()[1]))
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--ngpu", type=int, default=2)
    parser.add_argument("--last", type=int, default=20, help="the table's mean is over this many last steps")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench_out"))
    parser.add_argument(
        "--runs",
        choices=("all", "methods", "variants"),
        default="all",
        help="AdamW and DMuon, plus the other Newton–Schulz methods, the variants, or both",
    )
    parser.add_argument("--local-batch-size", type=int, default=None, help="the batch per rank (default: the job's 2)")
    parser.add_argument(
        "--from-raw", metavar="JSON", help="only print the tables (and PNG) of an earlier run's raw file"
    )
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.from_raw:
        with open(args.from_raw) as f:
            raw = json.load(f)
        curves, times = (raw["loss"], raw["optimizer_ms"]) if "loss" in raw else (raw, {})  # (the older files: curves)
        args.steps = len(next(iter(curves.values())))
    else:
        curves, times = {}, {}
        with tempfile.TemporaryDirectory() as workdir:
            for name, (optimizer, seed) in runs(args.runs).items():
                print(f"{name} ...", flush=True)
                curves[name], times[name] = train(name, optimizer, seed, args, workdir)
        with open(os.path.join(args.out, "convergence_raw.json"), "w") as f:
            json.dump({"loss": curves, "optimizer_ms": times}, f, indent=1)
    batch = f", local batch {args.local_batch_size}" if args.local_batch_size else ""
    title = f"llama3 debug model, {args.ngpu} ranks{batch}, {args.steps} steps: AdamW vs DMuon-Z3 ({args.runs})"
    text, md = table(curves, min(args.last, args.steps), times)
    print(title)
    print(text)
    print()
    print(md)
    with open(os.path.join(args.out, "convergence.txt"), "w") as f:
        f.write(title + "\n" + text + "\n\n" + md + "\n")
    plot(curves, min(args.last, args.steps), os.path.join(args.out, "convergence.png"), title)


if __name__ == "__main__":
    main()
