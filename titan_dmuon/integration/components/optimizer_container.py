"""``optimizer.name = "dmuon"`` for TorchTitan: an OptimizersContainer that builds DMuon.

TorchTitan 0.3.0 resolves optimizers from a fixed table; this container adds
"DMuon" to it. With ``name = "dmuon"`` the Muon targets (dedicated weights and
experts updated in place) go to one DMuon optimizer per model part, claimed
before any AdamW/Adam pattern: a param group whose ``optimizer_name`` is
"DMuon" (or "dmuon") takes the Muon targets its pattern matches (TorchTitan's
rule: first match in config order, ``re.search``, here on canonical names as
``muon_params``) into a DMuon param group of its own, its ``optimizer_kwargs``
over the flat Muon keys; the targets none claims form the last group, from the
flat keys. Every other parameter keeps TorchTitan's own param groups (its
AdamW/Adam, fused or foreach as ``implementation`` says), so a config's
groups (no weight decay on embeddings, Adam on the router, ...) keep their
settings. The catch-all group (pattern ``.*``) takes the flat keys: ``lr``,
``betas``, ``eps``, ``weight_decay`` with AdamW/Adam, ``adamw_*`` with dmuon.
``name = "AdamW"`` is then exactly TorchTitan's container. ``name = "naive_muon"`` (the benchmarks'
baseline, not part of DMuon) builds only in a subclass whose ``baseline_optimizer`` returns its factory
(benchmarks/naive_muon_job.py's), chosen by the config's class: this container builds none.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Literal

import tyro
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig
from torchtitan.tools.logging import logger

from titan_dmuon.integration.distributed.parallelize import DEFAULT_MUON_PARAMS
from titan_dmuon.integration.models.attention_heads import NS_BLOCKS
from titan_dmuon.integration.names import (
    ADAMW,
    ADAMW_FACTORY,
    BASELINE_NAMES,
    DMUON,
    DMUON_FACTORY,
    DMUON_GROUP_NAMES,
    OPTIMIZER_NAMES,
)
from titan_dmuon.optim.optimizer import DMuon
from titan_dmuon.options import JOB_KEYS, MUON_KEYS, OPTION_NAMES, DMuonOptions
from titan_dmuon.plan.owner_groups import GroupOptions
from titan_dmuon.runtime import DedicatedParams
from titan_dmuon.runtime.streams import DeviceTimer

# DMuon's options as [optimizer] keys: all of DMuonOptions but the Newton–Schulz constants
# (``eps`` is AdamW's name here); ``lr`` and ``weight_decay`` are shared with AdamW.
DMUON_OPTION_KEYS = tuple(k for k in OPTION_NAMES if k not in ("ns_coefficients", "eps"))
DEDICATION_KEYS = (
    "muon_params",
    "reshard_after_forward",
    "ns_blocks",
    "owner_groups",
    "owner_group_node_size",
    "owner_group_ns_tflops",
)
MUON_FAMILY_KEYS = tuple(k for k in DMUON_OPTION_KEYS if k not in ("lr", "weight_decay")) + DEDICATION_KEYS
ADAMW_ONLY_KEYS = ("betas", "eps")  # TorchTitan's flat AdamW keys, DMuonOptions' adamw_betas/adamw_eps
CATCH_ALL = ".*"
# What a DMuon param group's optimizer_kwargs may set: the per-group Muon options that [optimizer] sets too
# (not the job-wide ones, not ns_coefficients/eps, which [optimizer] leaves at torch.optim.Muon's: "eps" is
# AdamW's name in TorchTitan's groups)
MUON_GROUP_KEYS = tuple(k for k in MUON_KEYS if k in DMUON_OPTION_KEYS)
DEFAULT_MUON_GROUP = "optimizer.muon_params"  # how the log names the group of the unclaimed Muon targets


def is_dmuon_group(group: ParamGroupConfig) -> bool:
    """A param group that claims Muon targets (``optimizer_name`` "DMuon" or "dmuon")."""
    return group.optimizer_name in DMUON_GROUP_NAMES


def baseline_not_built(name: str, key: str) -> str:
    """The one-line error for a baseline name whose optimizer config's container does not build it."""
    return (
        f"{key} = {name!r}: the benchmarks' baseline (naive FSDP2 + Muon), which DMuon does not build itself; "
        "run it through its config module, whose container builds it (MODULE=benchmarks.naive_muon_job "
        'CONFIG=from_toml NAIVE_MUON_CONFIG_FILE=<job.toml> ./run_train.sh), or use name = "dmuon"'
    )


def dmuon_group_without_dmuon(group: ParamGroupConfig, name: str, key: str) -> str:
    """The one-line error for a DMuon param group in a job whose optimizer is not DMuon (``key``: the door's
    name for ``optimizer.param_groups``)."""
    return (
        f"{key}: the group with pattern {group.pattern!r} has optimizer_name {group.optimizer_name!r}, which puts "
        f'Muon targets in a DMuon param group, but optimizer.name = {name!r} trains no Muon; set name = "dmuon" '
        "or remove the group"
    )


# what the flat keys mean here, where the optimizer name decides it (the others: DMuonOptions' words)
_CONTAINER_HELP = {
    "lr": "Learning rate: Muon's with name = \"dmuon\", else AdamW's.",
    "weight_decay": "Decoupled weight decay: Muon's with name = \"dmuon\", else AdamW's.",
    "betas": 'AdamW betas (name = "AdamW"/"Adam").',
    "eps": 'AdamW epsilon (name = "AdamW"/"Adam").',
}


def _option_fields() -> list[tuple]:
    """The container's option fields, from DMuonOptions: ``name``, then ``lr``, ``weight_decay``, the flat
    AdamW keys (typed and defaulted as their ``adamw_*`` option) and the other options, each with its
    DMuonOptions type (its Literal lists included), default and attribute docstring (as the help text of
    TorchTitan's command line: ``Annotated``, which ``typing.get_type_hints`` drops for the doors)."""
    hints = typing.get_type_hints(DMuonOptions)
    defaults = {f.name: f.default for f in dataclasses.fields(DMuonOptions)}
    docs = {**attribute_docstrings(DMuonOptions), **_CONTAINER_HELP}
    keys = ["lr", "weight_decay", *ADAMW_ONLY_KEYS, *(k for k in DMUON_OPTION_KEYS if k not in ("lr", "weight_decay"))]
    option = {k: f"adamw_{k}" if k in ADAMW_ONLY_KEYS else k for k in keys}

    def annotated(key):
        hint = hints[option[key]]
        return Annotated[hint, tyro.conf.arg(help=docs[key])] if key in docs else hint

    return [("name", Literal[OPTIMIZER_NAMES], field(default=ADAMW))] + [
        (k, annotated(k), field(default=defaults[option[k]])) for k in keys
    ]


def attribute_docstrings(cls) -> dict[str, str]:
    """A dataclass's field docstrings (the string literal after a field, on one line), read from its source."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {
        node.target.id: " ".join(after.value.value.split())
        for node, after in zip(body, body[1:])
        if isinstance(node, ast.AnnAssign)
        and isinstance(node.target, ast.Name)
        and isinstance(after, ast.Expr)
        and isinstance(after.value, ast.Constant)
        and isinstance(after.value.value, str)
    }


# (a module-level class, named as it is, so that configs pickle and deep-copy)
DMuonOptionFields = dataclasses.make_dataclass(
    "DMuonOptionFields", _option_fields(), bases=(OptimizersContainer.Config,), kw_only=True, slots=True
)
DMuonOptionFields.__module__ = __name__  # (make_dataclass's ``module=`` is Python 3.12's)


class DMuonOptimizersContainer(OptimizersContainer):
    @dataclass(kw_only=True, slots=True)
    class Config(DMuonOptionFields):
        """``name``: "dmuon": Muon on dedicated attention/MLP projections + AdamW on the rest;
        "AdamW"/"Adam": TorchTitan's own; "naive_muon": FSDP2 + Muon with a full-gradient all-gather
        in step (a benchmark baseline; orthogonalises a fused q/k/v weight as one matrix).
        The options are DMuonOptions' fields (their types, defaults and meanings; ``lr`` and
        ``weight_decay`` are Muon's with name = "dmuon", else AdamW's; ``betas`` and ``eps`` are AdamW's
        with name = "AdamW"/"Adam"); ``adamw_*`` set the catch-all param group (pattern ".*") of a dmuon
        job, for the non-Muon parameters (embeddings, norms, head); other param groups keep their own
        settings, and a group with ``optimizer_name = "DMuon"`` gives the Muon targets it matches their own
        (``MUON_GROUP_KEYS`` in its optimizer_kwargs)."""

        muon_params: list[str] = field(default_factory=lambda: list(DEFAULT_MUON_PARAMS))
        """Regexes over parameter names selecting Muon targets (default: attention and MLP projections)."""
        reshard_after_forward: bool | None = None
        """DMuon Z3 (true) or Z2 (false); unset mirrors parallelism.fsdp_reshard_after_forward."""
        ns_blocks: Literal[NS_BLOCKS] = "matrix"
        """Newton–Schulz blocks of the attention projections: "matrix" (each weight whole; a fused wqkv as
        q, k, v) or "heads" (each head's rows of q, k, v, fused wqkv and MLA's wq/wq_b/wkv_b, and its
        columns of the output projection, orthogonalised on their own)."""
        owner_groups: bool = True
        """Let the plan split a dominant weight's Newton–Schulz and storage over a few ranks of its shard group
        where its cost model says it pays (docs/owner-groups.md); false: one owner per weight."""
        owner_group_node_size: int = GroupOptions().node_size
        """Ranks per node: owner groups stay inside a node's links, or span whole nodes."""
        owner_group_ns_tflops: float | None = GroupOptions().ns_tflops
        """Newton–Schulz throughput per rank (TFLOP/s) in the owner groups' cost model (default: measured on the
        job's device when DMuon is built, with the all-reduce latency and bandwidth)."""

        @classmethod
        def builds_baseline(cls, name: str) -> bool:
            """Whether the container this config builds (TorchTitan's ``_owner``, what ``build()`` makes)
            builds the baseline ``name``: what validation asks before launch."""
            return cls._owner.baseline_optimizer(name) is not None

    @classmethod
    def baseline_optimizer(cls, name: str) -> Callable | None:
        """The factory of a baseline name (BASELINE_NAMES), ``build(param_groups, *, muon_patterns, ns_method)``:
        one optimizer over TorchTitan's catch-all param group (its parameters' names in ``param_names``;
        DMuonOptions' per-group options as group settings), with ``optimizer.muon_params`` and
        ``optimizer.ns_method``. DMuon builds none (None); a benchmark's subclass, with its own nested
        Config, returns its baseline's (benchmarks/naive_muon_job.py: NaiveFSDPMuon)."""
        return None

    def __init__(self, config: Config, *, model_parts) -> None:
        misnamed = next((g for g in config.param_groups if is_dmuon_group(g)), None)
        if misnamed is not None and config.name != DMUON:
            raise ValueError(dmuon_group_without_dmuon(misnamed, config.name, "optimizer.param_groups"))
        self._muon_kwargs = None
        self._part_handles: list = []
        self._part_attention: list = []
        self._job_options = {k: getattr(config, k) for k in JOB_KEYS}
        self._baseline = self.baseline_optimizer(config.name) if config.name in BASELINE_NAMES else None
        if config.name in BASELINE_NAMES:  # (a benchmark baseline): one optimizer for everything
            if self._baseline is None:
                raise ValueError(baseline_not_built(config.name, "optimizer.name"))
            kwargs = {k: getattr(config, k) for k in DMUON_OPTION_KEYS if k not in JOB_KEYS}
            config.param_groups = [
                ParamGroupConfig(pattern=CATCH_ALL, optimizer_name=config.name, optimizer_kwargs=kwargs)
            ]
            config.optimizer_factory_kwargs_by_name = {
                config.name: {"muon_patterns": list(config.muon_params), "ns_method": config.ns_method}
            }
        else:
            config.param_groups = param_groups_with_catch_all(config)
            if config.name == DMUON:
                self._muon_kwargs = {k: getattr(config, k) for k in MUON_GROUP_KEYS}
        self._name = config.name
        super().__init__(config, model_parts=model_parts)
        self._step_timer = DeviceTimer(next(p for m in model_parts for p in m.parameters()).device)

    def _resolve_optimizer_factory(self, name: str):
        if name == DMUON_FACTORY:  # (the model part whose groups were just built: TorchTitan goes part by part)
            handles, attention, job = self._part_handles, self._part_attention, self._job_options
            return lambda groups, **kwargs: DMuon(
                groups, dedicated=handles, qk_clip_attention=attention, **job, **kwargs
            )
        if self._baseline is not None and name == self._name:
            return self._baseline
        return OptimizersContainer._resolve_optimizer_factory(name)

    def _build_param_groups(self, model, param_group_configs, impl_kwargs):
        if self._baseline is not None:  # DMuon's classes have no fused/foreach variants
            return OptimizersContainer._build_param_groups(model, param_group_configs, {})
        if self._muon_kwargs is None:
            return OptimizersContainer._build_param_groups(model, param_group_configs, impl_kwargs)
        self._part_handles = handles = DedicatedParams.of(model)
        if self._job_options["qk_clip_threshold"] is not None:
            from titan_dmuon.integration.models.attention_clip import attention_descriptions

            tp = next((h.mode.tp.size for h in handles if h.mode.tp is not None), 1)
            self._part_attention = attention_descriptions(model, tp_size=tp)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        muon = [(n, p) for n, p in named if any(h.member_of(p) or h.local_expert_of(p) for h in handles)]
        muon_ids = {id(p) for _, p in muon}
        rest = [(n, p) for n, p in named if id(p) not in muon_ids]
        kept = []
        for group in (g for g in param_group_configs if not is_dmuon_group(g)):
            pattern = re.compile(group.pattern)
            if any(pattern.search(n) for n, _ in rest) or not any(pattern.search(n) for n, _ in named):
                kept.append(group)  # (a pattern that matches nothing at all keeps TorchTitan's error)
            else:
                logger.info(
                    f"Optimizer param group {group.pattern!r}: all its parameters are on Muon (optimizer.muon_params)"
                )
        groups, patterns = OptimizersContainer._build_param_groups(_Named(rest), kept, impl_kwargs)
        if not muon:  # (a pipeline stage without Muon targets, e.g. the token embedding alone)
            return groups, patterns
        claimed = muon_param_groups(muon, [g for g in param_group_configs if is_dmuon_group(g)], self._muon_kwargs)
        return {DMUON_FACTORY: [g for g, _ in claimed], **groups}, {DMUON_FACTORY: [p for _, p in claimed], **patterns}

    def step(self, closure=None):
        """Each optimizer once. (Not ``super().step()``: once any plain OptimizersContainer has been
        built, its ``step`` is hook-wrapped too, and step pre-hooks such as MoE load balancing,
        with its all-reduce, would run twice.)"""
        if closure is not None:
            raise ValueError("OptimizersContainer does not support closures")
        self.step_each()

    def step_each(self) -> None:
        """Each optimizer's step, timed (what ``step`` runs; a subclass's ``step`` calls this, not
        ``super().step()``, for the same reason)."""
        with self._step_timer.timing():
            for optimizer in self.optimizers:
                optimizer.step()

    @property
    def last_step_seconds(self) -> float:
        """The last step's time on the device (read at log time: no sync in the step itself)."""
        return self._step_timer.seconds()

    def dmuon_optimizers(self) -> list[DMuon]:
        """The DMuon optimizers of a dmuon job (one per model part with Muon targets); none otherwise
        (a baseline may subclass DMuon, as NaiveFSDPMuon does, without dedicating)."""
        return [o for o in self.optimizers if isinstance(o, DMuon)] if self._name == DMUON else []


def muon_param_groups(muon, dmuon_groups, flat: dict) -> list[tuple[dict, str]]:
    """(DMuon param group, pattern) of a model part's Muon targets ``muon`` ((name, parameter) pairs): one per
    DMuon group of the config that claims any of them here (first match in config order, on canonical names),
    its optimizer_kwargs over ``flat`` (the flat keys' Muon settings), then the unclaimed ones from ``flat``.
    The same order on every rank of a stage (the config's, then the model's), which the plan and the owner
    groups' sums follow; a group that claims nothing in this part (a pipeline stage) is left out."""
    named = [(canonical_fqn(n), p) for n, p in muon]
    claimed: set[int] = set()
    out = []
    for config in dmuon_groups:
        pattern = re.compile(config.pattern)
        mine = [(n, p) for n, p in named if id(p) not in claimed and pattern.search(n)]
        claimed.update(id(p) for _, p in mine)
        if mine:
            group = {**flat, **config.optimizer_kwargs}
            out.append(({"params": [p for _, p in mine], "param_names": [n for n, _ in mine], **group}, config.pattern))
    left = [(n, p) for n, p in named if id(p) not in claimed]
    if left:
        out.append(({"params": [p for _, p in left], "param_names": [n for n, _ in left], **flat}, DEFAULT_MUON_GROUP))
    return out


class _Named:
    """The parameters TorchTitan's param-group builder may assign (those Muon does not take)."""

    def __init__(self, named) -> None:
        self._named = named

    def named_parameters(self):
        return iter(self._named)


def param_groups_with_catch_all(config) -> list[ParamGroupConfig]:
    """The config's param groups, with the catch-all group (added if missing) set from the flat keys (a DMuon
    group's ".*" is not it: that group claims every Muon target)."""
    if config.name == DMUON:
        flat = dict(
            lr=config.adamw_lr,
            betas=tuple(config.adamw_betas),
            eps=config.adamw_eps,
            weight_decay=config.adamw_weight_decay,
        )
        optimizer_name = ADAMW_FACTORY
    else:
        flat = dict(lr=config.lr, betas=tuple(config.betas), eps=config.eps, weight_decay=config.weight_decay)
        optimizer_name = config.name
    specific = [g for g in config.param_groups if g.pattern != CATCH_ALL or is_dmuon_group(g)]
    catch_all = next((g for g in config.param_groups if g.pattern == CATCH_ALL and not is_dmuon_group(g)), None)
    extra = dict(catch_all.optimizer_kwargs) if catch_all is not None else {}
    return specific + [
        ParamGroupConfig(pattern=CATCH_ALL, optimizer_name=optimizer_name, optimizer_kwargs={**extra, **flat})
    ]
