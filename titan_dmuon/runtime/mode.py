"""The data-parallel layout DMuon runs on, decided once.

As FSDP2's ``FSDPMeshInfo``/``HSDPMeshInfo`` decide its mode when
``fully_shard`` is called, ``DedicationMode.build`` reads the mesh and the
settings once; the plan, every runtime piece and the ledger's cost model read
this object and nothing else inspects the mesh.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

HSDP_DIM_NAMES = ("dp_replicate", "dp_shard")
_HSDP_ALIASES = {HSDP_DIM_NAMES, ("dp_replicate", "fsdp")}  # TorchTitan's legacy backend names the shard dim "fsdp"
EXPERT_SHARDINGS = ("auto", "local", "dedicated")


@dataclass(frozen=True, kw_only=True, eq=False)
class MeshInfo:
    """This rank's place in the (replicate R) x (shard N) data-parallel mesh; a 1-D mesh is R = 1.

    Global ranks in the plan are numbered ``r * N + s``."""

    mesh: DeviceMesh
    shard_group: dist.ProcessGroup
    shard_size: int
    shard_rank: int
    replicate_group: dist.ProcessGroup | None
    replicate_size: int
    replicate_rank: int
    device: torch.device  # where this rank's tensors live (the mesh's device type)
    coalesces: bool = field(default=False)  # the shard group's backend runs a group of collectives as one launch

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh) -> MeshInfo:
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
        device = _mesh_device(mesh)
        if mesh.ndim == 1:
            group = mesh.get_group()
            return cls(
                mesh=mesh,
                shard_group=group,
                shard_size=mesh.size(),
                shard_rank=mesh.get_local_rank(),
                replicate_group=None,
                replicate_size=1,
                replicate_rank=0,
                device=device,
                coalesces=coalesces(group, device),
            )
        if mesh.ndim == 2:
            names = tuple(mesh.mesh_dim_names or ())
            if names not in _HSDP_ALIASES:
                raise ValueError(
                    f"a 2-D mesh must have dims named {HSDP_DIM_NAMES} (replicate x shard, HSDP); "
                    f"got {names or 'no names'}. "
                    'Build it with init_device_mesh(device, (R, N), mesh_dim_names=("dp_replicate", "dp_shard"))'
                )
            shard_group = mesh.get_group(1)
            return cls(
                mesh=mesh,
                shard_group=shard_group,
                shard_size=mesh.size(1),
                shard_rank=mesh.get_local_rank(1),
                replicate_group=mesh.get_group(0),
                replicate_size=mesh.size(0),
                replicate_rank=mesh.get_local_rank(0),
                device=device,
                coalesces=coalesces(shard_group, device),
            )
        raise ValueError(f"mesh must be 1-D (DDP/FSDP) or 2-D (HSDP), got {mesh.ndim} dims {mesh.mesh_dim_names}")

    @property
    def world_size(self) -> int:
        return self.replicate_size * self.shard_size

    @property
    def hsdp(self) -> bool:
        return self.replicate_group is not None

    @property
    def groups(self) -> list[dist.ProcessGroup]:
        """One process group per mesh dimension (replicate first)."""
        return ([self.replicate_group] if self.hsdp else []) + [self.shard_group]


@dataclass(frozen=True, kw_only=True, eq=False)
class TensorParallelInfo:
    """The tensor-parallel group of this rank's TP-local shards (ranks with the same data-parallel
    coordinate): the Muon step's all-to-alls assemble each matrix on its NS home there."""

    mesh: DeviceMesh
    group: dist.ProcessGroup
    size: int
    rank: int

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh) -> TensorParallelInfo:
        if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
            raise ValueError(f"tp_mesh must be a 1-D DeviceMesh (the tensor-parallel dim), got {mesh!r}")
        return cls(mesh=mesh, group=mesh.get_group(), size=mesh.size(), rank=mesh.get_local_rank())


@dataclass(frozen=True, kw_only=True, eq=False)
class DedicationMode:
    """Z2/Z3 on a mesh, and where 3-D expert weights are updated."""

    mesh: MeshInfo
    """The data-parallel mesh: this rank's place in it and its process groups."""
    reshard_after_forward: bool
    """True: Z3 (free each layer's buffer after forward); False: Z2."""
    expert_sharding: str = "auto"
    """Where 3-D expert weights are updated: "local", "dedicated" or "auto" (``experts_stay_local``)."""
    tp: TensorParallelInfo | None = None
    """Tensor parallelism: the TP group of the dedicated weights' TP-local shards (None without)."""

    @classmethod
    def build(
        cls,
        mesh: DeviceMesh,
        *,
        reshard_after_forward: bool,
        expert_sharding: str = "auto",
        tp_mesh: DeviceMesh | None = None,
    ) -> DedicationMode:
        """From the mesh and settings ``dedicate_params`` got, checked (the one place the mesh is read)."""
        if expert_sharding not in EXPERT_SHARDINGS:
            raise ValueError(f"expert_sharding must be one of {EXPERT_SHARDINGS}, got {expert_sharding!r}")
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(
                f"reshard_after_forward must be a bool (True = Z3, False = Z2), got {reshard_after_forward!r} "
                f"of type {type(reshard_after_forward).__name__}"
            )
        tp = TensorParallelInfo.from_mesh(tp_mesh) if tp_mesh is not None and tp_mesh.size() > 1 else None
        return cls(
            mesh=MeshInfo.from_mesh(mesh),
            reshard_after_forward=reshard_after_forward,
            expert_sharding=expert_sharding,
            tp=tp,
        )

    @property
    def name(self) -> str:
        """The design's name for this mode (the cost model's key)."""
        return "dmuon_z3" if self.reshard_after_forward else "dmuon_z2"

    def experts_stay_local(self, num_experts: int) -> bool:
        """The one rule for 3-D expert weights: stay where FSDP2 (or expert parallelism) keeps whole
        experts per rank, each rank updating its own ("local"), or get one owner each ("dedicated").

        "auto": local when the data-parallel world has no more ranks than there are experts, where
        FSDP2 (TorchTitan: also under HSDP) shards them on dim 0 without padding; with more ranks
        TorchTitan would split each expert (dim 1), so each expert weight is dedicated instead."""
        if self.expert_sharding == "auto":
            return num_experts >= self.mesh.world_size
        return self.expert_sharding == "local"


def coalesces(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether this group's backend runs a group of collectives as one launch.

    NCCL does (``ncclGroupStart/End``); gloo cannot; the fake backend used to
    count launches at large world sizes accepts coalescing like NCCL."""
    if dist.get_backend(group) == "fake":
        return True
    try:
        return bool(group._get_backend(device).supports_coalescing)
    except RuntimeError:
        return False


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.accelerator.current_device_index())
