"""The runtime: hooks, packed buffers and collectives that move dedicated weights.

Laid out as FSDP2 lays out its own runtime:

* ``unit.py``: one layer's packed buffer and its lifecycle (``BufferState``, ``Phase``);
* ``reducer.py``: backward gradient reduces to owners, off the compute stream (HSDP: two stages);
* ``replica_sync.py``: HSDP's post-step broadcasts from global owners to replicas;
* ``state_dict.py``: state-dict hooks for DCP checkpoints;
* ``comm.py``: labels, counts, launches (coalesced groups) and streams;
* ``handle.py``: ``DedicatedParams``, the hooks that drive a step;
* ``dedicate.py``: ``dedicate_params``: validation, ownership plan, unit layout.
"""

from titan_dmuon.runtime.comm import comm_source
from titan_dmuon.runtime.dedicate import (
    HSDP_DIM_NAMES,
    canonical_fqn,
    dedicate_params,
    find_dedicated,
    find_local_experts,
    refresh_handles,
)
from titan_dmuon.runtime.handle import DedicatedParams, LocalExperts

__all__ = [
    "HSDP_DIM_NAMES",
    "DedicatedParams",
    "LocalExperts",
    "canonical_fqn",
    "comm_source",
    "dedicate_params",
    "find_dedicated",
    "find_local_experts",
    "refresh_handles",
]
