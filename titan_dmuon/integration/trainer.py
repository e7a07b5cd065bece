"""TorchTitan's Trainer and MetricsProcessor with DMuon's additions.

* Setup at build time. TorchTitan's entry point applies command-line
  overrides after the config function ran, so the config DMuonTrainer is
  given is checked again (finalize.prepare_for_build, before any process group)
  and the parallelize step is bound to ITS optimizer settings.
* Gradient clipping. ``Trainer.train_step`` clips with torch's clip over all
  parameters, which cannot mix FSDP2's DTensor shards with owner-held plain
  gradients (and would count dedicated gradients wrongly). While a DMuon step
  runs, TorchTitan's clip entry point is titan_dmuon.clip_grad_norm_, which
  counts each gradient element exactly once.
* Figures per step in the log and in TensorBoard/W&B: the optimizer step's
  time; DMuon's communication (elements and bytes per rank, next to the
  design's figure), Newton–Schulz matrices and time, owner balance and
  packed-buffer memory; and, with ``[metrics] count_all_comm = true``, every
  collective of the step (FSDP2's too) counted by the CommLedger.
* A check for GPU runs: with ``TITAN_DMUON_SYNC_DEBUG_FROM_STEP=<n>`` on a CUDA
  machine, from step n on forward+backward and the optimizer step (clipping
  included) run under ``torch.cuda.set_sync_debug_mode("error")``: any host
  sync there stops the job (TorchTitan's own input copies and logging stay
  outside; use a large ``metrics.log_freq``). benchmarks/gpu_check.py uses it.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass
from fractions import Fraction

import torch
import torchtitan.distributed.utils as titan_dist_utils
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from titan_dmuon.integration.config.finalize import prepare_for_build
from titan_dmuon.integration.config.validation.naming import ConfigError
from titan_dmuon.integration.names import Metric
from titan_dmuon.optim.grad_clip import clip_grad_norm_
from titan_dmuon.optim.optimizer import StepStat
from titan_dmuon.plan.cost_model import design_elements_per_rank
from titan_dmuon.tools.ledger import CommLedger


def dmuon_handles(optimizers) -> list:
    handles = []
    for opt in getattr(optimizers, "dmuon_optimizers", lambda: [])():
        handles += [h for h in opt.dedicated_handles() if h not in handles]
    return handles


def _clip_for_titan(handles):
    """TorchTitan's clip entry point while a DMuon step runs: DMuon's clip, over these handles."""

    def clip(
        parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None, pp_mesh=None, ep_enabled=False
    ):
        return clip_grad_norm_(
            parameters, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite, dedicated=handles, pp_mesh=pp_mesh
        )

    return clip


class DMuonTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def __init__(self, config: Config) -> None:
        try:
            config = prepare_for_build(config)
        except ConfigError as e:
            logger.error(f"config error: {e}")
            raise
        import torchtitan.trainer as titan_trainer

        # (its warning that LOG_RANK misses the last stage: every rank logs the loss, DMuonMetricsProcessor.log)
        with _replaced(titan_trainer, "ensure_pp_loss_visible", lambda **_: None):
            super().__init__(config)
        # DMuon moves its volume once per forward/backward, i.e. per micro-batch
        self.metrics_processor.microbatches_per_step = self.gradient_accumulation_steps
        self.metrics_processor.deferred_reduce = self.parallel_dims.pp_enabled
        if self.parallel_dims.pp_enabled:
            prepare_pipeline_schedule(self.pp_schedule, self.optimizers)
        if config.validator.enable:  # (TorchTitan's loop calls it between two steps)
            self.validator.validate = self._outside_steps(self.validator.validate)

    def _outside_steps(self, validate):
        """TorchTitan's validation, kept out of the steps' figures: its time is not a step's, nor are
        DMuon's broadcasts for its forwards (``DedicatedParams.outside_steps``, which also restarts the
        next forward's first broadcast that the validation used)."""

        def run(model_parts, step):
            started = time.perf_counter()
            with contextlib.ExitStack() as stack:
                for handle in dmuon_handles(self.optimizers):
                    stack.enter_context(handle.outside_steps())
                validate(model_parts, step)
            self.metrics_processor.seconds_outside_steps += time.perf_counter() - started

        return run

    def train(self):
        """TorchTitan's training loop, then DMuon's collectives still in flight are finished (the last
        step launched the next forward's first broadcast) while every process group is still up."""
        result = super().train()
        for handle in dmuon_handles(self.optimizers):
            handle.finish_in_flight()
        return result

    def train_step(self, data_iterator):
        self.metrics_processor.begin_step()
        with contextlib.ExitStack() as stack:
            if self.optimizers.dmuon_optimizers():  # cheap: no per-parameter scan on the hot path
                clip = _clip_for_titan(dmuon_handles(self.optimizers))
                if self._sync_debug():
                    clip = _no_host_sync(clip)
                    stack.enter_context(_replaced(self.optimizers, "step", _no_host_sync(self.optimizers.step)))
                stack.enter_context(_replaced(titan_dist_utils, "clip_grad_norm_", clip))
            ledger = self.metrics_processor.ledger
            if ledger is not None:
                stack.enter_context(ledger)
            return super().train_step(data_iterator)

    def forward_backward_step(self, **kwargs):
        if self._sync_debug():
            return _no_host_sync(super().forward_backward_step)(**kwargs)
        return super().forward_backward_step(**kwargs)

    def pp_forward_backward_step(self, **kwargs):
        """Gradient sync once per schedule step: off over the micro-batches (each dedicated weight
        is broadcast once and its gradients accumulate on every rank), on for each stage's last
        backward (``prepare_pipeline_schedule``), which issues their reduces to the owners; they
        are finished after the schedule (``finish_pipeline_reduces``)."""
        handles = dmuon_handles(self.optimizers)
        for handle in handles:
            handle.set_requires_gradient_sync(False)
        loss = super().pp_forward_backward_step(**kwargs)
        finish_pipeline_reduces(handles)
        return loss

    def _sync_debug(self) -> bool:
        first = os.environ.get("TITAN_DMUON_SYNC_DEBUG_FROM_STEP")
        return first is not None and torch.cuda.is_available() and self.step >= int(first)


def prepare_pipeline_schedule(schedule, optimizers) -> None:
    """Adapt a torch.distributed.pipelining schedule to DMuon (DMuonTrainer does it once the
    schedule is built): each stage's dedicated gradients are reduced during its last
    micro-batch's backward, and QK-clip's capture is paused in the metadata inference."""
    from titan_dmuon.integration.models.attention_clip import pause_capture_in_metadata_inference
    from titan_dmuon.runtime import DedicatedParams

    # (torch 2.14's schedules hold this rank's stages as _stages, or _stage for single-stage ones)
    stages = getattr(schedule, "_stages", None) or [s for s in [getattr(schedule, "_stage", None)] if s is not None]
    for stage in stages:
        handles = [h for module in stage.submod.modules() for h in DedicatedParams.of(module)]
        if handles:
            _reduce_in_last_backward(stage, handles)
    pause_capture_in_metadata_inference(stages, optimizers.dmuon_optimizers())


def finish_pipeline_reduces(handles) -> None:
    """After a schedule step: each stage's reduces, issued in its last backward, are finished (the
    compute stream waits for them only now, after the stages' sends) and the owners get their
    gradients; whatever a stage still holds (none with TorchTitan's schedules) is reduced too."""
    for handle in handles:
        handle.set_requires_gradient_sync(True)
        handle.set_is_last_backward(True)
        handle.reduce_gradients()


def _reduce_in_last_backward(stage, handles) -> None:
    """Every backward pass of a pipeline stage goes through ``stage.backward_maybe_with_nosync(
    backward_type, bwd_kwargs, last_backward)``, where torch.distributed.pipelining adapts DDP and
    FSDP2 to micro-batches (the schedule counts each stage's backward passes; ``last_backward``
    marks the stage's last one). DMuon's gradient sync is on for a full last backward: each
    layer's reduce is issued by its post-backward hook while the layers before it are still in
    backward, the same program point on every rank of the stage. A split backward (zero-bubble
    schedules) computes the weight gradients in the weight pass, all at once: the stage reduces
    right after its last one. Elsewhere sync is off (gradients accumulate), as the forwards have
    it (DMuonTrainer turns it off for the whole schedule).

    No backward inside the schedule is the last for the handles (``set_is_last_backward(False)``):
    the end of the stage's last backward issues the reduces left but the compute stream does not
    wait for them there, since the schedule's send of that micro-batch's input gradient comes next
    and NCCL's point-to-point waits for the current stream (a layer's reduce on the critical path of
    every stage); ``finish_pipeline_reduces`` finishes them after the schedule, as FSDP2 reduces in
    the schedule's REDUCE_GRAD, after the sends."""
    backward = getattr(stage, "backward_maybe_with_nosync", None)
    if backward is None or getattr(stage, "dw_builder", None) is not None:
        # another torch.distributed.pipelining, or a custom weight-gradient function (run after
        # this method returns): the reduce comes after the schedule (pp_forward_backward_step)
        logger.warning(
            "titan_dmuon: DMuon reduces this pipeline stage's gradients after the schedule, not in its last backward"
        )
        return

    def with_dmuon_sync(backward_type, bwd_kwargs, last_backward=False):
        for handle in handles:
            handle.set_is_last_backward(False)
            handle.set_requires_gradient_sync(last_backward and backward_type == "full")
        result = backward(backward_type, bwd_kwargs, last_backward=last_backward)
        for handle in handles:
            handle.set_requires_gradient_sync(False)
            if last_backward:
                handle.reduce_gradients()  # (issues the weight pass's; nothing left after a full backward)
        return result

    stage.backward_maybe_with_nosync = with_dmuon_sync


def _no_host_sync(fn):
    """``fn`` under torch.cuda.set_sync_debug_mode("error"): a host sync inside raises."""

    def wrapped(*args, **kwargs):
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(previous)

    return wrapped


@contextlib.contextmanager
def _replaced(owner, name: str, value):
    """``owner.name`` is ``value`` for the duration (a module global, or an object's method)."""
    own = vars(owner)
    had, original = name in own, own.get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if had:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


class DMuonMetricsProcessor(MetricsProcessor):
    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        count_all_comm: bool = False
        """Count every collective of each step (FSDP2's and DMuon's) with the CommLedger and
        log elements/bytes per rank per step. Costs a little Python per collective."""

    def __init__(self, config: Config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        self.ledger = CommLedger() if config.count_all_comm else None
        self.microbatches_per_step = 1
        self.deferred_reduce = False  # pipelining: one reduce per schedule step, whatever its micro-batches
        # more figures per step: objects with figures(steps) -> dict, describe(figures) -> str
        self.figure_sources: list = []
        self.seconds_outside_steps = 0.0  # since the last figures: validation, not part of any step's time
        self._steps_since_figures = 0
        self._time_of_last_figures: float | None = None

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        if self.parallel_dims.pp_enabled:
            global_avg_loss, global_max_loss = self._last_stage_loss(global_avg_loss, global_max_loss)
        figures = self.step_figures(step)
        super().log(
            step, global_avg_loss, global_max_loss, grad_norm, extra_metrics={**(extra_metrics or {}), **figures}
        )
        parts = [
            f"step {figures[Metric.STEP_SECONDS]:.3f}s, optimizer {1e3 * figures[Metric.OPTIMIZER_STEP_SECONDS]:.1f} ms"
        ]
        if Metric.ALL_COMM_ELEMENTS in figures:
            parts.append(
                f"all comm {figures[Metric.ALL_COMM_ELEMENTS] / 1e6:.4f}M elements/rank/step "
                f"({figures[Metric.ALL_COMM_MB]:.3f} MB; {figures[Metric.ALL_COMM_LAUNCHES]:.0f} launches)"
            )
        if Metric.COMM_ELEMENTS in figures:
            sync = (
                f"{self.microbatches_per_step} micro-batch(es)"
                if not self.deferred_reduce
                else "gradient sync once per pipeline step"
            )
            i = 0
            while Metric.part_comm_elements(i) in figures:  # per pipeline stage on this rank
                sync += (
                    f"; part {i} {figures[Metric.part_comm_elements(i)] / 1e6:.4f}M, "
                    f"design {figures[Metric.part_design_elements(i)] / 1e6:.4f}M"
                )
                i += 1
            parts.append(
                f"dmuon: comm {figures[Metric.COMM_ELEMENTS] / 1e6:.4f}M elements/rank/step "
                f"({figures[Metric.COMM_MB]:.3f} MB; design {figures[Metric.DESIGN_ELEMENTS] / 1e6:.4f}M "
                f"averaged over ranks, {sync}; {figures[Metric.LAUNCHES]:.0f} launches)  "
                f"NS: {figures[Metric.NS_MATRICES]:.0f} matrices on this rank, "
                f"{figures[Metric.NS_MS]:.1f} ms  owner balance (NS FLOPs max/mean): "
                f"{figures[Metric.OWNER_IMBALANCE]:.2f}  peak buffers {figures[Metric.PEAK_BUFFER_MB]:.2f} MB  "
                f"host {figures[Metric.HOST_MS]:.1f} ms  "
                f"first layer waited {figures[Metric.FIRST_LAYER_WAIT_MS]:.2f} ms"
            )
        if Metric.QK_MAX_LOGIT in figures:
            parts.append(
                f"QK-clip: max logit {figures[Metric.QK_MAX_LOGIT]:.4f} before clipping, "
                f"{figures[Metric.QK_CLIPPED_HEADS]:.0f} heads clipped"
            )
        parts += [source.describe(figures) for source in self.figure_sources]
        logger.info("titan_dmuon: " + "  ".join(parts))

    def log_validation(self, loss, step, extra_metrics=None):
        """Under pipelining TorchTitan's validator has the loss on the last stage's ranks only (the others
        log a negative placeholder, ``loss: -0.0020``): every rank takes it, as for the training loss."""
        if self.parallel_dims.pp_enabled:
            (loss,) = self._last_stage_loss(loss)
        super().log_validation(loss, step, extra_metrics)

    def _last_stage_loss(self, *losses: float) -> list[float]:
        """Under pipelining the loss is computed on the last stage's ranks (TorchTitan's trainer gives
        the others -1 per data-parallel rank), and only their log showed it: ``loss: -2.00000`` with
        run_train.sh's default LOG_RANK=0. Every rank takes it (a MAX over the pipeline ranks, at log
        steps only: a loss is >= 0), so each rank's log and metrics show the job's loss."""
        mesh = self.parallel_dims.get_mesh("pp")
        device = (
            "cpu"
            if mesh.device_type == "cpu"
            else torch.device(mesh.device_type, torch.accelerator.current_device_index())
        )
        values = torch.tensor(losses, dtype=torch.float64, device=device)
        torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX, group=mesh.get_group())
        return values.tolist()

    def begin_step(self) -> None:
        """DMuonTrainer calls this as each step starts. Figures are per step of THIS process: a
        resumed job's first log comes at step N+1 after one step, not N+1 steps (that step also
        carries what loading the checkpoint moved)."""
        if self._time_of_last_figures is None:
            self._time_of_last_figures = time.perf_counter()
        self._steps_since_figures += 1

    def step_figures(self, step: int) -> dict[str, float]:
        """This rank's figures, per step, since the last log."""
        steps = max(1, self._steps_since_figures)
        now = time.perf_counter()
        started = self._time_of_last_figures if self._time_of_last_figures is not None else now
        figures = {
            Metric.STEP_SECONDS: (now - started - self.seconds_outside_steps) / steps,
            Metric.OPTIMIZER_STEP_SECONDS: getattr(self.optimizers, "last_step_seconds", 0.0),
        }
        self._steps_since_figures, self._time_of_last_figures, self.seconds_outside_steps = 0, now, 0.0
        for source in self.figure_sources:
            figures.update(source.figures(steps))
        if self.ledger is not None:
            figures[Metric.ALL_COMM_ELEMENTS] = float(self.ledger.elements()) / steps
            figures[Metric.ALL_COMM_MB] = float(self.ledger.bytes()) / steps / 1e6
            figures[Metric.ALL_COMM_LAUNCHES] = self.ledger.launch_groups() / steps  # as NCCL launches them
            self.ledger.records.clear()
        handles = dmuon_handles(self.optimizers)
        if handles:
            elements, nbytes, design, peak, launches, host = Fraction(0), Fraction(0), Fraction(0), 0, 0, 0.0
            for part, handle in enumerate(handles):  # (one per pipeline stage this rank holds)
                host += handle.pop_host_seconds()
                popped = handle.pop_comm_stats()
                part_elements = sum(e for e, _, _ in popped.values())
                part_design = (
                    design_elements_per_rank(handle, deferred=self.deferred_reduce) * self.microbatches_per_step
                )
                if len(handles) > 1:
                    figures[Metric.part_comm_elements(part)] = float(part_elements / steps)
                    figures[Metric.part_design_elements(part)] = float(part_design)
                elements += part_elements
                design += part_design
                nbytes += sum(b for _, b, _ in popped.values())
                launches += sum(n for _, _, n in popped.values())
                peak += handle.peak_buffer_bytes
                handle.reset_peak_buffer_bytes()
            stats = [opt.last_step_stats for opt in self.optimizers.dmuon_optimizers()]
            figures.update(
                {
                    Metric.COMM_ELEMENTS: float(elements / steps),
                    Metric.COMM_MB: float(nbytes / steps) / 1e6,
                    Metric.DESIGN_ELEMENTS: float(design),
                    Metric.LAUNCHES: launches / steps,
                    Metric.NS_MATRICES: sum(s.get(StepStat.NS_MATRICES, 0) for s in stats),
                    Metric.NS_MS: 1e3 * sum(s.get(StepStat.NS_SECONDS, 0.0) for s in stats),
                    Metric.OWNER_IMBALANCE: max(h.plan.imbalance for h in handles),
                    Metric.PEAK_BUFFER_MB: peak / 1e6,
                    # host time per step in DMuon's hooks and its optimizer step (Python, launches; on the
                    # CPU also the work and gloo's waits), and how long the first layer's weights kept the
                    # next forward waiting (its broadcast starts as soon as the step updated that layer)
                    Metric.HOST_MS: 1e3 * (host / steps + sum(s.get(StepStat.HOST_SECONDS, 0.0) for s in stats)),
                    Metric.FIRST_LAYER_WAIT_MS: 1e3 * max(h.first_layer_wait_seconds for h in handles),
                }
            )
            figures.update(qk_clip_figures(stats))
        return figures


def qk_clip_figures(stats: list[dict]) -> dict[str, float]:
    """QK-clip's figures over this rank's DMuon optimizers (pipeline stages): the last step's
    largest logit before clipping (NaN if any stage saw one: Python's ``max`` would hide it
    behind the other stages' figures) and the heads clipped."""
    clipped = [s for s in stats if StepStat.QK_MAX_LOGIT in s]
    if not clipped:
        return {}
    maxima = [s[StepStat.QK_MAX_LOGIT] for s in clipped]
    return {
        Metric.QK_MAX_LOGIT: math.nan if any(math.isnan(m) for m in maxima) else max(maxima),
        Metric.QK_CLIPPED_HEADS: float(sum(s[StepStat.QK_CLIPPED_HEADS] for s in clipped)),
    }
