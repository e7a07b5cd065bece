"""``optimizer.name = "dmuon"`` for TorchTitan: an OptimizersContainer that builds DMuon.

TorchTitan 0.3.0 resolves optimizers from a fixed table; this container adds
"DMuon" to it. With ``name = "dmuon"`` the Muon targets (dedicated weights and
experts updated in place) go to one DMuon optimizer, claimed before any
pattern; every other parameter keeps TorchTitan's own param groups (its
AdamW/Adam, fused or foreach as ``implementation`` says), so a config's
groups (no weight decay on embeddings, Adam on the router, ...) keep their
settings. The catch-all group (pattern ``.*``) takes the flat keys: ``lr``,
``betas``, ``eps``, ``weight_decay`` with AdamW/Adam, ``adamw_*`` with dmuon.
``name = "AdamW"`` is then exactly TorchTitan's container.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from typing import Literal

from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig
from torchtitan.tools.logging import logger

from titan_dmuon.testing.baselines import NaiveFSDPMuon
from titan_dmuon.integration.names import ADAMW, ADAMW_FACTORY, DMUON, DMUON_FACTORY, NAIVE_MUON, OPTIMIZER_NAMES
from titan_dmuon.integration.training.parallelize import DEFAULT_MUON_PARAMS
from titan_dmuon.optimizer import DeviceTimer, DMuon
from titan_dmuon.options import JOB_KEYS, MUON_KEYS, OPTION_NAMES, DMuonOptions
from titan_dmuon.runtime import DedicatedParams

# DMuon's options as [optimizer] keys: all of DMuonOptions but the Newton–Schulz constants
# (``eps`` is AdamW's name here); ``lr`` and ``weight_decay`` are shared with AdamW.
DMUON_OPTION_KEYS = tuple(k for k in OPTION_NAMES if k not in ("ns_coefficients", "eps"))
DEDICATION_KEYS = ("muon_params", "reshard_after_forward")
MUON_FAMILY_KEYS = tuple(k for k in DMUON_OPTION_KEYS if k not in ("lr", "weight_decay")) + DEDICATION_KEYS
ADAMW_ONLY_KEYS = ("betas", "eps")  # TorchTitan's flat AdamW keys, DMuonOptions' adamw_betas/adamw_eps
CATCH_ALL = ".*"


def _option_fields() -> list[tuple]:
    """The container's option fields, from DMuonOptions: ``name``, then ``lr``, ``weight_decay``, the flat
    AdamW keys (typed and defaulted as their ``adamw_*`` option) and the other options, each with its
    DMuonOptions type (its Literal lists included) and default."""
    hints = typing.get_type_hints(DMuonOptions)
    defaults = {f.name: f.default for f in dataclasses.fields(DMuonOptions)}
    keys = ["lr", "weight_decay", *ADAMW_ONLY_KEYS, *(k for k in DMUON_OPTION_KEYS if k not in ("lr", "weight_decay"))]
    option = {k: f"adamw_{k}" if k in ADAMW_ONLY_KEYS else k for k in keys}
    return [("name", Literal[OPTIMIZER_NAMES], field(default=ADAMW))] + [
        (k, hints[option[k]], field(default=defaults[option[k]])) for k in keys
    ]


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
        settings."""

        muon_params: list[str] = field(default_factory=lambda: list(DEFAULT_MUON_PARAMS))
        """Regexes over parameter names selecting Muon targets (default: attention and MLP projections)."""
        reshard_after_forward: bool | None = None
        """DMuon Z3 (true) or Z2 (false); unset mirrors parallelism.fsdp_reshard_after_forward."""

    def __init__(self, config: Config, *, model_parts) -> None:
        self._muon_kwargs = None
        self._part_handles: list = []
        self._part_attention: list = []
        self._job_options = {k: getattr(config, k) for k in JOB_KEYS}
        if config.name == NAIVE_MUON:  # the benchmark baseline: one optimizer for everything
            kwargs = {k: getattr(config, k) for k in DMUON_OPTION_KEYS if k not in JOB_KEYS}
            config.param_groups = [ParamGroupConfig(pattern=CATCH_ALL, optimizer_name="NaiveFSDPMuon", optimizer_kwargs=kwargs)]
            config.optimizer_factory_kwargs_by_name = {
                "NaiveFSDPMuon": {"muon_patterns": list(config.muon_params), "ns_method": config.ns_method}}
        else:
            config.param_groups = param_groups_with_catch_all(config)
            if config.name == DMUON:
                self._muon_kwargs = {k: getattr(config, k) for k in MUON_KEYS if k in DMUON_OPTION_KEYS}
        self._name = config.name
        super().__init__(config, model_parts=model_parts)
        self._step_timer = DeviceTimer(next(p for m in model_parts for p in m.parameters()).device)

    def _resolve_optimizer_factory(self, name: str):
        if name == DMUON_FACTORY:  # (the model part whose groups were just built: TorchTitan goes part by part)
            handles, attention, job = self._part_handles, self._part_attention, self._job_options
            return lambda groups, **kwargs: DMuon(groups, dedicated=handles, qk_clip_attention=attention, **job,
                                                  **kwargs)
        if name == "NaiveFSDPMuon":
            return _naive_muon
        return OptimizersContainer._resolve_optimizer_factory(name)

    def _build_param_groups(self, model, param_group_configs, impl_kwargs):
        if self._name == NAIVE_MUON:  # DMuon's classes have no fused/foreach variants
            return OptimizersContainer._build_param_groups(model, param_group_configs, {})
        if self._muon_kwargs is None:
            return OptimizersContainer._build_param_groups(model, param_group_configs, impl_kwargs)
        self._part_handles = handles = DedicatedParams.of(model)
        if self._job_options["qk_clip_threshold"] is not None:
            from titan_dmuon.integration.training.attention_clip import attention_descriptions

            tp = next((h.mode.tp.size for h in handles if h.mode.tp is not None), 1)
            self._part_attention = attention_descriptions(model, tp_size=tp)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        muon = [(n, p) for n, p in named if any(h.member_of(p) or h.local_expert_of(p) for h in handles)]
        muon_ids = {id(p) for _, p in muon}
        rest = [(n, p) for n, p in named if id(p) not in muon_ids]
        kept = []
        for group in param_group_configs:
            pattern = re.compile(group.pattern)
            if any(pattern.search(n) for n, _ in rest) or not any(pattern.search(n) for n, _ in named):
                kept.append(group)  # (a pattern that matches nothing at all keeps TorchTitan's error)
            else:
                logger.info(f"Optimizer param group {group.pattern!r}: all its parameters are on Muon (optimizer.muon_params)")
        groups, patterns = OptimizersContainer._build_param_groups(_Named(rest), kept, impl_kwargs)
        if not muon:  # (a pipeline stage without Muon targets, e.g. the token embedding alone)
            return groups, patterns
        muon_group = {"params": [p for _, p in muon], "param_names": [canonical_fqn(n) for n, _ in muon], **self._muon_kwargs}
        return {DMUON_FACTORY: [muon_group], **groups}, {DMUON_FACTORY: ["optimizer.muon_params"], **patterns}

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
        return [o for o in self.optimizers if isinstance(o, DMuon) and not isinstance(o, NaiveFSDPMuon)]


class _Named:
    """The parameters TorchTitan's param-group builder may assign (those Muon does not take)."""

    def __init__(self, named) -> None:
        self._named = named

    def named_parameters(self):
        return iter(self._named)


def param_groups_with_catch_all(config) -> list[ParamGroupConfig]:
    """The config's param groups, with the catch-all group (added if missing) set from the flat keys."""
    if config.name == DMUON:
        flat = dict(
            lr=config.adamw_lr, betas=tuple(config.adamw_betas), eps=config.adamw_eps,
            weight_decay=config.adamw_weight_decay,
        )
        optimizer_name = ADAMW_FACTORY
    else:
        flat = dict(lr=config.lr, betas=tuple(config.betas), eps=config.eps, weight_decay=config.weight_decay)
        optimizer_name = config.name
    specific = [g for g in config.param_groups if g.pattern != CATCH_ALL]
    catch_all = next((g for g in config.param_groups if g.pattern == CATCH_ALL), None)
    extra = dict(catch_all.optimizer_kwargs) if catch_all is not None else {}
    return specific + [ParamGroupConfig(pattern=CATCH_ALL, optimizer_name=optimizer_name, optimizer_kwargs={**extra, **flat})]


def _naive_muon(param_groups, *, muon_patterns, ns_method):
    patterns = [re.compile(p) for p in muon_patterns]
    targets = [
        p for group in param_groups for p, name in zip(group["params"], group["param_names"])
        if any(pattern.search(name) for pattern in patterns)
    ]
    return NaiveFSDPMuon(param_groups, muon_params=targets, ns_method=ns_method)
