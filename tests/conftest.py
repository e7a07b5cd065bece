"""The tiers, marked from the folder a test lives in (``pytest -m unit`` is the fast tier), and the worker pools
that every module of a session shares (tests/support/pool.py)."""

from pathlib import Path

import pytest

from tests.support.pool import WorkerPool

TIERS = ("unit", "distributed", "titan", "e2e")
TESTS = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = Path(str(item.path)).resolve().relative_to(TESTS).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: a test outside the tier folders {TIERS}; move it into one")
        item.add_marker(getattr(pytest.mark, tier))


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
