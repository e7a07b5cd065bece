"""benchmarks/gpu_check.py (and benchmarks/gpu_runtime.py), as far as a CPU can check them.

One run of ``gpu_check.py --cpu`` (the whole flow, every runtime check in its subprocess, tiny
models) is shared by the tests of its rows; what only a GPU can show is skipped there and named in
each test's docstring. The Newton–Schulz rows, the trace summary and the job table's parsing run
in-process on tiny or synthetic inputs, and every job's command line is parsed by its own door.
These tests also run on torch 2.11 without TorchTitan (the GPU machine this project can be lent):
the two that need TorchTitan skip there.
"""

import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def _by_what(rows):
    return {what: result for _, what, result, _ in rows}


def parse_table(out: str) -> list[tuple[str, ...]]:
    """The rows of the one markdown table in ``out`` (cells unescaped); asserts there is one."""
    lines = out.splitlines()
    starts = [i for i, line in enumerate(lines) if line == "| check | what | result | detail |"]
    assert len(starts) == 1, out
    rows = []
    for line in lines[starts[0] + 2 :]:
        if not line.startswith("| "):
            break
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        assert len(cells) == 4, line
        rows.append(tuple(cells))
    return rows


@pytest.fixture(scope="module")
def dry_run():
    """``gpu_check.py --cpu`` once: (exit status, stdout, table rows)."""
    result = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--cpu"], cwd=ROOT, capture_output=True, text=True, timeout=400
    )
    return result.returncode, result.stdout, parse_table(result.stdout)


def _rows_of(rows, prefix: str):
    found = [row for row in rows if row[0].startswith(prefix)]
    assert found, (prefix, rows)
    return found


def test_refuses_without_cuda_and_runs_the_same_flow_on_the_cpu(dry_run, capsys):
    """Without CUDA it refuses (exit 2, nothing run); ``--cpu`` runs every core row once: one table
    that starts with the torch version and ends with the wall time, the TorchTitan jobs as one
    skipped row, exit 0 (every row that ran passed)."""
    from benchmarks import gpu_check

    if not torch.cuda.is_available():
        assert gpu_check.main([]) == 2
        assert "needs an NVIDIA GPU" in capsys.readouterr().out
    code, out, rows = dry_run
    assert code == 0 and out.splitlines()[-1].startswith("gpu_check: every row that ran passed"), out
    assert rows[0][:3] == ("environment", "torch, CUDA, Python, device", f"torch {torch.__version__}")
    assert rows[-1][:2] == ("total", "wall time")
    assert not [row for row in rows if gpu_check.failed(row)]
    titan = _rows_of(rows, "(b) (c) (4) (6) TorchTitan jobs")
    assert len(titan) == 1 and titan[0][2] == f"skipped: {gpu_check.titan_blocker(cpu=True)}"
    assert {row[0][:3] for row in rows} >= {"(a)", "(1)", "(2)", "(3)", "(5)", "(7)"}


def test_exit_status_counts_failures_and_a_spent_budget():
    from benchmarks.gpu_check import BUDGET_SPENT, failed

    assert [
        failed(("c", "w", result, ""))
        for result in (
            "pass",
            "12.3 ms",
            "skipped (cpu): no streams",
            "skipped: --skip-jobs",
            "FAIL: memory grew",
            "FAILED: x",
            "FAILED (1): RuntimeError",
            "INCONCLUSIVE: two runs without sleeps differ",
            BUDGET_SPENT,
        )
    ] == [False, False, False, False, True, True, True, True, True]


def test_the_torchtitan_rows_say_why_they_are_skipped(monkeypatch):
    """The lent GPU machine has torch 2.11 and no TorchTitan: one line says so. With TorchTitan on
    a torch older than 2.14 the line names the torch; with both, the jobs run (no reason)."""
    import importlib.util

    from benchmarks import gpu_check

    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert gpu_check.titan_blocker() == (
        "TorchTitan is not installed for this python; TorchTitan 0.3.0 needs torch "
        ">= 2.14, this one has torch 2.11.0+cu130"
    )
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert gpu_check.titan_blocker() == "TorchTitan 0.3.0 needs torch >= 2.14; this python has torch 2.11.0+cu130"
    assert gpu_check.titan_blocker(skip=True) == "--skip-jobs"
    monkeypatch.setattr(torch, "__version__", "2.14.1+cu130")
    assert gpu_check.titan_blocker() is None
    assert gpu_check.titan_blocker(cpu=True).startswith("--cpu: they train on the GPU")


# ---- (a) Newton–Schulz ---------------------------------------------------------------------------------------------
TINY_LAYERS = {"tiny": [("wqkv", 24, 16, [16, 4, 4]), ("w1", 40, 16, None), ("w2", 16, 40, None)]}


def test_newton_schulz_rows_per_method_light_up_with_the_methods_api(monkeypatch):
    """The rows are torch.optim.Muon's per-matrix iteration, then one per ``ns_methods.NS_METHODS``
    ("torch", "polar_express", "gram"), each timed through ``orthogonalise(..., ns_method=m)`` with its
    own ``ns_flops``; a non-finite output is a FAIL and an error a FAILED row (stood in for below), the
    others still run. Only a GPU gives the times and shares of the peak that matter."""
    from benchmarks import gpu_check
    from titan_dmuon.math import muon_update, ns_methods

    shapes = gpu_check.layer_matrices(TINY_LAYERS["tiny"])
    assert shapes == [(16, 16), (4, 16), (4, 16), (40, 16), (16, 40)]
    rows = gpu_check.newton_schulz_rows(TINY_LAYERS, torch.device("cpu"), 1, peak_tflops=1.0)
    assert [(r[1], r[2].endswith(" ms")) for r in rows] == [("torch.optim.Muon's iteration, per matrix", True)] + [
        (f"ns_method {m!r}, batched", True) for m in ns_methods.NS_METHODS
    ]
    for row, method in zip(rows, ("torch",) + ns_methods.NS_METHODS):
        flops = sum(ns_methods.ns_flops(r, c, ns_method=method) for r, c in shapes)
        assert f"5 matrices, {flops / 1e12:.3g} TFLOP" in row[3], row
    assert "x the time of torch.optim.Muon's iteration, per matrix" in rows[1][3]
    assert "x the time of ns_method 'torch', batched" in rows[2][3]

    real_orthogonalise, real_flops, calls = muon_update.orthogonalise, ns_methods.ns_flops, []
    flops = sum(real_flops(r, c) for r, c in shapes)

    def orthogonalise(matrices, *, ns_mode="batched", ns_method="torch"):
        calls.append((ns_mode, ns_method))
        if ns_method == "raises":
            raise ValueError("no such method")
        out = real_orthogonalise(matrices, ns_mode=ns_mode)
        return [o * float("nan") for o in out] if ns_method == "broken" else out

    def ns_flops(rows, cols, steps=ns_methods.NS_STEPS, *, ns_method="torch"):
        return real_flops(rows, cols, steps) // (2 if ns_method == "half" else 1)

    monkeypatch.setattr(ns_methods, "NS_METHODS", ("torch", "half", "broken", "raises"), raising=False)
    monkeypatch.setattr(muon_update, "orthogonalise", orthogonalise)
    monkeypatch.setattr(ns_methods, "ns_flops", ns_flops)
    rows = {r[1]: r for r in gpu_check.newton_schulz_rows(TINY_LAYERS, torch.device("cpu"), 1, peak_tflops=1.0)}
    assert list(rows) == [
        "torch.optim.Muon's iteration, per matrix",
        "ns_method 'torch', batched",
        "ns_method 'half', batched",
        "ns_method 'broken', batched",
        "ns_method 'raises', batched",
    ]
    assert ("exact", "torch") in calls and ("batched", "half") in calls
    assert f"{flops // 2 / 1e12:.3g} TFLOP; " in rows["ns_method 'half', batched"][3]
    assert "x the time of ns_method 'torch', batched" in rows["ns_method 'half', batched"][3]
    assert rows["ns_method 'broken', batched"][2] == "FAIL: a non-finite output"
    assert rows["ns_method 'raises', batched"][2] == "FAILED: ValueError: no such method"

    def ns_flops_before_methods(rows, cols, steps=ns_methods.NS_STEPS):  # muon_math before ns_method
        return real_flops(rows, cols, steps)

    assert gpu_check.with_method(ns_flops_before_methods, "torch") is ns_flops_before_methods
    with pytest.raises(TypeError, match="takes no ns_method"):
        gpu_check.with_method(ns_flops_before_methods, "half")


def test_the_dry_run_times_the_peak_and_newton_schulz(dry_run):
    _, _, rows = dry_run
    peak = _rows_of(rows, "(a) bf16 matmul peak")
    assert len(peak) == 1 and peak[0][2].endswith(" TFLOP/s")
    ns = _rows_of(rows, "(a) Newton–Schulz, one tiny layer")
    assert ns[0][1] == "torch.optim.Muon's iteration, per matrix" and ns[1][1] == "ns_method 'torch', batched"
    assert all(r[2].endswith(" ms") and "% of the bf16 peak" in r[3] for r in ns)


# ---- (1) the Launch --------------------------------------------------------------------------------------------
def test_one_launch_on_a_real_one_rank_group_with_the_shortcut_bypassed(dry_run):
    """gloo at world 1, group size passed as 2: the broadcast and the reduce are issued (one launch
    counted, two works: gloo does not coalesce) and the values come out right. Only a GPU proves
    the rest: NCCL's coalesced group, the host not blocked behind a sleeping side stream, the
    compute stream waiting on the Launch's event, and no host sync under sync debug 'error'."""
    rows = _rows_of(dry_run[2], "(1) ")
    results = _by_what(rows)
    assert results["launches counted (CommStats)"] == "pass" and results["values after synchronize"] == "pass"
    assert "waits on 2 work(s)" in rows[0][3]
    assert all(
        results[w].startswith("skipped (cpu)")
        for w in ("host not blocked", "compute stream waits", "no host sync (sync debug 'error')")
    )


# ---- (2) the fake process group --------------------------------------------------------------------------------------
def test_the_runtime_runs_every_layout_on_the_fake_process_group(dry_run):
    """World 4 Z3 and Z2, 2 x 2 HSDP, world 1 and the FSDP2 + AdamW control all train 3 steps as
    rank 0 on the fake backend. Only a GPU proves what the check is for: no unsynchronised
    cross-stream access under TORCH_CUDA_SANITIZER=1 (the CPU has no streams) and a flat
    torch.cuda.memory_allocated from step 2 on."""
    rows = _rows_of(dry_run[2], "(2) ")
    assert len(rows) == 5 and all(result == "pass" for _, _, result, _ in rows), rows
    assert rows[2][0] == "(2) fake PG, 2 x 2 HSDP, DMuon-Z3"


def test_a_sanitizer_race_reads_as_one_line():
    """How a CUDA-sanitizer report lands in the table (its objects built by hand here; only a GPU
    produces real ones)."""
    import traceback

    from benchmarks.gpu_runtime import describe_race, sanitizer_reports

    with sanitizer_reports() as found:  # (off here: nothing to record)
        pass
    assert found == []
    frame = traceback.FrameSummary("/x/titan_dmuon/runtime/unit.py", 150, "gather")

    def access(stream, op, kind):
        return SimpleNamespace(
            stream=stream, operator=SimpleNamespace(name=op), type=kind, aliases=["self"], stack_trace=[frame]
        )

    error = SimpleNamespace(
        errors=[
            SimpleNamespace(
                current_access=access(2, "aten::mm", "reading from"),
                previous_access=access(1, "aten::_foreach_copy_", "writing to"),
            )
        ]
    )
    line = describe_race(RuntimeError("rewrapped by autograd"), {1: "gather", 2: "compute"}, error.errors)
    assert describe_race(error, {1: "gather", 2: "compute"}) == line
    assert line == (
        "1 race(s); first: aten::mm reading from self on compute (unit.py:150 gather) after "
        "aten::_foreach_copy_ writing to self on gather (unit.py:150 gather)"
    )


# ---- (3) race amplification ------------------------------------------------------------------------------------------
def test_the_bypass_issues_collectives_at_world_one(dry_run):
    """On gloo at world 1 the bypass makes DMuon issue its collectives (launches > 0 in CommStats;
    without it none: the row's verdict requires both) and trains to the same weights, Z3 and Z2;
    the bypass comes off afterwards. Only a GPU proves the point of the check: with a sleep at the
    start of every side-stream block and before every free, the final weights stay bitwise the
    same (a missing wait or an early free would read or reuse memory too soon)."""
    from benchmarks.gpu_runtime import bypass_size_one_shortcut
    from titan_dmuon.runtime.comm import Launch

    rows = _rows_of(dry_run[2], "(3) ")
    bypass = [row for row in rows if row[1] == "bypass vs none: max |diff|"]
    assert [row[2] for row in bypass] == ["pass", "pass"], rows  # Z3 and Z2
    assert all(re.search(r"; [1-9]\d* launches with the bypass, 0 without", row[3]) for row in bypass), bypass
    assert sum(row[2].startswith("skipped (cpu)") for row in rows) == 4
    init = Launch.__init__
    with bypass_size_one_shortcut():
        assert Launch.__init__ is not init
    assert Launch.__init__ is init


def test_the_injected_sleeps_wrap_side_streams_and_frees_and_come_off():
    """The wrappers call through and are removed afterwards; on the CPU no sleep is queued (no
    stream, no CUDA buffer). Only a GPU runs the sleeps."""
    from benchmarks.gpu_runtime import sleeps_injected
    from titan_dmuon.runtime.streams import Streams
    from titan_dmuon.runtime.unit import Unit

    use, free = Streams.use, Unit.free
    with sleeps_injected(1000) as counts:
        assert Streams.use is not use and Unit.free is not free
        with Streams(torch.device("cpu")).use(None):
            pass
    assert Streams.use is use and Unit.free is free and counts == {"side_stream_blocks": 0, "frees": 0}


# ---- (5) the profiled step -------------------------------------------------------------------------------------------
def test_a_profiled_step_finds_the_hooks(dry_run):
    """Host time under DMuon::* (DMuon-Z3) and FSDP::* (the FSDP2 + AdamW baseline) labels is found
    in a CPU profile. Only a GPU gives kernels per layer and the compute stream's idle time."""
    rows = _rows_of(dry_run[2], "(5) ")
    host = [float(result) for _, what, result, _ in rows if what.startswith("host ms")]
    assert len(host) == 2 and all(ms > 0 for ms in host), rows
    assert sum(result.startswith("skipped (cpu)") for _, _, result, _ in rows) == 4


def _event(name, kind, start, duration, resource, activity=None, *, torch_211=False):
    """A kineto event as torch 2.14 gives it (``activity_type()``) or torch 2.11 (no such method:
    ``is_user_annotation()`` only)."""
    activity = activity or ("user_annotation" if kind == torch.autograd.DeviceType.CPU else "kernel")
    fields = dict(
        name=lambda: name,
        device_type=lambda: kind,
        start_ns=lambda: start,
        duration_ns=lambda: duration,
        start_thread_id=lambda: resource,
        device_resource_id=lambda: resource,
    )
    if torch_211:
        fields["is_user_annotation"] = lambda: activity.endswith("user_annotation")
    else:
        fields["activity_type"] = lambda: activity
    return SimpleNamespace(**fields)


@pytest.mark.parametrize("torch_211", [False, True])
def test_the_profile_summary_counts_kernels_streams_and_gaps(torch_211):
    """The trace arithmetic on hand-made events: nested labels merged per thread, the compute
    stream found by the marker kernel, memcpy/memset apart from kernels, labels' GPU spans left
    out, NCCL kernels by stream, and the idle gaps between the compute stream's kernels; the same
    from torch 2.11's events, which have no ``activity_type()``. Whether CUPTI's trace of a real
    step reads this way only a GPU shows."""
    from benchmarks.gpu_runtime import MARKER, summarize

    CPU_, CUDA_ = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def event(*args):
        return _event(*args, torch_211=torch_211)

    events = [
        event("FSDP::pre_forward", CPU_, 0, 100, 1),
        event("FSDP::all_gather", CPU_, 10, 20, 1),  # nested: 100
        event("FSDP::post_backward", CPU_, 0, 50, 2),  # another thread: +50
        event("DMuon::pre_forward", CPU_, 200, 30, 1),
        event(MARKER, CUDA_, 0, 5, 7),
        event("gemm", CUDA_, 1_000_000, 1_000_000, 7),
        event("Memcpy DtoD", CUDA_, 2_500_000, 500_000, 7, "gpu_memcpy"),
        event("DMuon::pre_forward", CUDA_, 0, 9_000_000, 7, "gpu_user_annotation"),  # a label's GPU span: not work
        event("gemm", CUDA_, 4_000_000, 1_000_000, 7),  # gaps: 0.5 ms, 1 ms
        event("ncclDevKernel_Broadcast", CUDA_, 1_000_000, 3_000_000, 9),
    ]
    s = summarize(events, wall_s=0.002)
    assert (s["fsdp_ms"], s["dmuon_ms"], s["wall_ms"]) == (150e-6, 30e-6, 2.0)
    assert (s["kernels"], s["copies"], s["nccl"], s["nccl_on_compute"], s["streams"]) == (3, 1, 1, 0, 2)
    assert (s["idle_ms"], s["gaps"], s["span_ms"]) == (1.5, 2, 4.0)


# ---- (7) the plain-PyTorch FSDP2 step ----------------------------------------------------------------------
def test_a_plain_pytorch_fsdp2_dmuon_step_beside_adamw(dry_run):
    """FSDP2 + DMuon-Z3 from plain PyTorch on a 1-rank gloo group: its fp32 weights equal the
    single-process torch.optim.Muon + AdamW reference within the tolerance, with collectives
    issued (shortcut bypassed); the bf16 step times of DMuon and AdamW are measured. Only a GPU
    gives the times that matter, the peak memory and the host-sync check."""
    rows = {row[1]: row for row in _rows_of(dry_run[2], "(7) ")}
    assert rows["fp32 weights after 2 steps vs torch.optim.Muon + AdamW"][2] == "pass", rows
    assert re.fullmatch(r"DMuon \d+\.\d\dx AdamW", rows["median step ms (steps 3-3), bf16 mixed precision"][2]), rows
    assert rows["peak memory_allocated GiB"][2].startswith("skipped (cpu)")
    assert rows["no host sync from step 3 (sync debug 'warn')"][2].startswith("skipped (cpu)")


# ---- the runtime checks' subprocess ----------------------------------------------------------------------------------
def test_a_check_killed_by_its_time_limit_is_a_failed_row_and_a_spent_budget_skips():
    """A check that printed no rows (here: killed by its time limit) is one FAILED row, and a
    spent budget skips (the rows that came back through the JSON lines: the dry run above)."""
    from benchmarks.gpu_check import BUDGET_SPENT, runtime_rows, table

    late = runtime_rows(("race",), {}, 0.3, device="cpu", tiny=True)
    assert len(late) == 1 and late[0][2].startswith("FAILED: timed out after 0 s"), late
    assert runtime_rows(("race",), {}, None)[0][2] == BUDGET_SPENT
    lines = table([("x", "max |diff|", "1", "")]).splitlines()
    assert len(lines) == 3 and lines[-1] == "| x | max \\|diff\\| | 1 |  |"
    assert parse_table(table([("x", "max |diff|", "1", "")]))[0] == ("x", "max |diff|", "1", "")


# ---- (4) (6) (b) (c): the jobs ---------------------------------------------------------------------------------------
STEP_LINE = "[rank0]:[titan] 2026-12-01 23:21:{s},{ms} - root - INFO - step: {n:2}  loss: {loss:8.5f}  grad_norm:  1.0000  memory:  {mem:5.2f}GiB(1.00%)  tps: {tps}  tflops: 0.10  mfu: 0.10%"  # noqa: E501
TORCH_LINE = "[rank0]:V1201 23:21:{s}.{us} 4836 torch/_dynamo/guards.py:5621] [0/1] [__recompiles] {text}"
COMPILED_LINE = "[rank0]:[rank0]:I1201 23:21:{s}.{us} 8366 torch/_dynamo/output_graph.py:3233] [0/0] Step 2: done compiler function inductor"  # noqa: E501


def test_compile_messages_after_step_two_are_counted_by_time():
    """TorchTitan's stdout and torch's stderr reach the log out of order: a recompile printed after
    the step-2 line but stamped before it belongs to step 2; one stamped after it is counted, and
    so is a graph compiled after it (TORCH_LOGS=dynamo; graphs compiled before it are the control
    that the logs arrive at all). Line formats as torchrun relays them (checked on the CPU)."""
    from benchmarks.gpu_check import compile_messages

    log = "\n".join(
        [
            COMPILED_LINE.format(s="29", us="000000"),
            STEP_LINE.format(s="30", ms="100", n=1, loss=8.1, mem=1.0, tps="1,234"),
            STEP_LINE.format(s="32", ms="100", n=2, loss=8.0, mem=1.0, tps="1,234"),
            TORCH_LINE.format(s="31", us="900000", text="Recompiling function forward in model.py:1"),  # late, step 2's
            TORCH_LINE.format(s="31", us="900000", text="    triggered by the following guard failure(s):"),
            TORCH_LINE.format(s="33", us="000000", text="Recompiling function forward in model.py:1"),
            TORCH_LINE.format(s="33", us="000000", text="    - 0/1: tensor 'x' size mismatch"),
            COMPILED_LINE.format(s="33", us="500000"),
            STEP_LINE.format(s="34", ms="100", n=3, loss=7.9, mem=1.0, tps="1,234"),
        ]
    )
    found = compile_messages(log)
    assert found == {
        "step_seen": True,
        "lines_after": 2,
        "messages_before": 1,
        "messages_after": 1,
        "graphs_before": 1,
        "graphs_after": 1,
        "first_after": "Recompiling function forward in model.py:1",
    }
    assert compile_messages(log.splitlines()[0])["step_seen"] is False  # no step 2: the row fails


def test_a_failed_job_reads_as_its_error_and_where_it_was_raised():
    """A sync-debug failure as torchrun relays it: the exception line, and the innermost frame of
    titan_dmuon or TorchTitan above it (whose code synchronised)."""
    from benchmarks.gpu_check import first_error

    log = "\n".join(
        [
            "[rank0]:[titan] 2026-12-01 23:21:30,100 - root - WARNING - something about an Error budget",
            "[rank0]:Traceback (most recent call last):",
            '[rank0]:  File "/w/.venv/lib/python3.11/site-packages/torchtitan/trainer.py", '
            "line 804, in forward_backward_step",
            '[rank0]:  File "/w/main/titan_dmuon/runtime/unit.py", line 150, in gather',
            '[rank0]:  File "/w/.venv/lib/python3.11/site-packages/torch/cuda/__init__.py", line 9, in synchronize',
            "[rank0]:RuntimeError: called a synchronizing CUDA operation",
        ]
    )
    assert first_error(log) == (
        "[rank0]:RuntimeError: called a synchronizing CUDA operation (at titan_dmuon/runtime/unit.py:150 in gather)"
    )
    assert first_error("all fine") == ""


def test_step_figures_and_the_median_step_time():
    from benchmarks.gpu_check import median_step_ms, parse_steps

    log = "\n".join(
        STEP_LINE.format(s="30", ms="100", n=n, loss=8.0, mem=2.5, tps=tps)
        for n, tps in ((1, "100"), (2, "1,000"), (3, "51,200"), (4, "25,600"), (5, "51,200"))
    )
    steps = parse_steps(log)
    assert steps[4] == (8.0, 2.5, 25600.0) and len(steps) == 5
    assert median_step_ms(steps, 512) == 10.0  # 512 tokens at 51,200 tokens/s; steps 1-2 left out


def test_job_rows_report_each_job_and_keep_going_past_failures():
    from benchmarks.gpu_check import job_rows

    ok = {
        "code": 0,
        "steps": {1: (8.0, 1.0, 512.0), 3: (7.0, 2.0, 51200.0), 4: (6.0, 3.0, 51200.0)},
        "error": "",
        "output": "",
    }
    results = {
        "z3_eager": ok,
        "z3_compile_accum2": {
            "code": 1,
            "steps": {},
            "error": "RuntimeError: called a synchronizing CUDA operation",
            "output": "",
        },
        "z2_compile": {
            **ok,
            "output": COMPILED_LINE.format(s="29", us="000000")
            + "\n"
            + STEP_LINE.format(s="30", ms="100", n=2, loss=8.0, mem=1.0, tps="9"),
        },
        "1b_dmuon": ok,
        "1b_adamw": {"code": "skipped", "steps": {}, "error": "", "output": ""},
        "adamw_graphs_on": ok,
        "adamw_graphs_off": {**ok, "steps": {3: (7.0, 2.0, 25600.0)}},
    }
    rows = {(check, what): (result, detail) for check, what, result, detail in job_rows(results)}
    titles = [check for check, _ in rows]
    assert len(rows) == 8 and "(b) llama3 debug, DMuon-Z3, compile off" in titles
    assert rows[("(b) llama3 debug, DMuon-Z3, compile off", "sync debug 'error', steps 3-6")][0] == "no host sync"
    assert rows[("(b) llama3 debug, DMuon-Z3, compile on, grad accumulation 2", "sync debug 'error', steps 3-6")][
        0
    ] == ("FAILED (1): RuntimeError: called a synchronizing CUDA operation")
    assert rows[("(4) llama3 debug, DMuon-Z2, compile on", "TORCH_LOGS lines after step 2")][0] == "pass (0 lines)"
    assert rows[("(4) llama3 debug, DMuon-Z3, compile on, grad accumulation 2", "TORCH_LOGS lines after step 2")][
        0
    ].startswith("FAILED (1)")
    assert rows[("(c) llama3 1B, DMuon", "peak reserved GiB")][0] == "3.00"
    assert rows[("(c) llama3 1B, AdamW", "peak reserved GiB")][0].startswith("SKIPPED")
    on, off = (
        rows[("(6) llama3 debug, AdamW, CUDA graphs on", "median step ms")],
        rows[("(6) llama3 debug, AdamW, CUDA graphs off", "median step ms")],
    )
    assert (on[0], off[0]) == ("10.00", "20.00") and "costs +100.0%" in off[1]


def test_its_1b_configs_are_valid():
    pytest.importorskip("torchtitan")
    from titan_dmuon.integration import cpu

    cpu.enable()
    from benchmarks.gpu_configs import llama3_1b_adamw, llama3_1b_dmuon
    from titan_dmuon.integration.config.validation.validate import validate_dmuon

    dmuon, adamw = llama3_1b_dmuon(), llama3_1b_adamw()
    assert dmuon.optimizer.name == "dmuon" and dmuon.model_spec.flavor == "1B" == adamw.model_spec.flavor
    validate_dmuon(dmuon, world_size=1)


def test_every_job_parses_through_its_own_door(tmp_path):
    """Each job's command line, as run_job passes it, is accepted by the door it goes through: the
    TOML layer (titan_dmuon's entry point) or TorchTitan's own parser (tyro: booleans are flags,
    the dump folder is --dump_folder); the CUDA-graph jobs turn capture on and off. Whether the
    jobs train on a GPU (FlexAttention, compile, capture) only a GPU shows."""
    pytest.importorskip("torchtitan")
    from titan_dmuon.integration import cpu

    cpu.enable()
    from torchtitan.config import ConfigManager

    from benchmarks.gpu_check import JOBS
    from titan_dmuon.integration.config.toml_file import load_config

    graphs = {}
    for job in JOBS:
        args = job.command_args(str(tmp_path / job.key))
        if job.python_door:
            module, function = job.config.split(":")
            config = ConfigManager().parse_args(["--module", module, "--config", function, *args])
        else:
            config = load_config(job.config, args)
        assert config.dump_folder == str(tmp_path / job.key) and config.metrics.disable_color_printing, job.key
        graphs[job.key] = config.training.disable_cuda_graphs
        if job.key == "z3_compile_accum2":
            assert config.compile.enable and config.training.global_batch_size == 2 * config.training.local_batch_size
    assert graphs["adamw_graphs_on"] is False and graphs["adamw_graphs_off"] is True


def test_job_environments_and_the_plan_fits_eight_minutes(monkeypatch):
    """Each job gets its own door's variables and nothing of the caller's (a CONFIG_FILE left in the
    environment would make run_train.sh refuse a Python-config job); the planned time fits the
    budget (with three Newton–Schulz methods, and the TorchTitan jobs) and every limit covers its
    estimate. The estimates are one H200's, unmeasured here."""
    from benchmarks.gpu_check import BUDGET_S, JOBS, RUNTIME_RUNS, estimate_s

    monkeypatch.setenv("CONFIG_FILE", "stale.toml")
    monkeypatch.setenv("TORCH_LOGS", "+dynamo")
    by_key = {job.key: job for job in JOBS}
    python_job = by_key["1b_dmuon"].environment(precheck=False)
    assert "CONFIG_FILE" not in python_job and python_job["MODULE"] == "benchmarks.gpu_configs"
    assert python_job["NGPU"] == "1" and python_job["TITAN_DMUON_PRECHECK"] == "0" and "TORCH_LOGS" not in python_job
    compiled = by_key["z3_compile_accum2"].environment(precheck=True)
    assert compiled["CONFIG_FILE"] == "train_configs/debug_model.toml" and "TITAN_DMUON_PRECHECK" not in compiled
    assert (
        compiled["TORCH_LOGS"] == "recompiles,graph_breaks,dynamo"
        and compiled["TITAN_DMUON_SYNC_DEBUG_FROM_STEP"] == "3"
    )
    assert by_key["adamw_graphs_on"].tokens_per_step == 512 and by_key["z3_eager"].tokens_per_step is None
    assert estimate_s(jobs=False, methods=3) < estimate_s(jobs=True, methods=3) <= BUDGET_S <= 480
    assert all(job.timeout_s >= 2 * job.estimate_s for job in JOBS)
    assert all(limit >= 2 * estimate for _, _, limit, estimate in RUNTIME_RUNS)


def test_the_ns_graph_row_compares_graph_and_eager_on_one_layer():
    """Row (8) in-process on the tiny layer: bitwise equal weights and a host time per step; on the
    CPU ``NSGraphs`` runs eagerly and the row says so (what a GPU shows: graphs captured and replayed)."""
    from benchmarks.gpu_check import graph_rows

    rows = graph_rows(torch.device("cpu"), cpu=True)
    assert [row[0] for row in rows] == ["(8) Newton–Schulz from CUDA graphs"] * 2
    assert rows[0][2] == "bitwise equal" and "runs eagerly" in rows[0][3]
    assert rows[1][2].endswith(" ms graph") and "ms eager" in rows[1][3]
