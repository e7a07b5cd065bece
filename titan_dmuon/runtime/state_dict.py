"""State dicts (DCP checkpoints) of dedicated weights.

A dedicated weight appears in ``state_dict()`` only on the ranks that hold it,
under its normal name, with its current full value (a TP shard, or a block of an
owner group's weight: as a DTensor of the full matrix); other ranks leave the
key out. DCP then writes each weight once (from a holder: all holders agree
once the HSDP post-step broadcasts have landed) and, on load, each rank
requests exactly the weights it holds now, which reshards across world sizes,
Z2/Z3, FSDP/HSDP and ownership plans.

Saving waits on the host for the HSDP post-step broadcasts and for everything
queued on the device (the step's writes of owners' weights and momentum: the
step never syncs the host): DCP's asynchronous checkpointing stages tensors on
its own stream from another thread, and TorchFT's recovery copies them on its
quorum thread, neither ordered after that work otherwise. Checkpoints and
recovery only, so the host waits cost nothing per step.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.utils.hooks import RemovableHandle

from titan_dmuon.runtime.members import pieces_of
from titan_dmuon.runtime.streams import synchronize_device


def install_state_dict_hooks(handle, module: nn.Module) -> list[RemovableHandle]:
    """Hooks on a module that registers dedicated weights (``handle``: its DedicatedParams)."""
    not_held_keys: set[str] = set()

    def on_state_dict(module, state_dict, prefix, local_metadata) -> None:
        handle.wait_for_replicate_broadcasts(host=True)
        synchronize_device(handle.mode.mesh.device)
        for m in handle.members_of(module):
            key = prefix + m.name
            if m.holds_full:  # the master weight, also while compute views are swapped in
                if m.entry.tp_dim is not None:  # a TP shard: the full matrix as a DTensor on the tp mesh
                    state_dict[key] = handle.as_sharded(m, m.param.detach())
                else:
                    state_dict[key] = m.param if isinstance(state_dict.get(key), nn.Parameter) else m.param.detach()
            elif m.block is not None:  # an owner group's block: the full matrix as a DTensor on its group
                state_dict[key] = handle.as_sharded(m, m.param.detach())
            else:
                state_dict.pop(key, None)

    def before_load(module, state_dict, prefix, *args) -> None:
        handle.wait_for_replicate_broadcasts(host=True)  # so that no older value lands after the load
        handle.discard_gathered_weights()  # a buffer gathered before the load holds old values
        for m in handle.members_of(module):  # (every rank meets the members in one order: _readable's gathers)
            key = prefix + m.name
            value = _readable(handle, m, state_dict.get(key))
            if m.block is not None:  # this rank's block of the full matrix
                if isinstance(value, torch.Tensor) and tuple(value.shape) == m.shape:
                    value = pieces_of(m, handle.plan)[m.block].of(value)
                if value is not None:
                    state_dict[key] = value
            elif not m.holds_full:
                state_dict.pop(key, None)  # its holders load it
                not_held_keys.add(key)
            elif value is not None:  # a TP shard: this rank's of the full matrix; one owner: the full matrix
                if m.entry.tp_dim is not None and tuple(value.shape) == m.entry.full_shape:
                    value = handle.tp_local(m, value)
                state_dict[key] = value

    def after_load(module, incompatible_keys) -> None:
        """Weights this rank does not hold are not "missing" from what it was given; the next
        gathers read the loaded values."""
        missing = incompatible_keys.missing_keys
        missing[:] = [k for k in missing if k not in not_held_keys]
        handle.weights_changed()

    return [
        module.register_state_dict_post_hook(on_state_dict),
        module.register_load_state_dict_pre_hook(before_load),
        module.register_load_state_dict_post_hook(after_load),
    ]


def _readable(handle, m, value):
    """``value`` as this rank reads it: a DTensor laid out as ``state_dict()`` gives it (an owner group's
    block, a TP shard) as its local tensor; any other DTensor whole, by ``full_tensor()`` on every rank of
    its mesh, whether or not the rank holds the weight (e.g. another FSDP2 model's state dict: an
    all-gather only the holders joined would hang on NCCL); a DTensor this rank is not part of: None."""
    if not isinstance(value, DTensor):
        return value
    if m.block is not None and _block_layout(value, handle.owner_groups.device_mesh(m), m.group.long_dim):
        return value.to_local()
    if m.entry.tp_dim is not None and tuple(value.placements) == (Shard(m.entry.tp_dim),):
        # a TP shard on its TP mesh: its holders read their shard; the rest of that mesh holds nothing of it
        return value.to_local() if m.holds_full else None
    if value.device_mesh.get_coordinate() is None:
        return None
    return value.full_tensor()


def _block_layout(value: DTensor, mesh, long_dim: int) -> bool:
    """Whether ``value`` is laid out as ``state_dict()`` gives a block: on its group's ranks, ``Shard`` along
    the long side. Compared by ranks, not by object: TorchFT's recovery sends the state dict pickled, so
    its meshes are copies (without process groups: a ``full_tensor()`` on one fails)."""
    other = value.device_mesh
    same_ranks = other is mesh or (other.device_type == mesh.device_type and torch.equal(other.mesh, mesh.mesh))
    return same_ranks and tuple(value.placements) == (Shard(long_dim),)
