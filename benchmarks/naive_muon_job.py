"""The config module of the benchmarks' naive FSDP2 + Muon rows (``[optimizer] name = "naive_muon"``).

    MODULE=benchmarks.naive_muon_job CONFIG=from_toml NAIVE_MUON_CONFIG_FILE=job.toml ./run_train.sh [overrides]

The baseline (``titan_dmuon.testing.baselines.NaiveFSDPMuon``) is not part of DMuon, so the
product does not import it: the config carries it. ``from_toml`` is the job of a TOML file, read by
the TOML door (``load_config``) as ``CONFIG_FILE=job.toml ./run_train.sh`` reads it, with this
module's ``NaiveMuonContainer.Config`` as the optimizer config (the same settings); TorchTitan's
``config.optimizer.build()`` then makes a NaiveMuonContainer, which builds NaiveFSDPMuon for that
name. TorchTitan's entry point calls the config function in every process of the job (the
pre-launch check and each worker), so the config is this module's wherever it is used. The command
line's overrides are TorchTitan's (``--checkpoint.enable``, not ``--checkpoint.enable true``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from titan_dmuon.integration import cpu

cpu.enable()  # as every door does, before TorchTitan's trainer is imported

from titan_dmuon.integration.assets import ensure_debug_assets  # noqa: E402
from titan_dmuon.integration.components.optimizer_container import DMuonOptimizersContainer  # noqa: E402
from titan_dmuon.integration.config.toml_file import load_config  # noqa: E402
from titan_dmuon.integration.names import NAIVE_MUON  # noqa: E402
from titan_dmuon.testing.baselines import NaiveFSDPMuon  # noqa: E402

CONFIG_FILE_ENV = "NAIVE_MUON_CONFIG_FILE"
DEBUG_ASSETS = "assets/debug"


def build_naive_fsdp_muon(param_groups, *, muon_patterns, ns_method):
    """NaiveFSDPMuon over TorchTitan's one catch-all param group: Muon on the parameters whose names
    match ``optimizer.muon_params``, AdamW on the rest."""
    patterns = [re.compile(p) for p in muon_patterns]
    targets = [
        p
        for group in param_groups
        for p, name in zip(group["params"], group["param_names"])
        if any(pattern.search(name) for pattern in patterns)
    ]
    return NaiveFSDPMuon(param_groups, muon_params=targets, ns_method=ns_method)


class NaiveMuonContainer(DMuonOptimizersContainer):
    """DMuon's optimizer container that also builds ``name = "naive_muon"``: NaiveFSDPMuon."""

    @dataclass(kw_only=True, slots=True)
    class Config(DMuonOptimizersContainer.Config):
        """DMuon's optimizer config whose ``build()`` makes a NaiveMuonContainer (TorchTitan's Configurable)."""

    @classmethod
    def baseline_optimizer(cls, name: str):
        return build_naive_fsdp_muon if name == NAIVE_MUON else None


def from_toml():
    """The job of the TOML file ``$NAIVE_MUON_CONFIG_FILE`` (TorchTitan's config functions take no
    arguments), with the debug tokenizer and dataset made first when it reads them (as run_train.sh
    does for ``CONFIG_FILE``)."""
    path = os.environ.get(CONFIG_FILE_ENV)
    if not path:
        raise ValueError(f"{CONFIG_FILE_ENV}=<job.toml> names the job of --config from_toml")
    with open(path) as f:
        if DEBUG_ASSETS in f.read():
            ensure_debug_assets(DEBUG_ASSETS)
    return load_config(path, optimizer_config=NaiveMuonContainer.Config)
