"""DMuon against a single-process torch.optim.Muon + torch.optim.AdamW reference,
and the modes against each other.

Tolerance: see helpers.TOLERANCE (gradient sums in another order, amplified by
bf16 Newton-Schulz to at most ~1 bf16 ulp of the update per step).
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from tests.support.helpers import (
    ADAMW,
    MUON,
    TOLERANCE,
    Setup,
    batches,
    bitwise_equal,
    distribute,
    full_state,
    global_loss,
    local_slice,
    make_mesh,
    max_diff,
    reference_train,
    toy_model,
    train,
)
from titan_dmuon import CommLedger, DMuon, clip_grad_norm_, dedicate_params
from titan_dmuon.runtime import CommLabel
from titan_dmuon.testing.toy_model import ToyConfig, ToyTransformer, loss_fn, muon_targets

STEPS = 5


def _vs_reference(rank, world, mode, max_norm=None, accumulate=1, ns_method="torch", slices=1):
    data = batches(STEPS)
    model = toy_model()
    ref, ref_losses, ref_norms = reference_train(model, data, max_norm=max_norm, ns_method=ns_method, slices=slices)
    setup = distribute(model, mode, world, opt_kwargs={"ns_method": ns_method})
    log = train(setup, data, rank, world, max_norm=max_norm, accumulate=accumulate)
    ns_total = torch.tensor([ns for _, _, ns in log], dtype=torch.int64)
    dist.all_reduce(ns_total)
    return {
        "diff": max_diff(full_state(setup), ref),
        "losses": global_loss([loss for loss, _, _ in log]),
        "ref_losses": ref_losses,
        "norms": [norm for _, norm, _ in log],
        "ref_norms": ref_norms,
        "ns_per_step": ns_total.tolist(),
        "matrices": len(setup.handle.plan.entries),
    }


def _check(results, *, clipped=False):
    for r in results:
        assert r["diff"] < TOLERANCE
        assert r["losses"] == pytest.approx(r["ref_losses"], abs=1e-4)
        assert r["losses"][-1] < r["losses"][0]
        # Newton-Schulz ran exactly once per dedicated matrix per step in the whole job
        assert r["ns_per_step"] == [r["matrices"]] * STEPS
        if clipped:
            # the global norm counts every gradient element once, at the right scale: at step 1 (same
            # weights, gradients summed in another order) to 1e-5; later steps see weights that agree
            # to TOLERANCE (bf16 Newton-Schulz rounding, kernel-dependent), so their norms to 1e-3. A
            # gradient counted twice or not at all is off by far more (e.g. sqrt(2)).
            assert r["norms"][0] == pytest.approx(r["ref_norms"][0], rel=1e-5)
            assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-3)
            assert all(n > 0.5 for n in r["ref_norms"])  # clipping was active


@pytest.mark.parametrize("mode", ["ddp", "z2", "z3"])
def test_two_ranks_match_reference(pool2, mode):
    _check(pool2.run(_vs_reference, mode))


@pytest.mark.parametrize("mode", ["z3", "hsdp"])
def test_four_ranks_match_reference(pool4, mode):
    """HSDP 2x2 once deadlocked: the shard->replicate reduce chain was issued "when a
    reduce completed", so ranks interleaved it differently with FSDP2's collectives
    on the shared replicate process group. It is now issued at fixed program points."""
    _check(pool4.run(_vs_reference, mode))


@pytest.mark.parametrize("ns_method", ["polar_express", "gram"])
def test_each_newton_schulz_method_matches_its_reference(pool2, ns_method):
    """torch.optim.Muon with the method's Newton–Schulz written independently (tests.support.helpers.
    reference_newton_schulz) is the reference; the toy model's k/v projections (16 x 32) run Gram
    Newton–Schulz under "gram", its other matrices (ratio <= 1.5) the Polar Express iteration. Every mode
    shares the path the method changes (muon_step's Newton–Schulz), so one mode. The reference sums the
    two ranks' gradients as they do (``slices=2``: bitwise the same gradients), so what remains is the
    batched GEMMs' rounding, within TOLERANCE; Gram Newton–Schulz turns a last-bit gradient difference
    into a larger update difference than the standard iteration (its products of polynomials are rounded
    as one matrix), so the reference's own gradient order (slices=1) would leave ~1e-3."""
    from titan_dmuon.math.ns_methods import uses_gram

    assert uses_gram(16, 32) and not uses_gram(32, 48)
    _check(pool2.run(_vs_reference, "z3", None, 1, ns_method, 2))


def _tensor_lr(rank, world):
    """lr and adamw_lr as 1-element tensors, as torch.optim.Muon and AdamW take them (and an LR scheduler
    updates them in place): the same steps as their values as numbers."""
    data = batches(3)
    runs = []
    for as_tensor in (True, False):
        lr, adamw_lr = torch.tensor(0.02), torch.tensor(1e-2)
        options = {"lr": lr, "adamw_lr": adamw_lr} if as_tensor else {"lr": lr.item(), "adamw_lr": adamw_lr.item()}
        setup = distribute(toy_model(), "z3", world, opt_kwargs=options)
        scheduler = torch.optim.lr_scheduler.LambdaLR(setup.opt, lambda step: 1.0 / (1 + step))
        train(setup, data[:1], rank, world)
        scheduler.step()
        train(setup, data[1:], rank, world)
        runs.append(full_state(setup))
    return bitwise_equal(*runs)


def test_a_tensor_lr_is_its_value(pool2):
    """``DMuon(..., lr=torch.tensor(1e-3))`` raised OptionError ("expected a number >= 0"): DMuonOptions
    checked lr as a Python number only. torch.optim.Muon takes a 1-element tensor (for compiled and
    capturable steps); DMuon now does too, for lr and adamw_lr, and steps with its value."""
    assert all(pool2.run(_tensor_lr))


@pytest.mark.parametrize("mode", ["z3", "ddp"])
def test_clip_grad_norm_matches_reference(pool2, mode):
    _check(pool2.run(_vs_reference, mode, 0.5), clipped=True)


def test_hsdp_clip_grad_norm_matches_reference(pool4):
    _check(pool4.run(_vs_reference, "hsdp", 0.5), clipped=True)


def test_gradient_accumulation_equals_big_batch(pool2):
    """Two micro-batches per step (gradients reduced and summed on the owner each time)."""
    _check(pool2.run(_vs_reference, "z3", None, 2))


def _deferred_sync(rank, world, mode):
    from titan_dmuon.plan.cost_model import design_elements_per_rank

    data = batches(STEPS)
    model = toy_model()
    ref, ref_losses, _ = reference_train(model, data)
    out = {"ref_losses": ref_losses}
    for sync in ("each", "last", "deferred"):
        setup = distribute(copy.deepcopy(model), mode, world, opt_kwargs={"ns_mode": "exact"})
        log = train(setup, data[:1], rank, world, accumulate=4, sync=sync)
        setup.handle.pop_comm_stats()
        log += train(setup, data[1:], rank, world, accumulate=4, sync=sync)
        moved = sum(e for e, _, _ in setup.handle.pop_comm_stats().values()) / (STEPS - 1)
        deferred = sync != "each"
        out[sync] = {
            "state": full_state(setup),
            "losses": global_loss([loss for loss, _, _ in log]),
            "moved": moved,
            "design": design_elements_per_rank(setup.handle, deferred=deferred) * (1 if deferred else 4),
            "held": setup.handle.holds_unreduced_gradients,
        }
        out[sync]["diff"] = max_diff(out[sync]["state"], ref)
    return out


@pytest.mark.parametrize("mode", ["z3", "z2"])
def test_gradient_sync_off_over_micro_batches(pool2, mode):
    """Four micro-batches per step with DMuon's gradient sync on for each ("each"), off until the
    last (FSDP2's accumulation pattern: "last"), or off for all and one reduce_gradients()
    (pipelining's: "deferred"). All train as the big batch (TOLERANCE: gradients summed in
    another order than the reference's). "last" and "deferred" are bitwise equal (exact
    Newton-Schulz): both add the micro-batches' gradients on each rank in the same order, then
    reduce the same sums. With sync off each weight moves once per step, one broadcast and one
    reduce (2(N-1)/N * P_M, Z2 or Z3): in Z2 a quarter of the traffic with sync on for each.

    Regression ("last"): the last backward reduced the accumulated gradients but left each unit
    marked as holding unreduced ones, so the step refused to run; and Z3 freed the weights it had
    kept gathered and broadcast them again for the last backward."""
    for r in pool2.run(_deferred_sync, mode):
        for sync in ("each", "last", "deferred"):
            run = r[sync]
            assert run["diff"] < TOLERANCE, sync
            assert run["losses"] == pytest.approx(r["ref_losses"], abs=1e-4), sync
            assert run["moved"] == run["design"] > 0, (sync, run["moved"], run["design"])
            assert not run["held"]
        assert bitwise_equal(r["last"]["state"], r["deferred"]["state"])
        if mode == "z2":
            assert r["deferred"]["moved"] * 4 == r["each"]["moved"]


# ---- modes against each other ------------------------------------------------------
def _run_mode(rank, world, mode, mesh=None, **kwargs):
    data = batches(STEPS)
    setup = distribute(toy_model(), mode, world, mesh=mesh, **kwargs)
    train(setup, data, rank, world)
    return full_state(setup)


def _z2_vs_z3(rank, world):
    z3 = _run_mode(rank, world, "z3")
    z2 = _run_mode(rank, world, "z2")
    z2_fsdp_z3 = _run_mode(rank, world, "z2", fsdp_reshard=True)
    z3_fsdp_z2 = _run_mode(rank, world, "z3", fsdp_reshard=False)
    return bitwise_equal(z2, z3), bitwise_equal(z2_fsdp_z3, z3), bitwise_equal(z3_fsdp_z2, z3)


def test_z2_and_z3_are_bit_identical(pool2):
    """Same gradients reach the same owners; asymmetric DMuon/FSDP2 settings too."""
    for same, asym1, asym2 in pool2.run(_z2_vs_z3):
        assert same and asym1 and asym2


def _hsdp_vs_shard_only(rank, world):
    hsdp = _run_mode(rank, world, "hsdp")
    flat = _run_mode(rank, world, "z3")
    return bitwise_equal(hsdp, flat), max_diff(hsdp, flat)


def test_hsdp_2x1_and_shard_only_are_bit_identical(pool2):
    """With two contributors a + b is exact in any order, so HSDP (2x1) and 1-D (2) agree bitwise."""
    for same, _ in pool2.run(_hsdp_vs_shard_only):
        assert same


def test_hsdp_2x2_and_shard_only_agree_within_bound(pool4):
    """Four gradients are summed as (g00+g01)+(g10+g11) under HSDP but in gloo's own order
    on a flat group of 4; float addition is not associative, so bitwise equality cannot
    hold. The difference stays within the reference tolerance."""
    for _, diff in pool4.run(_hsdp_vs_shard_only):
        assert diff < TOLERANCE


# ---- precision, fused weights, odd models --------------------------------------------------
def _mixed_precision(rank, world):
    data = batches(STEPS)
    model = toy_model()
    ref, _, _ = reference_train(model, data)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    setup = distribute(model, "z3", world, mp_policy=policy)
    with CommLedger() as ledger:
        train(setup, data, rank, world)
    kinds = {(r.kind, r.dtype) for r in ledger.select(source=CommLabel.DMUON)}
    master = {p.dtype for p in setup.handle.params}
    return max_diff(full_state(setup), ref), kinds, master


def test_mixed_precision_bf16_compute_fp32_reduce(pool2):
    for diff, kinds, master in pool2.run(_mixed_precision):
        assert kinds == {("broadcast", torch.bfloat16), ("reduce", torch.float32)}
        assert master == {torch.float32}
        assert diff < 5e-2  # bf16 forward/backward vs an fp32 reference: same trajectory, looser


def _fused_qkv(rank, world):
    """A fused q/k/v model with split_rows gets exactly the unfused model's update."""
    data = batches(STEPS)
    unfused = toy_model()
    ref, _, _ = reference_train(unfused, data)
    fused = ToyTransformer(ToyConfig(fused_qkv=True))
    fused_state = {}
    for name, tensor in unfused.state_dict().items():
        if ".attention.wq." in name:
            prefix = name.split(".attention.")[0]
            parts = [unfused.state_dict()[f"{prefix}.attention.{w}.weight"] for w in ("wq", "wk", "wv")]
            fused_state[f"{prefix}.attention.wqkv.weight"] = torch.cat(parts)
        elif ".attention.wk." not in name and ".attention.wv." not in name:
            fused_state[name] = tensor
    fused.load_state_dict(fused_state)
    setup = distribute(fused, "z3", world, split=True)
    train(setup, data, rank, world)
    got = full_state(setup)
    for prefix in {n.split(".attention.")[0] for n in got if ".attention.wqkv" in n}:
        q, k, v = got.pop(f"{prefix}.attention.wqkv.weight").split(fused.layers[0].attention.splits)
        got.update(
            {f"{prefix}.attention.wq.weight": q, f"{prefix}.attention.wk.weight": k, f"{prefix}.attention.wv.weight": v}
        )
    return max_diff(got, ref)


def test_fused_qkv_orthogonalised_per_block(pool2):
    for diff in pool2.run(_fused_qkv):
        assert diff < TOLERANCE


class _Gated(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.used = nn.Linear(dim, dim, bias=False)
        self.spare = nn.Linear(dim, dim, bias=False)  # never called: gets no gradient

    def forward(self, x):
        return x + self.used(x)


class _Net(nn.Module):
    def __init__(self, layers=2, spare=True):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 16)
        self.layers = nn.ModuleList(_Gated() for _ in range(layers))
        if not spare:
            for layer in self.layers:
                del layer.spare
        self.out = nn.Linear(16, 64, bias=False)

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def _gated_targets(model):
    return [p for n, p in model.named_parameters() if n.startswith("layers.")]


def _used_only_targets(model):
    return [model.layers[0].used.weight]


def _odd_model(rank, world, mode, layers, targets_fn):
    import warnings

    data = batches(3)
    model = _Net(layers, spare=targets_fn is _gated_targets)
    ref, _, _ = reference_train(model, data, targets_fn=targets_fn)
    setup = distribute(model, mode, world, targets_fn=targets_fn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(setup, data, rank, world)
    owned = sum(1 for e in setup.handle.plan.entries if e.owner == dist.get_rank())
    spare_owned = [e.fqn for e in setup.handle.plan.entries if e.owner == dist.get_rank() and "spare" in e.fqn]
    warned = sorted({f for w in caught for f in spare_owned if f in str(w.message)})
    return max_diff(full_state(setup), ref), owned, spare_owned, warned


def test_parameters_without_gradients_neither_hang_nor_go_unnoticed(pool2):
    """`spare` weights get a gradient on no rank: every rank still reduces them (zeros), so nothing
    hangs, and the owner gets a zero gradient, as the single-process reference does for a target no
    slice reaches (weight decay and momentum apply); each owner warns once per such weight."""
    for diff, _, spare_owned, warned in pool2.run(_odd_model, "z3", 2, _gated_targets):
        assert diff < TOLERANCE
        assert warned == sorted(spare_owned)


@pytest.mark.parametrize("mode", ["z3", "ddp"])
def test_more_ranks_than_matrices(pool2, mode):
    results = pool2.run(_odd_model, mode, 1, _used_only_targets)
    assert sorted(owned for _, owned, _, _ in results) == [0, 1]  # one rank owns nothing
    for diff, _, _, _ in results:
        assert diff < TOLERANCE


def test_hsdp_with_idle_ranks(pool4):
    results = pool4.run(_odd_model, "hsdp", 1, _used_only_targets)
    assert sorted(owned for _, owned, _, _ in results) == [0, 0, 0, 1]
    for diff, _, _, _ in results:
        assert diff < TOLERANCE


# ---- activation checkpointing and meta-device initialisation ---------------------------------
def _activation_checkpointing(rank, world, wrap_first):
    data = batches(STEPS)
    model = toy_model()
    ref, _, _ = reference_train(model, data)
    if wrap_first:  # TorchTitan's order: AC wrappers are the layer units DMuon hooks
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
        setup = distribute(model, "z3", world)
    else:  # hooks on the inner blocks: they fire again during recompute
        mesh = make_mesh("z3", world)
        handle = dedicate_params(model, muon_targets(model), mesh)
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
            fully_shard(model.layers[i], mesh=mesh, ignored_params=handle.ignored_params)
        fully_shard(model, mesh=mesh, ignored_params=handle.ignored_params)
        setup = Setup(model, model, handle, DMuon(model.parameters(), dedicated=handle, **MUON, **ADAMW), mesh)
    train(setup, data, rank, world)
    return max_diff(full_state(setup), ref)


@pytest.mark.parametrize("wrap_first", [True, False])
def test_activation_checkpointing(pool2, wrap_first):
    for diff in pool2.run(_activation_checkpointing, wrap_first):
        assert diff < TOLERANCE


def _meta_init_hsdp(rank, world):
    """Build on meta, dedicate, shard, materialise, then initialise *differently* on every
    rank: the first forward makes each weight's replicas agree (the global owner wins)."""
    with torch.device("meta"):
        model = ToyTransformer(ToyConfig())
    setup = distribute(model, "hsdp", world)
    model.to_empty(device="cpu")  # registers new Parameter objects: build the optimizer after
    setup.opt = DMuon(model.parameters(), dedicated=setup.handle, **MUON, **ADAMW)
    torch.manual_seed(100 + rank)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.ndim > 1 else p.fill_(1.0)
    losses = [loss for loss, _, _ in train(setup, batches(3), rank, world)]
    # every replica of every dedicated weight is identical after training (once the
    # last post-step broadcast has landed; the next forward would wait for it too)
    setup.handle.wait_for_replicate_broadcasts()
    replicate_group = setup.mesh.get_group("dp_replicate")
    mismatched = []
    for p, fqn in zip(setup.handle.params, setup.handle.fqns):
        if setup.handle.holds_full(p):
            copies = [torch.empty_like(p) for _ in range(2)]
            dist.all_gather(copies, p.detach(), group=replicate_group)
            if not torch.equal(copies[0], copies[1]):
                mismatched.append(fqn)
        else:
            assert p.numel() == 0  # non-owners keep nothing between steps
    return mismatched, losses


def test_meta_device_init_then_replica_sync(pool4):
    for mismatched, losses in pool4.run(_meta_init_hsdp):
        assert mismatched == []
        assert all(torch.isfinite(torch.tensor(losses)))


# ---- gradients and their norm after one backward, against the single-process gradient --------------
def _reference_grads(model, batch, slices):
    """The single-process gradient of the global batch, {name: grad}, summed as reference_train
    sums it: each slice's loss divided by ``slices``, slices added as a pairwise tree."""
    model = copy.deepcopy(model)
    params = list(model.parameters())
    per_slice = []
    for i in range(slices):
        x, y = local_slice(batch, i, slices)
        per_slice.append(torch.autograd.grad(loss_fn(model(x), y) / slices, params))
    while len(per_slice) > 1:
        per_slice = [[a + b for a, b in zip(*per_slice[i : i + 2])] for i in range(0, len(per_slice), 2)]
    return {name: g for (name, _), g in zip(model.named_parameters(), per_slice[0])}


def _one_backward(rank, world, mode, model):
    setup = distribute(model, mode, world)
    x, y = local_slice(batches(1)[0], rank, world)
    loss_fn(setup.module(x), y).backward()
    return setup


def _owner_grads(rank, world, mode):
    model = toy_model()
    reference = _reference_grads(model, batches(1)[0], world)
    setup = _one_backward(rank, world, mode, model)
    handle, off, stray, owned = setup.handle, {}, [], 0
    for p, fqn in zip(handle.params, handle.fqns):
        if handle.runs_newton_schulz(p):
            owned += 1
            ref = reference[fqn]
            off[fqn] = float("inf") if p.grad is None else ((p.grad - ref).abs().max() / ref.abs().max()).item()
        elif p.grad is not None:
            stray.append(fqn)
    return off, stray, owned, len(handle.plan.entries)


@pytest.mark.parametrize("mode, world", [("z3", 2), ("z2", 2), ("ddp", 2), ("hsdp", 4)])
def test_owner_gradient_is_the_global_batch_gradient(pool2, pool4, mode, world):
    """After one backward (before any step or clip) each dedicated weight's owner holds the
    gradient of the global batch's mean loss, to 1e-6 relative (the same sums in another order;
    HSDP 2 x 2 in the reference's order), and no other rank holds a gradient for it. A missing or
    doubled divide factor is 1x-3x off here (checked: ``gradient_divide_factor=1.0`` makes every
    weight 1.0 (2 ranks) or 3.0 (4 ranks) relative off); Muon's and AdamW's updates hardly change
    with the gradient's scale, so the 5-step tests see it only through clipping, barely above their
    tolerance."""
    results = {2: pool2, 4: pool4}[world].run(_owner_grads, mode)
    assert sum(owned for _, _, owned, _ in results) == results[0][3]  # each weight on one rank
    for off, stray, _, _ in results:
        assert stray == []
        assert all(rel < 1e-6 for rel in off.values()), off


def _clip_vs_torch(rank, world, mode, norm_type):
    """(DMuon's norm, torch's) over every parameter, then over the dedicated weights alone
    (max_norm 1e6: nothing is scaled, so both see the gradients of the backward)."""
    model = toy_model()
    reference = _reference_grads(model, batches(1)[0], world)
    setup = _one_backward(rank, world, mode, model)
    out = []
    for names, params in ((list(reference), list(setup.model.parameters())), (setup.handle.fqns, setup.handle.params)):
        leaves = [torch.zeros_like(reference[n], requires_grad=True) for n in names]
        for leaf, name in zip(leaves, names):
            leaf.grad = reference[name].clone()
        torch_norm = torch.nn.utils.clip_grad_norm_(leaves, 1e6, norm_type=norm_type)
        norm = clip_grad_norm_(params, 1e6, norm_type=norm_type, dedicated=setup.handle)
        out.append((norm.item(), torch_norm.item()))
    return out


@pytest.mark.parametrize("norm_type", [float("inf"), 2.0])
@pytest.mark.parametrize("mode", ["z3", "ddp"])
def test_clip_norm_is_torchs_on_the_global_gradient(pool2, mode, norm_type):
    """DMuon's clip_grad_norm_ over owner-held, FSDP2-sharded and DDP-replicated gradients gives
    torch.nn.utils.clip_grad_norm_'s norm of the single-process global gradient (after one backward),
    over all parameters and over the dedicated weights alone. No other test clips with inf: its
    all-reduce must be MAX; with SUM the norm is the sum of the ranks' maxima (checked: patching it
    to SUM gives 1.77x (Z3, all) and 1.37x (dedicated alone, both modes; over all parameters DDP's
    replicated head holds the maximum, which no collective touches)). The 2-norm sums the same
    squares in another order: 1e-6 (MAX instead of SUM there: 0.73x-0.98x)."""
    for both in pool2.run(_clip_vs_torch, mode, norm_type):
        for norm, torch_norm in both:
            assert norm == pytest.approx(torch_norm, rel=1e-6)
