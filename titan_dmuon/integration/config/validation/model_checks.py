"""Checks against the model's parameters, built on the meta device (no memory, no process group):
``muon_params`` against names and shapes, DMuon param groups' patterns, QK-clip's and per-head blocks'
attention, expert counts.
"""

from __future__ import annotations

import copy
import difflib
import re

import torch
from torch import nn

from titan_dmuon.integration.components.optimizer_container import is_dmuon_group
from titan_dmuon.integration.config.validation.fault_tolerance_section import fault_tolerant, moe_problem
from titan_dmuon.integration.config.validation.naming import PYTHON_NAMES, ConfigError, Naming
from titan_dmuon.integration.config.validation.parallelism_section import validate_expert_parallelism
from titan_dmuon.integration.distributed.parallelize import DEFAULT_MUON_PARAMS, fused_qkv_blocks, routed_expert_counts
from titan_dmuon.integration.names import DMUON, MUON_FAMILY_NAMES
from titan_dmuon.runtime import canonical_fqn


# ---- checks against the model's parameters (built on the meta device) ----------------------
def validate_against_model(config, world_size: int | None, names: Naming) -> list[str]:
    opt, p = config.optimizer, config.parallelism
    muon = opt.name in MUON_FAMILY_NAMES
    if not muon and p.expert_parallel_degree == 1 and not fault_tolerant(config):
        return []  # nothing below needs the model: do not build it
    model = meta_model(config, names)
    warnings = _validate_muon_params(model, opt.muon_params, config.model_spec, names) if muon else []
    if opt.name == DMUON:
        _validate_dmuon_groups(model, opt, config.model_spec, names)
    if opt.name == DMUON and opt.qk_clip_threshold is not None:
        _validate_qk_clip(model, opt, config.model_spec, names, tp=p.tensor_parallel_degree)
    if opt.name == DMUON and opt.ns_blocks != "matrix":
        _validate_head_blocks(model, opt, config.model_spec, names, tp=p.tensor_parallel_degree)
    experts = routed_expert_counts(model)
    if (
        experts
        and fault_tolerant(config)
        and any(
            getattr(m, "load_balance_coeff", None) is not None for m in model.modules() if hasattr(m, "routed_experts")
        )
    ):
        raise ConfigError(moe_problem(names))
    if p.expert_parallel_degree > 1 and experts:
        validate_expert_parallelism(p, world_size, min(experts), dmuon=opt.name == DMUON, names=names)
    return warnings


def _validate_qk_clip(model: nn.Module, opt, spec, names: Naming, *, tp: int = 1) -> None:
    """QK-clip needs attention it knows the q/k row layout of, and those weights on Muon (dedicated)."""
    from titan_dmuon.integration.models.attention_clip import QKClipNotSupported, attention_descriptions, clip_weights

    key = names.key("optimizer", "qk_clip_threshold")
    try:
        descriptions = attention_descriptions(model, tp_size=tp)
    except QKClipNotSupported as e:
        raise ConfigError(f"{key} = {opt.qk_clip_threshold!r} with the {spec.name} {spec.flavor} model: {e}") from None
    if not descriptions:
        raise ConfigError(
            f"{key} = {opt.qk_clip_threshold!r}: the {spec.name} {spec.flavor} model has no attention module to clip"
        )
    names_of = {id(p): canonical_fqn(n) for n, p in model.named_parameters()}
    patterns = [re.compile(p) for p in opt.muon_params]
    for param in clip_weights(descriptions):
        name = names_of.get(id(param), "?")
        if not any(p.search(name) for p in patterns):
            raise ConfigError(
                f"{key} = {opt.qk_clip_threshold!r}: QK-clip rescales {name} on its Muon owner after the update, but "
                f"{names.key('optimizer', 'muon_params')} leaves it to AdamW; add it to the Muon targets"
            )


def _validate_head_blocks(model: nn.Module, opt, spec, names: Naming, *, tp: int = 1) -> None:
    """Per-head Newton–Schulz needs attention whose head layout it knows, and some of its projections on Muon."""
    from titan_dmuon.integration.models.attention_heads import HeadBlocksNotSupported, head_blocks

    key, model_name = names.key("optimizer", "ns_blocks"), f"the {spec.name} {spec.flavor} model"
    try:
        blocks = head_blocks(model, tp_size=tp)
    except HeadBlocksNotSupported as e:
        raise ConfigError(f'{key} = {opt.ns_blocks!r} with {model_name}: {e}; use ns_blocks = "matrix"') from None
    weights = [*blocks.split_rows, *blocks.split_cols]
    if not weights:
        raise ConfigError(
            f"{key} = {opt.ns_blocks!r}: {model_name} has no attention module to split by heads; "
            'use ns_blocks = "matrix"'
        )
    names_of = {id(p): canonical_fqn(n) for n, p in model.named_parameters()}
    patterns = [re.compile(p) for p in opt.muon_params]
    if not any(any(p.search(names_of.get(id(w), "")) for p in patterns) for w in weights):
        raise ConfigError(
            f"{key} = {opt.ns_blocks!r}: none of {model_name}'s attention projections is on Muon "
            f"({names.key('optimizer', 'muon_params')}), so no weight would be split by heads; add them or use "
            'ns_blocks = "matrix"'
        )


def meta_model(config, names: Naming = PYTHON_NAMES) -> nn.Module:
    """The job's model on the meta device, built as TorchTitan's trainer builds it (after its
    ``update_from_config``, on a copy: the trainer updates the config's own model config later)."""
    spec = config.model_spec
    model_config = copy.deepcopy(spec.model)
    try:
        model_config.update_from_config(config=config)
        with torch.device("meta"):
            return model_config.build()
    except (ValueError, TypeError, AssertionError, NotImplementedError) as e:
        message = " ".join(str(e).split()) or type(e).__name__
        raise ConfigError(
            f"{names.source('model', text=message)}TorchTitan cannot build the {spec.name} {spec.flavor} model "
            f"for this job: {message}"
        ) from None


def _validate_muon_params(model: nn.Module, patterns, spec, names: Naming) -> list[str]:
    """Each regex of ``optimizer.muon_params`` must select only matrices DMuon can train, and each
    entry of a list the user wrote must select something (DMuon's default list covers every
    supported family, so its entries for other families match nothing here)."""
    named = [(canonical_fqn(n), p) for n, p in model.named_parameters() if p.requires_grad]
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    key, model_name = names.key("optimizer", "muon_params"), f"the {spec.name} {spec.flavor} model"
    own_list = tuple(patterns) != DEFAULT_MUON_PARAMS
    selected: dict[int, str] = {}
    for pattern in patterns:
        regex = re.compile(pattern)
        hits = [(n, p) for n, p in named if regex.search(n)]
        if not hits and own_list:
            raise ConfigError(
                f"{key} entry '{pattern}' matches no parameter of {model_name}{_close_names(pattern, model)}; "
                f"its parameters are {', '.join(_overview(model))}"
            )
        for name, param in hits:
            if id(param) in embeddings:
                raise ConfigError(
                    f"{key} entry '{pattern}' selects {name}, the token embedding (an nn.Embedding): an embedding is a "
                    "lookup table whose rows are indexed by token ids, while Muon orthogonalises matrices that act on "
                    "activations, so it stays on AdamW; narrow or remove the entry"
                )
            if param.ndim not in (2, 3):
                raise ConfigError(
                    f"{key} entry '{pattern}' selects {name} of shape {tuple(param.shape)}: Muon needs 2-D weight "
                    "matrices or 3-D expert weights (experts, rows, cols), and norms and biases stay on AdamW; "
                    "narrow the entry (e.g. end it with the projection's name and \\.weight$)"
                )
            selected[id(param)] = name
    if not selected:
        listed = ", ".join(repr(p) for p in patterns)
        raise ConfigError(
            f"{key} = [{listed}] matches no parameter of {model_name}; its parameters are {', '.join(_overview(model))}"
        )
    return _fused_qkv_left_out(model, selected, key)


def _validate_dmuon_groups(model: nn.Module, opt, spec, names: Naming) -> None:
    """Each DMuon param group must claim a Muon target, as the container claims them (first match in config
    order, on canonical names): a group that claims none would leave its settings unused without a word."""
    groups = [g for g in opt.param_groups if is_dmuon_group(g)]
    if not groups:
        return
    selectors = [re.compile(p) for p in opt.muon_params]
    names_of = [canonical_fqn(n) for n, p in model.named_parameters() if p.requires_grad]
    targets = [n for n in names_of if any(r.search(n) for r in selectors)]
    key, claimed_by = names.key("optimizer", "param_groups"), {}
    for group in groups:
        regex = re.compile(group.pattern)
        hits = [n for n in targets if regex.search(n)]
        mine = [n for n in hits if n not in claimed_by]
        where = f"{key}: the group with pattern {group.pattern!r} (optimizer_name {group.optimizer_name!r})"
        if hits and not mine:
            raise ConfigError(
                f"{where} matches only Muon targets that the earlier DMuon group with pattern "
                f"{claimed_by[hits[0]]!r} claims (the first match wins), so its settings would apply to none; "
                "narrow the earlier pattern or remove this group"
            )
        if not mine:
            overview = ", ".join(dict.fromkeys(_collapsed(n) for n in targets))
            raise ConfigError(
                f"{where} matches no Muon target of the {spec.name} {spec.flavor} model; its Muon targets "
                f"(optimizer.muon_params) are {overview}"
            )
        claimed_by.update((n, group.pattern) for n in mine)


def _fused_qkv_left_out(model: nn.Module, selected: dict[int, str], key: str) -> list[str]:
    """A list written for separate q/k/v weights (README style: ``.attention.w``) puts the output
    projection on Muon but not TorchTitan's fused wqkv: valid, but probably not meant."""
    fqns = {id(p): canonical_fqn(n) for n, p in model.named_parameters()}
    left_out = set()
    for weight in fused_qkv_blocks(model):
        name = fqns[id(weight)]
        attention = name.removesuffix(".wqkv.weight").rsplit(".", 1)[0] + "."
        if id(weight) not in selected and any(n.startswith(attention) for n in selected.values()):
            left_out.add(_collapsed(name))
    return [
        f"{key} puts attention weights on Muon but leaves {name} (TorchTitan's fused q/k/v weight) on AdamW; "
        f"add the regex {_exact_regex(name)} to the list to train it with Muon (per q/k/v block)"
        for name in sorted(left_out)
    ]


def _collapsed(name: str) -> str:
    """``layers.3.attention.wo.weight`` as ``layers.*.attention.wo.weight``: one entry per kind of weight."""
    return re.sub(r"(?<=\.)\d+(?=\.)", "*", name)


def _overview(model: nn.Module) -> list[str]:
    return list(dict.fromkeys(_collapsed(canonical_fqn(n)) for n, _ in model.named_parameters()))


def _exact_regex(collapsed: str) -> str:
    return r"\." + re.escape(collapsed.split(".*.", 1)[-1]) + "$"


def _close_names(pattern: str, model: nn.Module) -> str:
    """ " (close names: ...)" for an entry that matches nothing, from its literal text."""
    literal = re.sub(r"\\(.)", r"\1", pattern).strip("^$")
    close = difflib.get_close_matches(literal, _overview(model), n=3, cutoff=0.5)
    hint = ""
    if re.search(r"\bw[qkv]\b", literal) and fused_qkv_blocks(model):
        hint = "; this model fuses wq/wk/wv into one qkv_linear.wqkv weight"
    return (f" (close names: {', '.join(close)})" if close else "") + hint
