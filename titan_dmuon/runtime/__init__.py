"""The runtime: hooks, packed buffers and collectives that move dedicated weights.

May import: ``titan_dmuon.math``, ``options`` and ``plan``. The optimizer's step (``titan_dmuon.optim``) drives
it through the handle; it never imports the optimizer, TorchTitan or the measuring tools.

Laid out as FSDP2 lays out its own runtime, one concern per file:

* ``mode.py``: ``DedicationMode``/``MeshInfo``: the layout, decided once;
* ``members.py``: what a rank holds (``Member``, ``LocalExperts``, ``Bucket``, ``Segment``);
* ``unit.py``: one layer's packed buffer and its lifecycle (``BufferState``), as FSDP2's ``FSDPParamGroup``;
* ``context.py``: what a handle's units share (``RuntimeContext``: order, streams, counters; ``Phase``);
* ``hooks.py``: ``StepHooks``, the hooks that drive a step (lazy init, root and unit hooks, the
  end-of-backward callback), as FSDP2's ``FSDPState``;
* ``handle.py``: ``DedicatedParams``, what users call (queries, the optimizer-step protocol,
  ``remove()``), as FSDP2's ``FSDPModule``; with its methods of ``handle_figures.py`` (figures),
  ``handle_weights.py`` (``full_tensors``, TP conversions, initialisation) and
  ``handle_gradient_sync.py`` (gradient sync, the all-reduce hook) mixed in;
* ``reducer.py``: backward gradient reduces to owners, off the compute stream (HSDP: two stages);
* ``replica_sync.py``: HSDP's post-update broadcasts from global owners to replicas;
* ``tensor_parallel.py``: the step's TP exchange, and a TP shard to and from its full matrix;
* ``initialise.py``: dedicated weights initialised as the same model without DMuon would;
* ``state_dict.py``: state-dict hooks for DCP checkpoints;
* ``ddp.py``, ``gradient_sync.py``, ``gloo_exit.py``: dedicated weights under DDP; one gradient-sync switch for
  FSDP2, DDP and DMuon; gloo's exit guard;
* ``comm.py``: labels (``CommLabel``), counts and launches (coalesced groups); ``streams.py``: streams and events;
* ``request.py``: the parameters given to ``dedicate_params`` found in the model and checked;
* ``dedicate.py``: ``dedicate_params``: the plan, this rank's members, the units' layout, the handle.
"""

from titan_dmuon.runtime.comm import CommLabel, comm_source
from titan_dmuon.runtime.context import UnitOrderError
from titan_dmuon.runtime.dedicate import dedicate_params
from titan_dmuon.runtime.handle import DedicatedParams
from titan_dmuon.runtime.members import LocalExperts, Member
from titan_dmuon.runtime.mode import HSDP_DIM_NAMES, DedicationMode, MeshInfo
from titan_dmuon.runtime.request import canonical_fqn

__all__ = [
    "CommLabel",
    "HSDP_DIM_NAMES",
    "DedicatedParams",
    "DedicationMode",
    "LocalExperts",
    "Member",
    "MeshInfo",
    "UnitOrderError",
    "canonical_fqn",
    "comm_source",
    "dedicate_params",
]
