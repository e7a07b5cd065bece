"""The runtime's pieces built without a handle, for the runtime's unit tests (fast: one process).

``fake_pg`` starts the fake process group in this process (it accepts any collective and moves no
data: an all-gather copies the input into each output, a broadcast or reduce leaves the tensors as
they are); ``runtime_parts`` dedicates a tiny model's Muon targets as ``dedicate_params`` does,
through its own steps (``plan_dedication``, ``build_context``), with no hooks, no FSDP2 and no
optimizer. At world size 1 no collective is issued at all (a group of one sends nothing), so values
are checked there; larger fake worlds check state machines, counts and layouts.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tests.support.helpers import toy_model
from titan_dmuon.runtime import HSDP_DIM_NAMES, DedicationMode
from titan_dmuon.runtime.context import RuntimeContext
from titan_dmuon.runtime.dedicate import Dedication, build_context, plan_dedication
from titan_dmuon.testing.toy_model import muon_targets


@contextlib.contextmanager
def fake_pg(world: int, rank: int = 0):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def data_parallel_mesh(world: int, *, hsdp: bool = False):
    """A 1-D mesh of ``world`` ranks, or HSDP's 2 x world/2 (the process group must be up)."""
    from torch.distributed.device_mesh import init_device_mesh

    if hsdp:
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=HSDP_DIM_NAMES)
    return init_device_mesh("cpu", (world,))


@dataclass
class Parts:
    model: nn.Module
    mode: DedicationMode
    dedication: Dedication
    ctx: RuntimeContext

    @property
    def units(self) -> list:
        return self.ctx.units


def runtime_parts(
    world: int,
    *,
    hsdp: bool = False,
    reshard: bool = True,
    model: nn.Module | None = None,
    params=None,
    allocate: bool = True,
    **dedicate_kwargs,
) -> Parts:
    """``model`` (default: the toy transformer) dedicated on a mesh of ``world`` ranks of the process
    group that is up; ``allocate``: the units' compute params made (as the first forward makes them)."""
    model = model if model is not None else toy_model()
    mode = DedicationMode.build(data_parallel_mesh(world, hsdp=hsdp), reshard_after_forward=reshard)
    dedication = plan_dedication(model, params if params is not None else muon_targets(model), mode, **dedicate_kwargs)
    ctx = build_context(model, dedication, mode)
    if allocate:
        for unit in ctx.units:
            unit.allocate_compute_params(torch.float32, mode.mesh.device)
    return Parts(model=model, mode=mode, dedication=dedication, ctx=ctx)


class RecordingDevice:
    """A stand-in for an accelerator's device module (what ``torch.get_device_module`` returns),
    recording what the runtime asks of it, so that stream order can be checked on a CPU: streams
    that know which one is current (``stream(s)`` makes ``s`` current for its block), events named
    after the stream that recorded them, and ``synchronize``. Entries of ``log``:
    ("record", stream, event), ("wait_event", stream, event), ("wait_stream", waiter, waited),
    ("synchronize", device), and whatever a test appends (``current`` names the current stream)."""

    SIDE_STREAMS = ("gather", "reduce", "replicate")  # in the order runtime.streams.Streams makes them

    def __init__(self):
        self.log: list[tuple] = []
        self._made = 0
        self._events = 0
        self.compute = _RecordingStream(self, "compute")
        self._current = self.compute

    @property
    def current(self) -> str:
        return self._current.name

    def Stream(self, device=None, priority=0):  # noqa: N802 (torch's name)
        name = self.SIDE_STREAMS[self._made] if self._made < len(self.SIDE_STREAMS) else f"side{self._made}"
        self._made += 1
        return _RecordingStream(self, name)

    def current_stream(self, device=None):
        return self._current

    @contextlib.contextmanager
    def stream(self, stream):
        previous, self._current = self._current, stream
        try:
            yield
        finally:
            self._current = previous

    def synchronize(self, device=None):
        self.log.append(("synchronize", str(device)))

    def new_event(self, stream: str) -> str:
        self._events += 1
        return f"{stream}#{self._events}"


class _RecordingStream:
    def __init__(self, device: RecordingDevice, name: str):
        self.device, self.name = device, name

    def record_event(self):
        event = self.device.new_event(self.name)
        self.device.log.append(("record", self.name, event))
        return event

    def wait_event(self, event):
        self.device.log.append(("wait_event", self.name, event))

    def wait_stream(self, other):
        self.device.log.append(("wait_stream", self.name, other.name))
