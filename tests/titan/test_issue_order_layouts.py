"""One order on every rank in TorchTitan's layouts: TP, EP, CP and a real pipeline schedule, and a resume.

On NCCL every rank of a communicator must issue the same operations on it in the same order
(tests/support/issue_order.py). tests/distributed/test_issue_order.py simulates DMuon's own collectives on
16-64 ranks of Z2, Z3 and HSDP; this file runs TorchTitan's layouts that simulation does not build, on 4
gloo ranks, and records everything each rank issues (``IssueRecorder``: FSDP2's all-gathers and
reduce-scatters, DMuon's broadcasts, reduces and owner groups' Gram all-reduces, TorchTitan's TP, EP
all-to-all, CP and pipeline send/recv, DCP's planning) from the build through two steps, a checkpoint
save, a second job's build and load from it, and that job's first step (a resume). Then every
communicator must have one sequence on all its ranks, and the collectives one global order.

Each layout has two Muon param groups (the MLP weights at their own lr) and owner groups where it allows
them (figures given, ``FORCED``): CP 2 x FSDP 2 (dedication over the 4 ranks), PP 2 x FSDP 2 under
Interleaved1F1B (each stage's MLP over its 2 data-parallel ranks). TP 2 x FSDP 2 forms none: every Muon
target is a TP shard, whose Newton–Schulz home is one TP rank (``MatrixSpec.may_group``). EP 2 on FSDP 4
(tiny deepseek_v3) forms none either: stacks of experts keep one owner and the plan found no gain in
splitting its small dense matrices (a dense MLP 16x wider still formed none and made the job 30x slower
here; not pursued), so EP checks the all-to-alls' order beside DMuon's one-owner collectives. A planted
rank-dependent order is not run here: on real gloo ranks the mismatched all-reduce ends the planting rank's
process before its records come back (tests/distributed/test_issue_order.py plants one on the fake
process group).
"""

from __future__ import annotations

import pytest

from tests.support import titan_harness as th  # noqa: I001 (enables the CPU accommodations first)
from tests.support.issue_order import Communicator, IssueRecorder, check_issue_order
from titan_dmuon.plan.owner_groups import GroupOptions

# Sums next to Newton–Schulz cost nothing, every figure given (none measured: the same plan anywhere)
FORCED = GroupOptions(
    ns_tflops=1e-3, node_size=4, latency_us=0.0, nic_latency_us=0.0, intra_node_gbps=360.0, nic_gbps=45.0, min_gain=0.0
)
LOCAL_BATCH = 4  # a pipeline rank's, in micro-batches of one sample


def _mlp_group():
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    return [ParamGroupConfig(pattern=r"\.feed_forward\.", optimizer_name="DMuon", optimizer_kwargs={"lr": 0.04})]


def _llama3():
    return th.tiny_llama3(fuse_qkv=False, n_layers=2, hidden_dim=1024)  # (the MLP dominates: groups form)


class _Job:
    """One layout's model, DMuon container, LR schedule and TorchTitan checkpoint manager."""

    def __init__(self, world, layout, folder, seed):
        from torchtitan.components.optimizer import LRSchedulersContainer

        from tests.support.helpers import Counter
        from titan_dmuon.integration.components.checkpoint import DMuonCheckpointManager

        options = dict(lr=0.02, seed=seed, param_groups=_mlp_group())
        self.layout, self.built = layout, None
        if layout == "pp":
            self.dims = th.pp_dims(world)
            self.built = th.build_pp(
                _llama3(),
                self.dims,
                schedule="Interleaved1F1B",
                local_batch=LOCAL_BATCH,
                owner_groups=FORCED,
                **options,
            )
            self.parts, self.container = self.built[1], self.built[4]
        else:
            if layout == "ep":
                self.dims = th.parallel_dims(world, ep=2)
                model = th.tiny_deepseek_v3(experts=4)
            else:
                self.dims = th.parallel_dims(world, tp=2 if layout == "tp" else 1, cp=2 if layout == "cp" else 1)
                model = _llama3()
            built, self.container = th.build(model, self.dims, owner_groups=FORCED, **options)
            self.parts = [built]
        self.schedule = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=self.container, training_steps=4)
        self.counter = Counter()
        self.manager = DMuonCheckpointManager.Config(enable=True, folder="ckpt", interval=2).build(
            dataloader=Counter(),
            model_parts=self.parts,
            optimizers=self.container,
            lr_schedulers=self.schedule,
            states={"train_state": self.counter},
            sd_adapter=None,
            base_folder=folder,
        )
        data_parallel = world // (self.dims.tp * self.dims.cp * self.dims.pp)
        self.data = th.batches(4, 1, batch=(LOCAL_BATCH if layout == "pp" else 2) * data_parallel)

    def train(self, until):
        while self.counter.step < until:
            batch = [self.data[self.counter.step]]
            if self.built is not None:
                th.train_pp(self.dims, self.built, batch)
            else:
                th.train(self.parts[0], self.container, self.dims, batch)
            self.schedule.step()
            self.counter.step += 1
            self.manager.save(self.counter.step)

    def grouped(self) -> list[tuple[str, int]]:
        from tests.support.titan_outputs import handles_of

        return sorted((e.fqn, e.group.size) for h in handles_of(self.parts) for e in h.plan.entries if e.group)

    def muon_groups(self) -> int:
        return sum(1 for o in self.container.dmuon_optimizers() for g in o.param_groups if g["use_muon"])


def _recorded(rank, world, layout, folder):
    """This rank's issued operations over two steps, a save, a new job's build, load and first step; the
    first job's owner groups and Muon param groups."""
    recorder = IssueRecorder()
    with recorder:
        first = _Job(world, layout, folder, seed=0)
        first.train(2)
        first.manager.close()
        resumed = _Job(world, layout, folder, seed=1)
        assert resumed.manager.load(step=2) and resumed.counter.step == 2
        resumed.train(3)
        resumed.manager.close()
    return recorder.records, first.grouped(), first.muon_groups()


def _kinds(records) -> set[str]:
    return {kind for kind, _, _, _ in records}


@pytest.mark.parametrize("layout", ["tp", "ep", "cp", "pp"])
def test_every_communicator_sees_one_order(pool4, tmp_path, layout):
    """The layout's job on 4 ranks, recorded: one sequence per communicator on all its ranks, one global
    order of the collectives; and the job did what it is here for: two Muon param groups, owner groups
    (none under TP), Gram all-reduces on groups of 2 (and the layout's own exchanges: TP's and CP's
    collectives on 2 ranks, EP's all-to-all, the pipeline's send/recv)."""
    results = pool4.run(_recorded, layout, str(tmp_path))
    sequences = [records for records, _, _ in results]
    check_issue_order(sequences)
    for _, grouped, muon_groups in results:
        assert muon_groups == 2
        assert (grouped == []) if layout in ("tp", "ep") else grouped, grouped
    kinds = set().union(*(_kinds(s) for s in sequences))
    pairs = {c.ranks for s in sequences for _, c, _, _ in s if not c.p2p and len(c.ranks) == 2}
    assert pairs, "no collective on two ranks (TP's, CP's or an owner group's)"
    if layout == "ep":
        assert kinds & {"alltoall_", "alltoall_base_", "all_to_all_single"}, kinds
    if layout == "pp":
        assert "p2p" in kinds, kinds


def test_the_check_holds_point_to_point_to_each_direction_only():
    """A batch's sends and receives may be posted in any order (no cross reported), but a direction's
    sequence must match on both ends."""
    ab, ba = Communicator((0, 1), "1", True), Communicator((1, 0), "1", True)
    world = Communicator((0, 1), "0")
    rank0 = [("p2p", ab, ((4,),), "f"), ("p2p", ba, ((4,),), "f"), ("allreduce_", world, ((1,),), "f")]
    rank1 = [("p2p", ba, ((4,),), "f"), ("p2p", ab, ((4,),), "f"), ("allreduce_", world, ((1,),), "f")]
    check_issue_order([rank0, rank1])
    wrong = [("p2p", ba, ((4,),), "f"), ("p2p", ab, ((8,),), "f"), ("allreduce_", world, ((1,),), "f")]
    with pytest.raises(AssertionError, match="another sequence"):
        check_issue_order([rank0, wrong])
