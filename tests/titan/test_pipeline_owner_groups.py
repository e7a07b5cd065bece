"""Owner groups under a real pipeline schedule (test_pipeline.py's harness: TorchTitan's pipeline_llm and
schedule, PP 2 x FSDP 2 on 4 gloo ranks). A tiny llama3 whose MLP is 16 times its width: each layer's w1, w2
and w3 dominate its Newton–Schulz, three on two data-parallel ranks, so the plan (every figure given:
TINY_GROUPS) splits them over owner groups of both. Interleaved1F1B puts the token embedding alone in a
stage (no Muon target: it joins the owner groups' process groups, ``join_owner_groups``) and two stages on
each rank (each plan counts the earlier stage's load)."""

import re

import pytest
import torch

from tests.support import titan_harness as th  # noqa: I001 (enables the CPU accommodations first)
from tests.support.helpers import ADAMW, MUON, reference_train
from tests.support.owner_groups_parts import ADAMW_EPS, GROUP_RATIO, TINY_GROUPS
from tests.support.titan_outputs import handles_of, pp_weights
from titan_dmuon.integration.names import DEFAULT_MUON_PARAMS

LAYERS = 2
STEPS = 3
LOCAL_BATCH = 4  # per data-parallel rank (2 of them): 4 micro-batches of one sample per step
OPTIONS = dict(lr=MUON["lr"], adamw_lr=ADAMW["adamw_lr"], **ADAMW_EPS)  # (the rest: DMuon's defaults, MUON's)
# The sibling's bound (test_pipeline.py: the same job without pipelining differs by 1.5e-3 after 3 steps on
# the attention output projections, the gradients summed in another order and bf16 Newton–Schulz amplifying
# it; bound 3e-3), the group's Newton–Schulz rounding up to GROUP_RATIO times as far from exact arithmetic
# as one owner's on the grouped weights (tests/support/owner_groups_parts.py). A dropped or doubled block
# moves a weight by lr 0.02 per step.
BOUND = 3e-3 * (GROUP_RATIO + 1) / 2


def _model():
    return th.tiny_llama3(fuse_qkv=False, n_layers=LAYERS, hidden_dim=1024)


def _tokens():
    return th.batches(STEPS, 1, batch=2 * LOCAL_BATCH)


def _pipelined(rank, world, state, groups):
    dims = th.pp_dims(world)
    built = th.build_pp(
        _model(),
        dims,
        schedule="Interleaved1F1B",
        local_batch=LOCAL_BATCH,
        state=state,
        param_dtype="float32",
        owner_groups=groups,
        **OPTIONS,
    )
    _, parts, _, _, _ = built
    handles = handles_of(parts)
    norms = []
    losses = th.train_pp(dims, built, _tokens(), norms=norms)
    return {
        "losses": losses,
        "norms": norms,
        "weights": pp_weights(parts),
        "stages": len(parts),
        "handles": len(handles),
        "groups": sorted((e.fqn, e.group.size) for h in handles for e in h.plan.entries if e.group is not None),
    }


def _reference(state):
    """torch.optim.Muon on the Muon targets + AdamW on the rest, one process, the same global batches and
    start (2 slices: the data-parallel ranks' halves), clipped as the pipelined job clips (max_norm 1)."""
    model_config, _ = _model()
    th.cpu.use_sdpa_attention(model_config)
    with torch.device("meta"):
        model = model_config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # (the buffers: rotary embedding's, not in the state dict)
    model.load_state_dict(state)

    def targets(m):
        return [p for n, p in m.named_parameters() if any(re.search(r, "." + n) for r in DEFAULT_MUON_PARAMS)]

    data = [(t[:, :-1], t[:, 1:]) for t in _tokens()]
    return reference_train(model, data, max_norm=1.0, targets_fn=targets, adamw={**ADAMW, **ADAMW_EPS}, slices=2)


def test_owner_groups_under_interleaved_1f1b_train_as_torch_muon(pool4):
    """Each stage with a layer splits its dominant MLP weights over owner groups of its 2 FSDP ranks (on both
    pipeline ranks: the plans have groups, of MLP weights only), and the job trains as single-process
    torch.optim.Muon + AdamW on the same global batches: the weights after 3 steps within BOUND; the losses
    to 1e-4 and the gradient norms to 1e-3 relative as test_pipeline.py's, the first step's norm (the same
    weights: exact but for the order of the sums) to 1e-5. Planted: members that skip the Gram sums (each
    orthogonalising its block alone) end 1.3e-2 off, 3x BOUND."""
    state = th.initial_state(_model())
    results = pool4.run(_pipelined, state, TINY_GROUPS)
    reference, ref_losses, ref_norms = _reference(state)
    weights = {}
    for r in results:
        assert (r["stages"], r["handles"]) == (2, 1)  # (the embedding's and the head's stages have no handle)
        assert r["groups"] and all(size == 2 and ".feed_forward.w" in fqn for fqn, size in r["groups"]), r["groups"]
        weights.update(r["weights"])
    assert weights.keys() == reference.keys()
    diff = max((weights[k] - reference[k]).abs().max().item() for k in weights)
    assert diff <= BOUND, diff
    last_stage = [r for r in results if r["losses"][0] is not None]
    assert len(last_stage) == 2 and all(r["losses"] == pytest.approx(ref_losses, rel=1e-4) for r in last_stage)
    for r in results:
        assert r["norms"] == pytest.approx(ref_norms, rel=1e-3) and r["norms"][0] == pytest.approx(
            ref_norms[0], rel=1e-5
        )
