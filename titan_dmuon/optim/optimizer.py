"""DMuon: one optimizer over all of a model's parameters.

Dedicated weights get Muon, applied only by their global owner (no collective
in the step on a 1-D mesh); experts left where FSDP2 keeps them get Muon on
every rank for its own experts; every other parameter (FSDP2 DTensor shards,
DDP-replicated tensors) gets AdamW with ``torch.optim.AdamW`` semantics.

This module is the optimizer's API: param groups, options, state dicts, the
figures of the last step, AdamW. The Muon step's order (pipelined with the
communication: each layer sent on as soon as it is updated) is
``optim/step_schedule.py``'s; what runs on an owner for a list of weights
(momentum, Newton–Schulz, update) is ``optim/whole_update.py``'s, and the
tensor-parallel exchange's stages ``optim/tensor_parallel_update.py``'s.

Each user param group is split into a Muon group and an AdamW group, both
carrying their learning rate under ``"lr"``, so LR schedulers scale both.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam

from titan_dmuon.math.update_rules import scalar
from titan_dmuon.optim.optimizer_state import (
    adamw_initial_state,
    initialise_missing_state,
    keeps_momentum,
    list_every_param,
)
from titan_dmuon.optim.qk_clip import CLIPPED_HEADS_STAT, MAX_LOGIT_STAT
from titan_dmuon.optim.step_schedule import StepSchedule
from titan_dmuon.optim.tensor_parallel_update import merged_second_moments
from titan_dmuon.optim.whole_update import SECOND_MOMENT, NSFigures, OwnerUpdate
from titan_dmuon.options import JOB_KEYS, OPTION_NAMES, DMuonOptions, OptionError, check_whole_matrix_rules
from titan_dmuon.runtime.fsdp_ignore import check_left_alone
from titan_dmuon.runtime.handle import handles_for
from titan_dmuon.runtime.usage_checks import (
    check_every_member_given,
    check_sole_dmuon,
    check_still_registered,
    mark_held_by,
    registered_params,
    warn_if_nothing_dedicated,
)

MUON_STEP_RANGE = "DMuon.muon_step"  # the profiler's name for the Muon part of a step


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
    :class:`titan_dmuon.optim.qk_clip.QKClipAttention` per attention layer (its q/k weights
    dedicated); after each step every head whose largest logit S exceeded tau has its
    q/k rows rescaled on their owner (``titan_dmuon.optim.qk_clip``).

    Build it last (after ``dedicate_params``, ``fully_shard`` and materialising the model), as the one
    optimizer of the dedicated weights: ``runtime/usage_checks.py`` refuses the other orders.
    """

    steps_dedicated_weights = True  # (other optimizers over dedicated weights are refused at their first step)

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
        every_param = [p for g in user_groups for p in g["params"]]
        self._handles = handles_for(every_param, dedicated, module=module)
        check_left_alone([m for handle in self._handles for m in handle.members])
        check_every_member_given(self._handles, every_param)
        self._dedicated_ids: set[int] = set()
        groups = []
        for user_group in user_groups:
            group_options = {k: v for k, v in user_group.items() if k not in ("params", "param_names")}
            _check_known(group_options, "DMuon param-group")
            for key in JOB_KEYS:
                if key in group_options:
                    raise OptionError(
                        key, group_options[key], "a DMuon(...) keyword, not a param-group option (one value per job)"
                    )
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
        if dedicated is None:
            warn_if_nothing_dedicated(any(g["use_muon"] for g in groups))
        mark_held_by(self, every_param)
        roots = ([module] if module is not None else []) + [h.module for h in self._handles]
        self._first_step_checks = registered_params(roots, every_param)  # (cleared by the first step)
        # job keys (not in the param groups, so not in checkpoints; NorMuon's second moments are state)
        self.ns_method, self.ns_dtype, self.normuon_beta2 = (
            defaults.ns_method,
            defaults.ns_dtype,
            defaults.normuon_beta2,
        )
        self.ns_graphs = defaults.ns_graphs
        if self.ns_graphs:
            _check_graph_devices([p for g in self.param_groups if g["use_muon"] for p in g["params"]])
        check_whole_matrix_rules(
            self.param_groups, self._handles, ns_dtype=self.ns_dtype, normuon_beta2=self.normuon_beta2
        )
        self._ns = NSFigures()  # this rank's Newton–Schulz in the last step
        self._host_seconds = 0.0
        self.qk_clip = None
        if defaults.qk_clip_threshold is not None:
            from titan_dmuon.optim.qk_clip import QKClip

            self.qk_clip = QKClip(
                list(qk_clip_attention or ()),
                self._handles,
                threshold=defaults.qk_clip_threshold,
                alpha=defaults.qk_clip_alpha,
            )
        owner_update = self._owner_update = OwnerUpdate(self, self._ns)
        self._schedule = StepSchedule(
            owner_update, self._handles, qk_clip=self.qk_clip, dedicated_ids=self._dedicated_ids
        )

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
        stats = {
            StepStat.NS_MATRICES: self._ns.matrices,
            StepStat.NS_SECONDS: self._ns.seconds(),
            StepStat.HOST_SECONDS: self._host_seconds,
        }
        if self.qk_clip is not None:  # QK-clip: the largest logit before clipping and the heads clipped
            stats.update(self.qk_clip.stats())
        return stats

    @property
    def workspace_bytes(self) -> int:
        """The bytes this rank's Muon step keeps between steps for its temporaries (``optim/workspace.py``)."""
        return self._owner_update.workspace.nbytes()

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
        for index, _p, member, handle in self._tensor_parallel_params():
            state = packed["state"].get(index)
            if state is not None and "momentum_buffer" in state:  # (a new dict: super's shares ours)
                packed["state"][index] = {
                    **state,
                    "momentum_buffer": handle.as_sharded(member, state["momentum_buffer"]),
                }
        # Which second moments are merged (a collective on the TP group) follows the job's setting and the plan,
        # the same on every rank of the group, never this rank's state (issue 39: ranks whose states differed
        # issued different all-reduces, a hang on NCCL).
        if self.normuon_beta2 is not None:
            params = [p for group in self.param_groups for p in group["params"]]
            muon = [p for group in self.param_groups if group["use_muon"] for p in group["params"]]
            kept = [p for p in muon if keeps_momentum(self._handles, p)]
            merged = merged_second_moments(self.state, kept, self._handles)
            for index, p in enumerate(params):
                if id(p) in merged:
                    packed["state"][index] = {**packed["state"][index], SECOND_MOMENT: merged[id(p)]}
        list_every_param(self, packed)
        return packed

    def load_state_dict(self, state_dict) -> None:
        """Momentum of tensor-parallel shards arrives as DTensors of the full matrix (``state_dict``):
        each rank keeps its shard. The state is keyed as the saved param groups list the parameters
        (positions, or names from ``get_state_dict``), in the order of ours."""
        states = state_dict.get("state", {})
        keys = [key for group in state_dict.get("param_groups", []) for key in group["params"]]
        for index, _, _member, _handle in self._tensor_parallel_params():
            key = keys[index] if index < len(keys) else index
            state = states.get(key)
            if state is not None and isinstance(state.get("momentum_buffer"), DTensor):
                states[key] = {**state, "momentum_buffer": state["momentum_buffer"].to_local()}
        super().load_state_dict(state_dict)

    def _tensor_parallel_params(self):
        """(state-dict index, param, member, handle) of each TP-sharded dedicated weight (and each block
        of an owner group's weight: its momentum too is a DTensor of the whole matrix), in the
        numbering ``Optimizer.state_dict`` gives parameters."""
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                for handle in self._handles:
                    member = handle.member_of(p)
                    if member is not None and (member.entry.tp_dim is not None or member.block is not None):
                        yield index, p, member, handle
                index += 1

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step: Muon on the weights this rank updates (owned, or experts it holds), AdamW on the rest;
        then the next forward's first broadcast is launched early."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        start = time.perf_counter()
        if self._first_step_checks is not None:
            check_still_registered(self._first_step_checks)
            check_sole_dmuon(self, [(h, m.param) for h in self._handles for m in h.members])
            self._first_step_checks = None
        self._ns.matrices = 0
        if self.qk_clip is not None:
            self.qk_clip.start()  # the MAX all-reduce of the step's logits, waited at the first rescale
        self._muon_step([g for g in self.param_groups if g["use_muon"]])
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adamw_group_step(group)
        self._host_seconds = time.perf_counter() - start
        return loss

    def _muon_step(self, groups: list[dict]) -> None:
        """The Muon groups' step: ``optim/step_schedule.py`` orders it, ``optim/whole_update.py``
        is the rule it runs on each owner (a subclass may replace the whole, as the naive baseline).
        Profiled as ``MUON_STEP_RANGE`` (tests/test_step_memory.py reads its allocations there)."""
        with torch.profiler.record_function(MUON_STEP_RANGE):
            self._schedule.run(groups)

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
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=scalar(group["lr"]),
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
            decoupled_weight_decay=True,
        )


def _check_graph_devices(params: list[torch.Tensor]) -> None:
    """``ns_graphs`` replays CUDA graphs: every Muon weight on a CUDA device."""
    devices = sorted({str(p.device) for p in params if p.device.type != "cuda"})
    if devices or not torch.cuda.is_available():
        where = ", ".join(devices) if devices else "a machine without CUDA"
        raise OptionError(
            "ns_graphs", True, f"false for Muon weights on {where} (CUDA graphs replay on a CUDA device only)"
        )


def _check_known(options: dict, where: str) -> None:
    unknown = set(options) - set(OPTION_NAMES)
    if unknown:
        raise ValueError(f"unknown {where} option(s) {sorted(unknown)}; valid: {sorted(OPTION_NAMES)}")
