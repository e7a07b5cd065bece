"""``optim/tensor_parallel_update.py``: the TP weights' three stages, pipelined over batches.

On the fake process group as tp rank 0 of 2 (its all-to-alls move no data, so values are not checked
here: ``tests/titan/test_tensor_parallel.py`` checks them on gloo against torch.optim.Muon). What is checked
is what decides overlap on an accelerator, where this machine has none: the order in which the stages
issue their collectives and their Newton–Schulz, the stream waits before each collective (a
recording stand-in for ``Streams``; on the CPU the real one has no streams), and when the
Newton–Schulz timer starts.
"""

import contextlib
from collections import defaultdict
from types import SimpleNamespace

import torch

from tests.support.helpers import allocation_peak
from tests.support.runtime_parts import fake_pg
from titan_dmuon.runtime.comm import CommLabel

TP = 2
GROUP = dict(
    lr=0.02,
    weight_decay=0.1,
    momentum=0.95,
    nesterov=True,
    ns_steps=5,
    ns_coefficients=(3.4445, -4.7750, 2.0315),
    eps=1e-7,
    adjust_lr_fn=None,
    ns_mode="batched",
)


class _RecordingStreams:
    """``Streams`` as on an accelerator, each call recorded: the compute stream is "compute", the reduce
    stream "reduce"; an event is named by the order it was recorded in."""

    device = torch.device("cpu")  # (the tensors; the fake process group runs on the CPU)
    reduce = "reduce"

    def __init__(self, log):
        self.log = log

    def use(self, stream):
        return contextlib.nullcontext()

    def record(self, stream=None):
        event = f"event{sum(entry[0] == 'record' for entry in self.log)}"
        self.log.append(("record", stream or "compute", event))
        return event

    def wait_event(self, stream, event):
        self.log.append(("wait_event", stream or "compute", event))

    def wait_stream(self, waiter, waited=None):
        self.log.append(("wait_stream", waiter, waited or "compute"))


def _experts(count, *, rows=16, cols=64, homes=None):
    """A TP item: a stack of ``count`` experts split on their rows over the TP group (this rank's
    shards: ``rows`` x ``cols``), expert e homed on ``homes[e]`` (default: alternating)."""
    from titan_dmuon.optim.tensor_parallel_update import TPItem
    from titan_dmuon.plan.specs import TPMatrix

    homes = homes if homes is not None else [e % TP for e in range(count)]
    weight = torch.randn(count, rows, cols)
    matrices = [
        TPMatrix(shape=(rows, cols), dim=0, home=home, blocks=(((0, rows * TP),),), col_blocks=(((0, cols),),))
        for home in homes
    ]
    return TPItem(param=weight, weight=weight, grad=torch.randn_like(weight), matrices=matrices)


def _tp_step(log=None):
    """A ``TensorParallelStep`` on tp rank 0 of the fake process group (which must be up)."""
    from torch.distributed.device_mesh import init_device_mesh

    from titan_dmuon.optim.tensor_parallel_update import TensorParallelStep
    from titan_dmuon.optim.whole_update import NSFigures, OwnerUpdate
    from titan_dmuon.runtime.comm import CommStats
    from titan_dmuon.runtime.mode import TensorParallelInfo
    from titan_dmuon.runtime.streams import Streams
    from titan_dmuon.runtime.tensor_parallel import TensorParallelNewtonSchulz

    tp = TensorParallelInfo.from_mesh(init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",)))
    streams = _RecordingStreams(log) if log is not None else Streams(torch.device("cpu"))
    optimizer = SimpleNamespace(state=defaultdict(dict), ns_method="torch", ns_dtype="bfloat16", normuon_beta2=None)
    return TensorParallelStep(TensorParallelNewtonSchulz(tp, CommStats(), streams), OwnerUpdate(optimizer, NSFigures()))


@contextlib.contextmanager
def _recorded(log, *, ns=True, waits=False):
    """Each all-to-all's label (``("all_to_all", label)``), each Newton–Schulz call (``("newton_schulz",
    matrices)``) and, with ``waits``, each wait for collectives that moved data (``("wait",)``), into
    ``log`` as they are issued."""
    from titan_dmuon.optim import whole_update as owner_update
    from titan_dmuon.runtime import comm

    real = comm.Launch.all_to_all, owner_update.orthogonalise, comm.InFlight.wait

    def all_to_all(self, *args):
        log.append(("all_to_all", self.source))
        return real[0](self, *args)

    def orthogonalise(matrices, **kwargs):
        log.append(("newton_schulz", len(matrices)))
        return real[1](matrices, **kwargs)

    def wait(self, stream=None):
        if self.works:
            log.append(("wait",))
        return real[2](self, stream)

    comm.Launch.all_to_all = all_to_all
    if ns:
        owner_update.orthogonalise = orthogonalise
    if waits:
        comm.InFlight.wait = wait
    try:
        yield
    finally:
        comm.Launch.all_to_all, owner_update.orthogonalise, comm.InFlight.wait = real


def _issue_order(_rank, _world):
    """Three jobs of two experts each (one homed on each tp rank), through the pipeline."""
    log = []
    with fake_pg(TP), _recorded(log):
        tp_step = _tp_step(log)
        for job in range(3):
            tp_step.submit([(GROUP, [_experts(2)])], then=lambda job=job: log.append(("applied", job)))
        tp_step.finish()
    return log


def test_each_batch_is_sent_before_the_previous_batchs_newton_schulz(solo):
    """On NCCL the reduce stream runs the all-to-alls in issue order: batch k+1's shards go to their
    homes before batch k's Newton–Schulz, so they travel while it runs, and batch k's results come
    back while batch k+1's Newton–Schulz runs (applied after it, then the job's units sent on, in job
    order). Before, each batch's send came after the previous batch's results were sent back (NS(k),
    back(k), send(k+1)): queued behind back(k), which waits for NS(k), no transfer overlapped any
    Newton–Schulz. Each all-to-all's stream waits only for an event recorded just before it, after its
    inputs were written, never for the whole compute stream (``wait_stream``)."""
    log = solo.run(_issue_order)[0]
    to, back = ("all_to_all", CommLabel.TP_TO_HOME), ("all_to_all", CommLabel.TP_FROM_HOME)
    ns = ("newton_schulz", 1)  # (one of each batch's two experts is homed here)
    order = [entry for entry in log if entry[0] in ("all_to_all", "newton_schulz", "applied")]
    assert order == [to, to, ns, back, to, ns, back, ("applied", 0), ns, back, ("applied", 1), ("applied", 2)], order
    assert not [entry for entry in log if entry[0] == "wait_stream"], log
    for i, entry in enumerate(log):
        if entry[0] == "all_to_all":
            recorded, waited = log[i - 2], log[i - 1]
            assert recorded[:2] == ("record", "compute") and waited == ("wait_event", "reduce", recorded[2]), log
    assert sum(entry[0] == "all_to_all" for entry in log) == 6


def _timer_order(_rank, _world):
    log = []

    class RecordingTimer:
        on_host = True

        @contextlib.contextmanager
        def timing(self, accumulate=False):
            log.append(("timer starts",))
            yield
            log.append(("timer stops",))

    with fake_pg(TP), _recorded(log, waits=True):
        tp_step = _tp_step()
        tp_step.owner_update.figures.timer = RecordingTimer()
        tp_step.submit([(GROUP, [_experts(2)])], then=lambda: log.append(("applied",)))
        tp_step.finish()
    return [entry for entry in log if entry[0] != "all_to_all"], tp_step.owner_update.figures.matrices


def test_the_newton_schulz_timer_starts_once_the_shards_are_home(solo):
    """``ns_seconds`` is the Newton–Schulz's time: its timer starts after the wait for the shards sent
    to the homes (on an accelerator the start event is queued after the stream's wait, on the CPU the
    host has waited), and stops before the results go back. It used to time the whole home stage,
    the wait for the transfer included."""
    order, matrices = solo.run(_timer_order)[0]
    assert order == [("wait",), ("timer starts",), ("newton_schulz", 1), ("timer stops",), ("wait",), ("applied",)]
    assert matrices == 1


def _step_peak(_rank, _world, cap_matrices, jobs, experts):
    """Bytes allocated at the peak of the TP step (above what it started with) for ``jobs`` jobs of one
    stack of ``experts`` experts each, all homed on this rank (its worst case), with the cap at
    ``cap_matrices`` experts' exchange bytes; that cap; the jobs' exchange bytes; and the peak of
    Newton–Schulz alone on one capped batch (``muon_math.orthogonalise`` on its full matrices)."""
    from titan_dmuon.math.muon_update import orthogonalise
    from titan_dmuon.optim import tensor_parallel_update as tensor_parallel_step

    default = tensor_parallel_step.MAX_EXCHANGE_BYTES
    with fake_pg(TP):
        tp_step = _tp_step()
        items = [_experts(experts, rows=32, cols=128, homes=[0] * experts) for _ in range(jobs)]
        per_matrix = tensor_parallel_step.exchange_bytes(items[0].matrices[0], TP)

        def step():
            for item in items:
                tp_step.submit([(GROUP, [item])], then=lambda: None)
            tp_step.finish()

        tensor_parallel_step.MAX_EXCHANGE_BYTES = cap_matrices * per_matrix
        try:
            step()  # (makes the momentum buffers)
            peak = allocation_peak(step)
        finally:
            tensor_parallel_step.MAX_EXCHANGE_BYTES = default
    batch = [torch.randn(32 * TP, 128).bfloat16() for _ in range(cap_matrices)]
    newton_schulz = allocation_peak(lambda: orthogonalise(batch, ns_mode=GROUP["ns_mode"]))
    return peak, cap_matrices * per_matrix, per_matrix * experts * jobs, newton_schulz


def test_the_tp_steps_transient_memory_is_capped_whatever_the_chunk(solo):
    """Two jobs of 32 experts each, each job 8 x the cap (lowered to 4 experts' exchange bytes to keep
    the test small), all homed on this rank: the step's transient peak stays within the bound the
    module states, 6 x MAX_EXCHANGE_BYTES for the exchange's buffers plus what Newton–Schulz itself
    holds on one batch (measured here alone: its stack, X Xᵀ, the polynomial, the next X, the kernels'
    scratch). Uncapped, each job went through as one exchange, about five copies of its 8 caps alive
    (40 caps) beside Newton–Schulz on all of them."""
    peak, cap, total, newton_schulz = solo.run(_step_peak, 4, 2, 32)[0]
    assert total == 16 * cap
    assert peak <= 6 * cap + newton_schulz, (peak / cap, newton_schulz / cap)
