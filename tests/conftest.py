import pytest

from tests.pool import WorkerPool


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
