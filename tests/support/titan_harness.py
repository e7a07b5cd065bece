"""TorchTitan models in-process on the gloo pools, parallelized exactly as the trainer does it.

Tiny models of each family are built from TorchTitan's own layer builders with
small numbers (the shipped debug models cost seconds per step on 2 CPU cores);
``build`` runs DMuon's parallelize step (the family's own parallelize_fn with
DMuon's dedication) or TorchTitan's own, materialises and initialises the
model as ``Trainer.__init__`` does, and builds the optimizer container;
``train`` runs steps with TorchTitan's loss normalisation (sum over local tokens
divided by the global token count; FSDP2 sums).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from titan_dmuon.integration import cpu

cpu.enable()  # before TorchTitan's modules are imported (each function below imports them)

VOCAB = 256
SEQ = 16


def tiny_llama3(*, fuse_qkv: bool = True, dim: int = 64, n_layers: int = 2, hidden_dim: int | None = None):
    """(model config, family parallelize_fn, post_optimizer_build_fn); ``hidden_dim``: the MLP's (2 x dim)."""
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    layers = llama3._build_llama3_layers(
        n_layers=n_layers,
        dim=dim,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=hidden_dim or 2 * dim,
        fuse_qkv=fuse_qkv,
        rope=ComplexRoPE.Config(dim=dim // 4, max_seq_len=64, theta=500000, scaling="llama"),
        attn_backend="flex",
    )
    config = llama3.Llama3Model.Config(
        dim=dim,
        vocab_size=VOCAB,
        layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=llama3._output_linear_init(dim)),
    )
    return config, llama3.model_registry("debugmodel")


def tiny_qwen3(*, dim: int = 64, n_layers: int = 2):
    """Dense qwen3 (q/k norms, head_dim set apart from dim // n_heads)."""
    import torchtitan.models.qwen3 as qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    layers = qwen3._build_qwen3_layers(
        n_layers=n_layers,
        dim=dim,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        hidden_dim=2 * dim,
        attn_backend="flex",
        rope=CosSinRoPE.Config(dim=32, max_seq_len=64, theta=1000000.0),
    )
    config = qwen3.Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=dim,
        norm=qwen3._qwen3_norm(dim),
        layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=qwen3._LINEAR_INIT),
    )
    return config, qwen3.model_registry("debugmodel")


def tiny_qwen3_moe(*, experts: int = 8, dim: int = 64, n_layers: int = 2):
    import torchtitan.models.qwen3 as qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    layers = qwen3._build_qwen3_moe_layers(
        fuse_qkv=True,
        n_layers=n_layers,
        dim=dim,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        moe_hidden_dim=32,
        num_experts=experts,
        top_k=2,
        attn_backend="flex",
        moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=16, max_seq_len=64, theta=1000000.0),
    )
    config = qwen3.Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=dim,
        norm=qwen3._qwen3_norm(dim),
        layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=qwen3._LINEAR_INIT),
    )
    return config, qwen3.model_registry("debugmodel_moe")


def tiny_deepseek_v3(*, experts: int = 8, q_lora_rank: int = 0, dim: int = 64):
    """MLA attention, a dense first layer, routed + shared experts."""
    import torchtitan.models.deepseek_v3 as ds
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    layers = ds._build_dsv3_layers(
        n_layers=3,
        n_dense_layers=1,
        dim=dim,
        n_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        mscale=0.70,
        dense_hidden_dim=128,
        moe_hidden_dim=32,
        num_experts=experts,
        num_shared_experts=2,
        router_top_k=2,
        router_score_func="softmax",
        attn_backend="flex",
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(
            dim=8,
            max_seq_len=64,
            theta=10000.0,
            scaling="yarn",
            rope_factor=40.0,
            beta_fast=32.0,
            beta_slow=1.0,
            original_seq_len=64,
        ),
    )
    config = ds.DeepSeekV3Model.Config(
        vocab_size=VOCAB,
        dim=dim,
        layers=layers,
        mtp_layers=[],
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=ds._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=ds._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=ds._output_linear_init(dim)),
    )
    return config, ds.model_registry("debugmodel")


SPMD_DIMS: dict = {}  # per worker process: the spmd_types backend keeps the first ParallelDims' meshes


def parallel_dims(world: int, *, replicate: int = 1, ep: int = 1, tp: int = 1, cp: int = 1):
    """TorchTitan's ParallelDims. With tensor or context parallelism (spmd_types backend) one object per
    layout and worker process, as in a trainer process: the backend's SPMD annotations name the meshes
    of the first one built, and FSDP2 refuses parameters annotated with another mesh object."""
    if tp > 1 or cp > 1:
        key = (world, replicate, ep, tp, cp)
        if key not in SPMD_DIMS:
            SPMD_DIMS[key] = _new_parallel_dims(world, replicate=replicate, ep=ep, tp=tp, cp=cp)
        return SPMD_DIMS[key]
    return _new_parallel_dims(world, replicate=replicate, ep=ep, tp=tp, cp=cp)


def _new_parallel_dims(world: int, *, replicate: int, ep: int, tp: int, cp: int):
    from torchtitan.distributed import ParallelDims

    return ParallelDims(
        dp_replicate=replicate,
        dp_shard=world // (replicate * tp * cp),
        cp=cp,
        tp=tp,
        pp=1,
        ep=ep,
        world_size=world,
        # expert parallelism runs on gloo only with partial_dtensor; DMuon's TP takes spmd_types' TP-local shards;
        # context parallelism runs on the CPU with spmd_types (integration/cpu.py)
        spmd_backend="spmd_types" if tp > 1 or cp > 1 else "partial_dtensor",
    )


def build(
    model_and_spec,
    dims,
    *,
    optimizer: str = "dmuon",
    seed: int = 0,
    state: dict | None = None,
    compile: bool = False,
    param_dtype: str = "bfloat16",
    ac_config=None,
    optimizer_config: type | None = None,
    **optimizer_kwargs,
):
    """(model, optimizer container) as TorchTitan's Trainer would build them (``param_dtype``:
    training.mixed_precision_param, FSDP2's compute dtype; ``ac_config``: TorchTitan's
    activation checkpointing, e.g. ``SelectiveAC.Config()``; ``optimizer_config``: the container's
    config class, default DMuon's)."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import utils as dist_utils

    from titan_dmuon.integration.components.optimizer_container import DMuonOptimizersContainer
    from titan_dmuon.integration.distributed.parallelize import (
        DedicationSettings,
        parallelize_with_dmuon,
        parallelize_without_dmuon,
    )

    model_config, spec = model_and_spec
    dist_utils.set_spmd_backend(dims.spmd_backend)  # as Trainer.__init__ does
    parallelism = ParallelismConfig(
        spmd_backend=dims.spmd_backend,
        expert_parallel_degree=dims.ep,
        tensor_parallel_degree=dims.tp,
        context_parallel_degree=dims.cp,
    )
    model_config.update_from_config(config=_Parallelism(parallelism))  # sharding plans (expert parallelism)
    cpu.use_sdpa_attention(model_config, context_parallel=dims.cp > 1)
    with torch.device("meta"):
        model = model_config.build()
    kwargs = dict(
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param=param_dtype),
        ac_config=ac_config,
        parallelism=parallelism,
        compile_config=CompileConfig(enable=compile, components=["model"]),
        dump_folder="/tmp",
    )
    if optimizer == "dmuon":
        settings = DedicationSettings(
            **{
                k: optimizer_kwargs.pop(k)
                for k in ("muon_params", "reshard_after_forward", "ns_blocks", "owner_groups", "keep_whole")
                if k in optimizer_kwargs
            }
        )
        model = parallelize_with_dmuon(model, base_fn=spec.parallelize_fn, settings=settings, **kwargs)
    else:
        model = parallelize_without_dmuon(model, base_fn=spec.parallelize_fn, **kwargs)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    if state is not None:  # full tensors: shard those FSDP2 keeps as DTensors
        from torch.distributed.tensor import DTensor, distribute_tensor

        current = model.state_dict()
        model.load_state_dict(
            {
                k: distribute_tensor(v, current[k].device_mesh, current[k].placements, src_data_rank=None)
                if isinstance(current.get(k), DTensor)
                else v
                for k, v in state.items()
            }
        )
    model.train()
    config = (optimizer_config or DMuonOptimizersContainer.Config)(
        name=optimizer, implementation="for-loop", **optimizer_kwargs
    )
    container = config.build(model_parts=[model])
    if spec.post_optimizer_build_fn is not None:
        spec.post_optimizer_build_fn(container, [model], dims)
    return model, container


class _Parallelism:
    """What ``update_from_config`` reads from a trainer config outside the trainer."""

    def __init__(self, parallelism) -> None:
        self.parallelism = parallelism


def batches(steps: int, world: int, *, batch: int = 2, seed: int = 1, routed_vocab: int = VOCAB):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, routed_vocab, (batch * world, SEQ + 1), generator=g) for _ in range(steps)]


def train(
    model, container, dims, data, *, clip=None, norms: list | None = None, inf_norms: list | None = None
) -> list[float]:
    """Global mean loss per step (TorchTitan's normalisation; clipping with max_norm 1 by ``clip``,
    default DMuon's; each step's norm is appended to ``norms`` if given, and its max-norm, by DMuon's
    clip with norm_type inf before the clip, to ``inf_norms``)."""
    from torchtitan.distributed import utils as dist_utils

    from titan_dmuon import clip_grad_norm_
    from titan_dmuon.integration.trainer import dmuon_handles

    world = dist.get_world_size() // (dims.tp * dims.cp)  # data-parallel ranks (tp and cp ranks see the same batch)
    rank = dims.get_mesh("batch").get_local_rank() if world > 1 else 0
    context = dist_utils.get_spmd_context(parallel_dims=dims, spmd_typechecking=False)  # as Trainer's train_context
    losses = []
    for tokens in data:
        b = tokens.shape[0] // world
        local = tokens[rank * b : (rank + 1) * b]
        inputs, labels, kwargs = sequence_part(dims, local[:, :-1], local[:, 1:])
        with context():
            logits = model(inputs, **kwargs)
            if dims.tp > 1:  # loss parallel (TorchTitan's): each tp rank holds its vocabulary shard of the logits
                from torchtitan.components.loss import _LossParallelCrossEntropy

                summed = _LossParallelCrossEntropy.apply(logits, labels, dims.get_mesh("tp").get_group(), VOCAB, "sum")
            else:
                summed = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
            loss = summed / (tokens.shape[0] * SEQ)
            loss.backward()
        handles = dmuon_handles(container)
        if clip is None:
            clip = lambda params, max_norm: clip_grad_norm_(params, max_norm, dedicated=handles)  # noqa: E731
        if inf_norms is not None:
            inf_norms.append(float(_inf_norm([p for p in model.parameters()], handles)))
        norm = clip([p for p in model.parameters()], 1.0)
        if norms is not None:
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        container.step()
        container.zero_grad()
        total = loss.detach().clone() / dims.tp
        dist.all_reduce(total)
        losses.append(total.item())
    return losses


def sequence_part(dims, inputs, labels):
    """(inputs, labels, model kwargs) of this rank: under context parallelism its part of each sequence,
    as TorchTitan's trainer cuts it (``prepare_context_parallel_input``, head-tail load balancing), with
    the positions of those tokens; else all of it."""
    if dims.cp == 1:
        return inputs, labels, {}
    from torchtitan.distributed.context_parallel import prepare_context_parallel_input

    positions = torch.arange(inputs.shape[1]).expand(inputs.shape[0], -1)
    inputs, labels, kwargs = prepare_context_parallel_input(
        inputs, labels, {"positions": positions}, dims.get_mesh("cp"), torch.device("cpu")
    )
    return inputs, labels, kwargs


def _inf_norm(params, handles, pp_mesh=None):
    """The gradients' max-norm by DMuon's clip (max_norm inf: nothing is scaled)."""
    from titan_dmuon import clip_grad_norm_

    return clip_grad_norm_(params, float("inf"), norm_type=float("inf"), dedicated=handles, pp_mesh=pp_mesh)


def hf_export_expected(full: dict[str, torch.Tensor], parts, adapter) -> dict[str, torch.Tensor]:
    """What TorchTitan's HF export should hold of ``parts`` whose full weights are ``full`` (canonical
    names): each fused wqkv split as TorchTitan's state-dict hook splits it, through ``adapter``."""
    from torchtitan.components.checkpointer.utils import canonical_fqn
    from torchtitan.models.common.attention import FusedQKVLinear

    full = dict(full)
    for part in parts:
        for module_name, module in part.named_modules():
            if isinstance(module, FusedQKVLinear):
                prefix = canonical_fqn(module_name) + "."
                split = {f"{prefix}wqkv.weight": full.pop(f"{prefix}wqkv.weight")}
                FusedQKVLinear._split_qkv_on_save(module, split, prefix, None)
                full.update(split)
    return adapter.to_hf(full)


def initial_state(model_and_spec, seed: int = 0) -> dict[str, torch.Tensor]:
    """The weights a plain (unparallelized) build initialises, under TorchTitan's state-dict names
    (a fused wqkv is saved as wq/wk/wv): the same start for models built differently."""
    model_config, _ = model_and_spec
    cpu.use_sdpa_attention(model_config)
    with torch.device("meta"):
        model = model_config.build()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- pipeline parallelism, as the trainer runs it ---------------------------------------------------
def pp_dims(world: int, *, pp: int = 2, replicate: int = 1, cp: int = 1):
    from torchtitan.distributed import ParallelDims

    if cp > 1:  # (spmd_types: one object per layout and worker process, as parallel_dims explains)
        key = ("pp", world, pp, replicate, cp)
        if key not in SPMD_DIMS:
            SPMD_DIMS[key] = ParallelDims(
                dp_replicate=replicate,
                dp_shard=world // (pp * replicate * cp),
                cp=cp,
                tp=1,
                pp=pp,
                ep=1,
                world_size=world,
                spmd_backend="spmd_types",
            )
        return SPMD_DIMS[key]
    return ParallelDims(
        dp_replicate=replicate,
        dp_shard=world // (pp * replicate),
        cp=1,
        tp=1,
        pp=pp,
        ep=1,
        world_size=world,
        spmd_backend="partial_dtensor",
    )


def build_pp(
    model_and_spec,
    dims,
    *,
    schedule: str,
    local_batch: int,
    microbatch: int = 1,
    optimizer: str = "dmuon",
    seed: int = 0,
    state: dict | None = None,
    param_dtype: str = "bfloat16",
    ac_config=None,
    owner_groups=None,
    **optimizer_kwargs,
):
    """(pipeline schedule, model parts, has first stage, has last stage, optimizer container), built as
    TorchTitan's trainer builds them with pipeline parallelism (its pipeline_llm splits the model
    and runs the parallelize step on every part; DMuon's parallelize step is DMuonParallelize).
    ``owner_groups``: GroupOptions with every figure given, in place of the config's (measured)."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.pipeline_parallel import pipeline_llm

    from titan_dmuon.integration.components.optimizer_container import DMuonOptimizersContainer
    from titan_dmuon.integration.distributed.parallelize import DMuonParallelize

    model_config, spec = model_and_spec
    dist_utils.set_spmd_backend(dims.spmd_backend)
    parallelism = ParallelismConfig(
        spmd_backend=dims.spmd_backend,
        pipeline_parallel_degree=dims.pp,
        pipeline_parallel_schedule=schedule,
        pipeline_parallel_microbatch_size=microbatch,
        context_parallel_degree=dims.cp,
    )
    model_config.update_from_config(config=_Parallelism(parallelism))
    cpu.use_sdpa_attention(model_config, context_parallel=dims.cp > 1)
    with torch.device("meta"):
        model = model_config.build()
    container_kwargs = {
        k: optimizer_kwargs.pop(k) for k in ("muon_params", "reshard_after_forward") if k in optimizer_kwargs
    }
    opt_config = DMuonOptimizersContainer.Config(
        name=optimizer, implementation="for-loop", **container_kwargs, **optimizer_kwargs
    )
    parallelize = DMuonParallelize(base_fn=spec.parallelize_fn).bind(opt_config)
    if owner_groups is not None:
        settings = dataclasses.replace(parallelize.dedication, owner_groups=owner_groups)
        parallelize = dataclasses.replace(parallelize, dedication=settings)
    tokens = local_batch * SEQ

    def loss_fn(pred, labels):
        return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(), reduction="sum") / (
            tokens * dims.dp_shard * dims.dp_replicate
        ), None

    schedule_obj, parts, has_first, has_last = pipeline_llm(
        model,
        parallel_dims=dims,
        training=TrainingConfig(local_batch_size=local_batch, mixed_precision_param=param_dtype),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=ac_config,
        dump_folder="/tmp",
        device=torch.device("cpu"),
        model_config=model_config,
        parallelize_fn=parallelize,
        loss_fn=loss_fn,
    )
    torch.manual_seed(seed)
    for part in parts:
        part.to_empty(device="cpu")
        with torch.no_grad():
            part.init_weights(buffer_device=None)
        part.train()
    if state is not None:
        from torch.distributed.tensor import DTensor, distribute_tensor

        for part in parts:
            current = part.state_dict()
            part.load_state_dict(
                {
                    k: distribute_tensor(state[k], current[k].device_mesh, current[k].placements, src_data_rank=None)
                    if isinstance(current[k], DTensor)
                    else state[k]
                    for k in current
                }
            )
    container = opt_config.build(model_parts=parts)
    from titan_dmuon.integration.trainer import prepare_pipeline_schedule

    prepare_pipeline_schedule(schedule_obj, container)  # as DMuonTrainer does
    return schedule_obj, parts, has_first, has_last, container


def train_pp(dims, built, data, *, norms: list | None = None, inf_norms: list | None = None) -> list[float | None]:
    """One schedule step per batch of ``data`` (the global batch; this rank's data-parallel slice),
    gradient sync deferred to one reduce per step as DMuonTrainer does; global mean loss per step on
    the last stage's ranks, None elsewhere (the loss lives there)."""
    from torchtitan.distributed import utils as dist_utils

    from titan_dmuon import clip_grad_norm_
    from titan_dmuon.integration.trainer import dmuon_handles, finish_pipeline_reduces

    schedule, parts, has_first, has_last, container = built
    dp = dims.dp_shard * dims.dp_replicate
    context = dist_utils.get_spmd_context(parallel_dims=dims, spmd_typechecking=False)  # as Trainer's train_context
    rank = dims.get_mesh("batch").get_local_rank() if dp > 1 else 0
    handles = dmuon_handles(container)
    out = []
    for tokens in data:
        b = tokens.shape[0] // dp
        local = tokens[rank * b : (rank + 1) * b]
        losses = [] if has_last else None
        for handle in handles:
            handle.set_requires_gradient_sync(False)
        inputs, labels, kwargs = sequence_part(dims, local[:, :-1], local[:, 1:])
        with context():
            schedule.step(inputs if has_first else None, target=labels if has_last else None, losses=losses, **kwargs)
        finish_pipeline_reduces(handles)
        params = [p for m in parts for p in m.parameters()]
        if inf_norms is not None:
            inf_norms.append(float(_inf_norm(params, handles, dims.get_mesh("pp"))))
        norm = clip_grad_norm_(params, 1.0, dedicated=handles, pp_mesh=dims.get_mesh("pp"))
        if norms is not None:
            norms.append(float(norm))
        container.step()
        container.zero_grad()
        if has_last:
            total = torch.stack(losses).sum().detach().clone()
            if dp * dims.cp > 1:  # (over the data-parallel and context-parallel ranks: TorchTitan's loss mesh)
                dist.all_reduce(total, group=dims.get_mesh("loss").get_group())
            out.append(total.item())
        else:
            out.append(None)
    return out
