"""DMuon from TorchTitan Python configs: with_dmuon, titan_dmuon.config_registry, TorchTitan's own
command-line overrides, and the checks at build time. In-process, no training (the end-to-end
runs through the three doors are in test_titan_checkpoint_e2e.py)."""

import importlib
import os
import re
import subprocess
import sys
import textwrap
import types

import pytest

from tests.support.titan_configs import USER_MODULE, comparable, parse_args
from titan_dmuon import with_dmuon
from titan_dmuon.integration.config.finalize import prepare_for_build
from titan_dmuon.integration.config.toml_file import ConfigError, load_config
from titan_dmuon.integration.distributed.parallelize import DEFAULT_MUON_PARAMS, DedicationSettings, DMuonParallelize
from titan_dmuon.plan.owner_groups import GroupOptions

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module", autouse=True)
def in_repo_root():
    """The debug configs make and read ./assets/debug, like run_train.sh (which runs from the root)."""
    cwd = os.getcwd()
    os.chdir(ROOT)
    yield
    os.chdir(cwd)


@pytest.mark.parametrize(
    "toml, function, world, family_parallelize",
    [
        ("debug_model", "llama3_debugmodel_dmuon", 2, "parallelize_llama"),
        ("debug_model_z2", "llama3_debugmodel_dmuon_z2", 2, "parallelize_llama"),
        ("debug_model_hsdp", "llama3_debugmodel_dmuon_hsdp", 4, "parallelize_llama"),
        ("debug_model_pp", "llama3_debugmodel_dmuon_pp", 4, "parallelize_llama"),
        ("llama3_8b", "llama3_8b_dmuon", 32, "parallelize_llama"),
        ("llama3_70b", "llama3_70b_dmuon", 64, "parallelize_llama"),
        ("debug_model_moe", "qwen3_moe_debug_dmuon", 2, "parallelize_qwen3"),
        ("qwen3_30b_a3b", "qwen3_30b_a3b_dmuon", 64, "parallelize_qwen3"),
        ("deepseek_v3_16b", "deepseek_v3_16b_dmuon", 64, "parallelize_deepseekv3"),
        ("moonlight_16b_a3b", "moonlight_16b_a3b_dmuon", 64, "parallelize_kimi_k2_5"),
    ],
)
def test_registry_configs_are_the_toml_jobs(toml, function, world, family_parallelize):
    """Every setting of each registry config equals its TOML file's, the model spec included."""
    registry = importlib.import_module("titan_dmuon.config_registry")
    python = getattr(registry, function)()
    from_toml = load_config(f"train_configs/{toml}.toml", world_size=world)
    assert type(python) is type(from_toml) and type(python).__qualname__ == "DMuonTrainer.Config"
    assert comparable(python) == comparable(from_toml)
    for config in (python, from_toml):
        fn = config.model_spec.parallelize_fn
        assert isinstance(fn, DMuonParallelize) and not fn.bound and fn.base_fn.__name__ == family_parallelize


def test_a_users_with_dmuon_config_is_the_main_job(tmp_path, monkeypatch):
    """The user-style module that test_titan_checkpoint_e2e trains: with_dmuon on TorchTitan's own
    debug config with two options gives exactly debug_model.toml (unset options keep what TOML
    gives an unset key)."""
    user = _user_module(tmp_path, monkeypatch)
    assert comparable(user.my_dmuon_job()) == comparable(load_config("train_configs/debug_model.toml", world_size=2))


def _user_module(tmp_path, monkeypatch) -> types.ModuleType:
    (tmp_path / "user_dmuon_configs.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module("user_dmuon_configs")


def test_with_dmuon_keeps_what_it_is_not_given():
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = with_dmuon(llama3_debugmodel(), lr=0.02)
    opt = config.optimizer
    assert (opt.name, opt.lr, opt.weight_decay, opt.adamw_lr, opt.reshard_after_forward) == (
        "dmuon",
        0.02,
        0.1,
        8e-4,
        None,
    )
    again = with_dmuon(config, momentum=0.9, muon_params=(r"\.w1\.weight$",))
    assert (again.optimizer.lr, again.optimizer.momentum, again.optimizer.muon_params) == (
        0.02,
        0.9,
        [r"\.w1\.weight$"],
    )
    default = with_dmuon(again, muon_params=None, reshard_after_forward=None).optimizer
    assert default.muon_params == list(DEFAULT_MUON_PARAMS) and default.reshard_after_forward is None


# (with_dmuon keywords, a change to the config first, the same job as TOML)
SAME_ERRORS = [
    (dict(momentum=1.5), None, '[optimizer]\nname = "dmuon"\nmomentum = 1.5\n'),
    (dict(ns_steps=0), None, '[optimizer]\nname = "dmuon"\nns_steps = 0\n'),
    (dict(momentum="0.9"), None, '[optimizer]\nname = "dmuon"\nmomentum = "0.9"\n'),
    (dict(adamw_betas=[0.9]), None, '[optimizer]\nname = "dmuon"\nadamw_betas = [0.9]\n'),
    (dict(adjust_lr_fn="rms"), None, '[optimizer]\nname = "dmuon"\nadjust_lr_fn = "rms"\n'),
    (
        dict(ns_method="gram", ns_mode="exact"),
        None,
        '[optimizer]\nname = "dmuon"\nns_method = "gram"\nns_mode = "exact"\n',
    ),
    (dict(muon_params=["("]), None, '[optimizer]\nname = "dmuon"\nmuon_params = ["("]\n'),
    (
        {},
        ("parallelism", "context_parallel_load_balancer", "roundrobin"),
        '[optimizer]\nname = "dmuon"\n[parallelism]\ncontext_parallel_load_balancer = "roundrobin"\n',
    ),
    (
        {},
        ("training", "enable_cpu_offload", True),
        '[optimizer]\nname = "dmuon"\n[training]\nenable_cpu_offload = true\n',
    ),
    ({}, ("training", "steps", 0), '[optimizer]\nname = "dmuon"\n[training]\nsteps = 0\n'),
]


@pytest.mark.parametrize("options, change, toml", SAME_ERRORS)
def test_python_door_errors_are_the_toml_errors(tmp_path, options, change, toml):
    """The same bad setting gives the same one-line message through both doors; TOML adds the file
    and writes the key as ``[section] key``, Python as ``section.key``."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    if change is not None:
        section, key, value = change
        setattr(getattr(config, section), key, value)
    with pytest.raises(ConfigError) as python:
        with_dmuon(config, **options)
    path = tmp_path / "job.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as from_toml:
        load_config(str(path), world_size=2)
    expected = re.sub(r"\[(\w+)\] (\w+)", r"\1.\2", str(from_toml.value).removeprefix(f"{path}: "))
    assert str(python.value) == expected
    assert "\n" not in str(python.value)


def test_with_dmuon_takes_a_trainer_config():
    with pytest.raises(ConfigError, match="expected a TorchTitan Trainer.Config, got dict"):
        with_dmuon({"optimizer": "dmuon"})


def test_command_line_overrides_reach_the_parallelize_step(monkeypatch):
    """TorchTitan applies overrides after with_dmuon ran, into a new config object; DMuon's
    settings must come from that object (a parallelize_fn that captured them when the config
    function ran would silently train Z3 with the default targets here)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = parse_args(
        "--optimizer.lr",
        "0.01",
        "--optimizer.reshard_after_forward",
        "False",
        "--optimizer.muon_params",
        r"\.feed_forward\.w1\.weight$,\.attention\.wo\.weight$",
        "--optimizer.no-nesterov",
        "--training.steps",
        "4",
        "--metrics.count_all_comm",
    )
    assert type(config).__qualname__ == "DMuonTrainer.Config"
    assert (config.optimizer.lr, config.optimizer.nesterov, config.training.steps) == (0.01, False, 4)
    assert config.metrics.count_all_comm is True
    fn = prepare_for_build(config).model_spec.parallelize_fn
    assert fn.bound and fn.dedication == DedicationSettings(
        muon_params=(r"\.feed_forward\.w1\.weight$", r"\.attention\.wo\.weight$"),
        reshard_after_forward=False,
        owner_groups=GroupOptions(),
    )
    adamw_config = prepare_for_build(parse_args("--optimizer.name", "AdamW", "--optimizer.lr", "0.0008"))
    adamw = adamw_config.model_spec.parallelize_fn
    assert adamw.bound and adamw.dedication is None  # TorchTitan's own parallelize_fn (plus the gloo fix)


@pytest.mark.parametrize(
    "args, world, message",
    [
        (["--optimizer.momentum", "1.5"], None, "optimizer.momentum = 1.5: expected a number in [0, 1)"),
        (
            ["--parallelism.context_parallel_degree", "2", "--parallelism.spmd_backend", "partial_dtensor"],
            None,
            "parallelism.spmd_backend = 'partial_dtensor' with parallelism.context_parallel_degree = 2 "
            "on a machine without an accelerator",
        ),
        (
            ["--parallelism.data_parallel_shard_degree", "3"],
            "2",
            "parallelism: data_parallel_shard_degree(3) * data_parallel_replicate_degree(1)",
        ),
    ],
)
def test_overrides_are_checked_when_the_trainer_is_built(monkeypatch, args, world, message):
    """Bad overrides stop DMuonTrainer before it starts any process group, with the same message."""
    import torch.distributed as dist

    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    config = parse_args(*args)
    with pytest.raises(ConfigError) as info:
        config.build()
    assert str(info.value).startswith(message), str(info.value)
    assert not dist.is_initialized()


def test_import_is_torchtitan_free_and_cpu_mode_switches_on_late():
    """``import titan_dmuon`` imports no TorchTitan; under TorchTitan's entry point our registry is
    imported after its trainer, so cpu.enable must fix the device choice those modules copied."""
    script = textwrap.dedent("""
        import sys
        import titan_dmuon
        assert not [m for m in sys.modules if m.startswith("torchtitan")], "import titan_dmuon imported TorchTitan"
        import torchtitan.train, torchtitan.tools.profiler  # noqa: E401  - what torchtitan.train imports first
        import torch
        if torch.accelerator.is_available():
            sys.exit(0)
        import titan_dmuon.config_registry
        stale = [n for n, m in list(sys.modules.items()) if n.startswith("torchtitan") and m is not None
                 and (vars(m).get("device_type") == "cuda" or vars(m).get("device_module") is torch.cuda)]
        assert not stale, stale
        import torchtitan.components.metrics as metrics, torchtitan.distributed.utils as dist_utils
        assert metrics.device_type == "cpu" and dist_utils.device_module is torch.cpu
        assert metrics.build_device_memory_monitor.__name__ == "CpuMemoryMonitor"
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


class _Loader:
    def __init__(self, dp_world_size):
        self.dp_world_size = dp_world_size


@pytest.mark.parametrize("saved, now", [(2, 4), (4, 2), (2, 1)])
def test_data_parallel_degree_change_is_named(saved, now):
    """TorchTitan keeps one dataloader state per dp rank and cannot reshard it: 2 -> 4 ranks failed
    with a missing ``dataloader.dp_rank_3``, 4 -> 2 with an assertion. The check says what to do."""
    from titan_dmuon.integration.components.checkpoint import _data_parallel_change

    metadata = types.SimpleNamespace(
        state_dict_metadata={**{f"dataloader.dp_rank_{r}": None for r in range(saved)}, "dataloader.world_size": None}
    )
    (problem,) = _data_parallel_change({"dataloader": _Loader(now)}, metadata)
    assert f"saved with data-parallel degree {saved} and this job has {now}" in problem
    assert "--checkpoint.exclude_from_loading dataloader" in problem and "data order restarts" in problem
    assert _data_parallel_change({"dataloader": _Loader(saved)}, metadata) == []
    assert _data_parallel_change({}, metadata) == []  # the dataloader excluded from loading


def test_cuda_graph_capture_is_turned_off_for_dmuon(monkeypatch, caplog):
    """TorchTitan captures forward+backward in a CUDA graph by default and then replays it without
    running Python: DMuon's hooks would not run. with_dmuon turns it off silently, and so does the
    trainer when a command-line override turns it back on, warning only where capture could happen
    (the warning fired on every CPU run, and in the Python door even with the flag given, because
    it ran before TorchTitan applied the overrides); AdamW keeps TorchTitan's setting."""
    import logging

    import torch
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert llama3_debugmodel().training.disable_cuda_graphs is False  # TorchTitan's default
    with caplog.at_level(logging.WARNING):
        config = with_dmuon(llama3_debugmodel(), lr=0.02)
        assert config.training.disable_cuda_graphs is True
        assert prepare_for_build(parse_args("--training.disable_cuda_graphs")).training.disable_cuda_graphs is True
        assert not [r for r in caplog.records if "cuda_graphs" in r.getMessage()]
        config.training.disable_cuda_graphs = False  # as --training.no-disable_cuda_graphs would
        assert prepare_for_build(config).training.disable_cuda_graphs is True
    warned = [r for r in caplog.records if "--training.disable_cuda_graphs" in r.getMessage()]
    assert len(warned) == (1 if torch.cuda.is_available() else 0)
    config.optimizer.name, config.optimizer.lr = "AdamW", config.optimizer.adamw_lr
    config.training.disable_cuda_graphs = False
    assert prepare_for_build(config).training.disable_cuda_graphs is False
