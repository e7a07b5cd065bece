"""What the TorchTitan tier's modules share as fixtures."""

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def in_repo_root(monkeypatch):
    """The registry's debug configs make and read ./assets/debug, as run_train.sh does from the root; no
    WORLD_SIZE from the environment (the doors read it as torchrun's)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
