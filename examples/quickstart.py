"""DMuon in three lines on a plain FSDP2 job: a toy transformer learns a repeat pattern.

    torchrun --nproc_per_node 2 examples/quickstart.py

Runs on CPU (gloo) or GPU (NCCL). The three DMuon lines are marked; everything else is the usual
FSDP2 training loop. docs/guides/plain-pytorch.md explains each line and shows what it prints.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import titan_dmuon as dmuon  # DMuon line 1
from titan_dmuon.testing.toy_model import ToyConfig, ToyTransformer, loss_fn

MUON_WEIGHTS = r"\.(attention|feed_forward)\.w"  # every attention and MLP projection


def train(steps: int = 20) -> list[float]:
    """Train on every rank of the default process group; rank 0 prints each step's mean loss."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))
    torch.manual_seed(0)  # the same initial weights on every rank
    model = ToyTransformer(ToyConfig(dim=64, hidden_dim=128, n_layers=4, vocab_size=128)).to(device)

    dmuon.dedicate_params(model, mesh, predicate=MUON_WEIGHTS)  # DMuon line 2: one owner per Muon weight
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.DMuon(model, lr=0.02, adamw_lr=3e-3)  # DMuon line 3: Muon on the owners, AdamW for the rest

    generator = torch.Generator().manual_seed(1 + rank)  # each rank its own data
    losses = []
    for step in range(1, steps + 1):
        tokens = batch(generator).to(device)
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if rank == 0:
            print(f"step {step:2d}  loss {losses[-1]:.4f}")
    return losses


def batch(generator: torch.Generator) -> torch.Tensor:
    """4 sequences of 33 tokens in which every odd token repeats the one before it."""
    tokens = torch.randint(0, 128, (4, 33), generator=generator)
    tokens[:, 1::2] = tokens[:, 0:-1:2]
    return tokens


if __name__ == "__main__":
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    train()
    dist.destroy_process_group()
