"""The TorchTitan-free core where the GPU machine this project can be lent runs it: torch 2.11,
no TorchTitan (nor tyro, datasets, torchdata, spmd_types), nothing installable.

The core (``titan_dmuon`` outside ``integration/`` and ``config_registry.py``; ``sizing`` reads TorchTitan's
models only when asked to) and the GPU check
run there; its tests pass on torch 2.11 (docs/guides/gpus.md). What torch 2.11 lacks that the
core used is refused by name here, on any torch, by standing in 2.11's behaviour.
"""

import os
import subprocess
import sys

import pytest

from titan_dmuon.math import muon_update
from titan_dmuon.options import DMuonOptions, OptionError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _adjust_lr_of_torch_2_11(lr, adjust_lr_fn, param_shape):
    """torch 2.11-2.13's ``torch.optim._muon._adjust_lr``: no "spectral_unclamped" (its else: 1)."""
    rows, cols = param_shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * max(1, rows / cols) ** 0.5
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * max(rows, cols) ** 0.5
    return lr


def test_the_exact_mode_refuses_an_lr_rule_this_torchs_muon_lacks(monkeypatch):
    """On torch 2.11 ``ns_mode="exact"`` with ``adjust_lr_fn="spectral_unclamped"`` ran
    ``torch.optim.Muon``'s functional update, which silently scaled the learning rate by 1 instead
    of sqrt(rows / cols) (that rule came in torch 2.14): a wrong update without a word. Refused
    now, in the options and in ``muon_step`` itself; the batched mode (our own ``adjusted_lr``)
    still takes it."""
    import torch.optim._muon

    monkeypatch.setattr(torch.optim._muon, "_adjust_lr", _adjust_lr_of_torch_2_11)
    with pytest.raises(OptionError, match=r"adjust_lr_fn = 'spectral_unclamped': expected .*needs torch >= 2\.14"):
        DMuonOptions(ns_mode="exact", adjust_lr_fn="spectral_unclamped")
    DMuonOptions(ns_mode="batched", adjust_lr_fn="spectral_unclamped")
    DMuonOptions(ns_mode="exact", adjust_lr_fn="match_rms_adamw")
    param, grad = torch.randn(8, 2), torch.randn(8, 2)
    with pytest.raises(ValueError, match="needs torch >= 2.14"):
        muon_update.muon_step(
            [param],
            [grad],
            [torch.zeros_like(param)],
            [[((0, 8),)]],
            lr=0.02,
            weight_decay=0.1,
            momentum=0.95,
            nesterov=True,
            ns_steps=5,
            adjust_lr_fn="spectral_unclamped",
            ns_mode="exact",
        )


BLOCKED = ("torchtitan", "tyro", "datasets", "torchdata", "spmd_types")


def test_the_core_and_the_gpu_check_import_without_torchtitan():
    """Every core module, ``tests/support/helpers.py`` and the GPU check's two scripts import with
    TorchTitan and its dependencies unimportable, and the check then names TorchTitan as the
    reason its TorchTitan rows are skipped (a module-level TorchTitan import anywhere in them
    would stop the whole check on the lent machine)."""
    core = []
    for directory, _, files in os.walk(os.path.join(ROOT, "titan_dmuon")):
        package = os.path.relpath(directory, ROOT).replace(os.sep, ".")
        if ".integration" in package or "__pycache__" in package:
            continue
        core += [
            f"{package}.{name[:-3]}"
            for name in sorted(files)
            if name.endswith(".py") and name not in ("__init__.py", "__main__.py", "config_registry.py")
        ]
    script = (
        f"import importlib, sys\nsys.modules.update(dict.fromkeys({BLOCKED!r}))\n"
        f"for name in {[*core, 'tests.support.helpers', 'benchmarks.gpu_runtime', 'benchmarks.gpu_check']!r}:\n"
        "    importlib.import_module(name)\n"
        "from benchmarks.gpu_check import titan_blocker\nprint(titan_blocker())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("TorchTitan is not installed for this python"), result.stdout
    assert len(core) > 40 and {
        "titan_dmuon.runtime.unit",
        "titan_dmuon.math.ns_methods",
        "titan_dmuon.optim.optimizer",
        "titan_dmuon.plan.ownership",
        "titan_dmuon.sizing.figures",
    } <= set(core)
