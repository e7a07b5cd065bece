"""At interpreter exit, let gloo's worker threads finish releasing their works (Linux).

A gloo collective shortly before exit (a script's last loss all-reduce, a ledger
read after the last step) leaves a worker thread that still has to drop its
reference to the finished Work, which takes the GIL. If it gets the GIL only
once the interpreter is finalizing, CPython ends the thread inside the Work's
noexcept destructor: std::terminate, "terminate called without an active
exception", SIGABRT. ``install_exit_guard`` registers an atexit handler (which
runs while the interpreter is still whole) that naps until no gloo worker
thread is runnable.
"""

from __future__ import annotations

import atexit
import os
import time


def install_exit_guard() -> None:
    """Idempotent: atexit runs the guard once however often it is asked for."""
    atexit.unregister(_let_gloo_workers_finish)
    atexit.register(_let_gloo_workers_finish)


def _let_gloo_workers_finish(timeout_s: float = 2.0) -> None:
    """At interpreter exit, before finalization: let gloo's worker threads finish releasing their works.

    The hazard ``_all_gather_released`` avoids for the ledger's own collective
    holds for any gloo collective shortly before exit (the script's last loss
    all-reduce, say): a worker still to release a finished Work needs the GIL,
    and gets killed in a noexcept destructor (SIGABRT) if it only gets it once
    the interpreter is finalizing. atexit handlers run while the interpreter is
    still whole, so sleep here in short naps (GIL and CPU free) until no gloo
    worker thread is runnable, a few naps in a row. Linux only (reads /proc);
    costs a few milliseconds at exit.
    """
    try:
        tids = [t for t in os.listdir("/proc/self/task") if _thread_comm(t).startswith("pt_gloo")]
    except OSError:
        return
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while tids and quiet < 3 and time.monotonic() < deadline:
        time.sleep(0.002)
        quiet = 0 if any(_thread_state(t) == "R" for t in tids) else quiet + 1


def _thread_comm(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _thread_state(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]  # R running/runnable, S sleeping, ...
    except (OSError, IndexError):
        return ""
