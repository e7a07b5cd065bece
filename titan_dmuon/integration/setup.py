"""Setting DMuon up on a TorchTitan 0.3.0 ``Trainer.Config``: the one place where it happens.

Every door comes here: ``with_dmuon(config, lr=..., ...)`` for Python configs
(a config registry function, TorchTitan's ``--module/--config``), and the TOML
layer (``config.load_config``), which reads its file into TorchTitan's config
and then takes the same steps:

* ``dmuon_trainer_config``: a DMuonTrainer.Config whose optimizer, metrics and
  checkpoint configs are the DMuon-aware subclasses, with the same settings;
* ``validate_dmuon``: every cross-key check (optimizer options, unsupported
  parallelism and features, degrees vs the world size), as a one-line
  ConfigError naming the setting: ``optimizer.momentum = 1.5: expected a
  number in [0, 1)`` (the TOML layer also names the file);
* ``finalize``: the model spec (causal SDPA on a CPU machine; a parallelize_fn
  that DMuonTrainer binds to the optimizer config at build time).

TorchTitan's entry point calls the config function and THEN applies its
command-line overrides, which builds a new config object; so nothing here may
keep a config value for later. DMuonTrainer runs ``prepare_for_build`` on the
config it is actually given: it validates again (with the world size), before
any process group exists, and binds the parallelize step to that config's
optimizer settings.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from typing import Literal

from titan_dmuon.integration import cpu


class ConfigError(ValueError):
    """A bad job config: names the setting, the bad value and what is expected (from TOML, also where)."""


class Naming:
    """How an error names a setting. Python configs: ``optimizer.momentum``; TOML adds the file."""

    def key(self, section: str, key: str) -> str:
        return f"{section}.{key}"

    def section(self, section: str, *keys: str) -> str:
        return f"{section}:"

    def source(self, section: str, *keys: str) -> str:
        """Prefix for messages that name their settings themselves."""
        return ""


PYTHON_NAMES = Naming()


def with_dmuon(config, **options):
    """``config`` (any TorchTitan ``Trainer.Config``) trained with DMuon: a DMuonTrainer.Config.

    The keywords are the TOML ``[optimizer]`` keys of ``name = "dmuon"`` (``lr``,
    ``weight_decay``, ``momentum``, ``nesterov``, ``ns_steps``, ``adjust_lr_fn``,
    ``ns_mode``, ``adamw_lr``, ``adamw_betas``, ``adamw_eps``, ``adamw_weight_decay``,
    ``muon_params``, ``reshard_after_forward``), with the same meaning and checks.
    One left out keeps the config's value; on a plain TorchTitan config that is
    what TOML gives an unset key: ``lr`` and ``weight_decay`` from its AdamW, the
    others DMuon's defaults (``reshard_after_forward=None`` mirrors
    ``parallelism.fsdp_reshard_after_forward``; ``muon_params=None`` selects the
    attention and MLP projections). Like TorchTitan's registry functions this
    builds on ``config``: use the result, not the argument. Raises ConfigError
    naming the first bad setting.
    """
    from titan_dmuon.integration.optimizer import DEDICATION_KEYS, DMUON_OPTION_KEYS

    keys = DMUON_OPTION_KEYS + DEDICATION_KEYS
    unknown = sorted(set(options) - set(keys))
    if unknown:
        raise ConfigError(f"with_dmuon got unknown keyword(s) {unknown}; expected some of {', '.join(keys)}")
    cpu.enable()  # a user's registry module may be the first DMuon code TorchTitan imports
    config = dmuon_trainer_config(config)
    optimizer = config.optimizer
    optimizer.name = "dmuon"
    hints = typing.get_type_hints(type(optimizer))
    for key, value in options.items():
        if key == "muon_params" and value is None:
            from titan_dmuon.integration.parallelize import DEFAULT_MUON_PARAMS

            value = DEFAULT_MUON_PARAMS
        try:
            value = convert(value, hints[key], from_cli=False)
        except (TypeError, ValueError) as e:
            raise ConfigError(
                f"optimizer.{key} = {value!r}: expected {describe(hints[key])}" + (f" ({e})" if str(e) else "")
            ) from None
        setattr(optimizer, key, value)
    validate_dmuon(config)
    return finalize(config)


# ---- the steps ----------------------------------------------------------------------------
def dmuon_trainer_config(config):
    """``config`` as a DMuonTrainer.Config with DMuon-aware optimizer, metrics and checkpoint configs."""
    from torchtitan.trainer import Trainer

    from titan_dmuon.integration.checkpoint import DMuonCheckpointManager
    from titan_dmuon.integration.trainer import DMuonMetricsProcessor, DMuonTrainer

    if isinstance(config, DMuonTrainer.Config):
        cls = type(config)
    elif type(config) is Trainer.Config or _same_fields(config, Trainer.Config):
        cls = DMuonTrainer.Config  # (e.g. the Kimi recipes' config class: only extra checks, no extra settings)
    elif isinstance(config, Trainer.Config):
        raise ConfigError(
            f"{type(config).__qualname__} is the config of another trainer; DMuon runs DMuonTrainer "
            "(TorchTitan's Trainer with DMuon's clipping and metrics) and takes a Trainer.Config"
        )
    else:
        raise ConfigError(f"expected a TorchTitan Trainer.Config, got {type(config).__qualname__}")
    if config.model_spec is None:
        raise ConfigError("the config has no model_spec; start from a TorchTitan config registry function")
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    values["optimizer"] = _dmuon_optimizer_config(config.optimizer)
    values["metrics"] = _as_subclass(DMuonMetricsProcessor.Config, config.metrics, "metrics")
    values["checkpoint"] = _as_subclass(DMuonCheckpointManager.Config, config.checkpoint, "checkpoint")
    return cls(**values)


def _same_fields(config, cls) -> bool:
    return isinstance(config, cls) and {f.name for f in dataclasses.fields(config)} == {f.name for f in dataclasses.fields(cls)}


def _dmuon_optimizer_config(base):
    """TorchTitan's optimizer config as DMuon's container config.

    Its AdamW/Adam param groups are kept for the parameters Muon does not take (e.g. no weight
    decay on embeddings, Adam on the router); the catch-all group (pattern ".*") becomes the
    flat keys, AdamW's ``lr``/``betas``/``eps``/``weight_decay`` and, for DMuon, the same as
    ``adamw_*`` (the TOML layer's flat [optimizer] keys). TorchTitan's own Muon groups
    (DistMuon, in its Kimi recipes) give way to DMuon."""
    from torchtitan.components.optimizer import OptimizersContainer

    from titan_dmuon.integration.optimizer import CATCH_ALL, DMuonOptimizersContainer

    if isinstance(base, DMuonOptimizersContainer.Config):
        return base
    if type(base) is not OptimizersContainer.Config:
        raise ConfigError(
            f"optimizer: {type(base).__qualname__} cannot be combined with DMuon's optimizer container; "
            "start from TorchTitan's OptimizersContainer.Config"
        )
    groups = [g for g in base.param_groups if g.optimizer_name in ("AdamW", "Adam")]
    catch_all = next((g for g in groups if g.pattern == CATCH_ALL), None)
    flat = {
        k: (tuple(v) if k == "betas" else v)
        for k, v in (catch_all.optimizer_kwargs if catch_all else {}).items()
        if k in ("lr", "betas", "eps", "weight_decay")
    }
    return DMuonOptimizersContainer.Config(
        name=catch_all.optimizer_name if catch_all else "AdamW",
        implementation=base.implementation,
        param_groups=[g for g in groups if g is not catch_all],
        **flat,
        **{f"adamw_{k}": v for k, v in flat.items()},
    )


def _as_subclass(cls, instance, section: str):
    if isinstance(instance, cls):
        return instance
    if not issubclass(cls, type(instance)):
        raise ConfigError(
            f"{section}: {type(instance).__qualname__} cannot be combined with DMuon's {cls.__qualname__}; "
            f"start from TorchTitan's {cls.__mro__[1].__qualname__}"
        )
    return cls(**{f.name: getattr(instance, f.name) for f in dataclasses.fields(instance) if f.init})


def validate_dmuon(config, *, world_size: int | None = None, names: Naming = PYTHON_NAMES) -> None:
    """Every cross-key check of a DMuonTrainer.Config (any optimizer name); ConfigError on the first.

    The single place for such checks: with_dmuon, the TOML layer and DMuonTrainer
    (after command-line overrides, with the world size) all run it.
    """
    from titan_dmuon.integration.models import ModelNotSupported, check_model
    from titan_dmuon.integration.optimizer import DMUON_OPTION_KEYS, DMuonOptimizersContainer
    from titan_dmuon.integration.parallelize import check_supported
    from titan_dmuon.options import DMuonOptions, OptionError

    opt = config.optimizer
    if not isinstance(opt, DMuonOptimizersContainer.Config):
        raise ConfigError(f"optimizer: {type(opt).__qualname__} is not DMuon's optimizer config; set DMuon up with with_dmuon(config)")
    if opt.name in ("dmuon", "naive_muon"):
        try:
            DMuonOptions(**{k: getattr(opt, k) for k in DMUON_OPTION_KEYS})
        except OptionError as e:
            raise ConfigError(f"{names.key('optimizer', e.key)} = {e.value!r}: expected {e.expected}") from None
        for pattern in opt.muon_params:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(f"{names.key('optimizer', 'muon_params')}: bad regex {pattern!r} ({e})") from None
        if opt.name == "dmuon":
            try:
                check_supported(parallelism=config.parallelism, compile_config=config.compile, training=config.training)
                check_model(config.model_spec)
            except (NotImplementedError, ModelNotSupported) as e:
                raise ConfigError(f"{names.source('optimizer', 'name')}{e}") from None
    _validate_training(config.training, names)
    _validate_parallelism(config.parallelism, world_size, names)


def _validate_training(training, names: Naming) -> None:
    for key in ("steps", "local_batch_size", "seq_len"):
        if getattr(training, key) <= 0:
            raise ConfigError(f"{names.key('training', key)} = {getattr(training, key)}: expected a positive integer")
    if training.max_norm <= 0:
        raise ConfigError(f"{names.key('training', 'max_norm')} = {training.max_norm}: expected a positive number")


def _validate_parallelism(p, world_size: int | None, names: Naming) -> None:
    degrees = {
        "data_parallel_replicate_degree": p.data_parallel_replicate_degree,
        "tensor_parallel_degree": p.tensor_parallel_degree,
        "pipeline_parallel_degree": p.pipeline_parallel_degree,
        "context_parallel_degree": p.context_parallel_degree,
    }
    for key, degree in {**degrees, "expert_parallel_degree": p.expert_parallel_degree}.items():
        if degree < 1:
            raise ConfigError(f"{names.key('parallelism', key)} = {degree}: expected an integer >= 1")
    shard = p.data_parallel_shard_degree
    if shard != -1 and shard < 1:
        raise ConfigError(
            f"{names.key('parallelism', 'data_parallel_shard_degree')} = {shard}: "
            "expected -1 (use the remaining ranks) or an integer >= 1"
        )
    if world_size is None:
        return
    others = 1
    for degree in degrees.values():
        others *= degree
    product = " * ".join(f"{k}({v})" for k, v in degrees.items())
    if shard == -1 and world_size % others:
        raise ConfigError(f"{names.section('parallelism')} {product} = {others} does not divide the world size {world_size}")
    if shard != -1 and shard * others != world_size:
        raise ConfigError(
            f"{names.section('parallelism', 'data_parallel_shard_degree', 'data_parallel_replicate_degree')} "
            f"data_parallel_shard_degree({shard}) * {product} = {shard * others}, but the world size is {world_size}; "
            "the degrees must multiply to the number of processes (data_parallel_shard_degree = -1 infers it)"
        )


def finalize(config):
    """The model spec for DMuon, then a fresh config object, so that TorchTitan's own
    checks (``Trainer.Config.__post_init__``) see the final values."""
    _without_cuda_graphs(config)
    _finalize_model_spec(config)
    return type(config)(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})


def _without_cuda_graphs(config) -> None:
    """TorchTitan captures forward+backward in a CUDA graph by default on NVIDIA and then only
    replays it: DMuon's hooks would not run and its buffers would be replayed into. Off, loudly."""
    if config.optimizer.name != "dmuon" or config.training.disable_cuda_graphs:
        return
    from torchtitan.tools.logging import logger

    logger.warning(
        "training.disable_cuda_graphs = false: DMuon's hooks (weight broadcasts, gradient reduces, HSDP replica "
        "sync) must run every step, and a captured CUDA graph replays the step without them; turning CUDA "
        "graphs off. Set training.disable_cuda_graphs = true to silence this."
    )
    config.training.disable_cuda_graphs = True


def _finalize_model_spec(config) -> None:
    """Idempotent: causal SDPA without an accelerator; the optimizer-aware parallelize_fn."""
    from titan_dmuon.integration.parallelize import DMuonParallelize

    spec = config.model_spec
    if not cpu.accelerator_present():
        cpu.use_sdpa_attention(spec.model)
    if not isinstance(spec.parallelize_fn, DMuonParallelize):
        config.model_spec = dataclasses.replace(spec, parallelize_fn=DMuonParallelize(base_fn=spec.parallelize_fn))


def prepare_for_build(config):
    """DMuonTrainer's first step, on the config TorchTitan builds (command-line overrides applied):
    CPU mode, the checks again (now with the world size, still before any process group), and the
    parallelize step bound to this config's optimizer settings."""
    cpu.enable()
    world_size = os.environ.get("WORLD_SIZE")
    validate_dmuon(config, world_size=int(world_size) if world_size else None)
    _without_cuda_graphs(config)
    _finalize_model_spec(config)
    spec = config.model_spec
    config.model_spec = dataclasses.replace(spec, parallelize_fn=spec.parallelize_fn.bind(config.optimizer))
    return config


# ---- values as their annotated types ---------------------------------------------------------
def convert(value, annotation, *, from_cli: bool):
    """``value`` as ``annotation`` (TOML/Python values; strings too when ``from_cli``), else
    TypeError/ValueError (an empty message: ``describe(annotation)`` says what was expected)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (value is None or (from_cli and str(value).lower() in ("none", "null"))):
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return convert(value, option, from_cli=from_cli)
            except (TypeError, ValueError):
                pass
        raise ValueError("")
    if origin is Literal:
        if from_cli and not any(isinstance(a, str) for a in args):
            value = convert(value, type(args[0]), from_cli=True)
        if value not in args:
            raise ValueError("")
        return value
    if origin in (list, tuple):
        if from_cli and isinstance(value, str):
            value = [v.strip() for v in value.split(",")] if value else []
        if not isinstance(value, (list, tuple)):
            raise TypeError("")
        if origin is tuple:
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(convert(v, args[0], from_cli=from_cli) for v in value)
            if len(value) != len(args):
                raise ValueError(f"{len(args)} values")
            return tuple(convert(v, a, from_cli=from_cli) for v, a in zip(value, args))
        return [convert(v, args[0], from_cli=from_cli) for v in value] if args else list(value)
    if annotation is bool:
        if from_cli and isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        if not isinstance(value, bool):
            raise TypeError("")
        return value
    if annotation is int:
        if from_cli and isinstance(value, str):
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError("")
        return value
    if annotation is float:
        if from_cli and isinstance(value, str):
            value = float(value)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TypeError("")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise TypeError("")
        return value
    raise TypeError(f"this key cannot be set from a TOML file (type {annotation})")


def describe(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("unset" if a is type(None) else describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    plural = {bool: "true/false values", int: "integers", float: "numbers", str: "strings"}
    if origin is list:
        return f"a list of {plural.get(args[0], describe(args[0]))}" if args else "a list"
    if origin is tuple:
        return f"a list of {len(args)} {plural.get(args[0], describe(args[0]))}"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(annotation, str(annotation))
