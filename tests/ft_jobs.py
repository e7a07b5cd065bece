"""Launching the fault-tolerance jobs (tests/test_fault_tolerance_e2e.py, benchmarks/fault_tolerance.py):
a TorchFT lighthouse and replica groups through ./run_train.sh with ``MODULE=tests.ft_harness`` (the
README's job, instrumented: tests/ft_harness.py), waits that poll with a deadline, SIGKILL of a group."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIGHTHOUSE = Path(sys.executable).with_name("torchft_lighthouse")
DEADLINE_S = 420  # for any one wait (a group's start is ~20 s here; 2 shared cores may be far slower)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(what: str, done, *, timeout: float = DEADLINE_S, logs: list[Path] = (), alive: list = ()):
    """Poll ``done()`` until it is true; fail at the deadline, or at once when a process of ``alive``
    exits (a group that crashed), with the logs' tails."""
    deadline = time.monotonic() + timeout
    while True:
        value = done()
        if value:
            return value
        dead = [p.args[0] for p in alive if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name} ---\n{p.read_text()[-4000:]}" for p in logs if p.exists())
            why = f"{dead} exited" if dead else f"timed out after {timeout:.0f} s"
            raise AssertionError(f"{why} waiting for {what}\n{tails}")
        time.sleep(0.2)


class Job:
    """A lighthouse and replica groups in ``folder``; every process is killed on exit."""

    def __init__(self, folder: Path, *, ranks: int, steps: int, extra: tuple[str, ...] = ()) -> None:
        self.folder, self.ranks, self.steps, self.extra = folder, ranks, steps, extra
        self.records = folder / "records"
        self.records.mkdir(parents=True)
        self.port = free_port()
        self.lighthouse_log = folder / "lighthouse.log"
        self._procs: list[subprocess.Popen] = []
        self.lighthouse = self._start(
            [str(LIGHTHOUSE), "--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "5000",
             "--heartbeat_timeout_ms", "3000", "--bind", f"[::]:{self.port}"], self.lighthouse_log, os.environ)

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc) -> None:
        for proc in self._procs:
            self._kill(proc)

    def _start(self, cmd, log: Path, env) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                start_new_session=True)
        self._procs.append(proc)
        return proc

    def group(self, replica: int, name: str, *, pause: str | None = None, hold: int | None = None
              ) -> tuple[subprocess.Popen, Path]:
        env = {
            **os.environ, "MODULE": "tests.ft_harness", "CONFIG": "llama3_debugmodel_dmuon_ft", "NGPU": str(self.ranks),
            "PYTHON": sys.executable, "TITAN_DMUON_PRECHECK": "0", "TORCHFT_LIGHTHOUSE": f"http://localhost:{self.port}",
            "FT_TEST_RECORD": str(self.records), "FT_TEST_PAUSE": pause or "", "FT_TEST_HOLD": str(hold or ""),
            "LOG_RANK": "0",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        log = self.folder / f"{name}.log"
        cmd = ["./run_train.sh", "--dump_folder", str(self.folder / "dump"), "--fault_tolerance.replica_id", str(replica),
               "--training.steps", str(self.steps), "--metrics.disable_color_printing", *self.extra]
        return self._start(cmd, log, env), log

    def wait_paused(self, replica: int, logs, alive, *, marker: str = "paused") -> list[int]:
        """The pids of the group's workers, once each has paused (its marker holds its pid)."""
        markers = [self.records / f"{replica}_{r}.{marker}" for r in range(self.ranks)]

        def paused():
            if all(m.exists() and m.read_text().strip() for m in markers):
                return [int(m.read_text().split()[0]) for m in markers]
            return None

        pids = wait(f"group {replica}: {marker}", paused, logs=logs, alive=alive)
        for m in markers:
            m.unlink()
        return pids

    def release(self, replica: int) -> None:
        (self.records / f"{replica}.release").touch()

    def kill(self, proc: subprocess.Popen, workers: list[int]) -> float:
        """SIGKILL a group's workers and its torchrun at once (a lost node); the time of the kill."""
        when = time.time()
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._kill(proc)
        return when

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=60)

    def read(self, replica: int, rank: int) -> list[dict]:
        path = self.records / f"{replica}_{rank}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def log_time(log: Path, pattern: str) -> float | None:
    """The wall-clock time of the first log line matching ``pattern`` (TorchTitan's timestamps)."""
    for line in log.read_text().splitlines():
        if re.search(pattern, line):
            stamp = re.search(r"(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d[.,]\d{3})", line)
            if stamp:
                return time.mktime(time.strptime(stamp.group(1)[:19].replace("T", " "), "%Y-%m-%d %H:%M:%S")) + float(
                    "0." + stamp.group(1)[20:])
    return None


def kill_restart_kill(folder: Path, *, ranks: int, steps: int, kill_in: int, kill_after: int) -> dict:
    """The fault scenario: groups 0 and 1; group 1 SIGKILLed in the forward of step ``kill_in`` and
    restarted at once (group 0 waits after step ``kill_in + 1`` until the restarted group has
    started, so that it rejoins before the job ends); the restarted group SIGKILLed after step
    ``kill_after``, never to return; group 0 finishes. Returns the records per (group, rank), the
    logs, the kill times and the restart's."""
    with Job(folder, ranks=ranks, steps=steps) as job:
        a, a_log = job.group(0, "a", hold=kill_in + 1)
        b1, b1_log = job.group(1, "b1", pause=f"mid:{kill_in}")
        logs = [a_log, b1_log]
        kill_mid = job.kill(b1, job.wait_paused(1, logs, [a, b1]))
        restart = time.time()
        b2, b2_log = job.group(1, "b2", pause=f"end:{kill_after}")
        logs.append(b2_log)
        job.wait_paused(0, logs, [a, b2], marker="held")
        wait("the restarted group to start", lambda: "Trainer is initialized" in b2_log.read_text(), logs=logs,
             alive=[a, b2])
        job.release(0)
        kill_between = job.kill(b2, job.wait_paused(1, logs, [a, b2]))
        wait("group 0 to finish", lambda: a.poll() is not None, logs=logs)
        assert a.returncode == 0, a_log.read_text()[-5000:]
    return {
        "survivor": {r: {rec["step"]: rec for rec in job.read(0, r)} for r in range(ranks)},
        "healed": {r: {rec["step"]: rec for rec in job.read(1, r) if rec["time"] > kill_mid} for r in range(ranks)},
        "logs": {"a": a_log, "b1": b1_log, "b2": b2_log},
        "kill_mid": kill_mid, "restart": restart, "kill_between": kill_between,
    }


def uninterrupted(folder: Path, *, ranks: int, steps: int) -> dict:
    """The same job with no fault: the records of group 0 and group 0's log."""
    with Job(folder, ranks=ranks, steps=steps) as job:
        groups = [job.group(replica, f"g{replica}") for replica in (0, 1)]
        logs = [log for _, log in groups]
        for proc, log in groups:
            wait(f"group {log.stem} to finish", lambda p=proc: p.poll() is not None, logs=logs)
            assert proc.returncode == 0, log.read_text()[-5000:]
    return {"records": {rec["step"]: rec for rec in job.read(0, 0)}, "log": logs[0]}


STEP_LINE = re.compile(r"step:\s+(\d+)\s+loss:\s+([\d.]+)")


def losses(log: Path) -> dict[int, float]:
    """Each logged step's loss (the last line per step: a group logs again after it healed)."""
    return {int(step): float(loss) for step, loss in STEP_LINE.findall(log.read_text())}
