"""Checkpoints end to end: bit-exact resume, surviving a killed rank, the same job through the
three doors (TOML, a user's Python config, TorchTitan's own entry point), and the README's
resume/resharding commands as written."""

import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.support.run_train import (
    CKPT,
    DMUON,
    ROOT,
    assert_same_checkpoint,
    checkpoint_tensors,
    losses_by_step,
    run_train,
)
from tests.support.titan_configs import USER_MODULE


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """10 uninterrupted steps of the main job (DMuon-Z3, 2 ranks), checkpoints at 5 and 10."""
    folder = tmp_path_factory.mktemp("straight")
    result = run_train(folder, "--training.steps", "10", *CKPT)
    assert result.returncode == 0, result.stdout[-3000:]
    return folder, losses_by_step(result.stdout)


def test_killed_rank_then_restart_loses_nothing(straight, tmp_path):
    """SIGKILL one rank after the step-5 checkpoint was written; the restart resumes from
    step 5 and ends bit-identical to the uninterrupted run: the loss at every step, as printed, and the
    step-10 checkpoint's weights, momentum and AdamW state. (This is also the suite's resume in new
    processes; the steps before the save are the straight run's, as the entry-point test shows.)

    The kill waits for what the job itself signals, not for time: the step-5 folder's ``.metadata``
    (DCP writes it last, by rename) and a logged step after 5, polled every 20 ms while a thread
    drains the log; it lands before the step-10 save starts (checked before the kill, so the job
    cannot have finished), on a verified worker of THIS job. (It once failed with the job exiting 0:
    the victim was the first process anywhere on the machine with titan_dmuon.train in its command
    line, on a shared machine possibly another job's worker, and the kill waited on a blocking
    readline for "step:  7", with the job near its end.)"""
    folder, straight_losses = straight
    env = {**os.environ, "CONFIG_FILE": "train_configs/debug_model.toml", "NGPU": "2", "PYTHON": sys.executable}
    cmd = [
        "./run_train.sh",
        "--job.dump_folder",
        str(tmp_path),
        "--metrics.disable_color_printing",
        "true",
        "--training.steps",
        "10",
        *CKPT,
    ]
    step5, step10 = tmp_path / "checkpoint" / "step-5", tmp_path / "checkpoint" / "step-10"
    job = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )  # (its own process group: cleaned up below whatever happens)
    lines: list[str] = []

    def drain():  # (the pipe never fills, and the log can be read without blocking)
        for line in job.stdout:
            lines.append(line)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while not ((step5 / ".metadata").is_file() and max(losses_by_step("".join(lines)), default=0) > 5):
            assert job.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.02)
        victim = _a_training_worker(job.pid)
        assert not step10.exists() and job.poll() is None, "".join(lines)[-3000:]  # training is still running
        os.kill(victim, signal.SIGKILL)
        job.wait(timeout=120)
        reader.join(timeout=30)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode != 0, "".join(lines)[-3000:]
    assert os.path.isdir(tmp_path / "checkpoint" / "step-5")
    assert not (step10 / ".metadata").exists()  # the killed job never completed its last save

    restart = run_train(tmp_path, "--training.steps", "10", *CKPT)
    assert restart.returncode == 0, restart.stdout[-3000:]
    assert "Loading the checkpoint from" in restart.stdout and "step-5" in restart.stdout
    assert sorted(losses_by_step(restart.stdout)) == [6, 7, 8, 9, 10]
    assert losses_by_step(restart.stdout) == {s: straight_losses[s] for s in range(6, 11)}
    assert_same_checkpoint(checkpoint_tensors(folder, 10), checkpoint_tensors(tmp_path, 10))


def _cmdline(pid: int) -> list[bytes]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\0")


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])  # (the name in parentheses may hold spaces)


def _a_training_worker(agent_pid: int) -> int:
    """A worker process of THIS job: a child of its torchrun agent (run_train.sh execs torchrun, so
    the agent is the job's own pid) running the entry point the agent launches (its last ``-m``
    module, e.g. titan_dmuon.integration.train; read from the agent, so a renamed entry point is
    still found), not another job's worker."""
    agent = _cmdline(agent_pid)
    modules = [agent[i + 1] for i, arg in enumerate(agent[:-1]) if arg == b"-m"]
    assert modules[:1] == [b"torch.distributed.run"] and len(modules) == 2, agent
    entry = modules[1]
    for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            if _parent(pid) == agent_pid:
                worker = _cmdline(pid)
                if (b"-m", entry) in itertools.pairwise(worker):
                    return pid
        except (OSError, IndexError, ValueError):
            continue  # (a process that exited meanwhile)
    raise AssertionError(f"no worker running {entry!r} among the children of the torchrun agent {agent_pid}")


# TorchTitan's own command line (tyro): booleans are flags
TYRO_CKPT = ("--checkpoint.enable", "--checkpoint.interval", "5", "--lr_scheduler.total_steps", "10")
TORCHRUN = (
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--nproc_per_node",
    "2",
    "--rdzv_backend",
    "c10d",
    "--rdzv_endpoint",
    "localhost:0",
    "--local-ranks-filter",
    "0",
    "--role",
    "rank",
    "--tee",
    "3",
)


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("CONFIG_FILE", "MODULE", "CONFIG", "NGPU", "LOG_RANK")}
    return {**env, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **extra}


def test_torchtitan_entry_point_trains_the_same_job(straight, tmp_path):
    """``torchrun -m torchtitan.train --module titan_dmuon --config llama3_debugmodel_dmuon`` (as the
    README writes it, plus overrides) trains the TOML main job: the loss at every step and the
    step-10 checkpoint are identical, bit for bit."""
    folder, straight_losses = straight
    cmd = [
        *TORCHRUN,
        "-m",
        "torchtitan.train",
        "--module",
        "titan_dmuon",
        "--config",
        "llama3_debugmodel_dmuon",
        "--dump_folder",
        str(tmp_path),
        "--metrics.disable_color_printing",
        "--training.steps",
        "10",
        *TYRO_CKPT,
    ]
    result = subprocess.run(cmd, cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=420)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert losses_by_step(result.stdout) == straight_losses
    assert_same_checkpoint(checkpoint_tensors(folder, 10), checkpoint_tensors(tmp_path, 10))


def test_users_python_config_resumes_a_toml_checkpoint_bit_exactly(straight, tmp_path):
    """A user's registry module (with_dmuon on TorchTitan's debug config), launched as
    ``MODULE=... CONFIG=... ./run_train.sh`` (TorchTitan's entry point), resumes the TOML job's
    step-5 checkpoint and ends bit-identical to the uninterrupted TOML run."""
    folder, straight_losses = straight
    (tmp_path / "user_dmuon_configs.py").write_text(USER_MODULE)
    run = tmp_path / "run"
    shutil.copytree(folder / "checkpoint" / "step-5", run / "checkpoint" / "step-5")
    pythonpath = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    env = _clean_env(MODULE="user_dmuon_configs", CONFIG="my_dmuon_job", NGPU="2", PYTHONPATH=pythonpath)
    cmd = [
        "./run_train.sh",
        "--dump_folder",
        str(run),
        "--metrics.disable_color_printing",
        "--training.steps",
        "10",
        *TYRO_CKPT,
    ]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "-m torchtitan.train --module user_dmuon_configs --config my_dmuon_job" in result.stdout
    assert "Loading the checkpoint from" in result.stdout and "step-5" in result.stdout
    assert losses_by_step(result.stdout) == {s: straight_losses[s] for s in range(6, 11)}
    assert_same_checkpoint(checkpoint_tensors(folder, 10), checkpoint_tensors(run, 10))


def _documented_commands(page: str, heading: str) -> list[str]:
    """The first bash block after ``heading`` in the docs page ``page``."""
    with open(os.path.join(ROOT, "docs", page)) as f:
        section = f.read().split(heading, 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_documented_checkpoint_commands_run_as_written(tmp_path):
    """The documented resume and resharding commands (docs/checkpoints/torchtitan.md), verbatim,
    in a copy of the checkout (they write ./outputs): 4 steps, a resume to 8, and the HSDP job on 4
    ranks resuming with --checkpoint.exclude_from_loading dataloader. (Without the option every rank
    stops before loading with the line that names it: tests/titan/test_trainer_jobs.py, in-process.)"""
    commands = _documented_commands("checkpoints/torchtitan.md", "## Resume and reshard")
    assert len(commands) == 3 and "--checkpoint.exclude_from_loading dataloader" in commands[2], commands
    clone = tmp_path / "clone"
    clone.mkdir()
    shutil.copy2(os.path.join(ROOT, "run_train.sh"), clone)
    shutil.copytree(os.path.join(ROOT, "train_configs"), clone / "train_configs")
    if os.path.isdir(os.path.join(ROOT, "assets", "debug")):  # else run_train.sh makes them (slower)
        shutil.copytree(os.path.join(ROOT, "assets", "debug"), clone / "assets" / "debug")
    env = _clean_env()

    def sh(command: str):
        result = subprocess.run(
            ["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True, timeout=600
        )
        result.stdout = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout)  # the documented commands log in colour
        return result, losses_by_step(result.stdout)

    first, losses = sh(commands[0])
    assert first.returncode == 0 and sorted(losses) == [1, 2, 3, 4], first.stdout[-3000:]
    second, losses = sh(commands[1])
    assert second.returncode == 0 and sorted(losses) == [5, 6, 7, 8], second.stdout[-3000:]
    assert "Loading the checkpoint from ./outputs/checkpoint/step-4" in second.stdout

    third, losses = sh(commands[2])
    assert third.returncode == 0 and sorted(losses) == [9, 10, 11, 12], third.stdout[-3000:]
    assert "Loading the checkpoint from ./outputs/checkpoint/step-8" in third.stdout
    # the HSDP config's run (test_titan_e2e has none of its own): rank 0 is a shard owner in the
    # replicate stage, so it moves at least the design's average, the same every step. The first
    # step after a resume counts as one step (root cause of a bug: the figures were divided by the
    # steps since step 0, so a job resumed at step 8 logged about 1/9 of its traffic at step 9);
    # it also carries what loading the checkpoint moved (one replicate-stage broadcast).
    comm = [(float(e), float(d)) for e, _, d in DMUON.findall(third.stdout)]
    assert len(comm) == 4 and len(set(comm[1:])) == 1 and comm[1][0] >= comm[1][1], comm
    assert comm[1][0] <= comm[0][0] < 2 * comm[1][0], comm
