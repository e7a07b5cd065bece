"""The fast tier: single-process tests of one module each (the math, the plan, each runtime and optim module on
the fake process group); no gloo pools, no TorchTitan training. Marked ``unit`` by tests/conftest.py."""
