"""Side by side on this machine: DMuon-Z2/Z3 vs FSDP2+AdamW vs naive FSDP2+Muon.

    python benchmarks/bench_debug_model.py [--steps 10] [--rounds 2] [--ngpu 2] [--out bench_out]
                                           [--ns-methods torch polar_express gram] [--no-naive]
                                           [--seed-checkpoint] [--from-raw bench_out/debug_model_raw.json]

Trains TorchTitan's llama3 debug model with each configuration through
run_train.sh (rounds interleave the configurations, so machine noise hits all
of them alike; all start from the same weights: the same ``[debug] seed`` gives
DMuon TorchTitan's own initial model, or ``--seed-checkpoint`` loads one TorchTitan
seed checkpoint in every run), then prints one table of ratios against FSDP2+AdamW (same
reshard mode) and writes bench_out/debug_model.png. Times are medians over
the steps after the first two; communication is counted by the CommLedger
(every collective of a step, FSDP2's included), and so are launches per rank
per step, as NCCL runs them (``CommLedger.launch_groups()``: each of DMuon's
groups, one unit in one direction, is one coalesced launch; gloo here runs a
group's broadcasts/reduces one by one). Memory: the rank's peak RSS (CPU; peak device memory on GPU) and DMuon's
packed-buffer peak, which is P_M per rank in Z2 and about two layers in Z3. DMuon's host time per
step (its hooks and optimizer step; on a CPU this includes the work itself and gloo's waits) and how
long the next forward's first layer waited for its weights (its broadcast starts in the step, as
soon as that layer is updated) come from DMuon's log line. ``--ns-methods``: one DMuon-Z3 and one
DMuon-Z2 row per Newton–Schulz method (``[optimizer] ns_method``; default "torch" only).

Needs matplotlib for the plot (pip install -e '.[bench]').
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from titan_dmuon.muon_math import NS_METHODS  # noqa: E402

ADAMW = 'name = "AdamW"\nlr = 8e-4'
NAIVE = 'name = "naive_muon"\nlr = 0.05\nadamw_lr = 8e-4'
DMUON = 'name = "dmuon"\nlr = 0.05\nadamw_lr = 8e-4'
# The naive baseline is not part of DMuon: its rows run through its config module (benchmarks/naive_muon_job.py,
# whose optimizer config builds a container that builds it), on TorchTitan's entry point.
NAIVE_JOB = {"MODULE": "benchmarks.naive_muon_job", "CONFIG": "from_toml"}
NAIVE_JOB_FILE = "NAIVE_MUON_CONFIG_FILE"  # naive_muon_job.CONFIG_FILE_ENV (not imported: it imports TorchTitan)


def job_env(config_path: str, optimizer: str) -> dict[str, str]:
    """run_train.sh's variables for the job of ``config_path`` with this [optimizer] table: the TOML
    door, or the naive baseline's config module reading the same file."""
    if is_naive(optimizer):
        return {**NAIVE_JOB, NAIVE_JOB_FILE: config_path}
    return {"CONFIG_FILE": config_path}


def is_naive(optimizer: str) -> bool:
    return 'name = "naive_muon"' in optimizer


def job_args(args: list[str], optimizer: str) -> list[str]:
    """``train_args`` as the job's door spells them: TorchTitan's entry point (the naive rows) has the
    dump folder at the top (``--dump_folder``), the TOML door under ``[job]``."""
    if not is_naive(optimizer):
        return args
    return ["--dump_folder" if a == "--job.dump_folder" else a for a in args]


def configurations(ns_methods=("torch",), naive: bool = True) -> dict[str, tuple[str, str]]:
    """name -> ([optimizer] table, fsdp_reshard_after_forward), Z3 then Z2: AdamW, naive, DMuon per method
    ("DMuon Z3" is "torch"'s; "DMuon Z3 gram" another method's)."""
    out = {}
    for mode, reshard in (("Z3", "always"), ("Z2", "never")):
        out[f"FSDP2+AdamW {mode}"] = (ADAMW, reshard)
        if naive:
            out[f"naive FSDP2+Muon {mode}"] = (NAIVE, reshard)
        for method in ns_methods:
            name = f"DMuon {mode}" if method == "torch" else f"DMuon {mode} {method}"
            out[name] = (DMUON if method == "torch" else DMUON + f'\nns_method = "{method}"', reshard)
    return out


CONFIGS = configurations()

TEMPLATE = """
[job]
description = "benchmark"
[model]
name = "llama3"
flavor = "debugmodel"
hf_assets_path = "./assets/debug/tokenizer"
[optimizer]
{optimizer}
[lr_scheduler]
warmup_steps = {warmup_steps}
[training]
local_batch_size = 2
seq_len = 256
steps = {steps}
[dataloader]
dataset_path = "./assets/debug/text"
[parallelism]
fsdp_reshard_after_forward = "{reshard}"
[activation_checkpoint]
mode = "none"
[metrics]
log_freq = 1
disable_color_printing = true
count_all_comm = true
[debug]
seed = {seed}
"""


def job_toml(optimizer: str, *, steps: int, reshard: str = "always", warmup_steps: int = 2, seed: int = 0) -> str:
    """The llama3 debug job every benchmark of this model runs, with this ``[optimizer]`` table."""
    return TEMPLATE.format(optimizer=optimizer, steps=steps, reshard=reshard, warmup_steps=warmup_steps, seed=seed)

LINE = re.compile(
    r"step:\s+(\d+)\s+loss:\s+([\d.]+).*?memory:\s+([\d.]+)GiB.*?\n.*?titan_dmuon: step ([\d.]+)s, optimizer ([\d.]+) ms"
    r"\s+all comm ([\d.]+)M elements/rank/step \(([\d.]+) MB; ([\d.]+) launches\)"
    r"(?:\s+dmuon: comm .*?; ([\d.]+) launches\))?(?:.*?peak buffers ([\d.]+) MB)?"
    r"(?:\s+host ([\d.]+) ms\s+first layer waited ([\d.]+) ms)?"
)


def seed_checkpoint(config_path: str, workdir: str, extra: tuple = ()) -> str:
    """One set of initial weights for every configuration: TorchTitan's seed checkpoint (1 rank).
    (The same ``[debug] seed`` gives every configuration the same weights too; this also holds
    when a configuration's own layout would not.)"""
    folder = os.path.join(workdir, "seed")
    env = {**os.environ, "CONFIG_FILE": config_path, "NGPU": "1", "PYTHON": sys.executable}
    out = subprocess.run(
        ["./run_train.sh", "--job.dump_folder", folder, "--checkpoint.enable", "true",
         "--checkpoint.create_seed_checkpoint", "true", "--parallelism.data_parallel_shard_degree", "1", *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )
    if out.returncode != 0:
        sys.exit(f"seed checkpoint failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return os.path.join(folder, "checkpoint", "step-0")


def train_args(workdir: str, seed: str | None, tag: str) -> list[str]:
    """run_train.sh arguments: a fresh dump folder per run (so no run resumes another's checkpoint)
    and, with a seed checkpoint, its weights as the initial ones."""
    folder = os.path.join(workdir, "out", tag)
    shutil.rmtree(folder, ignore_errors=True)
    args = ["--job.dump_folder", folder]
    if seed is not None:  # (TorchTitan's flag spelling, which both doors take)
        args += ["--checkpoint.enable", "--checkpoint.initial_load_path", seed, "--checkpoint.interval", "100000"]
    return args


def run(name: str, steps: int, ngpu: int, workdir: str, seed: str | None = None, configs=CONFIGS) -> list[dict]:
    optimizer, reshard = configs[name]
    path = os.path.join(workdir, re.sub(r"\W+", "_", name) + ".toml")
    with open(path, "w") as f:
        f.write(job_toml(optimizer, steps=steps, reshard=reshard))
    env = {**os.environ, **job_env(path, optimizer), "NGPU": str(ngpu), "PYTHON": sys.executable}
    out = subprocess.run(
        ["./run_train.sh", *job_args(train_args(workdir, seed, re.sub(r"\W+", "_", name)), optimizer)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )
    if out.returncode != 0:
        sys.exit(f"{name} failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    rows = []
    for m in LINE.finditer(out.stdout + out.stderr):
        rows.append({
            "step": int(m[1]), "loss": float(m[2]), "rss_gib": float(m[3]), "step_s": float(m[4]),
            "opt_ms": float(m[5]), "comm_m": float(m[6]), "comm_mb": float(m[7]),
            # launches per rank per step as NCCL runs them (a DMuon group once; gloo runs it one by one)
            "launches": float(m[8]), "launch_dmuon": float(m[9]) if m[9] else None,
            "buffers_mb": float(m[10]) if m[10] else 0.0,
            "host_ms": float(m[11]) if m[11] else None, "first_wait_ms": float(m[12]) if m[12] else None,
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ngpu", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench_out"))
    parser.add_argument(
        "--seed-checkpoint", action="store_true",
        help="start every run from one TorchTitan seed checkpoint (the same [debug] seed gives the same weights too)",
    )
    parser.add_argument("--from-raw", metavar="JSON", help="only print the tables (and PNG) of an earlier run's debug_model_raw.json")
    parser.add_argument("--ns-methods", nargs="+", default=["torch"], choices=list(NS_METHODS),
                        help="a DMuon-Z3 and a DMuon-Z2 row per Newton–Schulz method")
    parser.add_argument("--no-naive", action="store_true", help="leave out the naive FSDP2+Muon rows")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.from_raw:
        with open(args.from_raw) as f:
            rows = json.load(f)
        args.rounds = len({d["round"] for data in rows.values() for d in data})
    else:
        rows = measure(args)
        with open(os.path.join(args.out, "debug_model_raw.json"), "w") as f:
            json.dump(rows, f, indent=1)

    summary = {name: summarize(data, args.steps) for name, data in rows.items()}
    table = text_table(summary, f"llama3 debug model, {args.ngpu} ranks, {args.rounds} rounds x {args.steps} steps (medians of steps 3+)")
    markdown = markdown_table(summary, args.steps)
    print(table)
    print()
    print(markdown)
    with open(os.path.join(args.out, "debug_model.txt"), "w") as f:
        f.write(table + "\n\n" + markdown + "\n")
    plot(summary, os.path.join(args.out, "debug_model.png"))


def measure(args) -> dict[str, list[dict]]:
    """Every configuration, round after round; rows of steps 3+ tagged with their round."""
    configs = configurations(args.ns_methods, naive=not args.no_naive)
    rows: dict[str, list[dict]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as workdir:
        seed = None
        if args.seed_checkpoint:
            print("seed checkpoint ...", flush=True)
            path = os.path.join(workdir, "seed.toml")
            with open(path, "w") as f:
                f.write(job_toml(ADAMW, steps=args.steps))
            seed = seed_checkpoint(path, workdir)
        for r in range(args.rounds):
            for name in configs:
                print(f"round {r + 1}/{args.rounds}: {name} ...", flush=True)
                rows[name] += [{**row, "round": r}
                               for row in run(name, args.steps, args.ngpu, workdir, seed, configs) if row["step"] > 2]
    return rows


def _median(data: list[dict], key: str):
    values = [d[key] for d in data if d.get(key) is not None]
    return statistics.median(values) if values else None


def summarize(data: list[dict], steps: int) -> dict:
    step = _median(data, "step_s")
    opt = _median(data, "opt_ms") / 1e3
    out = {
        "step_s": step, "opt_share": opt / step, "comm_m": _median(data, "comm_m"), "comm_mb": _median(data, "comm_mb"),
        "rss_gib": max(d["rss_gib"] for d in data), "buffers_mb": max(d["buffers_mb"] for d in data),
        "loss": statistics.median(d["loss"] for d in data if d["step"] == steps),
    }
    ordered = sorted(d["step_s"] for d in data)
    out["step_p10"] = ordered[int(0.1 * (len(ordered) - 1))]  # the less disturbed steps on a shared machine
    per_round = [statistics.median(d["step_s"] for d in data if d["round"] == r) for r in sorted({d["round"] for d in data})]
    out["round_spread"] = (min(per_round), max(per_round))  # step-time medians of the single rounds
    for key in ("launches", "launch_dmuon", "host_ms", "first_wait_ms"):
        out[key] = _median(data, key)
    return out


def _base(summary: dict, name: str) -> dict:
    return summary["FSDP2+AdamW " + re.search(r"Z[23]", name)[0]]


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def text_table(summary: dict, title: str) -> str:
    header = (
        f"{'configuration':<30}{'step time':>10}{'vs AdamW':>9}{'optim. share':>13}{'comm M elem':>12}"
        f"{'comm MB':>9}{'vs AdamW':>9}{'launches':>9}{'(DMuon)':>8}{'vs AdamW':>9}"
        f"{'peak RSS GiB':>13}{'DMuon buf MB':>13}{'final loss':>11}{'p10 step':>10}{'vs AdamW':>9}   rounds' step-time medians"
    )
    lines = [title, header]
    for name, s in summary.items():
        base = _base(summary, name)
        ratio = s["launches"] / base["launches"]
        lines.append(
            f"{name:<30}{s['step_s']:>9.3f}s{s['step_s'] / base['step_s']:>9.2f}{100 * s['opt_share']:>12.1f}%"
            f"{s['comm_m']:>12.4f}{s['comm_mb']:>9.3f}{s['comm_mb'] / base['comm_mb']:>9.3f}"
            f"{s['launches']:>9.0f}{_fmt(s['launch_dmuon'], '.0f'):>8}{ratio:>9.2f}"
            f"{s['rss_gib']:>13.2f}{s['buffers_mb']:>13.2f}{s['loss']:>11.3f}"
            f"{s['step_p10']:>9.3f}s{s['step_p10'] / base['step_p10']:>9.2f}   {s['round_spread'][0]:.3f}-{s['round_spread'][1]:.3f}s"
        )
    return "\n".join(lines)


def markdown_table(summary: dict, steps: int) -> str:
    lines = [
        "| configuration | step time (median) | vs AdamW | step time (p10) | vs AdamW | optimizer share | comm / rank / step | vs AdamW "
        "| launches / rank / step (DMuon's) | vs AdamW | DMuon buffers peak | DMuon host time / step "
        f"| first layer waited | loss at step {steps} |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        base = _base(summary, name)
        bold = name.startswith("DMuon")
        label = name.replace("FSDP2+AdamW", "FSDP2 + AdamW,").replace("naive FSDP2+Muon", "naive FSDP2 + Muon,")
        if bold:  # "DMuon Z3 gram" -> "DMuon-Z3, ns_method gram"
            label = "**" + re.sub(r"^DMuon (Z[23])(?: (\w+))?$",
                                  lambda m: f"DMuon-{m[1]}" + (f", ns_method {m[2]}" if m[2] else ""), name) + "**"
        ratio = s["launches"] / base["launches"]
        buffers = f"{s['buffers_mb']:.2f} MB" if s["buffers_mb"] else "–"
        lines.append(
            f"| {label} | {s['step_s']:.3f} s | {s['step_s'] / base['step_s']:.2f} | {s['step_p10']:.3f} s "
            f"| {s['step_p10'] / base['step_p10']:.2f} | {100 * s['opt_share']:.1f} % "
            f"| {s['comm_mb']:.2f} MB | {s['comm_mb'] / base['comm_mb']:.3f} "
            f"| {s['launches']:.0f} ({_fmt(s['launch_dmuon'], '.0f')}) "
            f"| {ratio:.2f} | {buffers} | {_fmt(s['host_ms'], '.1f')} ms | {_fmt(s['first_wait_ms'], '.2f')} ms "
            f"| {s['loss']:.2f} |"
        )
    return "\n".join(lines)


def plot(summary: dict, path: str) -> None:
    bar_panels(summary, [
        ("step time (s)", "step_s", 1),
        ("optimizer step share (%)", "opt_share", 100),
        ("communication per rank per step (MB)", "comm_mb", 1),
        ("launches / rank / step (NCCL)", "launches", 1),
    ], path, "llama3 debug model on this machine: DMuon vs FSDP2+AdamW vs naive FSDP2+Muon", height=4.5)


def bar_panels(summary: dict, panels: list[tuple[str, str, float]], path: str, title: str, *, height: float) -> None:
    """One horizontal bar chart per (title, summary key, scale), configurations coloured by kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, axes = plt.subplots(1, len(panels), figsize=(19, height))
    colors = ["#7f7f7f" if "AdamW" in n else "#d62728" if "naive" in n else "#1f77b4" for n in names]
    for ax, (panel, key, scale) in zip(axes, panels):
        values = [scale * summary[n][key] for n in names]
        ax.barh(names, values, color=colors)
        ax.set_title(panel)
        ax.invert_yaxis()
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:.3g}", va="center", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
