"""Side by side on this machine: TorchTitan's qwen3 MoE debug model with DMuon vs FSDP2+AdamW vs naive FSDP2+Muon.

    python benchmarks/bench_moe.py [--steps 4] [--seq 64] [--batch 2] [--ngpu 2] [--out bench_out]
                                   [--ns-methods torch polar_express gram] [--only FSDP2+AdamW DMuon]

TorchTitan's own ``qwen3_moe_debug`` (8 MoE layers, 64 experts of [768, 256],
top-8; 316M parameters) trains through run_train.sh with each optimizer, one
configuration after the other, FSDP2 on 2 ranks with TorchTitan's default
reshard policy (blocks reshard after forward: DMuon runs Z3). DMuon keeps the
3-D expert weights on FSDP2's dim-0 shards (whole experts per rank) and runs
per-expert Muon on them locally; attention projections and routers are
dedicated. naive FSDP2+Muon all-gathers every full gradient in the step
(experts included: one matrix per expert).

The full debug model costs 16-30 s per step on 2 CPU cores, so the defaults
are few steps at a short sequence: step time and optimizer share are medians
of steps 2+ (step 1 pays for warm-up); communication and launches per rank per
step come from the CommLedger (``count_all_comm``; launches as NCCL runs them,
see bench_debug_model.py);
loss is the last step's. Prints a table (and its markdown) and writes
bench_out/moe.png. By default each configuration initialises its weights from
``[debug] seed`` (DMuon's same-seed initialisation gives it TorchTitan's own
initial model: the same step-1 loss as AdamW's); ``--seed-checkpoint``
starts all three from one TorchTitan seed checkpoint (costs a ~1.3 GB write
and a load per run). ``--ns-methods``: one DMuon row per Newton–Schulz method ("DMuon" is "torch"'s,
"DMuon gram" ``ns_method = "gram"``'s).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_debug_model import (  # noqa: E402
    LINE,
    NS_METHODS,
    ROOT,
    bar_panels,
    job_args,
    job_env,
    rss_by_step,
    seed_checkpoint,
    train_args,
)

CONFIGS = {  # name -> [optimizer] table
    "FSDP2+AdamW": 'name = "AdamW"\nlr = 8e-4',
    "naive FSDP2+Muon": 'name = "naive_muon"\nlr = 0.02\nadamw_lr = 8e-4',
    "DMuon": 'name = "dmuon"\nlr = 0.02\nadamw_lr = 8e-4',
}

TEMPLATE = """
[job]
description = "MoE benchmark"
[model]
name = "qwen3"
flavor = "moe_debug"
hf_assets_path = "./assets/debug/tokenizer"
[optimizer]
{optimizer}
[lr_scheduler]
warmup_steps = 1
[training]
local_batch_size = {batch}
seq_len = {seq}
steps = {steps}
max_norm = 1.0
[dataloader]
dataset_path = "./assets/debug/text"
[parallelism]
fsdp_reshard_after_forward = "default"
[activation_checkpoint]
mode = "none"
[metrics]
log_freq = 1
disable_color_printing = true
count_all_comm = true
[debug]
seed = 0
"""

DMUON_LINE = re.compile(
    r"step:\s+(\d+)\s.*?\n.*?dmuon: comm ([\d.]+)M elements/rank/step \(([\d.]+) MB; design ([\d.]+)M"
    r".*?NS: (\d+) matrices on this rank, ([\d.]+) ms"
)


def optimizer_table(name: str) -> str:
    """The [optimizer] table of a configuration: CONFIGS', "DMuon <method>" with its ns_method."""
    if name in CONFIGS:
        return CONFIGS[name]
    method = name.removeprefix("DMuon ")
    return CONFIGS["DMuon"] + f'\nns_method = "{method}"'


def run(name: str, args, workdir: str, seed: str | None = None) -> tuple[list[dict], str]:
    path = os.path.join(workdir, re.sub(r"\W+", "_", name) + ".toml")
    with open(path, "w") as f:
        f.write(TEMPLATE.format(optimizer=optimizer_table(name), steps=args.steps, seq=args.seq, batch=args.batch))
    env = {**os.environ, **job_env(path, optimizer_table(name)), "NGPU": str(args.ngpu), "PYTHON": sys.executable}
    out = subprocess.run(
        ["./run_train.sh", *job_args(train_args(workdir, seed, re.sub(r"\W+", "_", name)), optimizer_table(name))],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    log = out.stdout + out.stderr
    if out.returncode != 0:
        sys.exit(f"{name} failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    rows = {}
    for m in LINE.finditer(log):
        rows[int(m[1])] = {
            "step": int(m[1]),
            "loss": float(m[2]),
            "rss_gib": float(m[3]),
            "step_s": float(m[4]),
            "opt_ms": float(m[5]),
            "comm_m": float(m[6]),
            "comm_mb": float(m[7]),
            "launches": float(m[8]),
            "launch_dmuon": float(m[9]) if m[9] else None,
        }
    for m in DMUON_LINE.finditer(log):
        if int(m[1]) in rows:
            rows[int(m[1])].update(
                dmuon_m=float(m[2]),
                dmuon_mb=float(m[3]),
                design_m=float(m[4]),
                ns_matrices=int(m[5]),
                ns_ms=float(m[6]),
            )
    return [rows[k] for k in sorted(rows)], log


def summarize(data: list[dict]) -> dict:
    steady = [d for d in data if d["step"] >= 2] or data

    def med(key):
        values = [d[key] for d in steady if d.get(key) is not None]
        return statistics.median(values) if values else None

    s = {
        k: med(k)
        for k in (
            "step_s",
            "opt_ms",
            "comm_m",
            "comm_mb",
            "launches",
            "launch_dmuon",
            "dmuon_m",
            "dmuon_mb",
            "design_m",
            "ns_matrices",
            "ns_ms",
        )
    }
    s["opt_share"] = s["opt_ms"] / 1e3 / s["step_s"]
    s["rss_gib"] = max(d["rss_gib"] for d in data)
    s["rss_by_step"] = {d["step"]: d["rss_gib"] for d in data}
    s["losses"] = [d["loss"] for d in data]
    s["loss"] = data[-1]["loss"]
    s["steps_used"] = [d["step"] for d in steady]
    return s


def _f(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def tables(summary: dict, title: str) -> tuple[str, str]:
    base = summary["FSDP2+AdamW"]
    text = [
        title,
        (
            f"{'configuration':<24}{'step time':>10}{'vs AdamW':>9}{'optim. share':>13}"
            f"{'comm M elem':>12}{'comm MB':>10}"
            f"{'vs AdamW':>9}{'launches':>9}{'(DMuon)':>8}{'peak RSS GiB':>13}{'vs AdamW':>9}{'loss':>8}"
        ),
    ]
    md = [
        "| configuration | step time | vs AdamW | optimizer share | comm / rank / step | vs AdamW "
        "| launches / rank / step (DMuon's) | peak RSS | vs AdamW | loss per step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        text.append(
            f"{name:<24}{s['step_s']:>9.2f}s{s['step_s'] / base['step_s']:>9.2f}{100 * s['opt_share']:>12.1f}%"
            f"{s['comm_m']:>12.4f}{s['comm_mb']:>10.2f}{s['comm_mb'] / base['comm_mb']:>9.4f}"
            f"{_f(s['launches'], '.0f'):>9}{_f(s['launch_dmuon'], '.0f'):>8}"
            f"{s['rss_gib']:>13.2f}{s['rss_gib'] / base['rss_gib']:>9.3f}{s['loss']:>8.3f}"
        )
        label = f"**{name.replace('DMuon ', 'DMuon, ns_method ')}**" if name.startswith("DMuon") else name
        md.append(
            f"| {label} | {s['step_s']:.2f} s | {s['step_s'] / base['step_s']:.2f} | {100 * s['opt_share']:.1f} % "
            f"| {s['comm_mb']:.2f} MB ({s['comm_m']:.4f}M elements) | {s['comm_mb'] / base['comm_mb']:.4f} "
            f"| {_f(s['launches'], '.0f')} ({_f(s['launch_dmuon'], '.0f')}) "
            f"| {s['rss_gib']:.2f} GiB | {s['rss_gib'] / base['rss_gib']:.3f} "
            f"| {', '.join(f'{x:.3f}' for x in s['losses'])} |"
        )
    text.append("")
    md.append("")
    by_step = {name: s["rss_by_step"] for name, s in summary.items()}
    for name in summary:
        if name != "FSDP2+AdamW":
            for line in rss_by_step(by_step, name, "FSDP2+AdamW"):
                text.append(line)
                md.append(f"- {line}")
    d = summary.get("DMuon", {})
    if d.get("dmuon_m") is not None:
        extra = (
            f"DMuon's own collectives: {d['dmuon_m']:.4f}M elements/rank/step ({d['dmuon_mb']:.2f} MB; design "
            f"{d['design_m']:.4f}M), NS {d['ns_matrices']} matrices on rank 0 in {d['ns_ms']:.0f} ms; "
            f"all collectives {d['comm_m']:.4f}M elements/rank/step vs FSDP2+AdamW's {base['comm_m']:.4f}M "
            f"(difference {d['comm_m'] - base['comm_m']:+.4f}M)"
        )
        text.append(extra)
        md.append("")
        md.append(extra)
    return "\n".join(text), "\n".join(md)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--ngpu", type=int, default=2)
    parser.add_argument("--only", nargs="+", choices=list(CONFIGS), help="run only these configurations")
    parser.add_argument(
        "--ns-methods",
        nargs="+",
        default=["torch"],
        choices=list(NS_METHODS),
        help="a DMuon row per Newton–Schulz method",
    )
    parser.add_argument("--out", default=os.path.join(ROOT, "bench_out"))
    parser.add_argument(
        "--seed-checkpoint",
        action="store_true",
        help="start every configuration from one TorchTitan seed checkpoint (same initial weights; "
        "without it DMuon's runs initialise other weights than TorchTitan's own for the same seed)",
    )
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    names = args.only or list(CONFIGS)
    if "FSDP2+AdamW" not in names:
        names = ["FSDP2+AdamW"] + names
    if "DMuon" in names:  # one DMuon row per method, "DMuon" being "torch"'s
        at = names.index("DMuon")
        names[at : at + 1] = ["DMuon" if m == "torch" else f"DMuon {m}" for m in args.ns_methods]
    summary = {}
    with tempfile.TemporaryDirectory() as workdir:
        seed = None
        if args.seed_checkpoint:
            print("seed checkpoint ...", flush=True)
            path = os.path.join(workdir, "seed.toml")
            with open(path, "w") as f:
                f.write(
                    TEMPLATE.format(
                        optimizer=optimizer_table("FSDP2+AdamW"), steps=args.steps, seq=args.seq, batch=args.batch
                    )
                )
            seed = seed_checkpoint(path, workdir)
        for name in names:
            print(f"{name} ...", flush=True)
            data, log = run(name, args, workdir, seed)
            with open(os.path.join(args.out, "moe_" + re.sub(r"\W+", "_", name) + ".log"), "w") as f:
                f.write(log)
            summary[name] = summarize(data)
    title = (
        f"qwen3 moe_debug, {args.ngpu} ranks, local batch {args.batch} x seq {args.seq}, {args.steps} steps per "
        f"configuration (times: medians of steps 2-{args.steps})"
    )
    text, md = tables(summary, title)
    print(text)
    print()
    print(md)
    with open(os.path.join(args.out, "moe.txt"), "w") as f:
        f.write(text + "\n\n" + md + "\n")
    plot(summary, os.path.join(args.out, "moe.png"), title)


def plot(summary: dict, path: str, title: str) -> None:
    bar_panels(
        summary,
        [
            ("step time (s)", "step_s", 1),
            ("optimizer step share (%)", "opt_share", 100),
            ("communication per rank per step (MB)", "comm_mb", 1),
            (f"loss at step {len(next(iter(summary.values()))['losses'])}", "loss", 1),
        ],
        path,
        title,
        height=1.6,
    )


if __name__ == "__main__":
    main()
