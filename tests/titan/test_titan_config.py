"""TOML job configs: mapping onto TorchTitan 0.3.0, overrides, and every error message."""

import pytest

from titan_dmuon.integration.config.toml_file import ConfigError, load_config

CONFIGS = "train_configs"


def _write(tmp_path, text, name="job.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


MINIMAL = """
[model]
name = "llama3"
flavor = "debugmodel"

[optimizer]
name = "dmuon"
lr = 0.02
"""


SHIPPED = {  # config -> (world size, model spec name, expert parallel degree)
    "debug_model": (2, "llama3", 1),
    "debug_model_z2": (2, "llama3", 1),
    "debug_model_hsdp": (4, "llama3", 1),
    "debug_model_pp": (4, "llama3", 1),
    "debug_model_adamw": (2, "llama3", 1),
    "debug_model_moe": (2, "qwen3", 1),
    "llama3_8b": (32, "llama3", 1),
    "llama3_70b": (64, "llama3", 1),
    "qwen3_30b_a3b": (64, "qwen3", 1),
    "deepseek_v3_16b": (64, "deepseek_v3", 8),
    "moonlight_16b_a3b": (64, "kimi_k2_5", 8),
    "debug_model_shakespeare": (2, "llama3", 1),
    "debug_model_shakespeare_adamw": (2, "llama3", 1),
}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_configs_load(name):
    world, model, ep = SHIPPED[name]
    config = load_config(f"{CONFIGS}/{name}.toml", world_size=world)
    assert config.optimizer.name == ("AdamW" if name.endswith("adamw") else "dmuon")
    assert type(config).__name__ == "Config" and type(config).__qualname__ == "DMuonTrainer.Config"
    assert config.model_spec.name == model and config.parallelism.expert_parallel_degree == ep
    assert config.training.disable_cuda_graphs == (config.optimizer.name == "dmuon")  # the file (GPU configs) or DMuon


def test_toml_values_reach_torchtitan_fields():
    config = load_config(f"{CONFIGS}/debug_model.toml", world_size=2)
    assert config.training.steps == 20 and config.training.seq_len == 256
    assert config.optimizer.lr == 0.05 and config.optimizer.adamw_betas == (0.9, 0.95)
    assert config.optimizer.reshard_after_forward is True
    assert config.dataloader.dataset_path == "./assets/debug/text"
    assert config.hf_assets_path == "./assets/debug/tokenizer"
    assert type(config.activation_checkpoint).__qualname__ == "SelectiveAC.Config"
    assert config.model_spec.name == "llama3" and config.model_spec.flavor == "debugmodel"


def test_nested_config_as_a_sub_table_and_dotted_command_line_keys(tmp_path):
    """[validator.dataloader] (TorchTitan's validation data: a config inside a section) from a TOML
    sub-table, and --validator.dataloader.key on the command line over it."""
    config = load_config(f"{CONFIGS}/debug_model_shakespeare.toml", world_size=2)
    assert config.validator.enable and config.validator.freq == 25 and config.validator.steps == 4
    assert config.validator.dataloader.dataset_path == "./assets/shakespeare/validation"
    assert config.dataloader.dataset_path == "./assets/shakespeare/train"
    cli = load_config(
        f"{CONFIGS}/debug_model_shakespeare.toml",
        ["--validator.dataloader.dataset_path", "elsewhere", "--validator.freq", "5"],
        world_size=2,
    )
    assert cli.validator.dataloader.dataset_path == "elsewhere" and cli.validator.freq == 5
    bad = _write(tmp_path, MINIMAL + '[validator.dataloader]\ndatset_path = "x"\n')
    typo = r"unknown key \[validator.dataloader\] datset_path \(did you mean 'dataset_path'"
    with pytest.raises(ConfigError, match=typo):
        load_config(bad, world_size=2)
    with pytest.raises(ConfigError, match=r"command line: unknown key \[training\] steps.x"):
        load_config(_write(tmp_path, MINIMAL, "b.toml"), ["--training.steps.x", "3"], world_size=2)


def test_defaults_then_toml_then_command_line(tmp_path):
    path = _write(tmp_path, MINIMAL + "[training]\nsteps = 7\nseq_len = 64\n")
    config = load_config(
        path,
        ["--training.steps", "9", "--optimizer.nesterov=false", "--optimizer.adamw_betas", "0.8,0.9"],
        world_size=2,
    )
    assert config.training.steps == 9  # command line beats TOML
    assert config.training.seq_len == 64  # TOML beats the default
    assert config.training.local_batch_size == 8  # TorchTitan's llama3 debug default
    assert config.optimizer.nesterov is False and config.optimizer.adamw_betas == (0.8, 0.9)


def test_ns_method_from_toml_and_command_line(tmp_path):
    """[optimizer] ns_method (a DMuonOptions field, so a container key, a TOML key and a command-line
    override without more code), default "torch"; the command line beats the file."""
    assert load_config(_write(tmp_path, MINIMAL), world_size=2).optimizer.ns_method == "torch"
    path = _write(tmp_path, MINIMAL + 'ns_method = "gram"\n', "b.toml")
    assert load_config(path, world_size=2).optimizer.ns_method == "gram"
    overridden = load_config(path, ["--optimizer.ns_method", "polar_express"], world_size=2)
    assert overridden.optimizer.ns_method == "polar_express"


def test_activation_checkpoint_modes(tmp_path):
    full = load_config(_write(tmp_path, MINIMAL + '[activation_checkpoint]\nmode = "full"\n'), world_size=2)
    none = load_config(_write(tmp_path, MINIMAL + '[activation_checkpoint]\nmode = "none"\n', "b.toml"), world_size=2)
    assert type(full.activation_checkpoint).__qualname__ == "FullAC.Config" and none.activation_checkpoint is None


def test_qwen3_and_adamw(tmp_path):
    config = load_config(
        _write(tmp_path, '[model]\nname = "qwen3"\n[optimizer]\nname = "AdamW"\nlr = 1e-3\n'), world_size=1
    )
    assert config.model_spec.name == "qwen3" and config.optimizer.name == "AdamW" and config.optimizer.lr == 1e-3


ERRORS = [
    # (TOML body, command line, world size, phrases that must all appear)
    ("[trainig]\nsteps = 3\n", [], 2, ["unknown section [trainig]", "did you mean 'training'"]),
    ("[training]\nstepz = 3\n", [], 2, ["unknown key [training] stepz", "did you mean 'steps'"]),
    ('[training]\nsteps = "ten"\n', [], 2, ["[training] steps = 'ten'", "expected an integer"]),
    ("[training]\nsteps = 0\n", [], 2, ["[training] steps = 0", "positive integer"]),
    ("[training]\nmax_norm = true\n", [], 2, ["[training] max_norm = True", "expected a number"]),
    (
        '[optimizer]\nname = "sgd"\n',
        [],
        2,
        ["[optimizer] name = 'sgd'", "one of 'dmuon', 'AdamW', 'Adam', 'naive_muon'"],
    ),
    (MINIMAL + "momentum = 1.5\n", [], 2, ["[optimizer] momentum = 1.5: expected a number in [0, 1)"]),
    (MINIMAL + "betas = [0.9, 0.99]\n", [], 2, ['[optimizer] betas applies to name = "AdamW" only', "adamw_betas"]),
    (
        '[optimizer]\nname = "AdamW"\nmomentum = 0.9\n',
        [],
        2,
        ['[optimizer] momentum applies to name = "dmuon" (or "naive_muon") only, not \'AdamW\''],
    ),
    (MINIMAL + "adamw_betas = [0.9]\n", [], 2, ["[optimizer] adamw_betas = [0.9]", "a list of 2"]),
    (
        MINIMAL + 'ns_method = "newton"\n',
        [],
        2,
        ["[optimizer] ns_method = 'newton'", "one of 'torch', 'polar_express', 'gram'"],
    ),
    (
        MINIMAL + 'ns_method = "gram"\nns_mode = "exact"\n',
        [],
        2,
        [
            "[optimizer] ns_method = 'gram': expected 'torch' with ns_mode 'exact' (torch.optim.Muon's own update), "
            "or ns_mode 'batched'"
        ],
    ),
    (
        MINIMAL + 'ns_method = "polar_express"\n',
        ["--optimizer.ns_mode", "exact"],
        2,
        ["ns_method = 'polar_express': expected 'torch' with ns_mode 'exact'"],
    ),
    (MINIMAL + 'muon_params = ["("]\n', [], 2, ["muon_params: bad regex '('"]),
    (
        MINIMAL + "[parallelism]\ndata_parallel_shard_degree = 3\n",
        [],
        2,
        ["data_parallel_shard_degree(3)", "world size is 2"],
    ),
    (MINIMAL + "[parallelism]\ndata_parallel_replicate_degree = 3\n", [], 4, ["does not divide the world size 4"]),
    (
        MINIMAL + "[parallelism]\ncontext_parallel_degree = 2\n[training]\nseq_len = 6\n",
        [],
        2,
        ["[training] seq_len = 6 with parallelism.context_parallel_degree = 2", "divisible by 4"],
    ),
    (
        MINIMAL + '[parallelism]\ncontext_parallel_load_balancer = "roundrobin"\n',
        [],
        2,
        ["context_parallel_load_balancer = 'roundrobin': expected 'headtail'"],
    ),
    (
        MINIMAL + "qk_clip_threshold = 100.0\n[parallelism]\ncontext_parallel_degree = 2\n"
        'context_parallel_load_balancer = "ptrr"\n',
        [],
        2,
        ["qk_clip_threshold = 100.0 with parallelism.context_parallel_load_balancer = 'ptrr'", "head-tail"],
    ),
    (
        MINIMAL + '[parallelism]\ntensor_parallel_degree = 2\nspmd_backend = "partial_dtensor"\n',
        [],
        2,
        [
            "tensor_parallel_degree > 1 with parallelism.spmd_backend = 'partial_dtensor'",
            "use spmd_backend = 'spmd_types'",
        ],
    ),
    (
        MINIMAL + '[parallelism]\nspmd_backend = "full_dtensor"\n',
        [],
        2,
        ["spmd_backend = 'full_dtensor'", "'spmd_types'"],
    ),
    (MINIMAL + "[training]\nenable_cpu_offload = true\n", [], 2, ["enable_cpu_offload = true is not supported"]),
    (
        MINIMAL
        + "[parallelism]\ntensor_parallel_degree = 2\n[compile]\nenable = true\nenable_async_tensor_parallel = true\n",
        [],
        2,
        ["compile.enable_async_tensor_parallel = true"],
    ),
    ('[model]\nname = "gpt2"\n', [], 2, ["[model] name = 'gpt2'", "llama3, qwen3, deepseek_v3, kimi_k2_7"]),
    ('[job]\ndump_fodler = "x"\n', [], 2, ["unknown key [job] dump_fodler", "did you mean 'dump_folder'"]),
    ('[model]\nname = "llama3"\nflavour = "8B"\n', [], 2, ["unknown key [model] flavour", "did you mean 'flavor'"]),
    ('[model]\nname = "gpt_oss"\n[optimizer]\nname = "dmuon"\n', [], 2, ["model 'gpt_oss' is not supported", "sinks"]),
    (
        '[model]\nname = "kimi_k2_7"\nflavor = "kimi_vl_a3b"\n[optimizer]\nname = "dmuon"\n',
        [],
        2,
        ["vision encoder", "moonlight_16b_a3b is supported"],
    ),
    ('[model]\nname = "deepseek_v3"\nflavor = "7B"\n', [], 2, ["[model] flavor = '7B'", "'16b'", "'debugmodel'"]),
    ('[model]\nflavor = "7B"\n', [], 2, ["[model] flavor = '7B'", "debugmodel"]),
    (
        '[activation_checkpoint]\nmode = "some"\n',
        [],
        2,
        ["[activation_checkpoint] mode = 'some'", "'selective', 'full', 'none'"],
    ),
    ('[activation_checkpoint]\nmode = "none"\ndebug = true\n', [], 2, ['has no effect with mode = "none"']),
    ("[validator]\ndataloader = 1\n", [], 2, ["[validator] dataloader", "cannot be set from a TOML file"]),
    (
        MINIMAL + "[validator]\nenable = true\nsteps = -1\n",
        [],
        2,
        ["[validator] steps = -1 (all the held-out data) can hang", "[validator] steps = 4 (--validator.steps 4)"],
    ),
    ("steps = 3\n", [], 2, ["top-level key 'steps' must be a [section] table"]),
    ("[training\nsteps = 3\n", [], 2, ["not valid TOML"]),
    (MINIMAL, ["--training.steps", "x"], 2, ["command line: [training] steps = 'x'", "expected an integer"]),
    (MINIMAL, ["--training.stepz", "3"], 2, ["command line: unknown key [training] stepz"]),
    (MINIMAL, ["training.steps", "3"], 2, ["expected --section.key value, got 'training.steps'"]),
    (MINIMAL, ["--training.steps"], 2, ["--training.steps needs a value"]),
]


@pytest.mark.parametrize("body, cli, world, phrases", ERRORS)
def test_bad_config_is_a_clear_error(tmp_path, body, cli, world, phrases):
    path = _write(tmp_path, body)
    with pytest.raises(ConfigError) as info:
        load_config(path, cli, world_size=world)
    message = str(info.value)
    for phrase in phrases:
        assert phrase in message, message
    if not cli:
        assert message.startswith(path), message  # names the file


def test_missing_file():
    with pytest.raises(ConfigError, match="nope.toml: config file not found"):
        load_config("nope.toml")
