"""The weights of TorchTitan's models as ``titan_dmuon.sizing`` needs them: names, shapes, which are
Muon targets, q/k/v row blocks and tensor-parallel split dims.

Two sources that agree (``tests/titan/test_sizing_model_shapes.py`` compares them weight by weight):

* shape tables (``SHAPE_TABLES``): llama3, deepseek_v3 and qwen3's MoE debug flavors of TorchTitan
  0.3.0's model registries, written out here, so that the sizing tool answers without TorchTitan
  (the lent GPU machine has none) and without building anything;
* TorchTitan itself (``from_registry``, ``from_toml``): the model built on the meta device, as the
  pre-launch check builds it, for every other flavor and for a TOML job's own config.

TorchTitan is imported only inside the two loaders.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from titan_dmuon.integration.names import DEFAULT_MUON_PARAMS
from titan_dmuon.plan.owner_groups import GroupOptions
from titan_dmuon.sizing.records import Layout, Weight

# Tensor parallelism in TorchTitan's parallelize functions: column-wise parallel linears split
# their rows (dim 0), row-wise ones their columns (dim 1); the router and MLA's down-projections
# (wq_a, wkv_a) are replicated; routed experts split their hidden dim (w1/w3: 1, w2: 2) unless
# expert parallelism keeps them whole.
_TP_DIMS = (
    (r"\.(qkv_linear\.wqkv|wq|wk|wv|wq_b|wkv_b)\.weight$", 0),
    (r"\.(feed_forward|shared_experts)\.w[13]\.weight$", 0),
    (r"\.(attention\.wo|feed_forward\.w2|shared_experts\.w2)\.weight$", 1),
    (r"\.inner_experts\.w[13]_EFD$", 1),
    (r"\.inner_experts\.w2_EDF$", 2),
    (r"^(tok_embeddings|lm_head|output)\.weight$", 0),
)


def tp_dim_of(fqn: str) -> int | None:
    """The dim TorchTitan's tensor parallelism splits (None: every TP rank holds the weight whole)."""
    return next((dim for pattern, dim in _TP_DIMS if re.search(pattern, fqn)), None)


def weights_of(
    named_shapes: Sequence[tuple[str, tuple[int, ...]]],
    *,
    muon_params: Sequence[str] = DEFAULT_MUON_PARAMS,
    blocks: dict[str, tuple] | None = None,
) -> list[Weight]:
    """``Weight`` records for a model's ``(name, shape)`` list, Muon targets picked by ``muon_params``
    (the regexes of ``[optimizer] muon_params``), layers read from ``layers.<i>.`` in the names."""
    patterns = [re.compile(p) for p in muon_params]
    out = []
    for fqn, shape in named_shapes:
        layer = re.match(r"layers\.(\d+)\.", fqn)
        out.append(
            Weight(
                fqn=fqn,
                shape=tuple(shape),
                muon=any(p.search(fqn) for p in patterns),
                layer=int(layer.group(1)) if layer else None,
                blocks=(blocks or {}).get(fqn),
                tp_dim=tp_dim_of(fqn),
            )
        )
    return out


# ---- the shape tables --------------------------------------------------------------------------------------
def _llama3(*, dim: int, layers: int, q_rows: int, kv_rows: int, hidden: int, vocab: int):
    shapes, blocks = [("tok_embeddings.weight", (vocab, dim))], {}
    for i in range(layers):
        wqkv = f"layers.{i}.attention.qkv_linear.wqkv.weight"
        shapes += [
            (wqkv, (q_rows + 2 * kv_rows, dim)),
            (f"layers.{i}.attention.wo.weight", (dim, q_rows)),
            (f"layers.{i}.feed_forward.w1.weight", (hidden, dim)),
            (f"layers.{i}.feed_forward.w2.weight", (dim, hidden)),
            (f"layers.{i}.feed_forward.w3.weight", (hidden, dim)),
            (f"layers.{i}.attention_norm.weight", (dim,)),
            (f"layers.{i}.ffn_norm.weight", (dim,)),
        ]
        # q, k and v orthogonalised apart (their rows interleave per kv group in TorchTitan's layout;
        # Newton–Schulz's cost depends on each block's row count only)
        blocks[wqkv] = (((0, q_rows),), ((q_rows, q_rows + kv_rows),), ((q_rows + kv_rows, q_rows + 2 * kv_rows),))
    shapes += [("norm.weight", (dim,)), ("lm_head.weight", (vocab, dim))]
    return shapes, blocks


def _deepseek_v3(
    *,
    dim: int,
    layers: int,
    dense_layers: int,
    q_lora_rank: int,
    heads: int,
    nope: int,
    rope: int,
    v_dim: int,
    kv_lora_rank: int,
    hidden: int,
    experts: int,
    moe_hidden: int,
    shared_hidden: int,
    vocab: int,
):
    shapes = [("tok_embeddings.weight", (vocab, dim))]
    for i in range(layers):
        a = f"layers.{i}.attention"
        q = (
            [
                (f"{a}.wq_a.weight", (q_lora_rank, dim)),
                (f"{a}.q_norm.weight", (q_lora_rank,)),
                (f"{a}.wq_b.weight", (heads * (nope + rope), q_lora_rank)),
            ]
            if q_lora_rank
            else [(f"{a}.wq.weight", (heads * (nope + rope), dim))]
        )
        shapes += q + [
            (f"{a}.wkv_a.weight", (kv_lora_rank + rope, dim)),
            (f"{a}.kv_norm.weight", (kv_lora_rank,)),
            (f"{a}.wkv_b.weight", (heads * (nope + v_dim), kv_lora_rank)),
            (f"{a}.wo.weight", (dim, heads * v_dim)),
            (f"layers.{i}.attention_norm.weight", (dim,)),
            (f"layers.{i}.ffn_norm.weight", (dim,)),
        ]
        if i < dense_layers:
            shapes += [
                (f"layers.{i}.feed_forward.w1.weight", (hidden, dim)),
                (f"layers.{i}.feed_forward.w2.weight", (dim, hidden)),
                (f"layers.{i}.feed_forward.w3.weight", (hidden, dim)),
            ]
        else:
            m = f"layers.{i}.moe"
            shapes += [
                (f"{m}.routed_experts.inner_experts.w1_EFD", (experts, moe_hidden, dim)),
                (f"{m}.routed_experts.inner_experts.w2_EDF", (experts, dim, moe_hidden)),
                (f"{m}.routed_experts.inner_experts.w3_EFD", (experts, moe_hidden, dim)),
                (f"{m}.router.gate.weight", (experts, dim)),
                (f"{m}.shared_experts.w1.weight", (shared_hidden, dim)),
                (f"{m}.shared_experts.w2.weight", (dim, shared_hidden)),
                (f"{m}.shared_experts.w3.weight", (shared_hidden, dim)),
            ]
    shapes += [("norm.weight", (dim,)), ("lm_head.weight", (vocab, dim))]
    return shapes, {}


def _qwen3_moe(
    *, dim: int, layers: int, q_rows: int, kv_rows: int, head_dim: int, experts: int, moe_hidden: int, vocab: int
):
    shapes, blocks = [("tok_embeddings.weight", (vocab, dim))], {}
    for i in range(layers):
        a, m = f"layers.{i}.attention", f"layers.{i}.moe"
        wqkv = f"{a}.qkv_linear.wqkv.weight"
        shapes += [
            (wqkv, (q_rows + 2 * kv_rows, dim)),
            (f"{a}.wo.weight", (dim, q_rows)),
            (f"{a}.q_norm.weight", (head_dim,)),
            (f"{a}.k_norm.weight", (head_dim,)),
            (f"{m}.routed_experts.inner_experts.w1_EFD", (experts, moe_hidden, dim)),
            (f"{m}.routed_experts.inner_experts.w2_EDF", (experts, dim, moe_hidden)),
            (f"{m}.routed_experts.inner_experts.w3_EFD", (experts, moe_hidden, dim)),
            (f"{m}.router.gate.weight", (experts, dim)),
            (f"layers.{i}.attention_norm.weight", (dim,)),
            (f"layers.{i}.ffn_norm.weight", (dim,)),
        ]
        blocks[wqkv] = (((0, q_rows),), ((q_rows, q_rows + kv_rows),), ((q_rows + kv_rows, q_rows + 2 * kv_rows),))
    shapes += [("norm.weight", (dim,)), ("lm_head.weight", (vocab, dim))]
    return shapes, blocks


_DSV3_MLA = dict(nope=128, rope=64, v_dim=128, kv_lora_rank=512)
SHAPE_TABLES: dict[tuple[str, str], Callable[[], tuple[list, dict]]] = {
    ("llama3", "debugmodel"): lambda: _llama3(dim=256, layers=6, q_rows=256, kv_rows=256, hidden=768, vocab=2048),
    ("llama3", "8B"): lambda: _llama3(dim=4096, layers=32, q_rows=4096, kv_rows=1024, hidden=14336, vocab=128256),
    ("llama3", "70B"): lambda: _llama3(dim=8192, layers=80, q_rows=8192, kv_rows=1024, hidden=28672, vocab=128256),
    ("llama3", "405B"): lambda: _llama3(dim=16384, layers=126, q_rows=16384, kv_rows=1024, hidden=53248, vocab=128256),
    ("deepseek_v3", "debugmodel"): lambda: _deepseek_v3(
        dim=256,
        layers=6,
        dense_layers=1,
        q_lora_rank=0,
        heads=16,
        **_DSV3_MLA,
        hidden=1024,
        experts=8,
        moe_hidden=256,
        shared_hidden=512,
        vocab=2048,
    ),
    ("deepseek_v3", "16B"): lambda: _deepseek_v3(
        dim=2048,
        layers=27,
        dense_layers=1,
        q_lora_rank=0,
        heads=16,
        **_DSV3_MLA,
        hidden=10944,
        experts=64,
        moe_hidden=1408,
        shared_hidden=2816,
        vocab=102400,
    ),
    ("deepseek_v3", "671B"): lambda: _deepseek_v3(
        dim=7168,
        layers=61,
        dense_layers=3,
        q_lora_rank=1536,
        heads=128,
        **_DSV3_MLA,
        hidden=18432,
        experts=256,
        moe_hidden=2048,
        shared_hidden=2048,
        vocab=129280,
    ),
    ("qwen3", "debugmodel_moe"): lambda: _qwen3_moe(
        dim=256, layers=8, q_rows=2048, kv_rows=1024, head_dim=128, experts=64, moe_hidden=768, vocab=2048
    ),
}


def table_key(name: str, flavor: str) -> tuple[str, str] | None:
    """The table entry for a model name and flavor (flavors compared without case), or None."""
    return next((key for key in SHAPE_TABLES if key[0] == name and key[1].lower() == flavor.lower()), None)


def from_table(name: str, flavor: str, *, muon_params: Sequence[str] = DEFAULT_MUON_PARAMS) -> list[Weight]:
    shapes, blocks = SHAPE_TABLES[table_key(name, flavor)]()
    return weights_of(shapes, muon_params=muon_params, blocks=blocks)


# ---- TorchTitan, on the meta device -----------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Job:
    """What the sizing tool reads of a TOML job: its weights, and what its config sets."""

    weights: list[Weight]
    layout: Layout | None  # None: the degrees leave the world size open (data_parallel_shard_degree = -1)
    reshard_after_forward: bool | None
    compute_dtype: str  # training.mixed_precision_param: FSDP2's param_dtype (master weights stay fp32)
    reduce_dtype: str
    description: str
    owner_groups: GroupOptions | None = None  # as the job dedicates (None: one owner per weight)
    keep_whole: tuple[str, ...] = ()  # regexes of weights that keep one owner (QK-clip's attention)


def registry_weights(name: str, flavor: str, *, muon_params: Sequence[str] = DEFAULT_MUON_PARAMS) -> list[Weight]:
    """The weights of ``flavor`` in TorchTitan's ``<name>`` model registry, built on the meta device."""
    import importlib

    import torch

    from titan_dmuon.integration.models.families import SUPPORTED

    if name not in SUPPORTED:
        raise ValueError(f"model {name!r}: expected one of {', '.join(SUPPORTED)}")
    family = importlib.import_module(f"torchtitan.models.{name}")
    flavors = next((v for k, v in vars(family).items() if k.endswith("_configs") and isinstance(v, dict)), {})
    key = next((f for f in flavors if f.lower() == flavor.lower()), flavor)
    if flavors and key not in flavors:
        raise ValueError(f"{name} has no flavor {flavor!r}; TorchTitan's registry has {', '.join(sorted(flavors))}")
    spec = family.model_registry(key)
    with torch.device("meta"):
        return _model_weights(spec.model.build(), muon_params)


def from_toml(config_file: str, cli_args: Sequence[str] = (), *, world_size: int | None = None) -> Job:
    """A TOML job (and ``--section.key value`` overrides) as the TOML door reads it, its model on the meta device."""
    from titan_dmuon.integration.config.toml_file import load_config
    from titan_dmuon.integration.config.validation.model_checks import meta_model

    config = load_config(config_file, list(cli_args), world_size=world_size)
    p, training, opt = config.parallelism, config.training, config.optimizer
    shard = p.data_parallel_shard_degree
    if shard == -1 and world_size is not None:
        shard = world_size // (
            p.data_parallel_replicate_degree
            * p.tensor_parallel_degree
            * p.pipeline_parallel_degree
            * p.context_parallel_degree
        )
    layout = (
        None
        if shard == -1
        else Layout(
            replicate=p.data_parallel_replicate_degree,
            shard=shard,
            tp=p.tensor_parallel_degree,
            pp=p.pipeline_parallel_degree,
            ep=p.expert_parallel_degree,
        )
    )
    from titan_dmuon.integration.distributed.parallelize import DedicationSettings

    muon_params = getattr(opt, "muon_params", DEFAULT_MUON_PARAMS)
    settings = DedicationSettings.of(opt)  # (the job's own owner groups and keep_whole, as it dedicates)
    return Job(
        owner_groups=settings.owner_groups,
        keep_whole=settings.keep_whole,
        weights=_model_weights(meta_model(config), muon_params),
        layout=layout,
        reshard_after_forward=getattr(opt, "reshard_after_forward", None),
        compute_dtype=training.mixed_precision_param,
        reduce_dtype=training.mixed_precision_reduce,
        description=f"{config_file}: {config.model_spec.name} {config.model_spec.flavor}",
    )


def _model_weights(model, muon_params: Sequence[str]) -> list[Weight]:
    from titan_dmuon.integration.distributed.parallelize import fused_qkv_blocks
    from titan_dmuon.runtime import canonical_fqn

    fqn_of = {id(p): canonical_fqn(n) for n, p in model.named_parameters()}
    blocks = {
        fqn_of[id(w)]: tuple(tuple(tuple(r) for r in block) for block in b) for w, b in fused_qkv_blocks(model).items()
    }
    named = [(canonical_fqn(n), tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]
    return weights_of(named, muon_params=muon_params, blocks=blocks)
