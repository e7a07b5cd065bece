"""TOML job configs for TorchTitan 0.3.0 (which has none of its own).

A file in the classic TorchTitan layout::

    [job]        dump_folder, description
    [model]      name ("llama3" | "qwen3"), flavor ("debugmodel", "8B", ...), hf_assets_path
    [optimizer]  name = "dmuon" | "AdamW" | "Adam", and its settings
    [training] [parallelism] [checkpoint] [metrics] [lr_scheduler] [dataloader]
    [activation_checkpoint] (mode = "selective" | "full" | "none") [validator] [compile] [comm] [debug] [profiler]
    [validator.dataloader]  the held-out data (a nested config is a sub-table; ``--validator.dataloader.key``)
    [fault_tolerance]  TorchFT (TorchTitan's keys: enable, replica_id, group_size, semi_sync_method, ...)

starts from TorchTitan's own config for the model (``<name>_<flavor>`` in its
config_registry), then each key overrides the field of the same name in the
0.3.0 config dataclass of that section. ``--section.key value`` arguments
override the file (command line > TOML > TorchTitan defaults); true/false keys
also take TorchTitan's flags ``--section.key`` and ``--section.no-key``. Every
key, type and value is checked before any process group starts; errors name
the file (or the command line), the key, the bad value and what is expected.

This is a thin layer: it reads the file into TorchTitan's config, then sets
DMuon up as ``with_dmuon`` does (``trainer_config``, ``validation``,
``finalize``); it only knows which keys the file set, which
``validation.validate_optimizer_keys`` checks.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import os
import re
import sys
import typing
from dataclasses import dataclass
from typing import Any, Literal

from titan_dmuon.integration.config.finalize import finalize
from titan_dmuon.integration.config.trainer_config import as_subclass, dmuon_trainer_config
from titan_dmuon.integration.config.validation.naming import ConfigError, Naming, command_line, toml_value
from titan_dmuon.integration.config.validation.optimizer_section import validate_optimizer_keys
from titan_dmuon.integration.config.validation.validate import validate_dmuon
from titan_dmuon.integration.config.values import convert, describe, is_boolean
from titan_dmuon.integration.models.families import config_function
from titan_dmuon.integration.names import ADAMW_NAMES
from titan_dmuon.options import ADAMW_KEYS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

TRAINER_SECTIONS = (  # TOML section == Trainer.Config attribute
    "optimizer",
    "lr_scheduler",
    "training",
    "parallelism",
    "checkpoint",
    "metrics",
    "dataloader",
    "activation_checkpoint",
    "validator",
    "compile",
    "comm",
    "debug",
    "profiler",
)
FAULT_TOLERANCE = "fault_tolerance"  # TorchTitan's torchft section: only in fault-tolerant configs
JOB_KEYS = {"dump_folder": str, "description": str}
MODEL_KEYS = {"name": str, "flavor": str, "hf_assets_path": str}
AC_MODES = ("selective", "full", "none")


__all__ = ["ConfigError", "apply_command_line", "load_config"]


@dataclass(frozen=True)
class _Setting:
    value: Any
    source: str  # file path or "command line"
    from_cli: bool
    flag: str | None = None  # the command-line word of a flag (--section.key / --section.no-key)


def load_config(
    config_file: str,
    cli_args: list[str] = (),
    *,
    world_size: int | None = None,
    this_machine: bool = False,
    optimizer_config: type | None = None,
):
    """The TorchTitan ``Trainer.Config`` (DMuon-aware subclass) for a TOML file plus overrides
    (``this_machine``: the job is about to run here; see ``validate_dmuon``). ``optimizer_config``: a
    subclass of DMuon's optimizer config whose container the job builds instead (a benchmark's, which
    builds its baseline: benchmarks/naive_muon_job.py), given the same settings before they are checked."""
    from_file = _read_toml(config_file)
    settings = {section: dict(table) for section, table in from_file.items()}
    for section, key, setting in _parse_cli(cli_args):
        settings.setdefault(section, {})[key] = setting
    sections = ["job", "model", *TRAINER_SECTIONS, FAULT_TOLERANCE]
    unknown = set(settings) - set(sections)
    if unknown:
        section = sorted(unknown)[0]
        where = next(iter(settings[section].values())).source
        raise ConfigError(
            f"{where}: unknown section [{section}]{_suggest(section, sections)}; valid sections: {', '.join(sections)}"
        )

    # a [fault_tolerance] section (or --fault_tolerance.* overrides): DMuon's fault-tolerant trainer (TorchFT)
    config = dmuon_trainer_config(_base_config(settings.get("model", {})), fault_tolerant=FAULT_TOLERANCE in settings)
    if optimizer_config is not None:
        config.optimizer = as_subclass(optimizer_config, config.optimizer, "optimizer")
    file_optimizer = _file_optimizer_name(from_file, config.optimizer.name)
    for key, setting in settings.get("job", {}).items():
        value = _check_plain(setting, "job", key, JOB_KEYS)
        if key == "dump_folder":
            config.dump_folder = value
    if "hf_assets_path" in settings.get("model", {}):
        config.hf_assets_path = _check_plain(settings["model"]["hf_assets_path"], "model", "hf_assets_path", MODEL_KEYS)

    _apply_sections(config, settings)

    sources = {key: setting.source for key, setting in settings.get("optimizer", {}).items()}
    validate_optimizer_keys(config.optimizer, sources, file_name=file_optimizer, config_file=config_file)
    if config.optimizer.name in ADAMW_NAMES:
        _adamw_from_flat_keys(config.optimizer)
    validate_dmuon(config, world_size=world_size, names=_TomlNames(settings), this_machine=this_machine)
    try:
        return finalize(config, keep_cuda_graph_setting="disable_cuda_graphs" in settings.get("training", {}))
    except ConfigError as e:  # TorchTitan's own checks of the whole config
        raise ConfigError(f"{config_file}: {e}") from None


def apply_command_line(config, cli_args: list[str]) -> Naming:
    """The ``--section.key value`` overrides of another door's command line (TorchTitan's parser,
    which rejected them), applied to ``config`` the TOML door's way: a value of the wrong type is
    this door's one line (a ConfigError). Other arguments are skipped. Returns how errors name
    these settings (as the TOML door names command-line values), for ``validate_dmuon``."""
    settings = _command_line_settings(cli_args)
    _apply_sections(config, settings)
    return _TomlNames(settings)


def command_line_names(cli_args: list[str], *, otherwise: str) -> Naming:
    """How errors name the settings of a config that another door (TorchTitan's parser) built from
    ``otherwise`` (e.g. its config function) and these overrides: a value set on the command line
    is named "command line", any other ``otherwise``, as the TOML door names its file."""
    return _TomlNames(_command_line_settings(cli_args), otherwise=otherwise)


def _command_line_settings(cli_args: list[str]) -> dict[str, dict[str, _Setting]]:
    """The trainer's ``--section.key value`` settings among ``cli_args`` (others are skipped)."""
    kept, keep = [], False
    for arg in cli_args:
        if arg.startswith("--"):
            keep = "." in arg.partition("=")[0] and arg[2:].split(".", 1)[0].replace("-", "_") in (
                *TRAINER_SECTIONS,
                FAULT_TOLERANCE,
            )
        if keep:
            kept.append(arg)
    settings: dict[str, dict[str, _Setting]] = {}
    for section, key, setting in _parse_cli(kept):
        settings.setdefault(section, {})[key] = setting
    return settings


def _apply_sections(config, settings: dict[str, dict[str, _Setting]]) -> None:
    _apply_activation_checkpoint(config, settings.get("activation_checkpoint", {}))
    for section in (*TRAINER_SECTIONS, FAULT_TOLERANCE):
        if section == "activation_checkpoint" or section not in settings:
            continue
        target = getattr(config, section)
        for key, setting in settings.get(section, {}).items():
            _apply(target, section, key, setting)


def _file_optimizer_name(from_file: dict[str, dict[str, _Setting]], base_name: str) -> str | None:
    """The optimizer the file's own [optimizer] keys were written for (its name, else the base config's)."""
    setting = from_file.get("optimizer", {}).get("name")
    if setting is None:
        return base_name
    return setting.value if isinstance(setting.value, str) else None


def _adamw_from_flat_keys(opt) -> None:
    """With name = "AdamW"/"Adam" the file sets AdamW's flat keys (adamw_* are refused there):
    ``adamw_*`` follow them, so the config says one thing (validation refuses a config whose flat
    keys and adamw_* disagree: a DMuon config switched to AdamW)."""
    for adamw, plain in ADAMW_KEYS.items():
        setattr(opt, adamw, getattr(opt, plain))


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


def _parse_cli(args) -> list[tuple[str, str, _Setting]]:
    """``--section.key value`` / ``--section.key=value`` (``--section.key v1 v2``: a tuple or list),
    and TorchTitan's spellings of true/false keys: ``--section.key`` (true), ``--section.no-key`` or
    ``--section.no_key`` (false), with ``-`` or ``_`` in names. A word that starts with ``--`` is
    never taken as a value."""
    out, args, i = [], list(args), 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(
                f"command line: expected --section.key value, got {arg!r} "
                "(true/false keys also as flags: --section.key, --section.no-key)"
            )
        name, has_value, value = arg[2:].partition("=")
        flag = None
        if not has_value:
            values = list(itertools.takewhile(lambda a: not a.startswith("--"), args[i + 1 :]))
            if values:  # (several: a tuple or list, as TorchTitan's command line writes it)
                value, i = values[0] if len(values) == 1 else values, i + len(values)
            else:
                flag = arg
        section, _, key = name.replace("-", "_").partition(".")
        if flag is not None:
            key, value = (key[3:], False) if key.startswith("no_") else (key, True)
        out.append((section, key, _Setting(value, "command line", True, flag)))
        i += 1
    return out


# ---- the base config and its sections --------------------------------------------------
def _base_config(model_settings: dict[str, _Setting]):
    for key, setting in model_settings.items():
        _check_plain(setting, "model", key, MODEL_KEYS)
    name_setting, flavor_setting = model_settings.get("name"), model_settings.get("flavor")
    name = name_setting.value if name_setting else "llama3"
    flavor = flavor_setting.value if flavor_setting else "debugmodel"
    try:
        return config_function(name, flavor)()
    except ValueError as e:  # (ModelNotSupported too)
        where = flavor_setting if "flavor" in str(e) and flavor_setting else name_setting or flavor_setting
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
            raise ConfigError(f'{setting.source}: [activation_checkpoint] {key} has no effect with mode = "none"')
        _apply(target, "activation_checkpoint", key, setting)


def _apply(target, section: str, key: str, setting: _Setting) -> None:
    """``target.key`` from ``setting``; a nested config (e.g. ``[validator.dataloader]``, or
    ``--validator.dataloader.dataset_path`` on the command line) key by key."""
    dotted, (key, nested, rest) = key, key.partition(".")
    fields = {f.name: f for f in dataclasses.fields(target) if not f.name.startswith("_")}
    inner = getattr(target, key, None)
    is_config = dataclasses.is_dataclass(inner) and not isinstance(inner, type)
    if key not in fields or (nested and not is_config):
        raise ConfigError(
            f"{setting.source}: unknown key [{section}] {dotted}{_suggest(key, fields)}; "
            f"valid keys: {', '.join(sorted(fields))}"
        )
    if is_config and (nested or isinstance(setting.value, dict)):
        table = {rest: setting} if nested else {k: _Setting(v, setting.source, False) for k, v in setting.value.items()}
        for inner_key, inner_setting in table.items():
            _apply(inner, f"{section}.{key}", inner_key, inner_setting)
        return
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
    if setting.flag is not None and not is_boolean(annotation):
        problem = "needs a value" if setting.value else "sets false, a flag for true/false keys only"
        raise ConfigError(f"command line: {setting.flag} {problem} ([{section}] {key} expects {describe(annotation)})")
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


# ---- how errors name settings ----------------------------------------------------------------
def _mentions(text: str, key: str) -> bool:
    """``text`` names ``key`` (keys with an underscore only: ``tensor_parallel_degree``, not ``name``)."""
    return "_" in key and re.search(rf"(?<!\w){re.escape(key)}(?!\w)", text) is not None


class _TomlNames(Naming):
    """Errors name the file (or the command line) a value came from, and the key as [section] key."""

    def __init__(self, settings: dict[str, dict[str, _Setting]], *, otherwise: str = "defaults") -> None:
        self.settings = settings
        self.otherwise = otherwise  # where a value nobody set here came from

    def where(self, section: str, *keys: str) -> str:
        """Where the value came from: the keys' source (the command line if it set any of them, as
        it overrides the file; no keys: any of the section's), else the section's, else the defaults."""
        table = self.settings.get(section, {})
        sources = [table[key].source for key in keys or table if key in table]
        if sources:
            return "command line" if "command line" in sources else sources[0]
        return next(iter(table.values()), _Setting(None, self.otherwise, False)).source

    def key(self, section: str, key: str) -> str:
        return f"{self.where(section, key)}: [{section}] {key}"

    def section(self, section: str, *keys: str) -> str:
        return f"{self.where(section, *keys)}: [{section}]"

    def source(self, section: str, *keys: str, text: str = "") -> str:
        mentioned = [
            setting.source for table in self.settings.values() for key, setting in table.items() if _mentions(text, key)
        ]
        if mentioned:
            return f"{'command line' if 'command line' in mentioned else mentioned[0]}: "
        return f"{self.where(section, *keys)}: "

    def how_to_set(self, section: str, key: str, value) -> str:
        return f"[{section}] {key} = {toml_value(value)} ({command_line(section, key, value)})"
