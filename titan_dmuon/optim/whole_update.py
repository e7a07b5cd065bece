"""What runs on an owner for a list of weights: Muon's momentum, then Newton–Schulz, then the update.

``OwnerUpdate.update`` is the rule for weights this rank holds whole (a dedicated weight on its
owner, the experts a rank keeps): one ``muon_update.muon_step`` per list, which runs the three stages
in batches of equally shaped matrices. Under tensor parallelism a matrix is held in shards, and the
same rule runs split where the matrix is split (``tensor_parallel_update.py`` moves the data between
the parts): ``momentum_inputs`` on each TP rank's shards, ``orthogonalise`` on the matrix's NS home,
``apply_shards`` on the shards again. Nothing here communicates, and nothing here decides the
order of the step (``optim/step_schedule.py`` does).

A variant of the rule extends this class and leaves the schedule alone: a weight's optimizer state
is ``state_of(param)``, the momentum and, with NorMuon (``normuon_beta2``), its per-row second moment
after Newton–Schulz (``second_moment``: one value per row of each Newton–Schulz matrix, kept where that
matrix is orthogonalised: on the owner, or, for a tensor-parallel weight, on its NS homes, whose rows
it covers whole); a Newton–Schulz spread over several ranks would replace ``update``'s for its
weights. ``figures`` counts the Newton–Schulz matrices and times them on the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from titan_dmuon.math.matrix_blocks import Block, block_rows, local_tiles
from titan_dmuon.math.muon_update import converted, muon_step, orthogonalise
from titan_dmuon.math.ns_methods import ns_torch_dtype
from titan_dmuon.math.update_rules import adjusted_lr, apply_normuon, scalar, second_moment_shape
from titan_dmuon.optim.ns_graphs import NSGraphs
from titan_dmuon.optim.workspace import Workspace
from titan_dmuon.runtime.streams import DeviceTimer

SECOND_MOMENT = "normuon_second_moment"  # NorMuon's v in a weight's optimizer state (beside "momentum_buffer")


@dataclass(eq=False)
class OwnedWeight:
    """A weight this rank updates whole: the registered parameter (its optimizer state's key), what
    this rank writes of it (the parameter, or its whole local experts), that part's gradient, and
    the row blocks and column blocks (() : every column) of each of its matrices."""

    param: torch.Tensor
    tensor: torch.Tensor
    grad: torch.Tensor
    blocks: Sequence[Block]
    col_blocks: Sequence[Block] = ()


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
    Newton–Schulz method, dtype and NorMuon decay ``optimizer.ns_method``, ``ns_dtype`` and
    ``normuon_beta2``, all read there each time (``load_state_dict`` replaces the state's mapping; a
    job may change the method between steps). The step's temporaries come from ``workspace``, the
    same memory every step (``optim/workspace.py``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, figures: NSFigures) -> None:
        self.optimizer, self.figures = optimizer, figures
        self.workspace = Workspace()
        self.ns_graphs = NSGraphs(self.workspace)  # used with the job's ns_graphs

    @property
    def ns_runner(self) -> NSGraphs | None:
        """How a Newton–Schulz batch runs: from CUDA graphs (``ns_graphs``), or called (None)."""
        return self.ns_graphs if getattr(self.optimizer, "ns_graphs", False) else None

    @property
    def ns_method(self) -> str:
        return self.optimizer.ns_method

    @property
    def ns_dtype(self) -> str:
        return self.optimizer.ns_dtype

    @property
    def normuon_beta2(self) -> float | None:
        return self.optimizer.normuon_beta2

    def second_moment(self, param: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        """This rank's part of ``param``'s NorMuon second moment of the (full) ``shape``
        (``second_moment_shape``), float32, made zero on first use; a DTensor like a local-experts
        parameter (sharded on its experts), on every rank."""
        state = self.state_of(param)
        if SECOND_MOMENT not in state:
            state[SECOND_MOMENT] = zero_second_moment(param, shape)
        return _local(state[SECOND_MOMENT])

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
        tensors, grads, buffers, blocks, col_blocks, moments = [], [], [], [], [], []
        beta2 = self.normuon_beta2
        for weight in weights:
            buffer = self.momentum_buffer(weight.param)
            moment = (
                None
                if beta2 is None
                else self.second_moment(weight.param, second_moment_shape(weight.param.shape, weight.col_blocks))
            )
            if weight.tensor.numel() == 0:
                continue  # FSDP2 gave this rank no expert of this weight
            tensors.append(weight.tensor)
            grads.append(weight.grad)
            buffers.append(buffer)
            blocks.append(weight.blocks)
            col_blocks.append(weight.col_blocks or None)
            moments.append(moment)
        if not tensors:
            return
        with self.figures.timing(tensors[0].device):
            self.figures.matrices += muon_step(
                tensors,
                grads,
                buffers,
                blocks,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                momentum=group["momentum"],
                nesterov=group["nesterov"],
                ns_steps=group["ns_steps"],
                ns_coefficients=group["ns_coefficients"],
                eps=group["eps"],
                adjust_lr_fn=group["adjust_lr_fn"],
                ns_mode=group["ns_mode"],
                ns_method=self.ns_method,
                col_blocks=col_blocks,
                ns_dtype=self.ns_dtype,
                normuon_beta2=beta2,
                second_moments=moments if beta2 is not None else None,
                scratch=self.workspace,
                ns_runner=self.ns_runner,
            )

    # ---- the same rule, split where tensor parallelism splits the matrix --------------------------------
    def momentum_inputs(
        self,
        group: dict,
        param: torch.Tensor,
        grad: torch.Tensor,
        matrices: slice,
        tp_matrices: Sequence = (),
        *,
        out: torch.Tensor,
    ) -> list:
        """torch.optim.Muon's momentum on this rank's shard of ``param`` (``matrices``: the experts of a
        stack, ``slice(0, 1)`` for a matrix); the bf16 Newton–Schulz input of each of those matrices,
        written into ``out`` (one per matrix). With NorMuon, ``param``'s second moment is made here on
        every rank that holds a part of it (its ``tp_matrices``' homes use it; checkpoints merge it:
        ``tensor_parallel_second_moments``)."""
        if self.normuon_beta2 is not None:
            self.second_moment(param, tp_second_moment_shape(param, tp_matrices))
        momentum, buffer = group["momentum"], self.momentum_buffer(param)
        if buffer.ndim == 3:
            buffer, grad = buffer[matrices], grad[matrices]
        buffer.lerp_(grad, 1 - momentum)
        ns_input = buffer
        if group["nesterov"]:
            ns_input = torch.lerp(
                grad, buffer, momentum, out=self.workspace("tp_nesterov", tuple(grad.shape), grad.dtype, grad.device)
            )
        for k in range(matrices.stop - matrices.start):
            out[k].copy_(ns_input[k] if ns_input.ndim == 3 else ns_input)
        return list(out)

    def orthogonalise_fn(self, group: dict):
        """Newton–Schulz of whole matrices (a TP home's), by ``group``'s options, in the job's dtype, each
        result passed to ``consume(i, result)`` (``muon_update.orthogonalise``)."""

        def orthogonalise_matrices(matrices: list[torch.Tensor], consume) -> None:
            orthogonalise(
                matrices,
                ns_mode=group["ns_mode"],
                steps=group["ns_steps"],
                coefficients=group["ns_coefficients"],
                eps=group["eps"],
                ns_method=self.ns_method,
                ns_dtype=self.ns_dtype,
                scratch=self.workspace,
                consume=consume,
                ns_runner=self.ns_runner,
            )

        return orthogonalise_matrices

    @property
    def result_dtype(self) -> torch.dtype:
        """The dtype of a Newton–Schulz result (what a TP home sends back)."""
        return ns_torch_dtype(self.ns_dtype)

    def home_rule(self, owners: Sequence):
        """What a TP home does to each orthogonalised tile before it travels back (None: nothing): NorMuon
        on the whole rows of the full matrix, with the weights' second moments. ``owners``: per matrix of
        the exchange, in order, (the weight: ``param`` and ``matrices``, one per expert; which of them)."""
        beta2 = self.normuon_beta2
        if beta2 is None:
            return None

        def normuon_at_home(i: int, t: int, result: torch.Tensor) -> torch.Tensor:
            item, k = owners[i]
            matrix = item.matrices[k]
            rows, _ = matrix.tiles()[t]
            moment = self.second_moment(item.param, tp_second_moment_shape(item.param, item.matrices))
            return apply_normuon(result, moment, k, rows, t % len(matrix.col_blocks), beta2, scratch=self.workspace)

        return normuon_at_home

    def apply_shards(self, group: dict, weight: torch.Tensor, matrices: Sequence, updates, *, tp_rank: int) -> None:
        """Decoupled weight decay on ``weight`` (this rank's shard: a matrix, or the experts of
        ``matrices``), then each (row block, column block)'s orthogonalised update from ``updates`` (this
        rank's shard of each matrix's result, in order), scaled for that block of the full matrix."""
        lr = scalar(group["lr"])
        weight.mul_(1 - lr * group["weight_decay"])
        for k, matrix in enumerate(matrices):
            update, target = next(updates), weight[k] if weight.ndim == 3 else weight
            for rows, cols in matrix.tiles():
                scale = adjusted_lr(lr, group["adjust_lr_fn"], (block_rows(rows), block_rows(cols)))
                for local_rows, local_cols in local_tiles(
                    rows, cols, tp_dim=matrix.dim, tp_rank=tp_rank, local_shape=matrix.shape
                ):
                    tile = converted(update[local_rows, local_cols], target.dtype, self.workspace)
                    target[local_rows, local_cols].add_(tile, alpha=-scale)


def tp_second_moment_shape(param: torch.Tensor, tp_matrices: Sequence) -> tuple[int, ...]:
    """The second moment of a tensor-parallel weight: per matrix (per expert of ``param``'s stack), one
    value per row of the full matrix (its row blocks cover them) and column block."""
    matrix = tp_matrices[0]
    rows = sum(block_rows(b) for b in matrix.blocks)
    return (*param.shape[:-2], rows, len(matrix.col_blocks))


def second_moment_shape_of(handles: Sequence, param: torch.Tensor) -> tuple[int, ...] | None:
    """The shape of ``param``'s NorMuon second moment, as the step makes it (``OwnerUpdate.update`` for a
    weight held whole, ``momentum_inputs`` for a tensor-parallel one): None for a weight no handle steps."""
    for handle in handles:
        member = handle.member_of(param)
        if member is not None:
            entry = member.entry
            if entry.tensor_parallel:
                return tp_second_moment_shape(param, entry.tp_matrices())
            return second_moment_shape(param.shape, entry.col_blocks or None)
        experts = handle.local_expert_of(param)
        if experts is not None:
            if experts.tp_dim is not None and experts.fqn in handle.local_tp_experts:
                return tp_second_moment_shape(param, handle.local_tp_experts[experts.fqn].tp_matrices())
            return second_moment_shape(param.shape, experts.col_blocks or None)
    return None


def zero_second_moment(param: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """A float32 zero second moment of ``shape`` for ``param``: a DTensor sharded as a local-experts
    parameter is (on its experts: each rank's part of dim 0 is the parameter's), else a plain tensor."""
    if not isinstance(param, DTensor):
        return torch.zeros(tuple(shape), dtype=torch.float32, device=param.device)
    local = torch.zeros((param.to_local().shape[0], *shape[1:]), dtype=torch.float32, device=param.to_local().device)
    size = torch.Size(shape)
    return DTensor.from_local(
        local,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=size,
        stride=torch.empty(size, device="meta").stride(),
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
