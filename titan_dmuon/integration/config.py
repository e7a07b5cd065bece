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

This is a thin layer over ``setup.py``: it reads the file into TorchTitan's
config, then sets DMuon up exactly as ``with_dmuon`` does (same checks, same
finalisation); only the checks that need to know which keys the file set
(e.g. ``betas`` with name = "dmuon") live here.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import typing
from dataclasses import dataclass
from typing import Any, Literal

from titan_dmuon.integration.setup import (
    ConfigError,
    Naming,
    convert,
    describe,
    dmuon_trainer_config,
    finalize,
    validate_dmuon,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

TRAINER_SECTIONS = (  # TOML section == Trainer.Config attribute
    "optimizer", "lr_scheduler", "training", "parallelism", "checkpoint", "metrics", "dataloader",
    "activation_checkpoint", "validator", "compile", "comm", "debug", "profiler",
)
JOB_KEYS = {"dump_folder": str, "description": str}
MODEL_KEYS = {"name": str, "flavor": str, "hf_assets_path": str}
AC_MODES = ("selective", "full", "none")


__all__ = ["ConfigError", "load_config"]


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

    config = dmuon_trainer_config(_base_config(settings.get("model", {})))
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

    _check_optimizer_keys(config.optimizer, settings.get("optimizer", {}))
    validate_dmuon(config, world_size=world_size, names=_TomlNames(settings))
    return finalize(config)


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
    from titan_dmuon.integration.models import config_function

    for key, setting in model_settings.items():
        _check_plain(setting, "model", key, MODEL_KEYS)
    name_setting, flavor_setting = model_settings.get("name"), model_settings.get("flavor")
    name = name_setting.value if name_setting else "llama3"
    flavor = flavor_setting.value if flavor_setting else "debugmodel"
    try:
        return config_function(name, flavor)()
    except ValueError as e:  # (ModelNotSupported too)
        where = (flavor_setting if "flavor" in str(e) and flavor_setting else name_setting or flavor_setting)
        raise ConfigError(f"{where.source if where else 'defaults'}: {e}") from None


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
        return convert(setting.value, annotation, from_cli=setting.from_cli)
    except (TypeError, ValueError) as e:
        raise ConfigError(
            f"{setting.source}: [{section}] {key} = {setting.value!r}: expected {describe(annotation)}"
            + (f" ({e})" if str(e) else "")
        ) from None


def _suggest(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ---- checks that depend on which keys were set ----------------------------------------------
class _TomlNames(Naming):
    """Errors name the file (or the command line) a value came from, and the key as [section] key."""

    def __init__(self, settings: dict[str, dict[str, _Setting]]) -> None:
        self.settings = settings

    def where(self, section: str, *keys: str) -> str:
        """Where the value came from: the key's source, else the section's, else the defaults."""
        table = self.settings.get(section, {})
        for key in keys:
            if key in table:
                return table[key].source
        return next(iter(table.values()), _Setting(None, "defaults", False)).source

    def key(self, section: str, key: str) -> str:
        return f"{self.where(section, key)}: [{section}] {key}"

    def section(self, section: str, *keys: str) -> str:
        return f"{self.where(section, *keys)}: [{section}]"

    def source(self, section: str, *keys: str) -> str:
        return f"{self.where(section, *keys)}: "


def _check_optimizer_keys(opt, optimizer_settings: dict[str, _Setting]) -> None:
    """Keys the file set that the chosen optimizer would ignore."""
    from titan_dmuon.integration.optimizer import ADAMW_ONLY_KEYS, MUON_FAMILY_KEYS

    muon_family = opt.name in ("dmuon", "naive_muon")
    for key, setting in optimizer_settings.items():
        if muon_family and key in ADAMW_ONLY_KEYS:
            hint = f"; with name = \"dmuon\" use adamw_{key} for the non-Muon parameters" if key != "implementation" else ""
            raise ConfigError(f"{setting.source}: [optimizer] {key} applies to name = \"AdamW\" only{hint}")
        if not muon_family and key in MUON_FAMILY_KEYS:
            raise ConfigError(f"{setting.source}: [optimizer] {key} applies to name = \"dmuon\" (or \"naive_muon\") only, not {opt.name!r}")
        if opt.name == "naive_muon" and key == "reshard_after_forward":
            raise ConfigError(f"{setting.source}: [optimizer] reshard_after_forward applies to name = \"dmuon\" only; naive_muon follows parallelism.fsdp_reshard_after_forward")
