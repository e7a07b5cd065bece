"""The Muon step of tensor-parallel weights allocates nothing large once its workspaces are made (issue 40):
TorchTitan's llama3 with tensor parallelism over the ranks; the TP exchange's momentum inputs, send, receive,
assembled and result buffers are the workspace's too (tests/distributed/test_step_memory.py for the rest)."""

from torch.profiler import ProfilerActivity, profile

from tests.support import titan_harness as th
from tests.support.measure import large_inside_the_muon_step

LIMIT = 64 * 2**10  # bytes: the bound on one allocation inside the step


def _tp_large_allocations(rank, world):
    """The same on TorchTitan's llama3 with tensor parallelism over the ranks: the TP exchange's
    momentum inputs, send, receive, assembled and result buffers are the workspace's too."""
    dims = th.parallel_dims(world, tp=world)
    model, container = th.build(th.tiny_llama3(dim=256), dims, param_dtype="float32")
    data = th.batches(3, 1, batch=8)
    th.train(model, container, dims, data[:2])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        th.train(model, container, dims, data[2:])
    return large_inside_the_muon_step(prof, LIMIT)


def test_the_tensor_parallel_step_allocates_nothing_large_after_step_2(pool2):
    for large in pool2.run(_tp_large_allocations):
        assert large == [], large
