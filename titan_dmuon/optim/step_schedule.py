"""The order of DMuon's Muon step: which weights are updated together, and when each is sent on.

As FSDP2 keeps a unit's lifecycle out of ``FSDPModule``, the step's schedule lives here, out of the
optimizer's API (``optimizer.py``) and out of the update rule (``optim/whole_update.py``: what runs on an
owner for a list of weights). Per handle, the dedicated weights are updated unit by unit in forward
order, in chunks of 1, 1, 2, 4, ... units (``pipeline_chunks``); after each chunk the handle sends its
units on (HSDP's broadcast to replicas; the first unit's broadcast for the next forward), so those
transfers overlap the Newton–Schulz of the later chunks. Each chunk is a ``Job``: its units and, per
param group, its weights: ``OwnedWeight`` (held whole here: ``OwnerUpdate.update``), ``GroupedWeight``
(a block of an owner group's weight: ``optim/grouped_update.py``, with the group's all-reduces) or ``TPItem``
(tensor-parallel shards: ``TensorParallelStep``'s three stages, a pipeline across jobs that sends a
job's units on once its weights are applied).
Experts that FSDP2 keeps in place follow: those TP splits as jobs of the same pipeline (nothing is
sent on after them), the others updated where they are.

Every rank runs every unit's ``before_update``/``updated`` in the same order, whatever it owns: they
issue collectives on groups that FSDP2 and the other ranks share. An owner group's sums go job by job and,
in a job, by the param group's position in the optimizer (then by name: ``grouped_update.batch_order``),
never in the order this rank happens to meet its weights: two groups that share ranks then see their sums
in one order on every rank (``tests/distributed/test_issue_order.py`` and ``tests/titan/test_issue_order_layouts.py``
check every communicator's order).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from titan_dmuon.optim.grouped_update import GroupedWeight, update_grouped
from titan_dmuon.optim.tensor_parallel_update import TensorParallelStep, TPItem
from titan_dmuon.optim.whole_update import OwnedWeight, OwnerUpdate


@dataclass(eq=False)
class Job:
    """Weights updated together, then ``units`` sent on (none for experts FSDP2 keeps); ``work`` is
    by param group's position in the optimizer: (group, its weights); ``in_order`` lists it by position,
    whatever order the weights were added in."""

    units: list
    work: dict[int, tuple[dict, list]] = field(default_factory=dict)

    def add(self, position: int, group: dict, items: list) -> None:
        self.work.setdefault(position, (group, []))[1].extend(items)

    def in_order(self) -> list[tuple[dict, list]]:
        return [self.work[position] for position in sorted(self.work)]


class StepSchedule:
    """DMuon's Muon step over its handles, in the order that overlaps its communication."""

    def __init__(self, owner_update: OwnerUpdate, handles: list, *, qk_clip=None, dedicated_ids: set[int]) -> None:
        self.owner_update, self.handles, self.qk_clip = owner_update, handles, qk_clip
        self._dedicated_ids = dedicated_ids  # every dedicated parameter DMuon was given (filled as it is built)

    def run(self, groups: list[dict]) -> None:
        """Dedicated weights unit by unit in forward order, each handle told after each unit; then the
        experts each rank updates in place (no communication follows them)."""
        for handle in self.handles:
            jobs = self._dedicated_jobs(handle, groups) + self._local_tensor_parallel_jobs(handle, groups)
            self._run_pipelined(handle, jobs)
        self._update_local_experts(groups)
        if self.qk_clip is not None:
            self.qk_clip.finish()

    def _run_pipelined(self, handle, jobs: list[Job]) -> None:
        """Weights held whole are updated at once and their units sent on; tensor-parallel ones go
        through ``TensorParallelStep``'s pipeline, which sends their units on once they are applied.
        Units are sent on in job order: a job with no TP weights first lets the pipeline finish."""
        tp_step = TensorParallelStep(handle.tensor_parallel_ns, self.owner_update) if handle.mode.tp else None
        for job in jobs:
            for unit in job.units:
                handle.before_update(unit)
            tp_work = []
            for group, items in job.in_order():
                owned = [w for w in items if isinstance(w, OwnedWeight)]
                if owned:
                    self.owner_update.update(group, owned)
                grouped = [w for w in items if isinstance(w, GroupedWeight)]
                if grouped:  # (its members run it together: the same list on each). No TP pipeline is in flight
                    # here: a tp mesh makes every weight TP (check_tp_dims_complete), and TP weights get no group
                    # (MatrixSpec.may_group), so these sends never pass a unit's deferred broadcast on NCCL
                    update_grouped(self.owner_update, group, grouped, handle.owner_groups)
                sharded = [w for w in items if isinstance(w, TPItem)]
                if sharded:  # (the same list on every rank of the TP group)
                    tp_work.append((group, sharded))
            if tp_work:
                tp_step.submit(tp_work, then=functools.partial(self._send_on, handle, job.units))
                continue
            if tp_step is not None:
                tp_step.finish()
            self._send_on(handle, job.units)  # at once: the next forward starts with the first ones
        if tp_step is not None:
            tp_step.finish()

    def _send_on(self, handle, units: list) -> None:
        """The units' weights are updated: QK-clip's rescale (on the owners), then the handle sends
        them on (HSDP's replica broadcast, the next forward's first broadcast). Every rank calls this
        for every unit in the same order, whatever it owns."""
        if self.qk_clip is not None:
            for unit in units:
                self.qk_clip.rescale(handle, unit.index)
        for unit in units:
            handle.updated(unit)

    # ---- what each job holds ------------------------------------------------------------------------
    def _dedicated_jobs(self, handle, groups: list[dict]) -> list[Job]:
        """This handle's weights this rank runs Newton–Schulz for (with a gradient), in the handle's
        step units in chunks (``pipeline_chunks``), each job's weights merged by param group."""
        by_unit: dict[int, Job] = {}
        for position, group in enumerate(groups):
            for p in group["params"]:
                member = handle.member_of(p)
                if member is None:
                    if id(p) in self._dedicated_ids and not any(h.member_of(p) for h in self.handles):
                        raise RuntimeError(
                            "a dedicated parameter held by DMuon is no longer the module's parameter: it was "
                            "replaced after DMuon was built (e.g. by model.to_empty() on a meta-device model). "
                            "Build DMuon after the model is materialised, as with FSDP2."
                        )
                    continue
                if member.runs_ns and p.grad is not None:
                    by_unit.setdefault(member.unit, Job([])).add(position, group, [_dedicated_item(p, member)])
        return _merged(pipeline_chunks(handle.step_units()), by_unit, key=lambda unit: unit.index, sent_on=True)

    def _local_tensor_parallel_jobs(self, handle, groups: list[dict]) -> list[Job]:
        """Experts split by tensor parallelism that FSDP2 keeps on this data-parallel rank, in chunks of
        layers in forward order (as the dedicated units)."""
        if handle.mode.tp is None:
            return []
        planned = handle.local_tp_experts
        by_layer: dict[int, Job] = {}
        for position, group in enumerate(groups):
            for p in group["params"]:
                experts = handle.local_expert_of(p)
                if experts is None or experts.tp_dim is None or p.grad is None or experts.fqn not in planned:
                    continue
                weight = whole_local_experts(p, tp_dim=experts.tp_dim)
                chunk = planned[experts.fqn]
                if weight.shape[0] != len(chunk.tp_homes):
                    raise RuntimeError(
                        f"{experts.fqn}: this rank holds {weight.shape[0]} experts but the plan expects "
                        f"{len(chunk.tp_homes)} (FSDP2's dim-0 shards of the stack, ceil(E/N) per rank)"
                    )
                item = TPItem(param=p, weight=weight, grad=_local(p.grad), matrices=chunk.tp_matrices())
                by_layer.setdefault(experts.unit, Job([])).add(position, group, [item])
        order = [u.index for u in handle.step_units()]
        layers = sorted(by_layer, key=lambda u: (order.index(u) if u in order else len(order), u))
        return _merged(pipeline_chunks(layers), by_layer, key=lambda layer: layer, sent_on=False)

    def _update_local_experts(self, groups: list[dict]) -> None:
        """The experts this rank holds and updates in place (FSDP2's whole-expert shards, not split by
        tensor parallelism), per param group; no communication follows them."""
        for group in groups:
            weights = []
            for p in group["params"]:
                experts = next((e for h in self.handles if (e := h.local_expert_of(p)) is not None), None)
                if experts is not None and experts.tp_dim is None and p.grad is not None:
                    weights.append(
                        OwnedWeight(
                            param=p,
                            tensor=whole_local_experts(p),
                            grad=_local(p.grad),
                            blocks=experts.blocks,
                            col_blocks=experts.col_blocks,
                        )
                    )
            if weights:
                self.owner_update.update(group, weights)


def _merged(chunks: list[list], by_key: dict[int, Job], *, key, sent_on: bool) -> list[Job]:
    """One job per chunk: the weights of its members' jobs (``by_key[key(member)]``) merged by param
    group; its units are the chunk's when ``sent_on``."""
    merged = []
    for chunk in chunks:
        job = Job(list(chunk) if sent_on else [])
        for member in chunk:
            for position, (group, items) in by_key[key(member)].work.items() if key(member) in by_key else ():
                job.add(position, group, items)
        merged.append(job)
    return merged


def _dedicated_item(p: torch.Tensor, member):
    """A dedicated weight as a job holds it: whole on its owner, a block on a member of its owner group,
    or a tensor-parallel ``TPItem``."""
    if member.group is not None:
        return GroupedWeight(param=p, grad=p.grad, member=member)
    if not member.entry.tensor_parallel:
        return OwnedWeight(
            param=p, tensor=p, grad=p.grad, blocks=member.entry.blocks, col_blocks=member.entry.col_blocks
        )
    return TPItem(param=p, weight=p, grad=p.grad, matrices=member.entry.tp_matrices())


def pipeline_chunks(units: list) -> list[list]:
    """Units in forward order, in chunks of 1, 1, 2, 4, 8, ...: the first layers are sent on after
    their own Newton–Schulz (the next forward starts with them), the later ones share batched
    calls, so a deep model costs ~log2(layers) rounds of the step's Python, not one per layer."""
    chunks, start, size = [], 0, 1
    while start < len(units):
        chunks.append(units[start : start + size])
        start += size
        size = size if len(chunks) == 1 else 2 * size
    return chunks


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def whole_local_experts(param: torch.Tensor, *, tp_dim: int | None = None) -> torch.Tensor:
    """This rank's experts of a 3-D weight, each whole (FSDP2 / EP shard it on dim 0), or each its TP
    shard along ``tp_dim`` (tensor parallelism splits every expert alike)."""
    if isinstance(param, DTensor):
        for placement in param.placements:
            # Shard(0), or _StridedShard(0) under FSDP2 + expert parallelism: whole experts per rank
            dim = getattr(placement, "dim", None)
            if not (placement.is_replicate() or dim == 0 or (tp_dim is not None and dim == tp_dim)):
                raise RuntimeError(
                    f"an expert weight of shape {tuple(param.shape)} is sharded {param.placements}: DMuon updates "
                    "experts in place only when every rank holds whole experts (sharded on dim 0). Use "
                    "dedicate_params(..., expert_sharding='dedicated') to give each expert weight one owner instead."
                )
    return _local(param)
