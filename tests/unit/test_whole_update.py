"""``optim/whole_update.py``: what runs on an owner for the weights it holds whole, and the same rule split
where tensor parallelism splits a matrix. One process, no process group.

The reference is ``torch.optim.Muon`` on the same weights and gradients. Its rule, per matrix: the
momentum ``buf.lerp_(grad, 1 - momentum)``, Newton–Schulz of ``grad.lerp(buf, momentum)`` (Nesterov) or
of ``buf``, decoupled weight decay, then the update scaled by ``adjusted_lr`` of the matrix's shape.
A weight's row blocks are separate matrices: each block is the reference's own parameter. The exact
mode runs torch.optim.Muon's own functional update, so it matches bit for bit by construction; the
batched mode stacks matrices of one shape into one bf16 Newton–Schulz call, whose kernels round in
another order: a bf16 unit round-off (2^-8) of the update, i.e. of ``adjusted_lr``, per step.
"""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from titan_dmuon.math.update_rules import adjusted_lr, second_moment_shape
from titan_dmuon.optim.whole_update import SECOND_MOMENT, NSFigures, OwnedWeight, OwnerUpdate

GROUP = dict(
    lr=0.02,
    weight_decay=0.1,
    momentum=0.95,
    nesterov=True,
    ns_steps=5,
    ns_coefficients=(3.4445, -4.7750, 2.0315),
    eps=1e-7,
    adjust_lr_fn=None,
    ns_mode="exact",
)
STEPS = 3
SHAPES = [(64, 32), (32, 48), (64, 32)]  # two of one shape: the batched mode stacks them


def _optimizer(**options):
    """What OwnerUpdate reads of DMuon: its state mapping (a defaultdict, as torch.optim.Optimizer's) and the
    job's Newton–Schulz options."""
    return SimpleNamespace(
        state=defaultdict(dict), ns_method="torch", ns_dtype="bfloat16", normuon_beta2=None, **options
    )


def _weights(shapes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in shapes]


def _gradients(shapes, step):
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=generator) for shape in shapes]


def _reference(weights, grads_by_step, group, blocks=None):
    """torch.optim.Muon, each row block of each weight its own parameter (``blocks``: per weight, its
    row ranges; None: whole)."""
    pieces = []
    for i, w in enumerate(weights):
        for start, stop in blocks[i] if blocks else [(0, w.shape[0])]:
            pieces.append((i, start, stop, torch.nn.Parameter(w[start:stop].clone())))
    muon = torch.optim.Muon(
        [p for *_, p in pieces],
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        momentum=group["momentum"],
        nesterov=group["nesterov"],
        ns_steps=group["ns_steps"],
        ns_coefficients=group["ns_coefficients"],
        eps=group["eps"],
        adjust_lr_fn=group["adjust_lr_fn"],
    )
    for grads in grads_by_step:
        for i, start, stop, p in pieces:
            p.grad = grads[i][start:stop].clone()
        muon.step()
    out = [w.clone() for w in weights]
    for i, start, stop, p in pieces:
        out[i][start:stop] = p.detach()
    return out


def _blocks(ranges) -> tuple:
    """Row blocks as a plan writes them: each block a tuple of row ranges (one range each here)."""
    return tuple(((start, stop),) for start, stop in ranges)


def _run(rule, weights, grads_by_step, group, blocks=None):
    for grads in grads_by_step:
        owned = [
            OwnedWeight(param=w, tensor=w, grad=g, blocks=_blocks(blocks[i] if blocks else [(0, w.shape[0])]))
            for i, (w, g) in enumerate(zip(weights, grads))
        ]
        rule.update(group, owned)
    return weights


@pytest.mark.parametrize("nesterov, adjust_lr_fn", [(True, None), (False, "match_rms_adamw")])
def test_exact_mode_is_torch_optim_muon_bit_for_bit(nesterov, adjust_lr_fn):
    group = {**GROUP, "nesterov": nesterov, "adjust_lr_fn": adjust_lr_fn}
    weights = _weights(SHAPES)
    grads = [_gradients(SHAPES, s) for s in range(STEPS)]
    expected = _reference(weights, grads, group)
    got = _run(OwnerUpdate(_optimizer(), NSFigures()), [w.clone() for w in weights], grads, group)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def test_batched_mode_is_torch_optim_muon_within_a_bf16_rounding_per_step():
    """Momentum is the same elementwise arithmetic (bitwise); the weights within STEPS bf16 unit
    round-offs of each matrix's step size (the batched kernels' rounding of the Newton–Schulz output)."""
    group = {**GROUP, "ns_mode": "batched"}
    weights = _weights(SHAPES)
    grads = [_gradients(SHAPES, s) for s in range(STEPS)]
    expected = _reference(weights, grads, group)
    optimizer = _optimizer()
    got = _run(OwnerUpdate(optimizer, NSFigures()), [w.clone() for w in weights], grads, group)
    for g, e, shape in zip(got, expected, SHAPES):
        step = adjusted_lr(group["lr"], group["adjust_lr_fn"], shape)
        assert (g - e).abs().max() <= STEPS * 2.0**-8 * step, shape


def test_row_blocks_are_separate_matrices_and_counted_as_such():
    """A weight's row blocks (the q, k, v of a fused projection) are orthogonalised and scaled each as
    its own weight; ``figures.matrices`` counts Newton–Schulz matrices: one per row block."""
    shapes = [(48, 32), (32, 16)]
    blocks = [[(0, 16), (16, 32), (32, 48)], [(0, 32)]]
    weights = _weights(shapes)
    grads = [_gradients(shapes, s) for s in range(STEPS)]
    expected = _reference(weights, grads, GROUP, blocks=blocks)
    figures = NSFigures()
    got = _run(OwnerUpdate(_optimizer(), figures), [w.clone() for w in weights], grads, GROUP, blocks=blocks)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
    assert figures.matrices == STEPS * sum(len(b) for b in blocks)


def test_a_rank_without_experts_keeps_momentum_state_and_changes_nothing_else():
    """FSDP2 may give a rank none of a stack's experts (an empty tensor): its momentum is still made (every
    rank holds the state's entry), and the other weights update exactly as without it."""
    weights = _weights(SHAPES)
    empty = torch.zeros(0, 64, 32)
    grads = _gradients(SHAPES, 0)
    optimizer = _optimizer()
    rule = OwnerUpdate(optimizer, NSFigures())
    owned = [OwnedWeight(param=w, tensor=w, grad=g, blocks=(((0, w.shape[0]),),)) for w, g in zip(weights, grads)]
    rule.update(GROUP, [OwnedWeight(param=empty, tensor=empty, grad=empty.clone(), blocks=(((0, 64),),)), *owned])
    alone = _run(OwnerUpdate(_optimizer(), NSFigures()), _weights(SHAPES), [grads], GROUP)
    assert optimizer.state[empty]["momentum_buffer"].shape == empty.shape
    for w, a in zip(weights, alone):
        assert torch.equal(w, a)
    nothing = OwnerUpdate(_optimizer(), NSFigures())
    nothing.update(GROUP, [OwnedWeight(param=empty, tensor=empty, grad=empty.clone(), blocks=(((0, 64),),))])
    assert nothing.figures.matrices == 0 and nothing.figures.timer is None  # no Newton–Schulz ran


def test_state_and_options_are_read_from_the_optimizer_each_time():
    """``load_state_dict`` replaces the optimizer's state mapping and a job may change its method
    between steps: the rule reads both at each call, never a copy taken when it was built."""
    optimizer = _optimizer()
    rule = OwnerUpdate(optimizer, NSFigures())
    (weight,) = _weights([(32, 16)])
    first = rule.momentum_buffer(weight)
    assert torch.equal(first, torch.zeros_like(weight)) and optimizer.state[weight]["momentum_buffer"] is first
    loaded = torch.full_like(weight, 0.5)
    optimizer.state = defaultdict(dict, {weight: {"momentum_buffer": loaded}})
    assert rule.state_of(weight) is optimizer.state[weight] and rule.momentum_buffer(weight) is loaded
    optimizer.ns_method, optimizer.ns_dtype, optimizer.normuon_beta2 = "gram", "float16", 0.95
    assert (rule.ns_method, rule.ns_dtype, rule.normuon_beta2) == ("gram", "float16", 0.95)
    assert rule.result_dtype == torch.float16


def test_normuon_keeps_one_second_moment_per_row_made_zero_on_first_use():
    """With NorMuon (``normuon_beta2``) each weight's state gets its second moment: float32, one value per
    row of each Newton–Schulz matrix and column block (``second_moment_shape``), zero before the first
    step; after a step it is (1 - beta2) times the rows' mean square of the orthogonalised update: positive
    (no row of a full-rank orthogonal factor is zero) and at most 1 - beta2 (its entries are at most 1)."""
    beta2 = 0.95
    optimizer = _optimizer()
    optimizer.normuon_beta2 = beta2
    rule = OwnerUpdate(optimizer, NSFigures())
    (weight,) = _weights([(48, 32)])
    shape = second_moment_shape(weight.shape, None)
    made = rule.second_moment(weight, shape)
    assert made.dtype == torch.float32 and tuple(made.shape) == tuple(shape) and not made.any()
    assert optimizer.state[weight][SECOND_MOMENT] is made
    rule.update(
        {**GROUP, "ns_mode": "batched"},
        [OwnedWeight(param=weight, tensor=weight, grad=_gradients([(48, 32)], 0)[0], blocks=(((0, 48),),))],
    )
    moment = optimizer.state[weight][SECOND_MOMENT]
    assert moment is made and (moment > 0).all() and (moment <= 1 - beta2).all()


@pytest.mark.parametrize("tp_dim", [0, 1])
def test_the_rule_split_over_tensor_parallel_shards_is_the_whole_rule(tp_dim):
    """``momentum_inputs`` on each TP rank's shard, ``orthogonalise_fn`` on the assembled matrix at its
    home, ``apply_shards`` on each shard: the same weights as ``update`` on the whole matrix. Momentum,
    decay and the scaled add are elementwise, the Newton–Schulz input is the same bf16 matrix, so the
    only difference is one Newton–Schulz call for a stack of one against one for a matrix: the batched
    mode's bound (a bf16 unit round-off of the step per step) holds."""
    from titan_dmuon.plan.specs import TPMatrix

    tp, rows, cols = 2, 64, 32
    group = {**GROUP, "ns_mode": "batched"}
    (whole,) = _weights([(rows, cols)])
    grads = [_gradients([(rows, cols)], s)[0] for s in range(STEPS)]
    expected = _run(OwnerUpdate(_optimizer(), NSFigures()), [whole.clone()], [[g] for g in grads], group)[0]

    def shard(t, k):
        return t.chunk(tp, dim=tp_dim)[k].clone()

    shards = [shard(whole, k) for k in range(tp)]
    rules = [OwnerUpdate(_optimizer(), NSFigures()) for _ in range(tp)]  # each TP rank's own state
    matrix = [
        TPMatrix(shape=tuple(shards[k].shape), dim=tp_dim, home=0, blocks=(((0, rows),),), col_blocks=(((0, cols),),))
        for k in range(tp)
    ]
    for g in grads:
        inputs = [
            rules[k].momentum_inputs(
                group,
                shards[k],
                shard(g, k),
                slice(0, 1),
                matrix[:1],
                out=torch.empty((1, *shards[k].shape), dtype=torch.bfloat16),
            )[0]
            for k in range(tp)
        ]
        results = []
        rules[0].orthogonalise_fn(group)([torch.cat(inputs, dim=tp_dim)], lambda i, r: results.append(r.clone()))
        (result,) = results
        for k in range(tp):
            rules[k].apply_shards(group, shards[k], [matrix[k]], iter([shard(result, k)]), tp_rank=k)
    got = torch.cat(shards, dim=tp_dim)
    assert (got - expected).abs().max() <= STEPS * 2.0**-8 * adjusted_lr(group["lr"], None, (rows, cols))
    assert not torch.equal(got, whole)  # (it trained)
