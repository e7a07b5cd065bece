"""Checks of the ``[optimizer]`` section: DMuon's options, owner groups, QK-clip's limits, the switch to AdamW,
and the TOML door's keys that another optimizer would read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from titan_dmuon.integration.components.optimizer_container import (
    ADAMW_ONLY_KEYS,
    DMUON_OPTION_KEYS,
    MUON_FAMILY_KEYS,
    MUON_GROUP_KEYS,
    DMuonOptimizersContainer,
    baseline_not_built,
    dmuon_group_without_dmuon,
    is_dmuon_group,
)
from titan_dmuon.integration.config.validation.naming import ConfigError, Naming, command_line, toml_value
from titan_dmuon.integration.config.validation.parallelism_section import check_supported
from titan_dmuon.integration.models.families import ModelNotSupported, check_model
from titan_dmuon.integration.names import (
    ADAMW_NAMES,
    BASELINE_NAMES,
    DMUON,
    DMUON_FACTORY,
    MUON_FAMILY_NAMES,
    NAIVE_MUON,
)
from titan_dmuon.options import ADAMW_KEYS, JOB_KEYS, DMuonOptions, OptionError
from titan_dmuon.plan.owner_groups import GroupOptions

ADAMW_EXAMPLE = "train_configs/debug_model_adamw.toml"


# Muon-family keys only DMuon runs (the benchmarks' naive_muon baseline does not): their off values
DMUON_ONLY_DEFAULTS = {"normuon_beta2": None, "ns_dtype": "bfloat16", "ns_blocks": "matrix", "ns_graphs": False}


def validate_owner_groups(opt, names: Naming) -> None:
    """The owner groups' settings, checked as ``GroupOptions`` checks them (one line naming the key)."""
    for key, field_name in (("owner_group_node_size", "node_size"), ("owner_group_ns_tflops", "ns_tflops")):
        try:
            GroupOptions(**{field_name: getattr(opt, key)})
        except ValueError as e:
            expected = str(e).split("expected ", 1)[-1]
            raise ConfigError(f"{names.key('optimizer', key)} = {getattr(opt, key)!r}: expected {expected}") from None


def validate_param_groups(opt, names: Naming) -> None:
    """``optimizer.param_groups``: each pattern a regex; a DMuon group (``optimizer_name`` "DMuon") only in a
    dmuon job, its optimizer_kwargs per-group Muon settings (``MUON_GROUP_KEYS``) with values as DMuonOptions
    checks them; with dmuon, the other groups AdamW/Adam (the only optimizers DMuon's container builds beside
    it). Whether a DMuon group's pattern matches Muon targets is checked against the model (``model_checks``)."""
    key = names.key("optimizer", "param_groups")
    for group in opt.param_groups:
        where = f"{key}: the group with pattern {group.pattern!r}"
        try:
            re.compile(group.pattern)
        except re.error as e:
            raise ConfigError(f"{where}: bad regex ({e})") from None
        if not is_dmuon_group(group):
            if opt.name == DMUON and group.optimizer_name not in ADAMW_NAMES:
                raise ConfigError(
                    f"{where} has optimizer_name {group.optimizer_name!r}: with optimizer.name = 'dmuon' a group is "
                    f"{DMUON_FACTORY!r} (Muon targets, in a DMuon param group of their own) or one of "
                    f"{', '.join(repr(n) for n in ADAMW_NAMES)} (the other parameters)"
                )
            continue
        if opt.name != DMUON:
            raise ConfigError(dmuon_group_without_dmuon(group, opt.name, key))
        for option in group.optimizer_kwargs:
            if option not in MUON_GROUP_KEYS:
                why = (
                    f"{option} is job-wide: set it in [optimizer]"
                    if option in JOB_KEYS
                    else f"a DMuon group holds Muon targets only; its optimizer_kwargs are some of "
                    f"{', '.join(MUON_GROUP_KEYS)}"
                )
                raise ConfigError(f"{where}: optimizer_kwargs key {option!r} is not a per-group Muon setting ({why})")
        try:
            DMuonOptions(**{**{k: getattr(opt, k) for k in DMUON_OPTION_KEYS}, **group.optimizer_kwargs})
        except OptionError as e:
            raise ConfigError(f"{where}: optimizer_kwargs {e.key} = {e.value!r}: expected {e.expected}") from None


def validate_adamw_switch(opt, names: Naming) -> None:
    """TorchTitan's AdamW trains every parameter from the flat keys (lr, betas, eps, weight_decay).
    A DMuon config switched to AdamW (``--optimizer.name AdamW``) still carries Muon's lr there
    (e.g. 0.05) and AdamW's in ``adamw_*``; training would silently use Muon's."""
    differ = [
        (plain, adamw)
        for adamw, plain in ADAMW_KEYS.items()
        if _comparable(getattr(opt, plain)) != _comparable(getattr(opt, adamw))
    ]
    if not differ:
        return
    values = ", ".join(
        f"{plain} = {getattr(opt, plain)!r} but {adamw} = {getattr(opt, adamw)!r}" for plain, adamw in differ
    )
    fix = " ".join(command_line("optimizer", plain, getattr(opt, adamw)) for plain, adamw in differ)
    raise ConfigError(
        f"{names.key('optimizer', 'name')} = {opt.name!r} trains every parameter with TorchTitan's {opt.name} from "
        f"optimizer.lr/betas/eps/weight_decay, and they disagree with this config's AdamW settings (adamw_*, "
        f"which DMuon uses for the non-Muon parameters): {values}; to train with {opt.name} at those settings "
        f"pass {fix}"
    )


def _comparable(value):
    return tuple(value) if isinstance(value, (list, tuple)) else value


# ---- TOML: keys the job set that its optimizer would ignore or read differently ------------------
def validate_optimizer_keys(opt, sources: Mapping[str, str], *, file_name: str | None, config_file: str) -> None:
    """``sources``: each [optimizer] key the job set -> where (the file or "command line");
    ``file_name``: the file's own ``name``. Only the TOML door knows which keys were set."""
    muon_family = opt.name in MUON_FAMILY_NAMES
    switched = file_name is not None and (file_name in MUON_FAMILY_NAMES) != muon_family
    for key, source in sources.items():
        if muon_family and key in ADAMW_ONLY_KEYS:
            hint = f'; with name = "dmuon" use adamw_{key} for the non-Muon parameters'
            raise ConfigError(f'{source}: [optimizer] {key} applies to name = "AdamW" only{hint}')
        if not muon_family and key in MUON_FAMILY_KEYS:
            raise ConfigError(
                f'{source}: [optimizer] {key} applies to name = "dmuon" (or "naive_muon") only, not {opt.name!r}; '
                f"{_how_to_switch(opt, sources, config_file, switched)}"
            )
        if opt.name == NAIVE_MUON and key == "reshard_after_forward":
            raise ConfigError(
                f'{source}: [optimizer] reshard_after_forward applies to name = "dmuon" only; '
                "naive_muon follows parallelism.fsdp_reshard_after_forward"
            )
    shared = _read_as_another_optimizers(sources) if switched else []
    if shared:
        key = shared[0]
        raise ConfigError(
            f"{sources[key]}: [optimizer] {key} = {getattr(opt, key)!r} is written for name = {toml_value(file_name)} "
            f"(the file's optimizer), and the command line switches to name = {toml_value(opt.name)}, which would read "
            f"it as {'Muon' if muon_family else opt.name}'s {key}; give that on the command line too: "
            f"--optimizer.{key} <value>"
        )


def _read_as_another_optimizers(sources: Mapping[str, str]) -> list[str]:
    """The shared keys (Muon's with dmuon, AdamW's otherwise) that only the file set."""
    return [k for k in ("lr", "weight_decay") if sources.get(k, "command line") != "command line"]


def _how_to_switch(opt, sources: Mapping[str, str], config_file: str, switched: bool) -> str:
    muon_keys = [k for k in sources if k in MUON_FAMILY_KEYS]
    in_file = [k for k in muon_keys if sources[k] != "command line"]
    on_cli = [f"--optimizer.{k}" for k in muon_keys if sources[k] == "command line"]
    steps = ([f"remove {', '.join(in_file)} from [optimizer] in {config_file}"] if in_file else []) + (
        [f"leave out {' '.join(on_cli)}"] if on_cli else []
    )
    shared = _read_as_another_optimizers(sources) if switched else []
    if shared:
        values = " ".join(f"--optimizer.{k} <value>" for k in shared)
        steps.append(f"give {opt.name}'s {' and '.join(shared)} (the file's are Muon's): {values}")
    return (
        f"to train this job with {opt.name}, {' and '.join(steps)}, "
        f"or start from an {opt.name} file such as {ADAMW_EXAMPLE}"
    )


def validate_optimizer(config, names: Naming) -> None:
    """The [optimizer] section: DMuon's options (as ``DMuonOptions`` checks them), its regexes, owner groups,
    the keys that apply to 'dmuon' only, QK-clip's limits, and a switch to AdamW that keeps Muon's lr."""
    opt = config.optimizer
    if not isinstance(opt, DMuonOptimizersContainer.Config):
        raise ConfigError(
            f"optimizer: {type(opt).__qualname__} is not DMuon's optimizer config; set DMuon up with with_dmuon(config)"
        )
    if opt.name in BASELINE_NAMES and not opt.builds_baseline(opt.name):
        raise ConfigError(baseline_not_built(opt.name, names.key("optimizer", "name")))
    validate_param_groups(opt, names)
    if opt.name in MUON_FAMILY_NAMES:
        try:
            DMuonOptions(**{k: getattr(opt, k) for k in DMUON_OPTION_KEYS})
        except OptionError as e:
            raise ConfigError(f"{names.key('optimizer', e.key)} = {e.value!r}: expected {e.expected}") from None
        for pattern in opt.muon_params:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(f"{names.key('optimizer', 'muon_params')}: bad regex {pattern!r} ({e})") from None
        validate_owner_groups(opt, names)
        if opt.name == DMUON:
            try:
                check_supported(parallelism=config.parallelism, compile_config=config.compile, training=config.training)
                check_model(config.model_spec)
            except (NotImplementedError, ModelNotSupported) as e:
                raise ConfigError(f"{names.source('optimizer', 'name', text=str(e))}{e}") from None
        for key, default in DMUON_ONLY_DEFAULTS.items():
            if opt.name != DMUON and getattr(opt, key) != default:
                raise ConfigError(
                    f"{names.key('optimizer', key)} = {getattr(opt, key)!r} applies to optimizer.name = 'dmuon' only "
                    f"({opt.name!r} does not run it); leave it unset or use name = 'dmuon'"
                )
        if opt.qk_clip_threshold is not None:
            key = names.key("optimizer", "qk_clip_threshold")
            if opt.name != DMUON:
                raise ConfigError(f"{key} = {opt.qk_clip_threshold!r}: QK-clip runs with optimizer.name = 'dmuon' only")
            if config.compile.enable and "model" in config.compile.components:
                raise ConfigError(
                    f"{key} = {opt.qk_clip_threshold!r} with compile.enable = true: "
                    "QK-clip captures the logits with an "
                    "eager forward hook on each inner_attention, which TorchTitan's fullgraph-compiled blocks cannot "
                    "contain; turn compile off (or take 'model' out of compile.components) with QK-clip"
                )
    elif opt.name in ADAMW_NAMES:
        validate_adamw_switch(opt, names)
