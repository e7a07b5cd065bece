"""``python -m titan_dmuon.env``: the bug-report environment report (issue 37, item 3)."""

import subprocess
import sys
from importlib import metadata

from titan_dmuon import env
from titan_dmuon.options import DMuonOptions


def test_the_report_names_versions_backends_devices_kernels_defaults():
    text = env.report()
    for heading in (
        "versions",
        "distributed backends",
        "devices",
        "CPU kernels",
        "DMuon option defaults",
        "environment variables",
    ):
        assert f"== {heading}\n" in text
    import torch

    assert f"torch: {metadata.version('torch')}\n" in text and torch.__version__ in text
    assert "\ngloo: available\n" in text  # (every Linux build of torch has gloo)
    assert f"torch CPU capability: {torch.backends.cpu.get_cpu_capability()}\n" in text
    defaults = DMuonOptions()
    for name in ("lr", "momentum", "ns_mode", "adamw_betas", "adamw_weight_decay"):
        assert f"\n{name}: {getattr(defaults, name)!r}\n" in text


def test_packages_that_are_missing_are_said_so(monkeypatch):
    """Without TorchTitan or torchft installed the report says so instead of failing."""
    real = metadata.version

    def version(name):
        if name in ("torchtitan", "torchft"):
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", version)
    text = env.report()
    assert "\ntorchtitan: not installed\n" in text and "\ntorchft: not installed\n" in text


def test_the_variables_that_matter_are_listed(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    monkeypatch.setenv("UNRELATED_VARIABLE_OF_THE_TEST", "x")
    section = env.report().split("== environment variables\n")[1]
    lines = set(section.splitlines())  # (and any others of these families the machine sets)
    assert {"MALLOC_ARENA_MAX: 2", "ONEDNN_MAX_CPU_ISA: AVX2", "TORCH_NCCL_ASYNC_ERROR_HANDLING: 1"} <= lines
    assert "UNRELATED_VARIABLE_OF_THE_TEST" not in section


def test_python_m_prints_it_without_importing_torchtitan():
    """The command a user runs; neither TorchTitan nor torchft is imported (their versions are read from
    the installed metadata), so the report also works where they cannot import."""
    code = (
        "import runpy, sys; runpy.run_module('titan_dmuon.env', run_name='__main__'); "
        "print('imported:', 'torchtitan' in sys.modules, 'torchft' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.startswith("== versions\n") and "== DMuon option defaults\n" in out
    assert out.rstrip().endswith("imported: False False")
