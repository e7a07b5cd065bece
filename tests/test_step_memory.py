"""DMuon's Muon step allocates nothing large once its workspaces are made (issue 40).

Every step used to allocate and free its temporaries (Nesterov inputs, the per-shape stacks, Newton–Schulz's
intermediates, NorMuon's, the TP exchange's buffers); the C allocator's heap fragmented around them and a
process's memory grew step after step. They now live in the step's ``Workspace`` (``optim/workspace.py``),
made in the first step. PyTorch's profiler (CPU, memory profiling on) counts what each op allocates inside
``DMuon.muon_step``'s range in step 3: nothing above ``LIMIT`` (scalars, norms, second-moment rows and the
lists of Python stay below it; the model is sized so that every matrix, stack and Gram matrix is above it).
Without the workspaces the same step allocates each of those (checked by reverting them).
"""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from tests.helpers import batches, distribute, local_slice, toy_model, train
from titan_dmuon.optim.optimizer import MUON_STEP_RANGE
from titan_dmuon.testing.toy_model import loss_fn

LIMIT = 64 * 2**10  # bytes: the bound on one allocation inside the step

# every Muon matrix at least 128 x 128 fp32 (64 KiB), its bf16 stack and Gram matrices too
SIZES = dict(dim=128, hidden_dim=384, n_heads=4, n_kv_heads=2, vocab_size=64)


def _large_allocations(rank, world, experts, opt_kwargs):
    """What ops inside the Muon step of step 3 allocate above LIMIT: [(op, bytes)]."""
    data = batches(3, vocab=SIZES["vocab_size"])
    setup = distribute(toy_model(num_experts=experts, **SIZES), "z3", world, opt_kwargs=opt_kwargs)
    train(setup, data, rank, world, steps=2)
    x, y = local_slice(data[2], rank, world)
    loss_fn(setup.module(x), y).backward()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        setup.opt.step()
    setup.opt.zero_grad()
    return _large_inside_the_muon_step(prof)


def _tp_large_allocations(rank, world):
    """The same on TorchTitan's llama3 with tensor parallelism over the ranks: the TP exchange's
    momentum inputs, send, receive, assembled and result buffers are the workspace's too."""
    from tests import titan_harness as th

    dims = th.parallel_dims(world, tp=world)
    model, container = th.build(th.tiny_llama3(dim=256), dims, param_dtype="float32")
    data = th.batches(3, 1, batch=8)
    th.train(model, container, dims, data[:2])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        th.train(model, container, dims, data[2:])
    return _large_inside_the_muon_step(prof)


def _large_inside_the_muon_step(prof):
    """[(op, bytes)] of the ops inside the one ``MUON_STEP_RANGE`` that allocated above LIMIT."""
    events = prof.events()
    ranges = [e.time_range for e in events if e.name == MUON_STEP_RANGE]
    assert len(ranges) == 1, ranges
    (step,) = ranges
    inside = [e for e in events if e.name != MUON_STEP_RANGE
              and step.start <= e.time_range.start and e.time_range.end <= step.end]
    assert inside, "no op recorded inside the Muon step: the profiler read nothing"
    return [(_path(e), e.self_cpu_memory_usage) for e in inside if e.self_cpu_memory_usage > LIMIT]


def _path(event) -> str:
    """The op and the ops it ran in, outermost first (what allocated, for the failure's message)."""
    names = []
    while event is not None and event.name != MUON_STEP_RANGE:
        names.append(event.name)
        event = event.cpu_parent
    return " < ".join(names)


@pytest.mark.parametrize("experts, opt_kwargs", [
    (0, {}),
    (4, {}),
    (4, {"ns_method": "gram", "ns_dtype": "float16", "normuon_beta2": 0.95}),
    (0, {"ns_method": "polar_express", "nesterov": False}),
])
def test_the_muon_step_allocates_nothing_large_after_step_2(pool2, experts, opt_kwargs):
    for large in pool2.run(_large_allocations, experts, opt_kwargs):
        assert large == [], large


def test_the_tensor_parallel_step_allocates_nothing_large_after_step_2(pool2):
    pytest.importorskip("torchtitan")
    for large in pool2.run(_tp_large_allocations):
        assert large == [], large
