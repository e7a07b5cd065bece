"""One prepared check on one NVIDIA GPU (a few minutes), printing one table.

    .venv/bin/python benchmarks/gpu_check.py [--skip-jobs]

(a) Newton–Schulz on one layer of llama3 8B and 70B shapes: DMuon's update
    (``muon_step``: shape groups batched, equal-up-to-transpose shapes in one
    batch) against ``torch.optim.Muon``'s per-matrix loop; ms and TFLOP/s.
(b) The main job (llama3 debug model, DMuon-Z3) on CUDA with one rank, compile
    off and on, with ``torch.cuda.set_sync_debug_mode("error")`` over DMuon's
    steady-state forward+backward and optimizer step: any host sync stops it.
(c) Peak device memory of DMuon vs TorchTitan's AdamW on llama3 1B (one rank).

NCCL refuses two ranks on one GPU, so every job here runs on one rank. Without
CUDA it refuses at once (exit code 2).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from titan_dmuon.muon_math import muon_step, ns_flops  # noqa: E402

# one transformer block: (name, rows, cols, row blocks of its fused q/k/v)
LLAMA3_LAYERS = {
    "llama3 8B": [("wqkv", 6144, 4096, [4096, 1024, 1024]), ("wo", 4096, 4096, None), ("w1", 14336, 4096, None),
                  ("w2", 4096, 14336, None), ("w3", 14336, 4096, None)],
    "llama3 70B": [("wqkv", 10240, 8192, [8192, 1024, 1024]), ("wo", 8192, 8192, None), ("w1", 28672, 8192, None),
                   ("w2", 8192, 28672, None), ("w3", 28672, 8192, None)],
}
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)


def layer_matrices(layer):
    """(shape of each matrix torch.optim.Muon sees, DMuon's parameters with their row blocks)."""
    separate, fused = [], []
    for _, rows, cols, split in layer:
        if split:
            separate += [(r, cols) for r in split]
            starts = [sum(split[:i]) for i in range(len(split))]
            fused.append(((rows, cols), [((s, s + r),) for s, r in zip(starts, split)]))
        else:
            separate.append((rows, cols))
            fused.append(((rows, cols), [((0, rows),)]))
    return separate, fused


def time_ms(fn, device, reps: int = 3) -> float:
    fn()  # warm-up (allocator, kernels)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps
    import time

    begin = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - begin) * 1e3 / reps


def newton_schulz_rows(layers=LLAMA3_LAYERS, device=None, reps: int = 3) -> list[tuple]:
    """(model, implementation, matrices, ms, TFLOP/s) for one layer's Muon update."""
    device = device or torch.device("cuda")
    return [row for model, layer in layers.items() for row in _time_layer(model, layer, device, reps)]


def _time_layer(model: str, layer, device, reps: int) -> list[tuple]:
    separate, fused = layer_matrices(layer)
    flops = sum(ns_flops(r, c) for r, c in separate)
    g = torch.Generator(device=device).manual_seed(0)
    torch_params = [torch.nn.Parameter(torch.randn(s, device=device, generator=g)) for s in separate]
    for p in torch_params:
        p.grad = torch.randn_like(p)
    reference = torch.optim.Muon(torch_params, **MUON)
    params = [torch.randn(s, device=device, generator=g) for s, _ in fused]
    grads = [torch.randn_like(p) for p in params]
    buffers = [torch.zeros_like(p) for p in params]
    blocks = [b for _, b in fused]

    def dmuon():
        with torch.no_grad():
            muon_step(params, grads, buffers, blocks, ns_steps=5, **MUON)

    rows = []
    for name, fn in (("torch.optim.Muon (per-matrix loop)", reference.step), ("DMuon muon_step (batched)", dmuon)):
        ms = time_ms(fn, device, reps)
        rows.append((model, name, len(separate), ms, flops / (ms / 1e3) / 1e12))
    return rows


# ---- jobs through run_train.sh -------------------------------------------------------------------------
STEP = re.compile(r"step:\s+(\d+)\s+loss:\s+([\d.]+).*?memory:\s+([\d.]+)GiB")


def run_job(name: str, args: list[str], env: dict | None = None, timeout: int = 420) -> dict:
    """Runs ./run_train.sh with one rank; returns losses, peak memory, and the first error line."""
    environment = {**os.environ, "NGPU": "1", "PYTHON": sys.executable, **(env or {})}
    command = ["./run_train.sh", "--metrics.disable_color_printing", "true", *args]
    try:
        result = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=timeout)
        out, code = result.stdout + result.stderr, result.returncode
    except subprocess.TimeoutExpired as e:
        out, code = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
    steps = {int(s): (float(loss), float(mem)) for s, loss, mem in STEP.findall(out)}
    error = next((line.strip() for line in out.splitlines() if "Error" in line), "")
    return {"name": name, "code": code, "steps": steps, "error": error[:160]}


def job_rows(tmp: str) -> list[tuple]:
    rows = []
    sync_env = {"TITAN_DMUON_SYNC_DEBUG_FROM_STEP": "3"}
    base = ["--training.steps", "6", "--metrics.log_freq", "100", "--job.dump_folder"]
    for compiled in ("false", "true"):
        job = run_job(f"main job, compile {compiled}", [*base, f"{tmp}/main_{compiled}", "--compile.enable", compiled], sync_env)
        ok = job["code"] == 0
        rows.append(("(b) " + job["name"], "sync debug 'error', steps 3-6", "no host sync" if ok else f"FAILED: {job['error']}",
                     _losses(job)))
    for optimizer in ("dmuon", "adamw"):
        job = run_job(f"llama3 1B, {optimizer}", ["--training.steps", "4", "--job.dump_folder", f"{tmp}/1b_{optimizer}"],
                      {"MODULE": "benchmarks.gpu_configs", "CONFIG": f"llama3_1b_{optimizer}"}, timeout=600)
        peak = max((mem for _, mem in job["steps"].values()), default=float("nan"))
        rows.append((f"(c) {job['name']}", "peak reserved GiB", f"{peak:.2f}" if job["code"] == 0 else f"FAILED: {job['error']}",
                     _losses(job)))
    return rows


def _losses(job) -> str:
    return " ".join(f"{loss:.3f}" for _, (loss, _) in sorted(job["steps"].items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-jobs", action="store_true", help="only the Newton-Schulz timing")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check needs an NVIDIA GPU (torch.cuda.is_available() is False); nothing was run.")
        sys.exit(2)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    lines = ["| check | what | result | detail |", "|---|---|---|---|"]
    for model, name, matrices, ms, tflops in newton_schulz_rows():
        lines.append(f"| (a) NS, one {model} layer | {name} | {ms:.1f} ms | {matrices} matrices, {tflops:.0f} TFLOP/s |")
    if not args.skip_jobs:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            for check, what, result, losses in job_rows(tmp):
                lines.append(f"| {check} | {what} | {result} | losses {losses} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
