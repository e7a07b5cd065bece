"""The toy jobs' training and state, as the checkpoint tests of the toy model compare them
(tests/titan/test_checkpoint.py, test_owner_groups_checkpoint.py, test_variants_checkpoint.py): a job resumed from a
checkpoint against the same job straight."""

import torch
from torch.distributed.tensor import DTensor

from tests.support.helpers import batches, full_state, local_slice
from titan_dmuon.testing.toy_model import loss_fn

STEPS = 6  # each job's steps (its learning-rate schedule's length)


def train_until(setup, schedule, counter, rank, world, until):
    data = batches(STEPS)
    losses = []
    while counter.step < until:
        x, y = local_slice(data[counter.step], rank, world)
        loss = loss_fn(setup.module(x), y)
        loss.backward()
        setup.opt.step()
        schedule.step()
        setup.opt.zero_grad()
        counter.step += 1
        losses.append(loss.item())
    return losses


def training_state(setup) -> dict[str, torch.Tensor]:
    """Weights, Muon momentum (from its owner) and AdamW moments, in full, keyed by name."""
    out = {f"weight/{k}": v for k, v in full_state(setup).items()}
    names = {id(p): n for n, p in setup.model.named_parameters()}
    for opt in setup.opt.optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                for key, value in opt.state.get(p, {}).items():
                    if isinstance(value, DTensor):
                        value = value.full_tensor()
                    if key == "momentum_buffer" or value.ndim > 0:
                        out[f"{key}/{names[id(p)]}"] = value.detach().clone()
    return out
