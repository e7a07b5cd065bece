"""What a fault costs under TorchFT with DMuon: the README's job in two replica groups (2 ranks each,
DMuon-Z3 in each), one group SIGKILLed in a step and restarted, the restarted one SIGKILLed between
steps for good, next to the same job without faults. One command (needs the ft extra):

    .venv/bin/python benchmarks/fault_tolerance.py [--steps 20 --kill-in 5 --kill-after 12]

Prints a table: the time from the kill until the survivor ended the failed step and until its next
committed step, the steps lost per fault, the restarted group's state transfer and its time from
start to its first committed step, whether it then equals the survivor bitwise, and the loss after
recovery next to the uninterrupted run's. Times depend on the machine (and its load); the steps
lost and the bitwise equality do not.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support.ft_jobs import kill_restart_kill, log_time, losses, uninterrupted  # noqa: E402

LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS = 3000  # as the README starts the lighthouse (its figures were measured so)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kill-in", type=int, default=5, help="group 1 is killed in the forward of this step")
    parser.add_argument("--kill-after", type=int, default=12, help="the restarted group is killed after this step")
    parser.add_argument("--ranks", type=int, default=2, help="ranks per group")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dmuon_ft_bench_") as folder:
        # (the tests give the lighthouse 10 s, for a loaded machine)
        run = kill_restart_kill(
            Path(folder, "faults"),
            ranks=args.ranks,
            steps=args.steps,
            kill_in=args.kill_in,
            kill_after=args.kill_after,
            heartbeat_timeout_ms=LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS,
        )
        clean = uninterrupted(
            Path(folder, "clean"),
            ranks=args.ranks,
            steps=args.steps,
            heartbeat_timeout_ms=LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS,
        )
        report(run, clean, args)


def report(run: dict, clean: dict, args) -> None:
    survivor, healed = run["survivor"][0], run["healed"]
    commits = {k: survivor[k]["commits"] for k in survivor}
    lost_in_step = sum(1 for k in survivor if k > 1 and commits[k] == commits[k - 1] and k <= args.kill_in + 1)
    lost_between = sum(1 for k in survivor if k > args.kill_after and commits[k] == commits[k - 1])
    failed = min(k for k in survivor if k > 1 and commits[k] == commits[k - 1])
    next_commit = min(k for k in survivor if k > failed)
    after_between = min(k for k in survivor if survivor[k]["time"] > run["kill_between"])
    b2 = run["logs"]["b2"]
    first = min(healed[0])
    equal = all(
        (healed[r][k]["weights"], healed[r][k]["state"])
        == (run["survivor"][r][k]["weights"], run["survivor"][r][k]["state"])
        for r in healed
        for k in healed[r]
    )
    ft_loss, clean_loss = losses(run["logs"]["a"]), losses(clean["log"])
    last = args.steps
    after = [k for k in ft_loss if k >= first]
    rows = [
        (
            "killed in a step: the survivor's failed step ended after the kill",
            f"{survivor[failed]['time'] - run['kill_mid']:.1f} s",
        ),
        (
            "killed in a step: the survivor's next committed step ended after the kill",
            f"{survivor[next_commit]['time'] - run['kill_mid']:.1f} s",
        ),
        ("steps lost: killed in a step / between steps", f"{lost_in_step} / {lost_between}"),
        (
            "killed between steps: the survivor's next step ended after the kill",
            f"{survivor[after_between]['time'] - run['kill_between']:.1f} s",
        ),
        (
            "healing: state transfer (TorchFT's fetch and load)",
            f"{log_time(b2, 'Loaded state dict') - log_time(b2, 'healing required'):.2f} s",
        ),
        (
            "healing: restart to the end of its first committed step (process start, model build, quorum, transfer)",
            f"{healed[0][first]['time'] - run['restart']:.1f} s (step {first})",
        ),
        (
            "healed group vs survivor, every rank and step after healing (weights, momentum, AdamW)",
            "bitwise equal" if equal else "DIFFERENT",
        ),
        (f"loss at step {last}: after the faults / uninterrupted", f"{ft_loss[last]:.5f} / {clean_loss[last]:.5f}"),
        (
            f"largest loss difference over steps {min(after)}-{last}",
            f"{max(abs(ft_loss[k] - clean_loss[k]) for k in after):.5f}",
        ),
    ]
    print(
        f"\nTorchFT, 2 groups x {args.ranks} ranks, llama3 debug model with DMuon-Z3, {args.steps} steps; group 1 "
        f"killed in step {args.kill_in} and restarted, then killed after step {args.kill_after} for good\n"
    )
    print("| figure | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
