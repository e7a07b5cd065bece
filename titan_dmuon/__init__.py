"""titan_dmuon: dedicated-owner Muon for PyTorch DDP, FSDP2 and HSDP.

The TorchTitan-free core:

* :func:`dedicate_params` gives each Muon-target weight one owner rank and
  installs the hooks that broadcast weights in forward and reduce gradients
  to their owner in backward;
* :class:`DMuon` applies Muon to dedicated weights (on their owner only) and
  AdamW to everything else;
* :func:`clip_grad_norm_` clips over FSDP2 shards and owner-held gradients;
* :class:`CommLedger` counts every collective in the design's units.
"""

from titan_dmuon.baselines import NaiveFSDPMuon
from titan_dmuon.ddp import wrap_ddp
from titan_dmuon.grad_clip import clip_grad_norm_
from titan_dmuon.ledger import CommLedger, theory_elements_per_rank
from titan_dmuon.optimizer import DMuon
from titan_dmuon.plan import OwnershipPlan
from titan_dmuon.runtime import DedicatedParams, dedicate_params

__all__ = [
    "CommLedger",
    "DMuon",
    "DedicatedParams",
    "NaiveFSDPMuon",
    "OwnershipPlan",
    "clip_grad_norm_",
    "dedicate_params",
    "theory_elements_per_rank",
    "wrap_ddp",
]
__version__ = "0.1.0"
