"""The tiers, marked from the folder a test lives in (``pytest -m unit`` is the fast tier), and the worker pools
that every module of a session shares (tests/support/pool.py)."""

from pathlib import Path

import pytest

from tests.support.pool import WorkerPool

TIERS = ("unit", "distributed", "titan", "e2e")
TESTS = Path(__file__).resolve().parent


def pytest_ignore_collect(collection_path, config):
    """``-m <tier>`` alone does not import the other tiers' modules (TorchTitan's among them): a tier's marker
    is its folder's and no other test carries it (checked below), so nothing they hold could be selected."""
    tier = (config.getoption("markexpr") or "").strip()
    if tier in TIERS and collection_path.resolve().parent == TESTS and collection_path.name in TIERS:
        return collection_path.name != tier or None
    return None


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = Path(str(item.path)).resolve().relative_to(TESTS).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: a test outside the tier folders {TIERS}; move it into one")
        foreign = [mark.name for mark in item.iter_markers() if mark.name in TIERS and mark.name != tier]
        if foreign:
            raise pytest.UsageError(f"{item.nodeid}: marked {foreign[0]} in tests/{tier}: the folder is the tier")
        item.add_marker(getattr(pytest.mark, tier))


def tier_scope(nodeid: str) -> str:
    """What stays on one test process under pytest-xdist: a tier with worker pools (``distributed``, ``titan``,
    ``e2e``) whole, so its pools, forkserver and TorchTitan imports are made once and a session pool's state
    is one sequence of tests; each unit test on its own, spread over both."""
    parts = Path(nodeid.split("::", 1)[0]).parts
    tier = next((part for part in parts if part in TIERS), "unit")
    return nodeid if tier == "unit" else tier


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's loadscope scheduling, scoped by ``tier_scope`` (in collection order, pyproject's addopts: distributed
    and e2e first, one on each process, then titan, then the unit tests as the processes free up). Not
    ``xdist_group`` markers: xdist 3.8 marks a group in ``item._nodeid``, which pytest >= 9.2 no longer reads,
    so every test was its own group and the tiers ran split over both processes (each starting its own pools;
    a test that relied on an earlier test's pool state failed in CI)."""
    from xdist.scheduler import LoadScopeScheduling

    class TierScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return tier_scope(nodeid)

    return TierScheduling(config, log)


@pytest.fixture(scope="session")
def pool1():
    """One gloo rank: a process group of size 1."""
    pool = WorkerPool(1)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def pool2():
    pool = WorkerPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def pool4():
    pool = WorkerPool(4)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def solo():
    """One process with no process group, for fake-process-group simulations."""
    pool = WorkerPool(1, backend=None)
    yield pool
    pool.close()
