"""A persistent pool of gloo worker processes for fast multi-process tests.

Spawning a process group costs seconds on 2 cores; a pool pays it once per
world size and then runs each test function on every rank in ~0.1 s.
Test functions are module-level (pickled by reference) and get
``(rank, world_size, *args)``; whatever they return comes back as a list
indexed by rank. A failure or timeout on any rank fails the test with every
rank's traceback, and the pool is rebuilt so the next test starts clean.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback

COLLECTIVE_TIMEOUT_S = 60  # a wrong collective fails a test in a minute, never hangs it
# Workers are forked from a server process that has imported these once (the modules every tier's workers
# import; no TorchTitan: the core-portability tests check a worker without it), so a pool's start or restart
# does not pay torch's import per rank (~2 s of CPU each here). The server starts with the session's
# environment; OMP's thread count is set per worker (torch.set_num_threads) after the fork.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _init_gloo(rank: int, world_size: int, init_file: str, timeout_s: float) -> None:
    """The world group, and every group made later (DeviceMesh's and TorchTitan's sub-groups: the
    shard, replicate, tp and pp groups), with ``timeout_s``: new_group's default is torch's 30
    minutes, so a collective missing on one rank of a sub-group (e.g. HSDP's replicate group) hung
    the test until the pool's deadline instead of failing with gloo's "Timed out waiting" on each rank."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    c10d.default_pg_timeout = timeout
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timeout
    )


def _worker(rank: int, world_size: int, init_file: str | None, tasks, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if init_file is not None:
        _init_gloo(rank, world_size, init_file, COLLECTIVE_TIMEOUT_S)
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args = item
        try:
            results.put((rank, True, fn(rank, world_size, *args)))
        except BaseException:  # noqa: BLE001 - report everything, including DCP's BaseException
            results.put((rank, False, traceback.format_exc()))
    if init_file is not None:
        dist.destroy_process_group()


class WorkerPool:
    """``world_size`` processes joined in one gloo group (or none, ``backend=None``)."""

    def __init__(self, world_size: int, *, backend: str | None = "gloo") -> None:
        self.world_size = world_size
        self.backend = backend
        self._procs: list = []
        self._start()

    def _start(self) -> None:
        ctx = _context()
        init_file = None
        if self.backend is not None:
            fd, init_file = tempfile.mkstemp(prefix="dmuon_pg_")
            os.close(fd)
            os.unlink(init_file)
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker, args=(r, self.world_size, init_file, self._tasks[r], self._results), daemon=True
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, timeout: float = 240.0) -> list:
        """Run ``fn(rank, world_size, *args)`` on every rank; returns the results by rank."""
        for q in self._tasks:
            q.put((fn, args))
        results: dict[int, tuple[bool, object]] = {}
        deadline = time.monotonic() + timeout
        while len(results) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=1.0)
                results[rank] = (ok, value)
            except queue.Empty:
                dead = [p for p in self._procs if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    why = (
                        f"worker(s) died with exit codes {[p.exitcode for p in dead]}"
                        if dead
                        else f"timed out after {timeout:.0f}s"
                    )
                    self.restart()
                    raise AssertionError(f"{fn.__name__}: {why}; results so far: {results}") from None
        failures = {r: v for r, (ok, v) in results.items() if not ok}
        if failures:
            self.restart()
            detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
            raise AssertionError(f"{fn.__name__} failed on rank(s) {sorted(failures)}:\n{detail}")
        return [results[r][1] for r in range(self.world_size)]

    def restart(self) -> None:
        self.close(graceful=False)
        self._start()

    def close(self, graceful: bool = True) -> None:
        if graceful:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        self._procs = []


def _one_shot(rank: int, world_size: int, init_file: str, pg_timeout_s: float, fn, args, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    _init_gloo(rank, world_size, init_file, pg_timeout_s)
    try:
        results.put((rank, True, fn(rank, world_size, *args)))
        code = 0
    except BaseException:  # noqa: BLE001 - a rank that fails exits at once, as under torchrun
        results.put((rank, False, traceback.format_exc()))
        code = 1
    results.close()
    results.join_thread()
    os._exit(code)  # no graceful teardown: the peers see this rank go away, as after a crash


def run_job(fn, world_size: int, *args, timeout: float = 120.0, pg_timeout_s: float = 60.0) -> list:
    """Run ``fn(rank, world_size, *args)`` once in fresh processes that exit when it returns or raises
    (a job, not a pool: for tests where a rank fails on purpose). Returns per rank
    ``(ok, value_or_traceback, exit_code)``; fails the test if the job outlives ``timeout``."""
    ctx = _context()
    fd, init_file = tempfile.mkstemp(prefix="dmuon_job_")
    os.close(fd)
    os.unlink(init_file)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_one_shot, args=(r, world_size, init_file, pg_timeout_s, fn, args, results))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
        p.join(timeout=10)
    outcome: dict[int, tuple] = {}
    while True:
        try:
            rank, ok, value = results.get(timeout=0.5)
        except queue.Empty:
            break
        outcome[rank] = (ok, value)
    if alive:
        raise AssertionError(f"{fn.__name__}: job still running after {timeout:.0f}s (a hang); results: {outcome}")
    return [(*outcome.get(r, (False, "no result")), procs[r].exitcode) for r in range(world_size)]
