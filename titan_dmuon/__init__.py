"""titan_dmuon: dedicated-owner Muon for PyTorch DDP, FSDP2 and HSDP.

The TorchTitan-free core:

* :func:`dedicate_params` gives each Muon-target weight one owner rank and
  installs the hooks that broadcast weights in forward and reduce gradients
  to their owner in backward;
* :class:`DMuon` applies Muon to dedicated weights (on their owner only) and
  AdamW to everything else;
* :func:`clip_grad_norm_` clips over FSDP2 shards and owner-held gradients;
* :func:`set_requires_gradient_sync` switches FSDP2's (or DDP's) and DMuon's gradient sync together;
* :class:`CommLedger` counts every collective in the design's units, and
  ``titan_dmuon.plan.cost_model`` gives the figures the design promises.

``titan_dmuon.with_dmuon(config, lr=...)`` turns a TorchTitan 0.3.0
``Trainer.Config`` into a DMuon one (``titan_dmuon.integration.config.python_config``); it is
imported on first use, so ``import titan_dmuon`` never imports TorchTitan.
"""

from titan_dmuon.optim.grad_clip import clip_grad_norm_
from titan_dmuon.optim.optimizer import DMuon
from titan_dmuon.options import DMuonOptions
from titan_dmuon.plan.cost_model import baseline_elements_per_rank, dmuon_elements_per_rank
from titan_dmuon.plan.owner_groups import GroupOptions
from titan_dmuon.plan.ownership import OwnershipPlan
from titan_dmuon.runtime import DedicatedParams, DedicationMode, UnitOrderError, dedicate_params
from titan_dmuon.runtime.ddp import wrap_ddp
from titan_dmuon.runtime.gradient_sync import set_requires_gradient_sync
from titan_dmuon.tools.ledger import CommLedger

__all__ = [
    "CommLedger",
    "DMuon",
    "DMuonOptions",
    "DedicatedParams",
    "DedicationMode",
    "GroupOptions",
    "OwnershipPlan",
    "UnitOrderError",
    "baseline_elements_per_rank",
    "clip_grad_norm_",
    "dedicate_params",
    "dmuon_elements_per_rank",
    "set_requires_gradient_sync",
    "wrap_ddp",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "with_dmuon":  # the TorchTitan plugin, loaded only when asked for
        from titan_dmuon.integration.config.python_config import with_dmuon

        return with_dmuon
    raise AttributeError(f"module 'titan_dmuon' has no attribute {name!r}")
