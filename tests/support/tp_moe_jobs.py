"""TorchTitan's MoE models under tensor parallelism, one job per call on a worker pool: what
tests/titan/test_tensor_parallel_moe.py compares between layouts and benchmarks/tp_moe_hsdp.py tabulates."""

import contextlib

import torch

from tests.support import titan_harness as th
from tests.support.helpers import full_parameters

STEPS = 3


MUON_WEIGHTS = (
    "wqkv.weight",
    "wo.weight",
    "wq_a.weight",
    "wq_b.weight",
    "wkv_a.weight",
    "wkv_b.weight",
    "w1.weight",
    "w2.weight",
    "w3.weight",
    "gate.weight",
    "w1_EFD",
    "w2_EDF",
    "w3_EFD",
)


QWEN3_EXPERTS = 8


DEEPSEEK_EXPERTS = 2


def tp_moe_model(family: str, experts: int):
    if family == "qwen3":
        config, spec = th.tiny_qwen3_moe(experts=experts)
    else:
        config, spec = th.tiny_deepseek_v3(experts=experts, q_lora_rank=16)
    for layer in config.layers:
        if getattr(layer, "moe", None) is not None:
            layer.moe.router._debug_force_load_balance = True
    return config, spec


def train_tp_moe(
    rank, world, family, experts, state, tp, ep=1, options=None, steps=STEPS, optimizer="dmuon", replicate=1
):
    from titan_dmuon.plan.cost_model import design_elements_per_rank

    dims = th.parallel_dims(world, tp=tp, ep=ep, replicate=replicate)
    kwargs = {"ns_mode": "exact", **(options or {})} if optimizer == "dmuon" else {}
    model, container = th.build(
        tp_moe_model(family, experts), dims, optimizer=optimizer, state=state, lr=0.02, param_dtype="float32", **kwargs
    )
    data = th.batches(steps, 1, batch=8)
    norms = []
    if optimizer != "dmuon":
        return {"losses": th.train(model, container, dims, data, norms=norms), "norms": norms}
    (handle,) = container.dmuon_optimizers()[0].dedicated_handles()
    with _exact_ns_calls() as exact_ns:
        losses = th.train(model, container, dims, data[:1], norms=norms)
        first_step = dict(container.dmuon_optimizers()[0].last_step_stats)
        handle.pop_comm_stats()
        losses += th.train(model, container, dims, data[1:], norms=norms)
    stats = handle.pop_comm_stats()
    return {
        "losses": losses,
        "norms": norms,
        "weights": full_parameters(model, handle),
        "exact_ns": exact_ns[0],
        "ns": container.dmuon_optimizers()[0].last_step_stats["ns_matrices"],
        "first_step": first_step,
        "moved": sum(e for e, _, _ in stats.values()) / max(1, steps - 1),
        "labels": {label for label, (e, _, _) in stats.items() if e},
        "design": design_elements_per_rank(handle),
        "local": sorted((e.fqn, e.tp_dim) for e in handle.local_experts),
        "dedicated_3d": sorted((e.fqn, e.tp_dim) for e in handle.plan.entries if len(e.shape) == 3),
        "replicated": sorted(e.fqn for e in handle.plan.entries if e.tp_replicated),
        "momentum": tp_moe_momentum(container, handle, model),
    }


def tp_moe_momentum(container, handle, model) -> dict[str, torch.Tensor]:
    """Every Muon momentum in full by name (a collective): TP shards assembled over TP, experts kept
    in place gathered from their DTensor shards; a replicated weight's from its TP home."""
    from torch.distributed.tensor import DTensor
    from torchtitan.components.checkpointer.utils import canonical_fqn

    names = {id(p): canonical_fqn(n) for n, p in model.named_parameters()}
    out = {}
    for opt in container.dmuon_optimizers():
        for group in opt.param_groups:
            for p in group["params"]:
                member = handle.member_of(p)
                value = opt.state.get(p, {}).get("momentum_buffer")
                if member is not None:
                    if member.entry.tensor_parallel and not member.entry.tp_replicated and member.runs_ns:
                        value = handle.tp_full(member, value)
                elif isinstance(value, DTensor):
                    value = value.full_tensor()
                if value is not None:
                    out[names[id(p)]] = value.detach().clone()
    return out


@contextlib.contextmanager
def _exact_ns_calls():
    """Matrices that went through torch.optim.Muon's own Newton-Schulz (ns_mode="exact")."""
    from torch.optim import _muon

    count, original = [0], _muon._zeropower_via_newtonschulz

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    _muon._zeropower_via_newtonschulz = counted
    try:
        yield count
    finally:
        _muon._zeropower_via_newtonschulz = original


LAYOUTS = {"qwen3": QWEN3_EXPERTS, "deepseek_v3": DEEPSEEK_EXPERTS}
