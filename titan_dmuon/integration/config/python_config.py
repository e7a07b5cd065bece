"""``with_dmuon``: a TorchTitan 0.3.0 ``Trainer.Config`` set up for DMuon, in one call.

The Python door (a config registry function, TorchTitan's ``--module/--config``).
It takes the same steps as the TOML layer (``config.load_config``):
``trainer_config.dmuon_trainer_config`` (DMuon-aware config classes),
``validation.validate_dmuon`` (every check) and ``finalize.finalize``.
"""

from __future__ import annotations

import typing

from titan_dmuon.integration import cpu
from titan_dmuon.integration.components.optimizer_container import DEDICATION_KEYS, DMUON_OPTION_KEYS
from titan_dmuon.integration.config.finalize import finalize
from titan_dmuon.integration.config.trainer_config import dmuon_trainer_config
from titan_dmuon.integration.config.validation.naming import ConfigError
from titan_dmuon.integration.config.validation.validate import validate_dmuon
from titan_dmuon.integration.config.values import convert, describe
from titan_dmuon.integration.distributed.parallelize import DEFAULT_MUON_PARAMS
from titan_dmuon.integration.names import DMUON

__all__ = ["with_dmuon"]


def with_dmuon(config, **options):
    """``config`` (any TorchTitan ``Trainer.Config``) trained with DMuon: a DMuonTrainer.Config.

    The keywords are the TOML ``[optimizer]`` keys of ``name = "dmuon"``, with the same meaning
    and checks: the fields of ``titan_dmuon.options.DMuonOptions`` but the Newton–Schulz constants
    (``lr``, ``momentum``, ``ns_method``, ``adamw_lr``, ``qk_clip_threshold``, ...: ``DMUON_OPTION_KEYS``),
    and ``muon_params``, ``reshard_after_forward`` (``DEDICATION_KEYS``).
    One left out keeps the config's value; on a plain TorchTitan config that is
    what TOML gives an unset key: ``lr`` and ``weight_decay`` from its AdamW, the
    others DMuon's defaults (``reshard_after_forward=None`` mirrors
    ``parallelism.fsdp_reshard_after_forward``; ``muon_params=None`` selects the
    attention and MLP projections). The config's param groups are kept, its
    ``optimizer_name = "DMuon"`` groups (Muon targets) too. Like TorchTitan's registry functions this
    builds on ``config``: use the result, not the argument. Raises ConfigError
    naming the first bad setting.
    """
    keys = DMUON_OPTION_KEYS + DEDICATION_KEYS
    unknown = sorted(set(options) - set(keys))
    if unknown:
        raise ConfigError(f"with_dmuon got unknown keyword(s) {unknown}; expected some of {', '.join(keys)}")
    cpu.enable()  # a user's registry module may be the first DMuon code TorchTitan imports
    config = dmuon_trainer_config(config, without_cuda_graphs=True)
    optimizer = config.optimizer
    optimizer.name = DMUON
    hints = typing.get_type_hints(type(optimizer))
    for key, value in options.items():
        if key == "muon_params" and value is None:
            value = DEFAULT_MUON_PARAMS
        try:
            value = convert(value, hints[key], from_cli=False)
        except (TypeError, ValueError) as e:
            raise ConfigError(
                f"optimizer.{key} = {value!r}: expected {describe(hints[key])}" + (f" ({e})" if str(e) else "")
            ) from None
        setattr(optimizer, key, value)
    validate_dmuon(config)  # (its warnings are logged by DMuonTrainer, after command-line overrides)
    return finalize(config)
