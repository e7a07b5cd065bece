"""The suite's own door: ``python -m pytest`` on two test processes keeps each tier with worker pools whole on
one of them (tests/conftest.py's ``tier_scope``), whatever pytest and pytest-xdist release is installed."""

import re
import subprocess
import sys

from tests.support.run_train import ROOT

CHEAP_E2E = [  # three e2e tests without a launch of their own
    "tests/e2e/test_gpu_check.py::test_exit_status_counts_failures_and_a_spent_budget",
    "tests/e2e/test_gpu_check.py::test_step_figures_and_the_median_step_time",
    "tests/e2e/test_gpu_check.py::test_its_1b_configs_are_valid",
]


def test_a_tier_with_pools_runs_on_one_test_process():
    """Root cause of a CI failure: the tiers were kept together by ``xdist_group`` markers, which xdist 3.8
    records in ``item._nodeid``, no longer read by pytest 9.2: every test became its own group, each tier ran
    split over both processes (two sets of pools), and a test that relied on an earlier test's pool state met a
    fresh pool. Three e2e tests and some unit tests on two processes: the e2e ones on one process, in order."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-n",
            "2",
            "-v",
            "-p",
            "no:cacheprovider",
            *CHEAP_E2E,
            "tests/unit/test_runtime_members.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    ran = re.findall(r"\[(gw\d)\] \[ *\d+%\] PASSED (tests/\S+)", result.stdout)
    e2e = [(worker, test) for worker, test in ran if test.startswith("tests/e2e/")]
    assert [test for _, test in e2e] == CHEAP_E2E, result.stdout[-3000:]
    assert len({worker for worker, _ in e2e}) == 1, e2e
    assert len(ran) > len(e2e)  # (and the unit tests ran beside them)
