"""DMuon under TorchFT (TorchTitan 0.3.0's ``experiments/torchft``): training goes on when a replica
group dies, and a restarted group rejoins with its state.

A fault-tolerant job is several replica groups, each its own torchrun world, joined by TorchFT's
lighthouse. Inside a group DMuon dedicates on the group's own mesh exactly as without fault
tolerance (Z2/Z3 over its FSDP ranks; a one-rank group owns everything). Across groups:

* per step (``semi_sync_method`` unset): each owner's reduced gradient is averaged with the
  owners at the same coordinate of every other group by TorchFT's all-reduce
  (``Manager.allreduce``, which reports a failed peer instead of raising and leaves a healing
  group out), through ``DedicatedParams.set_all_reduce_hook``, as FSDP2's own hook averages the
  other parameters' shards. Every group then runs Newton–Schulz on identical inputs: once per
  matrix per group (the price of surviving a group's loss, as AdamW's replicated state is under
  HSDP). The optimizer steps only if TorchFT's ``should_commit()`` agrees, so a step whose
  all-reduce failed changes no weight or momentum anywhere.
* semi-synchronously (``"diloco"``, ``"local_sgd"``): DMuon is the inner optimizer, purely inside
  each group; TorchFT averages the parameters (or DiLoCo's pseudo-gradients) every
  ``sync_steps``. What TorchFT writes into the weights after DMuon's step is seen by the next
  forward (DMuon drops the first layer's early broadcast, ``DedicatedParams.weights_changed``).

Recovery is TorchFT's state transfer: a group that joins fetches the model, the optimizer state
(every owner's weight and momentum from the peer rank with the same coordinate, which owns the
same weights), the LR schedule and the train state from a live group, before its first step. All
optimizer state exists from construction and is updated in place (TorchFT serves a state dict
taken once), with the param groups' current learning rate (TorchTitan's cached copy keeps the one
of the first step).

The quorum is synchronous: computed at the start of each step (per step) or each sync (semi-sync),
and a joining group loads its state before it runs a forward. TorchTitan's default for per-step
fault tolerance, the asynchronous quorum, is refused (``ASYNC_QUORUM_REASON``).

Nothing here is imported unless a config has a ``fault_tolerance`` section (TorchTitan's torchft
modules import ``torchft`` where it is installed; without it, only enabling fault tolerance fails,
at config time, naming the extra to install).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from fractions import Fraction

import torch
import torch.distributed as dist
import torchtitan.distributed.utils as titan_dist_utils
from torch.distributed.fsdp import FSDPModule
from torchtitan.components.loss import ChunkedLossWrapper
from torchtitan.components.optimizer.utils import init_optim_state
from torchtitan.experiments.torchft.checkpoint import TorchFTCheckpointManager
from torchtitan.experiments.torchft.config.job_config import FaultTolerance
from torchtitan.experiments.torchft.manager import TorchFTManager
from torchtitan.experiments.torchft.optimizer import TorchFTOptimizersContainer
from torchtitan.experiments.torchft.trainer import FaultTolerantTrainer
from torchtitan.tools.logging import logger

from titan_dmuon.integration.components.checkpoint import DMuonCheckpointManager
from titan_dmuon.integration.components.optimizer_container import DMuonOptimizersContainer
from titan_dmuon.integration.config.validation.fault_tolerance_section import ASYNC_QUORUM_REASON
from titan_dmuon.integration.trainer import DMuonTrainer, _replaced, dmuon_handles
from titan_dmuon.runtime import DedicatedParams
from titan_dmuon.runtime.streams import synchronize_device


class AcrossGroups:
    """The training log's figures of fault tolerance: the groups in the quorum, the steps TorchFT
    committed, and the per-step average across the groups, counted where the hooks issue it (each
    rank all-reduces every gradient it holds once per backward: its owners' dedicated gradients and
    its FSDP2 shards; an all-reduce of S elements over G groups moves 2(G-1)/G x S per rank)."""

    def __init__(self, manager: DMuonTorchFTManager) -> None:
        self._manager = manager
        self._elements, self._moved = 0, Fraction(0)

    def count(self, tensor: torch.Tensor, participants: int) -> None:
        self._elements += tensor.numel()
        self._moved += Fraction(2 * (participants - 1), max(participants, 1)) * tensor.numel()

    def figures(self, steps: int) -> dict[str, float]:
        ft = self._manager.manager
        out = {
            "ft/groups": float(ft.num_participants()),
            "ft/committed_steps": float(ft.current_step()),
            "ft/allreduced_elements_per_rank": self._elements / steps,
            "ft/moved_elements_per_rank": float(self._moved / steps),
        }
        self._elements, self._moved = 0, Fraction(0)
        return out

    def describe(self, figures: dict[str, float]) -> str:
        text = f"TorchFT: {figures['ft/groups']:.0f} groups, {figures['ft/committed_steps']:.0f} steps committed"
        if self._manager.per_step:
            text += (
                f", averaged {figures['ft/allreduced_elements_per_rank'] / 1e6:.4f}M elements/rank/step across "
                f"groups ({figures['ft/moved_elements_per_rank'] / 1e6:.4f}M moved)"
            )
        return text


class DMuonTorchFTManager(TorchFTManager):
    """TorchTitan's TorchFTManager with a synchronous quorum in every mode.

    ``per_step``: no semi-synchronous method, so gradients are averaged across the groups every
    step (FSDP2's all-reduce hook and DMuon's) and every step asks ``should_commit``; TorchTitan
    ties that to its asynchronous quorum (``use_async_quorum``), which is False here."""

    @dataclass(kw_only=True, slots=True)
    class Config(FaultTolerance):
        pass

    def __init__(self, config: Config) -> None:
        self.use_async_quorum = False
        self.per_step = config.semi_sync_method is None
        self.commit_decisions = 0  # should_commit calls so far (semi-sync: each may have rewritten the weights)
        self.figures = AcrossGroups(self)
        if not config.enable:
            self._manager = None
            return
        import torchft

        timeout = timedelta(milliseconds=config.process_group_timeout_ms)
        pg = (
            torchft.ProcessGroupGloo(timeout=timeout)
            if config.process_group == "gloo"
            else torchft.ProcessGroupNCCL(timeout=timeout)
        )
        self._manager = torchft.Manager(
            pg=pg,
            min_replica_size=config.min_replica_size,
            load_state_dict=None,
            state_dict=None,
            use_async_quorum=False,
            replica_id=f"torchtitan_ft_{config.replica_id}",
        )
        decide = self._manager.should_commit

        def should_commit(*args, **kwargs) -> bool:
            self.commit_decisions += 1
            return decide(*args, **kwargs)

        self._manager.should_commit = should_commit
        self.group_size = config.group_size
        self.replica_id = config.replica_id
        logger.info(
            f"fault tolerance: replica group {config.replica_id} of {config.group_size}, synchronous quorum, "
            + (
                "gradients averaged across the groups every step"
                if self.per_step
                else f"{config.semi_sync_method} with DMuon inner steps, a sync every {config.sync_steps} steps"
            )
        )
        if self.per_step:
            self.replicate_pg = torchft.process_group.ManagedProcessGroup(self._manager)
            self.replicate_pg.register("dp_replicate")

    def maybe_set_all_reduce_hook(self, model_parts: list[torch.nn.Module]) -> None:
        """Per step: average every gradient across the groups as it is reduced, FSDP2's shards and
        DMuon's owners' gradients alike (TorchFT's all-reduce: a failed peer is reported to
        ``should_commit``, a healing group contributes zeros)."""
        if not (self.enabled and self.per_step):
            return

        def average_across_groups(tensor: torch.Tensor) -> None:
            self.figures.count(tensor, self._manager.num_participants())
            dist.all_reduce(tensor, group=self.replicate_pg, op=dist.ReduceOp.AVG)

        for part in model_parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.set_all_reduce_hook(average_across_groups)
            for handle in DedicatedParams.of(part):
                handle.set_all_reduce_hook(average_across_groups)

    @property
    def loss_sync_pg(self):
        return self.replicate_pg if self.enabled and self.per_step else None


class DMuonFTOptimizersContainer(DMuonOptimizersContainer):
    """DMuon's container with TorchFT's commit (as TorchFT's OptimizerWrapper): per step,
    ``zero_grad()`` starts the quorum and ``step()`` steps only if ``should_commit()`` is true;
    semi-sync, every inner step runs and TorchFT decides at its syncs. All optimizer state exists
    from construction (one zero-gradient step), so the state dict TorchFT serves, taken once and
    refreshed after each load (as TorchTitan's TorchFTOptimizersContainer), stays current."""

    @dataclass(kw_only=True, slots=True)
    class Config(DMuonOptimizersContainer.Config, TorchFTOptimizersContainer.Config):
        pass

    def __init__(self, config: Config, *, model_parts, ft_manager: DMuonTorchFTManager) -> None:
        if ft_manager.enabled and ft_manager.use_async_quorum:  # (TorchTitan's own manager, per step)
            raise NotImplementedError(f"DMuon with TorchFT's asynchronous quorum: {ASYNC_QUORUM_REASON}")
        super().__init__(config, model_parts=model_parts)
        self._ft = ft_manager.manager if ft_manager.enabled else None
        self._commit_each_step = self._ft is not None and getattr(ft_manager, "per_step", False)
        self.cache_state_dict: dict | None = None
        if self._ft is not None:
            for optim in self.optimizers:
                init_optim_state(optim)

    def init_cache_state_dict(self) -> None:
        self.cache_state_dict = super().state_dict()

    def state_dict(self):
        """The cached state dict (its tensors are the live state) with the param groups' settings
        as they are now: the learning rate has moved on since the cache was taken (the LR schedule
        sets it every step), and a group that loads this must step with the current one. The host
        first waits for the device: TorchFT copies these tensors on its quorum thread and its own
        stream, which nothing else orders after the last step's writes (DMuon's step never syncs)."""
        for device in {p.device for optim in self.optimizers for group in optim.param_groups for p in group["params"]}:
            synchronize_device(device)
        if self.cache_state_dict is None:
            return super().state_dict()
        for optim in self.optimizers:
            for group in optim.param_groups:
                settings = {k: v for k, v in group.items() if k not in ("params", "param_names")}
                for fqn in group["param_names"]:
                    for key, value in settings.items():
                        self.cache_state_dict[f"param_groups.{fqn}.{key}"] = value
        return self.cache_state_dict

    def load_state_dict(self, state_dict) -> None:
        cached, self.cache_state_dict = self.cache_state_dict, None  # (loading assigns new state tensors)
        super().load_state_dict(state_dict)
        if cached is not None:
            self.init_cache_state_dict()

    def zero_grad(self, *args, **kwargs) -> None:
        if self._commit_each_step:
            self._ft.start_quorum()  # (synchronous: a joining group loads its state here)
        super().zero_grad(*args, **kwargs)

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("OptimizersContainer does not support closures")
        if self._commit_each_step and not self._ft.should_commit():
            return  # a peer failed during this step: no weight or momentum changes, on any group
        self.step_each()


class DMuonFTCheckpointManager(DMuonCheckpointManager, TorchFTCheckpointManager):
    """TorchFT's checkpoint manager (the data position per group on disk, the state TorchFT
    transfers to a joining group) with DMuon's checks before a DCP load."""

    @dataclass(kw_only=True, slots=True)
    class Config(DMuonCheckpointManager.Config, TorchFTCheckpointManager.Config):
        pass

    def __init__(self, config: Config, *, ft_manager: DMuonTorchFTManager | None = None, **kwargs) -> None:
        super().__init__(config, ft_manager=ft_manager, **kwargs)
        if ft_manager is not None and ft_manager.enabled:
            self.replica_groups = ft_manager.group_size


class DMuonFaultTolerantTrainer(DMuonTrainer, FaultTolerantTrainer):
    """DMuonTrainer (clip, figures, checks) on TorchTitan's FaultTolerantTrainer (replica groups,
    lighthouse, commit, healing) with DMuon's manager, container and checkpoint manager."""

    @dataclass(kw_only=True, slots=True)
    class Config(DMuonTrainer.Config, FaultTolerantTrainer.Config):
        fault_tolerance: DMuonTorchFTManager.Config = field(default_factory=DMuonTorchFTManager.Config)

    _decisions_seen = 0  # the manager's should_commit count at the last check

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        if self.ft_manager.enabled:
            self.metrics_processor.figure_sources.append(self.ft_manager.figures)
        if isinstance(self.loss_fn, ChunkedLossWrapper):
            # TorchTitan 0.3.0's FaultTolerantTrainer never gives a chunked loss (the llama3 configs')
            # its lm_head, as Trainer does: the first step failed. (Pipelining is refused under TorchFT.)
            self.loss_fn.set_lm_head(self.model_parts[0].lm_head)
            self.model_parts[0]._skip_lm_head = True

    def train_step(self, data_iterator):
        """Semi-sync: TorchFT rewrites the weights at its syncs, after DMuon's step started the
        next forward's first broadcast; a forward after a sync gathers them anew. Per step, the
        logged loss is the mean over the groups (TorchTitan 0.3.0's FaultTolerantTrainer sums the
        groups' means: with 2 groups it logged twice the loss)."""
        self._decisions_seen = drop_gathers_after_syncs(
            self.ft_manager, dmuon_handles(self.optimizers), self._decisions_seen
        )
        let_outer_optimizers_step(self.optimizers)
        with _replaced(titan_dist_utils, "dist_sum", _mean_of_group_means(titan_dist_utils.dist_sum)):
            return super().train_step(data_iterator)


def let_outer_optimizers_step(container) -> None:
    """DiLoCo's outer optimizers (TorchTitan builds a torch SGD over every parameter, TorchFT steps it at each
    sync) update the dedicated weights by design: on each owner its whole weight, from the pseudo-gradient
    TorchFT averaged over the groups. ``runtime/usage_checks.py`` refuses a torch optimizer over dedicated
    weights at its first step, so they are marked as DMuon's partners; TorchFT registers them with the step
    post-hook it puts on the inner optimizer (this container), which is where they are found."""
    for hook in getattr(container, "_optimizer_step_post_hooks", {}).values():
        for fragment in getattr(getattr(hook, "__self__", None), "_fragments", ()):
            outer = getattr(fragment, "_outer_optimizer", None)
            if outer is not None:
                outer.steps_dedicated_weights = True


def drop_gathers_after_syncs(ft_manager, handles, seen: int) -> int:
    """Semi-sync: if TorchFT decided on a sync since ``seen`` (its should_commit count), it may have
    written the weights (averaged, DiLoCo's outer step, or restored after a failed sync) after
    DMuon's step had already broadcast the first layer for the next forward: drop what is gathered
    ahead (``weights_changed``), so the forward gathers the new weights. Returns the count now."""
    if ft_manager.enabled and not ft_manager.per_step and ft_manager.commit_decisions != seen:
        for handle in handles:
            handle.weights_changed()
    return ft_manager.commit_decisions


def _mean_of_group_means(dist_sum):
    """TorchTitan's ``dist_sum`` for its logged loss (a float: each group's mean) averaged across the
    groups (its ``extra_pg``); counts (integers, e.g. tokens seen) still add up."""

    def mean_across_groups(x, mesh=None, extra_pg=None):
        if extra_pg is None or not x.is_floating_point():
            return dist_sum(x, mesh, extra_pg)
        dist.all_reduce(x, op=dist.ReduceOp.AVG, group=extra_pg)
        return dist_sum(x, mesh)

    return mean_across_groups
