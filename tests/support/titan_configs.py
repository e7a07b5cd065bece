"""Configs as TorchTitan's doors make them, shared by the config tests: a TOML file, the command line of
``torchtitan.train --module titan_dmuon``, a user's Python config, and the one-line error a bad one raises."""

import re
import textwrap

import pytest

MOE = '[model]\nname = "qwen3"\nflavor = "moe_debug"\n[optimizer]\nname = "dmuon"\n[parallelism]\n'


def toml_file(tmp_path, body: str, name: str = "job.toml") -> str:
    path = tmp_path / name
    path.write_text(body)
    return str(path)


def parse_args(*args: str, config: str = "llama3_debugmodel_dmuon"):
    """What torchtitan.train builds: the config function, then TorchTitan's overrides (tyro)."""
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--module", "titan_dmuon", "--config", config, *args])


def one_line_error(fn, *args, **kwargs) -> str:
    """The ConfigError ``fn`` raises, asserted to be one line."""
    from titan_dmuon.integration.config.toml_file import ConfigError  # (imports TorchTitan: here, not at import)

    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    return message


# A user's own registry module: TorchTitan's debug config on this project's local assets, switched
# to DMuon in one call. Also trained end to end (test_titan_checkpoint_e2e.py).
USER_MODULE = textwrap.dedent("""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from titan_dmuon import with_dmuon


    def my_dmuon_job():
        config = llama3_debugmodel()
        config.hf_assets_path = "./assets/debug/tokenizer"
        config.dataloader.dataset_path = "./assets/debug/text"
        config.training.local_batch_size, config.training.seq_len, config.training.steps = 2, 256, 20
        config.debug.seed = 0
        return with_dmuon(config, lr=0.05, reshard_after_forward=True)
""")


def comparable(config) -> dict:
    """``config.to_dict()`` without the addresses in the reprs of initialiser functions."""
    return _strip_addresses(config.to_dict())


def _strip_addresses(value):
    if isinstance(value, dict):
        return {k: _strip_addresses(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_strip_addresses(v) for v in value)
    return re.sub(r" at 0x[0-9a-f]+", "", value) if isinstance(value, str) else value
