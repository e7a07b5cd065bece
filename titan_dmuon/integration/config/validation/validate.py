"""``validate_dmuon``: every check of a DMuon job config, for every door, before any process group exists.

It runs in ``with_dmuon``, in the TOML door, in ``run_train.sh``'s pre-launch check and again in DMuonTrainer
on the config TorchTitan builds (command-line overrides applied). Each problem is one ``ConfigError`` line that
names the setting, the bad value and the fix in the door's spelling (``naming.py``); one module per config
section holds that section's checks.
"""

from __future__ import annotations

from titan_dmuon.integration.config.validation.fault_tolerance_section import fault_tolerance_problem, fault_tolerant
from titan_dmuon.integration.config.validation.model_checks import validate_against_model
from titan_dmuon.integration.config.validation.naming import PYTHON_NAMES, ConfigError, Naming
from titan_dmuon.integration.config.validation.optimizer_section import validate_optimizer
from titan_dmuon.integration.config.validation.other_sections import (
    validate_checkpoint,
    validate_sections,
    validate_training,
    validate_validator,
)
from titan_dmuon.integration.config.validation.parallelism_section import (
    validate_context_parallel,
    validate_parallelism,
    validate_pipeline,
)


def validate_dmuon(
    config, *, world_size: int | None = None, names: Naming = PYTHON_NAMES, this_machine: bool = False
) -> list[str]:
    """Every cross-key check of a DMuonTrainer.Config (any optimizer name); ConfigError on the first.

    ``this_machine``: the job is about to run here (DMuonTrainer, the entry points, the pre-launch
    check), so also check what this machine can run (a cluster config may be loaded anywhere).
    Returns warnings (settings that are valid but probably not meant); DMuonTrainer logs them,
    once, on the config it builds.
    """
    validate_optimizer(config, names)
    validate_training(config.training, names)
    validate_validator(config.validator, world_size, names)
    validate_checkpoint(config.checkpoint, names)
    validate_parallelism(config.parallelism, world_size, names)
    validate_context_parallel(config, names, this_machine=this_machine)
    validate_pipeline(config, names)
    validate_sections(config, names)
    problem = fault_tolerance_problem(config, names, this_machine=this_machine) if fault_tolerant(config) else None
    if problem is not None:
        raise ConfigError(problem)
    return validate_against_model(config, world_size, names)
