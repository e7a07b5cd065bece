"""The last steps before TorchTitan builds a DMuon job: the model spec, CUDA graphs, the bind.

``finalize`` ends both config doors (``with_dmuon``, the TOML layer).
TorchTitan's entry point calls the config function and THEN applies its
command-line overrides, which builds a new config object; so nothing here may
keep a config value for later. DMuonTrainer runs ``prepare_for_build`` on the
config it is actually given: it validates again (with the world size), before
any process group exists, and binds the parallelize step to that config's
optimizer settings.
"""

from __future__ import annotations

import dataclasses
import os

import torch
from torchtitan.tools.logging import logger

from titan_dmuon.integration import cpu
from titan_dmuon.integration.config.validation.naming import ConfigError
from titan_dmuon.integration.config.validation.validate import validate_dmuon
from titan_dmuon.integration.distributed.parallelize import DMuonParallelize
from titan_dmuon.integration.names import DMUON


def finalize(config, *, keep_cuda_graph_setting: bool = False):
    """The model spec for DMuon and CUDA graphs off (silently: TorchTitan's default is on, DMuon's
    hooks need them off), then a fresh config object, so that TorchTitan's own checks
    (``Trainer.Config.__post_init__``) see the final values. ``keep_cuda_graph_setting``: the job
    set ``training.disable_cuda_graphs`` itself (TOML); DMuonTrainer then turns it off, warning
    where capture could happen."""
    if not keep_cuda_graph_setting:
        _without_cuda_graphs(config, warn=False)
    _finalize_model_spec(config)
    try:
        return type(config)(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})
    except ValueError as e:  # TorchTitan's own cross-key checks
        raise ConfigError(f"TorchTitan rejects this config: {' '.join(str(e).split())}") from None


def prepare_for_build(config):
    """DMuonTrainer's first step, on the config TorchTitan builds (command-line overrides applied):
    CPU mode, the checks again (now with the world size, still before any process group; their
    warnings are logged here, once), CUDA graphs off and the parallelize step bound to this
    config's optimizer settings."""
    cpu.enable()
    world_size = os.environ.get("WORLD_SIZE")
    for warning in validate_dmuon(config, world_size=int(world_size) if world_size else None, this_machine=True):
        logger.warning(warning)
    _without_cuda_graphs(config, warn=torch.cuda.is_available())
    _finalize_model_spec(config)
    spec = config.model_spec
    config.model_spec = dataclasses.replace(spec, parallelize_fn=spec.parallelize_fn.bind(config.optimizer))
    return config


def _without_cuda_graphs(config, *, warn: bool) -> None:
    """TorchTitan captures forward+backward in a CUDA graph by default on NVIDIA and then only
    replays it: DMuon's hooks would not run and its buffers would be replayed into. Off; a warning
    only where capture could happen and the setting came from the job (after overrides)."""
    if config.optimizer.name != DMUON or config.training.disable_cuda_graphs:
        return
    if warn:
        logger.warning(
            "training.disable_cuda_graphs = false: DMuon's hooks (weight broadcasts, gradient reduces, HSDP replica "
            "sync) must run every step, and a captured CUDA graph replays the step without them; turning CUDA "
            "graphs off. Pass --training.disable_cuda_graphs (or leave out --training.no-disable_cuda_graphs and "
            "disable_cuda_graphs = false) to silence this."
        )
    config.training.disable_cuda_graphs = True


def _finalize_model_spec(config) -> None:
    """Idempotent: causal SDPA without an accelerator; the optimizer-aware parallelize_fn."""
    spec = config.model_spec
    if not cpu.accelerator_present():
        cpu.use_sdpa_attention(spec.model, context_parallel=config.parallelism.context_parallel_degree > 1)
    if not isinstance(spec.parallelize_fn, DMuonParallelize):
        config.model_spec = dataclasses.replace(spec, parallelize_fn=DMuonParallelize(base_fn=spec.parallelize_fn))
