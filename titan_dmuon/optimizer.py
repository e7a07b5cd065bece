"""DMuon: one optimizer over all of a model's parameters.

Dedicated weights get Muon, applied only by their global owner (no collective
in the step on a 1-D mesh); experts left where FSDP2 keeps them get Muon on
every rank for its own experts; every other parameter (FSDP2 DTensor shards,
DDP-replicated tensors) gets AdamW with ``torch.optim.AdamW`` semantics.

The step is pipelined with the communication: dedicated weights are updated
layer by layer in forward order, and after each layer the handle sends it on
(HSDP's broadcast to replicas; the first layer's broadcast for the next
forward), so those transfers overlap the Newton–Schulz of the later layers.

Each user param group is split into a Muon group and an AdamW group, both
carrying their learning rate under ``"lr"``, so LR schedulers scale both.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam

from titan_dmuon.muon_math import adjusted_lr, block_rows, local_block_rows, muon_step, orthogonalise, scalar
from titan_dmuon.optimizer_state import adamw_initial_state, initialise_missing_state, list_every_param
from titan_dmuon.options import JOB_KEYS, OPTION_NAMES, DMuonOptions, OptionError
from titan_dmuon.qk_clip import CLIPPED_HEADS_STAT, MAX_LOGIT_STAT
from titan_dmuon.runtime.fsdp_ignore import check_left_alone
from titan_dmuon.runtime.handle import handles_for
from titan_dmuon.runtime.streams import DeviceTimer


class StepStat:
    """The keys of ``DMuon.last_step_stats`` (the integration's per-step figures are made from them)."""

    NS_MATRICES = "ns_matrices"  # Newton–Schulz matrices (blocks: a fused q/k/v counts 3) on this rank
    NS_SECONDS = "ns_seconds"  # their time on the device
    HOST_SECONDS = "host_seconds"  # the step's host time (Python, launches; on the CPU the work too)
    QK_MAX_LOGIT = MAX_LOGIT_STAT  # QK-clip: the largest logit before clipping
    QK_CLIPPED_HEADS = CLIPPED_HEADS_STAT  # QK-clip: the heads clipped


class DMuon(torch.optim.Optimizer):
    """Muon for dedicated weights (see :func:`titan_dmuon.dedicate_params`), AdamW for the rest.

    ``params``: the model (``DMuon(model, ...)``: all its parameters) or parameters / param groups.
    ``dedicated``: the handle(s) ``dedicate_params`` returned for this model; by default the
    handles are found from the parameters (and the model's ``dedicate_params`` calls). Keyword
    arguments and group options: the fields of :class:`titan_dmuon.options.DMuonOptions`
    (``lr``, ``momentum``, ``ns_mode``, ``adamw_lr``, ...), e.g.
    ``[{"params": blocks, "lr": 0.02}, {"params": head, "adamw_lr": 1e-4}]``.
    After each ``step()``, ``last_step_stats`` holds this rank's Newton–Schulz
    figures (matrices, time); reading the time syncs with the device once.

    QK-clip (MuonClip): ``qk_clip_threshold=tau`` with ``qk_clip_attention``, one
    :class:`titan_dmuon.qk_clip.QKClipAttention` per attention layer (its q/k weights
    dedicated); after each step every head whose largest logit S exceeded tau has its
    q/k rows rescaled on their owner (``titan_dmuon.qk_clip``).
    """

    def __init__(self, params: Iterable | nn.Module, *, dedicated=None, qk_clip_attention=None, **options) -> None:
        _check_known(options, "DMuon")
        defaults = DMuonOptions(**options)
        module = params if isinstance(params, nn.Module) else None  # DMuon(model, ...): all its parameters
        user_groups = list(module.parameters() if module is not None else params)
        if not user_groups:
            raise ValueError("DMuon got an empty parameter list")
        if not isinstance(user_groups[0], dict):
            user_groups = [{"params": user_groups}]
        for user_group in user_groups:
            ps = user_group["params"]
            user_group["params"] = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        self._handles = handles_for([p for g in user_groups for p in g["params"]], dedicated, module=module)
        check_left_alone([m for handle in self._handles for m in handle.members])
        self._dedicated_ids: set[int] = set()
        groups = []
        for user_group in user_groups:
            group_options = {k: v for k, v in user_group.items() if k not in ("params", "param_names")}
            _check_known(group_options, "DMuon param-group")
            for key in JOB_KEYS:
                if key in group_options:
                    raise OptionError(key, group_options[key], "a DMuon(...) keyword, not a param-group option (one value per job)")
            merged = dataclasses.replace(defaults, **group_options)
            group_params, names = user_group["params"], user_group.get("param_names")
            for use_muon in (True, False):
                chosen = [i for i, p in enumerate(group_params) if self._is_muon_param(p) == use_muon]
                if not chosen:
                    continue
                group = {"params": [group_params[i] for i in chosen], "use_muon": use_muon}
                if names is not None:  # TorchTitan keys its flat optimizer state by these
                    group["param_names"] = [names[i] for i in chosen]
                group.update(merged.muon() if use_muon else merged.adamw())
                groups.append(group)
        super().__init__(groups, {})
        self._ns_timer: DeviceTimer | None = None
        self._ns_matrices = 0
        self._host_seconds = 0.0
        self.ns_method = defaults.ns_method  # (a job key: not in the param groups, so not in checkpoints)
        self._trim_host_heap = None  # glibc's malloc_trim when the Muon step runs on the CPU (first step)
        self.qk_clip = None
        if defaults.qk_clip_threshold is not None:
            from titan_dmuon.qk_clip import QKClip

            self.qk_clip = QKClip(list(qk_clip_attention or ()), self._handles,
                                  threshold=defaults.qk_clip_threshold, alpha=defaults.qk_clip_alpha)

    def _is_muon_param(self, p: torch.Tensor) -> bool:
        for handle in self._handles:
            if handle.member_of(p) is not None:
                self._dedicated_ids.add(id(p))
                return True
            if handle.local_expert_of(p) is not None:
                return True
        return False

    def dedicated_handles(self) -> list:
        """The dedicate_params handles this optimizer steps, in a fixed order."""
        return list(self._handles)

    @property
    def last_step_stats(self) -> dict[str, float]:
        """This rank's last step: Newton–Schulz matrices (blocks: a fused q/k/v counts 3) and time
        (device), and the step's host time (Python, launches; on the CPU the work too)."""
        seconds = self._ns_timer.seconds() if self._ns_timer is not None else 0.0
        stats = {StepStat.NS_MATRICES: self._ns_matrices, StepStat.NS_SECONDS: seconds,
                 StepStat.HOST_SECONDS: self._host_seconds}
        if self.qk_clip is not None:  # QK-clip: the largest logit before clipping and the heads clipped
            stats.update(self.qk_clip.stats())
        return stats

    def state_dict(self):
        """Also lands HSDP's in-flight post-step broadcasts first.

        DCP asks every Stateful for its state before it reads a checkpoint into
        the model's tensors in place; TorchTitan's zero-gradient step inside this
        call starts broadcasts of the pre-load weights, which must not land after
        the load.

        Every parameter is listed, with no entries on the ranks that keep nothing for it, and a fresh
        optimizer lists the zeros its first step would create (``optimizer_state``): PyTorch's
        ``get_state_dict``/``set_state_dict`` and ``dcp.save``/``dcp.load`` then work with their defaults."""
        for handle in self._handles:
            handle.wait_for_replicate_broadcasts(host=True)
        initialise_missing_state(self)
        packed = super().state_dict()
        for index, p, member, handle in self._tensor_parallel_params():
            state = packed["state"].get(index)
            if state is not None and "momentum_buffer" in state:  # (a new dict: super's shares ours)
                packed["state"][index] = {**state, "momentum_buffer": handle.as_sharded(member, state["momentum_buffer"])}
        list_every_param(self, packed)
        return packed

    def load_state_dict(self, state_dict) -> None:
        """Momentum of tensor-parallel shards arrives as DTensors of the full matrix (``state_dict``):
        each rank keeps its shard. The state is keyed as the saved param groups list the parameters
        (positions, or names from ``get_state_dict``), in the order of ours."""
        states = state_dict.get("state", {})
        keys = [key for group in state_dict.get("param_groups", []) for key in group["params"]]
        for index, _, member, handle in self._tensor_parallel_params():
            key = keys[index] if index < len(keys) else index
            state = states.get(key)
            if state is not None and isinstance(state.get("momentum_buffer"), DTensor):
                states[key] = {**state, "momentum_buffer": state["momentum_buffer"].to_local()}
        super().load_state_dict(state_dict)

    def _tensor_parallel_params(self):
        """(state-dict index, param, member, handle) of each TP-sharded dedicated weight, in the
        numbering ``Optimizer.state_dict`` gives parameters."""
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                for handle in self._handles:
                    member = handle.member_of(p)
                    if member is not None and member.entry.tp_dim is not None:
                        yield index, p, member, handle
                index += 1

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        start = time.perf_counter()
        self._ns_matrices = 0
        if self.qk_clip is not None:
            self.qk_clip.start()  # the MAX all-reduce of the step's logits, waited at the first rescale
        self._muon_step([g for g in self.param_groups if g["use_muon"]])
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adamw_group_step(group)
        if self._trim_host_heap is None and self._ns_timer is not None:
            self._trim_host_heap = _host_heap_trim() if self._ns_timer.on_host else False
        if self._trim_host_heap:
            self._trim_host_heap(0)
        self._host_seconds = time.perf_counter() - start
        return loss

    def _muon_step(self, groups: list[dict]) -> None:
        """Dedicated weights unit by unit in forward order, each handle told after each unit;
        then the experts each rank updates in place (no communication follows them).

        Tensor-parallel weights go through three stages per chunk (momentum and send, NS on the
        homes, update), pipelined: chunk k+1's shards go out before chunk k's results are applied,
        so its transfer overlaps that work and chunk k's weights are sent on before chunk k+1's NS.
        Experts that tensor parallelism splits and FSDP2 keeps in place follow in chunks of layers
        through the same pipeline (nothing is sent on after them)."""
        for handle in self._handles:
            jobs = self._dedicated_jobs(handle, self._dedicated_work(handle, groups))
            self._run_pipelined(handle, jobs + self._local_tensor_parallel_jobs(handle, groups))
        self._update_local_experts(groups)
        if self.qk_clip is not None:
            self.qk_clip.finish()

    def _dedicated_work(self, handle, groups: list[dict]) -> dict[int, dict]:
        """This handle's weights this rank runs Newton–Schulz for (with a gradient), by unit index, then
        by param group: {unit: {id(group): (group, items)}}."""
        by_unit: dict[int, dict] = {}
        for group in groups:
            for p in group["params"]:
                member = handle.member_of(p)
                if member is None:
                    if id(p) in self._dedicated_ids and not any(h.member_of(p) for h in self._handles):
                        raise RuntimeError(
                            "a dedicated parameter held by DMuon is no longer the module's parameter: it was "
                            "replaced after DMuon was built (e.g. by model.to_empty() on a meta-device model). "
                            "Build DMuon after the model is materialised, as with FSDP2."
                        )
                    continue
                if member.runs_ns and p.grad is not None:
                    work = by_unit.setdefault(member.unit, {}).setdefault(id(group), (group, []))
                    work[1].append(_item(p, member))
        return by_unit

    @staticmethod
    def _dedicated_jobs(handle, by_unit: dict[int, dict]) -> list:
        """The jobs of ``_run_pipelined`` for the dedicated weights: the handle's step units in chunks
        (``_pipeline_chunks``), each with its units' work merged by param group."""
        jobs = []
        for chunk in _pipeline_chunks(handle.step_units()):
            work: dict[int, tuple[dict, list]] = {}
            for unit in chunk:
                for key, (group, items) in by_unit.get(unit.index, {}).items():
                    work.setdefault(key, (group, []))[1].extend(items)
            jobs.append((chunk, work))
        return jobs

    def _update_local_experts(self, groups: list[dict]) -> None:
        """The experts this rank holds and updates in place (FSDP2's whole-expert shards, not split by
        tensor parallelism), per param group; no communication follows them."""
        for group in groups:
            weights, blocks = [], []
            for p in group["params"]:
                experts = next((e for h in self._handles if (e := h.local_expert_of(p)) is not None), None)
                if experts is not None and experts.tp_dim is None and p.grad is not None:
                    weights.append(p)
                    blocks.append(experts.blocks)
            if weights:
                self._update(group, weights, blocks, local_experts=True)

    def _run_pipelined(self, handle, jobs: list) -> None:
        """``jobs``: (units sent on after it, {group: (group, items)}) in order. Plain items are updated
        at once; tensor-parallel ones go to their homes, and the previous job's results are applied
        while they travel."""
        pending: tuple[list, list] | None = None  # a job whose TP results are on their way back
        for units, work in jobs:
            for unit in units:
                handle.before_update(unit)
            sent = []
            for group, items in work.values():
                plain = [(p, m) for p, m in items if not isinstance(m, _TPItem)]
                if plain:
                    self._update(group, [p for p, _ in plain], [m.entry.blocks for _, m in plain])
                sharded = [m for _, m in items if isinstance(m, _TPItem)]
                if sharded:  # (the same list on every rank of the TP group)
                    sent.append((group, sharded, self._send_tensor_parallel(group, handle, sharded)))
            if pending is not None:  # the previous job's results arrived while this one's went out
                self._finish_tensor_parallel(handle, *pending)
                pending = None
            if not sent:
                self._send_on(handle, units)  # at once: the next forward starts with the first ones
                continue
            back = [(group, items, self._orthogonalise_tensor_parallel(group, handle, exchange))
                    for group, items, exchange in sent]
            pending = (units, back)
        if pending is not None:
            self._finish_tensor_parallel(handle, *pending)

    def _local_tensor_parallel_jobs(self, handle, groups: list[dict]) -> list:
        """Experts split by tensor parallelism that FSDP2 keeps on this data-parallel rank, in chunks of
        layers in forward order (as the dedicated units), as jobs of ``_run_pipelined``."""
        if handle.mode.tp is None:
            return []
        planned = handle.local_tp_experts
        by_layer: dict[int, dict] = {}
        for group in groups:
            for p in group["params"]:
                experts = handle.local_expert_of(p)
                if experts is None or experts.tp_dim is None or p.grad is None or experts.fqn not in planned:
                    continue
                weight = _whole_local_experts(p, tp_dim=experts.tp_dim)
                chunk = planned[experts.fqn]
                if weight.shape[0] != len(chunk.tp_homes):
                    raise RuntimeError(
                        f"{experts.fqn}: this rank holds {weight.shape[0]} experts but the plan expects "
                        f"{len(chunk.tp_homes)} (FSDP2's dim-0 shards of the stack, ceil(E/N) per rank)"
                    )
                item = _TPItem(param=p, weight=weight, grad=_local(p.grad), matrices=chunk.tp_matrices(),
                               full_cols=chunk.spec.full_shape[-1])
                by_layer.setdefault(experts.unit, {}).setdefault(id(group), (group, []))[1].append((p, item))
        order = [u.index for u in handle.step_units()]
        layers = sorted(by_layer, key=lambda u: (order.index(u) if u in order else len(order), u))
        jobs = []
        for chunk in _pipeline_chunks(layers):
            work: dict[int, tuple[dict, list]] = {}
            for layer in chunk:
                for key, (group, items) in by_layer[layer].items():
                    work.setdefault(key, (group, []))[1].extend(items)
            jobs.append(([], work))
        return jobs

    def _update(self, group: dict, params: list, blocks: list, *, local_experts: bool = False) -> None:
        """Muon on ``params`` (this rank's): momentum state, then one ``muon_step``."""
        tensors, grads, buffers, kept_blocks = [], [], [], []
        for p, param_blocks in zip(params, blocks):
            state = self.state[p]
            if "momentum_buffer" not in state:  # (local experts: a DTensor like p, on every rank)
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if local_experts:
                weights = _whole_local_experts(p)
                if weights.shape[0] == 0:
                    continue  # FSDP2 gave this rank no expert of this weight
                tensors.append(weights)
                grads.append(_local(p.grad))
                buffers.append(_local(state["momentum_buffer"]))
            else:
                tensors.append(p)
                grads.append(p.grad)
                buffers.append(state["momentum_buffer"])
            kept_blocks.append(param_blocks)
        if not tensors:
            return
        if self._ns_timer is None:
            self._ns_timer = DeviceTimer(tensors[0].device)
        with self._ns_timer.timing(accumulate=self._ns_matrices > 0):
            self._ns_matrices += muon_step(
                tensors, grads, buffers, kept_blocks,
                lr=group["lr"], weight_decay=group["weight_decay"], momentum=group["momentum"],
                nesterov=group["nesterov"], ns_steps=group["ns_steps"], ns_coefficients=group["ns_coefficients"],
                eps=group["eps"], adjust_lr_fn=group["adjust_lr_fn"], ns_mode=group["ns_mode"],
                ns_method=self.ns_method,
            )

    # ---- tensor-parallel shards: three stages, pipelined over the step's chunks ----------------------
    def _send_tensor_parallel(self, group: dict, handle, items: list):
        """torch.optim.Muon's momentum on this rank's shards; their bf16 NS inputs to the homes. A
        replicated weight's momentum and input live on its home only (the one rank with its summed
        gradient: ``GradientReducer``)."""
        momentum, me, inputs, matrices = group["momentum"], handle.mode.tp.rank, [], []
        for item in items:
            matrices += item.matrices
            if item.matrices[0].dim is None and item.matrices[0].home != me:
                inputs += [None] * len(item.matrices)
                continue
            state = self.state[item.param]
            if "momentum_buffer" not in state:  # (local experts: a DTensor like the param)
                state["momentum_buffer"] = torch.zeros_like(item.param, memory_format=torch.preserve_format)
            buffer = _local(state["momentum_buffer"])
            buffer.lerp_(item.grad, 1 - momentum)
            ns_input = item.grad.lerp(buffer, momentum) if group["nesterov"] else buffer
            inputs += [(ns_input[k] if ns_input.ndim == 3 else ns_input).bfloat16() for k in range(len(item.matrices))]
        return handle.tensor_parallel_ns.send_to_homes(matrices, inputs)

    def _orthogonalise_tensor_parallel(self, group: dict, handle, sent):
        """Newton–Schulz of the matrices homed here (assembled from their shards); results sent back."""
        def orthogonalise_fn(matrices):
            return orthogonalise(matrices, ns_mode=group["ns_mode"], steps=group["ns_steps"],
                                 coefficients=group["ns_coefficients"], eps=group["eps"], ns_method=self.ns_method)

        if self._ns_timer is None:
            self._ns_timer = DeviceTimer(sent.sent.device)
        with self._ns_timer.timing(accumulate=self._ns_matrices > 0):
            back = handle.tensor_parallel_ns.orthogonalise_at_homes(sent, orthogonalise_fn)
        self._ns_matrices += back.ns_matrices
        return back

    def _finish_tensor_parallel(self, handle, chunk: list, back: list) -> None:
        """Weight decay and each row block's update (scaled for the full block) on this rank's shards,
        then the chunk's units are sent on."""
        tp_rank = handle.mode.tp.rank
        for group, items, exchange in back:
            lr = scalar(group["lr"])
            updates = iter(handle.tensor_parallel_ns.received(exchange))
            for item in items:
                item.weight.mul_(1 - lr * group["weight_decay"])
                for k, matrix in enumerate(item.matrices):
                    update, target = next(updates), item.weight[k] if item.weight.ndim == 3 else item.weight
                    for block in matrix.blocks:
                        scale = adjusted_lr(lr, group["adjust_lr_fn"], (block_rows(block), item.full_cols))
                        for start, stop, _ in local_block_rows(block, tp_dim=matrix.dim, tp_rank=tp_rank,
                                                               local_rows=matrix.shape[0]):
                            target[start:stop].add_(update[start:stop], alpha=-scale)
        self._send_on(handle, chunk)

    def _send_on(self, handle, chunk: list) -> None:
        """The chunk's weights are updated: QK-clip's rescale (on the owners), then the handle sends
        them on (HSDP's replica broadcast, the next forward's first broadcast). Every rank calls this
        for every unit in the same order, whatever it owns."""
        if self.qk_clip is not None:
            for unit in chunk:
                self.qk_clip.rescale(handle, unit.index)
        for unit in chunk:
            handle.updated(unit)

    def _adamw_group_step(self, group: dict) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state.update(adamw_initial_state(p))
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adam(
            params, grads, exp_avgs, exp_avg_sqs, [], steps,
            amsgrad=False, beta1=beta1, beta2=beta2, lr=scalar(group["lr"]), weight_decay=group["weight_decay"],
            eps=group["eps"], maximize=False, decoupled_weight_decay=True,
        )


def _host_heap_trim():
    """glibc's ``malloc_trim``, or False (another C library). On a CPU the step's Newton–Schulz stacks
    (tens of MB each) come from the C heap, which keeps them after they are freed: the next forward's
    activations could not always reuse those pages, so the process's resident peak grew by them (qwen3
    moe_debug: 1.02x AdamW's, at a tensor high-water of 0.78x). ``malloc_trim(0)`` after the step gives
    the heap's free pages back to the OS (a few ms per step on a CPU; GPUs keep their caching allocator)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else False
    except (OSError, AttributeError):
        return False


@dataclass(eq=False)
class _TPItem:
    """A weight in the step's tensor-parallel exchange: the registered parameter (the optimizer
    state's key), what this rank updates of it (the TP shard, or its local experts' shards), the
    gradient of that, its matrices (one per expert) and the full matrix's columns (the lr rule)."""

    param: torch.Tensor
    weight: torch.Tensor
    grad: torch.Tensor
    matrices: list
    full_cols: int


def _item(p: torch.Tensor, member):
    """A dedicated weight as ``_run_pipelined`` takes it: plain, or a tensor-parallel ``_TPItem``."""
    if not member.entry.tensor_parallel:
        return p, member
    return p, _TPItem(param=p, weight=p, grad=p.grad, matrices=member.entry.tp_matrices(),
                      full_cols=member.entry.full_shape[-1])


def _pipeline_chunks(units: list) -> list[list]:
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


def _whole_local_experts(param: torch.Tensor, *, tp_dim: int | None = None) -> torch.Tensor:
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


def _check_known(options: dict, where: str) -> None:
    unknown = set(options) - set(OPTION_NAMES)
    if unknown:
        raise ValueError(f"unknown {where} option(s) {sorted(unknown)}; valid: {sorted(OPTION_NAMES)}")
