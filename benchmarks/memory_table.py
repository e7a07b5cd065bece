"""Memory per rank, measured: DMuon (Z2, Z3, HSDP) next to FSDP2 + AdamW with the same reshard setting.

    python benchmarks/memory_table.py [--dim 256] [--layers 4] [--steps 3] [--seq 64] [--no-hsdp]
                                      [--only z2 z3 hsdp] [--gloo]
    python benchmarks/memory_table.py --moe [--steps 3] [--seq 64]   # TorchTitan's qwen3 moe_debug

The toy transformer (titan_dmuon/toy_model.py) with TorchTitan's mixed
precision (bf16 compute, fp32 master weights and gradient reduction) trains
on 2 ranks for FSDP (Z2, Z3) and 4 ranks as 2 x 2 for HSDP.

Per rank, from the CPU allocator's events (the profiler's memory events, the
method of tests/support/helpers.py: ``allocation_peak``), over the whole life of the
model (built, sharded/dedicated, trained):

* persistent: bytes alive after the last optimizer step, before the next
  ``zero_grad`` (TorchTitan zeroes the gradients at the start of a step, so
  the gradients are alive between steps). Broken down by storage (each
  storage counted once): parameters (FSDP2's local shards, DMuon owners' full
  fp32 weights), gradients, optimizer state (momentum; AdamW's exp_avg,
  exp_avg_sq, step), DMuon's packed buffers (Z2/Z3: the first layer's buffer,
  whose broadcast for the next forward is issued at the end of the step), and
  "other": anything else the run allocated that is still alive (0 here);
* forward+backward peak: the high-water mark of one steady-state
  forward+backward (gradients set to None before, as TorchTitan does) above
  what was alive when it started;
* optimizer-step peak: the same for ``opt.step()`` (DMuon: Newton–Schulz on
  the owner, the AdamW part, the first unit's broadcast; FSDP2 + AdamW:
  torch.optim.AdamW's foreach temporaries);
* high-water: the most bytes alive at any moment of the measured step
  (persistent state minus gradients + forward/backward peak, or persistent +
  optimizer-step peak, whichever is higher): what the rank needs.

By default every rank is simulated one after the other on the fake process
group (collectives do nothing; every allocation is the same as on real
ranks, and all of them happen on the main thread). On real gloo ranks
(``--gloo``) the profiler misses every free that happens on one of gloo's
threads (a collective's tensor whose last reference the gloo worker drops),
so the figures there come out 0-1.4 MB too high at random.

Every figure is the maximum over ranks (owners differ per rank: the rank that
holds the larger share of the dedicated weights), with the mean over ranks
in brackets where it differs.

``--moe`` also gives each rank's resident peak: the process's peak RSS after the
last step (what TorchTitan's ``memory:`` figure shows on a CPU), each rank run
again without the profiler in a fresh process, so it also counts what the C
allocator keeps after frees.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import multiprocessing
import os
import resource
import sys
import time
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from tests.support.helpers import baseline, batches, distribute, local_slice, make_mesh, toy_model  # noqa: E402
from tests.support.pool import WorkerPool  # noqa: E402
from titan_dmuon.testing.toy_model import loss_fn, muon_targets  # noqa: E402

# (label, world, how to build, FSDP2 baseline it is compared with)
ROWS = [
    ("FSDP2 + AdamW, Z2 (reshard_after_forward=False)", 2, ("fsdp_adamw", "z2"), None),
    ("DMuon-Z2", 2, ("dmuon", "z2"), "FSDP2 + AdamW, Z2 (reshard_after_forward=False)"),
    ("FSDP2 + AdamW, Z3 (reshard_after_forward=True)", 2, ("fsdp_adamw", "z3"), None),
    ("DMuon-Z3", 2, ("dmuon", "z3"), "FSDP2 + AdamW, Z3 (reshard_after_forward=True)"),
    ("FSDP2 + AdamW, HSDP 2 x 2 (reshard_after_forward=True)", 4, ("fsdp_adamw", "hsdp"), None),
    ("DMuon-Z3 on HSDP 2 x 2", 4, ("dmuon", "hsdp"), "FSDP2 + AdamW, HSDP 2 x 2 (reshard_after_forward=True)"),
]
PHASES = ("persistent", "fwd_bwd", "step", "high_water")


def _storages(tensors, seen: set) -> int:
    """Bytes of the storages behind ``tensors`` not counted yet (a DTensor counts its local shard)."""
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        if isinstance(t, DTensor):
            t = t._local_tensor
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def storage_breakdown(setup) -> dict[str, int]:
    """Bytes per rank of the parameters, gradients, optimizer state (each storage once) and DMuon's
    packed buffers alive now (also what ``tests/distributed/test_sizing_memory.py`` holds
    ``python -m titan_dmuon.sizing`` to)."""
    seen: set = set()
    params = list(setup.model.parameters())
    out = {
        "params": _storages(params, seen),
        "grads": _storages([p.grad for p in params], seen),
        "opt_state": _storages([v for state in _opt_states(setup.opt) for v in state.values()], seen),
        "dmuon_buffers": setup.handle.buffer_bytes if setup.handle is not None else 0,
    }
    return out


def _opt_states(opt):
    for o in getattr(opt, "opts", [opt]):
        yield from o.state.values()


def _timeline(prof) -> tuple[list[tuple[int, int]], dict[str, tuple[int, int]]]:
    """CPU memory events (time, bytes) and the ``bench::*`` ranges (start, end), from one profile."""
    memory, ranges = [], {}
    for e in prof.profiler.kineto_results.events():
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU:
            memory.append((e.start_ns(), e.nbytes()))
        elif e.name().startswith("bench::"):
            ranges[e.name()[len("bench::") :]] = (e.start_ns(), e.start_ns() + e.duration_ns())
    memory.sort()
    return memory, ranges


def _live_and_peak(memory, start: int, end: int) -> tuple[int, int, int]:
    """Bytes alive at ``start`` and at ``end`` (counted from the profile's start), and the peak in between."""
    now, at_start, peak = 0, None, None
    for t, nbytes in memory:
        if t >= start and at_start is None:
            at_start = peak = now
        if t > end:
            break
        now += nbytes
        if at_start is not None:
            peak = max(peak, now)
    if at_start is None:
        at_start = peak = now
    return at_start, now, peak


def _measure(rank: int, world: int, build: tuple[str, str], dims: dict, steps: int, seq: int) -> dict:
    kind, mode = build
    gc.collect()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    data = batches(steps, global_batch=2 * world, seq=seq, vocab=dims["vocab_size"])
    holder = {}

    def one_step(setup, batch, last: bool) -> None:
        x, y = local_slice(batch, rank, world)
        if last:
            gc.collect()  # the measured step starts without cyclic garbage of earlier steps
        setup.opt.zero_grad()  # set_to_none, at the start of the step as TorchTitan does
        with record_function("bench::fwd_bwd" if last else "bench::warmup"):
            loss_fn(setup.module(x), y).backward()
        with record_function("bench::step" if last else "bench::warmup_step"):
            setup.opt.step()

    # TorchTitan disables Python's automatic GC and collects every gc_freq steps; do the same so
    # tensors in reference cycles are freed at fixed points, not whenever the collector happens to run
    gc.disable()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = toy_model(**dims)
        if kind == "dmuon":
            setup = distribute(model, mode, world, mp_policy=policy)
        else:
            setup = baseline(
                model,
                kind,
                world,
                mesh=make_mesh("hsdp" if mode == "hsdp" else "z3", world),
                reshard=mode != "z2",
                mp_policy=policy,
            )
        del model
        holder["setup"] = setup
        for i, batch in enumerate(data):
            one_step(setup, batch, last=i == len(data) - 1)
        # let asynchronous frees land (gloo work objects release their tensors when they are
        # collected) before reading what is alive
        dist.barrier()
        gc.collect()
        time.sleep(0.2)
        with record_function("bench::end"):
            pass
        breakdown = storage_breakdown(setup)
    gc.enable()
    memory, ranges = _timeline(prof)
    _, persistent, _ = _live_and_peak(memory, 0, ranges["end"][0])
    fb_start, _, fb_peak = _live_and_peak(memory, *ranges["fwd_bwd"])
    st_start, _, st_peak = _live_and_peak(memory, *ranges["step"])
    p_m = sum(p.numel() for p in muon_targets(toy_model(**dims)))
    result = {
        "persistent": persistent,
        "fwd_bwd": fb_peak - fb_start,
        "step": st_peak - st_start,
        **breakdown,
        "p_m": p_m,
        "high_water": max(fb_peak, st_peak),
    }
    result["other"] = persistent - sum(breakdown.values())
    del holder, setup
    gc.collect()
    return result


def _measure_moe(rank: int, world: int, optimizer: str, steps: int, seq: int) -> dict:
    """The same phases for TorchTitan's qwen3 ``moe_debug`` model (64 experts of [768, 256] in 8
    layers), built and trained as TorchTitan's trainer does (tests/support/titan_harness.py), with TorchTitan's
    AdamW container or DMuon's, local batch 2 x ``seq``."""
    import torchtitan.models.qwen3 as qwen3

    from tests.support import titan_harness as th

    spec = qwen3.model_registry("debugmodel_moe")
    gc.disable()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model, container = th.build((spec.model, spec), th.parallel_dims(world), optimizer=optimizer, lr=0.02)
        _moe_steps(rank, world, model, container, steps, seq, record_function)
        gc.collect()
        with record_function("bench::end"):
            pass
        seen: set = set()
        params = list(model.parameters())
        handles = (
            [h for o in container.dmuon_optimizers() for h in o.dedicated_handles()] if optimizer == "dmuon" else []
        )
        breakdown = {
            "params": _storages(params, seen),
            "grads": _storages([p.grad for p in params], seen),
            "opt_state": _storages(
                [v for o in container.optimizers for st in o.state.values() for v in st.values()], seen
            ),
            "dmuon_buffers": sum(h.buffer_bytes for h in handles),
        }
    gc.enable()
    memory, ranges = _timeline(prof)
    _, persistent, _ = _live_and_peak(memory, 0, ranges["end"][0])
    fb_start, _, fb_peak = _live_and_peak(memory, *ranges["fwd_bwd"])
    st_start, _, st_peak = _live_and_peak(memory, *ranges["step"])
    result = {
        "persistent": persistent,
        "fwd_bwd": fb_peak - fb_start,
        "step": st_peak - st_start,
        **breakdown,
        "p_m": 0,
        "high_water": max(fb_peak, st_peak),
    }
    result["other"] = persistent - sum(breakdown.values())
    del model, container
    gc.collect()
    return result


def _moe_steps(rank: int, world: int, model, container, steps: int, seq: int, mark) -> None:
    """``steps`` training steps of the moe_debug job on this rank's slice of a global batch of 2 x world
    sequences; ``mark(name)`` wraps the phases (the last step's "bench::fwd_bwd" and "bench::step")."""
    data = [
        torch.randint(0, 2048, (2 * world, seq + 1), generator=torch.Generator().manual_seed(i)) for i in range(steps)
    ]
    for i, tokens in enumerate(data):
        last = i == len(data) - 1
        if last:
            gc.collect()
        container.zero_grad()
        b = tokens.shape[0] // world
        local = tokens[rank * b : (rank + 1) * b]
        with mark("bench::fwd_bwd" if last else "bench::warmup"):
            logits = model(local[:, :-1])
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), local[:, 1:].flatten(), reduction="sum"
            )
            (loss / tokens[:, 1:].numel()).backward()
            del logits, loss
        with mark("bench::step" if last else "bench::warmup_step"):
            container.step()


def _resident_moe(rank: int, world: int, optimizer: str, steps: int, seq: int) -> int:
    """Peak RSS (bytes) of one rank of the moe_debug job after ``steps`` steps: run in a fresh process
    (``_in_fresh_process``) on the fake process group, without the profiler."""
    import torchtitan.models.qwen3 as qwen3
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tests.support import titan_harness as th

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        spec = qwen3.model_registry("debugmodel_moe")
        model, container = th.build((spec.model, spec), th.parallel_dims(world), optimizer=optimizer, lr=0.02)
        _moe_steps(rank, world, model, container, steps, seq, lambda name: contextlib.nullcontext())
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (KiB on Linux)
    finally:
        dist.destroy_process_group()


def _in_fresh_process(fn, *args):
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def on_fake_pg(rank: int, world: int, build, dims: dict, steps: int, seq: int, measure=None) -> dict:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        if measure is not None:
            return measure(rank, world, build, steps, seq)
        return _measure(rank, world, build, dims, steps, seq)
    finally:
        dist.destroy_process_group()


def _mb(x: float) -> str:
    return f"{x / 1e6:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="steps per configuration; the last one is measured")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--no-hsdp", action="store_true", help="skip the 4-rank HSDP rows")
    parser.add_argument(
        "--gloo",
        action="store_true",
        help="run on real gloo ranks instead (frees on gloo's threads are invisible to the profiler: noisy)",
    )
    parser.add_argument(
        "--only", choices=["z2", "z3", "hsdp"], nargs="+", help="only these modes (with their baselines)"
    )
    parser.add_argument(
        "--moe",
        action="store_true",
        help="TorchTitan's qwen3 moe_debug model instead (2 ranks, FSDP2 + AdamW vs DMuon-Z3; --seq applies)",
    )
    args = parser.parse_args()
    if args.moe:
        return _moe_table(args)
    dims = dict(dim=args.dim, n_layers=args.layers, n_heads=8, n_kv_heads=4, hidden_dim=3 * args.dim, vocab_size=1024)
    rows = [r for r in ROWS if not (args.no_hsdp and r[1] == 4) and (not args.only or r[2][1] in args.only)]
    results: dict[str, list[dict]] = {}
    if args.gloo:
        for world in sorted({r[1] for r in rows}):
            pool = WorkerPool(world)
            try:
                for label, w, build, _ in rows:
                    if w == world:
                        print(f"measuring {label} on {world} gloo ranks ...", flush=True)
                        results[label] = pool.run(_measure, build, dims, args.steps, args.seq, timeout=900)
            finally:
                pool.close()
    else:
        for label, world, build, _ in rows:
            print(f"measuring {label}: {world} ranks simulated one by one on the fake process group ...", flush=True)
            results[label] = [on_fake_pg(rank, world, build, dims, args.steps, args.seq) for rank in range(world)]

    p_m = next(iter(results.values()))[0]["p_m"]
    title = (
        f"toy transformer dim {args.dim}, {args.layers} layers, hidden {3 * args.dim}, vocab 1024 "
        f"(P_M = {p_m / 1e6:.3f}M Muon-target elements = {4 * p_m / 1e6:.2f} MB in fp32), bf16 compute / fp32 reduce, "
        f"local batch 2 x seq {args.seq}; MB = 1e6 bytes per rank, max over ranks (mean in brackets)"
    )
    keys = ["params", "grads", "opt_state", "dmuon_buffers", "other", "persistent", "fwd_bwd", "step", "high_water"]
    header = (
        "| configuration | ranks | params | grads | optimizer state | DMuon buffers | other | **persistent** "
        "| vs FSDP2 | fwd+bwd peak | vs FSDP2 | optimizer-step peak | vs FSDP2 | **high-water** | vs FSDP2 |"
    )
    lines = [title, "", header, "|---" * 15 + "|"]
    for label, world, _, base_label in rows:
        per_rank = results[label]
        cell = {k: (max(r[k] for r in per_rank), sum(r[k] for r in per_rank) / len(per_rank)) for k in keys}
        base = None
        if base_label is not None:
            b = results[base_label]
            base = {k: max(r[k] for r in b) for k in PHASES}

        def ratio(k):
            return f"{cell[k][0] / base[k]:.2f}" if base else "1.00"

        def fmt(k):
            hi, mean = cell[k]
            return _mb(hi) if hi == mean else f"{_mb(hi)} ({_mb(mean)})"

        name = f"**{label}**" if label.startswith("DMuon") else label
        lines.append(
            f"| {name} | {world} | {fmt('params')} | {fmt('grads')} | {fmt('opt_state')} | {fmt('dmuon_buffers')} "
            f"| {fmt('other')} | **{fmt('persistent')}** | {ratio('persistent')} "
            f"| {fmt('fwd_bwd')} | {ratio('fwd_bwd')} "
            f"| {fmt('step')} | {ratio('step')} | **{fmt('high_water')}** | {ratio('high_water')} |"
        )
    print("\n".join(lines))


def _moe_table(args) -> None:
    results = {}
    for label, optimizer in (("FSDP2 + AdamW (TorchTitan's container)", "AdamW"), ("DMuon-Z3", "dmuon")):
        print(
            f"measuring {label} on qwen3 moe_debug: 2 ranks simulated one by one on the fake process group ...",
            flush=True,
        )
        results[label] = [
            on_fake_pg(rank, 2, optimizer, {}, args.steps, args.seq, measure=_measure_moe) for rank in range(2)
        ]
        for rank, result in enumerate(results[label]):
            result["resident"] = _in_fresh_process(_resident_moe, rank, 2, optimizer, args.steps, args.seq)
    keys = [
        "params",
        "grads",
        "opt_state",
        "dmuon_buffers",
        "other",
        "persistent",
        "fwd_bwd",
        "step",
        "high_water",
        "resident",
    ]
    base = {k: max(r[k] for r in results["FSDP2 + AdamW (TorchTitan's container)"]) for k in (*PHASES, "resident")}
    print(
        f"TorchTitan qwen3 moe_debug (316M parameters; 64 experts of [768, 256] in 8 layers), 2 ranks, local batch "
        f"2 x seq {args.seq}, bf16 compute / fp32 reduce; MB = 1e6 bytes per rank, max over ranks\n"
    )
    print(
        "| configuration | params | grads | optimizer state | DMuon buffers | other | **persistent** | vs AdamW "
        "| fwd+bwd peak | vs AdamW | optimizer-step peak | vs AdamW | **high-water** | vs AdamW "
        "| resident peak (RSS) | vs AdamW |"
    )
    print("|---" * 16 + "|")
    for label, per_rank in results.items():
        cell = {k: max(r[k] for r in per_rank) for k in keys}
        ratio = {k: f"{cell[k] / base[k]:.{3 if k == 'resident' else 2}f}" for k in (*PHASES, "resident")}
        print(
            f"| {label} | {_mb(cell['params'])} | {_mb(cell['grads'])} | {_mb(cell['opt_state'])} | "
            f"{_mb(cell['dmuon_buffers'])} | {_mb(cell['other'])} | **{_mb(cell['persistent'])}** "
            f"| {ratio['persistent']} "
            f"| {_mb(cell['fwd_bwd'])} | {ratio['fwd_bwd']} | {_mb(cell['step'])} | {ratio['step']} "
            f"| **{_mb(cell['high_water'])}** | {ratio['high_water']} | {cell['resident'] / 2**30:.2f} GiB "
            f"| {ratio['resident']} |"
        )


if __name__ == "__main__":
    main()
