"""What a sizing is asked about and what it answers: the model's weights, the layout, the precision,
and the figures per stage (memory, traffic, Newton–Schulz). Plain records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction

from titan_dmuon.math.matrix_blocks import Block
from titan_dmuon.plan.owner_groups import GroupOptions
from titan_dmuon.plan.ownership import OwnershipPlan

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


CONFIGURATIONS = ("FSDP2 + AdamW, Z2", "FSDP2 + AdamW, Z3", "DMuon-Z2", "DMuon-Z3")


STEP_COUNT_BYTES = 4  # AdamW's per-parameter step count: a float32 scalar tensor (torch.optim.AdamW's and DMuon's)


NS_BYTES = 2  # Newton–Schulz runs in bf16: what the TP exchange sends to the homes and back


@dataclass(frozen=True, kw_only=True)
class Weight:
    """One parameter of the model, as the sizing needs it."""

    fqn: str
    shape: tuple[int, ...]
    muon: bool  # a Muon target (dedicated, or a routed-expert stack updated where it lives)
    layer: int | None  # its transformer layer (one DMuon unit per layer); None: embeddings, final norm, head
    blocks: tuple[Block, ...] | None = None  # Newton–Schulz row blocks (fused q/k/v); None: the whole matrix
    tp_dim: int | None = None  # the dim tensor parallelism splits; None: every TP rank holds it whole

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def experts(self) -> int:
        """Experts in a 3-D stack (0 for any other weight)."""
        return self.shape[0] if len(self.shape) == 3 else 0


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Data-parallel replicate R x shard N (HSDP when both > 1, DDP when N = 1 < R), tensor
    parallelism T, pipeline stages P, expert parallelism E (inside the shard x tensor ranks)."""

    replicate: int = 1
    shard: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.replicate * self.shard * self.tp * self.pp

    @property
    def ddp(self) -> bool:
        return self.shard == 1 and self.replicate > 1

    def describe(self) -> str:
        kind = "DDP" if self.ddp else "HSDP" if self.replicate > 1 else "FSDP"
        parts = [f"replicate {self.replicate} x shard {self.shard} ({kind})"]
        parts += [f"{name} {n}" for name, n in (("TP", self.tp), ("PP", self.pp), ("EP", self.ep)) if n > 1]
        return ", ".join(parts) + f": {self.world} ranks"


@dataclass(frozen=True, kw_only=True)
class Precision:
    """Bytes per element: master weights, gradients and optimizer state (``param``), forward and
    backward weights (``compute``: FSDP2's ``mp_policy.param_dtype``), gradient reduction (``reduce``)."""

    param: int = 4
    compute: int = 2
    reduce: int = 4


@dataclass(frozen=True, kw_only=True)
class Memory:
    """Bytes per rank (the largest rank of each figure)."""

    params: int
    grads: int
    optimizer_state: int
    buffers_between_steps: int = 0  # DMuon's packed buffers alive between steps (the first layer's)
    buffers_peak: int = 0  # DMuon's packed buffers at their peak (the counter ``peak_buffer_bytes``)
    unreduced_grads: int = 0  # pipelining: the stage's dedicated gradients held unreduced over the micro-batches
    gathered_peak: int = 0  # FSDP2's all-gathered weights and one layer's reduce buffers (estimate)
    workspace: int = (
        0  # DMuon's Muon-step workspace, kept between steps (step_memory.workspace_bytes; TP weights' aside)
    )
    group_temporaries: int = 0  # owner groups' step temporaries: their Gram workspace (step_memory.group_temporaries)

    @property
    def persistent(self) -> int:
        return self.params + self.grads + self.optimizer_state + self.buffers_between_steps + self.workspace

    @property
    def peak(self) -> int:
        """Everything above at once, activations not included."""
        return (
            self.params
            + self.grads
            + self.optimizer_state
            + self.buffers_peak
            + self.unreduced_grads
            + self.gathered_peak
            + self.workspace
            + self.group_temporaries
        )


@dataclass(frozen=True, kw_only=True)
class Traffic:
    """Elements (the design's unit) and bytes per rank per step for the dedicated Muon targets."""

    elements: Fraction
    bytes: Fraction


@dataclass(frozen=True, kw_only=True)
class PlanFigures:
    """One ownership plan of a stage and what DMuon does with it: the one-owner plan, or the plan with
    owner groups (the runtime's default), so that the two can be read side by side."""

    plan: OwnershipPlan
    ns_per_rank: list[int]  # Newton–Schulz FLOPs of each rank of the stage (R x N x T)
    ns_seconds: list[float]  # ... and its time: FLOPs at ns_tflops plus its owner groups' all-reduces
    largest_ns: int  # the largest Newton–Schulz job one rank runs whole (a matrix, a dedicated stack)
    memory: dict[str, Memory]  # "DMuon-Z2", "DMuon-Z3"
    traffic: dict[str, Traffic]  # "DMuon-Z2", "DMuon-Z3", owner groups' all-reduces included
    group_traffic: Traffic  # the owner groups' all-reduces alone, per rank (the mean over the stage's ranks)
    group_traffic_max: Traffic  # ... on the rank that all-reduces the most

    @property
    def grouped(self) -> bool:
        return any(e.group is not None for e in self.plan.entries)


@dataclass(frozen=True, kw_only=True)
class Stage:
    """One pipeline stage's figures (the whole model without pipelining): DMuon's from the plan that runs
    (``runs``: with owner groups unless they are off), ``one_owner`` beside it."""

    index: int
    memory: dict[str, Memory]
    traffic: dict[str, Traffic]
    floor: Traffic
    tp_exchange: Traffic
    runs: PlanFigures
    one_owner: PlanFigures  # the same object as ``runs`` where no owner group forms
    dedicated_numel: int
    local_expert_numel: int

    @property
    def plan(self) -> OwnershipPlan:
        return self.runs.plan

    @property
    def ns_per_rank(self) -> list[int]:
        return self.runs.ns_per_rank


@dataclass(frozen=True, kw_only=True)
class Sizing:
    layout: Layout
    precision: Precision
    stages: list[Stage]
    muon_numel: int
    other_numel: int
    recommendation: str
    groups: GroupOptions  # how the plan that runs chose owner groups (``enabled`` False: one owner per weight)
    reasons: list[str] = field(default_factory=list)

    def heaviest(self, configuration: str) -> Stage:
        """The stage whose ranks need the most memory under ``configuration``."""
        return max(self.stages, key=lambda s: s.memory[configuration].peak)

    def figures(self, which: str) -> list[PlanFigures]:
        """Each stage's ``runs`` or ``one_owner``."""
        return [getattr(s, which) for s in self.stages]

    @property
    def grouped(self) -> bool:
        return any(s.runs.grouped for s in self.stages)

    @property
    def ns_max(self) -> int:
        return max(max(s.ns_per_rank) for s in self.stages)

    @property
    def ns_mean(self) -> float:
        return sum(sum(s.ns_per_rank) for s in self.stages) / sum(len(s.ns_per_rank) for s in self.stages)

    def ns_seconds_max(self, which: str = "runs") -> float:
        """The busiest rank's Newton–Schulz time (``step()`` waits for it), of ``runs`` or ``one_owner``."""
        return max(max(f.ns_seconds) for f in self.figures(which))
