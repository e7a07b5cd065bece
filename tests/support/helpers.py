"""Building blocks shared by the multi-process tests: models, parallel setups, references."""

from __future__ import annotations

import contextlib
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
from titan_dmuon.testing.toy_model import ToyConfig, ToyTransformer, loss_fn, muon_targets, qkv_splits

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
        (
            torch.randint(0, vocab, (global_batch, seq), generator=g),
            torch.randint(0, vocab, (global_batch, seq), generator=g),
        )
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
    param_groups_fn=None,
    **dedicate_kwargs,
) -> Setup:
    """mode: "z2" | "z3" (FSDP2), "hsdp" (2 x world/2, Z3), "ddp". ``param_groups_fn(model)``: DMuon's
    param groups (default: every parameter in one)."""
    mesh = mesh if mesh is not None else make_mesh(mode, world)
    reshard = (
        mode != "z2" if "reshard_after_forward" not in dedicate_kwargs else dedicate_kwargs.pop("reshard_after_forward")
    )
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
    params = param_groups_fn(model) if param_groups_fn is not None else model.parameters()
    opt = DMuon(params, dedicated=handle, **{**MUON, **ADAMW, **(opt_kwargs or {})})
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


def baseline(
    model: nn.Module,
    kind: str,
    world: int,
    *,
    mesh=None,
    reshard: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> Setup:
    """kind: "fsdp_adamw" (FSDP2 + AdamW everywhere), "naive" (FSDP2 + Muon with a
    full-gradient all-gather in step), "ddp_muon" (DDP all-reduce + torch.optim.Muon)."""
    from torch.nn.parallel import DistributedDataParallel

    from titan_dmuon.testing.baselines import NaiveFSDPMuon

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
        kw = {"mp_policy": mp_policy} if mp_policy is not None else {}
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, **kw)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard, **kw)
        if kind == "fsdp_adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=ADAMW["adamw_lr"])
        elif kind == "naive":
            opt = NaiveFSDPMuon(model.parameters(), muon_params=muon_targets(model), **MUON, **ADAMW)
        else:
            raise ValueError(kind)
    return Setup(module=module, model=model, handle=None, opt=opt, mesh=mesh)


def train(
    setup: Setup,
    data,
    rank: int,
    world: int,
    *,
    steps: int | None = None,
    max_norm=None,
    accumulate: int = 1,
    sync: str = "each",
):
    """Returns per-step (local loss, clip norm or None, NS matrices on this rank).

    ``sync`` (DMuon's gradient sync over the ``accumulate`` micro-batches): "each" micro-batch;
    "last" (off before the last one, as FSDP2's gradient accumulation); "deferred" (off for all,
    then ``reduce_gradients()``, as pipelining does)."""
    from titan_dmuon import clip_grad_norm_

    out = []
    for batch in data[: steps or len(data)]:
        x, y = local_slice(batch, rank, world)
        loss_total = 0.0
        for i, (xs, ys) in enumerate(zip(x.chunk(accumulate), y.chunk(accumulate))):
            if sync != "each":
                setup.handle.set_requires_gradient_sync(sync == "last" and i == accumulate - 1)
            loss = loss_fn(setup.module(xs), ys) / accumulate
            loss.backward()
            loss_total += loss.item()
        if sync == "deferred":
            setup.handle.set_requires_gradient_sync(True)
            setup.handle.reduce_gradients()
        norm = clip_grad_norm_(setup.model.parameters(), max_norm, dedicated=setup.handle) if max_norm else None
        setup.opt.step()
        ns = getattr(setup.opt, "last_step_stats", {}).get("ns_matrices")
        setup.opt.zero_grad()
        out.append((loss_total, None if norm is None else norm.item(), ns))
    return out


def full_state(setup: Setup) -> dict[str, torch.Tensor]:
    """Every parameter in full on every rank (collective)."""
    return full_parameters(setup.model, setup.handle)


def merge_rank_states(states) -> dict[str, torch.Tensor]:
    """One dict from every rank's ``{name: tensor}``; a name two ranks report must agree bitwise."""
    merged = {}
    for state in states:
        for key, value in state.items():
            assert key not in merged or torch.equal(merged[key], value), key
            merged[key] = value
    return merged


def assert_states_equal(a: dict, b: dict) -> None:
    """The same names, every tensor bitwise equal (the differing ones listed with their max difference)."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    assert [(k, (a[k] - b[k]).abs().max().item()) for k in a if not torch.equal(a[k], b[k])] == []


class Counter:
    """Stands in for TorchTitan's train state and dataloader (both Stateful) in checkpoint tests."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def full_parameters(model: nn.Module, handle=None) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` in full on every rank, by canonical name (collective)."""
    dedicated = handle.full_tensors() if handle is not None else {}
    out = {}
    for name, p in model.named_parameters():
        name = canonical_fqn(name)
        if name in dedicated:
            out[name] = dedicated[name]
        elif isinstance(p, DTensor):
            out[name] = p.full_tensor().detach().clone()  # (a Replicate DTensor's full tensor is its local one)
        else:
            out[name] = p.detach().clone()
    return out


def reference_train(
    model: nn.Module,
    data,
    *,
    max_norm=None,
    muon=MUON,
    adamw=ADAMW,
    targets_fn=muon_targets,
    slices=1,
    before_slice=None,
    ns_method: str = "torch",
    ns_dtype: torch.dtype = torch.bfloat16,
    normuon_beta2: float | None = None,
):
    """Single process: torch.optim.Muon on the targets, torch.optim.AdamW on the rest.

    ``ns_method`` other than "torch" (or ``ns_dtype`` float16): torch.optim.Muon with that method's
    Newton–Schulz as written in ``reference_newton_schulz`` (independently of titan_dmuon).
    ``normuon_beta2``: NorMuon, ``reference_normuon`` on each leaf's Newton–Schulz output with the
    leaf's own second moment (one torch.optim.Muon per leaf, so each call is known to be its leaf's).

    ``slices``: the global batch is processed as that many equal slices (one per data-parallel
    rank) whose gradients are averaged as a pairwise tree, ((g0 + g1) + (g2 + g3)) / 4, which is
    the order HSDP 2 x 2 sums them in (shard group, then replicate group); with 2 ranks the result
    is bitwise what any distributed reduction computes ((g0 + g1) / 2 is exact in any order).

    A 3-D expert weight (E, rows, cols) is E matrices: each expert's slice is its own
    torch.optim.Muon leaf (its own momentum and shape-based LR), copied in and out every step.

    A Muon target no slice reached gets a zero gradient, as DMuon gives it (every rank reduces
    every dedicated weight, zeros where it has none): weight decay and momentum still apply.
    ``before_slice(model, i)`` runs before slice i's forward (a model whose path depends on the rank)."""
    model = copy.deepcopy(model)
    targets = targets_fn(model)
    ids = {id(p) for p in targets}
    others = [p for p in model.parameters() if id(p) not in ids]
    experts = [(p, e, nn.Parameter(p.detach()[e].clone())) for p in targets if p.ndim == 3 for e in range(p.shape[0])]
    leaves = [p for p in targets if p.ndim == 2] + [leaf for _, _, leaf in experts]
    orthogonalise = (
        None if ns_method == "torch" and ns_dtype == torch.bfloat16 else reference_newton_schulz(ns_method, ns_dtype)
    )
    muon_steps = [(torch.optim.Muon(leaves, **muon), orthogonalise)]
    if normuon_beta2 is not None:  # one optimizer per leaf, each with its own second moment
        muon_steps = [
            (torch.optim.Muon([leaf], **muon), normuon_newton_schulz(orthogonalise, normuon_beta2)) for leaf in leaves
        ]
    opt_adamw = torch.optim.AdamW(
        others,
        lr=adamw["adamw_lr"],
        betas=adamw["adamw_betas"],
        eps=adamw["adamw_eps"],
        weight_decay=adamw["adamw_weight_decay"],
    )
    losses, norms = [], []
    params = list(model.parameters())
    for batch in data:
        loss, per_slice = 0.0, []
        for i in range(slices):
            x, y = local_slice(batch, i, slices)
            if before_slice is not None:
                before_slice(model, i)
            part = loss_fn(model(x), y) / slices
            per_slice.append(torch.autograd.grad(part, params, allow_unused=True))
            loss += part.item()
        while len(per_slice) > 1:
            pairs = [per_slice[i : i + 2] for i in range(0, len(per_slice), 2)]
            per_slice = [pair[0] if len(pair) == 1 else [_add(a, b) for a, b in zip(*pair)] for pair in pairs]
        for p, g in zip(params, per_slice[0]):
            p.grad = torch.zeros_like(p) if g is None and id(p) in ids else g  # (others: None, as one backward)
        losses.append(loss)
        if max_norm:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        for p, e, leaf in experts:
            leaf.grad = p.grad[e].clone()
        for opt_muon, fn in muon_steps:
            with torch_muon_newton_schulz(fn):
                opt_muon.step()
        with torch.no_grad():
            for p, e, leaf in experts:
                p[e].copy_(leaf)
                leaf.grad = p.grad = None  # (the 3-D weight is in neither optimizer)
        opt_adamw.step()
        for opt_muon, _ in muon_steps:
            opt_muon.zero_grad()
        opt_adamw.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses, norms


@contextlib.contextmanager
def late_delivery():
    """DMuon's asynchronous collectives (``dist.broadcast``/``dist.reduce``) deliver their result
    only at ``wait()``: each runs on a scratch copy of its tensor that is copied back when waited.
    On gloo a result read before its wait is usually already there (the race rarely opens); here a
    missing wait reads stale data and changes the answer, as it would on a GPU."""

    class _Late:
        def __init__(self, work, scratch, target):
            self.work, self.scratch, self.target = work, scratch, target

        def wait(self, *args):
            if self.work is not None:
                self.work.wait()
                self.work = None
                with torch.no_grad():
                    self.target.copy_(self.scratch)
            return True

    def late(fn):
        def call(tensor, *args, async_op=False, **kwargs):
            if not async_op:
                return fn(tensor, *args, async_op=False, **kwargs)
            scratch = tensor.detach().clone()
            return _Late(fn(scratch, *args, async_op=True, **kwargs), scratch, tensor)

        return call

    real = dist.broadcast, dist.reduce
    dist.broadcast, dist.reduce = late(real[0]), late(real[1])
    try:
        yield
    finally:
        dist.broadcast, dist.reduce = real


def _add(a, b):
    return a if b is None else b if a is None else a + b


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def global_loss(local_losses: list[float], group=None) -> list[float]:
    t = torch.tensor(local_losses, dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return (t / dist.get_world_size(group)).tolist()


def allocation_peak(fn) -> int:
    """Peak bytes allocated while ``fn`` runs, above what was allocated when it started.

    Counts every allocation and free of the CPU allocator (storage resizes included)
    from the profiler's memory events; the GPU equivalent is torch.cuda.max_memory_allocated."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (
            e
            for e in prof.profiler.kineto_results.events()
            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
        ),
        key=lambda e: e.start_ns(),
    )
    now = peak = 0
    for event in events:
        now += event.nbytes()
        peak = max(peak, now)
    return peak


# ---- Newton–Schulz methods, written here independently of titan_dmuon.math ---------------------------------
# Polar Express (arXiv 2505.16932, Algorithm 1): the degree-5 polynomial of each step, the last one repeated.
PAPER_POLAR_EXPRESS = [
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
]
PAPER_SAFETY = 1.01  # every polynomial but the last is p(x / 1.01); the input is divided by 1.01 ||X||_F


def paper_schedule(steps: int) -> list[tuple[float, float, float]]:
    """The Polar Express (a, b, c) of each of ``steps`` steps, as the paper's Algorithm 1 builds them."""
    s = PAPER_SAFETY
    scaled = [(a / s, b / s**3, c / s**5) for a, b, c in PAPER_POLAR_EXPRESS[:-1]] + [PAPER_POLAR_EXPRESS[-1]]
    return scaled[:steps] + [scaled[-1]] * max(0, steps - len(scaled))


def reference_newton_schulz(method: str, dtype: torch.dtype = torch.bfloat16):
    """``torch.optim._muon._zeropower_via_newtonschulz``'s signature, one 2-D matrix, for ``method``: the
    iteration written as torch.optim.Muon writes its own (bf16, fused ``addmm``s; or in float16, the input
    normalised in float32 before it is rounded to float16), with the Polar Express
    schedule ("polar_express"), or as Gram Newton–Schulz ("gram": Q and R = X Xᵀ carried between restarts
    before every odd step, as Dao-AILab/gram-newton-schulz writes it) where the wide matrix's long side is
    more than 1.5 times its short side (the FLOP rule for 5 steps and matrices under 1024 rows)."""

    def orthogonalise(grad, ns_coefficients, ns_steps, eps):
        x = grad.bfloat16() if dtype == torch.bfloat16 else grad.float()
        transposed = grad.size(0) > grad.size(1)
        if transposed:
            x = x.T
        scale = 1.0 if method == "torch" else PAPER_SAFETY
        x = (x / (x.norm() * scale).clamp(min=eps)).to(dtype)
        schedule = [tuple(ns_coefficients)] * ns_steps if method == "torch" else paper_schedule(ns_steps)
        short, long = x.shape
        if method == "gram" and 2 * long > 3 * short:
            assert short < 1024, "the reference has no rule for blocked symmetric products"
            gram, product = x @ x.T, None
            for step, (a, b, c) in enumerate(schedule):
                if step % 2 == 1:  # restart
                    x = product @ x
                    gram, product = x @ x.T, None
                z = torch.addmm(gram, gram, gram, beta=b, alpha=c)
                if product is None:
                    product = z + a * torch.eye(short, dtype=z.dtype)
                else:
                    product = torch.addmm(product, product, z, beta=a)
                if step + 1 < ns_steps and (step + 1) % 2 == 0:
                    rz = torch.addmm(gram, gram, z, beta=a)
                    gram = torch.addmm(rz, z, rz, beta=a)
            x = product @ x
        else:
            for a, b, c in schedule:
                gram = x @ x.T
                x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.T if transposed else x

    return orthogonalise


def reference_normuon(orthogonal: torch.Tensor, moment: torch.Tensor, beta2: float, dtype=torch.float64):
    """NorMuon (arXiv 2510.05491) as issue 31 states it, in ``dtype``: v <- beta2 v + (1 - beta2) mean over
    columns of O^2 (one value per row, v from 0, no bias correction); O / (sqrt(v) + 1e-8) row by row;
    then rescaled to O's Frobenius norm. Returns (Ô, v). (float32: the rounding a float32 implementation
    of the same formula gets, for references that must not drift from it: top-k routing turns a last-bit
    difference of the weights into another expert.)"""
    o = orthogonal.to(dtype)
    v = beta2 * moment.to(dtype) + (1 - beta2) * (o * o).mean(dim=1)
    scaled = o / (torch.sqrt(v) + 1e-8).reshape(-1, 1)
    norm = torch.linalg.vector_norm(scaled)
    return (scaled * (torch.linalg.vector_norm(o) / norm) if norm > 0 else scaled), v


def normuon_newton_schulz(orthogonalise, beta2: float, dtype=torch.float32):
    """``_zeropower_via_newtonschulz``'s signature for ONE leaf: its Newton–Schulz (``orthogonalise``, None:
    torch's own), then ``reference_normuon`` in ``dtype`` with the second moment this function keeps
    (``.moment``)."""
    from torch.optim import _muon

    base = orthogonalise or _muon._zeropower_via_newtonschulz  # (torch's own, taken before any patch)

    def with_normuon(grad, ns_coefficients, ns_steps, eps):
        o = base(grad, ns_coefficients, ns_steps, eps)
        if with_normuon.moment is None:
            with_normuon.moment = torch.zeros(o.shape[0], dtype=dtype)
        update, with_normuon.moment = reference_normuon(o, with_normuon.moment, beta2, dtype)
        return update.float()

    with_normuon.moment = None
    return with_normuon


@contextlib.contextmanager
def torch_muon_newton_schulz(orthogonalise):
    """torch.optim.Muon with its Newton–Schulz replaced by ``orthogonalise`` (None: its own)."""
    from torch.optim import _muon

    original = _muon._zeropower_via_newtonschulz
    if orthogonalise is not None:
        _muon._zeropower_via_newtonschulz = orthogonalise
    try:
        yield
    finally:
        _muon._zeropower_via_newtonschulz = original
