"""TorchTitan's Trainer and MetricsProcessor with DMuon's two additions.

* Gradient clipping. ``Trainer.train_step`` clips with torch's clip over all
  parameters, which cannot mix FSDP2's DTensor shards with owner-held plain
  gradients (and would count dedicated gradients wrongly). While a DMuon step
  runs, TorchTitan's clip entry point is titan_dmuon.clip_grad_norm_, which
  counts each gradient element exactly once.
* DMuon's figures per step in the log line and in TensorBoard/W&B:
  communication elements and bytes per rank next to the design's theory,
  Newton–Schulz matrices and time, and the owner balance.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from fractions import Fraction

import torchtitan.distributed.utils as titan_dist_utils
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from titan_dmuon.grad_clip import clip_grad_norm_
from titan_dmuon.runtime import dedicated_member


def _dmuon_handles(optimizers) -> list:
    handles = []
    for opt in getattr(optimizers, "dmuon_optimizers", lambda: [])():
        for group in opt.param_groups:
            if group["use_muon"]:
                for p in group["params"]:
                    handle = dedicated_member(p)[0]
                    if handle not in handles:
                        handles.append(handle)
    return handles


def _clip_for_titan(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None, pp_mesh=None, ep_enabled=False):
    if pp_mesh is not None or ep_enabled:
        raise NotImplementedError("DMuon's gradient clipping supports data parallelism only (no PP/EP)")
    return clip_grad_norm_(parameters, max_norm, norm_type)


class DMuonTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def train_step(self, data_iterator):
        if not _dmuon_handles(self.optimizers):
            return super().train_step(data_iterator)
        with _replaced(titan_dist_utils, "clip_grad_norm_", _clip_for_titan):
            return super().train_step(data_iterator)


@contextlib.contextmanager
def _replaced(module, name: str, value):
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


class DMuonMetricsProcessor(MetricsProcessor):
    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        pass

    _last_logged_step = 0

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        figures = self.dmuon_figures(step)
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics={**(extra_metrics or {}), **figures})
        if figures:
            logger.info(
                f"dmuon: comm {figures['dmuon/comm_elements_per_rank'] / 1e6:.4f}M elements/rank/step "
                f"({figures['dmuon/comm_MB_per_rank']:.3f} MB; design {figures['dmuon/theory_elements_per_rank'] / 1e6:.4f}M "
                f"averaged over ranks)  NS: {figures['dmuon/ns_matrices']:.0f} matrices on this rank, "
                f"{figures['dmuon/ns_ms']:.1f} ms  owner balance (NS FLOPs max/mean): "
                f"{figures['dmuon/owner_imbalance']:.2f}"
            )

    def dmuon_figures(self, step: int) -> dict[str, float]:
        """This rank's DMuon figures per step since the last log."""
        handles = _dmuon_handles(self.optimizers)
        if not handles:
            return {}
        steps = max(1, step - self._last_logged_step)
        self._last_logged_step = step
        elements, nbytes, theory = Fraction(0), Fraction(0), Fraction(0)
        for handle in handles:
            popped = handle.pop_comm_stats()
            elements += sum(e for e, _ in popped.values())
            nbytes += sum(b for _, b in popped.values())
            theory += handle.theory_elements_per_rank()
        stats = [opt.last_step_stats for opt in self.optimizers.dmuon_optimizers()]
        return {
            "dmuon/comm_elements_per_rank": float(elements / steps),
            "dmuon/comm_MB_per_rank": float(nbytes / steps) / 1e6,
            "dmuon/theory_elements_per_rank": float(theory),
            "dmuon/ns_matrices": sum(s.get("ns_matrices", 0) for s in stats),
            "dmuon/ns_ms": 1e3 * sum(s.get("ns_seconds", 0.0) for s in stats),
            "dmuon/owner_imbalance": max(h.plan.imbalance for h in handles),
        }

