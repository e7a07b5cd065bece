"""TorchTitan's own model families under DMuon, in-process on the gloo pools (tests/support/titan_harness.py).

Dense (fused q/k/v), qwen3 MoE, deepseek_v3 (MLA, dense first layer, shared experts), expert
parallelism, and TorchTitan's optimizer param groups.
"""

import pytest
import torch

from tests.support import titan_harness as th


# ---- fused q/k/v -----------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_fused_wqkv_blocks_are_torchtitans_q_k_v(family):
    """Every fused wqkv is orthogonalised as its q, k and v blocks, and those blocks are exactly the
    rows TorchTitan itself splits into wq/wk/wv (its state-dict hook, interleaved per kv group)."""
    import importlib

    from torchtitan.models.common.attention import FusedQKVLinear

    from titan_dmuon.integration.distributed.parallelize import fused_qkv_blocks

    registry = importlib.import_module(f"torchtitan.models.{family}.config_registry")
    with torch.device("meta"):
        model = getattr(registry, f"{family}_debugmodel")().model_spec.model.build()
    blocks = fused_qkv_blocks(model)
    fused = [m for m in model.modules() if isinstance(m, FusedQKVLinear)]
    assert fused and len(blocks) == len(fused)
    for module in fused:
        rows = module.wqkv.weight.shape[0]
        state = {"wqkv.weight": torch.arange(rows, dtype=torch.float32)[:, None]}
        FusedQKVLinear._split_qkv_on_save(module, state, "", None)
        for block, name in zip(blocks[module.wqkv.weight], ("wq", "wk", "wv")):
            block_rows = [r for start, stop in block for r in range(start, stop)]
            assert block_rows == state[f"{name}.weight"][:, 0].long().tolist(), name


def _fused_vs_unfused(rank, world, split_fused):
    from torchtitan.models.common.attention import FusedQKVLinear

    data = th.batches(4, world)
    state = th.initial_state(th.tiny_llama3(fuse_qkv=True))
    weights = {}
    for fused in (True, False):
        dims = th.parallel_dims(world)
        model, container = th.build(th.tiny_llama3(fuse_qkv=fused), dims, state=state, lr=0.02)
        (handle,) = container.dmuon_optimizers()[0].dedicated_handles()
        if fused and not split_fused:  # the broken variant: the whole wqkv as one matrix
            for m in handle._members:
                object.__setattr__(m.entry, "blocks", (((0, m.entry.shape[0]),),))
        th.train(model, container, dims, data)
        full = handle.full_tensors()
        for module_name, module in model.named_modules():
            if isinstance(module, FusedQKVLinear):  # in TorchTitan's unfused names
                prefix = module_name.replace("_checkpoint_wrapped_module.", "") + "."
                split = {f"{prefix}wqkv.weight": full.pop(f"{prefix}wqkv.weight")}
                FusedQKVLinear._split_qkv_on_save(module, split, prefix, None)
                full.update(split)
        weights[fused] = full
    return max((weights[True][k] - weights[False][k]).abs().max().item() for k in weights[False])


def test_fused_and_unfused_llama3_train_alike(pool2):
    """From the same weights, TorchTitan's fused-wqkv llama3 and the same model with separate
    wq/wk/wv end 4 DMuon steps with the same q, k, v (fused and separate matmuls round
    differently: ~1 bf16 ulp of the update per step); orthogonalising wqkv as one matrix ends
    elsewhere (observed 2.4e-3 vs 2.1e-2)."""
    right = pool2.run(_fused_vs_unfused, True)[0]
    wrong = pool2.run(_fused_vs_unfused, False)[0]
    assert right < 5e-3 < wrong, (right, wrong)


# ---- torch.compile through TorchTitan's own apply_compile ------------------------------------------------
def _compiled_vs_eager(rank, world, mode):
    from torch._dynamo.utils import counters

    data = th.batches(4, world)
    state = th.initial_state(th.tiny_llama3())
    dims = th.parallel_dims(world, replicate=2 if mode == "hsdp" else 1)
    reshard = mode != "z2"
    losses = {}
    for compiled in (False, True):
        model, container = th.build(
            th.tiny_llama3(), dims, state=state, compile=compiled, lr=0.02, reshard_after_forward=reshard
        )
        losses[compiled] = th.train(model, container, dims, data[:2])
        graphs = counters["stats"]["unique_graphs"]
        losses[compiled] += th.train(model, container, dims, data[2:])
    return (
        max(abs(a - b) for a, b in zip(losses[False], losses[True])),
        counters["stats"]["unique_graphs"] - graphs,
        graphs,
    )


@pytest.mark.parametrize("mode", ["z3", "z2"])
def test_torchtitan_compile_matches_eager(pool2, mode):
    """compile.enable = true: TorchTitan compiles each block (inductor, fullgraph=True) inside its
    parallelize_fn, before DMuon dedicates; nothing recompiles after the first two steps, and losses
    agree with eager within 2e-3 (bf16 compute: inductor keeps fused intermediates in fp32 where eager
    rounds each op to bf16; step 1 differs by 1e-4, later steps by up to 6e-4 observed). Stale or
    missing dedicated weights would be off by > 1e-1."""
    for diff, new_graphs, graphs in pool2.run(_compiled_vs_eager, mode, timeout=600):
        assert graphs >= 1 and new_graphs == 0
        assert diff < 2e-3


# ---- MoE: TorchTitan's qwen3 MoE and deepseek_v3 -------------------------------------------------------------
def _moe_job(rank, world, family, experts, ep=1, **kwargs):
    from titan_dmuon import CommLedger

    make = {"qwen3": th.tiny_qwen3_moe, "deepseek_v3": th.tiny_deepseek_v3}[family]
    data = th.batches(4, world)
    state = th.initial_state(make(experts=experts))
    dims = th.parallel_dims(world, ep=ep)
    model, container = th.build(make(experts=experts), dims, state=state, lr=0.02, **kwargs)
    dmuon = container.dmuon_optimizers()[0]
    (handle,) = dmuon.dedicated_handles()
    losses = th.train(model, container, dims, data[:2])
    with CommLedger() as ledger:
        losses += th.train(model, container, dims, data[2:])
    adamw_model, adamw = th.build(make(experts=experts), th.parallel_dims(world, ep=ep), state=state, optimizer="AdamW")
    with CommLedger() as adamw_ledger:
        adamw_losses = th.train(adamw_model, adamw, dims, data[:1])
    muon_names = sorted({n for g in dmuon.param_groups for n in g["param_names"]})
    return {
        "losses": losses,
        "adamw_first_loss": adamw_losses[0],
        "local": sorted(e.fqn for e in handle.local_experts),
        "dedicated": sorted(e.fqn for e in handle.plan.entries),
        "muon": muon_names,
        "ns": dmuon.last_step_stats["ns_matrices"],
        "elements": ledger.elements() / 2,
        "adamw_elements": adamw_ledger.elements(),
        "bias_moved": any(b.abs().sum() > 0 for n, b in model.named_buffers() if n.endswith("expert_bias_E")),
    }


def _check_moe(results, *, local_experts: bool):
    for r in results:
        assert r["losses"][0] == pytest.approx(r["adamw_first_loss"], rel=1e-5)  # same start, same scale
        assert all(torch.isfinite(torch.tensor(r["losses"])))
        experts = [n for n in r["muon"] if "inner_experts" in n]
        assert experts and (set(experts) <= set(r["local"]) if local_experts else set(experts) <= set(r["dedicated"]))
        assert any(".router.gate." in n for n in r["muon"])  # the router on Muon, as TorchTitan's Kimi recipe
        assert r["elements"] <= r["adamw_elements"]  # no more traffic than FSDP2 + AdamW
        assert r["bias_moved"]  # TorchTitan's load-balancing step pre-hook ran
    assert sum(r["ns"] for r in results) > 0


def test_qwen3_moe_experts_stay_local(pool2):
    """8 experts on 2 FSDP ranks: TorchTitan shards them on dim 0, each rank runs Muon on its own 4."""
    results = pool2.run(_moe_job, "qwen3", 8)
    _check_moe(results, local_experts=True)
    for r in results:  # per step: 2 layers x 3 expert weights x 4 local experts, plus its dedicated matrices
        assert r["ns"] >= 2 * 3 * 4


def test_deepseek_v3_mla_dense_layer_and_shared_experts(pool2):
    results = pool2.run(_moe_job, "deepseek_v3", 8)
    _check_moe(results, local_experts=True)
    muon = results[0]["muon"]
    for part in (
        ".attention.wq.",
        ".attention.wkv_a.",
        ".attention.wkv_b.",
        ".attention.wo.",
        "layers.0.feed_forward.w1.",
        ".shared_experts.w2.",
    ):
        assert any(part in n for n in muon), part
    assert not any("norm" in n for n in muon)  # kv_norm and the RMSNorms stay on AdamW


def test_more_ranks_than_experts_dedicates_them(pool4):
    """3 experts on 4 FSDP ranks: TorchTitan would split each expert on dim 1; DMuon gives each
    expert weight one owner instead (NS once per expert matrix in the whole job)."""
    _check_moe(pool4.run(_moe_job, "qwen3", 3), local_experts=False)


def test_expert_parallel(pool2):
    """expert_parallel_degree 2 (the partial_dtensor backend: TorchTitan's EP all-to-all runs on gloo
    only there): experts are whole on their EP rank, DMuon runs Muon on them in place, and the
    losses follow the EP = 1 run's (token routing through all-to-all sums in another order)."""
    ep = pool2.run(_moe_job, "qwen3", 8, 2)
    plain = pool2.run(_moe_job, "qwen3", 8, 1)
    _check_moe(ep, local_experts=True)
    assert ep[0]["losses"] == pytest.approx(plain[0]["losses"], abs=1e-3)


def test_param_groups_of_the_config_are_kept(pool2):
    for groups in pool2.run(_param_groups):
        assert groups["dmuon"] == {
            "DMuon": ["muon"],
            # (first parameter of each group, its weight decay, its lr): embeddings keep wd 0; the rest adamw_lr
            "AdamW": [("tok_embeddings.weight", 0.0, 8e-4), ("layers.0.attention.q_norm.weight", 0.1, 1e-3)],
        }
        assert groups["adamw"] == groups["titan"]  # name = "AdamW": exactly TorchTitan's own container


def _param_groups(rank, world):
    """TorchTitan's qwen3_debugmodel_moe_param_groups: embeddings without weight decay, router on Adam.
    With dmuon the router goes to Muon and the embeddings group keeps its settings; with AdamW every
    group is TorchTitan's."""
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.models.qwen3.config_registry import qwen3_debugmodel_moe_param_groups

    from titan_dmuon.integration.config.trainer_config import dmuon_trainer_config

    titan_groups = qwen3_debugmodel_moe_param_groups().optimizer.param_groups
    converted = dmuon_trainer_config(qwen3_debugmodel_moe_param_groups()).optimizer
    out = {}
    for name in ("dmuon", "AdamW"):
        dims = th.parallel_dims(world)
        config = {k: getattr(converted, k) for k in ("param_groups", "lr", "betas", "eps", "weight_decay")}
        model, container = th.build(th.tiny_qwen3_moe(), dims, optimizer=name, adamw_lr=1e-3, **config)
        out[name.lower()] = _summary(container)
    model, _ = th.build(th.tiny_qwen3_moe(), th.parallel_dims(world), optimizer="AdamW")
    titan = OptimizersContainer(
        OptimizersContainer.Config(param_groups=titan_groups, implementation="for-loop"), model_parts=[model]
    )
    out["titan"] = _summary(titan)
    return out


def _summary(container):
    summary = {}
    for opt in container.optimizers:
        name = type(opt).__name__
        for group in opt.param_groups:
            if name == "DMuon":
                summary.setdefault(name, []).append("muon")
            else:
                summary.setdefault(name, []).append((group["param_names"][0], group["weight_decay"], group["lr"]))
    return summary


# ---- the same seed gives TorchTitan's own initial model ---------------------------------------------------------
def _same_seed_start(rank, world, family, replicate, experts, ep):
    """Every parameter after TorchTitan's init (no seed checkpoint), and step 1's loss and grad norm,
    for TorchTitan's own FSDP2/DDP + AdamW build and for DMuon's, from the same seed."""
    from tests.support.helpers import full_parameters
    from titan_dmuon import clip_grad_norm_

    make = {
        "llama3": th.tiny_llama3,
        "qwen3": lambda: th.tiny_qwen3_moe(experts=experts),
        "deepseek_v3": lambda: th.tiny_deepseek_v3(experts=experts),
    }[family]
    data = th.batches(1, world)
    out = {}
    for optimizer in ("AdamW", "dmuon"):
        dims = th.parallel_dims(world, replicate=replicate, ep=ep)
        model, container = th.build(make(), dims, optimizer=optimizer, seed=7, lr=0.02)
        handle = container.dmuon_optimizers()[0].dedicated_handles()[0] if optimizer == "dmuon" else None
        weights = full_parameters(model, handle)
        norms = []
        if handle is None:  # TorchTitan's own clip (over DTensor shards, EP-aware)
            from torchtitan.distributed.utils import clip_grad_norm_ as titan_clip

            clip = lambda params, max_norm: titan_clip(params, max_norm, ep_enabled=ep > 1)  # noqa: E731
        else:
            clip = lambda params, max_norm: clip_grad_norm_(params, max_norm, dedicated=handle)  # noqa: E731
        loss = th.train(model, container, dims, data, clip=clip, norms=norms)[0]
        out[optimizer] = (weights, loss, norms[0])
    (titan, titan_loss, titan_norm), (mine, loss, norm) = out["AdamW"], out["dmuon"]
    return (
        sorted(k for k in titan if not torch.equal(titan[k], mine[k])),
        len(titan),
        titan_loss,
        loss,
        titan_norm,
        norm,
    )


@pytest.mark.parametrize(
    "family, world, replicate, experts, ep",
    [
        ("llama3", 2, 1, 0, 1),  # FSDP2
        ("llama3", 4, 2, 0, 1),  # HSDP 2 x 2
        ("llama3", 2, 2, 0, 1),  # DDP
        ("qwen3", 2, 1, 8, 1),  # MoE, experts on FSDP2's dim-0 shards
        ("qwen3", 4, 1, 2, 1),  # MoE, more ranks than experts: experts dedicated (FSDP2 would use Shard(1))
        ("qwen3", 2, 1, 8, 2),  # expert parallelism
        ("deepseek_v3", 2, 1, 8, 1),  # MLA, dense first layer, shared experts
    ],
)
def test_same_seed_starts_from_torchtitans_initial_model(pool2, pool4, family, world, replicate, experts, ep):
    """With the same seed and no seed checkpoint, DMuon's model is TorchTitan's own, weight for weight:
    while a module initialises, its dedicated weights are DTensors laid out as FSDP2 would shard them
    (DDP: full replicas), so TorchTitan's initialisers draw the same random numbers on every rank.
    Step 1 then sees the same loss and grad norm as TorchTitan's AdamW (the norm sums owner-held and
    sharded squares in another order: 1e-6)."""
    pool = {2: pool2, 4: pool4}[world]
    for differing, count, titan_loss, loss, titan_norm, norm in pool.run(
        _same_seed_start, family, replicate, experts, ep
    ):
        assert count > 10 and differing == []
        assert loss == titan_loss
        assert norm == pytest.approx(titan_norm, rel=1e-6)


# ---- the container hands the [optimizer] keys to DMuon and to the catch-all AdamW group ----------------------
OPTIONS = dict(  # every one differs from its default, so a key that is not passed on keeps a wrong value
    lr=0.015,
    weight_decay=0.07,
    momentum=0.8,
    nesterov=False,
    ns_steps=4,
    adjust_lr_fn="match_rms_adamw",
    ns_mode="exact",
    adamw_lr=3e-3,
    adamw_betas=(0.8, 0.9),
    adamw_eps=1e-7,
    adamw_weight_decay=0.03,
)
MUON_GROUP = ("lr", "weight_decay", "momentum", "nesterov", "ns_steps", "adjust_lr_fn", "ns_mode")


def _container_groups(rank, world):
    model, container = th.build(th.tiny_llama3(), th.parallel_dims(world), **OPTIONS)
    dmuon = container.dmuon_optimizers()
    muon = [(g["use_muon"], {k: g[k] for k in MUON_GROUP}) for o in dmuon for g in o.param_groups]
    rest = [
        (type(o).__name__, len(g["params"]), {k: g[k] for k in ("lr", "betas", "eps", "weight_decay")})
        for o in container.optimizers
        if o not in dmuon
        for g in o.param_groups
    ]
    return muon, rest, sum(1 for p in model.parameters() if p.requires_grad)


def test_optimizer_keys_reach_dmuon_and_the_catch_all_group(pool2):
    """Every job config uses the defaults of momentum, nesterov, ns_steps, adjust_lr_fn and ns_mode,
    so a container that dropped one would train with DMuon's default unnoticed. Built with non-default
    values, DMuon's Muon groups hold each of them, and the catch-all AdamW group (the only other group
    here) holds the adamw_* keys, adamw_weight_decay distinct from Muon's weight_decay (checked: with
    "momentum" taken out of the container's MUON_KEYS the group holds 0.95 and this fails)."""
    for muon, rest, trainable in pool2.run(_container_groups):
        assert muon and all(use_muon for use_muon, _ in muon)  # (no AdamW group inside DMuon)
        expected = {k: OPTIONS[k] for k in MUON_GROUP}
        assert all(settings == expected for _, settings in muon), muon
        assert len(rest) == 1 and rest[0][0] == "AdamW", rest
        assert rest[0][2] == dict(lr=3e-3, betas=(0.8, 0.9), eps=1e-7, weight_decay=0.03)
        assert 0 < rest[0][1] < trainable


# ---- the expert-parallel limit --------------------------------------------------------------------------------
def _meta_moe(experts):
    from titan_dmuon.integration import cpu

    config, _ = th.tiny_qwen3_moe(experts=experts)
    cpu.use_sdpa_attention(config)
    with torch.device("meta"):
        return config.build()


def _dims(*, shard, replicate=1, ep=1):
    from torchtitan.distributed import ParallelDims

    from titan_dmuon.integration.distributed.degrees import ParallelDegrees

    return ParallelDegrees.of(
        ParallelDims(
            dp_replicate=replicate,
            dp_shard=shard,
            cp=1,
            tp=1,
            pp=1,
            ep=ep,
            world_size=shard * replicate,
            spmd_backend="partial_dtensor",
        )
    )


def test_expert_parallel_limit():
    """Under expert parallelism with more expert-FSDP x EP ranks than experts, TorchTitan splits each
    expert (Shard(1)) and DMuon's in-place expert update would run Newton-Schulz on slices: the job
    must stop with the numbers and the key to change, not train wrongly (checked: without the check
    the first case returns "local"). That product is dp_shard x cp x tp whatever the EP degree
    (TorchTitan's efsdp = dp_shard * cp * tp / ep), so raising expert_parallel_degree does not lift
    the limit and the error must not advise it (it did: "... or raise expert_parallel_degree").
    Within the limit experts stay local; under DDP every rank holds every expert, so each is
    dedicated; plain FSDP leaves the choice to dedicate_params ("auto")."""
    from titan_dmuon.integration.distributed.parallelize import expert_sharding

    model = _meta_moe(experts=2)
    for ep in (2, 4):
        with pytest.raises(NotImplementedError) as raised:
            expert_sharding(model, _dims(shard=4, ep=ep))
        message = str(raised.value)
        assert "4 expert-FSDP x EP ranks and 2 experts" in message
        assert "lower data_parallel_shard_degree" in message
        assert "raise expert_parallel_degree" not in message
    assert expert_sharding(model, _dims(shard=2, ep=2)) == "local"
    assert expert_sharding(model, _dims(shard=2, replicate=2, ep=2)) == "local"  # HSDP: the shard group counts
    assert expert_sharding(model, _dims(shard=1, replicate=2)) == "dedicated"
    assert expert_sharding(model, _dims(shard=2)) == "auto"
    assert expert_sharding(model, _dims(shard=4)) == "auto"
    assert expert_sharding(_meta_moe(experts=8), _dims(shard=4, ep=2)) == "local"


# ---- experts are in exactly one optimizer group: DMuon's -----------------------------------------------------
def _expert_groups(rank, world, experts):
    from titan_dmuon.runtime import canonical_fqn

    model, container = th.build(th.tiny_qwen3_moe(experts=experts), th.parallel_dims(world), lr=0.02)
    (handle,) = container.dmuon_optimizers()[0].dedicated_handles()
    places = {}
    for name, p in model.named_parameters():
        if "inner_experts" in name:
            places[canonical_fqn(name)] = [
                (type(o).__name__, g.get("use_muon"))
                for o in container.optimizers
                for g in o.param_groups
                for q in g["params"]
                if q is p
            ]
    return places, sorted(e.fqn for e in handle.local_experts), sorted(e.fqn for e in handle.plan.entries)


@pytest.mark.parametrize("experts, world", [(8, 2), (2, 4)])
def test_each_expert_weight_is_in_one_dmuon_group_only(pool2, pool4, experts, world):
    """Routed expert weights, kept local (8 experts on 2 ranks) or dedicated (2 experts on 4 ranks),
    are each in exactly one param group of the whole container, a Muon group of DMuon: an expert also
    left in TorchTitan's AdamW group (or in DMuon's AdamW group) would get both updates, and only the
    extra checkpoint keys of another test would show it (checked: handing the container's AdamW groups
    every parameter puts each expert in ("AdamW", None) too and this fails)."""
    for places, local, dedicated in {2: pool2, 4: pool4}[world].run(_expert_groups, experts):
        assert len(places) == 2 * 3  # 2 layers x w1, w2, w3
        if experts == 8:
            assert sorted(places) == local  # kept where FSDP2 holds them
        else:
            assert set(places) <= set(dedicated) and not local
        for fqn, where in places.items():
            assert where == [("DMuon", True)], (fqn, where)


# ---- a baseline built by the benchmark's container: naive FSDP2 + Muon ----------------------------------------
def _naive_muon_through_its_container(rank, world):
    """Losses with ``name = "naive_muon"`` as benchmarks/naive_muon_job.py's config builds it (its
    NaiveMuonContainer), and with NaiveFSDPMuon built by hand on the same model (same seed, same options)."""
    import re

    from benchmarks.naive_muon_job import NaiveMuonContainer
    from titan_dmuon.integration.distributed.parallelize import DEFAULT_MUON_PARAMS
    from titan_dmuon.testing.baselines import NaiveFSDPMuon

    data = th.batches(2, world)
    model, container = th.build(
        th.tiny_llama3(),
        th.parallel_dims(world),
        optimizer="naive_muon",
        seed=3,
        lr=0.02,
        optimizer_config=NaiveMuonContainer.Config,
    )
    built = type(container).__name__, [type(o).__name__ for o in container.optimizers], container.dmuon_optimizers()
    losses = th.train(model, container, th.parallel_dims(world), data)
    model, _ = th.build(th.tiny_llama3(), th.parallel_dims(world), optimizer="AdamW", seed=3)
    targets = [p for n, p in model.named_parameters() if any(re.search(r, n) for r in DEFAULT_MUON_PARAMS)]
    by_hand = NaiveFSDPMuon(list(model.parameters()), muon_params=targets, lr=0.02)
    return built, losses, th.train(model, by_hand, th.parallel_dims(world), data)


def test_naive_muon_is_built_by_the_benchmarks_container(pool2):
    """The product does not import titan_dmuon.testing: ``name = "naive_muon"`` builds through the benchmark's
    config class (``NaiveMuonContainer.Config.build()`` makes its container, whose ``baseline_optimizer`` is
    NaiveFSDPMuon: one over every parameter, no fused/foreach kwargs, not counted as a DMuon optimizer), and
    it trains exactly as NaiveFSDPMuon built by hand (bitwise: same class, options and model)."""
    for built, losses, by_hand in pool2.run(_naive_muon_through_its_container):
        assert built == ("NaiveMuonContainer", ["NaiveFSDPMuon"], [])
        assert losses == by_hand and losses[1] < losses[0]
