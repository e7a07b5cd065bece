"""Z2 or Z3, and why: the recommendation from each mode's peak memory on the plan that runs (owner groups
unless they are off) against the device's share left to it."""

from __future__ import annotations

from titan_dmuon.sizing.records import Layout, Stage
from titan_dmuon.sizing.render import format_gb

MODES = (("Z2", "DMuon-Z2"), ("Z3", "DMuon-Z3"))


def _peak(stages: list[Stage], configuration: str, which: str = "runs") -> int:
    """The largest rank's peak without activations over the stages, on ``runs`` or ``one_owner``."""
    return max(getattr(s, which).memory[configuration].peak for s in stages)


def _fits_line(stages: list[Stage], mode: str, budget: float, note: str) -> str:
    """One line: whether ``mode`` fits ``budget`` and why (its peak on the plan that runs, and on one
    owner per weight where owner groups change it)."""
    configuration = dict(MODES)[mode]
    peak = _peak(stages, configuration)
    fits = peak <= budget
    line = (
        f"{mode} {'fits' if fits else 'does not fit'}: its peak without activations, {format_gb(peak)}, is "
        f"{'within' if fits else 'over'} {format_gb(budget)}{note}"
    )
    if any(s.runs is not s.one_owner for s in stages):
        alone = _peak(stages, configuration, "one_owner")
        line += f", with owner groups (the plan that runs); one owner per weight: {format_gb(alone)}, " + (
            "within" if alone <= budget else "over"
        )
    return line


def recommend(stages: list[Stage], layout: Layout, device_memory: float, share: float) -> tuple[str, list[str]]:
    """The decision tree, on the figures: Z2 saves one broadcast of the Muon targets per step and
    keeps every layer's gathered weights from forward to backward; take it only where that fits."""
    z2 = max(stages, key=lambda s: s.memory["DMuon-Z2"].peak)
    z3 = max(stages, key=lambda s: s.memory["DMuon-Z3"].peak)
    budget = (1 - share) * device_memory
    if layout.pp > 1:
        return "either (the same under pipelining)", [
            "with pipelining DMuon keeps each layer's weights gathered over the micro-batches and reduces once per "
            "step, whatever reshard_after_forward says: Z2 and Z3 move and hold the same"
        ]
    if layout.ddp:
        return "DMuon-Z2 (DDP)", ["under DDP every rank holds the whole model anyway; DMuon runs Z2 there"]
    if layout.shard * layout.replicate == 1:
        return "either (one data-parallel rank)", ["one data-parallel rank: nothing is broadcast or reduced"]
    extra = z2.memory["DMuon-Z2"].peak - z3.memory["DMuon-Z3"].peak
    saved = z3.traffic["DMuon-Z3"].bytes - z2.traffic["DMuon-Z2"].bytes
    reasons = [
        f"Z2 keeps every layer's gathered Muon weights from forward to backward: {format_gb(extra)} "
        "more per rank at its "
        f"peak than Z3 (P_M in the compute dtype, not P_M / N)",
        f"Z3 broadcasts them again in backward: {format_gb(saved)} more per rank per step than Z2 "
        f"({float(z3.traffic['DMuon-Z3'].elements / z3.floor.elements):.2f}x the floor against "
        f"{float(z2.traffic['DMuon-Z2'].elements / z2.floor.elements):.2f}x)",
        _fits_line(
            stages, "Z2", budget, f" ({1 - share:.0%} of {format_gb(device_memory)}, the rest left to activations)"
        ),
        _fits_line(stages, "Z3", budget, ""),
    ]
    if _peak(stages, "DMuon-Z2") <= budget:
        return "DMuon-Z2", reasons + ["so Z2: it fits, and moves the least (measure the step time before keeping it)"]
    if _peak(stages, "DMuon-Z3") > budget:  # (Z3 is the smaller, and over the same budget: say what would fit)
        return "DMuon-Z3", reasons + [
            "so Z3, the smaller of the two: neither fits this layout; more data-parallel ranks, tensor or pipeline "
            "parallelism, or a device with more memory"
        ]
    return "DMuon-Z3", reasons + [
        "so Z3; if Z3 runs out of memory, look at activations (activation checkpointing) and gradient accumulation "
        "first: Z3's buffers are two layers"
    ]
