"""A TorchTitan ``Trainer.Config`` as DMuon's: DMuonTrainer.Config with DMuon-aware sections.

Both doors start here (``with_dmuon`` and the TOML layer): the config keeps
every setting, and its optimizer, metrics and checkpoint configs become the
subclasses that know DMuon's keys, so TorchTitan's ``config.build()`` builds
DMuon's trainer, container, metrics and checkpoint checks.
"""

from __future__ import annotations

import dataclasses

from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.trainer import Trainer

from titan_dmuon.integration.components.checkpoint import DMuonCheckpointManager
from titan_dmuon.integration.components.optimizer_container import CATCH_ALL, DMuonOptimizersContainer, is_dmuon_group
from titan_dmuon.integration.config.validation.naming import ConfigError
from titan_dmuon.integration.names import ADAMW, ADAMW_NAMES
from titan_dmuon.integration.trainer import DMuonMetricsProcessor, DMuonTrainer
from titan_dmuon.options import ADAMW_KEYS


def dmuon_trainer_config(config, *, without_cuda_graphs: bool = False, fault_tolerant: bool = False):
    """``config`` as a DMuonTrainer.Config with DMuon-aware optimizer, metrics and checkpoint configs
    (``without_cuda_graphs``: and ``training.disable_cuda_graphs`` on, as finalize() sets it for DMuon).

    A config with a ``fault_tolerance`` section (TorchTitan's FaultTolerantTrainer.Config, e.g. its
    ``torchft.llama3`` registry), or ``fault_tolerant=True``, becomes DMuon's fault-tolerant one
    (``integration/distributed/fault_tolerance.py``, imported only then)."""
    names = {f.name for f in dataclasses.fields(config)} if dataclasses.is_dataclass(config) else set()
    fault_tolerant = fault_tolerant or "fault_tolerance" in names
    trainer, optimizer, checkpoint = DMuonTrainer.Config, DMuonOptimizersContainer.Config, DMuonCheckpointManager.Config
    if fault_tolerant:
        from titan_dmuon.integration.distributed import fault_tolerance as ft

        trainer, optimizer, checkpoint = (
            ft.DMuonFaultTolerantTrainer.Config,
            ft.DMuonFTOptimizersContainer.Config,
            ft.DMuonFTCheckpointManager.Config,
        )
    if isinstance(config, trainer):
        cls = type(config)
    elif isinstance(config, Trainer.Config) and names <= {f.name for f in dataclasses.fields(trainer)}:
        cls = trainer  # (e.g. the Kimi recipes' config class: only extra checks, no extra settings)
    elif isinstance(config, Trainer.Config):
        raise ConfigError(
            f"{type(config).__qualname__} is the config of another trainer; DMuon runs DMuonTrainer "
            "(TorchTitan's Trainer with DMuon's clipping and metrics, or its FaultTolerantTrainer) and takes a "
            "Trainer.Config"
        )
    else:
        raise ConfigError(f"expected a TorchTitan Trainer.Config, got {type(config).__qualname__}")
    if config.model_spec is None:
        raise ConfigError("the config has no model_spec; start from a TorchTitan config registry function")
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    if without_cuda_graphs:  # TorchTitan's checks of the new object refuse pipeline parallelism with them on
        values["training"] = dataclasses.replace(config.training, disable_cuda_graphs=True)
    values["optimizer"] = _dmuon_optimizer_config(config.optimizer, optimizer)
    values["metrics"] = as_subclass(DMuonMetricsProcessor.Config, config.metrics, "metrics")
    values["checkpoint"] = as_subclass(checkpoint, config.checkpoint, "checkpoint")
    if fault_tolerant:
        values["fault_tolerance"] = as_subclass(
            ft.DMuonTorchFTManager.Config,
            values.get("fault_tolerance") or ft.DMuonTorchFTManager.Config(),
            "fault_tolerance",
        )
    return cls(**values)


def _same_fields(config, cls) -> bool:
    return isinstance(config, cls) and {f.name for f in dataclasses.fields(config)} == {
        f.name for f in dataclasses.fields(cls)
    }


def _dmuon_optimizer_config(base, cls=DMuonOptimizersContainer.Config):
    """TorchTitan's optimizer config as DMuon's container config.

    Its AdamW/Adam param groups are kept for the parameters Muon does not take (e.g. no weight
    decay on embeddings, Adam on the router); the catch-all group (pattern ".*") becomes the
    flat keys, AdamW's ``lr``/``betas``/``eps``/``weight_decay`` and, for DMuon, the same as
    ``adamw_*`` (the TOML layer's flat [optimizer] keys). DMuon param groups (``optimizer_name``
    "DMuon") are kept, in their place; TorchTitan's own Muon groups (DistMuon, in its Kimi recipes)
    give way to DMuon."""
    if isinstance(base, cls):
        return base
    if isinstance(base, DMuonOptimizersContainer.Config):  # (DMuon's, for a fault-tolerant job now)
        return as_subclass(cls, base, "optimizer")
    if not _same_fields(base, OptimizersContainer.Config):  # (TorchTitan's, or TorchFT's: no settings of its own)
        raise ConfigError(
            f"optimizer: {type(base).__qualname__} cannot be combined with DMuon's optimizer container; "
            "start from TorchTitan's OptimizersContainer.Config"
        )
    groups = [g for g in base.param_groups if g.optimizer_name in ADAMW_NAMES or is_dmuon_group(g)]
    catch_all = next((g for g in groups if g.pattern == CATCH_ALL and not is_dmuon_group(g)), None)
    flat = {
        k: (tuple(v) if k == "betas" else v)
        for k, v in (catch_all.optimizer_kwargs if catch_all else {}).items()
        if k in ADAMW_KEYS.values()
    }
    return cls(
        name=catch_all.optimizer_name if catch_all else ADAMW,
        implementation=base.implementation,
        param_groups=[g for g in groups if g is not catch_all],
        **flat,
        **{adamw: flat[plain] for adamw, plain in ADAMW_KEYS.items() if plain in flat},
    )


def as_subclass(cls, instance, section: str):
    """``instance`` (a section's config) as ``cls``, a subclass of its class, with the same field values
    (``dataclasses.replace`` keeps the class); a ConfigError when ``cls`` does not extend it."""
    if isinstance(instance, cls):
        return instance
    if not issubclass(cls, type(instance)):
        raise ConfigError(
            f"{section}: {type(instance).__qualname__} cannot be combined with DMuon's {cls.__qualname__}; "
            f"start from TorchTitan's {cls.__mro__[1].__qualname__}"
        )
    return cls(**{f.name: getattr(instance, f.name) for f in dataclasses.fields(instance) if f.init})
