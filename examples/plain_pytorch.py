"""DMuon from plain PyTorch (no TorchTitan): a toy transformer on FSDP2, HSDP or DDP.

    torchrun --nproc_per_node 2 examples/plain_pytorch.py --mode z3
    torchrun --nproc_per_node 4 examples/plain_pytorch.py --mode hsdp

Runs on CPU (gloo) or GPU (NCCL). Prints the loss and, per step, the
communication the ledger counted next to the design's theory.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from titan_dmuon import CommLedger, DMuon, clip_grad_norm_, dedicate_params, wrap_ddp
from titan_dmuon.plan.cost_model import design_elements_per_rank
from titan_dmuon.testing.toy_model import ToyConfig, ToyTransformer, loss_fn, muon_targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["z2", "z3", "hsdp", "ddp"], default="z3")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if args.mode == "hsdp":
        mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        mesh = init_device_mesh(device.type, (world,))

    torch.manual_seed(0)  # the same initial weights on every rank
    model = ToyTransformer(ToyConfig(dim=64, hidden_dim=128, n_layers=4, vocab_size=128)).to(device)

    # 1. give every attention/MLP projection one owner, BEFORE fully_shard / DDP
    z3 = args.mode != "z2" and args.mode != "ddp"
    handle = dedicate_params(model, muon_targets(model), mesh, reshard_after_forward=z3)
    # 2. the rest of the model: FSDP2 (ignoring dedicated weights) or DDP
    if args.mode == "ddp":
        module = wrap_ddp(model, handle)
    else:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, ignored_params=handle.ignored_params, reshard_after_forward=z3)
        fully_shard(model, mesh=mesh, ignored_params=handle.ignored_params, reshard_after_forward=z3)
        module = model
    # 3. one optimizer: Muon on dedicated weights (owners only), AdamW on the rest
    opt = DMuon(model.parameters(), dedicated=handle, lr=0.02, adamw_lr=3e-3)

    if rank == 0:
        print(handle.plan.describe())
    generator = torch.Generator().manual_seed(1 + rank)  # each rank its own data
    replicate = mesh.size(0) if args.mode == "hsdp" else 1
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, 128, (4, 33), generator=generator).to(device)
        tokens[:, 1::2] = tokens[:, 0:-1:2]  # a learnable pattern: every odd token repeats the previous
        with CommLedger() as ledger:
            loss = loss_fn(module(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
            norm = clip_grad_norm_(model.parameters(), max_norm=1.0, dedicated=handle)
            opt.step()
            opt.zero_grad()
        dmuon = ledger.mean_over_ranks(mesh_group(mesh), source="dmuon")
        theory = design_elements_per_rank(handle)  # (Z3 counts the kept last layer from step 2 on)
        loss_avg = loss.detach().clone()
        dist.all_reduce(loss_avg)
        if rank == 0:
            note = "  (+ the one-time HSDP replica sync)" if step == 1 and replicate > 1 else ""
            print(
                f"step {step:3d}  loss {loss_avg.item() / world:.4f}  grad_norm {norm.item():.3f}  "
                f"dmuon elements/rank {float(dmuon):,.0f}  theory {float(theory):,.0f}{note}"
            )
    dist.destroy_process_group()


def mesh_group(mesh):
    return dist.group.WORLD if mesh.ndim == 2 else mesh.get_group()


if __name__ == "__main__":
    main()
