"""Faults, end to end: a TorchFT lighthouse and replica groups started with ./run_train.sh as the README
starts them, groups SIGKILLed in a step and between steps, one restarted, one never.

The groups run the README's job through TorchTitan's entry point with ``MODULE=tests.support.ft_harness`` (the
same config, ``llama3_debugmodel_dmuon_ft``, plus per-step digests of every tensor each rank holds and
a pause at a chosen point, where the test kills the group). Every wait polls with a deadline; the
machine may be loaded (2 shared cores), so deadlines are generous and nothing sleeps a fixed time.
Skipped, with the reason, where torchft is not installed (the ``test`` extra installs it).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest

from tests.support.ft_jobs import DEADLINE_S, ROOT, Job, free_port, kill_restart_kill, log_time, losses, wait
from titan_dmuon.integration.config.validation.fault_tolerance_section import torchft_missing

pytestmark = pytest.mark.skipif(
    torchft_missing(), reason="torchft is not installed (pip install -e '.[ft]'; the test extra has it)"
)


def test_groups_killed_in_a_step_and_between_steps(tmp_path):
    """Two groups of two ranks (DMuon-Z3 in each; the README's job, 11 steps). Group 1 is SIGKILLed
    in the forward of step 3 and restarted once group 0 has finished step 4 (group 0 waits until the
    restarted group is in its quorum); the restarted group is SIGKILLed after step 6, between steps,
    and restarted again (group 0 waits after step 7); that one is SIGKILLed after step 9 and never
    comes back. Every hand-over waits for an event, not a time (``tests/support/ft_jobs.py``:
    ``kill_restart_kill``), so that a loaded machine changes only how long it takes.

    * Group 0 commits nothing for step 3 (its weights, momentum and AdamW state after step 3 are
      bitwise those after step 2), continues alone, and commits every other step: one step lost,
      none for the kills between steps.
    * Each restarted group heals from group 0 (TorchFT's transfer, rank to rank: each rank gets the
      weights and momentum it owns) and from then on holds, rank for rank, bitwise the same
      weights and optimizer state as group 0 after every step (the learning rate it got is the
      current one: with TorchTitan's cached state it differed).
    * The job finishes with the survivor."""
    run = kill_restart_kill(tmp_path, ranks=2, steps=11, kill_in=3, kill_between=6, kill_after=9)
    survivor, incarnations = run["survivor"], run["incarnations"]
    for r in range(2):
        steps = survivor[r]
        assert sorted(steps) == list(range(1, 12))
        commits = [steps[k]["commits"] for k in range(1, 12)]
        assert commits == [1, 2, 2, 3, 4, 5, 6, 7, 8, 9, 10], commits  # step 3 discarded, every other one committed
        assert (steps[3]["weights"], steps[3]["state"]) == (steps[2]["weights"], steps[2]["state"])
        for incarnation, expected in zip(incarnations, ([5, 6], [8, 9])):  # killed in a step, then between steps
            rejoined = sorted(incarnation[r])
            assert rejoined == expected, rejoined
            for k in rejoined:
                assert (incarnation[r][k]["weights"], incarnation[r][k]["state"], incarnation[r][k]["lrs"]) == (
                    steps[k]["weights"],
                    steps[k]["state"],
                    steps[k]["lrs"],
                ), (r, k)
    # across the groups each rank all-reduces every gradient element it holds once per step (its owners'
    # dedicated gradients and its FSDP2 shards): 2(G-1)/G of them moved, none while it is alone
    figures = re.findall(
        r"TorchFT: (\d) groups, \d+ steps committed, averaged ([\d.]+)M elements/rank/step across "
        r"groups \(([\d.]+)M moved\)",
        run["logs"]["a"].read_text(),
    )
    assert len(figures) == 11 and {g for g, _, _ in figures} == {"1", "2"}
    for groups, averaged, moved in figures:
        assert float(averaged) == round(survivor[0][1]["held"] / 1e6, 4)
        assert float(moved) == (float(averaged) if groups == "2" else 0.0)
    # the logged loss is the mean over the groups: at step 1, of the initial model, near ln(vocabulary)
    # (TorchTitan's FaultTolerantTrainer logged the sum of the groups' means: twice that)
    assert losses(run["logs"]["a"])[1] < 1.5 * math.log(2048)
    assert all("healing required" in run["logs"][name].read_text() for name in ("b2", "b3"))
    assert run["logs"]["a"].read_text().count("should_commit=False") == 1

    # the figures of this run (the machine is shared: times are indicative; benchmarks/fault_tolerance.py)
    b2 = run["logs"]["b2"]
    print(
        f"\nkilled in step 3: group 0 ended that step (discarded) {survivor[0][3]['time'] - run['kill_mid']:.1f} s "
        f"after the kill; the restarted group's transfer took "
        f"{log_time(b2, 'Loaded state dict') - log_time(b2, 'healing required'):.2f} s"
    )


@pytest.mark.parametrize("method, ranks", [("diloco", 2), ("local_sgd", 1)])
def test_semi_synchronous_training_with_dmuon_inner_steps(tmp_path, method, ranks):
    """DiLoCo and LocalSGD with DMuon as the inner optimizer (two groups, of two ranks and of one; a
    sync every 2 steps): DMuon runs inside each group only, so the groups' weights differ after the
    inner steps (each trains on its own data) and are bitwise equal after every sync, on every rank
    (owners' full weights, the other ranks' placeholders and FSDP2's shards alike); the job trains."""
    with Job(
        tmp_path,
        ranks=ranks,
        steps=4,
        extra=("--fault_tolerance.semi_sync_method", method, "--fault_tolerance.sync_steps", "2"),
    ) as job:
        groups = [job.group(replica, f"g{replica}", hold=(0,)) for replica in (0, 1)]
        job.release_together((0, 1), [log for _, log in groups], [proc for proc, _ in groups])
        for proc, log in groups:
            wait(f"group {log.stem} to finish", lambda p=proc: p.poll() is not None, logs=[log for _, log in groups])
            assert proc.returncode == 0, log.read_text()[-5000:]
    for r in range(ranks):
        g0, g1 = ({rec["step"]: rec["weights"] for rec in job.read(replica, r)} for replica in (0, 1))
        assert sorted(g0) == sorted(g1) == [1, 2, 3, 4]
        assert [g0[k] == g1[k] for k in (1, 2, 3, 4)] == [False, True, False, True], (r, g0, g1)
    trained = losses(groups[0][1])
    assert sorted(trained) == [1, 2, 3, 4] and trained[4] < trained[1], trained


def test_lighthouse_unreachable_at_start_is_one_line(tmp_path):
    """The README's group command with no lighthouse running: run_train.sh's check stops before
    torchrun with one line, last, naming the address and how to start the lighthouse (exit 2)."""
    env = {
        **os.environ,
        "CONFIG": "llama3_debugmodel_dmuon_ft",
        "NGPU": "1",
        "PYTHON": sys.executable,
        "TORCHFT_LIGHTHOUSE": f"http://localhost:{free_port()}",
        "TORCHFT_CONNECT_TIMEOUT_SEC": "1",
    }
    result = subprocess.run(
        ["./run_train.sh", "--fault_tolerance.replica_id", "0", "--dump_folder", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"config error: no TorchFT lighthouse answers at {env['TORCHFT_LIGHTHOUSE']}"), last
    assert "torchft_lighthouse --min_replicas 1" in last and "torchrun" not in result.stdout
