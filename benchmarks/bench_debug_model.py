"""Side by side on this machine, per batch: DMuon-Z2/Z3 vs FSDP2+AdamW vs naive FSDP2+Muon.

    python benchmarks/bench_debug_model.py [--batches 2x256 4x1024 16x1024] [--steps 10] [--rounds 2]
                                           [--ngpu 2] [--out bench_out] [--ns-methods torch polar_express gram]
                                           [--no-naive] [--no-z2] [--seed-checkpoint]
                                           [--from-raw bench_out/debug_model_raw.json]

Trains TorchTitan's llama3 debug model (d = 256) with each configuration through run_train.sh at each
batch (tokens per rank per step, ``<local_batch_size>x<seq_len>``). Newton–Schulz costs about 5·d/B of
the model's FLOPs (B: the job's tokens per optimizer step), so the batch decides how much of a step
Muon can cost at all: 125% of the model's FLOPs at 2 x 256 tokens on 2 ranks, 3.9% at 16 x 1024 (the
largest this CPU trains in seconds; an 8B model at 4M tokens per step is at ~0.5%). Each table row
gives its batch's 5d/B. Rounds interleave the configurations, so machine noise hits all of them alike;
all start from the same weights (the same ``[debug] seed`` gives DMuon TorchTitan's own initial model,
or ``--seed-checkpoint`` loads one TorchTitan seed checkpoint in every run) and see the same batches.

Per row: the step time (median of steps 3+, over every round) and its ratio to FSDP2+AdamW of the same
reshard mode and batch; the optimizer step's share; communication per rank per step counted by the
CommLedger (every collective of a step, FSDP2's included) and launches as NCCL runs them
(``CommLedger.launch_groups()``); the rank's peak RSS (CPU; peak device memory on GPU) and DMuon's
packed-buffer peak (P_M per rank in Z2, about two layers in Z3); the loss at the last step (mean over
the rounds); and the **time to loss**: the steady-state seconds (steps x median step time) a run takes
to reach the loss its AdamW row ends at, both as means over ``LOSS_WINDOW`` steps, beside AdamW's own
(Muon's point is fewer steps to a loss). Writes bench_out/debug_model.txt (the text table and its
markdown), bench_out/debug_model.png and the raw per-step figures. ``--ns-methods``: one DMuon-Z3 and
one DMuon-Z2 row per Newton–Schulz method (``[optimizer] ns_method``; default "torch" only).

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
import textwrap
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from titan_dmuon.math.ns_methods import NS_METHODS  # noqa: E402

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


def configurations(ns_methods=("torch",), naive: bool = True, z2: bool = True) -> dict[str, tuple[str, str]]:
    """name -> ([optimizer] table, fsdp_reshard_after_forward), Z3 then Z2: AdamW, naive, DMuon per method
    ("DMuon Z3" is "torch"'s; "DMuon Z3 gram" another method's)."""
    out = {}
    for mode, reshard in (("Z3", "always"), ("Z2", "never"))[: 2 if z2 else 1]:
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
local_batch_size = {local_batch}
seq_len = {seq_len}
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


def job_toml(
    optimizer: str,
    *,
    steps: int,
    reshard: str = "always",
    warmup_steps: int = 2,
    seed: int = 0,
    local_batch: int = 2,
    seq_len: int = 256,
) -> str:
    """The llama3 debug job every benchmark of this model runs, with this ``[optimizer]`` table
    (``local_batch`` sequences of ``seq_len`` tokens per rank per step)."""
    return TEMPLATE.format(
        optimizer=optimizer,
        steps=steps,
        reshard=reshard,
        warmup_steps=warmup_steps,
        seed=seed,
        local_batch=local_batch,
        seq_len=seq_len,
    )


LINE = re.compile(
    r"step:\s+(\d+)\s+loss:\s+([\d.]+).*?memory:\s+([\d.]+)GiB.*?\n"
    r".*?titan_dmuon: step ([\d.]+)s, optimizer ([\d.]+) ms"
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
        [
            "./run_train.sh",
            "--job.dump_folder",
            folder,
            "--checkpoint.enable",
            "true",
            "--checkpoint.create_seed_checkpoint",
            "true",
            "--parallelism.data_parallel_shard_degree",
            "1",
            *extra,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
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


def run(
    name: str,
    steps: int,
    ngpu: int,
    workdir: str,
    seed: str | None = None,
    configs=CONFIGS,
    batch: "Batch | None" = None,
) -> list[dict]:
    optimizer, reshard = configs[name]
    path = os.path.join(workdir, re.sub(r"\W+", "_", name) + ".toml")
    shape = {} if batch is None else {"local_batch": batch.local, "seq_len": batch.seq}
    with open(path, "w") as f:
        f.write(job_toml(optimizer, steps=steps, reshard=reshard, **shape))
    env = {**os.environ, **job_env(path, optimizer), "NGPU": str(ngpu), "PYTHON": sys.executable}
    out = subprocess.run(
        ["./run_train.sh", *job_args(train_args(workdir, seed, re.sub(r"\W+", "_", name)), optimizer)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if out.returncode != 0:
        sys.exit(f"{name} failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    rows = []
    for m in LINE.finditer(out.stdout + out.stderr):
        rows.append(
            {
                "step": int(m[1]),
                "loss": float(m[2]),
                "rss_gib": float(m[3]),
                "step_s": float(m[4]),
                "opt_ms": float(m[5]),
                "comm_m": float(m[6]),
                "comm_mb": float(m[7]),
                # launches per rank per step as NCCL runs them (a DMuon group once; gloo runs it one by one)
                "launches": float(m[8]),
                "launch_dmuon": float(m[9]) if m[9] else None,
                "buffers_mb": float(m[10]) if m[10] else 0.0,
                "host_ms": float(m[11]) if m[11] else None,
                "first_wait_ms": float(m[12]) if m[12] else None,
            }
        )
    return rows


MODEL_DIM = (
    256  # llama3 debugmodel's width d (TorchTitan's _debugmodel): Newton–Schulz costs ~5d/B of the model's FLOPs
)


@dataclass(frozen=True)
class Batch:
    """Tokens per rank per step: ``local_batch_size`` sequences of ``seq_len`` tokens."""

    local: int
    seq: int

    @staticmethod
    def parse(text: str) -> "Batch":
        m = re.fullmatch(r"(\d+)x(\d+)", text)
        if not m:
            raise argparse.ArgumentTypeError(f"{text!r}: give a batch as <local_batch_size>x<seq_len>, e.g. 16x1024")
        return Batch(int(m[1]), int(m[2]))

    def __str__(self) -> str:
        return f"{self.local}x{self.seq}"

    def ns_share(self, ranks: int) -> float:
        """~5·d/B: Newton–Schulz's FLOPs over the model's, B the job's tokens per optimizer step."""
        return 5 * MODEL_DIM / (ranks * self.local * self.seq)


DEFAULT_BATCHES = ("2x256", "4x1024", "16x1024")
HEADLINE = "16x1024"  # the realistic row: the smallest NS share this CPU can train at (~4% of the FLOPs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ngpu", type=int, default=2)
    parser.add_argument(
        "--batches",
        nargs="+",
        type=Batch.parse,
        default=[Batch.parse(b) for b in DEFAULT_BATCHES],
        help="tokens per rank per step, <local_batch_size>x<seq_len> (default: %(default)s)",
    )
    parser.add_argument("--out", default=os.path.join(ROOT, "bench_out"))
    parser.add_argument(
        "--seed-checkpoint",
        action="store_true",
        help="start every run from one TorchTitan seed checkpoint (the same [debug] seed gives the same weights too)",
    )
    parser.add_argument(
        "--from-raw", metavar="JSON", help="only print the tables (and PNG) of an earlier run's debug_model_raw.json"
    )
    parser.add_argument(
        "--ns-methods",
        nargs="+",
        default=["torch"],
        choices=list(NS_METHODS),
        help="a DMuon-Z3 and a DMuon-Z2 row per Newton–Schulz method",
    )
    parser.add_argument("--no-naive", action="store_true", help="leave out the naive FSDP2+Muon rows")
    parser.add_argument("--no-z2", action="store_true", help="only the Z3 rows (blocks reshard after forward)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.from_raw:
        with open(args.from_raw) as f:
            raw = json.load(f)
        args.rounds, args.steps = raw["rounds"], raw["steps"]
        rows = raw["rows"]
    else:
        rows = measure(args)
        with open(os.path.join(args.out, "debug_model_raw.json"), "w") as f:
            json.dump({"rounds": args.rounds, "steps": args.steps, "ngpu": args.ngpu, "rows": rows}, f, indent=1)

    summary = {batch: {name: summarize(data) for name, data in by_name.items()} for batch, by_name in rows.items()}
    title = (
        f"llama3 debug model (d = {MODEL_DIM}), {args.ngpu} ranks, {args.rounds} rounds x {args.steps} steps "
        "(step times: medians of steps 3+)"
    )
    table = text_table(summary, title, args.ngpu)
    markdown = markdown_table(summary, args.ngpu, args.steps)
    for batch, by_name in summary.items():
        for name in by_name:
            if name.startswith("DMuon"):
                base_name = "FSDP2+AdamW " + re.search(r"Z[23]", name)[0]
                by_step = {n: s["rss_by_step"] for n, s in by_name.items()}
                table += "".join(f"\n{batch} tokens/rank, {line}" for line in rss_by_step(by_step, name, base_name))
    print(table)
    print()
    print(markdown)
    with open(os.path.join(args.out, "debug_model.txt"), "w") as f:
        f.write(table + "\n\n" + markdown + "\n")
    plot(summary, os.path.join(args.out, "debug_model.png"), args.ngpu)


def measure(args) -> dict[str, dict[str, list[dict]]]:
    """Per batch, every configuration round after round (rounds interleave the configurations);
    every step's row tagged with its round."""
    configs = configurations(args.ns_methods, naive=not args.no_naive, z2=not args.no_z2)
    rows: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory() as workdir:
        seed = None
        if args.seed_checkpoint:
            print("seed checkpoint ...", flush=True)
            path = os.path.join(workdir, "seed.toml")
            with open(path, "w") as f:
                f.write(job_toml(ADAMW, steps=args.steps))
            seed = seed_checkpoint(path, workdir)
        for batch in args.batches:
            by_name = rows.setdefault(str(batch), {name: [] for name in configs})
            for r in range(args.rounds):
                for name in configs:
                    print(f"{batch} tokens/rank, round {r + 1}/{args.rounds}: {name} ...", flush=True)
                    by_name[name] += [
                        {**row, "round": r} for row in run(name, args.steps, args.ngpu, workdir, seed, configs, batch)
                    ]
    return rows


def _median(data: list[dict], key: str):
    values = [d[key] for d in data if d.get(key) is not None]
    return statistics.median(values) if values else None


def mean_losses(data: list[dict]) -> list[float]:
    """The loss of each step, the mean over the rounds (every round trains the same batches)."""
    steps = sorted({d["step"] for d in data})
    return [statistics.fmean(d["loss"] for d in data if d["step"] == s) for s in steps]


LOSS_WINDOW = 3  # steps: the loss "reached" is a mean over this many steps (one batch's loss is noisy)


def smoothed(losses: list[float]) -> list[float]:
    return [statistics.fmean(losses[max(0, i - LOSS_WINDOW + 1) : i + 1]) for i in range(len(losses))]


def summarize(data: list[dict]) -> dict:
    steady = [d for d in data if d["step"] > 2]
    step = _median(steady, "step_s")
    out = {
        "step_s": step,
        "opt_share": _median(steady, "opt_ms") / 1e3 / step,
        "comm_m": _median(steady, "comm_m"),
        "comm_mb": _median(steady, "comm_mb"),
        "rss_gib": max(d["rss_gib"] for d in data),
        "rss_by_step": {k: max(d["rss_gib"] for d in data if d["step"] == k) for k in {d["step"] for d in data}},
        "buffers_mb": max(d["buffers_mb"] for d in data),
        "losses": mean_losses(data),
    }
    out["loss"] = out["losses"][-1]
    per_round = [
        statistics.median(d["step_s"] for d in steady if d["round"] == r) for r in sorted({d["round"] for d in steady})
    ]
    out["round_spread"] = (min(per_round), max(per_round))  # step-time medians of the single rounds
    for key in ("launches", "launch_dmuon", "host_ms", "first_wait_ms"):
        out[key] = _median(steady, key)
    return out


def rss_by_step(by_step: dict[str, dict[int, float]], name: str, base_name: str) -> list[str]:
    """Peak RSS (TorchTitan's ``memory:``, the process's high-water mark; the largest over rounds) of ``name``
    and of ``base_name`` at steps 3, 5 and the last, each against the baseline's at the same step, and the
    growth from step 5 to the last: whether memory levels off as the baseline's does."""
    ref = by_step[base_name]
    lines = []
    for label in (base_name, name):
        rss = by_step[label]
        last = max(rss)
        steps = [k for k in (3, 5) if k < last] + [last]
        cells = ", ".join(f"step {k} {rss[k]:.2f} GiB ({rss[k] / ref[k]:.3f}x)" for k in steps)
        growth = 100 * (rss[last] / rss[min(5, last)] - 1)
        lines.append(f"peak RSS, {label}: {cells}; step {min(5, last)} to {last}: {growth:+.1f}%")
    return lines


def _base(by_name: dict, name: str) -> dict:
    return by_name["FSDP2+AdamW " + re.search(r"Z[23]", name)[0]]


def time_to_loss(s: dict, base: dict) -> tuple[int, float] | None:
    """(steps, seconds) a run takes to reach the loss its AdamW row ends at (both as ``LOSS_WINDOW``-step
    means; seconds at the run's median step time), or None if it does not within the run."""
    target = smoothed(base["losses"])[-1]
    for i, loss in enumerate(smoothed(s["losses"])):
        if loss <= target:
            return i + 1, (i + 1) * s["step_s"]
    return None


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _reach(s: dict, base: dict) -> tuple[str, str]:
    """(time to AdamW's final loss, its ratio to AdamW's own time) as table cells."""
    reached = time_to_loss(s, base)
    if reached is None:
        return "not reached", "-"
    steps, seconds = reached
    return f"{seconds:.1f} s ({steps} steps)", f"{seconds / (len(base['losses']) * base['step_s']):.2f}"


def text_table(summary: dict, title: str, ranks: int) -> str:
    header = (
        f"{'tokens/rank':<12}{'5d/B':>7}  {'configuration':<26}{'step time':>10}{'vs AdamW':>9}{'optim. share':>13}"
        f"{'comm MB':>9}{'vs AdamW':>9}{'launches':>9}{'(DMuon)':>8}{'peak RSS GiB':>13}{'vs AdamW':>9}"
        f"{'DMuon buf MB':>13}{'final loss':>11}{'time to AdamW final loss':>26}{'vs AdamW':>9}"
        "   rounds' step-time medians"
    )
    lines = [title, header]
    for batch, by_name in summary.items():
        share = Batch.parse(batch).ns_share(ranks)
        for name, s in by_name.items():
            base = _base(by_name, name)
            reach, ratio = _reach(s, base) if base is not s else ("", "")
            lines.append(
                f"{batch:<12}{100 * share:>6.1f}%  {name:<26}{s['step_s']:>9.3f}s{s['step_s'] / base['step_s']:>9.3f}"
                f"{100 * s['opt_share']:>12.1f}%{s['comm_mb']:>9.2f}{s['comm_mb'] / base['comm_mb']:>9.3f}"
                f"{s['launches']:>9.0f}{_fmt(s['launch_dmuon'], '.0f'):>8}{s['rss_gib']:>13.2f}"
                f"{s['rss_gib'] / base['rss_gib']:>9.3f}{s['buffers_mb']:>13.2f}{s['loss']:>11.3f}{reach:>26}{ratio:>9}"
                f"   {s['round_spread'][0]:.3f}-{s['round_spread'][1]:.3f}s"
            )
    return "\n".join(lines)


def markdown_table(summary: dict, ranks: int, steps: int) -> str:
    lines = [
        "| tokens / rank / step | NS share ~5d/B | configuration | step time (median) | vs AdamW | optimizer share "
        "| comm / rank / step vs AdamW | peak RSS vs AdamW "
        f"| loss at step {steps} | time to AdamW's loss at step {steps} | vs AdamW |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for batch, by_name in summary.items():
        local, seq = batch.split("x")
        share = Batch.parse(batch).ns_share(ranks)
        for name, s in by_name.items():
            base = _base(by_name, name)
            label = name.replace("FSDP2+AdamW", "FSDP2 + AdamW,").replace("naive FSDP2+Muon", "naive FSDP2 + Muon,")
            if name.startswith("DMuon"):  # "DMuon Z3 gram" -> "DMuon-Z3, ns_method gram"
                label = (
                    "**"
                    + re.sub(
                        r"^DMuon (Z[23])(?: (\w+))?$",
                        lambda m: f"DMuon-{m[1]}" + (f", ns_method {m[2]}" if m[2] else ""),
                        name,
                    )
                    + "**"
                )
            reach, ratio = _reach(s, base) if base is not s else ("–", "–")
            lines.append(
                f"| {local} x {seq} | {100 * share:.1f} % | {label} | {s['step_s']:.3f} s "
                f"| {s['step_s'] / base['step_s']:.3f} "
                f"| {100 * s['opt_share']:.1f} % | {s['comm_mb'] / base['comm_mb']:.3f} "
                f"| {s['rss_gib'] / base['rss_gib']:.3f} | {s['loss']:.2f} | {reach} | {ratio} |"
            )
    return "\n".join(lines)


def plot(summary: dict, path: str, ranks: int) -> None:
    """One bar per configuration and batch in each of four stacked charts: step time relative to AdamW,
    optimizer share, communication, and the time to AdamW's final loss relative to AdamW's run."""
    flat = {}
    for batch, by_name in summary.items():
        share = 100 * Batch.parse(batch).ns_share(ranks)
        for name, s in by_name.items():
            base = _base(by_name, name)
            reached = time_to_loss(s, base)
            flat[f"{batch} ({share:.1f}%): {name}"] = {
                **s,
                "step_vs_adamw": s["step_s"] / base["step_s"],
                "reach_vs_adamw": (reached[1] / (len(base["losses"]) * base["step_s"])) if reached else float("nan"),
            }
    compared = "DMuon vs FSDP2+AdamW" + (" vs naive FSDP2+Muon" if any("naive" in n for n in flat) else "")
    bar_panels(
        flat,
        [
            ("step time vs AdamW", "step_vs_adamw", 1),
            ("optimizer step share (%)", "opt_share", 100),
            ("communication per rank per step (MB)", "comm_mb", 1),
            ("time to AdamW's final loss\n(vs AdamW's run)", "reach_vs_adamw", 1),
        ],
        path,
        f"llama3 debug model per batch (tokens/rank, ~5d/B):\n{compared}",
        height=0.8 + 0.26 * len(flat),
    )


def bar_panels(summary: dict, panels: list[tuple[str, str, float]], path: str, title: str, *, height: float) -> None:
    """One horizontal bar chart per (title, summary key, scale), configurations coloured by kind, the
    charts stacked in one column 7.5 inches wide (825 px at 110 dpi): shown at a docs page's width
    (~700 px) its labels keep ~10 px; ``height`` is one chart's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(7.5, 0.6 + height * len(panels)), squeeze=False, layout="constrained"
    )  # keeps the suptitle clear of the first chart
    colors = ["#7f7f7f" if "AdamW" in n else "#d62728" if "naive" in n else "#1f77b4" for n in names]
    for ax, (panel, key, scale) in zip(axes[:, 0], panels):
        values = [scale * summary[n][key] for n in names]
        ax.barh(names, values, color=colors)
        ax.set_title(panel.replace("\n", " "), fontsize=11)
        ax.tick_params(labelsize=9)
        ax.invert_yaxis()
        ax.margins(x=0.12)  # room for the value printed after the longest bar
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:.3g}", va="center", fontsize=9)
    fig.suptitle("\n".join(textwrap.fill(line, 80) for line in title.splitlines()), fontsize=11)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
