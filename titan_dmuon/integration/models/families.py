"""TorchTitan 0.3.0's model families under DMuon: which train with it, and why the others do not.

One table for both doors: the TOML layer (``[model] name``/``flavor``) and the
checks every DMuonTrainer.Config gets (its ``model_spec``).
"""

from __future__ import annotations

import importlib

# TOML [model] name -> TorchTitan's model_spec.name
SUPPORTED = {"llama3": "llama3", "qwen3": "qwen3", "deepseek_v3": "deepseek_v3", "kimi_k2_7": "kimi_k2_5"}

REFUSED = {
    "gpt_oss": (
        "its attention (learned sinks, sliding windows) runs only with varlen/flex attention, which has no CPU "
        "backward here, and SDPA would drop the sinks, so it was never trained or tested with DMuon"
    ),
    "qwen3_5": (
        "its Gated DeltaNet layers need flash-linear-attention (fla: Triton/CUDA only) and its configs a vision "
        "tower and image data, none of which runs or was tested here"
    ),
    "flux": "it is a diffusion model, not a decoder LLM",
    "muse_glimmer": "it is a vision-language model with an image tower DMuon has not been tested with",
}
MULTIMODAL_REASON = (
    "it has a vision encoder trained on image data (torchvision, a multimodal data loader), which DMuon has not "
    "been tested with; its text tower moonlight_16b_a3b is supported"
)


# TorchTitan's torchft experiment registers llama3 as "torchft/llama3": the same model, with DiLoCo's
# fragment function
FAULT_TOLERANT_PREFIX = "torchft/"


class ModelNotSupported(ValueError):
    """A TorchTitan model family DMuon refuses, with the reason."""


def check_model(spec) -> None:
    """Raise ModelNotSupported (naming the family and why) unless DMuon supports this model."""
    name = spec.name
    titan = name.removeprefix(FAULT_TOLERANT_PREFIX)
    family = next((toml for toml, titan_name in SUPPORTED.items() if titan_name == titan), titan)
    if family in REFUSED:
        raise ModelNotSupported(
            f"model {name!r} is not supported with optimizer.name = 'dmuon': {REFUSED[family]}; use 'AdamW'"
        )
    if family not in SUPPORTED:
        raise ModelNotSupported(
            f"model {name!r} is not supported with optimizer.name = 'dmuon' (supported: {', '.join(SUPPORTED)}); "
            "use 'AdamW'"
        )
    if getattr(spec.model, "vision_encoder", None) is not None:
        raise ModelNotSupported(
            f"model {name!r} ({spec.flavor}) is not supported with optimizer.name = 'dmuon': {MULTIMODAL_REASON}"
        )


def config_function(name: str, flavor: str):
    """TorchTitan's config function for a TOML ``[model] name``/``flavor``: ``<name>_<flavor>`` in the
    family's config registry, or ``<flavor>`` where the function has no prefix (kimi_k2_7's
    ``moonlight_16b_a3b``). ValueError naming the valid choices. (Families DMuon refuses load, for
    AdamW; ``check_model`` refuses them with dmuon.)"""
    if name not in SUPPORTED and name not in REFUSED:  # (REFUSED ones load; DMuon's checks refuse them)
        raise ValueError(f"[model] name = {name!r}: expected one of {', '.join(SUPPORTED)}")
    try:
        registry = importlib.import_module(f"torchtitan.models.{name}.config_registry")
    except ModuleNotFoundError as e:
        raise ValueError(
            f"[model] name = {name!r}: TorchTitan's {name} configs need {e.name!r} (pip install {e.name})"
        ) from None
    key = flavor.lower().replace(".", "_").replace("-", "_")
    for function in (f"{name}_{key}", key):
        if callable(getattr(registry, function, None)) and not function.startswith("_"):
            return getattr(registry, function)
    raise ValueError(
        f"[model] flavor = {flavor!r} has no TorchTitan config for {name}; expected one of {flavors(registry, name)}"
    )


def flavors(registry, name: str) -> list[str]:
    """The registry's config functions, without the model-name prefix where they have one."""
    from torchtitan.trainer import Trainer

    out = []
    for attr in dir(registry):
        fn = getattr(registry, attr)
        if attr.startswith("_") or not callable(fn) or getattr(fn, "__module__", None) != registry.__name__:
            continue
        if getattr(fn, "__annotations__", {}).get("return") not in (Trainer.Config, "Trainer.Config"):
            continue
        out.append(attr[len(name) + 1 :] if attr.startswith(f"{name}_") else attr)
    return sorted(out)
