"""Side by side on this machine: DMuon-Z2/Z3 vs FSDP2+AdamW vs naive FSDP2+Muon.

    python benchmarks/bench_debug_model.py [--steps 10] [--rounds 2] [--ngpu 2] [--out bench_out]

Trains TorchTitan's llama3 debug model with each configuration through
run_train.sh (rounds interleave the configurations, so machine noise hits all
of them alike), then prints one table of ratios against FSDP2+AdamW (same
reshard mode) and writes bench_out/debug_model.png. Times are medians over
the steps after the first two; communication is counted by the CommLedger
(every collective of a step, FSDP2's included). Memory: the rank's peak RSS
(CPU; peak device memory on GPU) and DMuon's packed-buffer peak, which is
P_M per rank in Z2 and about two layers in Z3.

Needs matplotlib for the plot (pip install -e '.[bench]').
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIGS = {  # name -> ([optimizer] table, fsdp_reshard_after_forward)
    "FSDP2+AdamW Z3": ('name = "AdamW"\nlr = 8e-4', "always"),
    "naive FSDP2+Muon Z3": ('name = "naive_muon"\nlr = 0.05\nadamw_lr = 8e-4', "always"),
    "DMuon Z3": ('name = "dmuon"\nlr = 0.05\nadamw_lr = 8e-4', "always"),
    "FSDP2+AdamW Z2": ('name = "AdamW"\nlr = 8e-4', "never"),
    "naive FSDP2+Muon Z2": ('name = "naive_muon"\nlr = 0.05\nadamw_lr = 8e-4', "never"),
    "DMuon Z2": ('name = "dmuon"\nlr = 0.05\nadamw_lr = 8e-4', "never"),
}

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
warmup_steps = 2
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
seed = 0
"""

LINE = re.compile(
    r"step:\s+(\d+)\s+loss:\s+([\d.]+).*?memory:\s+([\d.]+)GiB.*?\n.*?titan_dmuon: step ([\d.]+)s, optimizer ([\d.]+) ms"
    r"\s+all comm ([\d.]+)M elements/rank/step \(([\d.]+) MB\)(?:.*?peak buffers ([\d.]+) MB)?"
)


def run(name: str, steps: int, ngpu: int, workdir: str) -> list[dict]:
    optimizer, reshard = CONFIGS[name]
    path = os.path.join(workdir, re.sub(r"\W+", "_", name) + ".toml")
    with open(path, "w") as f:
        f.write(TEMPLATE.format(optimizer=optimizer, reshard=reshard, steps=steps))
    env = {**os.environ, "CONFIG_FILE": path, "NGPU": str(ngpu), "PYTHON": sys.executable}
    out = subprocess.run(
        ["./run_train.sh", "--job.dump_folder", os.path.join(workdir, "out")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )
    if out.returncode != 0:
        sys.exit(f"{name} failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    rows = []
    for m in LINE.finditer(out.stdout + out.stderr):
        rows.append({
            "step": int(m[1]), "loss": float(m[2]), "rss_gib": float(m[3]), "step_s": float(m[4]),
            "opt_ms": float(m[5]), "comm_m": float(m[6]), "comm_mb": float(m[7]),
            "buffers_mb": float(m[8]) if m[8] else 0.0,
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ngpu", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench_out"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as workdir:
        for r in range(args.rounds):
            for name in CONFIGS:
                print(f"round {r + 1}/{args.rounds}: {name} ...", flush=True)
                rows[name] += [row for row in run(name, args.steps, args.ngpu, workdir) if row["step"] > 2]

    summary = {}
    for name, data in rows.items():
        step = statistics.median(d["step_s"] for d in data)
        opt = statistics.median(d["opt_ms"] for d in data) / 1e3
        summary[name] = {
            "step_s": step, "opt_share": opt / step, "comm_m": statistics.median(d["comm_m"] for d in data),
            "comm_mb": statistics.median(d["comm_mb"] for d in data), "rss_gib": max(d["rss_gib"] for d in data),
            "buffers_mb": max(d["buffers_mb"] for d in data),
            "loss": statistics.median(d["loss"] for d in data if d["step"] == args.steps),
        }
    header = (
        f"{'configuration':<22}{'step time':>10}{'vs AdamW':>9}{'optim. share':>13}{'comm M elem':>12}"
        f"{'comm MB':>9}{'vs AdamW':>9}{'peak RSS GiB':>13}{'DMuon buf MB':>13}{'final loss':>11}"
    )
    lines = [f"llama3 debug model, {args.ngpu} ranks, {args.rounds} rounds x {args.steps} steps (medians of steps 3+)", header]
    for name, s in summary.items():
        base = summary["FSDP2+AdamW " + name[-2:]]
        lines.append(
            f"{name:<22}{s['step_s']:>9.3f}s{s['step_s'] / base['step_s']:>9.2f}{100 * s['opt_share']:>12.1f}%"
            f"{s['comm_m']:>12.3f}{s['comm_mb']:>9.2f}{s['comm_mb'] / base['comm_mb']:>9.2f}"
            f"{s['rss_gib']:>13.2f}{s['buffers_mb']:>13.2f}{s['loss']:>11.3f}"
        )
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(args.out, "debug_model.txt"), "w") as f:
        f.write(table + "\n")
    plot(summary, os.path.join(args.out, "debug_model.png"))


def plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = [
        ("step time (s)", [summary[n]["step_s"] for n in names]),
        ("optimizer step share (%)", [100 * summary[n]["opt_share"] for n in names]),
        ("communication per rank per step (MB)", [summary[n]["comm_mb"] for n in names]),
    ]
    colors = ["#7f7f7f" if "AdamW" in n else "#d62728" if "naive" in n else "#1f77b4" for n in names]
    for ax, (title, values) in zip(axes, panels):
        ax.barh(names, values, color=colors)
        ax.set_title(title)
        ax.invert_yaxis()
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:.3g}", va="center", fontsize=8)
    fig.suptitle("llama3 debug model on this machine: DMuon vs FSDP2+AdamW vs naive FSDP2+Muon")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
