"""One prepared check on one NVIDIA GPU (under 8 minutes on an H200), printing one table.

    .venv/bin/python benchmarks/gpu_check.py [--skip-jobs] [--skip-runtime]

(a) Newton–Schulz on one layer of llama3 8B and 70B shapes: DMuon's update
    (``muon_step``: shape groups batched) against ``torch.optim.Muon``'s per-matrix loop.
(1) One coalesced broadcast + reduce ``Launch`` on a real 1-rank NCCL group with
    DMuon's size-1 shortcut bypassed, behind a ``torch.cuda._sleep`` on its side
    stream: one launch, the host not blocked, the compute stream waits, values, no sync.
(2) The runtime on CUDA tensors, rank 0 of world 4 (Z3, Z2), 2 x 2 (HSDP) and world 1
    simulated on the fake process group under ``TORCH_CUDA_SANITIZER=1``; memory flat.
(3) Race amplification at world 1: sleeps at every side-stream block and buffer free
    leave the final weights bitwise unchanged (shortcut bypassed, and not).
(4) TorchTitan's llama3 debug model on one GPU with its default attention
    (FlexAttention), through ./run_train.sh: (b) Z3 compile off and (Z3) compile on with
    gradient accumulation 2 under ``torch.cuda.set_sync_debug_mode("error")`` from step 3;
    with ``TORCH_LOGS=recompiles,graph_breaks`` no recompile or graph break after step 2
    (Z3 with accumulation, Z2); (c) peak memory of DMuon vs AdamW on llama3 1B.
(5) One profiled steady-state step, DMuon-Z3 vs FSDP2-Z3 + AdamW (world 1): host time in
    the hooks, CUDA kernels per layer, compute-stream idle time.
(6) TorchTitan's AdamW job with CUDA-graph capture on vs off: median step time.

(1), (2), (3) and (5) are in ``benchmarks/gpu_runtime.py`` (each in a subprocess: (2)
needs the sanitizer on from the start; a hang there cannot stop the rest). NCCL refuses
two ranks on one GPU, so every real process group here has one rank. A failing check
is a FAILED row; the others still run. Without CUDA it refuses at once (exit code 2).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from titan_dmuon.muon_math import muon_step, ns_flops  # noqa: E402

BUDGET_S = 470  # the whole check, every subprocess included (8 minutes, less a margin)

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


# ---- the time budget -----------------------------------------------------------------------------------
class Budget:
    """Seconds left of the whole check; each subprocess gets its own limit, capped by what is left."""

    def __init__(self, total_s: float = BUDGET_S) -> None:
        self.deadline = time.monotonic() + total_s

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def timeout(self, own_s: float, *, least_s: float = 20) -> float | None:
        """The limit for the next subprocess, or None when too little is left to start it."""
        left = self.left()
        return None if left < least_s else min(own_s, left)


def progress(message: str) -> None:
    print(f"gpu_check: {message}", file=sys.stderr, flush=True)


# ---- (1) (2) (3) (5): the runtime checks, in subprocesses ----------------------------------------------------
RUNTIME_RUNS = (  # (checks, extra environment, own limit in s, estimate in s)
    (("launch", "race", "profile"), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, 150, 40),
    (("fake_pg",), {"TORCH_CUDA_SANITIZER": "1"}, 150, 35),
)


def runtime_rows(checks, env: dict, timeout: float | None, *, device: str = "cuda", tiny: bool = False) -> list[tuple]:
    """Runs benchmarks/gpu_runtime.py on ``checks``; a check that printed no rows (a crash, a
    timeout) gets one FAILED row with the first error line of the output."""
    from benchmarks.gpu_runtime import LABELS, ROW_PREFIX

    if timeout is None:
        return [(LABELS[c], c, "SKIPPED: the 8-minute budget is spent", "") for c in checks]
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_runtime.py"), *checks, "--device", device]
    if tiny:
        command.append("--tiny")
    out, code = run_command(command, {**os.environ, **env}, timeout, merge=False)  # (each JSON line whole)
    failure = code if isinstance(code, str) else f"exit code {code}"
    rows, done = [], set()
    for line in out.splitlines():
        if line.startswith(ROW_PREFIX):
            report = json.loads(line[len(ROW_PREFIX):])
            done.add(report["check"])
            rows += [tuple(r) for r in report["rows"]]
    for check in checks:
        if check not in done:
            rows.append((LABELS[check], check, f"FAILED: {failure}: {first_error(out) or 'no error line'}", ""))
    return rows


def _text(stream) -> str:
    return stream.decode(errors="replace") if isinstance(stream, bytes) else (stream or "")


def run_command(command: list[str], env: dict, timeout: float, *, merge: bool = True) -> tuple[str, int | str]:
    """(its output, exit code or "timed out after N s"); ``merge``: stdout and stderr as one stream
    (in the order they came), else stdout then stderr. The command runs in its own session, so that
    on a timeout its whole process group goes (torchrun's workers too, which would otherwise keep
    the GPU), not only the process started here."""
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge else subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return out + (err or ""), proc.returncode
    except subprocess.TimeoutExpired:
        out = err = ""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                out, err = proc.communicate(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
        return _text(out) + _text(err), f"timed out after {timeout:.0f} s"


# ---- (4) (6) (b) (c): jobs through run_train.sh ----------------------------------------------------------------
STEP = re.compile(r"step:\s+(\d+)\s+loss:\s+([\d.]+).*?memory:\s+([\d.]+)GiB.*?tps:\s+([\d,]+)")
TITAN_TIME = re.compile(r"\[titan\] \d{4}-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d),(\d{3}) .*?step:\s+(\d+)\s+loss:")
TORCH_LOG = re.compile(r"[VIWEDC](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6}) \d+ \S+\] (.*)")
ARTIFACT = re.compile(r"\[__(recompiles|graph_breaks)\](.*)")
HEADLINE = re.compile(r"Recompiling function|Graph break")  # the first line of each message
COMPILED = "Step 2: done compiler function"  # TORCH_LOGS=dynamo: one line per graph compiled
ERROR = re.compile(r"\b(\w+(Error|Exception)|error):")
FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
SYNC_DEBUG = {"TITAN_DMUON_SYNC_DEBUG_FROM_STEP": "3"}
COMPILE_LOGS = {"TORCH_LOGS": "recompiles,graph_breaks,dynamo"}  # dynamo: graphs compiled, the control
OWN_ENV = ("CONFIG_FILE", "MODULE", "CONFIG", "TORCH_LOGS", "TITAN_DMUON_SYNC_DEBUG_FROM_STEP", "TITAN_DMUON_PRECHECK")


@dataclass(frozen=True)
class Job:
    key: str
    title: str
    config: str  # a TOML file (run by titan_dmuon's entry point), or "module:function" (TorchTitan's own)
    args: tuple[str, ...]
    env: dict = field(default_factory=dict)
    timeout_s: int = 150
    estimate_s: int = 30  # on one H200: start (~15-30 s), compilation, steps

    @property
    def tokens_per_step(self) -> int | None:
        """Tokens one step trains on its one rank, where its command line sets the batch and sequence."""
        values = {a: b for a, b in zip(self.args, self.args[1:]) if a.startswith("--") and not b.startswith("--")}
        batch = values.get("--training.global_batch_size", values.get("--training.local_batch_size"))
        seq = values.get("--training.seq_len")
        return int(batch) * int(seq) if batch and seq else None

    @property
    def python_door(self) -> bool:
        return not self.config.endswith(".toml")

    def command_args(self, dump_folder: str) -> list[str]:
        """Its arguments for ./run_train.sh, in its door's spelling (booleans as flags in both)."""
        folder = ["--dump_folder", dump_folder] if self.python_door else ["--job.dump_folder", dump_folder]
        return ["--metrics.disable_color_printing", *folder, *self.args]

    def environment(self, *, precheck: bool) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in OWN_ENV}
        if self.python_door:
            module, function = self.config.split(":")
            env.update(MODULE=module, CONFIG=function)
        else:
            env["CONFIG_FILE"] = self.config
        if not precheck:
            env["TITAN_DMUON_PRECHECK"] = "0"  # the workers still check; saves a TorchTitan import
        return {**env, "NGPU": "1", "PYTHON": sys.executable, **self.env}


DEBUG = "train_configs/debug_model.toml"
JOBS = (
    Job("z3_eager", "llama3 debug, DMuon-Z3, compile off", DEBUG,
        ("--training.steps", "6", "--metrics.log_freq", "100", "--compile.enable", "false"), SYNC_DEBUG, 150, 30),
    Job("z3_compile_accum2", "llama3 debug, DMuon-Z3, compile on, grad accumulation 2", DEBUG,
        ("--training.steps", "6", "--metrics.log_freq", "1", "--compile.enable", "true", "--training.global_batch_size", "4"),
        {**SYNC_DEBUG, **COMPILE_LOGS}, 240, 90),
    Job("z2_compile", "llama3 debug, DMuon-Z2, compile on", "train_configs/debug_model_z2.toml",
        ("--training.steps", "6", "--metrics.log_freq", "1", "--compile.enable", "true"), COMPILE_LOGS, 200, 55),
    Job("1b_dmuon", "llama3 1B, DMuon", "benchmarks.gpu_configs:llama3_1b_dmuon", ("--training.steps", "4"), {}, 180, 45),
    Job("1b_adamw", "llama3 1B, AdamW", "benchmarks.gpu_configs:llama3_1b_adamw", ("--training.steps", "4"), {}, 180, 40),
    *(Job(f"adamw_graphs_{state}", f"llama3 debug, AdamW, CUDA graphs {state}", "train_configs/debug_model_adamw.toml",
          ("--training.steps", "20", "--metrics.log_freq", "1", "--training.local_batch_size", "2",
           "--training.seq_len", "256", "--training.disable_cuda_graphs", disable), {}, 120, 25)
      for state, disable in (("on", "false"), ("off", "true"))),
)


def run_job(job: Job, tmp: str, timeout: float | None, *, precheck: bool = False) -> dict:
    """./run_train.sh with one rank; its per-step figures, the first error line and the whole output."""
    if timeout is None:
        return {"key": job.key, "code": "skipped", "steps": {}, "error": "the 8-minute budget is spent", "output": ""}
    command = ["./run_train.sh", *job.command_args(f"{tmp}/{job.key}")]
    out, code = run_command(command, job.environment(precheck=precheck), timeout)
    error = first_error(out) if code != 0 else ""
    return {"key": job.key, "code": code, "steps": parse_steps(out), "error": error, "output": out}


def first_error(out: str) -> str:
    """The first line that reads as an error (an exception line, else any line naming an error), with
    the innermost frame of titan_dmuon or TorchTitan in the traceback above it, if any."""
    lines = [line.strip() for line in out.splitlines()]
    index = next((i for i, line in enumerate(lines) if ERROR.search(line)), None)
    if index is None:
        index = next((i for i, line in enumerate(lines) if "Error" in line), None)
    if index is None:
        return ""
    where = ""
    for line in reversed(lines[max(0, index - 60) : index]):
        frame = FRAME.search(line)
        if frame and ("titan_dmuon" in frame.group(1) or "torchtitan" in frame.group(1)):
            path = frame.group(1)
            path = path[path.rfind("titan_dmuon/") if "titan_dmuon/" in path else path.rfind("torchtitan/") :]
            where = f" (at {path}:{frame.group(2)} in {frame.group(3)})"
            break
    return (lines[index][:200] + where)[:300]


def parse_steps(out: str) -> dict[int, tuple[float, float, float]]:
    """{step: (loss, peak reserved GiB, tokens/s)} from TorchTitan's step lines."""
    return {int(s): (float(loss), float(mem), float(tps.replace(",", ""))) for s, loss, mem, tps in STEP.findall(out)}


def compile_messages(out: str, after_step: int = 2) -> dict:
    """What TORCH_LOGS printed after step ``after_step``'s line: recompile and graph-break lines,
    and graphs compiled (``dynamo`` at INFO; some before it show that the logs reach this output).

    TorchTitan logs to stdout and torch to stderr, which torchrun relays separately, so the
    order of lines is not reliable: both carry timestamps, which decide (lines are compared by
    time where both parse, else by position)."""
    lines = out.splitlines()
    mark_time = mark_index = None
    for i, line in enumerate(lines):
        m = TITAN_TIME.search(line)
        if m and int(m.group(7)) == after_step:
            mark_time = tuple(int(x) for x in m.group(1, 2, 3, 4, 5)) + (int(m.group(6)) * 1000,)
            mark_index = i
            break
        step = STEP.search(line)
        if mark_index is None and step and int(step.group(1)) == after_step:
            mark_index = i
    found = {"step_seen": mark_index is not None, "lines_after": 0, "messages_before": 0, "messages_after": 0,
             "graphs_before": 0, "graphs_after": 0, "first_after": ""}
    for i, line in enumerate(lines):
        m = TORCH_LOG.search(line)
        if not m:
            continue
        when = tuple(int(x) for x in m.group(1, 2, 3, 4, 5, 6))
        after = mark_index is not None and (when > mark_time if mark_time is not None else i > mark_index)
        period = "after" if after else "before"
        if COMPILED in m.group(7):
            found[f"graphs_{period}"] += 1
        artifact = ARTIFACT.search(m.group(7))
        if artifact is None:
            continue
        headline = bool(HEADLINE.search(artifact.group(2)))
        found[f"messages_{period}"] += headline
        if after:
            found["lines_after"] += 1
            if headline and not found["first_after"]:
                found["first_after"] = artifact.group(2).strip()[:160]
    return found


def median_step_ms(steps: dict, tokens_per_step: int, from_step: int = 3) -> float:
    """Median step time of steps ``from_step``.. from TorchTitan's tokens/s (one step per log line)."""
    times = [1e3 * tokens_per_step / tps for s, (_, _, tps) in sorted(steps.items()) if s >= from_step and tps > 0]
    return statistics.median(times) if times else float("nan")


def _losses(job) -> str:
    return " ".join(f"{loss:.3f}" for _, (loss, _, _) in sorted(job["steps"].items()))


def _failed(job) -> str:
    return "SKIPPED: the 8-minute budget is spent" if job["code"] == "skipped" else f"FAILED ({job['code']}): {job['error']}"


def job_rows(results: dict[str, dict]) -> list[tuple]:
    """Table rows from the jobs' results (keyed by Job.key; missing jobs give no rows)."""
    rows = []
    titles = {job.key: job.title for job in JOBS}
    tokens = {job.key: job.tokens_per_step for job in JOBS}
    for key in ("z3_eager", "z3_compile_accum2"):
        if key in results:
            job = results[key]
            rows.append((f"(b) {titles[key]}", "sync debug 'error', steps 3-6",
                         "no host sync" if job["code"] == 0 else _failed(job), f"losses {_losses(job)}"))
    for key in ("z3_compile_accum2", "z2_compile"):
        if key in results:
            job = results[key]
            if job["code"] != 0:
                rows.append((f"(4) {titles[key]}", "TORCH_LOGS lines after step 2", _failed(job), ""))
                continue
            logs = compile_messages(job["output"])
            clean = logs["step_seen"] and logs["lines_after"] == 0 and logs["graphs_after"] == 0 and logs["graphs_before"] > 0
            if clean:
                result = "pass (0 lines)"
            elif not logs["step_seen"]:
                result = "FAIL: no 'step:  2' line"
            elif logs["graphs_before"] == 0:
                result = "FAIL: no graph compiled in the log (TORCH_LOGS not reaching it, or compile off)"
            else:
                result = f"FAIL: {logs['lines_after']} lines, {logs['graphs_after']} graphs compiled: {logs['first_after']}"
            rows.append((f"(4) {titles[key]}", "TORCH_LOGS lines after step 2", result,
                         f"{logs['graphs_before']} graphs compiled and {logs['messages_before']} recompile/graph-break "
                         f"messages up to step 2, {logs['messages_after']} after; FlexAttention; losses {_losses(job)}"))
    for key in ("1b_dmuon", "1b_adamw"):
        if key in results:
            job = results[key]
            peak = max((mem for _, mem, _ in job["steps"].values()), default=float("nan"))
            rows.append((f"(c) {titles[key]}", "peak reserved GiB", f"{peak:.2f}" if job["code"] == 0 else _failed(job),
                         f"losses {_losses(job)}"))
    medians = {}
    for state in ("on", "off"):
        key = f"adamw_graphs_{state}"
        if key in results:
            job = results[key]
            medians[state] = median_step_ms(job["steps"], tokens[key]) if job["code"] == 0 else float("nan")
            detail = f"median of steps 3-{max(job['steps'], default=0)}, from tokens/s"
            if state == "off" and math.isfinite(medians.get("on", math.nan)) and math.isfinite(medians["off"]):
                detail += f"; turning capture off costs {100 * (medians['off'] / medians['on'] - 1):+.1f}%"
            rows.append((f"(6) {titles[key]}", "median step ms", f"{medians[state]:.2f}" if job["code"] == 0 else _failed(job),
                         detail))
    return rows


def run_jobs(tmp: str, budget: Budget, jobs=JOBS) -> dict[str, dict]:
    results = {}
    for i, job in enumerate(jobs):
        start = time.monotonic()
        results[job.key] = run_job(job, tmp, budget.timeout(job.timeout_s), precheck=i == 0)
        progress(f"{job.key}: {results[job.key]['code']} in {time.monotonic() - start:.0f} s")
    return results


def estimate_s() -> int:
    """The planned wall time on one H200 (NS timing ~15 s, then the subprocesses)."""
    return 15 + sum(run[3] for run in RUNTIME_RUNS) + sum(job.estimate_s for job in JOBS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-jobs", action="store_true", help="no ./run_train.sh jobs ((b), (c), (4), (6))")
    parser.add_argument("--skip-runtime", action="store_true", help="no runtime checks ((1), (2), (3), (5))")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check needs an NVIDIA GPU (torch.cuda.is_available() is False); nothing was run.")
        sys.exit(2)
    budget, started = Budget(), time.monotonic()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; planned ~{estimate_s()} s of {BUDGET_S}")
    rows = []
    try:
        for model, name, matrices, ms, tflops in newton_schulz_rows():
            rows.append((f"(a) NS, one {model} layer", name, f"{ms:.1f} ms", f"{matrices} matrices, {tflops:.0f} TFLOP/s"))
    except Exception as e:  # noqa: BLE001 - a row, and the other checks still run
        from benchmarks.gpu_runtime import first_line

        rows.append(("(a) NS", "one layer's update", f"FAILED: {first_line(e)}", ""))
    torch.cuda.empty_cache()
    progress(f"(a) done at {time.monotonic() - started:.0f} s")
    if not args.skip_runtime:
        for checks, env, own_s, _ in RUNTIME_RUNS:
            rows += runtime_rows(checks, env, budget.timeout(own_s))
            progress(f"{', '.join(checks)} done at {time.monotonic() - started:.0f} s")
    if not args.skip_jobs:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            rows += job_rows(run_jobs(tmp, budget))
    rows.append(("total", "wall time", f"{time.monotonic() - started:.0f} s", f"budget {BUDGET_S} s"))
    print(table(rows))


def table(rows) -> str:
    """One markdown table: check, what, result, detail (a '|' inside a cell escaped)."""
    lines = ["| check | what | result | detail |", "|---|---|---|---|"]
    lines += ["| " + " | ".join(str(cell).replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
