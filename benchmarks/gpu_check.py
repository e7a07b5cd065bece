"""One prepared check on one NVIDIA GPU (under 8 minutes on an H200), printing one table.

    python3 benchmarks/gpu_check.py [--skip-jobs] [--skip-runtime]   # the repository on PYTHONPATH
    python3 benchmarks/gpu_check.py --cpu                            # the same flow on the CPU, tiny sizes

It runs on torch 2.11 without TorchTitan (the GPU machine this project can be lent: torch
2.11.0+cu130, no TorchTitan, nothing to install): the core rows need only titan_dmuon's
TorchTitan-free core; the TorchTitan rows are skipped there with one line saying why.

(a) The bf16 matmul peak of this GPU, then Newton–Schulz on one layer of llama3 8B and 70B
    shapes: ``torch.optim.Muon``'s per-matrix iteration, and DMuon's batched ``orthogonalise``
    once per method in ``ns_math.NS_METHODS``: ms, TFLOP/s and their share of that peak.
(8) Newton–Schulz batches replayed from CUDA graphs (``ns_graphs``) against eager on one llama3 8B
    layer's Muon step: bitwise equal weights, host time per step (``benchmarks/gpu_ns_graphs.py``).
(1) One coalesced broadcast + reduce ``Launch`` on a real 1-rank NCCL group with
    DMuon's size-1 shortcut bypassed, behind a ``torch.cuda._sleep`` on its side
    stream: one launch, the host not blocked, the compute stream waits, values, no sync.
(2) The runtime on CUDA tensors, rank 0 of world 4 (Z3, Z2), 2 x 2 (HSDP) and world 1
    simulated on the fake process group under ``TORCH_CUDA_SANITIZER=1``; memory flat.
(3) Race amplification at world 1: sleeps at every side-stream block and buffer free
    leave the final weights bitwise unchanged (shortcut bypassed, and not).
(5) One profiled steady-state step, DMuon-Z3 vs FSDP2-Z3 + AdamW (world 1): host time in
    the hooks, CUDA kernels per layer, compute-stream idle time.
(7) FSDP2 + DMuon-Z3 from plain PyTorch on a 1-rank NCCL group: fp32 weights against
    ``torch.optim.Muon`` + ``torch.optim.AdamW`` in one process; with bf16 mixed precision the
    step time, peak memory and host syncs beside FSDP2 + AdamW.
TorchTitan rows (TorchTitan 0.3.0 on torch 2.14; skipped where either is missing):
(4) TorchTitan's llama3 debug model on one GPU with its default attention
    (FlexAttention), through ./run_train.sh: (b) Z3 compile off and (Z3) compile on with
    gradient accumulation 2 under ``torch.cuda.set_sync_debug_mode("error")`` from step 3;
    with ``TORCH_LOGS=recompiles,graph_breaks`` no recompile or graph break after step 2
    (Z3 with accumulation, Z2); (c) peak memory of DMuon vs AdamW on llama3 1B.
(6) TorchTitan's AdamW job with CUDA-graph capture on vs off: median step time.

(1), (2), (3), (5) and (7) are in ``benchmarks/gpu_runtime.py``, each group in a subprocess ((2)
needs the sanitizer on from the start; a hang there cannot stop the rest). NCCL refuses two
ranks on one GPU, so every real process group here has one rank. A failing check is a FAILED
row; the others still run. Exit status: 0 when every row that ran passed, 1 when one failed
(FAIL, FAILED, INCONCLUSIVE, or skipped because the 8-minute budget was spent), 2 without CUDA
(nothing run; ``--cpu`` runs the same flow there, what the CPU tests exercise).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import inspect
import json
import math
import os
import platform
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

from titan_dmuon.math import muon_update  # noqa: E402
from titan_dmuon.math import ns_methods as ns_math  # noqa: E402

BUDGET_S = 470  # the whole check, every subprocess included (8 minutes, less a margin)
BUDGET_SPENT = "SKIPPED: the 8-minute budget is spent"
TITAN_TORCH = (2, 14)  # TorchTitan 0.3.0's torch

# one transformer block: (name, rows, cols, row blocks of its fused q/k/v)
LLAMA3_LAYERS = {
    "llama3 8B": [
        ("wqkv", 6144, 4096, [4096, 1024, 1024]),
        ("wo", 4096, 4096, None),
        ("w1", 14336, 4096, None),
        ("w2", 4096, 14336, None),
        ("w3", 14336, 4096, None),
    ],
    "llama3 70B": [
        ("wqkv", 10240, 8192, [8192, 1024, 1024]),
        ("wo", 8192, 8192, None),
        ("w1", 28672, 8192, None),
        ("w2", 8192, 28672, None),
        ("w3", 28672, 8192, None),
    ],
}
TINY_LAYERS = {"tiny": [("wqkv", 24, 16, [16, 4, 4]), ("w1", 40, 16, None), ("w2", 16, 40, None)]}
PEAK_SIZE = {"cuda": 8192, "cpu": 256}  # the square bf16 matmul whose TFLOP/s is the peak


def layer_matrices(layer) -> list[tuple[int, int]]:
    """The 2-D matrices Newton–Schulz sees in one layer (a fused q/k/v is its q, k and v blocks)."""
    return [(r, cols) for _, rows, cols, split in layer for r in (split or [rows])]


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


def ns_methods() -> tuple[str, ...]:
    """The Newton–Schulz methods of ``math/ns_methods.py`` ("torch" first); ("torch",) where it names none."""
    return tuple(getattr(ns_math, "NS_METHODS", ("torch",)))


def with_method(fn, method: str):
    """``fn`` with ``ns_method=method`` where it takes that keyword, else ``fn`` itself (which is
    the "torch" method: the math before it had methods)."""
    if "ns_method" in inspect.signature(fn).parameters:
        return functools.partial(fn, ns_method=method)
    if method != "torch":
        raise TypeError(f"ns_methods.{fn.__name__} takes no ns_method, so {method!r} cannot run")
    return fn


def matmul_peak_tflops(device, n: int | None = None, reps: int = 10) -> float:
    """bf16 TFLOP/s of one square ``n``-sized matmul on ``device``: the best of 3 timings."""
    n = n or PEAK_SIZE[device.type]
    g = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(n, n, device=device, generator=g, dtype=torch.bfloat16) for _ in range(2))
    ms = min(time_ms(lambda: torch.mm(a, b), device, reps) for _ in range(3))
    return 2 * n**3 / (ms / 1e3) / 1e12


def newton_schulz_rows(layers=LLAMA3_LAYERS, device=None, reps: int = 3, *, peak_tflops: float) -> list[tuple]:
    """Table rows: one layer's Newton–Schulz through ``torch.optim.Muon``'s per-matrix iteration,
    then batched once per method: ms, TFLOP/s (the method's own FLOPs: ``ns_flops``) and the share
    of ``peak_tflops``. A method whose output is not finite is a FAIL; one that raises, FAILED."""
    device = device or torch.device("cuda")
    rows = []
    for model, layer in layers.items():
        check = f"(a) Newton–Schulz, one {model} layer"
        shapes = layer_matrices(layer)
        g = torch.Generator(device=device).manual_seed(0)
        matrices = [torch.randn(s, device=device, generator=g).bfloat16() for s in shapes]
        runs = [("torch.optim.Muon's iteration, per matrix", "torch", "exact")]
        runs += [(f"ns_method {m!r}, batched", m, "batched") for m in ns_methods()]
        times = {}  # what -> ms
        for what, method, ns_mode in runs:
            try:
                ms, finite, flops = _time_newton_schulz(matrices, method, ns_mode, device, reps)
            except Exception as e:  # noqa: BLE001 - a row; the other methods still run
                from benchmarks.gpu_runtime import first_line

                rows.append((check, what, f"FAILED: {first_line(e)}", ""))
                continue
            times[what] = ms
            tflops = flops / (ms / 1e3) / 1e12
            # batched 'torch' against the per-matrix iteration, every other method against batched 'torch'
            against = runs[0][0] if method == "torch" else runs[1][0]
            relative = (
                f"; {ms / times[against]:.2f}x the time of {against}" if against in times and against != what else ""
            )
            rows.append(
                (
                    check,
                    what,
                    f"{ms:.2f} ms" if finite else "FAIL: a non-finite output",
                    f"{tflops:.3g} TFLOP/s = {100 * tflops / peak_tflops:.0f}% of the bf16 peak; {len(shapes)} "
                    f"matrices, {flops / 1e12:.3g} TFLOP{relative}",
                )
            )
    return rows


def _time_newton_schulz(matrices, method: str, ns_mode: str, device, reps: int) -> tuple[float, bool, int]:
    """(ms per call, every output finite, FLOPs) of ``orthogonalise`` on ``matrices`` (bf16; the
    per-matrix path normalises them in place, which leaves them the same matrices up to scale)."""
    orthogonalise = (
        with_method(muon_update.orthogonalise, method) if ns_mode == "batched" else muon_update.orthogonalise
    )
    flops = sum(with_method(ns_math.ns_flops, method)(*m.shape) for m in matrices)
    outputs: list = []

    def run():
        outputs[:] = orthogonalise(matrices, ns_mode=ns_mode)

    ms = time_ms(run, device, reps)
    return ms, all(bool(torch.isfinite(o).all()) for o in outputs), flops


def graph_rows(device, *, cpu: bool) -> list[tuple]:
    """Row (8): ``benchmarks/gpu_ns_graphs.py`` on one llama3 8B layer (``--cpu``: the tiny one)."""
    from benchmarks.gpu_ns_graphs import CHECK, ns_graph_rows

    model = "tiny" if cpu else "llama3 8B"
    try:
        return ns_graph_rows(
            layer_matrices((TINY_LAYERS if cpu else LLAMA3_LAYERS)[model]), f"one {model} layer", device
        )
    except Exception as e:  # noqa: BLE001 - a row, and the other checks still run
        from benchmarks.gpu_runtime import first_line

        return [(CHECK, f"one {model} layer", f"FAILED: {first_line(e)}", "")]


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


# ---- (1) (2) (3) (5) (7): the runtime checks, in subprocesses ------------------------------------------------
RUNTIME_RUNS = (  # (checks, extra environment on CUDA, own limit in s, estimate in s)
    (("launch", "race", "profile"), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, 150, 40),
    (("fake_pg",), {"TORCH_CUDA_SANITIZER": "1"}, 150, 35),
    (("fsdp_step",), {}, 150, 35),
)


def runtime_rows(checks, env: dict, timeout: float | None, *, device: str = "cuda", tiny: bool = False) -> list[tuple]:
    """Runs benchmarks/gpu_runtime.py on ``checks``; a check that printed no rows (a crash, a
    timeout) gets one FAILED row with the first error line of the output."""
    from benchmarks.gpu_runtime import LABELS, ROW_PREFIX

    if timeout is None:
        return [(LABELS[c], c, BUDGET_SPENT, "") for c in checks]
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_runtime.py"), *checks, "--device", device]
    if tiny:
        command.append("--tiny")
    out, code = run_command(command, {**os.environ, **env}, timeout, merge=False)  # (each JSON line whole)
    failure = code if isinstance(code, str) else f"exit code {code}"
    rows, done = [], set()
    for line in out.splitlines():
        if line.startswith(ROW_PREFIX):
            report = json.loads(line[len(ROW_PREFIX) :])
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
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge else subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
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
    Job(
        "z3_eager",
        "llama3 debug, DMuon-Z3, compile off",
        DEBUG,
        ("--training.steps", "6", "--metrics.log_freq", "100", "--compile.enable", "false"),
        SYNC_DEBUG,
        150,
        30,
    ),
    Job(
        "z3_compile_accum2",
        "llama3 debug, DMuon-Z3, compile on, grad accumulation 2",
        DEBUG,
        (
            "--training.steps",
            "6",
            "--metrics.log_freq",
            "1",
            "--compile.enable",
            "true",
            "--training.global_batch_size",
            "4",
        ),
        {**SYNC_DEBUG, **COMPILE_LOGS},
        240,
        90,
    ),
    Job(
        "z2_compile",
        "llama3 debug, DMuon-Z2, compile on",
        "train_configs/debug_model_z2.toml",
        ("--training.steps", "6", "--metrics.log_freq", "1", "--compile.enable", "true"),
        COMPILE_LOGS,
        200,
        55,
    ),
    Job(
        "1b_dmuon", "llama3 1B, DMuon", "benchmarks.gpu_configs:llama3_1b_dmuon", ("--training.steps", "4"), {}, 180, 45
    ),
    Job(
        "1b_adamw", "llama3 1B, AdamW", "benchmarks.gpu_configs:llama3_1b_adamw", ("--training.steps", "4"), {}, 180, 40
    ),
    *(
        Job(
            f"adamw_graphs_{state}",
            f"llama3 debug, AdamW, CUDA graphs {state}",
            "train_configs/debug_model_adamw.toml",
            (
                "--training.steps",
                "20",
                "--metrics.log_freq",
                "1",
                "--training.local_batch_size",
                "2",
                "--training.seq_len",
                "256",
                "--training.disable_cuda_graphs",
                disable,
            ),
            {},
            120,
            25,
        )
        for state, disable in (("on", "false"), ("off", "true"))
    ),
)


def run_job(job: Job, tmp: str, timeout: float | None, *, precheck: bool = False) -> dict:
    """./run_train.sh with one rank; its per-step figures, the first error line and the whole output."""
    if timeout is None:
        return {"key": job.key, "code": "skipped", "steps": {}, "error": BUDGET_SPENT, "output": ""}
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
    found = {
        "step_seen": mark_index is not None,
        "lines_after": 0,
        "messages_before": 0,
        "messages_after": 0,
        "graphs_before": 0,
        "graphs_after": 0,
        "first_after": "",
    }
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
    return BUDGET_SPENT if job["code"] == "skipped" else f"FAILED ({job['code']}): {job['error']}"


def job_rows(results: dict[str, dict]) -> list[tuple]:
    """Table rows from the jobs' results (keyed by Job.key; missing jobs give no rows)."""
    rows = []
    titles = {job.key: job.title for job in JOBS}
    tokens = {job.key: job.tokens_per_step for job in JOBS}
    for key in ("z3_eager", "z3_compile_accum2"):
        if key in results:
            job = results[key]
            rows.append(
                (
                    f"(b) {titles[key]}",
                    "sync debug 'error', steps 3-6",
                    "no host sync" if job["code"] == 0 else _failed(job),
                    f"losses {_losses(job)}",
                )
            )
    for key in ("z3_compile_accum2", "z2_compile"):
        if key in results:
            job = results[key]
            if job["code"] != 0:
                rows.append((f"(4) {titles[key]}", "TORCH_LOGS lines after step 2", _failed(job), ""))
                continue
            logs = compile_messages(job["output"])
            clean = (
                logs["step_seen"]
                and logs["lines_after"] == 0
                and logs["graphs_after"] == 0
                and logs["graphs_before"] > 0
            )
            if clean:
                result = "pass (0 lines)"
            elif not logs["step_seen"]:
                result = "FAIL: no 'step:  2' line"
            elif logs["graphs_before"] == 0:
                result = "FAIL: no graph compiled in the log (TORCH_LOGS not reaching it, or compile off)"
            else:
                result = (
                    f"FAIL: {logs['lines_after']} lines, {logs['graphs_after']} graphs compiled: {logs['first_after']}"
                )
            rows.append(
                (
                    f"(4) {titles[key]}",
                    "TORCH_LOGS lines after step 2",
                    result,
                    f"{logs['graphs_before']} graphs compiled and {logs['messages_before']} recompile/graph-break "
                    f"messages up to step 2, {logs['messages_after']} after; FlexAttention; losses {_losses(job)}",
                )
            )
    for key in ("1b_dmuon", "1b_adamw"):
        if key in results:
            job = results[key]
            peak = max((mem for _, mem, _ in job["steps"].values()), default=float("nan"))
            rows.append(
                (
                    f"(c) {titles[key]}",
                    "peak reserved GiB",
                    f"{peak:.2f}" if job["code"] == 0 else _failed(job),
                    f"losses {_losses(job)}",
                )
            )
    medians = {}
    for state in ("on", "off"):
        key = f"adamw_graphs_{state}"
        if key in results:
            job = results[key]
            medians[state] = median_step_ms(job["steps"], tokens[key]) if job["code"] == 0 else float("nan")
            detail = f"median of steps 3-{max(job['steps'], default=0)}, from tokens/s"
            if state == "off" and math.isfinite(medians.get("on", math.nan)) and math.isfinite(medians["off"]):
                detail += f"; turning capture off costs {100 * (medians['off'] / medians['on'] - 1):+.1f}%"
            rows.append(
                (
                    f"(6) {titles[key]}",
                    "median step ms",
                    f"{medians[state]:.2f}" if job["code"] == 0 else _failed(job),
                    detail,
                )
            )
    return rows


def run_jobs(tmp: str, budget: Budget, jobs=JOBS) -> dict[str, dict]:
    results = {}
    for i, job in enumerate(jobs):
        start = time.monotonic()
        results[job.key] = run_job(job, tmp, budget.timeout(job.timeout_s), precheck=i == 0)
        progress(f"{job.key}: {results[job.key]['code']} in {time.monotonic() - start:.0f} s")
    return results


def torch_version() -> tuple[int, int]:
    return tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())


def titan_blocker(*, cpu: bool = False, skip: bool = False) -> str | None:
    """Why the TorchTitan jobs cannot run here, or None (what this python lacks first: a ``--cpu``
    run on the lent machine's torch then gives the line that machine's GPU run gives)."""
    if skip:
        return "--skip-jobs"
    if importlib.util.find_spec("torchtitan") is None:
        return (
            f"TorchTitan is not installed for this python; TorchTitan 0.3.0 needs torch >= 2.14, this one has "
            f"torch {torch.__version__}"
        )
    if torch_version() < TITAN_TORCH:
        return f"TorchTitan 0.3.0 needs torch >= 2.14; this python has torch {torch.__version__}"
    if cpu:
        return "--cpu: they train on the GPU (their command lines are checked by the CPU tests)"
    return None


def titan_skipped_row(reason: str) -> tuple:
    return (
        "(b) (c) (4) (6) TorchTitan jobs",
        "./run_train.sh with NGPU=1",
        f"skipped: {reason}",
        "sync debug in the main job, recompiles and graph breaks, llama3 1B memory, CUDA graphs on/off",
    )


def environment_row(device) -> tuple:
    titan = importlib.util.find_spec("torchtitan")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})"
    return (
        "environment",
        "torch, CUDA, Python, device",
        f"torch {torch.__version__}",
        f"CUDA {torch.version.cuda}, Python {platform.python_version()}, {where}; "
        f"TorchTitan {'installed' if titan else 'not installed'}",
    )


def failed(row) -> bool:
    """A row that did not pass: FAIL/FAILED, INCONCLUSIVE, or not run for lack of time."""
    return str(row[2]).startswith(("FAIL", "INCONCLUSIVE", BUDGET_SPENT))


def estimate_s(*, jobs: bool = True, methods: int | None = None) -> int:
    """The planned wall time on one H200: Newton–Schulz (~5 s per implementation timed), the
    runtime subprocesses, the TorchTitan jobs where they run."""
    implementations = 1 + (len(ns_methods()) if methods is None else methods)
    return (
        10
        + 5 * implementations
        + sum(run[3] for run in RUNTIME_RUNS)
        + (sum(job.estimate_s for job in JOBS) if jobs else 0)
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-jobs", action="store_true", help="no TorchTitan jobs ((b), (c), (4), (6))")
    parser.add_argument("--skip-runtime", action="store_true", help="no runtime checks ((1), (2), (3), (5), (7))")
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="the same flow on the CPU with tiny sizes (what the CPU tests run); no TorchTitan jobs",
    )
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print(
            f"gpu_check needs an NVIDIA GPU (torch.cuda.is_available() is False with torch {torch.__version__}); "
            "nothing was run. --cpu runs the same flow on the CPU with tiny sizes."
        )
        return 2
    device = torch.device("cpu" if args.cpu else "cuda")
    blocker = titan_blocker(cpu=args.cpu, skip=args.skip_jobs)
    budget, started = Budget(), time.monotonic()
    rows = [environment_row(device)]
    print(
        f"gpu_check: {rows[0][2]}, {rows[0][3]}; planned ~{estimate_s(jobs=blocker is None)} s of {BUDGET_S}",
        flush=True,
    )
    try:
        peak = matmul_peak_tflops(device)
        rows.append(
            (
                "(a) bf16 matmul peak",
                f"torch.mm, {PEAK_SIZE[device.type]}^3, bf16",
                f"{peak:.3g} TFLOP/s",
                "best of 3 timings of 10; the Newton–Schulz rows' share is of this",
            )
        )
        rows += newton_schulz_rows(
            TINY_LAYERS if args.cpu else LLAMA3_LAYERS, device, 1 if args.cpu else 3, peak_tflops=peak
        )
    except Exception as e:  # noqa: BLE001 - a row, and the other checks still run
        from benchmarks.gpu_runtime import first_line

        rows.append(("(a) Newton–Schulz", "peak and one layer per method", f"FAILED: {first_line(e)}", ""))
    rows += graph_rows(device, cpu=args.cpu)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    progress(f"(a), (8) done at {time.monotonic() - started:.0f} s")
    if not args.skip_runtime:
        for checks, env, own_s, _ in RUNTIME_RUNS:
            rows += runtime_rows(
                checks, env if device.type == "cuda" else {}, budget.timeout(own_s), device=device.type, tiny=args.cpu
            )
            progress(f"{', '.join(checks)} done at {time.monotonic() - started:.0f} s")
    if blocker is not None:
        rows.append(titan_skipped_row(blocker))
    else:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            rows += job_rows(run_jobs(tmp, budget))
    rows.append(("total", "wall time", f"{time.monotonic() - started:.0f} s", f"budget {BUDGET_S} s"))
    print(table(rows))
    bad = [row for row in rows if failed(row)]
    print(
        f"gpu_check: {len(bad)} of {len(rows)} rows did not pass"
        if bad
        else f"gpu_check: every row that ran passed ({len(rows)} rows)",
        flush=True,
    )
    return 1 if bad else 0


def table(rows) -> str:
    """One markdown table: check, what, result, detail (a '|' inside a cell escaped)."""
    lines = ["| check | what | result | detail |", "|---|---|---|---|"]
    lines += ["| " + " | ".join(str(cell).replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
