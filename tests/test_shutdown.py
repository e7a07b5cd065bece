"""A script that reads the CommLedger every step exits cleanly: no abort at interpreter shutdown.

Bug: 2-rank gloo runs that called ``ledger.mean_over_ranks`` after every step
ended, after all their steps, with "terminate called without an active
exception" and SIGABRT in about 1 run of 5 (0 without the ledger read).

Root cause (torch 2.14.1 + gloo + CPython 3.11; found with a core dump and an
LD_PRELOAD shim that logged which threads took the GIL, and when):
``mean_over_ranks`` all-gathers small temporary tensors. gloo runs the
collective on a worker thread (``ProcessGroupGloo::runLoop``), and that thread
drops its reference to the finished Work only after ``wait()`` has let the
caller go; in about 15% of calls (95% when the worker shares a CPU with the
main thread) the caller has already moved on and the worker's reference is the
last one. Releasing a tensor that has a Python object takes the GIL (torch 2.14
decrefs the PyObject when a TensorImpl's last C++ reference goes), so the
worker queues for the GIL in ``~AsyncAllgatherWork`` → ``TensorImpl::
decref_pyobject``. The read is the last collective of the step and is followed
only by pure-Python work, so a worker that lags can still be queued for the GIL
when the interpreter begins finalizing; CPython's ``take_gil`` then ends the
thread (``PyThread_exit_thread`` → ``pthread_exit``), and the forced unwind
through the Work's noexcept destructor calls ``std::terminate``. The core dump
showed exactly that stack on the ``pt_gloo_runloop`` thread. The ledger did not
keep anything alive (at ``destroy_process_group`` its only referrer is the
script's variable; its records hold plain values; c10d Works do not capture
the mode, which is stashed while ``__torch_dispatch__`` runs);
``del ledger; gc.collect()`` helped only because the collection took long
enough for the worker to finish. Toggle: with the race made likely (below),
reading the ledger aborted 5 of 6 runs, the same runs with the ledger but no
read 0 of 6, without the ledger 0 of 6. This test without the fix: 6 of 10
runs aborted (8 of 20 ranks), 18 of 20 ranks saw the read's tensors outlive it;
with the fix 0 of 20 runs, 0 of 40 ranks.

Fix (ledger.py, ``_all_gather_released``): after the all-gather, wait with the
GIL released until no C++ owner holds the tensors and the worker's decref is
done, so the worker never needs the GIL on the exit path.

The test forks 2-rank runs from one parent that has imported torch already
(spawning costs seconds per process), each a few Z3 steps of the toy model
under a CommLedger read every step, then ``destroy_process_group`` and a normal
interpreter exit. To make the race likely on any machine each rank runs on one
CPU with its gloo worker threads at nice 19 (the worker then lags the main
thread), and a 1 s GIL switch interval keeps a queued worker from taking the
GIL back before finalization. Besides exit codes, each rank checks the
invariant the fix establishes: when ``mean_over_ranks`` returns, its tensors are
gone rather than left for a gloo worker to free (seen in 18 of 20 ranks
without the fix, so the test fails even when no run happens to abort).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNS = 10
STEPS = 3


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks ranks, pins CPUs, renices threads via /proc")
def test_exit_after_reading_ledger_every_step_does_not_abort():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "tests.test_shutdown", "--runs", str(RUNS), "--steps", str(STEPS)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"runner failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 2 * RUNS
    bad = [r for r in results if r["exit_code"] != 0 or "terminate called" in r["output"] or r["left_to_worker"]]
    assert not bad, "\n\n".join(
        f"run {r['run']} rank {r['rank']}: exit code {r['exit_code']}, ledger tensors left to a gloo worker "
        f"after {r['left_to_worker']} of {STEPS} reads\n{r['output'][-1500:]}"
        for r in bad
    ) + f"\n({time.monotonic() - start:.0f} s)"


# ---- the runner (python -m tests.test_shutdown) ---------------------------------------


def _child(rank: int, init_file: str, steps: int) -> None:
    """One rank: a few Z3 steps under a CommLedger read every step, then a normal exit."""
    import weakref
    from datetime import timedelta

    import torch.distributed as dist

    from tests.helpers import batches, distribute, local_slice, toy_model
    from titan_dmuon import CommLedger, clip_grad_norm_
    from titan_dmuon.toy_model import loss_fn

    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})  # main thread and gloo workers share one CPU
    sys.setswitchinterval(1.0)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    _renice_gloo_workers()

    # the invariant: the tensors of the ledger's own all-gather are gone when the read returns
    reading, gathered = [False], []
    all_gather = dist.all_gather

    def spy(tensor_list, tensor, *args, **kwargs):
        if reading[0]:
            gathered.extend(weakref.ref(t) for t in (tensor, *tensor_list))
        return all_gather(tensor_list, tensor, *args, **kwargs)

    dist.all_gather = spy

    setup = distribute(toy_model(dim=32, hidden_dim=48, n_kv_heads=2, vocab_size=64, n_layers=2), "z3", 2)
    left_to_worker = 0
    for batch in batches(steps, global_batch=2, vocab=64):
        xs, ys = local_slice(batch, rank, 2)
        with CommLedger() as ledger:
            loss_fn(setup.module(xs), ys).backward()
            clip_grad_norm_(setup.model.parameters(), max_norm=1.0)
            setup.opt.step()
            setup.opt.zero_grad()
        reading[0] = True
        ledger.mean_over_ranks(setup.mesh.get_group(), source="dmuon")
        reading[0] = False
        left_to_worker += any(ref() is not None for ref in gathered)
        gathered.clear()
    print(f"LEFT_TO_WORKER {left_to_worker}", flush=True)
    dist.destroy_process_group()


def _renice_gloo_workers() -> None:
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith("pt_gloo"):
                    os.setpriority(os.PRIO_PROCESS, int(tid), 19)
        except OSError:
            pass


def _die_with_parent() -> None:
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _main() -> None:
    import argparse
    import shutil
    import signal
    import tempfile

    import torch

    import tests.helpers  # noqa: F401  (imported once here, inherited by every forked rank)
    import titan_dmuon  # noqa: F401

    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=RUNS)
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="dmuon_shutdown_")
    results = []
    forked = False
    try:
        for run in range(args.runs):
            children = {}
            for rank in range(2):
                log = os.path.join(tmp, f"run{run}_rank{rank}.log")
                pid = os.fork()
                if pid == 0:  # the rank: run, then leave _main and exit the interpreter normally
                    forked = True
                    _die_with_parent()
                    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    os.dup2(fd, 1)
                    os.dup2(fd, 2)
                    _child(rank, os.path.join(tmp, f"init{run}"), args.steps)
                    return
                children[pid] = (rank, log)
            deadline = time.monotonic() + 120
            status = {}
            while len(status) < len(children):
                for pid in children:
                    if pid not in status:
                        done, code = os.waitpid(pid, os.WNOHANG)
                        if done:
                            status[pid] = os.waitstatus_to_exitcode(code)
                if time.monotonic() > deadline:
                    for pid in children:
                        if pid not in status:
                            os.kill(pid, signal.SIGKILL)
                            os.waitpid(pid, 0)
                            status[pid] = "timeout"
                time.sleep(0.02)
            for pid, (rank, log) in children.items():
                with open(log) as f:
                    output = f.read()
                left = [int(line.split()[1]) for line in output.splitlines() if line.startswith("LEFT_TO_WORKER ")]
                results.append(
                    {"run": run, "rank": rank, "exit_code": status[pid], "left_to_worker": left[0] if left else 0,
                     "output": output[-4000:]}
                )
    finally:
        if not forked:
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(results))


if __name__ == "__main__":
    _main()
