"""Jobs started as processes, as a user starts them: run_train.sh, torchrun, TorchTitan's entry point, TorchFT
kill and restart, benchmarks/gpu_check.py. Marked ``e2e`` by tests/conftest.py."""
