"""The QK-clip figures of docs/qk-clip.md, regenerated: each job with the clip and without it, per step.

    .venv/bin/python benchmarks/qk_clip_figures.py  # llama3 and deepseek_v3 debug models, ~2.5 min on 2 CPU cores

Runs ``./run_train.sh`` (the main job, 2 ranks) with ``--optimizer.qk_clip_threshold TAU`` and,
for the comparison, with a threshold no logit reaches (1e9: the capture and its reduce run and log
S, every factor is exactly 1, so the job trains as without the clip), and prints docs/qk-clip.md's table
with both models: the step's largest logit S before clipping, the heads clipped, the loss. The
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
        [
            "./run_train.sh",
            "--job.dump_folder",
            folder,
            "--metrics.disable_color_printing",
            "true",
            "--training.steps",
            str(steps),
            "--optimizer.qk_clip_threshold",
            tau,
            *extra,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    text = out.stdout + out.stderr
    if out.returncode != 0:
        raise SystemExit(f"run_train.sh failed (exit {out.returncode}):\n{text[-3000:]}")
    losses = [(int(s), float(loss)) for s, loss in STEP.findall(text)]
    clips = [(float(s), int(n)) for s, n in QK.findall(text)]
    return [(step, loss, s, n) for (step, loss), (s, n) in zip(losses, clips)]


def table(results: dict[str, tuple[list, list]]) -> str:
    """docs/qk-clip.md's table: per step, for each model, S and heads clipped with the clip, S without it
    and the loss with and without it."""
    models = list(results)
    head = (
        "| step | "
        + " | ".join(f"{m}: S | heads clipped | S without the clip | loss with, without the clip" for m in models)
        + " |"
    )
    lines = [head, "|---|" + "---|" * 4 * len(models)]
    for step in range(1, max(len(clipped) for clipped, _ in results.values()) + 1):
        cells = []
        for clipped, free in results.values():
            if step > len(clipped):
                cells += [""] * 4
                continue
            (_, loss, s, n), (_, free_loss, free_s, _) = clipped[step - 1], free[step - 1]
            cells += [f"{s:.4f}", str(n), f"{free_s:.4f}", f"{loss:.4f}, {free_loss:.4f}"]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(JOBS), choices=list(JOBS))
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="qk_clip_figures_") as work:
        for model in args.models:
            tau, steps, extra = JOBS[model]
            results[model] = (
                run(tau, steps, extra, os.path.join(work, f"{model}_clip")),
                run(NEVER, steps, extra, os.path.join(work, f"{model}_free")),
            )
            print(f"{model}: tau = {tau}, {steps} steps", flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
