"""Checkpoints end to end through run_train.sh: bit-exact resume, and surviving a killed rank."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.test_titan_e2e import ROOT, STEP, run_train

CKPT = ("--checkpoint.enable", "true", "--checkpoint.interval", "5", "--checkpoint.last_save_model_only", "false",
        "--lr_scheduler.total_steps", "10")


def _checkpoint(folder, step) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(folder, f"step-{step}.pt")
    dcp_to_torch_save(os.path.join(folder, "checkpoint", f"step-{step}"), out)
    return _flat(torch.load(out, weights_only=False))


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert any(".momentum_buffer" in k for k in a) and any(".exp_avg" in k for k in a)
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def _losses(output: str) -> dict[int, str]:
    return {int(s): loss for s, loss, _ in STEP.findall(output)}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """10 uninterrupted steps of the main job (DMuon-Z3, 2 ranks), checkpoints at 5 and 10."""
    folder = tmp_path_factory.mktemp("straight")
    result = run_train(folder, "--training.steps", "10", *CKPT)
    assert result.returncode == 0, result.stdout[-3000:]
    return folder, _losses(result.stdout)


def test_resume_in_new_processes_is_bit_exact(straight, tmp_path):
    folder, straight_losses = straight
    first = run_train(tmp_path, "--training.steps", "5", *CKPT)
    second = run_train(tmp_path, "--training.steps", "10", *CKPT)
    assert first.returncode == 0 and second.returncode == 0, second.stdout[-3000:]
    assert "Loading the checkpoint from" in second.stdout
    resumed = {**_losses(first.stdout), **_losses(second.stdout)}
    assert resumed == straight_losses  # the loss at every step, as printed
    _assert_same(_checkpoint(folder, 10), _checkpoint(tmp_path, 10))  # weights, momentum, AdamW state


def test_killed_rank_then_restart_loses_nothing(straight, tmp_path):
    """SIGKILL one rank after the step-5 checkpoint was written; the restart resumes from
    step 5 and ends bit-identical to the uninterrupted run."""
    folder, straight_losses = straight
    env = {**os.environ, "CONFIG_FILE": "train_configs/debug_model.toml", "NGPU": "2", "PYTHON": sys.executable}
    cmd = ["./run_train.sh", "--job.dump_folder", str(tmp_path), "--metrics.disable_color_printing", "true",
           "--training.steps", "10", *CKPT]
    job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = ""
    deadline = time.monotonic() + 300
    while "step:  7" not in seen and time.monotonic() < deadline:
        line = job.stdout.readline()
        if not line:
            break
        seen += line
    victim = _a_training_worker(job.pid)
    os.kill(victim, signal.SIGKILL)
    job.communicate(timeout=120)
    assert job.returncode != 0
    assert os.path.isdir(tmp_path / "checkpoint" / "step-5")

    restart = run_train(tmp_path, "--training.steps", "10", *CKPT)
    assert restart.returncode == 0, restart.stdout[-3000:]
    assert "Loading the checkpoint from" in restart.stdout and "step-5" in restart.stdout
    assert sorted(_losses(restart.stdout)) == [6, 7, 8, 9, 10]
    assert _losses(restart.stdout) == {s: straight_losses[s] for s in range(6, 11)}
    _assert_same(_checkpoint(folder, 10), _checkpoint(tmp_path, 10))


def _a_training_worker(launcher_pid: int) -> int:
    """A worker process of the torchrun started by run_train.sh (not the agent itself)."""
    for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().split(b"\0")
        except OSError:
            continue
        if b"titan_dmuon.train" in cmdline and b"torch.distributed.run" not in cmdline and pid != launcher_pid:
            return pid
    raise AssertionError("no training worker found")
