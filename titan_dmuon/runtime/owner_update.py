"""What runs on an owner for a list of weights: Muon's momentum, then Newton–Schulz, then the update.

``OwnerUpdate.update`` is the rule for weights this rank holds whole (a dedicated weight on its
owner, the experts a rank keeps): one ``muon_math.muon_step`` per list, which runs the three stages
in batches of equally shaped matrices. Under tensor parallelism a matrix is held in shards, and the
same rule runs split where the matrix is split (``tensor_parallel_step.py`` moves the data between
the parts): ``momentum_inputs`` on each TP rank's shards, ``orthogonalise`` on the matrix's NS home,
``apply_shards`` on the shards again. Nothing here communicates, and nothing here decides the
order of the step (``step_schedule.py`` does).

A variant of the rule extends this class and leaves the schedule alone: a weight's optimizer state
is ``state_of(param)`` (the momentum today; a per-row second moment after Newton–Schulz would sit
beside it), and a Newton–Schulz spread over several ranks would replace ``update``'s for its
weights. ``figures`` counts the Newton–Schulz matrices and times them on the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from titan_dmuon.muon_math import Block, adjusted_lr, block_rows, local_block_rows, muon_step, orthogonalise, scalar
from titan_dmuon.runtime.streams import DeviceTimer


@dataclass(eq=False)
class OwnedWeight:
    """A weight this rank updates whole: the registered parameter (its optimizer state's key), what
    this rank writes of it (the parameter, or its whole local experts), that part's gradient, and
    the row blocks of each of its matrices."""

    param: torch.Tensor
    tensor: torch.Tensor
    grad: torch.Tensor
    blocks: Sequence[Block]


class NSFigures:
    """This rank's Newton–Schulz in the last step: matrices (row blocks) and their device time."""

    def __init__(self) -> None:
        self.matrices = 0
        self.timer: DeviceTimer | None = None

    @contextlib.contextmanager
    def timing(self, device: torch.device):
        """Time the block on ``device`` (the step's first timed block starts the spans over)."""
        if self.timer is None:
            self.timer = DeviceTimer(device)
        with self.timer.timing(accumulate=self.matrices > 0):
            yield

    def seconds(self) -> float:
        """Reading it syncs with the device once."""
        return self.timer.seconds() if self.timer is not None else 0.0


class OwnerUpdate:
    """Muon on this rank's weights. Their optimizer state is ``optimizer.state`` and the job's
    Newton–Schulz method ``optimizer.ns_method``, both read there each time (``load_state_dict``
    replaces the state's mapping; a job may change the method between steps)."""

    def __init__(self, optimizer: torch.optim.Optimizer, figures: NSFigures) -> None:
        self.optimizer, self.figures = optimizer, figures

    @property
    def ns_method(self) -> str:
        return self.optimizer.ns_method

    def state_of(self, param: torch.Tensor) -> dict:
        return self.optimizer.state[param]

    def momentum_buffer(self, param: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``param``'s momentum, made (zero) on first use. Local experts: a
        DTensor like the parameter, on every rank, also one that holds none of its experts."""
        state = self.state_of(param)
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return _local(state["momentum_buffer"])

    def update(self, group: dict, weights: list[OwnedWeight]) -> None:
        """Muon on ``weights`` with ``group``'s options: momentum, Newton–Schulz of each row block,
        decoupled weight decay and the update (``muon_step``, timed)."""
        tensors, grads, buffers, blocks = [], [], [], []
        for weight in weights:
            buffer = self.momentum_buffer(weight.param)
            if weight.tensor.numel() == 0:
                continue  # FSDP2 gave this rank no expert of this weight
            tensors.append(weight.tensor)
            grads.append(weight.grad)
            buffers.append(buffer)
            blocks.append(weight.blocks)
        if not tensors:
            return
        with self.figures.timing(tensors[0].device):
            self.figures.matrices += muon_step(
                tensors, grads, buffers, blocks,
                lr=group["lr"], weight_decay=group["weight_decay"], momentum=group["momentum"],
                nesterov=group["nesterov"], ns_steps=group["ns_steps"], ns_coefficients=group["ns_coefficients"],
                eps=group["eps"], adjust_lr_fn=group["adjust_lr_fn"], ns_mode=group["ns_mode"],
                ns_method=self.ns_method,
            )

    # ---- the same rule, split where tensor parallelism splits the matrix --------------------------------
    def momentum_inputs(self, group: dict, param: torch.Tensor, grad: torch.Tensor, matrices: slice) -> list:
        """torch.optim.Muon's momentum on this rank's shard of ``param`` (``matrices``: the experts of a
        stack, ``slice(0, 1)`` for a matrix); the bf16 Newton–Schulz input of each of those matrices."""
        momentum, buffer = group["momentum"], self.momentum_buffer(param)
        if buffer.ndim == 3:
            buffer, grad = buffer[matrices], grad[matrices]
        buffer.lerp_(grad, 1 - momentum)
        ns_input = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
        return [(ns_input[k] if ns_input.ndim == 3 else ns_input).bfloat16()
                for k in range(matrices.stop - matrices.start)]

    def orthogonalise_fn(self, group: dict):
        """Newton–Schulz of whole matrices (a TP home's), by ``group``'s options."""
        def orthogonalise_matrices(matrices: list[torch.Tensor]) -> list[torch.Tensor]:
            return orthogonalise(matrices, ns_mode=group["ns_mode"], steps=group["ns_steps"],
                                 coefficients=group["ns_coefficients"], eps=group["eps"], ns_method=self.ns_method)

        return orthogonalise_matrices

    def apply_shards(self, group: dict, weight: torch.Tensor, matrices: Sequence, updates, *, full_cols: int,
                     tp_rank: int) -> None:
        """Decoupled weight decay on ``weight`` (this rank's shard: a matrix, or the experts of
        ``matrices``), then each row block's orthogonalised update from ``updates`` (this rank's
        shard of each matrix's result, in order), scaled for the block of the full matrix."""
        lr = scalar(group["lr"])
        weight.mul_(1 - lr * group["weight_decay"])
        for k, matrix in enumerate(matrices):
            update, target = next(updates), weight[k] if weight.ndim == 3 else weight
            for block in matrix.blocks:
                scale = adjusted_lr(lr, group["adjust_lr_fn"], (block_rows(block), full_cols))
                for start, stop, _ in local_block_rows(block, tp_dim=matrix.dim, tp_rank=tp_rank,
                                                       local_rows=matrix.shape[0]):
                    target[start:stop].add_(update[start:stop], alpha=-scale)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
