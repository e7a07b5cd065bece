"""``runtime/hooks.py``: ``StepHooks`` on a tiny model dedicated at world size 1 on the fake process
group (no collective is issued: every value is this process's own), without a handle, FSDP2 or an
optimizer. The hooks give the owners the gradients plain autograd gives, reduce each layer while the
layers before it are still in backward, leave the model as it was after backward and after an
evaluation forward, and name a layer whose gradient never comes."""

import copy

import pytest
import torch
from torch import nn

from tests.support.runtime_parts import fake_pg, runtime_parts

# The dedicated layers compute on views of one packed fp32 buffer holding copies of the weights: the
# same math as plain autograd, but a kernel may take another path for a view at an offset: equal up to
# fp32 rounding of these 8-wide sums.
TOLERANCE = 1e-6


class _Tiny(nn.Module):
    """An input projection (not dedicated), then three dedicated layers; ``events`` records each layer
    output's gradient as backward reaches it; ``loss_from``: the layer whose output is the loss
    (None: the input projection's, so no layer's gradient comes)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 8, bias=False)
        self.layers = nn.ModuleList([nn.Linear(8, 8, bias=False) for _ in range(3)])
        self.events: list | None = None
        self.loss_from: int | None = 2

    def forward(self, x):
        h = self.embed(x)
        loss = h.sum() if self.loss_from is None else None
        for i, layer in enumerate(self.layers):
            h = torch.tanh(layer(h))
            if self.events is not None and h.requires_grad:
                h.register_hook(lambda grad, i=i: self.events.append(("grad", f"layers.{i}")))
            if i == self.loss_from:
                loss = h.sum()
        return loss


def _hooked(model, *, reshard=True, followed=None):
    from titan_dmuon.runtime.hooks import StepHooks

    parts = runtime_parts(
        1, model=model, params=[layer.weight for layer in model.layers], allocate=False, reshard=reshard
    )
    hooks = StepHooks(
        module=model,
        ctx=parts.ctx,
        members=parts.dedication.members,
        param_dtype=None,
        follow_params=(lambda: followed.append("followed")) if followed is not None else (lambda: None),
    )
    return parts, hooks


def _record_reduces(ctx, events):
    real_reduce, real_finish = ctx.reducer.reduce, ctx.reducer.finish
    ctx.reducer.reduce = lambda unit: (events.append(("reduce", unit.name)), real_reduce(unit))[1]
    ctx.reducer.finish = lambda: (events.append(("finish",)), real_finish())[1]


def _step(reshard):
    model = _Tiny()
    reference = copy.deepcopy(model)
    followed = []
    parts, hooks = _hooked(model, reshard=reshard, followed=followed)
    x = torch.randn(4, 8)
    out = {"before": hooks.initialized}
    model.events, events = [], []
    _record_reduces(parts.ctx, events)
    for step in range(2):  # the first records the order of the layers, the second follows it
        events.clear()
        model.events = events
        model(x).backward()
        reference(x).backward()
        out[f"close{step}"] = all(
            torch.allclose(a.grad, b.grad, rtol=TOLERANCE, atol=TOLERANCE)
            for a, b in zip(model.parameters(), reference.parameters())
        )
        for p in (*model.parameters(), *reference.parameters()):
            p.grad = None
    out["events"] = list(events)
    out["registered"] = all(
        layer._parameters["weight"] is m.param
        for layer, m in zip(model.layers, sorted(parts.dedication.members, key=lambda m: m.fqn))
    )
    out["buffer_bytes"] = parts.ctx.buffer_bytes
    out["followed"] = followed
    out["order"] = [u.name for u in parts.ctx.forward_order]
    with torch.no_grad():
        model.events = None
        model(x)  # evaluation: each layer's buffer freed as it is done, the weights put back
    out["after_no_grad"] = (
        parts.ctx.buffer_bytes,
        [u.phase.value for u in parts.units],
        all(layer._parameters["weight"] is layer.weight for layer in model.layers),
    )
    return out


def _step_job(rank, world, reshard):
    with fake_pg(1):
        return _step(reshard)


@pytest.mark.parametrize("reshard", [True, False])
def test_the_hooks_give_owners_autograds_gradients_and_leave_the_model_as_it_was(solo, reshard):
    """Z3 and Z2 at world size 1: the owners' gradients are plain autograd's (two steps: recording
    the order, then following it); each layer is reduced as soon as its inputs' gradient is computed
    (before backward reaches the layer below it), the reducer finishes once at the end; the registered
    parameters are back and no buffer is left after backward and after an evaluation forward. The
    lazy init follows replaced parameters once, at the first forward."""
    out = solo.run(_step_job, reshard)[0]
    assert out["before"] is False and out["followed"] == ["followed"]
    assert out["close0"] and out["close1"]
    assert out["order"] == ["layers.0", "layers.1", "layers.2"]
    assert out["events"] == [
        ("grad", "layers.2"),
        ("reduce", "layers.2"),
        ("grad", "layers.1"),
        ("reduce", "layers.1"),
        ("grad", "layers.0"),
        ("reduce", "layers.0"),
        ("finish",),
    ]
    assert out["registered"] and out["buffer_bytes"] == 0
    assert out["after_no_grad"] == (0, ["idle", "idle", "idle"], True)


def _failures():
    out = {}
    model = _Tiny()
    model.loss_from = None  # no layer's output reaches the loss
    _hooked(model)
    try:
        model(torch.randn(4, 8)).backward()
    except RuntimeError as e:
        out["unreached"] = str(e)
    with torch.device("meta"):
        on_meta = _Tiny()
    _hooked(on_meta)
    try:
        on_meta(torch.randn(4, 8, device="meta"))
    except RuntimeError as e:
        out["meta"] = str(e)
    model = _Tiny()
    parts, hooks = _hooked(model)
    hooks.remove()
    events = []
    _record_reduces(parts.ctx, events)
    model(torch.randn(4, 8)).backward()
    out["removed"] = (events, parts.ctx.forward_order, all(layer.weight.grad is not None for layer in model.layers))
    return out


def _failures_job(rank, world):
    with fake_pg(1):
        return _failures()


def test_the_hooks_name_a_layer_without_gradient_refuse_meta_weights_and_come_off(solo):
    """The end-of-backward callback names a layer that ran forward but got no gradient (every rank
    must reduce every layer, or the peers hang); the first forward refuses weights still on the meta
    device; after ``remove()`` a step is plain PyTorch (no reduce, no order recorded)."""
    out = solo.run(_failures_job)[0]
    assert "layer 'layers.2' ran forward but got no gradient in this backward pass" in out["unreached"]
    assert "dedicated parameter 'layers.0.weight' is still on the meta device" in out["meta"]
    assert out["removed"] == ([], [], True)
