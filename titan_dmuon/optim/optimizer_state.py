"""What ``DMuon.state_dict()`` presents, so that PyTorch's checkpoint API works with its defaults.

PyTorch's ``get_state_dict``/``set_state_dict`` (``torch.distributed.checkpoint.state_dict``)
refuse, unless ``strict=False``, to load an optimizer state that has no entry for a parameter
that requires gradients. Under DMuon a dedicated weight's momentum lives on its one global owner
(``Member.runs_ns``; under tensor parallelism a replicated weight's on its TP home only), so every
other rank has nothing to save for it. Two rules make the defaults work, on every mode:

* every parameter DMuon steps is listed in its state, on every rank: a rank that keeps nothing
  for one lists it with no entries (``{}``), which DCP neither writes nor reads, while the owner
  lists its momentum as a plain tensor of the full matrix, which DCP writes once and loads on
  whichever rank owns the weight at load time (any world size, any mode, any plan);
* a fresh optimizer's state already holds, as zeros, every tensor its first step would create
  (``initialise_missing_state``), so that ``opt.state_dict()`` names every tensor a ``dcp.load``
  must fill, as ``get_state_dict`` does by running a zero step first.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import _get_scalar_dtype

from titan_dmuon.optim.whole_update import SECOND_MOMENT, second_moment_shape_of, zero_second_moment


def adamw_initial_state(p: torch.Tensor) -> dict[str, torch.Tensor]:
    """``torch.optim.AdamW``'s state of ``p`` before its first step."""
    return {
        "step": torch.tensor(0.0, dtype=_get_scalar_dtype()),
        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
    }


def keeps_momentum(handles, p: torch.Tensor) -> bool:
    """True on the ranks whose Muon step keeps a momentum buffer for ``p``: a dedicated weight's global
    owner (a TP-replicated one's NS home only), and every rank for the experts it updates in place."""
    for handle in handles:
        member = handle.member_of(p)
        if member is not None:
            if not member.runs_ns:
                return False
            if not member.entry.tp_replicated:
                return True
            return member.entry.tp_matrices()[0].home == handle.mode.tp.rank
        if handle.local_expert_of(p) is not None:
            return True
    return False


def initialise_missing_state(optimizer) -> None:
    """Give each trainable parameter that has no state yet the zeros its first step would create
    (the same values: a resumed run then equals the straight one bit for bit): AdamW's moments, the
    Muon momentum, and with NorMuon (``optimizer.normuon_beta2``) its second moment."""
    handles = optimizer.dedicated_handles()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad or optimizer.state.get(p):
                continue
            if not group["use_muon"]:
                optimizer.state[p] = adamw_initial_state(p)
            elif keeps_momentum(handles, p):
                state = {"momentum_buffer": torch.zeros_like(p, memory_format=torch.preserve_format)}
                shape = second_moment_shape_of(handles, p) if optimizer.normuon_beta2 is not None else None
                if shape is not None:
                    state[SECOND_MOMENT] = zero_second_moment(p, shape)
                optimizer.state[p] = state


def list_every_param(optimizer, packed: dict) -> None:
    """``packed`` (``Optimizer.state_dict()``'s, keyed by position) gets an empty entry for each parameter
    this rank keeps no state for."""
    index = 0
    for group in optimizer.param_groups:
        for _ in group["params"]:
            packed["state"].setdefault(index, {})
            index += 1
