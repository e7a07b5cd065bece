"""``runtime/reducer.py``: which stream waits for which reduce, and when (the order NCCL runs them in).

On the CPU there are no streams and every wait blocks the host, so order cannot show in timings; here
the reducer runs on the fake process group with its ``Streams`` on a recording stand-in for an
accelerator's device module (``tests/support/runtime_parts.py: RecordingDevice``), and each wait on a launch
in flight (``InFlight.wait``, which on an accelerator makes the *current* stream wait) is logged with
the stream that was current. A backward is simulated by calling the reducer as the post-backward hooks
do (``reduce`` per layer in backward order, ``finish`` or ``issue_rest`` at its end).
"""

import pytest
import torch

from tests.support.runtime_parts import RecordingDevice, fake_pg, runtime_parts
from titan_dmuon.runtime.comm import CommLabel, CommStats, InFlight
from titan_dmuon.runtime.reducer import GradientReducer
from titan_dmuon.runtime.streams import Streams


def _recorded_backward(world, *, hsdp=False, hook=False, deferred=False):
    """The log of one simulated backward: ("reduce", unit) as each post-backward starts, ("hook",
    stream) for each all-reduce hook call, ("wait", flight, stream) for each wait on a launch,
    ("end",) where backward ends, ("finish",) where ``finish`` starts (right away, or after
    ``issue_rest`` and a ("schedule_end",) when ``deferred``), and the device's own entries."""
    device = RecordingDevice()
    real_module, real_wait = torch.get_device_module, InFlight.wait

    def wait(in_flight, stream=None):
        name = getattr(in_flight, "recorded_name", None)
        if name is not None:
            device.log.append(("wait", name, stream.name if stream is not None else device.current))
        real_wait(in_flight, stream)

    torch.get_device_module = lambda d=None: device
    InFlight.wait = wait
    try:
        with fake_pg(world):
            parts = runtime_parts(world, hsdp=hsdp)
            stats = CommStats()
            reducer = GradientReducer(
                mode=parts.mode,
                streams=Streams(torch.device("cuda", 0)),
                stats=stats,
                reduce_dtype=torch.float32,
                divide_factor=1.0,
            )
            if hook:
                reducer.all_reduce_hook = lambda flat: device.log.append(("hook", device.current))

            def name_new_flights():
                for flight in reducer._in_flight + reducer._unwaited:
                    if not hasattr(flight.in_flight, "recorded_name"):
                        unit = flight.items[0][0].pieces[0].member.unit if flight.items else "-"
                        flight.in_flight.recorded_name = f"{flight.stage.value}:{unit}"

            for unit in reversed(parts.units):
                for m in unit.members:
                    m.compute.grad = torch.ones(m.shape)
                device.log.append(("reduce", unit.index))
                reducer.reduce(unit)
                name_new_flights()
            device.log.append(("end",))
            if deferred:
                reducer.issue_rest()
                name_new_flights()
                device.log.append(("schedule_end",))
                pending = reducer.awaiting_finish
            device.log.append(("finish",))
            reducer.finish()
            handed = sum(m.param.grad is not None for m in parts.dedication.members if m.runs_ns)
            owners = sum(m.runs_ns for m in parts.dedication.members)
            return {
                "log": device.log,
                "units": len(parts.units),
                "handed": handed,
                "owners": owners,
                "replicate_reduces": stats.pop().get(CommLabel.REPLICATE_REDUCE, (0, 0, 0))[2],
                "pending": pending if deferred else None,
                "after": reducer.awaiting_finish,
            }
    finally:
        torch.get_device_module, InFlight.wait = real_module, real_wait


def _hook_job(rank, world):
    return _recorded_backward(2, hook=True)


def test_the_compute_stream_waits_for_the_cross_group_hook_only_at_the_end_of_backward(solo):
    """TorchFT's all-reduce hook (across replica groups) runs on the replicate stream after the
    shard stage, and the compute stream waits for its work only in ``finish``, as FSDP2's compute
    stream waits for its all-reduce stream only in ``finalize_backward``. Regression: ``finish``'s
    wait came right after the hook, in the next layer's post-backward, so the backward of layer
    k-1 waited on the GPU for layer k+1's shard reduce *and* its all-reduce across groups: backward
    ran at the inter-group network's speed. The compute stream still waits for each layer's shard
    reduce at the next post-backward (FSDP2's one reduce-scatter buffer in flight)."""
    r = solo.run(_hook_job)[0]
    log = r["log"]
    hooks = [i for i, e in enumerate(log) if e[0] == "hook"]
    assert hooks and all(log[i][1] == "replicate" for i in hooks)  # the hook's work on the side stream
    hook_events = [e[2] for e in log if e[0] == "record" and e[1] == "replicate"]
    assert hook_events, log
    compute_waits = [(i, e[2]) for i, e in enumerate(log) if e[:2] == ("wait_event", "compute")]
    finish = log.index(("finish",))
    waited = [event for i, event in compute_waits if event in hook_events]
    assert sorted(waited) == sorted(hook_events), log  # each once, before the owners get .grad
    assert all(i > finish for i, event in compute_waits if event in hook_events), log
    # the shard stage: the replicate stream waits for it before the hook, the compute stream at the
    # next post-backward (or the end), each layer's once
    shard_waits = [e for e in log if e[0] == "wait" and e[1].startswith("shard")]
    assert sorted(e[1] for e in shard_waits if e[2] == "compute") == sorted(f"shard:{u}" for u in range(r["units"]))
    assert r["handed"] == r["owners"] > 0


def _deferred_job(rank, world, hsdp):
    return _recorded_backward(4 if hsdp else 2, hsdp=hsdp, deferred=True)


@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp", "hsdp"])
def test_issue_rest_leaves_the_compute_stream_free_until_finish(solo, hsdp):
    """The end of a pipeline stage's last backward (``issue_rest``): every stage still due is issued
    (under HSDP the last layer's reduce across the replicate group, from the replicate stream after
    its shard stage) and the compute stream waits for none of them until ``finish``, after the
    schedule, so the stage's send of its input gradient does not queue behind them. Until then the
    reducer reports them unfinished (the optimizer step refuses to run); ``finish`` waits for every
    one on the compute stream and hands the owners their gradients."""
    r = solo.run(_deferred_job, hsdp)[0]
    log = r["log"]
    end, schedule_end, finish = log.index(("end",)), log.index(("schedule_end",)), log.index(("finish",))
    compute_waits = [(i, e[1]) for i, e in enumerate(log) if e[0] == "wait" and e[2] == "compute"]
    assert not [w for i, w in compute_waits if end < i < finish], log
    first = "shard:0"  # the last layer backward reaches: its reduce is the last one issued
    assert [i for i, w in compute_waits if w == first][0] > finish
    stages = ("shard", "replicate") if hsdp else ("shard",)
    assert sorted(w for _, w in compute_waits) == sorted(f"{s}:{u}" for s in stages for u in range(r["units"]))
    if hsdp:  # every layer's replicate stage was issued before the schedule ended
        assert r["replicate_reduces"] == r["units"]
        replicate_first = [i for i, e in enumerate(log) if e[:2] == ("wait", first) and e[2] == "replicate"]
        assert replicate_first and replicate_first[0] < schedule_end
    assert r["pending"] and not r["after"]
    assert r["handed"] == r["owners"] > 0
