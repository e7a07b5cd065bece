"""Building blocks shared by the multi-process tests: models, parallel setups, references."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from titan_dmuon import DMuon, dedicate_params, wrap_ddp
from titan_dmuon.runtime import canonical_fqn
from titan_dmuon.toy_model import ToyConfig, ToyTransformer, loss_fn, muon_targets, qkv_splits

MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
ADAMW = dict(adamw_lr=1e-2, adamw_betas=(0.9, 0.95), adamw_eps=1e-8, adamw_weight_decay=0.1)
# Reference vs distributed: gradients are summed in another order, and bf16
# Newton-Schulz can turn a last-bit difference into ~1 bf16 ulp of the update
# (2^-8 relative = 4e-3 * lr 0.02 ~ 1e-4 per step). Observed: <= 2e-4 over 5
# steps; broken variants (wrong owner, shard-only NS, wrong scale) are >= 1e-2 off.
TOLERANCE = 1e-3


def toy_model(seed: int = 0, **overrides) -> ToyTransformer:
    torch.manual_seed(seed)
    return ToyTransformer(ToyConfig(**overrides))


def batches(steps: int, global_batch: int = 8, seq: int = 8, vocab: int = 64, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, vocab, (global_batch, seq), generator=g), torch.randint(0, vocab, (global_batch, seq), generator=g))
        for _ in range(steps)
    ]


def local_slice(batch, rank: int, world: int):
    x, y = batch
    b = x.shape[0] // world
    return x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]


@dataclass
class Setup:
    """A model made distributed one way, with its DMuon optimizer."""

    module: nn.Module  # what to call for forward (may be a DDP wrapper)
    model: nn.Module  # the underlying model
    handle: object
    opt: DMuon
    mesh: object
    extra: dict = field(default_factory=dict)


def make_mesh(mode: str, world: int):
    if mode == "hsdp":
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    return init_device_mesh("cpu", (world,))


def distribute(
    model: nn.Module,
    mode: str,
    world: int,
    *,
    mesh=None,
    mp_policy: MixedPrecisionPolicy | None = None,
    fsdp_reshard: bool | None = None,
    split: bool = False,
    opt_kwargs: dict | None = None,
    targets_fn=muon_targets,
    **dedicate_kwargs,
) -> Setup:
    """mode: "z2" | "z3" (FSDP2), "hsdp" (2 x world/2, Z3), "ddp"."""
    mesh = mesh if mesh is not None else make_mesh(mode, world)
    reshard = mode != "z2" if "reshard_after_forward" not in dedicate_kwargs else dedicate_kwargs.pop("reshard_after_forward")
    if mode == "ddp":
        reshard = False
    handle = dedicate_params(
        model,
        targets_fn(model),
        mesh,
        reshard_after_forward=reshard,
        mp_policy=mp_policy,
        split_rows=qkv_splits(model) if split else None,
        **dedicate_kwargs,
    )
    module = model
    if mode == "ddp":
        module = _fake_pg_safe(wrap_ddp(model, handle))
    else:
        fsdp_reshard = reshard if fsdp_reshard is None else fsdp_reshard
        kw = dict(mesh=mesh, ignored_params=handle.ignored_params, reshard_after_forward=fsdp_reshard)
        if mp_policy is not None:
            kw["mp_policy"] = mp_policy
        for layer in model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
    opt = DMuon(model.parameters(), **{**MUON, **ADAMW, **(opt_kwargs or {})})
    return Setup(module=module, model=model, handle=handle, opt=opt, mesh=mesh)


def _fake_pg_safe(ddp):
    """On the fake process group DDP's default hook reads a future value that is None;
    this hook issues the same one all-reduce per bucket and returns the buffer itself."""
    if dist.get_backend() == "fake":

        def hook(group, bucket):
            buffer = bucket.buffer()
            return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda _: buffer)

        ddp.register_comm_hook(ddp.process_group, hook)
    return ddp


class _Both:
    """Two optimizers stepped together (a baseline's Muon + AdamW)."""

    def __init__(self, *opts):
        self.opts = opts

    def step(self):
        for o in self.opts:
            o.step()

    def zero_grad(self):
        for o in self.opts:
            o.zero_grad()


def baseline(model: nn.Module, kind: str, world: int, *, mesh=None, reshard: bool = True) -> Setup:
    """kind: "fsdp_adamw" (FSDP2 + AdamW everywhere), "naive" (FSDP2 + Muon with a
    full-gradient all-gather in step), "ddp_muon" (DDP all-reduce + torch.optim.Muon)."""
    from torch.nn.parallel import DistributedDataParallel

    from titan_dmuon import NaiveFSDPMuon

    mesh = mesh if mesh is not None else make_mesh("z3", world)
    targets = muon_targets(model)
    module = model
    if kind == "ddp_muon":
        module = _fake_pg_safe(DistributedDataParallel(model, process_group=mesh.get_group()))
        ids = {id(p) for p in targets}
        opt = _Both(
            torch.optim.Muon(targets, **MUON),
            torch.optim.AdamW([p for p in model.parameters() if id(p) not in ids], lr=ADAMW["adamw_lr"]),
        )
    else:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        if kind == "fsdp_adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=ADAMW["adamw_lr"])
        elif kind == "naive":
            opt = NaiveFSDPMuon(model.parameters(), muon_params=muon_targets(model), **MUON, **ADAMW)
        else:
            raise ValueError(kind)
    return Setup(module=module, model=model, handle=None, opt=opt, mesh=mesh)


def train(setup: Setup, data, rank: int, world: int, *, steps: int | None = None, max_norm=None, accumulate: int = 1):
    """Returns per-step (local loss, clip norm or None, NS matrices on this rank)."""
    from titan_dmuon import clip_grad_norm_

    out = []
    for batch in data[: steps or len(data)]:
        x, y = local_slice(batch, rank, world)
        loss_total = 0.0
        for xs, ys in zip(x.chunk(accumulate), y.chunk(accumulate)):
            loss = loss_fn(setup.module(xs), ys) / accumulate
            loss.backward()
            loss_total += loss.item()
        norm = clip_grad_norm_(setup.model.parameters(), max_norm) if max_norm else None
        setup.opt.step()
        ns = getattr(setup.opt, "last_step_stats", {}).get("ns_matrices")
        setup.opt.zero_grad()
        out.append((loss_total, None if norm is None else norm.item(), ns))
    return out


def full_state(setup: Setup) -> dict[str, torch.Tensor]:
    """Every parameter in full on every rank (collective)."""
    dedicated = setup.handle.full_tensors() if setup.handle is not None else {}
    out = {}
    for name, p in setup.model.named_parameters():
        name = canonical_fqn(name)
        if name in dedicated:
            out[name] = dedicated[name]
        elif isinstance(p, DTensor):
            out[name] = p.full_tensor().detach()
        else:
            out[name] = p.detach().clone()
    return out


def reference_train(model: nn.Module, data, *, max_norm=None, muon=MUON, adamw=ADAMW, targets_fn=muon_targets):
    """Single process: torch.optim.Muon on the targets, torch.optim.AdamW on the rest."""
    model = copy.deepcopy(model)
    targets = targets_fn(model)
    ids = {id(p) for p in targets}
    others = [p for p in model.parameters() if id(p) not in ids]
    opt_muon = torch.optim.Muon(targets, **muon)
    opt_adamw = torch.optim.AdamW(
        others, lr=adamw["adamw_lr"], betas=adamw["adamw_betas"], eps=adamw["adamw_eps"], weight_decay=adamw["adamw_weight_decay"]
    )
    losses, norms = [], []
    for x, y in data:
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.item())
        if max_norm:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt_muon.step()
        opt_adamw.step()
        opt_muon.zero_grad()
        opt_adamw.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses, norms


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a.keys() ^ b.keys()))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def global_loss(local_losses: list[float], group=None) -> list[float]:
    t = torch.tensor(local_losses, dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return (t / dist.get_world_size(group)).tolist()
