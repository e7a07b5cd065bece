"""benchmarks/gpu_check.py, as far as a CPU can check it (the GPU run itself needs an NVIDIA GPU)."""

import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def test_refuses_without_cuda():
    result = subprocess.run([sys.executable, "benchmarks/gpu_check.py"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "needs an NVIDIA GPU" in result.stdout and "nothing was run" in result.stdout


def test_newton_schulz_comparison_runs_the_same_update():
    """Both implementations it times run: one row each, same matrix count; on tiny shapes here."""
    from benchmarks.gpu_check import newton_schulz_rows

    tiny = {"tiny": [("wqkv", 24, 16, [16, 4, 4]), ("w1", 40, 16, None), ("w2", 16, 40, None)]}
    rows = newton_schulz_rows(tiny, device=torch.device("cpu"), reps=1)
    assert [r[1] for r in rows] == ["torch.optim.Muon (per-matrix loop)", "DMuon muon_step (batched)"]
    assert all(r[2] == 5 and r[3] > 0 and r[4] > 0 for r in rows)


def test_its_1b_configs_are_valid():
    from titan_dmuon.integration import cpu

    cpu.enable()
    from benchmarks.gpu_configs import llama3_1b_adamw, llama3_1b_dmuon
    from titan_dmuon.integration.validation import validate_dmuon

    dmuon, adamw = llama3_1b_dmuon(), llama3_1b_adamw()
    assert dmuon.optimizer.name == "dmuon" and dmuon.model_spec.flavor == "1B" == adamw.model_spec.flavor
    validate_dmuon(dmuon, world_size=1)
