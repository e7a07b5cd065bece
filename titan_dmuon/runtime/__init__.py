"""The runtime: hooks, packed buffers and collectives that move dedicated weights.

Laid out as FSDP2 lays out its own runtime, one concern per file:

* ``mode.py``: ``DedicationMode``/``MeshInfo``: the layout, decided once;
* ``members.py``: what a rank holds (``Member``, ``LocalExperts``, ``Bucket``, ``Segment``);
* ``unit.py``: one layer's packed buffer and its lifecycle (``BufferState``, ``Phase``);
* ``context.py``: what a handle's units share (``RuntimeContext``: order, streams, counters);
* ``reducer.py``: backward gradient reduces to owners, off the compute stream (HSDP: two stages);
* ``replica_sync.py``: HSDP's post-update broadcasts from global owners to replicas;
* ``state_dict.py``: state-dict hooks for DCP checkpoints;
* ``comm.py``: labels, counts and launches (coalesced groups); ``streams.py``: streams and events;
* ``handle.py``: ``DedicatedParams``, the hooks that drive a step;
* ``dedicate.py``: ``dedicate_params``: validation, ownership plan, unit layout.
"""

from titan_dmuon.runtime.comm import CommLabel, comm_source
from titan_dmuon.runtime.context import UnitOrderError
from titan_dmuon.runtime.dedicate import canonical_fqn, dedicate_params
from titan_dmuon.runtime.handle import DedicatedParams
from titan_dmuon.runtime.members import LocalExperts, Member
from titan_dmuon.runtime.mode import HSDP_DIM_NAMES, DedicationMode, MeshInfo

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
