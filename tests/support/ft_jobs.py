"""Launching the fault-tolerance jobs (tests/e2e/test_fault_tolerance_e2e.py, benchmarks/fault_tolerance.py):
a TorchFT lighthouse and replica groups through ./run_train.sh with ``MODULE=tests.support.ft_harness`` (the
README's job, instrumented: tests/support/ft_harness.py), waits that poll with a deadline, SIGKILL of a group.

No wait inside a group is shorter than the test's own deadline: TorchFT's quorum and its other
operations (60 s by default) and the groups' cross-group process group (the job's 10 s) are given
``DEADLINE_S``. A group held by the test, or slowed by a loaded machine, then makes its peers wait
instead of failing them (a killed peer is still seen at once: its connections close); the test's
own waits fail with every log's tail. The lighthouse counts a group dead after
``HEARTBEAT_TIMEOUT_MS`` without a heartbeat: 3 s lapsed for a live group on a loaded machine.

Groups started together are held before their first step until all of them are (``hold=(0,)``,
``release_together``): the lighthouse gives a group that asks while no other is alive yet a quorum of
its own, and the other would join steps later."""

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

ROOT = Path(__file__).resolve().parents[2]
LIGHTHOUSE = Path(sys.executable).with_name("torchft_lighthouse")
DEADLINE_S = 420  # for any one wait (a group's start is ~20 s here; 2 shared cores may be far slower)
HEARTBEAT_TIMEOUT_MS = 10000  # the lighthouse's: how long after its last heartbeat a group counts as dead


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

    def __init__(
        self,
        folder: Path,
        *,
        ranks: int,
        steps: int,
        extra: tuple[str, ...] = (),
        heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS,
    ) -> None:
        self.folder, self.ranks, self.steps, self.extra = folder, ranks, steps, extra
        self.records = folder / "records"
        self.records.mkdir(parents=True)
        self.port = free_port()
        self.lighthouse_log = folder / "lighthouse.log"
        self._procs: list[subprocess.Popen] = []
        self.lighthouse = self._start(
            [
                str(LIGHTHOUSE),
                "--min_replicas",
                "1",
                "--quorum_tick_ms",
                "100",
                "--join_timeout_ms",
                "5000",
                "--heartbeat_timeout_ms",
                str(heartbeat_timeout_ms),
                "--bind",
                f"[::]:{self.port}",
            ],
            self.lighthouse_log,
            os.environ,
        )

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc) -> None:
        for proc in self._procs:
            self._kill(proc)

    def _start(self, cmd, log: Path, env) -> subprocess.Popen:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
        )
        self._procs.append(proc)
        return proc

    def group(
        self, replica: int, name: str, *, pause: str | None = None, hold: tuple[int, ...] = ()
    ) -> tuple[subprocess.Popen, Path]:
        env = {
            **os.environ,
            "MODULE": "tests.support.ft_harness",
            "CONFIG": "llama3_debugmodel_dmuon_ft",
            "NGPU": str(self.ranks),
            "PYTHON": sys.executable,
            "TITAN_DMUON_PRECHECK": "0",
            "TORCHFT_LIGHTHOUSE": f"http://localhost:{self.port}",
            "FT_TEST_RECORD": str(self.records),
            "FT_TEST_PAUSE": pause or "",
            "FT_TEST_HOLD": ",".join(map(str, hold)),
            "LOG_RANK": "0",
            "TORCHFT_QUORUM_TIMEOUT_SEC": str(DEADLINE_S),
            "TORCHFT_TIMEOUT_SEC": str(DEADLINE_S),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        log = self.folder / f"{name}.log"
        cmd = [
            "./run_train.sh",
            "--dump_folder",
            str(self.folder / "dump"),
            "--fault_tolerance.replica_id",
            str(replica),
            "--training.steps",
            str(self.steps),
            "--metrics.disable_color_printing",
            "--fault_tolerance.process_group_timeout_ms",
            str(DEADLINE_S * 1000),
            *self.extra,
        ]
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

    def lighthouse_log_size(self) -> int:
        return self.lighthouse_log.stat().st_size

    def in_lighthouse_quorum(self, replica: int, since: int) -> bool:
        """Whether the lighthouse has registered a quorum request of group ``replica`` after byte
        ``since`` of its log: TorchFT's lighthouse logs "Received quorum request for replica
        torchtitan_ft_<replica>:..." as a request arrives, then, once it is registered, the quorum
        status with the count of participants ("[healthy/registered participants healthy]"). With
        every other group held out of its quorum, a later status with a participant is that group."""
        text = self.lighthouse_log.read_bytes()[since:].decode(errors="replace")
        received = text.find(f"Received quorum request for replica torchtitan_ft_{replica}:")
        return (
            received >= 0
            and re.search(r"Quorum status: [^\n]*\[[1-9]\d*/[1-9]\d* participants healthy\]", text[received:])
            is not None
        )

    def release(self, replica: int, step: int) -> None:
        (self.records / f"{replica}.release{step}").touch()

    def release_together(self, replicas, logs, alive) -> None:
        """Groups started with ``hold=(0,)``: once every one is held before its first step (its
        TorchFT manager, made with the trainer, heartbeats), all are released."""
        for replica in replicas:
            self.wait_paused(replica, logs, alive, marker="held")
        for replica in replicas:
            self.release(replica, 0)

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
                    "0." + stamp.group(1)[20:]
                )
    return None


def kill_restart_kill(
    folder: Path,
    *,
    ranks: int,
    steps: int,
    kill_in: int,
    kill_after: int,
    kill_between: int | None = None,
    heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS,
) -> dict:
    """The fault scenario: groups 0 and 1; group 1 SIGKILLed in the forward of step ``kill_in`` and
    restarted; with ``kill_between``, the restarted group SIGKILLed after that step (between steps)
    and restarted again; the last one SIGKILLed after step ``kill_after``, never to return; group 0
    finishes. Returns the records per (group, rank) (the restarted groups' records after the first
    kill under "healed", each restart's under "incarnations"), the logs, the kill times and the
    first restart's.

    Every hand-over waits for an event, never for a time, so that the outcome is the same however
    the machine schedules the groups:

    * both groups start held before their first step and are released together (their first quorum
      then has both);
    * after each kill, group 0 finishes the next step alone (its quorum leaves the dead group out
      once the lighthouse stops hearing it) and holds; only then is group 1 restarted, so that
      quorum cannot already wait for the new group;
    * group 0 is released once the lighthouse has registered the restarted group's quorum request,
      and the lighthouse forms the quorum of both as soon as group 0 asks. Regression: group 0 was
      released when the restarted group's log said it had started; on a loaded machine it could ask
      first and get a quorum of its own at once (its previous quorum had it alone), so the new group
      joined a step late, or still be held when the new group's quorum timed out (torchft's 60 s;
      the lighthouse waits for every live group, and a held group 0 is alive)."""
    kills = [kill_in] + ([kill_between] if kill_between is not None else [])
    with Job(folder, ranks=ranks, steps=steps, heartbeat_timeout_ms=heartbeat_timeout_ms) as job:
        a, a_log = job.group(0, "a", hold=(0, *(k + 1 for k in kills)))
        b, b_log = job.group(1, "b1", pause=f"mid:{kill_in}", hold=(0,))
        logs = [a_log, b_log]
        job.release_together((0, 1), logs, [a, b])
        kill_times, restarts, group_logs = [], [], {"a": a_log, "b1": b_log}
        for n, killed_after_step in enumerate(kills):
            kill_times.append(job.kill(b, job.wait_paused(1, logs, [a, b])))
            job.wait_paused(0, logs, [a], marker="held")  # (after step killed_after_step + 1, alone)
            restarts.append(time.time())
            since = job.lighthouse_log_size()  # (the killed group sends no request after this)
            last = n + 1 == len(kills)
            b, b_log = job.group(1, f"b{n + 2}", pause=f"end:{kill_after if last else kills[n + 1]}")
            logs.append(b_log)
            group_logs[f"b{n + 2}"] = b_log
            wait(
                "the restarted group in the lighthouse's quorum",
                lambda: job.in_lighthouse_quorum(1, since),
                logs=[*logs, job.lighthouse_log],
                alive=[a, b],
            )
            job.release(0, killed_after_step + 1)
        kill_last = job.kill(b, job.wait_paused(1, logs, [a, b]))
        wait("group 0 to finish", lambda: a.poll() is not None, logs=logs)
        assert a.returncode == 0, a_log.read_text()[-5000:]
    bounds = [*kill_times, kill_last]
    records = {r: job.read(1, r) for r in range(ranks)}
    incarnations = [
        {r: {rec["step"]: rec for rec in records[r] if start < rec["time"] < stop} for r in range(ranks)}
        for start, stop in zip(bounds, bounds[1:])
    ]
    return {
        "survivor": {r: {rec["step"]: rec for rec in job.read(0, r)} for r in range(ranks)},
        "healed": {r: {rec["step"]: rec for rec in records[r] if rec["time"] > kill_times[0]} for r in range(ranks)},
        "incarnations": incarnations,
        "logs": group_logs,
        "kill_mid": kill_times[0],
        "restart": restarts[0],
        "kill_between": kill_times[1] if kill_between else kill_last,
        "kill_last": kill_last,
    }


def uninterrupted(folder: Path, *, ranks: int, steps: int, heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS) -> dict:
    """The same job with no fault: the records of group 0 and group 0's log."""
    with Job(folder, ranks=ranks, steps=steps, heartbeat_timeout_ms=heartbeat_timeout_ms) as job:
        groups = [job.group(replica, f"g{replica}", hold=(0,)) for replica in (0, 1)]
        logs = [log for _, log in groups]
        job.release_together((0, 1), logs, [proc for proc, _ in groups])
        for proc, log in groups:
            wait(f"group {log.stem} to finish", lambda p=proc: p.poll() is not None, logs=logs)
            assert proc.returncode == 0, log.read_text()[-5000:]
    return {"records": {rec["step"]: rec for rec in job.read(0, 0)}, "log": logs[0]}


STEP_LINE = re.compile(r"step:\s+(\d+)\s+loss:\s+([\d.]+)")


def losses(log: Path) -> dict[int, float]:
    """Each logged step's loss (the last line per step: a group logs again after it healed)."""
    return {int(step): float(loss) for step, loss in STEP_LINE.findall(log.read_text())}
