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
from torch.profiler import ProfilerActivity, profile

from tests.support.helpers import batches, distribute, local_slice, toy_model, train
from tests.support.measure import large_inside_the_muon_step
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
    return large_inside_the_muon_step(prof, LIMIT)


@pytest.mark.parametrize(
    "experts, opt_kwargs",
    [
        (0, {}),
        (4, {}),
        (4, {"ns_method": "gram", "ns_dtype": "float16", "normuon_beta2": 0.95}),
        (0, {"ns_method": "polar_express", "nesterov": False}),
    ],
)
def test_the_muon_step_allocates_nothing_large_after_step_2(pool2, experts, opt_kwargs):
    for large in pool2.run(_large_allocations, experts, opt_kwargs):
        assert large == [], large
