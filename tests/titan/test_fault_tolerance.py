"""Fault tolerance across replica groups, in-process (no TorchFT needed): the all-reduce hook.

Under TorchFT every replica group dedicates on its own mesh and each owner's reduced gradient is
averaged with the owners at the same coordinate of every other group (``set_all_reduce_hook``,
as FSDP2's). Here 4 gloo ranks play 2 groups of 2: the hook all-reduces over the ranks with the
same group rank, exactly where TorchFT's ``Manager.allreduce`` runs in a real job
(``tests/e2e/test_fault_tolerance_e2e.py`` runs that, with a lighthouse, faults and healing).
"""

import dataclasses
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

from tests.support.helpers import (
    TOLERANCE,
    batches,
    bitwise_equal,
    distribute,
    full_state,
    global_loss,
    max_diff,
    reference_train,
    toy_model,
    train,
)
from titan_dmuon.integration.config.validation.fault_tolerance_section import torchft_missing

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
GROUPS = 2
needs_torchft = pytest.mark.skipif(
    torchft_missing(),
    reason="torchft is not installed (pip install -e '.[ft]'; the "
    "test extra has it): configs that enable fault tolerance are refused without it",
)


def _two_groups_of_two(rank, world, max_norm):
    """2 replica groups x FSDP 2 (DMuon-Z3 in each), gradients averaged across the groups by the
    hooks, against one process on the whole batch (4 slices, summed as the groups sum them)."""
    data = batches(STEPS)
    model = toy_model()
    ref, ref_losses, ref_norms = reference_train(model, data, max_norm=max_norm, slices=world)
    grid = init_device_mesh("cpu", (GROUPS, world // GROUPS), mesh_dim_names=("group", "dp_shard"))
    across = grid.get_group("group")  # (rank r of every group: what TorchFT's process group links)

    def average_across_groups(tensor):
        dist.all_reduce(tensor, group=across)
        tensor.div_(GROUPS)

    setup = distribute(model, "z3", world, mesh=grid["dp_shard"])
    setup.handle.set_all_reduce_hook(average_across_groups)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(average_across_groups)
    log = train(setup, data, rank, world, max_norm=max_norm)
    ns = torch.tensor([n for _, _, n in log], dtype=torch.int64)
    dist.all_reduce(ns)
    state = full_state(setup)  # (within the group)
    others = [None] * world
    dist.all_gather_object(others, {k: v for k, v in state.items()})
    return {
        "diff": max_diff(state, ref),
        "losses": global_loss([loss for loss, _, _ in log]),
        "ref_losses": ref_losses,
        "norms": [norm for _, norm, _ in log],
        "ref_norms": ref_norms,
        "ns_per_step": ns.tolist(),
        "matrices": len(setup.handle.plan.entries),
        "groups_identical": bitwise_equal(others[rank % 2], others[2 + rank % 2]),
    }


@pytest.mark.parametrize("max_norm", [None, 0.5])
def test_replica_groups_train_as_one_batch(pool4, max_norm):
    """The groups together train as one process on the union of their batches (to TOLERANCE: bf16
    Newton-Schulz; the clip's global norm, within each group over the averaged gradients, to 1e-5
    at step 1), the groups stay bitwise identical, and Newton-Schulz runs once per matrix per
    group: the job's count per step is groups x matrices."""
    for r in pool4.run(_two_groups_of_two, max_norm):
        assert r["diff"] < TOLERANCE
        assert r["losses"] == pytest.approx(r["ref_losses"], abs=1e-4)
        assert r["groups_identical"]
        assert r["ns_per_step"] == [GROUPS * r["matrices"]] * STEPS
        if max_norm is not None:
            assert r["norms"][0] == pytest.approx(r["ref_norms"][0], rel=1e-5)
            assert all(n > max_norm for n in r["ref_norms"])  # (clipping was active)


def _hook_on_hsdp(rank, world):
    setup = distribute(toy_model(), "hsdp", world)
    with pytest.raises(NotImplementedError, match="global owner"):
        setup.handle.set_all_reduce_hook(lambda t: None)
    return True


def test_hook_refused_under_hsdp(pool4):
    """HSDP's gradient reaches one global owner only: no peer to average with."""
    assert all(pool4.run(_hook_on_hsdp))


# ---- the manager's own hook: TorchFT's average across the groups, and its figures --------------------------
class _Quorum:
    """What DMuonTorchFTManager's hook reaches of a torchft Manager through torchft's
    ManagedProcessGroup: ``allreduce(tensor, reduce_op)`` with torchft's contract (an AVG is the
    sum over the participants divided by their number), over the gloo ranks (each rank here is
    rank 0 of its own one-rank group), and the participants."""

    def __init__(self):
        self._pg = dist.group.WORLD
        self.averaged = []  # per call: whether the hook asked for an average

    def num_participants(self):
        return dist.get_world_size()

    def current_step(self):
        return 0

    def allreduce(self, tensor, should_quantize=False, reduce_op=dist.ReduceOp.AVG):
        from torchft.work import _DummyWork

        self.averaged.append(reduce_op == dist.ReduceOp.AVG)
        dist.all_reduce(tensor, group=self._pg)
        if reduce_op == dist.ReduceOp.AVG:
            tensor /= self.num_participants()
        return _DummyWork(tensor)


def _managers_own_hook(rank, world):
    """Two replica groups of one rank each (Z3 on a one-rank mesh, as TorchFT's groups dedicate on
    their own mesh): the hook DMuonTorchFTManager installs on DMuon's handle and on FSDP2's modules,
    first on a known tensor, then through a backward, against the mean of the groups' gradients
    computed without it; and the figures it counts (``AcrossGroups``)."""
    from torchft.process_group import ManagedProcessGroup

    from titan_dmuon.integration.distributed.fault_tolerance import DMuonTorchFTManager
    from titan_dmuon.runtime import DedicatedParams

    manager = DMuonTorchFTManager(DMuonTorchFTManager.Config())  # (not enabled: no lighthouse; given a quorum)
    quorum = _Quorum()
    manager._manager, manager.replicate_pg = quorum, ManagedProcessGroup(quorum)
    grid = init_device_mesh("cpu", (world, 1), mesh_dim_names=("group", "dp_shard"))
    setup = distribute(toy_model(), "z3", 1, mesh=grid["dp_shard"])
    x, y = batches(1)[0]
    x, y = x[rank::world], y[rank::world]  # each group its own data
    from titan_dmuon.testing.toy_model import loss_fn

    loss_fn(setup.module(x), y).backward()  # step 1 (records the layer order), no hook: this group's gradients
    own = {n: p.grad.detach().clone() for n, p in setup.model.named_parameters()}
    setup.opt.zero_grad()
    installed, real_set = [], DedicatedParams.set_all_reduce_hook
    DedicatedParams.set_all_reduce_hook = lambda self, hook: (installed.append(hook), real_set(self, hook))[1]
    try:
        manager.maybe_set_all_reduce_hook([setup.model])
    finally:
        DedicatedParams.set_all_reduce_hook = real_set
    (hook,) = installed
    known = torch.full((5,), float(rank + 1))
    hook(known)
    out = {"known": known.tolist(), "known_figures": manager.figures.figures(1)}
    loss_fn(setup.module(x), y).backward()
    out["figures"] = manager.figures.figures(1)
    out["held"] = sum(p.numel() for p in setup.model.parameters() if p.requires_grad)  # (all of it: one-rank group)
    everyone = [None] * world
    dist.all_gather_object(everyone, own)
    mean = {n: sum(g[n] for g in everyone) / world for n in own}
    out["diff"] = max((p.grad - mean[n]).abs().max().item() for n, p in setup.model.named_parameters())
    out["averaged"] = quorum.averaged
    return out


@needs_torchft
def test_the_managers_own_hook_averages_across_groups_and_counts_what_it_moves(pool2):
    """The hook DMuonTorchFTManager installs (``maybe_set_all_reduce_hook``) on DMuon's handle and
    FSDP2's modules averages across the groups: a known tensor (1 on one group, 2 on the other)
    becomes 1.5 on both, and after a backward every gradient is the mean of the two groups' own
    (to 1e-6: two fp32 terms, summed and halved here as there). Regression: the in-process tests
    installed their own hook, so a hook that summed (``op=SUM``) passed them, and the e2e test
    compares the groups only with each other. Its figures, counted where it runs: every element
    it all-reduces, and 2(G-1)/G of them moved (G = 2: as many), once per gradient element the
    rank holds per backward (checked only end to end before)."""
    for r in pool2.run(_managers_own_hook):
        assert r["known"] == [1.5] * 5
        known, backward = r["known_figures"], r["figures"]
        assert known["ft/allreduced_elements_per_rank"] == known["ft/moved_elements_per_rank"] == 5
        assert backward["ft/allreduced_elements_per_rank"] == backward["ft/moved_elements_per_rank"] == r["held"]
        assert r["diff"] < 1e-6, r["diff"]
        assert len(r["averaged"]) > 1 and all(r["averaged"])


# ---- the optimizer container's commit and the state TorchFT serves (a stand-in manager) -----------------
class _Manager:
    """What the container asks TorchFT's Manager: a quorum per zero_grad, a decision per step."""

    def __init__(self):
        self.quorums, self.commit = 0, True

    def start_quorum(self):
        self.quorums += 1

    def should_commit(self):
        return self.commit


def _ft_container(model, manager, *, use_async_quorum=False):
    from types import SimpleNamespace

    from titan_dmuon.integration.distributed.fault_tolerance import DMuonFTOptimizersContainer

    ft = SimpleNamespace(enabled=True, per_step=True, use_async_quorum=use_async_quorum, manager=manager)
    config = DMuonFTOptimizersContainer.Config(name="dmuon", implementation="for-loop", lr=0.02)
    return config.build(model_parts=[model], ft_manager=ft)


def _local_tensors(model, container):
    from torch.distributed.tensor import DTensor

    def local(t):
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    weights = {n: local(p) for n, p in model.named_parameters()}
    state = {
        (id(p), k): local(v)
        for o in container.optimizers
        for p, s in o.state.items()
        for k, v in s.items()
        if torch.is_tensor(v)
    }
    return weights, state


def _commit_and_served_state(rank, world):
    from tests.support import titan_harness as th
    from titan_dmuon.integration.trainer import dmuon_handles

    dims = th.parallel_dims(world)
    model, _ = th.build(th.tiny_llama3(), dims)
    manager = _Manager()
    container = _ft_container(model, manager)
    owned = [m for h in dmuon_handles(container) for m in h.members if m.runs_ns]
    out = {
        "momentum_at_construction": bool(owned)
        and all("momentum_buffer" in container.dmuon_optimizers()[0].state[m.param] for m in owned)
    }
    container.init_cache_state_dict()  # (TorchFT's checkpoint manager does this once)
    served = container.state_dict()
    data = th.batches(2, world)
    before = _local_tensors(model, container)
    manager.commit = False
    th.train(model, container, dims, data[:1])
    after_discarded = _local_tensors(model, container)
    out["discarded_changes_nothing"] = all(
        torch.equal(before[i][k], after_discarded[i][k]) for i in (0, 1) for k in before[i]
    )
    manager.commit = True
    th.train(model, container, dims, data[1:])
    after = _local_tensors(model, container)
    out["committed_changes"] = any(not torch.equal(before[0][k], after[0][k]) for k in before[0])
    out["quorums"] = manager.quorums  # (one per zero_grad: each step's, after its optimizer step)
    live = {
        (id(p), k): v
        for o in container.optimizers
        for p, s in o.state.items()
        for k, v in s.items()
        if torch.is_tensor(v)
    }
    served_tensors = [v for v in served.values() if torch.is_tensor(v)]
    out["served_is_live"] = all(any(t is v for v in live.values()) for t in served_tensors)  # updated in place
    for o in container.optimizers:
        for group in o.param_groups:
            group["lr"] = 0.123  # as the LR schedule does each step
    from titan_dmuon.integration.distributed import fault_tolerance

    synchronized, real_sync = [], fault_tolerance.synchronize_device
    fault_tolerance.synchronize_device = lambda device: synchronized.append(str(device))
    try:
        out["served_lr"] = {v for k, v in container.state_dict().items() if k.endswith(".lr")}
    finally:
        fault_tolerance.synchronize_device = real_sync
    out["synchronized"] = synchronized
    with pytest.raises(NotImplementedError, match="asynchronous quorum"):
        _ft_container(model, manager, use_async_quorum=True)
    return out


def test_commit_gate_and_the_state_torchft_serves(pool2):
    """TorchTitan's model family on FSDP 2 with DMuon's fault-tolerant container: every owner's
    momentum exists from construction; a step TorchFT does not commit changes no weight or
    optimizer state; the state dict TorchFT serves to a joining group holds the live tensors (the
    step updates them in place) and the learning rate as it is now (TorchTitan's cached copy kept
    the first step's: a healed group then stepped with another LR than its peers), after the host
    waited for the device of the parameters (TorchFT copies the live tensors on its quorum thread
    and stream, which nothing else orders after the step's writes: a healing group could get
    half-updated momentum; ``synchronize_device`` itself is checked in test_runtime_streams.py); an
    asynchronous quorum is refused."""
    for r in pool2.run(_commit_and_served_state):
        assert r["momentum_at_construction"]
        assert r["discarded_changes_nothing"] and r["committed_changes"]
        assert r["quorums"] == 2
        assert r["served_is_live"]
        assert r["served_lr"] == {0.123}
        assert r["synchronized"] == ["cpu"]  # (every parameter of this job is on the CPU)


# ---- semi-sync: weights TorchFT writes after DMuon's step reach the next forward -------------------
def _forward_after_written_weights(rank, world, refresh):
    from types import SimpleNamespace

    from tests.support import titan_harness as th
    from titan_dmuon.integration.distributed.fault_tolerance import drop_gathers_after_syncs
    from titan_dmuon.integration.trainer import dmuon_handles

    dims = th.parallel_dims(world)
    model, container = th.build(th.tiny_llama3(), dims)
    data = th.batches(2, world)
    th.train(model, container, dims, data[:1])  # (its step starts the first layer's broadcast for the next forward)
    handles = dmuon_handles(container)
    with torch.no_grad():
        for m in handles[0].members:
            if m.holds_full:
                m.param.data.copy_(torch.randn_like(m.param) * 0.02)  # as LocalSGD/DiLoCo write them
    if refresh:
        ft = SimpleNamespace(enabled=True, per_step=False, commit_decisions=1)
        assert drop_gathers_after_syncs(ft, handles, 0) == 1
    tokens = data[1][rank * 2 : (rank + 1) * 2]
    with torch.no_grad():
        first = model(tokens[:, :-1]).float()
        second = model(tokens[:, :-1]).float()  # (gathers every layer anew)
    return torch.equal(first, second)


@pytest.mark.parametrize("refresh", [True, False])
def test_forward_after_a_sync_sees_the_written_weights(pool2, refresh):
    """LocalSGD and DiLoCo write the weights in the optimizer's step post-hook, after DMuon's step
    broadcast the first layer for the next forward: that forward used the old first layer. After a
    sync (a should_commit decision) the fault-tolerant trainer drops what was gathered ahead; without
    it (refresh=False) the forward is not the one of the written weights."""
    assert pool2.run(_forward_after_written_weights, refresh) == [refresh] * 2


# ---- config doors and refusals (in-process, no torchft job) -----------------------------------------
def _ft_job(**ft):
    from torchtitan.experiments.torchft.config.job_config import FaultTolerance
    from torchtitan.experiments.torchft.trainer import FaultTolerantTrainer
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    base = llama3_debugmodel()
    base.checkpoint.enable = True
    values = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    return FaultTolerantTrainer.Config(**values, fault_tolerance=FaultTolerance(enable=True, group_size=2, **ft))


def _problem(config_fn, *args, **kwargs) -> str:
    from titan_dmuon.integration.config.validation.naming import ConfigError

    with pytest.raises(ConfigError) as info:
        config_fn(*args, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


@needs_torchft
def test_fault_tolerant_configs_from_both_doors(monkeypatch):
    """TorchTitan's FaultTolerantTrainer.Config through with_dmuon, the registry's job and the TOML
    file all become DMuon's fault-tolerant trainer config, setting for setting the same job;
    --fault_tolerance.* on the command line applies (TorchTitan's keys)."""
    monkeypatch.chdir(ROOT)
    from tests.support.titan_configs import comparable
    from titan_dmuon import with_dmuon
    from titan_dmuon.config_registry import llama3_debugmodel_dmuon_ft
    from titan_dmuon.integration.config.toml_file import load_config
    from titan_dmuon.integration.distributed.fault_tolerance import (
        DMuonFaultTolerantTrainer,
        DMuonFTCheckpointManager,
        DMuonFTOptimizersContainer,
        DMuonTorchFTManager,
    )

    config = with_dmuon(_ft_job())
    assert isinstance(config, DMuonFaultTolerantTrainer.Config)
    assert isinstance(config.optimizer, DMuonFTOptimizersContainer.Config) and config.optimizer.name == "dmuon"
    assert isinstance(config.checkpoint, DMuonFTCheckpointManager.Config)
    assert isinstance(config.fault_tolerance, DMuonTorchFTManager.Config) and config.fault_tolerance.group_size == 2
    python = llama3_debugmodel_dmuon_ft()
    toml = load_config("train_configs/debug_model_ft.toml", world_size=2)
    assert type(python) is type(toml) and comparable(python) == comparable(toml)
    cli = load_config(
        "train_configs/debug_model_ft.toml",
        ["--fault_tolerance.replica_id", "1", "--fault_tolerance.semi_sync_method", "diloco"],
    )
    assert (cli.fault_tolerance.replica_id, cli.fault_tolerance.semi_sync_method) == (1, "diloco")
    plain = load_config("train_configs/debug_model.toml", world_size=2)  # (no [fault_tolerance]: DMuon's own trainer)
    assert type(plain).__qualname__ == "DMuonTrainer.Config" and not hasattr(plain, "fault_tolerance")


@needs_torchft
@pytest.mark.parametrize(
    "change, expected",
    [
        (
            dict(parallelism={"data_parallel_replicate_degree": 2}),
            "data_parallel_replicate_degree = 2 with fault_tolerance.enable = true: "
            "DMuon's HSDP reduces each gradient to one global owner",
        ),
        (
            dict(parallelism={"pipeline_parallel_degree": 2}),
            "pipeline_parallel_degree = 2 with fault_tolerance.enable = true",
        ),
        (
            dict(parallelism={"context_parallel_degree": 2}),
            "context_parallel_degree = 2 with fault_tolerance.enable = true",
        ),
        (dict(checkpoint={"enable": False}), "checkpoint.enable = false: TorchFT's state transfer"),
        (dict(fault_tolerance={"semi_sync_method": "streaming"}), "semi_sync_method = 'streaming': expected unset"),
        (
            dict(fault_tolerance={"replica_id": 2}),
            "replica_id = 2: expected this group's index, 0 to group_size - 1 = 1",
        ),
        (
            dict(fault_tolerance={"semi_sync_method": "diloco", "sync_steps": 3, "num_fragments": 2}),
            "sync_steps = 3 with num_fragments = 2",
        ),
        (
            dict(optimizer={"qk_clip_threshold": 100.0}),
            "QK-clip's per-head max logit would cover one group's batch only",
        ),
    ],
)
def test_what_cannot_run_under_torchft_is_refused_by_name(change, expected):
    from titan_dmuon import with_dmuon

    config = _ft_job()
    options = change.pop("optimizer", {})
    for section, values in change.items():
        for key, value in values.items():
            setattr(getattr(config, section), key, value)
    assert expected in _problem(with_dmuon, config, **options)


def test_without_torchft_enabling_fault_tolerance_names_the_extra(monkeypatch):
    from titan_dmuon import with_dmuon
    from titan_dmuon.integration.config.validation import fault_tolerance_section

    monkeypatch.setattr(fault_tolerance_section, "torchft_missing", lambda: True)
    assert "needs TorchFT, which is not installed: pip install -e '.[ft]'" in _problem(with_dmuon, _ft_job())


@needs_torchft
def test_the_lighthouse_is_checked_before_the_job(monkeypatch):
    """On this machine (the pre-launch check, each worker): TORCHFT_LIGHTHOUSE unset, or nothing
    answering there, is one line with the command to start it (TorchFT itself waited its 60 s
    connect timeout and failed deep in its Rust client)."""
    from titan_dmuon import with_dmuon
    from titan_dmuon.integration.config.validation.validate import validate_dmuon

    config = with_dmuon(_ft_job())
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    assert "TORCHFT_LIGHTHOUSE is not set" in _problem(validate_dmuon, config, this_machine=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # (closed again below: nothing listens there)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", f"http://localhost:{port}")
    monkeypatch.setenv("TORCHFT_CONNECT_TIMEOUT_SEC", "0.5")
    message = _problem(validate_dmuon, config, this_machine=True)
    assert (
        message.startswith(f"no TorchFT lighthouse answers at http://localhost:{port}")
        and "torchft_lighthouse" in message
    )
    validate_dmuon(config)  # (a config may be checked anywhere: the lighthouse only where the job runs)


@needs_torchft
def test_moe_with_load_balancing_is_refused():
    """TorchTitan updates a MoE's expert bias from one group's token counts: the groups would drift."""
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    from titan_dmuon import with_dmuon

    base = qwen3_moe_debug()
    job = _ft_job()
    job.model_spec = base.model_spec
    assert "load_balance_coeff" in _problem(with_dmuon, job)


def test_a_groups_data_position_loads_in_its_group():
    """Each TorchFT group saves the data position of its own ranks (dp ranks 2 and 3 of 4 for group 1):
    DMuon's check before a load counted 2 saved positions against a degree of 4 and stopped the
    restarted group ("saved with data-parallel degree 2 and this job has 4"). Per group it is 2 and 2."""
    from types import SimpleNamespace

    from titan_dmuon.integration.components.checkpoint import _data_parallel_change

    saved = SimpleNamespace(state_dict_metadata={"dataloader.dp_rank_2": None, "dataloader.dp_rank_3": None})
    loader = {"dataloader": SimpleNamespace(dp_world_size=4)}
    assert _data_parallel_change(loader, saved, replica_groups=2) == []
    assert "this job has 4" in _data_parallel_change(loader, saved)[0]
