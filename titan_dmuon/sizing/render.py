"""A sizing as the text ``python -m titan_dmuon.sizing`` prints: memory and traffic tables, Newton–Schulz
per rank, the recommendation.
"""

from __future__ import annotations

from titan_dmuon.plan.owner_groups import H200_BF16_TFLOPS  # (Newton–Schulz runs below it: times are lower bounds)
from titan_dmuon.sizing.records import CONFIGURATIONS, Sizing


# ---- the report ------------------------------------------------------------------------------------------
def format_gb(nbytes: float, unit: float | None = None) -> str:
    """Bytes in GB, or in MB where the figures (``unit``: the largest of them) stay below 1 GB."""
    if (unit if unit is not None else nbytes) >= 1e9:
        return f"{nbytes / 1e9:,.2f} GB"
    return f"{nbytes / 1e6:,.2f} MB"


def _flop(flops: float) -> str:
    return f"{flops / 1e12:,.1f} TFLOP" if flops >= 1e11 else f"{flops / 1e9:,.3f} GFLOP"


def _count(x: float) -> str:
    return f"{x / 1e9:,.3f}B" if x >= 1e8 else f"{x / 1e6:,.3f}M"


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:,.1f} ms" if seconds >= 1e-3 else f"{1e6 * seconds:,.1f} us"


def render(sizing: Sizing, *, title: str, tflops: float = H200_BF16_TFLOPS) -> str:
    """The report ``python -m titan_dmuon.sizing`` prints."""
    return "\n".join(
        [
            *_header(sizing, title),
            *_memory_table(sizing),
            *_traffic_table(sizing),
            *_newton_schulz_lines(sizing, tflops),
            "",
            f"Recommendation: {sizing.recommendation}",
            *(f"- {reason}" for reason in sizing.reasons),
        ]
    )


def _header(sizing: Sizing, title: str) -> list[str]:
    names = {4: "fp32", 2: "bf16"}
    p = sizing.precision
    return [
        f"{title}; {sizing.layout.describe()}",
        f"Muon targets {_count(sizing.muon_numel)} elements, other weights {_count(sizing.other_numel)}; weights, "
        f"gradients and optimizer state in {names[p.param]}, compute {names[p.compute]}, reduce {names[p.reduce]}",
    ]


def _memory_table(sizing: Sizing) -> list[str]:
    staged = sizing.layout.pp > 1
    stage_of = {c: sizing.heaviest(c) for c in CONFIGURATIONS}
    out = [
        "",
        "Memory per rank (GB = 1e9 bytes, MB = 1e6; the largest rank"
        + (", of the heaviest pipeline stage" if staged else "")
        + "; activations not included)",
        "",
        "| | " + " | ".join(CONFIGURATIONS) + " |",
        "|---" * (len(CONFIGURATIONS) + 1) + "|",
    ]
    rows = [
        ("parameters", lambda m: m.params),
        ("gradients", lambda m: m.grads),
        ("optimizer state", lambda m: m.optimizer_state),
        ("DMuon buffers between steps", lambda m: m.buffers_between_steps),
        ("DMuon buffers, peak", lambda m: m.buffers_peak),
        ("DMuon's Muon-step workspace (kept between steps)", lambda m: m.workspace),
    ]
    if staged:
        rows.append(("gradients held over the micro-batches (estimate)", lambda m: m.unreduced_grads))
    rows += [
        ("FSDP2's gathered weights + a layer's reduce buffer (estimate)", lambda m: m.gathered_peak),
        ("**persistent**: parameters, gradients, state, buffers between steps, workspace", lambda m: m.persistent),
        ("**peak without activations**", lambda m: m.peak),
    ]
    unit = max(stage_of[c].memory[c].peak for c in CONFIGURATIONS)
    for label, get in rows:
        out.append(
            f"| {label} | " + " | ".join(format_gb(get(stage_of[c].memory[c]), unit) for c in CONFIGURATIONS) + " |"
        )
    if staged:
        out += ["", "heaviest stage: " + ", ".join(f"{c} stage {stage_of[c].index}" for c in CONFIGURATIONS)]
    return out


def _traffic_table(sizing: Sizing) -> list[str]:
    stage = max(sizing.stages, key=lambda s: s.dedicated_numel)
    names = {4: "fp32", 2: "bf16"}
    p = sizing.precision
    unit = max(t.bytes for t in stage.traffic.values())
    out = [
        "",
        "Communication per rank per step of the dedicated Muon targets "
        f"({_count(stage.dedicated_numel)} elements"
        + (" in the largest pipeline stage" if sizing.layout.pp > 1 else "")
        + "; elements as a bandwidth-optimal "
        f"algorithm moves them, titan_dmuon.plan.cost_model; bytes with weights sent in {names[p.compute]}, "
        "gradients in "
        f"{names[p.reduce]})",
        "",
        "| | elements | x floor | bytes |",
        "|---|---|---|---|",
        f"| floor: an all-reduce of their gradients over the data-parallel ranks | {_count(stage.floor.elements)} "
        f"| 1.000 | {format_gb(stage.floor.bytes, unit)} |",
    ]
    for name in (
        "FSDP2 + AdamW, Z2",
        "FSDP2 + AdamW, Z3",
        "naive FSDP2 + Muon, Z2",
        "naive FSDP2 + Muon, Z3",
        "DMuon-Z2",
        "DMuon-Z3",
    ):
        if name in stage.traffic:
            t = stage.traffic[name]
            ratio = f"{float(t.elements / stage.floor.elements):.3f}" if stage.floor.elements else "-"
            out.append(f"| {name} | {_count(t.elements)} | {ratio} | {format_gb(t.bytes, unit)} |")
    if sizing.layout.tp > 1:
        out.append(
            "| of which DMuon's TP exchange (both modes, on the TP group) | "
            f"{_count(stage.tp_exchange.elements)} "
            f"| | {format_gb(stage.tp_exchange.bytes, unit)} |"
        )
    out.append("")
    if stage.local_expert_numel:
        out.append(
            "Routed experts kept where FSDP2 / expert parallelism holds them "
            f"({_count(stage.local_expert_numel)} "
            "elements in this stage): each rank updates its own; they move what they move under FSDP2 + AdamW. "
        )
    out.append("FSDP2's traffic for the other weights (embeddings, norms, head) is the same in every row.")
    return out


def _newton_schulz_lines(sizing: Sizing, tflops: float) -> list[str]:
    rate = tflops * 1e12
    largest = max(s.largest_ns for s in sizing.stages)
    mean = sizing.ns_mean
    return [
        "",
        "Newton–Schulz per step (ns_method 'torch', 5 steps; owners from build_plan"
        + (", per pipeline stage" if sizing.layout.pp > 1 else "")
        + "):",
        "",
        f"- busiest rank {_flop(sizing.ns_max)}, mean {_flop(mean)}, max/mean "
        f"{sizing.ns_max / mean if mean else 1.0:.3f}",
        f"- critical path at {tflops:g} TFLOP/s: {_ms(sizing.ns_max / rate)} (the busiest rank); floor "
        f"{_ms(largest / rate)} (the largest job one rank runs whole, {_flop(largest)}: "
        "no one-owner plan goes below it; owner groups can)",
        "- FSDP2 + AdamW runs none; naive FSDP2 + Muon runs every matrix on every rank",
    ]
