"""DMuon: one optimizer over all of a model's parameters.

Dedicated weights get Muon, applied only by their global owner (no collective
in the step on a 1-D mesh); every other parameter (FSDP2 DTensor shards,
DDP-replicated tensors) gets AdamW with ``torch.optim.AdamW`` semantics.

Each user param group is split into a Muon group and an AdamW group, both
carrying their learning rate under ``"lr"``, so LR schedulers scale both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam
from torch.optim.optimizer import _get_scalar_dtype

from titan_dmuon.muon_math import muon_step
from titan_dmuon.options import OPTION_NAMES, DMuonOptions
from titan_dmuon.runtime import find_dedicated, find_local_experts, refresh_handles


class DMuon(torch.optim.Optimizer):
    """Muon for dedicated weights (see :func:`titan_dmuon.dedicate_params`), AdamW for the rest.

    Keyword arguments and group options: the fields of
    :class:`titan_dmuon.options.DMuonOptions` (``lr``, ``momentum``, ``ns_mode``,
    ``adamw_lr``, ...), e.g. ``[{"params": blocks, "lr": 0.02}, {"params": head, "adamw_lr": 1e-4}]``.
    After each ``step()``, ``last_step_stats`` holds this rank's Newton–Schulz
    figures (matrices, time); reading the time syncs with the device once.
    """

    def __init__(self, params: Iterable, **options) -> None:
        _check_known(options, "DMuon")
        defaults = DMuonOptions(**options)
        user_groups = list(params)
        refresh_handles()
        if not user_groups:
            raise ValueError("DMuon got an empty parameter list")
        if not isinstance(user_groups[0], dict):
            user_groups = [{"params": user_groups}]
        groups = []
        for user_group in user_groups:
            group_options = {k: v for k, v in user_group.items() if k not in ("params", "param_names")}
            _check_known(group_options, "DMuon param-group")
            merged = dataclasses.replace(defaults, **group_options)
            group_params = user_group["params"]
            group_params = [group_params] if isinstance(group_params, torch.Tensor) else list(group_params)
            names = user_group.get("param_names")
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

    def _is_muon_param(self, p: torch.Tensor) -> bool:
        return find_dedicated(p) is not None or find_local_experts(p) is not None

    @property
    def last_step_stats(self) -> dict[str, float]:
        """This rank's Newton–Schulz matrices (blocks: a fused q/k/v counts 3) and time in the last step."""
        seconds = self._ns_timer.seconds() if self._ns_timer is not None else 0.0
        return {"ns_matrices": self._ns_matrices, "ns_seconds": seconds}

    def state_dict(self):
        """Also lands HSDP's in-flight post-step broadcasts first.

        DCP asks every Stateful for its state before it reads a checkpoint into
        the model's tensors in place; TorchTitan's zero-gradient step inside this
        call starts broadcasts of the pre-load weights, which must not land after
        the load."""
        for handle in self.dedicated_handles():
            handle.wait_for_replicate_broadcasts()
        return super().state_dict()

    def dedicated_handles(self) -> list:
        """The dedicate_params handles of this optimizer's Muon parameters, in a fixed order."""
        handles = []
        for group in self.param_groups:
            if group["use_muon"]:
                for p in group["params"]:
                    found = find_dedicated(p)
                    if found is not None and found[0] not in handles:
                        handles.append(found[0])
        return handles

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        refresh_handles()
        handles = self.dedicated_handles()  # same order on every rank: it follows the param groups
        for handle in handles:
            handle.wait_for_replicate_broadcasts()  # the last step's sends read the weights we update now
        self._ns_matrices = 0
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_group_step(group)
            else:
                self._adamw_group_step(group)
        for handle in handles:
            handle.after_step()
        return loss

    def _muon_group_step(self, group: dict) -> None:
        params, grads, buffers, blocks = [], [], [], []
        for p in group["params"]:
            dedicated, local = find_dedicated(p), find_local_experts(p)
            if dedicated is None and local is None:
                raise RuntimeError(
                    "a dedicated parameter held by DMuon is no longer the module's parameter: it was "
                    "replaced after DMuon was built (e.g. by model.to_empty() on a meta-device model). "
                    "Build DMuon after the model is materialised, as with FSDP2."
                )
            if p.grad is None or (dedicated is not None and not dedicated[1].runs_ns):
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:  # (local experts: a DTensor like p, on every rank)
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if dedicated is not None:
                params.append(p)
                grads.append(p.grad)
                buffers.append(state["momentum_buffer"])
                blocks.append(dedicated[1].entry.blocks)
            else:
                weights = _whole_local_experts(p, local[1].fqn)
                if weights.shape[0] == 0:
                    continue  # FSDP2 gave this rank no expert of this weight
                params.append(weights)
                grads.append(_local(p.grad))
                buffers.append(_local(state["momentum_buffer"]))
                blocks.append(local[1].blocks)
        if not params:
            return
        if self._ns_timer is None:
            self._ns_timer = DeviceTimer(params[0].device)
        with self._ns_timer.timing(accumulate=self._ns_matrices > 0):
            self._ns_matrices += muon_step(
                params, grads, buffers, blocks,
                lr=group["lr"], weight_decay=group["weight_decay"], momentum=group["momentum"],
                nesterov=group["nesterov"], ns_steps=group["ns_steps"], ns_coefficients=group["ns_coefficients"],
                eps=group["eps"], adjust_lr_fn=group["adjust_lr_fn"], ns_mode=group["ns_mode"],
            )

    def _adamw_group_step(self, group: dict) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())  # as torch.optim.AdamW
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
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
            amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
            eps=group["eps"], maximize=False, decoupled_weight_decay=True,
        )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _whole_local_experts(param: torch.Tensor, fqn: str) -> torch.Tensor:
    """This rank's experts of a 3-D weight, each whole (FSDP2 / EP shard it on dim 0)."""
    if isinstance(param, DTensor):
        for placement in param.placements:
            # Shard(0), or _StridedShard(0) under FSDP2 + expert parallelism: whole experts per rank
            if not (placement.is_replicate() or getattr(placement, "dim", None) == 0):
                raise RuntimeError(
                    f"expert weight {fqn!r} is sharded {param.placements}: DMuon updates experts in place only "
                    "when every rank holds whole experts (sharded on dim 0). Use dedicate_params(..., "
                    "expert_sharding='dedicated') to give each expert weight one owner instead."
                )
    return _local(param)


def _check_known(options: dict, where: str) -> None:
    unknown = set(options) - set(OPTION_NAMES)
    if unknown:
        raise ValueError(f"unknown {where} option(s) {sorted(unknown)}; valid: {sorted(OPTION_NAMES)}")


class DeviceTimer:
    """Times work queued on a device without syncing the host: events are recorded now
    and read at log time (on the CPU, where work is synchronous, a host clock)."""

    def __init__(self, device: torch.device) -> None:
        self._module = None if device.type == "cpu" else torch.get_device_module(device)
        self._spans: list = []

    @contextlib.contextmanager
    def timing(self, *, accumulate: bool = False):
        if not accumulate:
            self._spans = []
        if self._module is None:
            start = time.perf_counter()
            yield
            self._spans.append(time.perf_counter() - start)
            return
        begin, end = self._module.Event(enable_timing=True), self._module.Event(enable_timing=True)
        begin.record()
        yield
        end.record()
        self._spans.append((begin, end))

    def seconds(self) -> float:
        """The timed spans since the last non-accumulating ``timing()``; waits for them on a device."""
        total = 0.0
        for span in self._spans:
            if isinstance(span, float):
                total += span
            else:
                span[1].synchronize()
                total += span[0].elapsed_time(span[1]) / 1e3
        return total
