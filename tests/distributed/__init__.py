"""The TorchTitan-free core in several processes: gloo worker pools (tests/support/pool.py) against single-process
references. Marked ``distributed`` by tests/conftest.py."""
