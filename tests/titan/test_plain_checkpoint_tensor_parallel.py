"""PyTorch's own checkpoint API (get_state_dict/set_state_dict, dcp.save/dcp.load with their defaults) on
TorchTitan's llama3 under tensor parallelism (the toy model's jobs: tests/distributed/test_plain_checkpoint.py)."""

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from tests.support.helpers import assert_states_equal, merge_rank_states
from titan_dmuon.runtime import canonical_fqn

STEPS, SAVED_AT = 4, 2  # as tests/distributed/test_plain_checkpoint.py's jobs


def _tp_job(world, tp, seed):
    """TorchTitan's llama3, tiny, TP-sharded by its spmd_types backend (TP-local plain tensors), with
    DMuon's dedication and optimizer; checkpointed here with PyTorch's API directly, not TorchTitan's."""
    from tests.support import titan_harness as th

    dims = th.parallel_dims(world, tp=tp)
    model, container = th.build(th.tiny_llama3(n_layers=2, fuse_qkv=False), dims, seed=seed, lr=0.02)
    return dims, model, container


def _tp_state(model, container) -> dict[str, torch.Tensor]:
    """Weights and Muon momentum in full (TP shards assembled), Adam moments; by name. Collective."""
    from tests.support.helpers import full_parameters

    (dmuon,) = container.dmuon_optimizers()
    (handle,) = dmuon.dedicated_handles()
    out = {f"weight/{k}": v for k, v in full_parameters(model, handle).items()}
    names = {id(p): canonical_fqn(n) for n, p in model.named_parameters()}
    for opt in container.optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                for key, value in opt.state.get(p, {}).items():
                    member = handle.member_of(p)
                    if key == "momentum_buffer" and member is not None:
                        value = handle.tp_full(member, value)
                    elif isinstance(value, DTensor):
                        value = value.full_tensor()
                    out[f"{key}/{names[id(p)]}"] = value.detach().clone()
    return out


def _tp_train(dims, model, container, start, stop):
    from tests.support import titan_harness as th

    return th.train(model, container, dims, th.batches(STEPS, 1, batch=8)[start:stop])


def _tp_straight_and_resumed(rank, world, folder):
    dims, model, container = _tp_job(world, 2, seed=0)
    losses = _tp_train(dims, model, container, 0, SAVED_AT)
    model_state, optim_state = get_state_dict(model, container.optimizers)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
    saved = _tp_state(model, container)
    losses += _tp_train(dims, model, container, SAVED_AT, STEPS)
    straight = _tp_state(model, container)
    dims, model, container = _tp_job(world, 2, seed=1)
    model_state, optim_state = get_state_dict(model, container.optimizers)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
    set_state_dict(model, container.optimizers, model_state_dict=model_state, optim_state_dict=optim_state)
    resumed = _tp_train(dims, model, container, SAVED_AT, STEPS)
    return saved, (losses, straight), (resumed, _tp_state(model, container))


def _tp_into_fsdp(rank, world, folder):
    dims, model, container = _tp_job(world, 1, seed=1)
    model_state, optim_state = get_state_dict(model, container.optimizers)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
    set_state_dict(model, container.optimizers, model_state_dict=model_state, optim_state_dict=optim_state)
    return _tp_state(model, container)


def test_tensor_parallel_resumes_and_reshards_with_the_defaults(pool2, tmp_path):
    """TP 2: each dedicated weight and its momentum saved as a DTensor of the full matrix on the TP mesh;
    a new TP job resumes bit for bit, and FSDP 2 without TP loads every weight and momentum as saved."""
    results = pool2.run(_tp_straight_and_resumed, str(tmp_path))
    for _, (losses, _), (resumed, _) in results:
        assert resumed == losses[SAVED_AT:]
    assert_states_equal(merge_rank_states(r[2][1] for r in results), merge_rank_states(r[1][1] for r in results))
    saved = merge_rank_states(r[0] for r in results)
    loaded = merge_rank_states(pool2.run(_tp_into_fsdp, str(tmp_path)))
    shared = {k for k in saved if not k.startswith("step/")}
    assert any(k.startswith("momentum_buffer/") for k in shared)
    assert_states_equal({k: loaded[k] for k in shared}, {k: saved[k] for k in shared})
