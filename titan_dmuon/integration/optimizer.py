"""``optimizer.name = "dmuon"`` for TorchTitan: an OptimizersContainer that builds DMuon.

TorchTitan 0.3.0 resolves optimizers from a fixed table; this container adds
"DMuon" to it and turns the flat ``[optimizer]`` keys into TorchTitan's
param-group config, so ``name = "AdamW"`` behaves exactly as TorchTitan does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

from titan_dmuon.baselines import NaiveFSDPMuon
from titan_dmuon.integration.parallelize import DEFAULT_MUON_PARAMS
from titan_dmuon.optimizer import DeviceTimer, DMuon

MUON_FAMILY_KEYS = (
    "momentum", "nesterov", "ns_steps", "adjust_lr_fn", "adamw_lr", "adamw_betas", "adamw_eps",
    "adamw_weight_decay", "muon_params", "reshard_after_forward",
)
ADAMW_ONLY_KEYS = ("betas", "eps", "implementation")


class DMuonOptimizersContainer(OptimizersContainer):
    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        name: Literal["dmuon", "AdamW", "Adam", "naive_muon"] = "AdamW"
        """"dmuon": Muon on dedicated attention/MLP projections + AdamW on the rest; "AdamW"/"Adam":
        TorchTitan's own; "naive_muon": FSDP2 + Muon with a full-gradient all-gather in step (a
        benchmark baseline; orthogonalises a fused q/k/v weight as one matrix)."""
        lr: float = 8e-4
        """Learning rate: Muon's with name = "dmuon", else AdamW's."""
        weight_decay: float = 0.1
        """Decoupled weight decay: Muon's with name = "dmuon", else AdamW's."""
        betas: tuple[float, float] = (0.9, 0.95)
        """AdamW betas (name = "AdamW"/"Adam")."""
        eps: float = 1e-8
        """AdamW epsilon (name = "AdamW"/"Adam")."""
        momentum: float = 0.95
        """Muon momentum."""
        nesterov: bool = True
        """Muon Nesterov momentum."""
        ns_steps: int = 5
        """Newton–Schulz iterations."""
        adjust_lr_fn: Literal["original", "match_rms_adamw", "spectral_unclamped"] | None = None
        """Muon per-shape learning-rate scaling, as torch.optim.Muon (unset = "original")."""
        adamw_lr: float = 8e-4
        """AdamW learning rate for the non-Muon parameters (embeddings, norms, head)."""
        adamw_betas: tuple[float, float] = (0.9, 0.95)
        adamw_eps: float = 1e-8
        adamw_weight_decay: float = 0.1
        muon_params: list[str] = field(default_factory=lambda: list(DEFAULT_MUON_PARAMS))
        """Regexes over parameter names selecting Muon targets (default: attention and MLP projections)."""
        reshard_after_forward: bool | None = None
        """DMuon Z3 (true) or Z2 (false); unset mirrors parallelism.fsdp_reshard_after_forward."""

    def __init__(self, config: Config, *, model_parts) -> None:
        if config.name in ("dmuon", "naive_muon"):
            kwargs = dict(
                lr=config.lr, weight_decay=config.weight_decay, momentum=config.momentum, nesterov=config.nesterov,
                ns_steps=config.ns_steps, adjust_lr_fn=config.adjust_lr_fn, adamw_lr=config.adamw_lr,
                adamw_betas=tuple(config.adamw_betas), adamw_eps=config.adamw_eps,
                adamw_weight_decay=config.adamw_weight_decay,
            )
            factory = "DMuon" if config.name == "dmuon" else "NaiveFSDPMuon"
            config.param_groups = [ParamGroupConfig(pattern=".*", optimizer_name=factory, optimizer_kwargs=kwargs)]
            if config.name == "naive_muon":
                config.optimizer_factory_kwargs_by_name = {"NaiveFSDPMuon": {"muon_patterns": list(config.muon_params)}}
        else:
            kwargs = dict(lr=config.lr, betas=tuple(config.betas), eps=config.eps, weight_decay=config.weight_decay)
            config.param_groups = [ParamGroupConfig(pattern=".*", optimizer_name=config.name, optimizer_kwargs=kwargs)]
        self._muon_family = config.name in ("dmuon", "naive_muon")
        super().__init__(config, model_parts=model_parts)
        self._step_timer = DeviceTimer(next(p for m in model_parts for p in m.parameters()).device)

    @staticmethod
    def _resolve_optimizer_factory(name: str):
        if name == "DMuon":
            return DMuon
        if name == "NaiveFSDPMuon":
            return _naive_muon
        return OptimizersContainer._resolve_optimizer_factory(name)

    def _build_param_groups(self, model, param_group_configs, impl_kwargs):
        # DMuon has no fused/foreach variants: keep those keys out of its groups
        return OptimizersContainer._build_param_groups(model, param_group_configs, {} if self._muon_family else impl_kwargs)

    def step(self, closure=None):
        with self._step_timer.timing():
            return super().step(closure)

    @property
    def last_step_seconds(self) -> float:
        """The last step's time on the device (read at log time: no sync in the step itself)."""
        return self._step_timer.seconds()

    def dmuon_optimizers(self) -> list[DMuon]:
        return [o for o in self.optimizers if isinstance(o, DMuon) and not isinstance(o, NaiveFSDPMuon)]


def _naive_muon(param_groups, *, muon_patterns):
    patterns = [re.compile(p) for p in muon_patterns]
    targets = [
        p for group in param_groups for p, name in zip(group["params"], group["param_names"])
        if any(pattern.search(name) for pattern in patterns)
    ]
    return NaiveFSDPMuon(param_groups, muon_params=targets)
