"""The command line of ``python -m titan_dmuon.sizing``: size a job from a shape table, TorchTitan's model
on the meta device or a TOML config, and print the tables."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

from titan_dmuon import sizing as sizing_package
from titan_dmuon.plan.owner_groups import H200_BF16_TFLOPS, GroupOptions  # (NS runs below it: lower bounds)
from titan_dmuon.sizing.figures import size_job
from titan_dmuon.sizing.records import DTYPE_BYTES, Layout, Precision
from titan_dmuon.sizing.render import render


# ---- the command -----------------------------------------------------------------------------------------
def _layout(args, job_layout: Layout | None) -> Layout:
    given = {k: getattr(args, k) for k in ("replicate", "shard", "tp", "pp", "ep") if getattr(args, k) is not None}
    base = job_layout or Layout()
    values = {k: given.get(k, getattr(base, k)) for k in ("replicate", "shard", "tp", "pp", "ep")}
    if args.world is not None and "shard" not in given:
        rest = values["replicate"] * values["tp"] * values["pp"]
        if args.world % rest:
            raise SystemExit(f"--world {args.world} is not a multiple of replicate x tp x pp = {rest}")
        values["shard"] = args.world // rest
    layout = Layout(**values)
    if args.world is not None and layout.world != args.world:
        raise SystemExit(f"--world {args.world} but replicate x shard x tp x pp = {layout.world}")
    return layout


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m titan_dmuon.sizing", description=sizing_package.__doc__.split("\n\n")[0]
    )
    source = parser.add_argument_group("the model (one of)")
    source.add_argument("--model", help="TorchTitan model name: llama3, deepseek_v3, qwen3, kimi_k2_7")
    source.add_argument(
        "--flavor", help="its flavor in TorchTitan's model registry, e.g. 8B, 70B, 405B, 671B, debugmodel"
    )
    source.add_argument(
        "--config",
        metavar="FILE.toml",
        help="a TOML job (its model, muon_params, degrees and dtypes); other --section.key value "
        "arguments override it as with run_train.sh",
    )
    source.add_argument(
        "--source",
        choices=("auto", "table", "torchtitan"),
        default="auto",
        help="--model's weights from the shape tables (no TorchTitan needed) or TorchTitan's model on "
        "the meta device; auto: the table where there is one",
    )
    layout = parser.add_argument_group("the layout (a --config's [parallelism] unless given)")
    layout.add_argument("--world", type=int, help="ranks in all; the shard degree is what the others leave")
    for name, help_text in (
        ("replicate", "data-parallel replicas R (HSDP; with --shard 1: DDP)"),
        ("shard", "data-parallel shard ranks N"),
        ("tp", "tensor-parallel degree"),
        ("pp", "pipeline stages"),
        ("ep", "expert-parallel degree (inside shard x tp)"),
    ):
        layout.add_argument(f"--{name}", type=int, help=help_text)
    figures = parser.add_argument_group("figures")
    figures.add_argument(
        "--tflops",
        type=float,
        default=None,
        help="Newton–Schulz TFLOP/s per rank for the critical path and the owner groups' cost model "
        f"(default: the H200's bf16 matmul peak, {H200_BF16_TFLOPS:g}, so the times are lower bounds)",
    )
    figures.add_argument(
        "--owner-groups",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="plan owner groups as the runtime does by default (a --config's optimizer.owner_groups; "
        "default on), priced at an H200's stated figures",
    )
    figures.add_argument(
        "--node-size", type=int, default=None, help="ranks per node for owner groups (default 8; a --config's)"
    )
    figures.add_argument(
        "--device-memory", type=float, default=80.0, help="GB per rank for the recommendation (default 80)"
    )
    figures.add_argument(
        "--activation-share",
        type=float,
        default=0.5,
        help="share of --device-memory left to activations when deciding Z2/Z3 (default 0.5)",
    )
    figures.add_argument(
        "--param-dtype", default=None, help="master weights, gradients, optimizer state (default fp32)"
    )
    figures.add_argument(
        "--compute-dtype",
        default=None,
        help="forward/backward weights (default bf16; a --config's training.mixed_precision_param)",
    )
    figures.add_argument(
        "--reduce-dtype",
        default=None,
        help="gradient reduction (default fp32; a --config's training.mixed_precision_reduce)",
    )
    args, overrides = parser.parse_known_args(argv)
    if overrides and not args.config:
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    from titan_dmuon.sizing import model_shapes

    job_layout, compute_dtype, reduce_dtype = None, "bfloat16", "float32"
    groups, keep_whole = GroupOptions(), ()
    if args.config:
        job = model_shapes.from_toml(args.config, overrides, world_size=args.world)
        weights, title = job.weights, job.description
        job_layout, compute_dtype, reduce_dtype = job.layout, job.compute_dtype, job.reduce_dtype
        groups, keep_whole = job.owner_groups or GroupOptions(enabled=False), job.keep_whole
    elif args.model and args.flavor:
        tabled = model_shapes.table_key(args.model, args.flavor) is not None
        use_table = args.source == "table" or (args.source == "auto" and tabled)
        if use_table:
            if not tabled:
                parser.error(
                    f"no shape table for {args.model} {args.flavor}; tables: "
                    + ", ".join(f"{n} {f}" for n, f in model_shapes.SHAPE_TABLES)
                )
            weights = model_shapes.from_table(args.model, args.flavor)
            title = f"{args.model} {args.flavor} (shape table)"
        else:
            weights = model_shapes.registry_weights(args.model, args.flavor)
            title = f"{args.model} {args.flavor} (TorchTitan's model registry, meta device)"
    else:
        parser.error("give --model and --flavor, or --config")
    if job_layout is None and args.world is None and args.shard is None:
        parser.error("give the layout: --world, or --shard (with --replicate, --tp, --pp, --ep as needed)")
    precision = Precision(
        param=DTYPE_BYTES[args.param_dtype or "float32"],
        compute=DTYPE_BYTES[args.compute_dtype or compute_dtype],
        reduce=DTYPE_BYTES[args.reduce_dtype or reduce_dtype],
    )
    chosen = {"enabled": args.owner_groups, "node_size": args.node_size, "ns_tflops": args.tflops}
    groups = dataclasses.replace(groups, **{k: v for k, v in chosen.items() if v is not None})
    sizing = size_job(
        weights,
        _layout(args, job_layout),
        precision=precision,
        device_memory=args.device_memory * 1e9,
        activation_share=args.activation_share,
        groups=groups,
        keep_whole=keep_whole,
    )
    print(render(sizing, title=title))
