"""What DMuon reads of TorchTitan's parallel layout: the degrees (``ParallelDegrees``, decoded once from
``ParallelDims``), the expert region's ranks, and the mesh DMuon dedicates over (dp_shard x cp, with
HSDP's replicas).
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_dmuon.plan.cost_model import dedication_shard_size


@dataclass(frozen=True, kw_only=True)
class ParallelDegrees:
    """What DMuon's dedication reads of TorchTitan's ParallelDims, decoded once per model part
    (``parallelize_with_dmuon``): the degrees, and the layouts they make."""

    replicate: int  # dp_replicate
    shard: int  # dp_shard
    cp: int
    tp: int
    ep: int
    pipelined: bool

    @staticmethod
    def of(parallel_dims) -> ParallelDegrees:
        return ParallelDegrees(
            replicate=parallel_dims.dp_replicate,
            shard=parallel_dims.dp_shard,
            cp=parallel_dims.cp,
            tp=parallel_dims.tp,
            ep=parallel_dims.ep,
            pipelined=parallel_dims.pp_enabled,
        )

    @property
    def fsdp(self) -> int:
        """The ranks FSDP2 shards over (TorchTitan's ``fsdp``): dp_shard x cp. Context-parallel ranks hold
        the same weights and see different parts of each sequence, so their gradients are summed with the
        data-parallel shards': they are DMuon's shard group, whose owners run Newton–Schulz."""
        return dedication_shard_size(data_parallel_shard=self.shard, context_parallel=self.cp)

    @property
    def sharded(self) -> bool:
        """FSDP2 shards the other parameters (FSDP or HSDP, context parallelism included)."""
        return self.fsdp > 1

    @property
    def ddp(self) -> bool:
        """Data parallelism by replicas only: every rank holds every parameter."""
        return self.fsdp == 1 and self.replicate > 1

    @property
    def expert_region_ranks(self) -> int:
        return expert_region_ranks(shard=self.shard, cp=self.cp, tp=self.tp)

    @property
    def storage_ranks(self) -> int:
        """The ranks of FSDP2's storage mesh under tensor parallelism (spmd_types): replicate x shard x cp x tp."""
        return self.replicate * self.shard * self.cp * self.tp


def expert_region_ranks(*, shard: int, cp: int, tp: int) -> int:
    """The ranks TorchTitan splits into expert-FSDP x EP: dp_shard x cp x tp, whatever the EP degree
    (its efsdp = dp_shard * cp * tp / ep). One rule for the check before launch (the config's degrees)
    and the dedication (ParallelDims)."""
    return shard * cp * tp


def dedication_mesh(parallel_dims, degrees: ParallelDegrees, spmd: bool):
    """DMuon's dedication group: every rank that sums a dedicated weight's gradient. FSDP2's shard group
    (``ParallelDegrees.fsdp``: dp_shard x cp), x the replicas under HSDP; the replicas alone under DDP.
    Under the spmd_types backend TorchTitan names no dp_shard x cp mesh (FSDP2 flattens the two dims
    itself): it is flattened here, under TorchTitan's legacy name for it, ``fsdp``."""
    replicate, shard_ranks = degrees.replicate, degrees.fsdp
    shard_mesh = _shard_mesh(parallel_dims, degrees, spmd)
    if replicate > 1 and shard_ranks > 1:
        from torch.distributed.device_mesh import DeviceMesh

        if spmd and degrees.cp > 1:  # (a 2-D mesh of the replicate dim and the flattened one)
            return DeviceMesh._concatenate([parallel_dims.get_mesh("dp_replicate"), shard_mesh])
        return parallel_dims.get_mesh(["dp_replicate", "dp_shard" if spmd else "fsdp"])
    if shard_ranks > 1:
        return shard_mesh
    if replicate > 1:
        return parallel_dims.get_mesh("dp_replicate")
    if parallel_dims.world_size > 1:  # one data-parallel rank under pipeline or tensor parallelism: a mesh of
        return shard_mesh  # one (the world mesh would be the pp or tp ranks)
    return parallel_dims.world_mesh


def _shard_mesh(parallel_dims, degrees: ParallelDegrees, spmd: bool):
    if not spmd:
        return parallel_dims.get_mesh("fsdp")  # (TorchTitan's legacy backend: dp_shard x cp already)
    if degrees.cp == 1:
        return parallel_dims.get_mesh("dp_shard")
    return parallel_dims.get_mesh(["dp_shard", "cp"])._flatten("fsdp")  # (spmd_types keeps dp_shard at size 1)
