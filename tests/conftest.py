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
        if tier != "unit":  # a tier with worker pools stays on one test process (pyproject's addopts)
            item.add_marker(pytest.mark.xdist_group(tier))


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
