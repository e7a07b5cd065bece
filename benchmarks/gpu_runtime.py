"""benchmarks/gpu_check.py's checks of DMuon's runtime itself, on one device.

    python3 benchmarks/gpu_runtime.py launch race profile fsdp_step [--device cuda] [--tiny]
    TORCH_CUDA_SANITIZER=1 python3 benchmarks/gpu_runtime.py fake_pg [--device cuda]

Each check takes a device and returns table rows ``(check, what, result, detail)``;
``result`` is "pass", "FAIL: ..." / "FAILED: ..." (an error), "skipped (cpu): ..."
or a number. On the CPU they run with tiny sizes (the tests do that) and skip
what only a GPU can show (streams, sleeps, the sanitizer, kernels). Run as a
script, each finished check prints its rows as one line ``GPU_CHECK_ROWS <json>``
(so rows of checks that finished survive a later hang or crash).

(1) ``launch``: one coalesced broadcast + reduce Launch on a real 1-rank NCCL
    group, DMuon's size-1 shortcut bypassed (group size passed as 2), behind a
    ``torch.cuda._sleep`` on the issuing side stream: one launch counted, the host
    not blocked, the compute stream waits, values right, no host sync.
(2) ``fake_pg``: the whole runtime on CUDA tensors, rank 0 of world 4 (Z3, Z2),
    2 x 2 (HSDP) and world 1 on the fake process group, under
    ``TORCH_CUDA_SANITIZER=1``; FSDP2 + AdamW as a control; memory flat after step 2.
(3) ``race``: world 1 on real NCCL, sleeps at the start of every side-stream block
    and before every buffer free: the final weights must be bitwise those of the run
    without sleeps, with the shortcut bypassed (collectives issued) and without it
    (world 1 as TorchTitan's NGPU=1 runs it).
(5) ``profile``: one profiled steady-state step, DMuon-Z3 and FSDP2-Z3 + AdamW (world 1,
    shortcut bypassed): host time in the hooks, CUDA kernels per layer, compute-stream idle.
(7) ``fsdp_step``: FSDP2 + DMuon-Z3 set up from plain PyTorch on a 1-rank NCCL group: fp32
    weights against the single-process torch.optim.Muon + AdamW reference; with bf16 mixed
    precision its step time, peak memory and host syncs beside FSDP2 + AdamW's.

Only the TorchTitan-free core is used (titan_dmuon outside integration/, tests/support/helpers.py), so
this runs on torch 2.11 without TorchTitan (the GPU machine this project can be lent).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import itertools
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

ROW_PREFIX = "GPU_CHECK_ROWS "
SKIP_CPU = "skipped (cpu)"

# toy models (titan_dmuon.testing.toy_model.ToyConfig fields); CPU runs use the tiny ones
SIZES = {
    "fake_pg": dict(n_layers=3),
    "race": dict(vocab_size=256, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, hidden_dim=128),
    "profile": dict(vocab_size=2048, dim=256, n_layers=6, n_heads=16, n_kv_heads=8, hidden_dim=768),
}
TINY = dict(n_layers=3)
PROFILE_BATCH = {"cuda": (8, 256), "cpu": (2, 8)}  # (sequences, tokens each) per step


def first_line(error: BaseException) -> str:
    """The first line of an error, with its type (for a table cell)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:200]


def verdict(ok: bool, failure: str) -> str:
    return "pass" if ok else f"FAIL: {failure}"


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


# ---- process groups, the bypass, the sleeps ---------------------------------------------------------
@contextlib.contextmanager
def process_group(backend: str, world: int = 1):
    """This process as rank 0: a real group of one (nccl, gloo) or the fake backend at ``world``."""
    if backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    else:
        assert world == 1, "one process: a real process group has one rank"
        kwargs = {}
        if backend == "nccl":
            torch.cuda.set_device(0)
            kwargs["device_id"] = torch.device("cuda", 0)  # the communicator is made now, not at the first collective
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def bypass_size_one_shortcut():
    """Every ``Launch`` on a group of one is told the group has two ranks, so that it issues its
    collectives (on one real rank a broadcast or reduce is a copy or nothing) instead of returning
    early: world size 1 then runs the code path of larger worlds."""
    from titan_dmuon.runtime.comm import Launch

    original = Launch.__init__

    @functools.wraps(original)
    def init(self, group, group_size, *args, **kwargs):
        original(self, group, 2 if group_size == 1 else group_size, *args, **kwargs)

    Launch.__init__ = init
    try:
        yield
    finally:
        Launch.__init__ = original


def sleep_cycles(ms: float) -> int:
    """``torch.cuda._sleep`` cycles for about ``ms`` milliseconds on this GPU (measured)."""
    probe = 10_000_000
    torch.cuda._sleep(1000)  # (first launch)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return max(1000, int(probe * ms / max(start.elapsed_time(end), 1e-3)))


@contextlib.contextmanager
def sleeps_injected(cycles: int):
    """Race amplification: a ``torch.cuda._sleep`` queued at the start of every side-stream block
    (``Streams.use`` of a stream) and on the current stream before every buffer free (``Unit.free``).
    Yields the counts of sleeps queued. A missing wait then reads or reuses memory while the
    stream that should have gone first is still asleep."""
    from titan_dmuon.runtime.streams import Streams
    from titan_dmuon.runtime.unit import BufferState, Unit

    counts = {"side_stream_blocks": 0, "frees": 0}
    use, free = Streams.use, Unit.free

    @contextlib.contextmanager
    def asleep_first(inner):
        with inner:
            torch.cuda._sleep(cycles)
            counts["side_stream_blocks"] += 1
            yield

    def sleeping_use(self, stream):
        inner = use(self, stream)
        return inner if stream is None else asleep_first(inner)

    def sleeping_free(self):
        if self.state is not BufferState.FREE and self.buffer is not None and self.buffer.is_cuda:
            torch.cuda._sleep(cycles)
            counts["frees"] += 1
        return free(self)

    Streams.use, Unit.free = sleeping_use, sleeping_free
    try:
        yield counts
    finally:
        Streams.use, Unit.free = use, free


@contextlib.contextmanager
def deterministic(device: torch.device):
    """Run-to-run bitwise kernels on CUDA: deterministic algorithms (cuBLAS needs
    CUBLAS_WORKSPACE_CONFIG, set before its first use) and the math SDPA backend."""
    if device.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train(setup, data, device, world: int, *, after_step=None) -> torch.Tensor | None:
    """Rank 0's share of each global batch: forward, backward, step; no host sync. Returns the last
    loss as a tensor (only the last is kept: (2) checks that memory stays flat from step 2 on);
    data already on ``device`` is not copied."""
    from tests.support.helpers import local_slice
    from titan_dmuon.testing.toy_model import loss_fn

    last = None
    for i, batch in enumerate(data):
        x, y = (t.to(device) for t in local_slice(batch, 0, world))
        loss = loss_fn(setup.module(x), y)
        loss.backward()
        last = loss.detach()
        setup.opt.step()
        setup.opt.zero_grad()
        if after_step is not None:
            after_step(i)
    return last


def _setup(kind: str, mesh, world: int, device: torch.device, sizes: dict, *, mp_policy=None):
    """kind: a ``tests.support.helpers.distribute`` mode (z3, z2, hsdp) or "fsdp_adamw" (the baseline)."""
    from tests.support.helpers import baseline, distribute, toy_model

    model = toy_model(**sizes).to(device)
    if kind == "fsdp_adamw":
        return baseline(model, "fsdp_adamw", world, mesh=mesh, reshard=True, mp_policy=mp_policy)
    return distribute(model, kind, world, mesh=mesh, mp_policy=mp_policy)


def _mesh(device: torch.device, kind: str, world: int):
    from torch.distributed.device_mesh import init_device_mesh

    if kind == "hsdp":
        return init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    return init_device_mesh(device.type, (world,))


def _launches(handle) -> int:
    return sum(n for _, _, n in handle.pop_comm_stats().values()) if handle is not None else 0


# ---- (1) one coalesced Launch on a real NCCL group ------------------------------------------------------
def launch_check(device: torch.device, *, sleep_ms: float = 50.0, numel: int = 1 << 20) -> list[tuple]:
    """One Launch (a broadcast and a reduce) from a side stream on a real 1-rank group, the size-1
    shortcut bypassed, behind a sleep queued on that stream. On the CPU (gloo, world 1): one launch
    counted and the values; what needs streams is skipped."""
    from titan_dmuon.runtime.comm import CommStats, Launch
    from titan_dmuon.runtime.mode import coalesces

    cuda = device.type == "cuda"
    check = f"(1) one Launch (broadcast + reduce), 1-rank {backend_for(device)} group, shortcut bypassed"
    with process_group(backend_for(device)) as group:
        coalesce = coalesces(group, device)
        a = torch.full((numel,), 3.0, device=device)
        b = torch.full((numel // 4,), 5.0, device=device)
        stats = CommStats()

        def launch():
            with Launch(group, 2, device, "gpu_check.launch", stats, coalesce=coalesce) as issued:
                issued.broadcast(a, src=0)
                issued.reduce(b, dst=0)
            return issued

        launch().in_flight.wait()  # warm-up: NCCL sets up the communicator's work on its first collective
        _sync(device)
        stats.pop()
        side = torch.cuda.Stream(device, priority=-1) if cuda else None
        cycles = sleep_cycles(sleep_ms) if cuda else 0
        sync_error = None
        debug = torch.cuda.get_sync_debug_mode() if cuda else None
        try:
            if cuda:
                torch.cuda.set_sync_debug_mode("error")
            with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
                queued = time.perf_counter()
                if cuda:
                    torch.cuda._sleep(cycles)
                a.fill_(7.0)  # after the sleep, on the side stream
                b.fill_(11.0)
                t0 = time.perf_counter()
                issued = launch()
                t1 = time.perf_counter()
            before = torch.cuda.current_stream(device).record_event() if cuda else None
            t2 = time.perf_counter()
            works, event = len(issued.in_flight.works), issued.in_flight.event
            issued.in_flight.wait()
            t3 = time.perf_counter()
            after = torch.cuda.current_stream(device).record_event() if cuda else None
            c = a[: b.numel()] * b  # on the compute stream, after the wait: 77 only if it really waited
        except RuntimeError as e:
            if not (cuda and "synchroniz" in str(e)):
                raise
            sync_error = first_line(e)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(debug)
        if sync_error is not None:
            _sync(device)
            return [(check, "no host sync (sync debug 'error')", f"FAIL: {sync_error}", "the rest not measured")]
        if cuda:
            deadline = time.perf_counter() + 0.01
            while not before.query() and time.perf_counter() < deadline:
                pass
            compute_was_free = before.query()
            event_pending, after_pending = event is not None and not event.query(), not after.query()
            checked_at_ms = 1e3 * (time.perf_counter() - queued)
        _sync(device)
        counted = stats.pop().get("gpu_check.launch", (0, 0, 0))[2]
        values_ok = bool((a == 7).all() and (b == 11).all() and (c == 77).all())
    rows = [
        (
            check,
            "launches counted (CommStats)",
            verdict(counted == 1 and (coalesce or not cuda), f"{counted} launches, coalesced: {coalesce}"),
            f"1 broadcast + 1 reduce; coalesced: {coalesce}; waits on {works} work(s)"
            f"{' and one event on the issuing stream' if event is not None else ''}",
        ),
        (
            check,
            "values after synchronize",
            verdict(values_ok, "a, b or a*b wrong"),
            "broadcast 7, reduce 11 (one rank), and 7 * 11 computed on the compute stream after wait()",
        ),
    ]
    if not cuda:
        return rows + [
            (check, what, f"{SKIP_CPU}: gloo's wait() blocks the host; no streams", "")
            for what in ("host not blocked", "compute stream waits", "no host sync (sync debug 'error')")
        ]
    host_ms = 1e3 * ((t1 - t0) + (t3 - t2))
    in_time = checked_at_ms < 0.8 * sleep_ms
    rows += [
        (
            check,
            "host not blocked",
            verdict(host_ms < sleep_ms / 4, f"{host_ms:.1f} ms on the host"),
            f"Launch {1e3 * (t1 - t0):.2f} ms + wait() {1e3 * (t3 - t2):.2f} ms on the host; "
            f"side stream asleep {sleep_ms:.0f} ms",
        ),
        (
            check,
            "compute stream waits",
            verdict(
                in_time and compute_was_free and event_pending and after_pending,
                "checked too late"
                if not in_time
                else f"compute free before wait: {compute_was_free}, Launch event pending: {event_pending}, "
                f"event after wait() pending: {after_pending}",
            ),
            f"checked {checked_at_ms:.1f} ms into the {sleep_ms:.0f} ms sleep: an event before wait() completed, "
            "the Launch's event and one recorded after wait() on the compute stream did not",
        ),
        (check, "no host sync (sync debug 'error')", "pass", "Launch, wait() and the compute after it"),
    ]
    return rows


# ---- (2) the runtime on the fake process group, under the CUDA sanitizer ---------------------------------------
FAKE_PG_RUNS = (  # (label, kind, world)
    ("world 4, DMuon-Z3", "z3", 4),
    ("world 4, DMuon-Z2", "z2", 4),
    ("2 x 2 HSDP, DMuon-Z3", "hsdp", 4),
    ("world 1, DMuon-Z3 (size-1 shortcut: no collective)", "z3", 1),
    ("world 4, FSDP2-Z3 + AdamW (control)", "fsdp_adamw", 4),
)


def sanitizer_enabled() -> bool:
    module = sys.modules.get("torch.cuda._sanitizer")
    return bool(module is not None and module.cuda_sanitizer.enabled)


@contextlib.contextmanager
def sanitizer_reports():
    """The races the CUDA sanitizer finds while inside (a list; empty without the sanitizer). Kept
    here because the error it raises from autograd's device thread may reach the caller rewrapped."""
    found: list = []
    if not sanitizer_enabled():
        yield found
        return
    handler = sys.modules["torch.cuda._sanitizer"].cuda_sanitizer.dispatch.event_handler
    original = handler._handle_kernel_launch

    def recording(*args, **kwargs):
        errors = original(*args, **kwargs)
        found.extend(errors)
        return errors

    handler._handle_kernel_launch = recording
    try:
        yield found
    finally:
        handler._handle_kernel_launch = original


def fake_pg_check(device: torch.device, *, runs=FAKE_PG_RUNS, steps: int = 5, sizes: dict | None = None) -> list[tuple]:
    """Rank 0 of each world simulated on this device (the fake backend moves no data: values are
    not checked). On CUDA: under TORCH_CUDA_SANITIZER=1 an unsynchronised cross-stream access
    raises; memory_allocated at the end of steps 2.. must not change."""
    sizes = SIZES["fake_pg"] if sizes is None else sizes
    cuda = device.type == "cuda"
    sanitizer = sanitizer_enabled()
    rows = []
    for label, kind, world in runs:
        check = f"(2) fake PG, {label}"
        what = "sanitizer, memory after steps 2+" if cuda else "runs (cpu)"
        names: dict[int, str] = {}
        try:
            with sanitizer_reports() as races:
                memory = _fake_pg_run(device, kind, world, steps, sizes, names)
        except Exception as e:  # noqa: BLE001 - a table row, not a crash
            rows.append(
                (check, what, f"FAILED: {describe_race(e, names, races)}", f"sanitizer {'on' if sanitizer else 'off'}")
            )
            continue
        if not cuda:
            rows.append((check, what, "pass", f"{steps} steps on the CPU; {SKIP_CPU}: sanitizer and device memory"))
            continue
        flat = all(m == memory[1] for m in memory[1:])
        mib = ", ".join(f"{m / 2**20:.3f}" for m in memory)
        ok = flat and sanitizer
        rows.append(
            (
                check,
                what,
                verdict(ok, "memory grew" if not flat else "sanitizer was not on"),
                f"sanitizer {'on' if sanitizer else 'OFF'}; memory_allocated MiB after steps 1-{steps}: {mib}",
            )
        )
    return rows


def _fake_pg_run(device, kind, world, steps, sizes, names) -> list[int]:
    from tests.support.helpers import batches

    with process_group("fake", world):
        setup = _setup(kind, _mesh(device, kind, world), world, device, sizes)
        if device.type == "cuda":
            names[torch.cuda.current_stream(device).cuda_stream] = "compute"
            if setup.handle is not None:
                streams = setup.handle._ctx.streams
                for name in ("gather", "reduce", "replicate"):
                    names[getattr(streams, name).cuda_stream] = name
        memory = []
        data = batches(steps, global_batch=2 * world, vocab=sizes.get("vocab_size", 64))
        _train(
            setup,
            data,
            device,
            world,
            after_step=lambda i: memory.append(torch.cuda.memory_allocated(device) if device.type == "cuda" else 0),
        )
        _sync(device)
        if setup.handle is not None:
            setup.handle.remove()
        return memory


def describe_race(error: BaseException, names: dict[int, str], races=()) -> str:
    """A CUDA-sanitizer error in one line: the two kernels, their streams, and where each ran (in
    titan_dmuon or torch.distributed). ``races``: what the sanitizer reported, if the error lost it."""
    races = list(races) or getattr(error, "errors", None)
    if not races or not hasattr(races[0], "current_access"):
        return first_line(error)
    race = races[0]

    def access(a) -> str:
        stream = names.get(a.stream, f"stream {a.stream}")
        ours = [f for f in a.stack_trace if "titan_dmuon" in f.filename or "torch/distributed" in f.filename]
        where = f" ({os.path.basename(ours[-1].filename)}:{ours[-1].lineno} {ours[-1].name})" if ours else ""
        return f"{a.operator.name} {a.type} {'/'.join(a.aliases) or 'its output'} on {stream}{where}"

    return f"{len(races)} race(s); first: {access(race.current_access)} after {access(race.previous_access)}"[:300]


# ---- (3) race amplification at world 1 ------------------------------------------------------------------------
def race_check(
    device: torch.device, *, modes=("z3", "z2"), steps: int = 3, sleep_ms: float = 5.0, sizes: dict | None = None
) -> list[tuple]:
    """World 1 on a real group (NCCL; gloo on the CPU). With the size-1 shortcut bypassed every
    Launch issues its collectives; on CUDA, sleeps injected at every side-stream block and buffer
    free must leave the final weights bitwise unchanged (a determinism control run first), with
    and without the bypass. Bypass vs none: equal within TOLERANCE, and launches > 0 vs == 0."""
    from tests.support.helpers import TOLERANCE, bitwise_equal, max_diff

    sizes = SIZES["race"] if sizes is None else sizes
    cuda = device.type == "cuda"
    rows = []
    with process_group(backend_for(device)), deterministic(device):
        cycles = sleep_cycles(sleep_ms) if cuda else 0
        for mode in modes:
            check = f"(3) race amplification, DMuon-{mode.upper()}, world 1"
            try:
                with_bypass = _world1_run(device, mode, steps, sizes, bypass=True)
                without = _world1_run(device, mode, steps, sizes, bypass=False)
                plain, alone = with_bypass["state"], without["state"]
                launches, none_launched = with_bypass["launches"], without["launches"]
                diff = max_diff(plain, alone)
                rows.append(
                    (
                        check,
                        "bypass vs none: max |diff|",
                        verdict(
                            diff <= TOLERANCE and launches > 0 and none_launched == 0,
                            f"{diff:.2e}, launches {launches} vs {none_launched}",
                        ),
                        f"{diff:.2e} (tolerance {TOLERANCE}); {launches} launches with the bypass, "
                        f"{none_launched} without, {steps} steps",
                    )
                )
                if not cuda:
                    rows += [
                        (check, what, f"{SKIP_CPU}: no streams to race", "")
                        for what in ("sleeps vs none, bypass (bitwise)", "sleeps vs none, no bypass (bitwise)")
                    ]
                    continue
                for bypass, reference in ((True, plain), (False, alone)):
                    what = f"sleeps vs none, {'bypass' if bypass else 'no bypass (as NGPU=1 runs)'} (bitwise)"
                    control = _world1_run(device, mode, steps, sizes, bypass=bypass)["state"]
                    if not bitwise_equal(control, reference):
                        rows.append(
                            (
                                check,
                                what,
                                "INCONCLUSIVE: two runs without sleeps differ",
                                f"max |diff| {max_diff(control, reference):.2e}: nondeterministic kernels, or a "
                                "race that opens without sleeps",
                            )
                        )
                        continue
                    run = _world1_run(device, mode, steps, sizes, bypass=bypass, cycles=cycles)
                    slept, counts = run["state"], run["sleeps"]
                    same = bitwise_equal(slept, reference)
                    rows.append(
                        (
                            check,
                            what,
                            verdict(same, f"max |diff| {max_diff(slept, reference):.2e}"),
                            f"{counts['side_stream_blocks']} side-stream blocks and {counts['frees']} frees each "
                            f"began with a {sleep_ms:.0f} ms sleep; control run bitwise equal",
                        )
                    )
            except Exception as e:  # noqa: BLE001
                rows.append((check, "final weights", f"FAILED: {first_line(e)}", ""))
    return rows


def _world1_run(device, mode, steps, sizes, *, bypass: bool, cycles: int = 0) -> dict:
    """Train ``steps`` steps at world 1: the final parameters, DMuon's launches, the sleeps queued."""
    from tests.support.helpers import batches, full_state

    data = batches(steps, global_batch=8, seq=16, vocab=sizes.get("vocab_size", 64))
    launches, sleeps = 0, {"side_stream_blocks": 0, "frees": 0}
    with bypass_size_one_shortcut() if bypass else contextlib.nullcontext():
        setup = _setup(mode, _mesh(device, mode, 1), 1, device, sizes)

        def count(_):
            nonlocal launches
            launches += _launches(setup.handle)

        with sleeps_injected(cycles) if cycles else contextlib.nullcontext(sleeps) as sleeps:
            _train(setup, data, device, 1, after_step=count)
    _sync(device)
    state = full_state(setup)
    setup.handle.remove()
    return {"state": state, "launches": launches, "sleeps": sleeps}


# ---- (5) one profiled steady-state step -------------------------------------------------------------------------
def profile_check(device: torch.device, *, sizes: dict | None = None, warmup: int = 2) -> list[tuple]:
    """DMuon-Z3 and FSDP2-Z3 + AdamW at world 1 (shortcut bypassed; FSDP2 has its own size-1
    shortcut), one step under torch.profiler after ``warmup`` steps: host time in the hooks
    (DMuon::* and FSDP::* labels, overlaps merged per thread), CUDA kernels per layer, and the
    idle time of the compute stream between its first and last kernel of the step."""
    from tests.support.helpers import batches

    sizes = SIZES["profile"] if sizes is None else sizes
    cuda = device.type == "cuda"
    sequences, seq = PROFILE_BATCH[device.type]
    layers = sizes.get("n_layers", 2)
    rows = []
    with process_group(backend_for(device)), bypass_size_one_shortcut():
        for label, kind in (("DMuon-Z3", "z3"), ("FSDP2-Z3 + AdamW", "fsdp_adamw")):
            check = f"(5) profiled step, {label} (world 1, bypass)"
            try:
                setup = _setup(kind, _mesh(device, kind, 1), 1, device, sizes)
                data = batches(warmup + 1, global_batch=sequences, seq=seq, vocab=sizes.get("vocab_size", 64))
                _train(setup, data[:warmup], device, 1)
                _sync(device)
                summary = profiled_step(functools.partial(_train, setup, data[warmup:], device, 1), device)
                if setup.handle is not None:
                    setup.handle.remove()
            except Exception as e:  # noqa: BLE001
                rows.append((check, "profile", f"FAILED: {first_line(e)}", ""))
                continue
            own = summary["dmuon_ms"] if kind == "z3" else summary["fsdp_ms"]
            rows.append(
                (
                    check,
                    f"host ms in {'DMuon' if kind == 'z3' else 'FSDP'}::* hooks",
                    f"{own:.2f}",
                    f"DMuon::* {summary['dmuon_ms']:.2f} ms, FSDP::* {summary['fsdp_ms']:.2f} ms; "
                    f"step {summary['wall_ms']:.1f} ms on the host; {sequences} x {seq} tokens, {layers} layers",
                )
            )
            if not cuda:
                rows += [
                    (check, what, f"{SKIP_CPU}: no CUDA kernels", "")
                    for what in ("CUDA kernels per layer", "compute-stream idle ms")
                ]
                continue
            rows.append(
                (
                    check,
                    "CUDA kernels per layer",
                    f"{summary['kernels'] / layers:.1f}",
                    f"{summary['kernels']} kernels + {summary['copies']} memcpy/memset in the step; NCCL kernels "
                    f"{summary['nccl']} ({summary['nccl_on_compute']} on the compute stream), "
                    f"{summary['streams']} streams used",
                )
            )
            rows.append(
                (
                    check,
                    "compute-stream idle ms",
                    f"{summary['idle_ms']:.2f}",
                    f"gaps between consecutive kernels, over a {summary['span_ms']:.2f} ms span "
                    f"from the step's first kernel to its last ({summary['gaps']} gaps)",
                )
            )
    return rows


MARKER = "spin_kernel"  # torch.cuda._sleep's kernel: queued on the compute stream to find it in the trace


def profiled_step(step, device: torch.device) -> dict:
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        if cuda:
            torch.cuda._sleep(1000)
        start = time.perf_counter()
        step()
        wall = time.perf_counter() - start
        _sync(device)
    return summarize(prof.profiler.kineto_results.events(), wall_s=wall)


HOOK_LABELS = ("DMuon::", "FSDP::")  # the record_function labels of DMuon's and FSDP2's hooks


def device_activity(event) -> str:
    """A device event's kind: "annotation" (a label's GPU span, not work), "copy" (memcpy/memset) or
    "kernel". torch 2.14's events have ``activity_type()``; torch 2.11's do not (the GPU machine this
    project can be lent has 2.11), where ``is_user_annotation()`` and the name tell the same."""
    if hasattr(event, "activity_type"):
        kind = event.activity_type()  # kernel, gpu_memcpy, gpu_memset, gpu_user_annotation
        annotation, copy = kind == "gpu_user_annotation", kind in ("gpu_memcpy", "gpu_memset")
    else:
        annotation, copy = event.is_user_annotation() or event.name().startswith(HOOK_LABELS), False
    if annotation:
        return "annotation"
    return "copy" if copy or event.name().startswith(("Memcpy", "Memset")) else "kernel"


def summarize(events, *, wall_s: float = 0.0) -> dict:
    """Host time under DMuon::* / FSDP::* labels (intervals merged per thread), and on the device:
    kernels, memcpy/memset, NCCL kernels and the compute stream's idle time. The compute stream is
    the one that ran the marker (``torch.cuda._sleep``); without one, the busiest stream."""
    cpu = {prefix: {} for prefix in HOOK_LABELS}
    device_events = []
    for e in events:
        if e.device_type() == torch.autograd.DeviceType.CPU:
            for prefix, spans in cpu.items():
                if e.name().startswith(prefix):
                    spans.setdefault(e.start_thread_id(), []).append((e.start_ns(), e.start_ns() + e.duration_ns()))
        elif e.device_type() == torch.autograd.DeviceType.CUDA:
            kind = device_activity(e)
            if kind != "annotation":
                device_events.append(
                    (e.start_ns(), e.start_ns() + e.duration_ns(), e.device_resource_id(), e.name(), kind == "copy")
                )
    out = {
        "dmuon_ms": _union_ns(cpu["DMuon::"]) / 1e6,
        "fsdp_ms": _union_ns(cpu["FSDP::"]) / 1e6,
        "wall_ms": 1e3 * wall_s,
    }
    markers = [ev for ev in device_events if MARKER in ev[3]]
    work = [ev for ev in device_events if MARKER not in ev[3]]
    copies = [ev for ev in work if ev[4]]
    kernels = [ev for ev in work if not ev[4]]
    by_stream: dict[int, int] = {}
    for ev in work:
        by_stream[ev[2]] = by_stream.get(ev[2], 0) + 1
    compute = markers[0][2] if markers else (max(by_stream, key=by_stream.get) if by_stream else None)
    timeline = sorted((ev[0], ev[1]) for ev in work if ev[2] == compute)
    idle, gaps = 0, 0
    for (_, end), (start, _) in itertools.pairwise(timeline):
        if start > end:
            idle += start - end
            gaps += 1
    nccl = [ev for ev in kernels if "nccl" in ev[3].lower()]
    out.update(
        kernels=len(kernels),
        copies=len(copies),
        streams=len(by_stream),
        nccl=len(nccl),
        nccl_on_compute=sum(1 for ev in nccl if ev[2] == compute),
        idle_ms=idle / 1e6,
        gaps=gaps,
        span_ms=(timeline[-1][1] - timeline[0][0]) / 1e6 if timeline else 0.0,
    )
    return out


def _union_ns(spans_by_thread: dict) -> int:
    total = 0
    for spans in spans_by_thread.values():
        end = None
        for s, e in sorted(spans):
            if end is None or s > end:
                total += e - s
                end = e
            elif e > end:
                total += e - end
                end = e
    return total


# ---- (7) a plain-PyTorch FSDP2 + DMuon step against FSDP2 + AdamW ---------------------------------------------
STEP_SIZES = {  # (7)'s timed toy model, bf16 mixed precision: ~0.5 B parameters on CUDA
    "cuda": dict(vocab_size=32768, dim=2048, n_layers=8, n_heads=16, n_kv_heads=8, hidden_dim=5632),
    "cpu": TINY,
}
STEP_BATCH = {"cuda": (4, 1024), "cpu": (2, 8)}  # (sequences, tokens each) per step
STEP_RUNS = (  # (label, kind, size-1 shortcut bypassed)
    ("FSDP2 + AdamW", "fsdp_adamw", False),
    ("DMuon-Z3, shortcut bypassed", "z3", True),
    ("DMuon-Z3 as NGPU=1 runs it", "z3", False),
)


def fsdp_step_check(
    device: torch.device, *, sizes: dict | None = None, steps: int = 10, reference_steps: int = 3
) -> list[tuple]:
    """FSDP2 + DMuon-Z3 set up from plain PyTorch (no TorchTitan) on a real 1-rank group, beside
    FSDP2 + AdamW. (i) fp32: the weights after ``reference_steps`` steps (shortcut bypassed) against
    the single-process ``torch.optim.Muon`` + ``torch.optim.AdamW`` reference, within TOLERANCE
    (batched bf16 Newton–Schulz against the per-matrix one). (ii) bf16 mixed precision, for AdamW
    and for DMuon with the shortcut bypassed and as NGPU=1 runs it: the median step time of steps
    3.., peak ``memory_allocated`` and no host sync from step 3 (sync debug 'warn')."""
    cuda = device.type == "cuda"
    timed = STEP_SIZES[device.type] if sizes is None else sizes
    check = f"(7) plain PyTorch FSDP2 + DMuon-Z3 vs FSDP2 + AdamW, 1-rank {backend_for(device)} group"
    reference_what = f"fp32 weights after {reference_steps} steps vs torch.optim.Muon + AdamW"
    rows, runs = [], {}
    with process_group(backend_for(device)):
        try:
            rows.append(
                (
                    check,
                    reference_what,
                    *_against_reference(device, SIZES["race"] if sizes is None else sizes, reference_steps),
                )
            )
        except Exception as e:  # noqa: BLE001
            rows.append((check, reference_what, f"FAILED: {first_line(e)}", ""))
        for label, kind, bypass in STEP_RUNS:
            try:
                runs[label] = _timed_run(device, kind, timed, steps, bypass=bypass)
            except Exception as e:  # noqa: BLE001
                runs[label] = {"error": first_line(e)}
    failed = [f"{label}: {run['error']}" for label, run in runs.items() if "error" in run]
    if failed:
        return rows + [(check, "bf16 mixed-precision steps", f"FAILED: {'; '.join(failed)}"[:300], "")]
    adamw, bypassed, alone = (runs[label] for label, _, _ in STEP_RUNS)
    sequences, seq = STEP_BATCH[device.type]
    rows.append(
        (
            check,
            f"median step ms (steps 3-{steps}), bf16 mixed precision",
            f"DMuon {bypassed['step_ms'] / adamw['step_ms']:.2f}x AdamW",
            f"FSDP2 + AdamW {adamw['step_ms']:.2f} ms; DMuon-Z3 {bypassed['step_ms']:.2f} ms (shortcut bypassed), "
            f"{alone['step_ms']:.2f} ms (as NGPU=1); {timed.get('n_layers', 2)} layers, "
            f"{adamw['params'] / 1e6:.1f}M parameters, {sequences} x {seq} tokens; "
            f"last loss {adamw['loss']:.3f} / {bypassed['loss']:.3f}",
        )
    )
    if not cuda:
        return rows + [
            (check, what, f"{SKIP_CPU}: no device memory or sync debug mode", "")
            for what in ("peak memory_allocated GiB", "no host sync from step 3 (sync debug 'warn')")
        ]
    gib = 2**30
    rows.append(
        (
            check,
            "peak memory_allocated GiB",
            f"{bypassed['peak'] / gib:.2f} vs {adamw['peak'] / gib:.2f}",
            f"DMuon-Z3 (shortcut bypassed) vs FSDP2 + AdamW, above the empty device; DMuon as NGPU=1 "
            f"{alone['peak'] / gib:.2f}",
        )
    )
    dmuon_syncs = [
        f"{label}: {runs[label]['sync']}" for label, kind, _ in STEP_RUNS if kind == "z3" and runs[label]["sync"]
    ]
    rows.append(
        (
            check,
            "no host sync from step 3 (sync debug 'warn')",
            verdict(not dmuon_syncs, "; ".join(dmuon_syncs)),
            f"forward, backward, step, {steps - 2} steps; FSDP2 + AdamW: {adamw['sync'] or 'no host sync'}"[:300],
        )
    )
    return rows


def _against_reference(device: torch.device, sizes: dict, steps: int) -> tuple[str, str]:
    """(result, detail): DMuon-Z3's fp32 weights at world 1 (shortcut bypassed) vs the reference."""
    from tests.support.helpers import TOLERANCE, batches, full_state, max_diff, reference_train, toy_model

    data = [
        tuple(t.to(device) for t in batch)
        for batch in batches(steps, global_batch=8, seq=16, vocab=sizes.get("vocab_size", 64))
    ]
    with bypass_size_one_shortcut():
        setup = _setup("z3", _mesh(device, "z3", 1), 1, device, sizes)
        _train(setup, data, device, 1)
        launches = _launches(setup.handle)
        state = full_state(setup)
        setup.handle.remove()
    expected, _, _ = reference_train(toy_model(**sizes).to(device), data)
    diff = max_diff(state, expected)
    return (
        verdict(diff <= TOLERANCE and launches > 0, f"max |diff| {diff:.2e}, {launches} launches"),
        f"max |diff| {diff:.2e} (tolerance {TOLERANCE}: batched bf16 Newton–Schulz vs per matrix); "
        f"{launches} DMuon launches (shortcut bypassed); the reference is one process, no FSDP2",
    )


def _timed_run(device: torch.device, kind: str, sizes: dict, steps: int, *, bypass: bool) -> dict:
    """``steps`` bf16-mixed-precision steps: the median step time of steps 3.., peak memory_allocated
    above the empty device, the host syncs from step 3 on (sync debug 'warn': each sync is a warning
    naming the line that made it), the last loss and the parameter count."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from tests.support.helpers import batches

    cuda = device.type == "cuda"
    sequences, seq = STEP_BATCH[device.type]
    data = [
        tuple(t.to(device) for t in batch)  # on the device first: a host-to-device copy synchronises
        for batch in batches(steps, global_batch=sequences, seq=seq, vocab=sizes.get("vocab_size", 64))
    ]
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    empty = torch.cuda.memory_allocated(device) if cuda else 0
    marks: list = []

    def after_step(i: int) -> None:
        marks.append(
            torch.cuda.current_stream(device).record_event(torch.cuda.Event(enable_timing=True))
            if cuda
            else time.perf_counter()
        )
        if cuda and i == 1:
            torch.cuda.set_sync_debug_mode("warn")  # from step 3

    bypassed = bypass_size_one_shortcut() if bypass else contextlib.nullcontext()
    with warnings.catch_warnings(record=True) as caught, bypassed:
        warnings.simplefilter("always")
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        setup = _setup(kind, _mesh(device, kind, 1), 1, device, sizes, mp_policy=mp)
        params = sum(p.numel() for p in setup.model.parameters())
        after_step(-1)  # the start of step 1
        try:
            last_loss = _train(setup, data, device, 1, after_step=after_step)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
        _sync(device)
        if setup.handle is not None:
            setup.handle.remove()
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    times = [a.elapsed_time(b) if cuda else 1e3 * (b - a) for a, b in itertools.pairwise(marks)]
    return {
        "step_ms": statistics.median(times[2:] or times),
        "loss": last_loss.item(),
        "params": params,
        "peak": torch.cuda.max_memory_allocated(device) - empty if cuda else 0,
        "sync": f"{len(syncs)} syncs, the first {str(syncs[0].message).splitlines()[0][:80]} at "
        f"{_short_path(syncs[0].filename)}:{syncs[0].lineno}"
        if syncs
        else None,
    }


def _short_path(path: str) -> str:
    """A source file's path from its package on (titan_dmuon/..., torch/...)."""
    for marker in ("site-packages/", f"{ROOT}/"):
        if marker in path:
            return path[path.rindex(marker) + len(marker) :]
    return path


CHECKS = {
    "launch": launch_check,
    "fake_pg": fake_pg_check,
    "race": race_check,
    "profile": profile_check,
    "fsdp_step": fsdp_step_check,
}
LABELS = {
    "launch": "(1) coalesced Launch on a 1-rank group",
    "fake_pg": "(2) fake PG under the sanitizer",
    "race": "(3) race amplification",
    "profile": "(5) profiled step",
    "fsdp_step": "(7) plain PyTorch FSDP2 + DMuon vs FSDP2 + AdamW",
}
TINY_KWARGS = {  # --tiny: each check's arguments on the CPU (tests/e2e/test_gpu_check.py)
    "launch": dict(numel=1024),
    "fake_pg": dict(sizes=TINY, steps=3),
    "race": dict(sizes=TINY, steps=2),
    "profile": dict(sizes=TINY, warmup=1),
    "fsdp_step": dict(sizes=TINY, steps=3, reference_steps=2),
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="gpu_check's runtime checks; one JSON line of rows per check")
    parser.add_argument("checks", nargs="+", choices=sorted(CHECKS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny models and few steps (what the CPU tests run)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    for name in args.checks:
        start = time.perf_counter()
        try:
            rows = CHECKS[name](device, **(TINY_KWARGS[name] if args.tiny else {}))
        except Exception as e:  # noqa: BLE001 - one check's failure must not stop the next
            rows = [(LABELS[name], name, f"FAILED: {first_line(e)}", "")]
        rows = [
            list(r[:3]) + [f"{r[3]} [{time.perf_counter() - start:.0f} s]" if i == len(rows) - 1 else r[3]]
            for i, r in enumerate(rows)
        ]
        print(ROW_PREFIX + json.dumps({"check": name, "rows": rows}), flush=True)


if __name__ == "__main__":
    main()
