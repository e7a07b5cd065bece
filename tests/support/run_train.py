"""./run_train.sh started as a user starts it, and what its jobs leave: the log's step lines and DMuon figures,
TensorBoard's tags, a DCP checkpoint read back in full."""

import os
import re
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


STEP = re.compile(r"step:\s+(\d+)\s+loss:\s+([\d.]+)\s+grad_norm:\s+([\d.]+)")


DMUON = re.compile(r"dmuon: comm ([\d.]+)M elements/rank/step \(([\d.]+) MB; design ([\d.]+)M")


def run_train(tmp_path, *overrides, config="debug_model.toml", ngpu=2, env=None, timeout=420):
    """./run_train.sh with these overrides. Without run_train.sh's own check before torchrun (the
    workers check the config too; tests/titan/test_config_errors.py and the README commands test cover
    the check): it costs a TorchTitan import, ~8 s, per run."""
    environment = {
        **os.environ,
        "CONFIG_FILE": config if os.path.isabs(config) else f"train_configs/{config}",
        "NGPU": str(ngpu),
        "PYTHON": sys.executable,
        "TITAN_DMUON_PRECHECK": "0",
        **(env or {}),
    }
    cmd = ["./run_train.sh", "--job.dump_folder", str(tmp_path), "--metrics.disable_color_printing", "true", *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=timeout)


def parse(result):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout + result.stderr
    steps = {int(s): (float(loss), float(norm)) for s, loss, norm in STEP.findall(out)}
    comm = [(float(a), float(b), float(c)) for a, b, c in DMUON.findall(out)]
    return steps, comm


def tensorboard_tags(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for dirpath, _, files in os.walk(folder):
        if any(f.startswith("events.out.tfevents") for f in files):
            accumulator = EventAccumulator(dirpath)
            accumulator.Reload()
            tags |= set(accumulator.Tags()["scalars"])
    return tags


CKPT = (
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "5",
    "--checkpoint.last_save_model_only",
    "false",
    "--lr_scheduler.total_steps",
    "10",
)


def checkpoint_tensors(folder, step) -> dict:
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


def assert_same_checkpoint(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert any(".momentum_buffer" in k for k in a) and any(".exp_avg" in k for k in a)
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def losses_by_step(output: str) -> dict[int, str]:
    return {int(s): loss for s, loss, _ in STEP.findall(output)}
