"""End to end: ./run_train.sh on this machine (CPU, gloo), as a user runs it."""

import os
import socket
import subprocess
import sys

import pytest

from tests.support.run_train import ROOT, STEP, parse, run_train, tensorboard_tags
from titan_dmuon.integration.names import Metric


def test_main_job_trains_and_logs_dmuon_figures(tmp_path):
    """The README's main job: debug model, DMuon-Z3, 2 ranks, 20 steps, TensorBoard on."""
    result = run_train(tmp_path, "--metrics.enable_tensorboard", "true")
    steps, comm = parse(result)
    assert sorted(steps) == list(range(1, 21))
    assert steps[20][0] < 0.8 * steps[1][0], steps
    assert len(comm) == 20
    # Z3 with the last layer kept for backward: 3(N-1)/N * P_M - (N-1)/N * P_layer, P_M = 5,111,808 in 6
    # layers; step 1 (which learns the layer order) re-broadcasts the last layer and already launches
    # step 2's first broadcast.
    for elements, megabytes, design in comm[1:]:
        assert elements == design == pytest.approx(7.2417, abs=1e-4)
        assert megabytes == pytest.approx(19.5953, abs=1e-3)  # bf16 broadcasts, fp32 reduce
    assert comm[0][0] == pytest.approx(7.6677 + 0.4260, abs=1e-4)
    assert "--config_file train_configs/debug_model.toml" in result.stdout  # run_train.sh prints its command
    tags = tensorboard_tags(tmp_path)
    assert {Metric.COMM_ELEMENTS, Metric.NS_MS, Metric.OWNER_IMBALANCE, "grad_norm"} <= tags


def test_two_node_launch_on_one_machine(tmp_path):
    """Two run_train.sh invocations, NNODES=2, one process each, rendezvous on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "CONFIG_FILE": "train_configs/debug_model.toml",
        "NGPU": "1",
        "NNODES": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "PYTHON": sys.executable,
    }
    cmd = [
        "./run_train.sh",
        "--job.dump_folder",
        str(tmp_path),
        "--metrics.disable_color_printing",
        "true",
        "--training.steps",
        "4",
    ]
    nodes = [
        subprocess.Popen(
            cmd,
            cwd=ROOT,
            env={**env, "NODE_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=420)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    steps = {int(s): float(loss) for s, loss, _ in STEP.findall(outputs[0])}
    assert sorted(steps) == [1, 2, 3, 4] and steps[4] < steps[1]
    assert "--nnodes 2 --node_rank 0" in outputs[0]


def test_config_error_stops_before_any_process_group(tmp_path):
    """The entry point run_train.sh launches on every rank: a bad key exits with status 2."""
    env = {**os.environ, "WORLD_SIZE": "2"}
    cmd = [
        sys.executable,
        "-m",
        "titan_dmuon.integration.train",
        "--config_file",
        "train_configs/debug_model.toml",
        "--training.stepz",
        "3",
    ]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "command line: unknown key [training] stepz (did you mean 'steps'?)" in result.stdout + result.stderr
    assert "Building device mesh" not in result.stdout + result.stderr


def test_run_train_sh_stops_before_torchrun_with_the_line_last(tmp_path):
    """A config error (here a misspelt key): the message is the last line and no torchrun is started
    (run_train.sh prints the torchrun command just before it runs it)."""
    env = {**os.environ, "CONFIG_FILE": "train_configs/debug_model.toml", "NGPU": "2", "PYTHON": sys.executable}
    result = subprocess.run(
        ["./run_train.sh", "--job.dump_folder", str(tmp_path), "--training.stepz", "3"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert (
        result.stderr.rstrip("\n")
        .rsplit("\n", 1)[-1]
        .startswith("config error: command line: unknown key [training] stepz (did you mean 'steps'?)")
    ), result.stderr[-2000:]
    assert "torch.distributed.run" not in result.stdout + result.stderr
