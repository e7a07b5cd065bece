"""The README's QK-clip figures, regenerated: each job with the clip and without it, per step.

    .venv/bin/python benchmarks/qk_clip_figures.py            # llama3 and deepseek_v3 debug models, ~5 min on 2 CPU cores

Runs ``./run_train.sh`` (the main job, 2 ranks) with ``--optimizer.qk_clip_threshold TAU`` and,
for the comparison, with a threshold no logit reaches (1e9: the capture and its reduce run and log
S, every factor is exactly 1, so the job trains as without the clip), and prints one markdown table
per model: the step's largest logit S before clipping, the heads clipped, the loss, for both. The
figures are bf16 runs of this machine's kernels: another CPU or a GPU gives slightly other digits.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP = re.compile(r"step:\s+(\d+)\s+loss:\s+([\d.]+)")
QK = re.compile(r"QK-clip: max logit ([\d.]+) before clipping, (\d+) heads clipped")
NEVER = "1e9"
JOBS = {  # model: (tau, steps, extra overrides)
    "llama3": ("0.8", 10, ()),
    "deepseek_v3": ("1.0", 8, ("--model.name", "deepseek_v3")),
}


def run(tau: str, steps: int, extra: tuple, folder: str) -> list[tuple[int, float, float, int]]:
    """(step, loss, S, heads clipped) per step of one run of the main job."""
    env = {**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable), "TITAN_DMUON_PRECHECK": "0"}
    out = subprocess.run(
        ["./run_train.sh", "--job.dump_folder", folder, "--metrics.disable_color_printing", "true",
         "--training.steps", str(steps), "--optimizer.qk_clip_threshold", tau, *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False,
    )
    text = out.stdout + out.stderr
    if out.returncode != 0:
        raise SystemExit(f"run_train.sh failed (exit {out.returncode}):\n{text[-3000:]}")
    losses = [(int(s), float(loss)) for s, loss in STEP.findall(text)]
    clips = [(float(s), int(n)) for s, n in QK.findall(text)]
    return [(step, loss, s, n) for (step, loss), (s, n) in zip(losses, clips)]


def table(model: str, tau: str, clipped: list, free: list) -> str:
    lines = [
        f"{model}, tau = {tau}:",
        "",
        "| step | max logit S | heads clipped | loss | S without the clip | loss without |",
        "|---|---|---|---|---|---|",
    ]
    for (step, loss, s, n), (_, free_loss, free_s, _) in zip(clipped, free):
        lines.append(f"| {step} | {s:.4f} | {n} | {loss:.4f} | {free_s:.4f} | {free_loss:.4f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(JOBS), choices=list(JOBS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="qk_clip_figures_") as work:
        for model in args.models:
            tau, steps, extra = JOBS[model]
            clipped = run(tau, steps, extra, os.path.join(work, f"{model}_clip"))
            free = run(NEVER, steps, extra, os.path.join(work, f"{model}_free"))
            print(table(model, tau, clipped, free), end="\n\n", flush=True)


if __name__ == "__main__":
    main()
