"""Z2 or Z3, and why: the recommendation from each mode's peak memory against the device's share left to it."""

from __future__ import annotations

from titan_dmuon.sizing.records import Layout, Stage
from titan_dmuon.sizing.render import format_gb


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
    fits = z2.memory["DMuon-Z2"].peak <= budget
    reasons = [
        f"Z2 keeps every layer's gathered Muon weights from forward to backward: {format_gb(extra)} "
        "more per rank at its "
        f"peak than Z3 (P_M in the compute dtype, not P_M / N)",
        f"Z3 broadcasts them again in backward: {format_gb(saved)} more per rank per step than Z2 "
        f"({float(z3.traffic['DMuon-Z3'].elements / z3.floor.elements):.2f}x the floor against "
        f"{float(z2.traffic['DMuon-Z2'].elements / z2.floor.elements):.2f}x)",
        f"Z2's peak without activations, {format_gb(z2.memory['DMuon-Z2'].peak)}, is "
        + ("within" if fits else "over")
        + f" {format_gb(budget)} ({1 - share:.0%} of {format_gb(device_memory)}, the rest "
        "left to activations)",
    ]
    if fits:
        return "DMuon-Z2", reasons + ["so Z2: it fits, and moves the least (measure the step time before keeping it)"]
    z3_peak = z3.memory["DMuon-Z3"].peak
    if z3_peak > budget:  # (Z3 is the smaller, and over the same budget: say so, with what would fit)
        return "DMuon-Z3", reasons + [
            f"Z3's peak without activations, {format_gb(z3_peak)}, is over {format_gb(budget)} too: neither fits this "
            "layout; more data-parallel ranks, tensor or pipeline parallelism, or a device with more memory",
            "so Z3, the smaller of the two",
        ]
    return "DMuon-Z3", reasons + [
        f"Z3's peak without activations, {format_gb(z3_peak)}, is within {format_gb(budget)}",
        "so Z3; if Z3 runs out of memory, look at activations (activation checkpointing) and gradient accumulation "
        "first: Z3's buffers are two layers",
    ]
