"""Muon param groups through TorchTitan's door: ``[[optimizer.param_groups]]`` with ``optimizer_name = "DMuon"``.

Two DMuon groups at their own settings, in config order with the first match winning (``w1`` at
MLP_W1_LR; then ``\\.feed_forward\\.``, which matches ``w1`` too but gets ``w2``/``w3``, at MLP_LR), the
attention projections in the default group (the flat keys, LR), on TorchTitan's llama3 shrunk to one layer
whose MLP dominates (``tests/support/titan_harness.py``), FSDP 2, with owner groups forced (``FORCED``:
the plan splits each MLP matrix over both ranks, so both DMuon groups hold grouped matrices) and
TorchTitan's warmup/decay LR schedule:

* both doors (the TOML text and ``with_dmuon`` on TorchTitan's config with the groups in its
  ``param_groups``) give the same optimizer config; the job trains as single-process ``torch.optim.Muon``
  with the same three param groups + ``torch.optim.AdamW`` under the same schedule, within GROUP_TOLERANCE
  (one owner's bf16 Newton–Schulz bound, widened by the owner group's own Newton–Schulz:
  tests/support/owner_groups_parts.py); the reference with every Muon group at LR is more than 4 times
  that far; each group's scheduled lr is the reference's, exactly;
* a resume through TorchTitan's CheckpointManager (new processes, another initial model) is bit for bit
  the job that never stopped: losses, weights, every rank's optimizer state and each group's lr;
* each bad setting is one line before launch, in either door's spelling.
"""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tests.support import titan_harness as th  # noqa: I001 (enables the CPU accommodations first)
from tests.support.helpers import Counter, full_parameters
from tests.support.owner_groups_parts import GROUP_TOLERANCE
from titan_dmuon.integration.config.toml_file import ConfigError, load_config
from titan_dmuon.plan.owner_groups import GroupOptions

STEPS = 4
SCHEDULE = dict(warmup_steps=2)  # TorchTitan's linear warmup, then linear decay over 2 * STEPS (lr > 0 at the end)
LR, MLP_W1_LR, MLP_LR = 0.02, 0.005, 0.04  # the default group (flat keys), then the two DMuon groups
ADAMW = dict(adamw_lr=1e-3, adamw_betas=(0.9, 0.95), adamw_eps=1e-8, adamw_weight_decay=0.1)
MODEL = dict(fuse_qkv=False, n_layers=1, hidden_dim=512)  # three MLP matrices of 8x the attention's NS cost
# Sums next to Newton–Schulz cost nothing, every figure given (none measured: the plan is the same anywhere):
# the plan splits the MLP matrices over both ranks (an odd number of dominant matrices leaves 2 ranks unbalanced).
FORCED = GroupOptions(
    ns_tflops=1e-3, node_size=2, latency_us=0.0, nic_latency_us=0.0, intra_node_gbps=360.0, nic_gbps=45.0, min_gain=0.0
)
W1 = {"lr": MLP_W1_LR, "weight_decay": 0.05}
MLP = {"lr": MLP_LR, "momentum": 0.9, "nesterov": False}

TOML = f"""
[model]
name = "llama3"
flavor = "debugmodel"

[optimizer]
name = "dmuon"
lr = {LR}
adamw_lr = {ADAMW["adamw_lr"]}

[[optimizer.param_groups]]
pattern = "\\\\.feed_forward\\\\.w1\\\\."
optimizer_name = "DMuon"
optimizer_kwargs = {{ lr = {MLP_W1_LR}, weight_decay = 0.05 }}

[[optimizer.param_groups]]
pattern = "\\\\.feed_forward\\\\."
optimizer_name = "dmuon"
optimizer_kwargs = {{ lr = {MLP_LR}, momentum = 0.9, nesterov = false }}
"""


def _groups():
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    return [
        ParamGroupConfig(pattern=r"\.feed_forward\.w1\.", optimizer_name="DMuon", optimizer_kwargs=dict(W1)),
        ParamGroupConfig(pattern=r"\.feed_forward\.", optimizer_name="dmuon", optimizer_kwargs=dict(MLP)),
    ]


def _reference_settings(name: str) -> dict:
    """Each Muon target's torch.optim.Muon group settings, written from the config above."""
    if ".feed_forward.w1." in name:
        return W1
    return MLP if ".feed_forward." in name else {"lr": LR}


def _toml_optimizer(tmp_path, text=TOML):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return load_config(str(path), world_size=2).optimizer


def _python_optimizer(groups):
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from titan_dmuon import with_dmuon

    config = llama3_debugmodel()
    config.optimizer.param_groups = groups + config.optimizer.param_groups  # (TorchTitan's catch-all AdamW last)
    return with_dmuon(config, lr=LR, adamw_lr=ADAMW["adamw_lr"]).optimizer


def _build(dims, optimizer, state):
    """The tiny llama3 (float32 compute) with the door's optimizer settings and owner groups forced, and
    TorchTitan's LR schedule."""
    from torchtitan.components.optimizer import LRSchedulersContainer

    settings = {f.name: getattr(optimizer, f.name) for f in dataclasses.fields(optimizer) if f.init}
    for key in ("name", "implementation", "owner_groups"):
        settings.pop(key)
    model, container = th.build(
        th.tiny_llama3(**MODEL), dims, state=state, param_dtype="float32", owner_groups=FORCED, **settings
    )
    schedule = LRSchedulersContainer.Config(**SCHEDULE).build(optimizers=container, training_steps=2 * STEPS)
    return model, container, schedule


def _muon_groups(container) -> list[tuple[list[str], float]]:
    return [(g["param_names"], g["lr"]) for o in container.dmuon_optimizers() for g in o.param_groups if g["use_muon"]]


def _trained(rank, world, optimizer, state, data):
    dims = th.parallel_dims(world)
    model, container, schedule = _build(dims, optimizer, state)
    (handle,) = container.dmuon_optimizers()[0].dedicated_handles()
    grouped = sorted(e.fqn for e in handle.plan.entries if e.group is not None)
    for batch in data:
        th.train(model, container, dims, [batch])
        schedule.step()
    return full_parameters(model, handle), _muon_groups(container), grouped


def _reference(state, data, settings_of=_reference_settings):
    """Single process: torch.optim.Muon with the Muon targets' groups, torch.optim.AdamW on the rest, TorchTitan's
    schedule on both, the global batch's mean token loss, clipped at 1 as th.train clips. Returns the weights
    and each Muon target's lr at the end."""
    from torchtitan.components.optimizer import LRSchedulersContainer

    from titan_dmuon.integration import cpu
    from titan_dmuon.integration.names import DEFAULT_MUON_PARAMS

    config, _ = th.tiny_llama3(**MODEL)
    cpu.use_sdpa_attention(config)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # (the buffers, e.g. RoPE's, which are not in the state dict)
    model.load_state_dict(copy.deepcopy(state))
    named = dict(model.named_parameters())
    targets = [n for n in named if any(re.search(p, n) for p in DEFAULT_MUON_PARAMS)]
    groups: dict = {}
    for name in targets:
        groups.setdefault(tuple(sorted(settings_of(name).items())), []).append(named[name])
    muon = torch.optim.Muon(
        [{"params": ps, **dict(settings)} for settings, ps in groups.items()],
        lr=LR,
        weight_decay=0.1,
        momentum=0.95,
        nesterov=True,
    )
    adamw = torch.optim.AdamW(
        [p for n, p in named.items() if n not in targets],
        lr=ADAMW["adamw_lr"],
        betas=ADAMW["adamw_betas"],
        eps=ADAMW["adamw_eps"],
        weight_decay=ADAMW["adamw_weight_decay"],
    )
    schedule = LRSchedulersContainer.Config(**SCHEDULE).build(optimizers=[muon, adamw], training_steps=2 * STEPS)
    for tokens in data:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="sum")
        (loss / (tokens.shape[0] * th.SEQ)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
        schedule.step()
    lrs = {n: g["lr"] for g in muon.param_groups for p in g["params"] for n in targets if named[n] is p}
    return {n: p.detach().clone() for n, p in named.items()}, lrs


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_two_dmuon_groups_through_both_doors_train_as_torch_muon(pool2, tmp_path, in_repo_root):
    toml, python = _toml_optimizer(tmp_path), _python_optimizer(_groups())
    assert toml.param_groups == python.param_groups == _groups()
    assert [(o.lr, o.momentum, o.weight_decay, o.adamw_lr) for o in (toml, python)] == [(LR, 0.95, 0.1, 1e-3)] * 2
    state = th.initial_state(th.tiny_llama3(**MODEL))
    data = th.batches(STEPS, 2)
    reference, reference_lrs = _reference(state, data)
    at_one_lr, _ = _reference(state, data, settings_of=lambda name: {"lr": LR})
    mlp = [n for n in reference_lrs if ".feed_forward." in n]
    for optimizer in (toml, python):
        weights, groups, grouped = pool2.run(_trained, optimizer, state, data)[0]
        assert [names for names, _ in groups] == [  # (config order, first match; the default group last)
            [n for n in mlp if ".w1." in n],
            [n for n in mlp if ".w1." not in n],
            [n for n in reference_lrs if n not in mlp],
        ]
        assert grouped == sorted(mlp)  # both DMuon groups' matrices are split over an owner group
        assert [lr for _, lr in groups] == [reference_lrs[names[0]] for names, _ in groups]
        assert len({lr for _, lr in groups}) == 3 and all(
            {reference_lrs[n] for n in names} == {lr} for names, lr in groups
        )
        assert _max_diff(weights, reference) <= GROUP_TOLERANCE
        assert _max_diff(weights, at_one_lr) > 4 * GROUP_TOLERANCE


# ---- resume through TorchTitan's checkpointer ------------------------------------------------------------------
def _checkpointed(rank, world, optimizer, state, folder, data, until, save=False, load=False):
    """The job from ``state``, loaded from ``folder``'s checkpoint if ``load``, trained to step ``until``, saved
    there if ``save``: (losses, weights, this rank's optimizer state, this rank's Muon groups and lrs)."""
    from titan_dmuon.integration.components.checkpoint import DMuonCheckpointManager

    dims = th.parallel_dims(world)
    model, container, schedule = _build(dims, optimizer, state)
    counter = Counter()
    manager = DMuonCheckpointManager.Config(enable=True, folder="ckpt", interval=1).build(
        dataloader=Counter(),
        model_parts=[model],
        optimizers=container,
        lr_schedulers=schedule,
        states={"train_state": counter},
        sd_adapter=None,
        base_folder=folder,
    )
    if load:
        assert manager.load() and counter.step == STEPS // 2
    losses = []
    while counter.step < until:
        losses += th.train(model, container, dims, [data[counter.step]])
        schedule.step()
        counter.step += 1
    if save:
        manager.save(counter.step)
    manager.close()
    (handle,) = container.dmuon_optimizers()[0].dedicated_handles()
    names = {id(p): n for n, p in model.named_parameters()}
    optimizer_state = {
        f"{names[id(p)]}/{key}": (value.to_local() if isinstance(value, DTensor) else value).clone()
        for o in container.optimizers
        for p, entries in o.state.items()
        for key, value in entries.items()
    }
    return losses, full_parameters(model, handle), optimizer_state, _muon_groups(container)


def test_two_dmuon_groups_resume_bit_exact_through_torchtitans_checkpointer(pool2, tmp_path, in_repo_root):
    """4 steps straight == 2 steps + save + new processes + a job from another initial model + load + 2 steps,
    bit for bit: every loss, every weight, every rank's optimizer state (Muon momentum on the owner groups'
    members, AdamW moments, steps), each Muon group's lr (its own, scheduled)."""
    optimizer = _toml_optimizer(tmp_path)
    state, other = (th.initial_state(th.tiny_llama3(**MODEL), seed=seed) for seed in (0, 1))
    data = th.batches(STEPS, 2)
    folder = str(tmp_path / "run")
    straight = pool2.run(_checkpointed, optimizer, state, str(tmp_path / "straight"), data, STEPS)
    first = pool2.run(_checkpointed, optimizer, state, folder, data, STEPS // 2, True)
    pool2.restart()
    second = pool2.run(_checkpointed, optimizer, other, folder, data, STEPS, False, True)
    for rank in range(2):
        (losses, weights, opt_state, groups), (resumed_losses, resumed, resumed_state, resumed_groups) = (
            straight[rank],
            second[rank],
        )
        assert first[rank][0] + resumed_losses == losses
        assert len(groups) == 3 and resumed_groups == groups
        assert any(k.endswith("/momentum_buffer") for k in opt_state) and opt_state.keys() == resumed_state.keys()
        assert [k for k in weights if not torch.equal(weights[k], resumed[k])] == []
        assert [k for k in opt_state if not torch.equal(opt_state[k], resumed_state[k])] == []


# ---- bad input: one line before launch ----------------------------------------------------------------------------
def _group(pattern="\\\\.feed_forward\\\\.", name="DMuon", kwargs="{ lr = 0.01 }"):
    return (
        f'\n[[optimizer.param_groups]]\npattern = "{pattern}"\noptimizer_name = "{name}"\noptimizer_kwargs = {kwargs}\n'
    )


BASE = '[model]\nname = "llama3"\nflavor = "debugmodel"\n\n[optimizer]\nname = "dmuon"\n'
BAD = [
    # (TOML text, the phrases of its one line)
    (
        BASE + _group("layers\\\\.9\\\\."),
        [
            "[optimizer] param_groups: the group with pattern 'layers\\\\.9\\\\.' (optimizer_name 'DMuon') matches no "
            "Muon target of the llama3 debugmodel model",
            "layers.*.attention.wo.weight",
        ],
    ),
    (
        BASE + _group("norm"),
        ["the group with pattern 'norm' (optimizer_name 'DMuon') matches no Muon target"],
    ),
    (
        BASE + _group("layers") + _group("layers\\\\.0\\\\.", name="dmuon"),
        [
            "the group with pattern 'layers\\\\.0\\\\.' (optimizer_name 'dmuon') matches only Muon targets that the "
            "earlier DMuon group with pattern 'layers' claims (the first match wins)"
        ],
    ),
    (
        BASE + _group(kwargs="{ betas = [0.9, 0.95] }"),
        [
            "the group with pattern '\\\\.feed_forward\\\\.': optimizer_kwargs key 'betas' is not a per-group Muon "
            "setting",
            "lr, weight_decay, momentum, nesterov, ns_steps, adjust_lr_fn, ns_mode",
        ],
    ),
    (
        BASE + _group(kwargs='{ ns_method = "gram" }'),
        ["optimizer_kwargs key 'ns_method' is not a per-group Muon setting (ns_method is job-wide"],
    ),
    (BASE + _group(kwargs="{ momentum = 1.5 }"), ["optimizer_kwargs momentum = 1.5: expected a number in [0, 1)"]),
    (BASE + _group(kwargs="{ lr = -0.1 }"), ["optimizer_kwargs lr = -0.1: expected a number >= 0"]),
    (
        BASE.replace('"dmuon"', '"AdamW"') + _group(),
        [
            "[optimizer] param_groups: the group with pattern '\\\\.feed_forward\\\\.' has optimizer_name 'DMuon', "
            "which puts Muon targets in a DMuon param group, but optimizer.name = 'AdamW' trains no Muon",
            'set name = "dmuon"',
        ],
    ),
    (BASE + _group("("), ["the group with pattern '(': bad regex"]),
    (
        BASE + _group("norm", name="DistMuon"),
        [
            "the group with pattern 'norm' has optimizer_name 'DistMuon': with optimizer.name = 'dmuon' a group is "
            "'DMuon'"
        ],
    ),
    (
        BASE + '\n[[optimizer.param_groups]]\npattern = "norm"\noptimizer_name = "DMuon"\nlr = 0.1\n',
        [
            "[optimizer] param_groups = ",
            "expected a list of tables with keys pattern, optimizer_name",
            "unknown key 'lr'",
        ],
    ),
]


@pytest.mark.parametrize("text, phrases", BAD, ids=range(len(BAD)))
def test_a_bad_dmuon_group_is_one_line_naming_the_file(tmp_path, text, phrases):
    with pytest.raises(ConfigError) as info:
        _toml_optimizer(tmp_path, text)
    message = str(info.value)
    assert message.startswith(str(tmp_path / "job.toml")) and "\n" not in message, message
    for phrase in phrases:
        assert phrase in message, message


def test_a_bad_dmuon_group_is_one_line_in_the_python_door_and_the_container():
    """with_dmuon names the setting as Python does; the container refuses a DMuon group of a non-dmuon job too
    (a config built without the doors), before it looks at a model."""
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    from titan_dmuon.integration.components.optimizer_container import DMuonOptimizersContainer

    bad = [ParamGroupConfig(pattern=r"layers\.9\.", optimizer_name="DMuon", optimizer_kwargs={"lr": 0.01})]
    with pytest.raises(ConfigError, match=r"^optimizer\.param_groups: the group with pattern 'layers\\\\.9\\\\.'"):
        _python_optimizer(bad)
    bad = [ParamGroupConfig(pattern=r"\.feed_forward\.", optimizer_name="DMuon", optimizer_kwargs={"nesterov": 1})]
    with pytest.raises(ConfigError, match="optimizer_kwargs nesterov = 1: expected true or false"):
        _python_optimizer(bad)
    config = DMuonOptimizersContainer.Config(name="AdamW", param_groups=_groups())
    with pytest.raises(ValueError, match="but optimizer.name = 'AdamW' trains no Muon"):
        DMuonOptimizersContainer(config, model_parts=[])
