"""What makes TorchTitan's HF export a folder that ``transformers`` loads as is.

TorchTitan's last save with ``checkpoint.last_save_in_hf`` writes the weights as HF safetensors
(through the model family's state-dict adapter), and nothing else: ``from_pretrained`` also
needs ``config.json`` (the architecture) and ``generation_config.json``; and it leaves the
per-rank files it consolidated from in a ``sharded/`` folder. ``DMuonCheckpointManager`` calls
``complete_hf_export`` after that save: it writes both files from the model's own arguments
(TorchTitan's model config, the one the adapter converted the weights with), copies the
tokenizer files of ``hf_assets_path`` (so ``AutoTokenizer`` loads the folder too) and removes
``sharded/``. Families: llama3 (``LlamaForCausalLM``) and qwen3, dense and MoE
(``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``); for the others the export stays TorchTitan's
(weights only) and a warning says so.
"""

from __future__ import annotations

import json
import os
import shutil

from torchtitan.tools.logging import logger

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


class NoHFConfig(ValueError):
    """The model has no HF architecture whose config this module can write (says why)."""


def complete_hf_export(folder: str, model_config, *, dtype: str, hf_assets_path: str | None) -> None:
    """After TorchTitan's HF save into ``folder`` (on one rank, once every rank's save returned)."""
    shutil.rmtree(os.path.join(folder, "sharded"), ignore_errors=True)  # consolidated into folder already
    tokens = _special_token_ids(hf_assets_path)
    try:
        config = hf_config(model_config, dtype=dtype, **tokens)
    except NoHFConfig as e:
        logger.warning(
            f"HF export in {folder}: weights only, no config.json ({e}); write one by hand to load it with transformers"
        )
        return
    _write_json(os.path.join(folder, "config.json"), config)
    _write_json(os.path.join(folder, "generation_config.json"), {"_from_model_config": True, **tokens})
    for name in TOKENIZER_FILES:
        if hf_assets_path and os.path.isfile(os.path.join(hf_assets_path, name)):
            shutil.copyfile(os.path.join(hf_assets_path, name), os.path.join(folder, name))
    logger.info(f"HF export in {folder}: {config['architectures'][0]} config.json, generation_config.json")


def hf_config(model_config, *, dtype: str = "float32", bos_token_id=None, eos_token_id=None) -> dict:
    """``config.json`` of the HF architecture that TorchTitan's state-dict adapter converts this
    model's weights for, from the model's own arguments (NoHFConfig where there is none)."""
    from torchtitan.models.llama3.model import Llama3Model
    from torchtitan.models.qwen3.model import Qwen3Model

    if isinstance(model_config, Llama3Model.Config):
        family = "llama"
    elif isinstance(model_config, Qwen3Model.Config):
        family = "qwen3"
    else:
        raise NoHFConfig(f"{type(model_config).__qualname__} is not llama3 or qwen3")
    layers = model_config.layers
    attention = layers[0].attention
    n_heads = attention.n_heads
    config = {
        "vocab_size": model_config.vocab_size,
        "hidden_size": model_config.dim,
        "num_hidden_layers": len(layers),
        "num_attention_heads": n_heads,
        "num_key_value_heads": attention.n_kv_heads or n_heads,  # (as GQAttention reads its config)
        "head_dim": attention.head_dim or model_config.dim // n_heads,
        "hidden_act": "silu",
        "rms_norm_eps": model_config.norm.eps,
        "tie_word_embeddings": bool(model_config.enable_weight_tying),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        **_rope(attention.rope),
    }
    dense = [layer.feed_forward for layer in layers if getattr(layer, "feed_forward", None) is not None]
    moe = [(i, layer.moe) for i, layer in enumerate(layers) if getattr(layer, "moe", None) is not None]
    if dense:
        config["intermediate_size"] = dense[0].w1.out_features
    if family == "llama":
        if moe:
            raise NoHFConfig("a llama3 model with MoE layers has no HF architecture")
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **config,
            "mlp_bias": False,
            "pretraining_tp": 1,
        }
    config.update(use_sliding_window=False, sliding_window=None, max_window_layers=len(layers))
    if not moe:
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **config}
    first = moe[0][1]
    router = first.router
    if (
        router.score_func != "softmax"
        or router.route_scale != 1.0
        or first.shared_experts is not None
        or router.num_expert_groups
    ):
        raise NoHFConfig("Qwen3MoE routes by a softmax over experts, top-k, without shared experts or expert groups")
    hidden = first.routed_experts.inner_experts.hidden_dim
    config.setdefault("intermediate_size", hidden)
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **config,
        "num_experts": first.num_experts,
        "num_experts_per_tok": router.top_k,
        "moe_intermediate_size": hidden,
        "norm_topk_prob": bool(router.route_norm),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(len(layers)) if i not in dict(moe)],
    }


def _rope(rope) -> dict:
    """RoPE as HF writes it (``rope_theta``, ``rope_scaling``: what transformers 4 and 5 both read)."""
    if rope.scaling == "none":
        scaling = None
    elif rope.scaling == "llama":
        scaling = {
            "rope_type": "llama3",
            "factor": rope.scaling_factor,
            "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
        }
    else:
        raise NoHFConfig(f"RoPE scaling {rope.scaling!r} is not written to HF configs here")
    return {"rope_theta": rope.theta, "rope_scaling": scaling, "max_position_embeddings": rope.max_seq_len}


def _special_token_ids(hf_assets_path: str | None) -> dict:
    """bos/eos token ids of the job's tokenizer (``tokenizer_config.json`` names them,
    ``tokenizer.json`` numbers them); None where the assets do not say."""
    ids = {"bos_token_id": None, "eos_token_id": None}
    try:
        with open(os.path.join(hf_assets_path, "tokenizer_config.json")) as f:
            names = json.load(f)
        with open(os.path.join(hf_assets_path, "tokenizer.json")) as f:
            added = {t["content"]: t["id"] for t in json.load(f).get("added_tokens", [])}
    except (OSError, TypeError, ValueError, KeyError):
        return ids
    for kind in ("bos", "eos"):
        token = names.get(f"{kind}_token")
        token = token.get("content") if isinstance(token, dict) else token
        ids[f"{kind}_token_id"] = added.get(token)
    return ids


def _write_json(path: str, value: dict) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2)
        f.write("\n")
