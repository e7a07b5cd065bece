"""``runtime/streams.py``: on the CPU every method is a no-op (the runtime reads the same there); on an
accelerator each call goes to the stream it names, checked against a recording stand-in for the
device module (``torch.get_device_module``), since this machine has no accelerator."""

import pytest
import torch

from tests.support.runtime_parts import RecordingDevice
from titan_dmuon.runtime.streams import DeviceTimer, Streams, synchronize_device


class _Event:
    def __init__(self, log, name, enable_timing=False):
        self.log, self.name = log, name

    def record(self):
        self.log.append(("record", self.name))

    def synchronize(self):
        self.log.append(("synchronize", self.name))

    def elapsed_time(self, end):
        return 250.0  # milliseconds


class _Stream:
    def __init__(self, log, name, priority=0):
        self.log, self.name, self.priority = log, name, priority

    def record_event(self):
        self.log.append(("record_event", self.name))
        return f"event of {self.name}"

    def wait_event(self, event):
        self.log.append(("wait_event", self.name, event))

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))


class _DeviceModule:
    """What ``torch.cuda`` offers the runtime, recording each call."""

    def __init__(self):
        self.log, self.made, self.events = [], [], 0
        self.compute = _Stream(self.log, "compute")

    def Stream(self, device=None, priority=0):  # noqa: N802 (torch's name)
        self.made.append(_Stream(self.log, f"side{len(self.made)}", priority))
        return self.made[-1]

    def Event(self, enable_timing=False):  # noqa: N802
        self.events += 1
        return _Event(self.log, f"event{self.events}", enable_timing)

    def current_stream(self, device=None):
        return self.compute

    def stream(self, stream):
        self.log.append(("use", stream.name))
        return torch.autograd.profiler.record_function("stand-in")  # any context manager


@pytest.fixture
def device_module(monkeypatch):
    module = _DeviceModule()
    monkeypatch.setattr(torch, "get_device_module", lambda device=None: module)
    return module


def test_on_the_cpu_there_are_no_streams_and_nothing_to_wait_for():
    streams = Streams(torch.device("cpu"))
    assert streams.gather is streams.reduce is streams.replicate is None
    with streams.use(streams.gather):
        pass
    assert streams.record() is None
    streams.wait_event(None, streams.record())
    streams.wait_stream(streams.reduce)


def test_on_an_accelerator_each_call_goes_to_the_stream_it_names(device_module):
    """Gather and reduce streams at high priority (their copies must not queue behind compute, as
    FSDP2's), the replicate stream at the default; ``record``/``wait_event``/``wait_stream`` default to
    the current (compute) stream; waiting for no event issues nothing."""
    streams = Streams(torch.device("cuda", 0))
    assert [s.priority for s in (streams.gather, streams.reduce, streams.replicate)] == [-1, -1, 0]
    log = device_module.log
    with streams.use(streams.reduce):
        pass
    event = streams.record()
    streams.record(streams.gather)
    streams.wait_event(None, event)
    streams.wait_event(streams.gather, None)
    streams.wait_event(streams.gather, event)
    streams.wait_stream(streams.reduce)
    streams.wait_stream(streams.replicate, streams.gather)
    assert log == [
        ("use", "side1"),
        ("record_event", "compute"),
        ("record_event", "side0"),
        ("wait_event", "compute", "event of compute"),
        ("wait_event", "side0", "event of compute"),
        ("wait_stream", "side1", "compute"),
        ("wait_stream", "side2", "side0"),
    ]


def test_a_cpu_timer_keeps_the_spans_since_its_last_reset():
    import time

    timer = DeviceTimer(torch.device("cpu"))
    with timer.timing():
        time.sleep(0.05)
    with timer.timing(accumulate=True):
        pass
    assert timer.seconds() >= 0.05
    with timer.timing():  # not accumulating: starts over
        pass
    assert timer.seconds() < 0.05


def test_a_device_timer_records_events_and_syncs_only_when_read(device_module):
    """No host sync while timing (the per-step path must not sync); reading waits for the end events
    of the spans since the last non-accumulating ``timing()``."""
    timer = DeviceTimer(torch.device("cuda", 0))
    with timer.timing():
        pass
    with timer.timing(accumulate=True):
        pass
    assert [entry[0] for entry in device_module.log] == ["record"] * 4
    assert timer.seconds() == 2 * 0.25
    assert [entry for entry in device_module.log if entry[0] == "synchronize"] == [
        ("synchronize", "event2"),
        ("synchronize", "event4"),
    ]
    with timer.timing():
        pass
    assert timer.seconds() == 0.25


def test_synchronize_device_names_the_device_and_is_a_no_op_on_the_cpu(monkeypatch):
    """Checkpoints and recovery wait for every stream of the job's device (named: TorchFT calls from
    its quorum thread, whose current device may be another); on the CPU work is done when its call
    returns, and no device module is asked."""
    device = RecordingDevice()
    monkeypatch.setattr(torch, "get_device_module", lambda d=None: device)
    synchronize_device(torch.device("cpu"))
    synchronize_device(torch.device("cuda", 3))
    assert device.log == [("synchronize", "cuda:3")]
