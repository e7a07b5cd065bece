"""The config module of the fault-tolerance tests: ``MODULE=tests.support.ft_harness CONFIG=llama3_debugmodel_dmuon_ft
./run_train.sh ...`` is the README's job (titan_dmuon.config_registry's, re-exported) with two test aids
that TorchTitan's entry point loads with it:

* ``FT_TEST_RECORD=<folder>``: after every step each rank appends a line to
  ``<folder>/<replica>_<rank>.jsonl``: the trainer's step, TorchFT's committed steps, the
  learning rates, the trainable elements it holds, a digest of every tensor this rank holds of the model and of the
  optimizer state (bitwise: equal digests at the same rank of two groups mean equal weights, momentum and
  AdamW moments), and the wall-clock time;
* ``FT_TEST_PAUSE=mid:<step>`` (in the forward of that step) or ``end:<step>`` (after that step,
  before the next quorum): every rank writes ``<folder>/<replica>_<rank>.paused`` (its pid) and sleeps,
  so the test can SIGKILL the group exactly there;
* ``FT_TEST_HOLD=<step>[,<step>...]``: after each of those steps every rank writes
  ``<folder>/<replica>_<rank>.held`` and waits until ``<folder>/<replica>.release<step>`` exists (so a
  restarting group can catch up with it); step 0 holds before the first step of this process,
  before its first quorum (so that groups started together meet in their first quorum: a group
  that asks while the other is not yet alive gets a quorum of its own).
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import torch
from torch.distributed.tensor import DTensor

from titan_dmuon.config_registry import llama3_debugmodel_dmuon_ft  # noqa: F401 (TorchTitan's --config)
from titan_dmuon.integration.distributed.fault_tolerance import DMuonFaultTolerantTrainer

_RECORD = os.environ.get("FT_TEST_RECORD")
_PAUSE = os.environ.get("FT_TEST_PAUSE")
_HOLD = os.environ.get("FT_TEST_HOLD")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().contiguous()


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for name, tensor in tensors:
        t = _local(tensor)
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def _state(trainer) -> dict:
    weights = [(n, p) for part in trainer.model_parts for n, p in sorted(part.named_parameters())]
    state, lrs = [], []
    for optim in trainer.optimizers.optimizers:
        for group in optim.param_groups:
            lrs.append(group["lr"])
            for name, p in zip(group["param_names"], group["params"]):
                state += [(f"{name}.{k}", v) for k, v in sorted(optim.state.get(p, {}).items()) if torch.is_tensor(v)]
    ft = trainer.ft_manager
    held = sum(_local(p).numel() for _, p in weights if p.requires_grad)  # (owners' full weights, FSDP2's shards)
    return {
        "step": trainer.step,
        "held": held,
        "commits": ft.manager.current_step() if ft.enabled else None,
        "weights": _digest(weights),
        "state": _digest(state),
        "lrs": lrs,
        "time": time.time(),
    }


def _path(trainer, suffix: str) -> str:
    return os.path.join(_RECORD, f"{trainer.config.fault_tolerance.replica_id}_{os.environ.get('RANK', '0')}{suffix}")


def _pause(trainer) -> None:
    with open(_path(trainer, ".paused"), "w") as f:
        f.write(f"{os.getpid()} {time.time()}")
    time.sleep(3600)  # (the test kills the group; bounded in case it does not)


def _hold(trainer, step: int) -> None:
    with open(_path(trainer, ".held"), "w") as f:
        f.write(f"{os.getpid()} {time.time()}")
    release = os.path.join(_RECORD, f"{trainer.config.fault_tolerance.replica_id}.release{step}")
    deadline = time.monotonic() + 900
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.1)


if _RECORD is not None:
    _when, _, _at = (_PAUSE or "none:0").partition(":")
    _train_step, _forward_backward = (
        DMuonFaultTolerantTrainer.train_step,
        DMuonFaultTolerantTrainer.forward_backward_step,
    )

    _holds = {int(step) for step in _HOLD.split(",")} if _HOLD else set()

    def _recorded_train_step(self, data_iterator):
        if 0 in _holds and not getattr(self, "_ft_test_started", False):
            self._ft_test_started = True
            _hold(self, 0)
        out = _train_step(self, data_iterator)
        with open(_path(self, ".jsonl"), "a") as f:
            f.write(json.dumps(_state(self)) + "\n")
        if _when == "end" and self.step == int(_at):
            _pause(self)
        if self.step in _holds:
            _hold(self, self.step)
        return out

    def _paused_forward_backward(self, **kwargs):
        if _when == "mid" and self.step == int(_at):
            _pause(self)
        return _forward_backward(self, **kwargs)

    DMuonFaultTolerantTrainer.train_step = _recorded_train_step
    DMuonFaultTolerantTrainer.forward_backward_step = _paused_forward_backward
