"""Context parallelism on this CPU: the llama3 debug job with CP 2 x FSDP 2 against FSDP 2 without CP.

    python benchmarks/context_parallel.py [--steps 10] [--out bench_out/context_parallel]

TorchTitan's random initialisation depends on the FSDP mesh, which CP enlarges (dp_shard x cp), so the
runs start from one seed checkpoint (``--checkpoint.create_seed_checkpoint`` on one rank, then
``--checkpoint.initial_load_path``) and see the same global batch (the data-parallel degree is 2 in
every run: without CP each of the 2 ranks reads 2 sequences; with CP each pair of ranks cuts its 2
sequences in 4 chunks, TorchTitan's head-tail load balancer). For TorchTitan's AdamW and for DMuon it
prints each step's loss and gradient norm without and with CP, the largest relative differences, and
DMuon's communication per step (the training log's ``dmuon: comm``: measured, next to the design).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP = re.compile(r"step:\s+(\d+)\s+loss:\s+([\d.]+)\s+grad_norm:\s+([\d.]+)")
COMM = re.compile(r"dmuon: comm ([\d.]+)M elements/rank/step \(([\d.]+) MB; design ([\d.]+)M")
CP = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.context_parallel_degree", "2"]
RUNS = {  # name -> (TOML, ranks, overrides)
    "AdamW, FSDP 2": ("debug_model_adamw.toml", 2, ["--parallelism.data_parallel_shard_degree", "2"]),
    "AdamW, CP 2 x FSDP 2": ("debug_model_adamw.toml", 4, CP),
    "DMuon, FSDP 2": ("debug_model.toml", 2, ["--parallelism.data_parallel_shard_degree", "2"]),
    "DMuon, CP 2 x FSDP 2": ("debug_model.toml", 4, CP),
}


def run_train(config: str, ngpu: int, args: list[str]) -> str:
    env = {**os.environ, "CONFIG_FILE": f"train_configs/{config}", "NGPU": str(ngpu), "PYTHON": sys.executable}
    out = subprocess.run(
        ["./run_train.sh", "--metrics.disable_color_printing", "true", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if out.returncode != 0:
        sys.exit(f"run_train.sh {' '.join(args)} failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return out.stdout + out.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="bench_out/context_parallel")
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    seed = os.path.join(out, "seed")
    run_train(
        "debug_model_adamw.toml",
        1,
        [
            "--job.dump_folder",
            seed,
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--checkpoint.enable",
            "--checkpoint.create_seed_checkpoint",
        ],
    )
    curves, comm = {}, {}
    for name, (config, ngpu, overrides) in RUNS.items():
        tag = re.sub(r"\W+", "_", name)
        log = run_train(
            config,
            ngpu,
            [
                "--job.dump_folder",
                os.path.join(out, tag),
                "--training.steps",
                str(args.steps),
                "--checkpoint.enable",
                "--checkpoint.interval",
                str(10 * args.steps),
                "--checkpoint.initial_load_path",
                os.path.join(seed, "checkpoint", "step-0"),
                *overrides,
            ],
        )
        curves[name] = {int(s): (float(loss), float(norm)) for s, loss, norm in STEP.findall(log)}
        comm[name] = [(float(m), float(d)) for m, _, d in COMM.findall(log)]
    print(f"llama3 debug model, {args.steps} steps from one seed checkpoint; loss / grad norm per step")
    names = list(RUNS)
    print("| step | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for step in range(1, args.steps + 1):
        print(f"| {step} | " + " | ".join(f"{curves[n][step][0]:.5f} / {curves[n][step][1]:.4f}" for n in names) + " |")
    for optimizer in ("AdamW", "DMuon"):
        a, b = curves[f"{optimizer}, FSDP 2"], curves[f"{optimizer}, CP 2 x FSDP 2"]
        loss = max(abs(a[s][0] - b[s][0]) / a[s][0] for s in a)
        norm = max(abs(a[s][1] - b[s][1]) / a[s][1] for s in a)
        print(
            f"{optimizer}: CP vs no CP, step 1 loss {a[1][0]:.5f} vs {b[1][0]:.5f}, grad norm {a[1][1]:.4f} vs "
            f"{b[1][1]:.4f}; largest relative difference over {args.steps} steps: loss {loss:.1e}, grad norm {norm:.1e}"
        )
    for name in ("DMuon, FSDP 2", "DMuon, CP 2 x FSDP 2"):
        measured, design = comm[name][-1]
        print(f"{name}: DMuon's communication per rank per step {measured}M elements (design {design}M)")


if __name__ == "__main__":
    main()
