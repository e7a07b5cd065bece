"""TorchTitan in-process: its model families, configs, trainer pieces and checkpointing, built as its trainer
builds them (tests/support/titan_harness.py). Marked ``titan`` by tests/conftest.py.

TorchTitan is pointed at the CPU and gloo here, before any module of this tier imports it: pytest imports this
package before each of its modules, and so does a pool worker, which imports a test module to run its functions
(``cpu.enable`` is a no-op with an accelerator)."""

from titan_dmuon.integration import cpu

cpu.enable()
