"""MoE checkpoints: TorchTitan's qwen3 MoE under DMuon through TorchTitan's CheckpointManager.

The model is tests/titan_harness.py's tiny qwen3 MoE: the same model classes, parallelize_fn
(with DMuon's dedication), state-dict hooks and checkpoint code as the shipped ``moe_debug``
config, with small dimensions, because the shipped one costs 15-30 s per step on 2 CPU cores.
Resuming happens in NEW processes (the pool is restarted between save and load).
"""

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests import titan_harness as th  # noqa: I001 (enables the CPU accommodations first)

from torchtitan.components.checkpointer.utils import canonical_fqn  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer  # noqa: E402

from titan_dmuon.integration.checkpoint import DMuonCheckpointManager  # noqa: E402

STEPS = 4
EXPERT_WEIGHTS = ("w1_EFD", "w2_EDF", "w3_EFD")


class _Counter:
    """Stands in for TorchTitan's train state and dataloader (both Stateful)."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


class _Job:
    """A tiny qwen3 MoE made distributed as the trainer does, with its DMuon container, LR
    schedule and checkpoint manager (``hf``: the last save is model-only in HF safetensors,
    through the model's own TorchTitan state-dict adapter)."""

    def __init__(self, world, experts, folder, *, hf=False):
        self.dims = th.parallel_dims(world)
        config, spec = th.tiny_qwen3_moe(experts=experts)
        self.model, self.container = th.build((config, spec), self.dims, lr=0.02)
        self.schedule = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=self.container, training_steps=STEPS)
        self.counter = _Counter()
        self.adapter = spec.state_dict_adapter(config, None) if hf else None
        manager_config = DMuonCheckpointManager.Config(
            enable=True, folder="ckpt", interval=1, last_save_model_only=hf, last_save_in_hf=hf
        )
        self.manager = manager_config.build(
            dataloader=_Counter(), model_parts=[self.model], optimizers=self.container, lr_schedulers=self.schedule,
            states={"train_state": self.counter}, sd_adapter=self.adapter, base_folder=folder,
        )
        self.data = th.batches(STEPS, world)

    def train(self, until):
        losses = []
        while self.counter.step < until:
            losses += th.train(self.model, self.container, self.dims, [self.data[self.counter.step]])
            self.schedule.step()
            self.counter.step += 1
        return losses

    def handle(self):
        (handle,) = self.container.dmuon_optimizers()[0].dedicated_handles()
        return handle

    def weights(self):
        """Every parameter and state-dict buffer in full, by canonical name (collective)."""
        dedicated = self.handle().full_tensors()
        out = {}
        for name, p in self.model.named_parameters():
            name = canonical_fqn(name)
            if name in dedicated:
                out[name] = dedicated[name]
            elif isinstance(p, DTensor):
                out[name] = p.full_tensor().detach()
            else:
                out[name] = p.detach().clone()
        persistent = set(self.model.state_dict())
        for name, b in self.model.named_buffers():
            if name in persistent:
                out[canonical_fqn(name)] = b.full_tensor() if isinstance(b, DTensor) else b.detach().clone()
        return out

    def state(self):
        """Weights, Muon momentum (experts' too: DTensors when local, the owner's plain tensor when
        dedicated) and AdamW moments, in full, keyed by name; merge over ranks with _merge."""
        out = {f"weight/{k}": v for k, v in self.weights().items()}
        names = {id(p): canonical_fqn(n) for n, p in self.model.named_parameters()}
        for opt in self.container.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    for key, value in opt.state.get(p, {}).items():
                        if isinstance(value, DTensor):
                            value = value.full_tensor()
                        if key == "momentum_buffer" or value.ndim > 0:
                            out[f"{key}/{names[id(p)]}"] = value.detach().clone()
        return out


def _merge(states):
    merged = {}
    for state in states:
        for key, value in state.items():
            assert key not in merged or torch.equal(merged[key], value), key
            merged[key] = value
    return merged


def _probe(rank, world, experts, folder):
    t = time.perf_counter()
    job = _Job(world, experts, folder)
    built = time.perf_counter() - t
    job.train(2)
    trained = time.perf_counter() - t - built
    job.manager.save(job.counter.step)
    job.manager.close()
    saved = time.perf_counter() - t - built - trained
    s = job.state()
    return built, trained, saved, sorted(s)


def test_probe(pool2, pool4, tmp_path):
    r = pool2.run(_probe, 8, str(tmp_path / "a"))
    print(r[0][:3], r[0][3])
    r = pool4.run(_probe, 3, str(tmp_path / "b"))
    print(r[0][:3], r[0][3])
