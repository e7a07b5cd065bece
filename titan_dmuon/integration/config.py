"""TOML job configs for TorchTitan 0.3.0 (which has none of its own).

A file in the classic TorchTitan layout::

    [job]        dump_folder, description
    [model]      name ("llama3" | "qwen3"), flavor ("debugmodel", "8B", ...), hf_assets_path
    [optimizer]  name = "dmuon" | "AdamW" | "Adam", and its settings
    [training] [parallelism] [checkpoint] [metrics] [lr_scheduler] [dataloader]
    [activation_checkpoint] (mode = "selective" | "full" | "none") [validator] [compile] [comm] [debug] [profiler]

starts from TorchTitan's own config for the model (``<name>_<flavor>`` in its
config_registry), then each key overrides the field of the same name in the
0.3.0 config dataclass of that section. ``--section.key value`` arguments
override the file (command line > TOML > TorchTitan defaults). Every key,
type and value is checked before any process group starts; errors name the
file (or the command line), the key, the bad value and what is expected.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import os
import re
import sys
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from titan_dmuon.muon_math import NS_EPS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SUPPORTED_MODELS = ("llama3", "qwen3")
TRAINER_SECTIONS = (  # TOML section == Trainer.Config attribute
    "optimizer", "lr_scheduler", "training", "parallelism", "checkpoint", "metrics", "dataloader",
    "activation_checkpoint", "validator", "compile", "comm", "debug", "profiler",
)
JOB_KEYS = {"dump_folder": str, "description": str}
MODEL_KEYS = {"name": str, "flavor": str, "hf_assets_path": str}
AC_MODES = ("selective", "full", "none")


class ConfigError(ValueError):
    """A bad job config: says where, which key, what value, and what is expected."""


@dataclass(frozen=True)
class _Setting:
    value: Any
    source: str  # file path or "command line"
    from_cli: bool


def load_config(config_file: str, cli_args: list[str] = (), *, world_size: int | None = None):
    """The TorchTitan ``Trainer.Config`` (DMuon-aware subclass) for a TOML file plus overrides."""
    settings = _read_toml(config_file)
    for section, key, value in _parse_cli(cli_args):
        settings.setdefault(section, {})[key] = _Setting(value, "command line", True)
    unknown = set(settings) - {"job", "model", *TRAINER_SECTIONS}
    if unknown:
        section = sorted(unknown)[0]
        where = next(iter(settings[section].values())).source
        raise ConfigError(
            f"{where}: unknown section [{section}]{_suggest(section, ['job', 'model', *TRAINER_SECTIONS])}; "
            f"valid sections: {', '.join(['job', 'model', *TRAINER_SECTIONS])}"
        )

    config = _base_config(settings.get("model", {}))
    _use_dmuon_components(config)
    for key, setting in settings.get("job", {}).items():
        value = _check_plain(setting, "job", key, JOB_KEYS)
        if key == "dump_folder":
            config.dump_folder = value
    if "hf_assets_path" in settings.get("model", {}):
        config.hf_assets_path = _check_plain(settings["model"]["hf_assets_path"], "model", "hf_assets_path", MODEL_KEYS)

    _apply_activation_checkpoint(config, settings.get("activation_checkpoint", {}))
    for section in TRAINER_SECTIONS:
        if section == "activation_checkpoint":
            continue
        target = getattr(config, section)
        for key, setting in settings.get(section, {}).items():
            _apply(target, section, key, setting)

    _validate(config, settings, world_size)
    return _finalize(config)


# ---- reading -------------------------------------------------------------------------
def _read_toml(path: str) -> dict[str, dict[str, _Setting]]:
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: config file not found")
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    out: dict[str, dict[str, _Setting]] = {}
    for section, table in raw.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: top-level key {section!r} must be a [section] table, got {table!r}")
        out[section] = {key: _Setting(value, path, False) for key, value in table.items()}
    return out


def _parse_cli(args) -> list[tuple[str, str, str]]:
    """``--section.key value`` / ``--section.key=value`` pairs."""
    out, args, i = [], list(args), 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"command line: expected --section.key value, got {arg!r}")
        if "=" in arg:
            name, value = arg[2:].split("=", 1)
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"command line: {arg} needs a value")
            name, value = arg[2:], args[i + 1]
            i += 1
        section, _, key = name.partition(".")
        out.append((section, key, value))
        i += 1
    return out


# ---- the base config and its sections --------------------------------------------------
def _base_config(model_settings: dict[str, _Setting]):
    for key, setting in model_settings.items():
        _check_plain(setting, "model", key, MODEL_KEYS)
    name_setting = model_settings.get("name")
    name = name_setting.value if name_setting else "llama3"
    if name not in SUPPORTED_MODELS:
        raise ConfigError(
            f"{name_setting.source}: [model] name = {name!r}: expected one of {', '.join(SUPPORTED_MODELS)}"
        )
    flavor_setting = model_settings.get("flavor")
    flavor = flavor_setting.value if flavor_setting else "debugmodel"
    registry = importlib.import_module(f"torchtitan.models.{name}.config_registry")
    function = f"{name}_{flavor.lower().replace('.', '_')}"
    if not hasattr(registry, function):
        flavors = sorted(f[len(name) + 1 :] for f in dir(registry) if f.startswith(f"{name}_") and callable(getattr(registry, f)))
        where = flavor_setting.source if flavor_setting else "defaults"
        raise ConfigError(f"{where}: [model] flavor = {flavor!r} has no TorchTitan config for {name}; expected one of {flavors}")
    return getattr(registry, function)()


def _apply_activation_checkpoint(config, settings: dict[str, _Setting]) -> None:
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    mode_setting = settings.get("mode")
    if mode_setting is not None:
        mode = _coerce(mode_setting, "activation_checkpoint", "mode", Literal[AC_MODES])
        config.activation_checkpoint = {"selective": SelectiveAC.Config(), "full": FullAC.Config(), "none": None}[mode]
    target = config.activation_checkpoint
    for key, setting in settings.items():
        if key == "mode":
            continue
        if target is None:
            raise ConfigError(f"{setting.source}: [activation_checkpoint] {key} has no effect with mode = \"none\"")
        _apply(target, "activation_checkpoint", key, setting)


def _apply(target, section: str, key: str, setting: _Setting) -> None:
    fields = {f.name: f for f in dataclasses.fields(target) if not f.name.startswith("_")}
    if key not in fields:
        raise ConfigError(
            f"{setting.source}: unknown key [{section}] {key}{_suggest(key, fields)}; "
            f"valid keys: {', '.join(sorted(fields))}"
        )
    annotation = typing.get_type_hints(type(target))[key]
    setattr(target, key, _coerce(setting, section, key, annotation))


def _check_plain(setting: _Setting, section: str, key: str, allowed: dict[str, type]):
    if key not in allowed:
        raise ConfigError(
            f"{setting.source}: unknown key [{section}] {key}{_suggest(key, allowed)}; valid keys: {', '.join(allowed)}"
        )
    return _coerce(setting, section, key, allowed[key])


# ---- types ----------------------------------------------------------------------------
def _coerce(setting: _Setting, section: str, key: str, annotation):
    """``setting.value`` as ``annotation``, or a ConfigError saying what was expected."""
    try:
        return _convert(setting.value, annotation, setting.from_cli)
    except (TypeError, ValueError) as e:
        raise ConfigError(
            f"{setting.source}: [{section}] {key} = {setting.value!r}: expected {_describe(annotation)}"
            + (f" ({e})" if str(e) else "")
        ) from None


def _convert(value, annotation, from_cli: bool):
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (value is None or (from_cli and str(value).lower() in ("none", "null"))):
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _convert(value, option, from_cli)
            except (TypeError, ValueError) as e:
                errors.append(e)
        raise ValueError("")
    if origin is Literal:
        if from_cli and not any(isinstance(a, str) for a in args):
            value = _convert(value, type(args[0]), True)
        if value not in args:
            raise ValueError("")
        return value
    if origin in (list, tuple):
        if from_cli and isinstance(value, str):
            value = [v.strip() for v in value.split(",")] if value else []
        if not isinstance(value, list):
            raise TypeError("")
        if origin is tuple:
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(_convert(v, args[0], from_cli) for v in value)
            if len(value) != len(args):
                raise ValueError(f"{len(args)} values")
            return tuple(_convert(v, a, from_cli) for v, a in zip(value, args))
        return [_convert(v, args[0], from_cli) for v in value] if args else value
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


def _describe(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("unset" if a is type(None) else _describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is list:
        return f"a list of {_describe(args[0])}" if args else "a list"
    if origin is tuple:
        return f"a list of {len(args)} {_describe(args[0])}s"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(annotation, str(annotation))


def _suggest(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ---- cross-key checks -------------------------------------------------------------------
def _validate(config, settings: dict[str, dict[str, _Setting]], world_size: int | None) -> None:
    def where(section: str, *keys: str) -> str:
        """Where the value came from: the key's source, else the section's, else the defaults."""
        for key in keys:
            if key in settings.get(section, {}):
                return settings[section][key].source
        return next(iter(settings.get(section, {}).values()), _Setting(None, "defaults", False)).source

    _validate_optimizer(config, settings.get("optimizer", {}), where)
    _validate_training(config.training, where)
    _validate_parallelism(config.parallelism, world_size, where)


def _validate_optimizer(config, optimizer_settings: dict[str, _Setting], where) -> None:
    from titan_dmuon.integration.optimizer import ADAMW_ONLY_KEYS, MUON_FAMILY_KEYS
    from titan_dmuon.integration.parallelize import check_supported
    from titan_dmuon.optimizer import OptionError, validate_options

    opt = config.optimizer
    muon_family = opt.name in ("dmuon", "naive_muon")
    for key, setting in optimizer_settings.items():
        if muon_family and key in ADAMW_ONLY_KEYS:
            hint = f"; with name = \"dmuon\" use adamw_{key} for the non-Muon parameters" if key != "implementation" else ""
            raise ConfigError(f"{setting.source}: [optimizer] {key} applies to name = \"AdamW\" only{hint}")
        if not muon_family and key in MUON_FAMILY_KEYS:
            raise ConfigError(f"{setting.source}: [optimizer] {key} applies to name = \"dmuon\" (or \"naive_muon\") only, not {opt.name!r}")
        if opt.name == "naive_muon" and key == "reshard_after_forward":
            raise ConfigError(f"{setting.source}: [optimizer] reshard_after_forward applies to name = \"dmuon\" only; naive_muon follows parallelism.fsdp_reshard_after_forward")
    if not muon_family:
        return
    keys = ("lr", "weight_decay", "momentum", "nesterov", "ns_steps", "adjust_lr_fn", "adamw_lr", "adamw_betas", "adamw_eps", "adamw_weight_decay")
    try:
        validate_options({**{k: getattr(opt, k) for k in keys}, "eps": NS_EPS})
    except OptionError as e:
        raise ConfigError(f"{where('optimizer', e.key)}: [optimizer] {e}") from None
    for pattern in opt.muon_params:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConfigError(f"{where('optimizer', 'muon_params')}: [optimizer] muon_params: bad regex {pattern!r} ({e})") from None
    if opt.name == "dmuon":
        try:
            check_supported(parallelism=config.parallelism, compile_config=config.compile, training=config.training)
        except NotImplementedError as e:
            raise ConfigError(f"{where('optimizer', 'name')}: {e}") from None


def _validate_training(training, where) -> None:
    for key in ("steps", "local_batch_size", "seq_len"):
        if getattr(training, key) <= 0:
            raise ConfigError(f"{where('training', key)}: [training] {key} = {getattr(training, key)}: expected a positive integer")
    if training.max_norm <= 0:
        raise ConfigError(f"{where('training', 'max_norm')}: [training] max_norm = {training.max_norm}: expected a positive number")


def _validate_parallelism(p, world_size: int | None, where) -> None:
    degrees = {
        "data_parallel_replicate_degree": p.data_parallel_replicate_degree,
        "tensor_parallel_degree": p.tensor_parallel_degree,
        "pipeline_parallel_degree": p.pipeline_parallel_degree,
        "context_parallel_degree": p.context_parallel_degree,
    }
    for key, degree in {**degrees, "expert_parallel_degree": p.expert_parallel_degree}.items():
        if degree < 1:
            raise ConfigError(f"{where('parallelism', key)}: [parallelism] {key} = {degree}: expected an integer >= 1")
    shard = p.data_parallel_shard_degree
    if shard != -1 and shard < 1:
        raise ConfigError(f"{where('parallelism', 'data_parallel_shard_degree')}: [parallelism] data_parallel_shard_degree = {shard}: expected -1 (use the remaining ranks) or an integer >= 1")
    if world_size is None:
        return
    others = 1
    for degree in degrees.values():
        others *= degree
    product = " * ".join(f"{k}({v})" for k, v in degrees.items())
    if shard == -1 and world_size % others:
        raise ConfigError(f"{where('parallelism')}: [parallelism] {product} = {others} does not divide the world size {world_size}")
    if shard != -1 and shard * others != world_size:
        raise ConfigError(
            f"{where('parallelism', 'data_parallel_shard_degree', 'data_parallel_replicate_degree')}: [parallelism] "
            f"data_parallel_shard_degree({shard}) * {product} = {shard * others}, but the world size is {world_size}; "
            "the degrees must multiply to the number of processes (data_parallel_shard_degree = -1 infers it)"
        )


# ---- into TorchTitan's objects --------------------------------------------------------
def _finalize(config):
    """Swap in DMuon-aware components and the CPU accommodations where needed."""
    from titan_dmuon.integration import cpu
    from titan_dmuon.integration.parallelize import DedicationSettings, parallelize_with_dmuon, parallelize_without_dmuon
    from titan_dmuon.integration.trainer import DMuonTrainer

    spec = config.model_spec
    if not cpu.accelerator_present():
        cpu.use_sdpa_attention(spec.model)
    if config.optimizer.name == "dmuon":
        settings = DedicationSettings(
            muon_params=tuple(config.optimizer.muon_params), reshard_after_forward=config.optimizer.reshard_after_forward
        )
        parallelize = _bind(parallelize_with_dmuon, settings=settings, base_fn=spec.parallelize_fn)
    else:
        parallelize = _bind(parallelize_without_dmuon, base_fn=spec.parallelize_fn)
    config.model_spec = dataclasses.replace(spec, parallelize_fn=parallelize)
    return DMuonTrainer.Config(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})


def _bind(fn, **bound):
    def parallelize_fn(model, **kwargs):
        return fn(model, **kwargs, **bound)

    parallelize_fn.__name__ = fn.__name__
    return parallelize_fn


def _as(cls, instance):
    return cls(**{f.name: getattr(instance, f.name) for f in dataclasses.fields(instance) if f.init})


def _use_dmuon_components(config) -> None:
    """TorchTitan's optimizer, metrics and checkpoint configs as DMuon-aware subclasses, same settings."""
    from titan_dmuon.integration.checkpoint import DMuonCheckpointManager
    from titan_dmuon.integration.optimizer import DMuonOptimizersContainer
    from titan_dmuon.integration.trainer import DMuonMetricsProcessor

    base = config.optimizer
    kwargs = base.param_groups[0].optimizer_kwargs if base.param_groups else {}
    config.optimizer = DMuonOptimizersContainer.Config(
        name=base.param_groups[0].optimizer_name if base.param_groups else "AdamW",
        implementation=base.implementation,
        **{k: (tuple(v) if k == "betas" else v) for k, v in kwargs.items() if k in ("lr", "betas", "eps", "weight_decay")},
    )
    config.metrics = _as(DMuonMetricsProcessor.Config, config.metrics)
    config.checkpoint = _as(DMuonCheckpointManager.Config, config.checkpoint)
