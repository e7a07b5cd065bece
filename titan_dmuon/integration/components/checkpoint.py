"""TorchTitan's DCP CheckpointManager, checking a checkpoint before loading it.

Saving needs nothing extra (an HF export also gets its config.json: integration/components/hf_export.py):
DMuon's state-dict hooks (runtime.py) make every
dedicated weight appear once per holder under its normal name, and its
momentum lives in the optimizer state of its one global owner. Loading gets
a check first, identical on every rank so that a bad checkpoint is an error
everywhere rather than a hang in DCP's collectives:

* the metadata must be readable and every data file complete (a save that was
  killed never writes ``.metadata``, so TorchTitan skips such a folder; a
  truncated file is caught here);
* every model tensor this rank will load must exist with the same shape
  (a checkpoint of another model is named by its first differing keys);
* a checkpoint written by another optimizer (e.g. AdamW) loads weights, step,
  data position and LR schedule, with fresh optimizer state and a warning;
* NorMuon's second moments (``normuon_second_moment``) that a checkpoint does not
  hold (written by a job without NorMuon, or with other Newton–Schulz blocks,
  ``ns_blocks``) start at zero, as in a new job, with a warning; the rest of the
  optimizer state loads (a job without NorMuon ignores a checkpoint's);
* the data position can only be loaded at the data-parallel degree it was
  saved with (TorchTitan keeps one dataloader state per dp rank and cannot
  reshard it): after a change of layout the job stops with one line naming
  ``--checkpoint.exclude_from_loading dataloader``, which loads everything
  else and restarts the data order.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torchtitan.components.checkpoint import DATALOADER, OPTIMIZER, CheckpointManager
from torchtitan.tools import filesystem
from torchtitan.tools.logging import logger

from titan_dmuon.optim.whole_update import SECOND_MOMENT

DMUON_GROUP_MARKER = ".use_muon"  # a param-group key only DMuon writes
_DATALOADER_RANK_KEY = re.compile(rf"^{DATALOADER}\.dp_rank_(\d+)$")  # one per data-parallel rank


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this job; says which and why."""


class DMuonCheckpointManager(CheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    replica_groups = 1  # the data position in a checkpoint covers the data-parallel ranks of one of these

    def dcp_save(self, state_dict, checkpoint_id, async_mode, enable_garbage_collection=False, to_hf=False):
        """TorchTitan's save; an HF export (synchronous: TorchTitan's last save) then gets what
        ``transformers`` needs to load it as is (integration/components/hf_export.py), written by rank 0."""
        result = super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        if to_hf and async_mode == "disabled" and (not dist.is_initialized() or dist.get_rank() == 0):
            from titan_dmuon.integration.components.hf_export import complete_hf_export

            complete_hf_export(
                checkpoint_id,
                self.sd_adapter.model_config,
                dtype=str(self.export_dtype).removeprefix("torch."),
                hf_assets_path=self.sd_adapter.hf_assets_path,
            )
        return result

    def dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized):
        if not from_hf and not filesystem.is_remote(checkpoint_id):
            state_dict = checked_state_dict(state_dict, checkpoint_id, replica_groups=self.replica_groups)
        return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)


def checked_state_dict(state_dict: dict, checkpoint_id: str, *, replica_groups: int = 1) -> dict:
    """``state_dict`` ready for ``dcp.load``, or a CheckpointError raised on every rank.
    ``replica_groups``: TorchFT groups, each saving the data position of its own ranks."""
    problems, metadata = [], None
    try:
        metadata = FileSystemReader(checkpoint_id).read_metadata()
    except Exception as e:  # noqa: BLE001 - any failure to read metadata means the same thing
        problems.append(
            f"cannot read its .metadata ({type(e).__name__}: {e}); the checkpoint is incomplete or corrupt. "
            "Delete the folder or set checkpoint.load_step to an earlier step"
        )
    if metadata is not None:
        problems += _incomplete_files(metadata, checkpoint_id)
        problems += _model_mismatches(state_dict, metadata)
        problems += _data_parallel_change(state_dict, metadata, replica_groups=replica_groups)
    problems = _everywhere(problems)
    if problems:
        listed = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        message = f"checkpoint {checkpoint_id} cannot be loaded: {listed}"
        logger.error(f"checkpoint error: {message}")
        raise CheckpointError(message)

    if OPTIMIZER in state_dict:
        ours = _writes_dmuon_state(state_dict[OPTIMIZER])
        theirs = any(
            k.startswith(f"{OPTIMIZER}.param_groups.") and k.endswith(DMUON_GROUP_MARKER)
            for k in metadata.state_dict_metadata
        )
        if ours != theirs:
            logger.warning(
                f"checkpoint {checkpoint_id} was written by {'DMuon' if theirs else 'another optimizer (e.g. AdamW)'} "
                f"and this job uses {'DMuon' if ours else 'another optimizer'}: loading the model weights, training "
                "step, data position and LR schedule; the optimizer state (momentum, Adam moments) starts fresh."
            )
            state_dict = {k: v for k, v in state_dict.items() if k != OPTIMIZER}
        elif ours:
            state_dict = {**state_dict, OPTIMIZER: FreshSecondMoments(state_dict[OPTIMIZER], metadata, checkpoint_id)}
    return state_dict


class FreshSecondMoments:
    """The optimizers as DCP loads them (a Stateful), without the NorMuon second moments the checkpoint
    does not hold as this job has them (missing, or of another shape): DCP would fail on them. Left out,
    the optimizers' own load drops them, and the next step makes them zero: a defined start."""

    def __init__(self, optimizers, metadata, checkpoint_id: str) -> None:
        self.optimizers, self.saved, self.checkpoint_id = optimizers, metadata.state_dict_metadata, checkpoint_id

    def state_dict(self) -> dict:
        own = self.optimizers.state_dict()
        fresh = [k for k, v in own.items() if k.endswith("." + SECOND_MOMENT) and not self._holds(k, v)]
        if fresh:
            logger.warning(
                f"checkpoint {self.checkpoint_id} holds no NorMuon second moment of this job's shape for "
                f"{len(fresh)} weight(s) (e.g. {fresh[0].removeprefix('state.').removesuffix('.' + SECOND_MOMENT)}): "
                "it "
                "was written without optimizer.normuon_beta2, or with another optimizer.ns_blocks; they start at "
                "zero, as in a new job, and the rest of the optimizer state loads."
            )
        return {k: v for k, v in own.items() if k not in fresh}

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizers.load_state_dict(state_dict)

    def _holds(self, key: str, value) -> bool:
        entry = self.saved.get(f"{OPTIMIZER}.{key}")
        return isinstance(entry, TensorStorageMetadata) and tuple(entry.size) == tuple(value.shape)


def _writes_dmuon_state(optimizers) -> bool:
    return bool(getattr(optimizers, "dmuon_optimizers", lambda: [])())


def _incomplete_files(metadata, checkpoint_id: str) -> list[str]:
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(needed.items()):
        path = os.path.join(checkpoint_id, name)
        if not os.path.isfile(path):
            problems.append(f"data file {name} is missing")
        elif os.path.getsize(path) < size:
            problems.append(f"data file {name} is truncated ({os.path.getsize(path)} bytes, needs {size})")
    return problems


def _model_mismatches(state_dict: dict, metadata) -> list[str]:
    problems = []
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            continue  # Stateful components (optimizer, dataloader, ...) check themselves
        entry = metadata.state_dict_metadata.get(key)
        if entry is None:
            problems.append(f"it has no {key!r} (a checkpoint of another model?)")
        elif not isinstance(entry, TensorStorageMetadata):
            problems.append(f"{key!r} is not a tensor in it")
        elif tuple(entry.size) != tuple(value.shape):
            problems.append(f"{key!r} has shape {tuple(entry.size)} in it but {tuple(value.shape)} in this model")
    return problems


def _data_parallel_change(state_dict: dict, metadata, *, replica_groups: int = 1) -> list[str]:
    """The dataloader state of another data-parallel degree cannot be loaded (TorchTitan fails with a
    missing ``dataloader.dp_rank_N`` or an assertion, depending on the direction). Under TorchFT each
    group saves its own ranks' positions (the degree counts every group's ranks)."""
    dataloader = state_dict.get(DATALOADER)
    current = getattr(dataloader, "dp_world_size", None)
    if current is not None:
        current //= replica_groups
    saved = {int(m.group(1)) for k in metadata.state_dict_metadata if (m := _DATALOADER_RANK_KEY.match(k))}
    if current is None or not saved or len(saved) == current:
        return []
    return [
        f"it was saved with data-parallel degree {len(saved)} and this job has {current}, and the data position "
        "cannot be resharded; to resume on this layout add --checkpoint.exclude_from_loading dataloader (weights, "
        "optimizer state, step and LR schedule load; the data order restarts from the beginning)"
    ]


def _everywhere(problems: list[str]) -> list[str]:
    """Every rank's problems, on every rank (one all-gather), so all ranks stop together."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return problems
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problems)
    merged: list[str] = []
    for rank_problems in gathered:
        merged += [p for p in rank_problems if p not in merged]
    return merged
