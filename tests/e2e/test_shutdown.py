"""A script that reads the CommLedger every step exits cleanly: no abort at interpreter shutdown.

Bug: 2-rank gloo Z3 runs shaped like examples/plain_pytorch.py (a CommLedger
each step, ``mean_over_ranks`` after it, the loss all-reduced, a print) ended,
after all their steps, with "terminate called without an active exception"
and SIGABRT in about 1 run of 5.

Root cause (torch 2.14.1 + gloo + CPython 3.11; found with a core dump and an
LD_PRELOAD shim that logged which threads took the GIL, and when): gloo runs a
collective on a worker thread (``ProcessGroupGloo::runLoop``), and that thread
drops its reference to the finished Work only after ``wait()`` has let the
caller go; in about 15% of calls (95% when the worker shares a CPU with the
main thread) the worker's reference is the last one. Releasing a tensor that
has a Python object takes the GIL (torch 2.14 decrefs the PyObject when a
TensorImpl's last C++ reference goes), so the worker queues for the GIL in
``~AsyncWork`` -> ``TensorImpl::decref_pyobject``. If the interpreter starts
finalizing before the worker gets it, CPython's ``take_gil`` ends the thread
(``PyThread_exit_thread`` -> ``pthread_exit``) and the forced unwind through
the Work's noexcept destructor calls ``std::terminate``: the core dump shows
exactly that stack on the ``pt_gloo_runloop`` thread. Any gloo collective
shortly before exit can do this; the ledger made it likely: its read is an
all-gather of temporaries (their last reference is then the worker's, and the
worker frees them) issued after the step, and the core dump's Work was that
all-gather. The ledger kept nothing alive (at ``destroy_process_group`` its
only referrer is the script's variable, its records hold plain values, c10d
Works do not capture the mode, which is stashed while ``__torch_dispatch__``
runs); ``del ledger; gc.collect()`` helped only because the collection gave the
worker time. Toggle, with the race made likely (below) and no loss all-reduce:
reading the ledger aborted 5 of 6 runs; the ledger without the read 0 of 6; no
ledger 0 of 6. With the loss all-reduce as the last collective and no ledger at
all, 16 of 20 ranks aborted: the hazard is torch's.

Fix (ledger.py): ``mean_over_ranks`` waits, GIL released, until no C++ owner
holds its tensors and the worker's decref is done; and a CommLedger installs an
atexit hook that naps (GIL and CPU free) until no gloo worker thread is
runnable, so workers finish before finalization whatever collective came last.
Measured by this test (10 runs of 3 steps): without the fix 15 of 20 ranks aborted and the
read's tensors outlived it in 46 of 60 reads; with the first part only 15 of 20
ranks aborted (in the loss all-reduce's Work) and 0 reads; with both 0 and 0.

The test forks 2-rank runs from one parent that has imported torch already
(spawning costs seconds per process), each a few Z3 steps of the toy model
under a CommLedger read every step, the loss all-reduced and printed, then
``destroy_process_group`` and a normal interpreter exit. To make the race likely
on any machine each rank runs on one CPU with its gloo worker threads at nice
19 (the worker then lags the main thread), and a 1 s GIL switch interval keeps
a queued worker from taking the GIL back before finalization. Besides exit
codes, each rank checks that the read's tensors are gone when
``mean_over_ranks`` returns rather than left for a gloo worker to free.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNS = 8
STEPS = 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks ranks, pins CPUs, renices threads via /proc")
def test_exit_after_reading_ledger_every_step_does_not_abort():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "tests.e2e.test_shutdown", "--runs", str(RUNS), "--steps", str(STEPS)],
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
    assert not bad, (
        "\n\n".join(
            f"run {r['run']} rank {r['rank']}: exit code {r['exit_code']}, ledger tensors left to a gloo worker "
            f"after {r['left_to_worker']} of {STEPS} reads\n{r['output'][-1500:]}"
            for r in bad
        )
        + f"\n({time.monotonic() - start:.0f} s)"
    )


# ---- the runner (python -m tests.e2e.test_shutdown) ---------------------------------------


def _child(rank: int, init_file: str, steps: int) -> None:
    """One rank: a few Z3 steps under a CommLedger read every step, then a normal exit."""
    import weakref
    from datetime import timedelta

    import torch.distributed as dist

    from tests.support.helpers import batches, distribute, local_slice, toy_model
    from titan_dmuon import CommLedger, clip_grad_norm_
    from titan_dmuon.runtime import CommLabel
    from titan_dmuon.testing.toy_model import loss_fn

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
    for batch in batches(steps, global_batch=2, vocab=64):
        xs, ys = local_slice(batch, rank, 2)
        with CommLedger() as ledger:
            loss = loss_fn(setup.module(xs), ys)
            loss.backward()
            clip_grad_norm_(setup.model.parameters(), max_norm=1.0, dedicated=setup.handle)
            setup.opt.step()
            setup.opt.zero_grad()
        reading[0] = True
        dmuon = ledger.mean_over_ranks(setup.mesh.get_group(), source=CommLabel.DMUON)
        reading[0] = False
        print(f"LEFT_TO_WORKER {int(any(ref() is not None for ref in gathered))}", flush=True)
        gathered.clear()
        loss_avg = loss.detach().clone()  # the example's tail: its own last collective, then a print
        dist.all_reduce(loss_avg)
        if rank == 0:
            print(f"loss {loss_avg.item() / 2:.4f}  dmuon elements/rank {float(dmuon):,.0f}", flush=True)
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

    import tests.support.helpers  # noqa: F401  (imported once here, inherited by every forked rank)
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
                left = sum(int(line.split()[1]) for line in output.splitlines() if line.startswith("LEFT_TO_WORKER "))
                results.append(
                    {
                        "run": run,
                        "rank": rank,
                        "exit_code": status[pid],
                        "left_to_worker": left,
                        "output": output[-4000:],
                    }
                )
    finally:
        if not forked:
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(results))


if __name__ == "__main__":
    _main()
