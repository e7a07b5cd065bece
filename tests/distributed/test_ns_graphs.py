"""``ns_graphs``: Newton–Schulz batches replayed from CUDA graphs (``optim/ns_graphs.py``), refused by name
where it cannot work; off CUDA the same code path runs eagerly. The GPU's side (graph vs eager, bitwise,
host time) is ``benchmarks/gpu_check.py``'s row (8); the test here that needs CUDA skips without it."""

import pytest
import torch

from tests.support.helpers import distribute, toy_model
from titan_dmuon.math.matrix_blocks import row_blocks
from titan_dmuon.math.muon_update import muon_step
from titan_dmuon.optim.ns_graphs import NSGraphs
from titan_dmuon.optim.workspace import Workspace
from titan_dmuon.options import DMuonOptions, OptionError


def test_ns_graphs_is_refused_with_the_exact_mode_and_for_a_non_boolean():
    with pytest.raises(OptionError, match="ns_graphs = True: expected false with ns_mode 'exact'"):
        DMuonOptions(ns_graphs=True, ns_mode="exact")
    with pytest.raises(OptionError, match="ns_graphs = 'yes': expected true or false"):
        DMuonOptions(ns_graphs="yes")


def _build_on_cpu(rank, world):
    try:
        distribute(toy_model(), "z3", world, opt_kwargs={"ns_graphs": True})
    except OptionError as e:
        return str(e)
    return None


def test_ns_graphs_is_refused_for_weights_off_cuda(pool1):
    """A CPU job: refused when DMuon is built, naming the option and the device."""
    (message,) = pool1.run(_build_on_cpu)
    assert message is not None and message.startswith("ns_graphs = True: expected false for Muon weights on ")
    assert "CUDA graphs replay on a CUDA device only" in message


def _step(device, runner_of, steps=3):
    """Three Muon steps of a few matrices (two shape classes, a stack of experts); the weights."""
    g = torch.Generator(device=device).manual_seed(0)
    shapes = [(48, 80), (80, 48), (3, 40, 24), (64, 64)]
    params = [torch.randn(s, device=device, generator=g) for s in shapes]
    grads = [torch.randn(s, device=device, generator=g) for s in shapes]
    buffers = [torch.zeros_like(p) for p in params]
    workspace = Workspace()
    runner = runner_of(workspace)
    for _ in range(steps):
        muon_step(
            params,
            grads,
            buffers,
            [row_blocks(p.shape[-2:]) for p in params],
            lr=0.02,
            weight_decay=0.1,
            momentum=0.95,
            nesterov=True,
            ns_steps=5,
            scratch=workspace,
            ns_runner=runner,
        )
    return params, runner


def test_off_cuda_the_graph_path_runs_eagerly():
    """The same results as the plain call (bitwise: the same calls), every batch counted as eager."""
    plain, _ = _step(torch.device("cpu"), lambda workspace: None)
    graphed, runner = _step(torch.device("cpu"), NSGraphs)
    assert all(torch.equal(a, b) for a, b in zip(plain, graphed))
    assert runner.eager == 3 * 3 and runner.captured == runner.replayed == 0  # 3 shape classes, 3 steps


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA (gpu_check.py row (8) on a GPU)")
def test_on_cuda_each_batch_is_captured_once_and_replayed_bitwise():
    """Step 1 makes the buffers (eager), step 2 runs once on static ones (eager), step 3 captures each of
    the 3 shape classes' batches and replays it, and so on: 3 graphs for 15 calls over 5 steps."""
    plain, _ = _step(torch.device("cuda"), lambda workspace: None, steps=5)
    graphed, runner = _step(torch.device("cuda"), NSGraphs, steps=5)
    assert all(torch.equal(a, b) for a, b in zip(plain, graphed))
    assert runner.captured == 3 and runner.eager + runner.replayed == 15 and runner.replayed >= 6
