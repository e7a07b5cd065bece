"""A sizing as the text ``python -m titan_dmuon.sizing`` prints: memory and traffic tables, Newton–Schulz
per rank, the recommendation.
"""

from __future__ import annotations

from titan_dmuon.sizing.plans import groups_formed, kept_whole
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


def render(sizing: Sizing, *, title: str) -> str:
    """The report ``python -m titan_dmuon.sizing`` prints."""
    return "\n".join(
        [
            *_header(sizing, title),
            *_memory_table(sizing),
            *_traffic_table(sizing),
            *_newton_schulz_lines(sizing),
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
        + "; activations not included"
        + ("; DMuon on the plan with owner groups, that runs: a member keeps its block" if sizing.grouped else "")
        + ")",
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
    if sizing.grouped:
        rows.append(
            ("owner groups' step temporaries (their Gram workspace, in the step only)", lambda m: m.group_temporaries)
        )
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
    if stage.runs.grouped:
        groups = stage.runs.group_traffic
        out.append(
            "| of which owner groups' Gram all-reduces (both modes; fp32; the mean over the ranks) | "
            f"{_count(groups.elements)} | | {format_gb(groups.bytes, unit)} |"
        )
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


def _summed(rows) -> dict:
    """{row without its last item: the last items summed}, in first-seen order (counts over the stages)."""
    out: dict = {}
    for *key, n in rows:
        key = key[0] if len(key) == 1 else tuple(key)
        out[key] = out.get(key, 0) + n
    return out


def _newton_schulz_lines(sizing: Sizing) -> list[str]:
    """The step's Newton–Schulz on the one-owner plan and, beside it, on the plan with owner groups."""
    options = sizing.groups
    columns = ["one_owner", "runs"] if sizing.grouped else ["runs"]
    heads = {"one_owner": "one owner per weight", "runs": "owner groups (the plan that runs)"}
    if not sizing.grouped:
        heads["runs"] = "one owner per weight (the plan that runs)"
    rate = options.flops_per_second()

    def cells(get) -> str:
        return " | ".join(get(sizing.figures(c)) for c in columns)

    def flops(figures) -> str:
        load = [f for x in figures for f in x.ns_per_rank]
        mean = sum(load) / len(load)
        return f"{_flop(max(load))}; {_flop(mean)}; {max(load) / mean if mean else 1.0:.3f}"

    def largest(figures) -> str:
        most = max(x.largest_ns for x in figures)
        return f"{_ms(most / rate)} ({_flop(most)})"

    def peaks(figures) -> str:
        return " / ".join(format_gb(max(x.memory[c].peak for x in figures)) for c in ("DMuon-Z2", "DMuon-Z3"))

    out = [
        "",
        "Newton–Schulz per step (ns_method 'torch', 5 steps; plans from build_plan"
        + (", per pipeline stage" if sizing.layout.pp > 1 else "")
        + f"; {options.describe() if options.enabled else f'at {options.ns_tflops:g} TFLOP/s, owner groups off'}):",
        "",
        "| | " + " | ".join(heads[c] for c in columns) + " |",
        "|---" * (len(columns) + 1) + "|",
        f"| busiest rank, the critical path: its FLOPs at {options.ns_tflops:g} TFLOP/s + its groups' all-reduces | "
        + cells(lambda fs: _ms(max(t for x in fs for t in x.ns_seconds)))
        + " |",
        "| its FLOPs; the mean; max/mean | " + cells(flops) + " |",
        "| the largest job one rank runs whole (no rank runs less: the plan's floor) | " + cells(largest) + " |",
    ]
    if sizing.grouped:
        runs = sizing.figures("runs")
        mean = sum(x.group_traffic.elements for x in runs) / len(runs)
        busiest = max(runs, key=lambda x: x.group_traffic_max.elements).group_traffic_max
        sizes = _summed((k, n) for x in runs for _, k, n in groups_formed(x.plan))
        out += [
            "| owner groups: weights x ranks | – | "
            + ", ".join(f"{n} x {k}" for k, n in sorted(sizes.items(), key=lambda kn: -kn[0]))
            + " |",
            "| their Gram all-reduces per rank per step, fp32: the mean; the busiest member | – | "
            f"{_count(mean)} elements, {format_gb(mean * 4)}; {_count(busiest.elements)}, "
            f"{format_gb(busiest.bytes)} |",
            "| their step temporaries (Gram workspace; the largest rank, in the step only) | – | "
            + format_gb(max(x.memory["DMuon-Z3"].group_temporaries for x in runs))
            + " |",
        ]
    out += [
        "| DMuon-Z2 / DMuon-Z3 peak without activations | " + cells(peaks) + " |",
        "",
    ]
    for (name, k), n in _summed(g for x in sizing.figures("runs") for g in groups_formed(x.plan)).items():
        out.append(f"- in owner groups of {k} ranks: {name} ({n} weights)")
    if options.enabled:
        kept: dict[str, dict[str, int]] = {}
        for (name, why), n in _summed(g for x in sizing.figures("runs") for g in kept_whole(x.plan)).items():
            kept.setdefault(why, {})[name] = kept.get(why, {}).get(name, 0) + n
        for why, names in kept.items():
            out.append(f"- one owner whatever the cost ({why}): {', '.join(names)} ({sum(names.values())} weights)")
    floor = max(x.largest_ns for x in sizing.figures("one_owner"))
    busiest = sizing.ns_seconds_max("runs")
    if not options.enabled:
        verdict = "owner groups are off (--no-owner-groups)"
    elif sizing.grouped:
        verdict = f"owner groups take the busiest rank from {_ms(sizing.ns_seconds_max('one_owner'))} to {_ms(busiest)}"
        verdict += ", below that floor" if busiest < floor / rate else ""
    elif not any(e.may_group for x in sizing.figures("runs") for e in x.plan.entries):
        verdict = "owner groups form none here: no weight may take one (above)"
    else:
        verdict = (
            "owner groups form none here: no sizing shortens the busiest rank by more than "
            f"{options.min_gain:.0%} at these figures"
        )
    out += [
        f"- the one-matrix floor: no one-owner plan goes below the largest weight's Newton–Schulz, "
        f"{_ms(floor / rate)} ({_flop(floor)}); {verdict}",
        "- FSDP2 + AdamW runs none; naive FSDP2 + Muon runs every matrix on every rank",
    ]
    return out
