"""The variants' options from every door: ``normuon_beta2``, ``ns_dtype`` (DMuonOptions fields, so DMuon
keywords, container fields, TOML keys and command-line flags), ``ns_blocks`` (a dedication key of the
TorchTitan integration, like ``muon_params``), and their refusals, one line each, before launch."""

import os

import pytest

from titan_dmuon import with_dmuon
from titan_dmuon.integration.config.check import main
from titan_dmuon.integration.config.toml_file import ConfigError, load_config
from titan_dmuon.options import DMuonOptions, OptionError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAIN_JOB = "train_configs/debug_model.toml"
TOML_DOOR = ["--config_file", MAIN_JOB]
PYTHON_DOOR = ["--module", "titan_dmuon", "--config", "llama3_debugmodel_dmuon"]
VARIANTS = ["--optimizer.normuon_beta2", "0.95", "--optimizer.ns_blocks", "heads", "--optimizer.ns_dtype", "float16"]


pytestmark = pytest.mark.usefixtures("in_repo_root")  # (tests/titan/conftest.py)


def _set(opt) -> tuple:
    return opt.normuon_beta2, opt.ns_blocks, opt.ns_dtype


def test_every_door_sets_them(tmp_path):
    """TOML keys, ``--optimizer.*`` flags over a file, ``with_dmuon`` keywords and TorchTitan's own command
    line (``--module titan_dmuon``) all reach the optimizer config; unset, they are Muon's defaults."""
    from torchtitan.config import ConfigManager
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    assert _set(load_config(MAIN_JOB, world_size=2).optimizer) == (None, "matrix", "bfloat16")
    path = tmp_path / "job.toml"
    path.write_text(
        open(MAIN_JOB)
        .read()
        .replace(
            'name = "dmuon"\n', 'name = "dmuon"\nnormuon_beta2 = 0.9\nns_blocks = "heads"\nns_dtype = "float16"\n', 1
        )
    )
    assert _set(load_config(str(path), world_size=2).optimizer) == (0.9, "heads", "float16")
    assert _set(load_config(MAIN_JOB, VARIANTS, world_size=2).optimizer) == (0.95, "heads", "float16")
    assert _set(
        with_dmuon(llama3_debugmodel(), normuon_beta2=0.95, ns_blocks="heads", ns_dtype="float16").optimizer
    ) == (0.95, "heads", "float16")
    parsed = ConfigManager().parse_args([*PYTHON_DOOR, *VARIANTS])
    assert _set(parsed.optimizer) == (0.95, "heads", "float16")
    for door in (TOML_DOOR, PYTHON_DOOR):  # the pre-launch check of run_train.sh passes them
        assert main([*door, *VARIANTS]) == 0


def test_dmuon_takes_them_as_keywords_not_per_group():
    """``DMuon(..., normuon_beta2=, ns_dtype=)``: one value per job (the options' JOB_KEYS), refused in a
    param group; their ranges are DMuonOptions' checks."""
    import torch

    from titan_dmuon.optim.optimizer import DMuon

    p = torch.nn.Parameter(torch.randn(4, 4))
    DMuon([p], normuon_beta2=0.95, ns_dtype="float16")
    with pytest.raises(OptionError, match="normuon_beta2 = 0.9: expected a DMuon\\(...\\) keyword"):
        DMuon([{"params": [p], "normuon_beta2": 0.9}])
    assert DMuonOptions(normuon_beta2=0.0).normuon_beta2 == 0.0
    for bad in (1.0, -0.1, True, "0.9"):
        with pytest.raises(OptionError, match="normuon_beta2 = .*: expected a number in \\[0, 1\\), or unset"):
            DMuonOptions(normuon_beta2=bad)
    with pytest.raises(OptionError, match="ns_dtype = 'float32': expected one of \\('bfloat16', 'float16'\\)"):
        DMuonOptions(ns_dtype="float32")


# (arguments, the one line after "config error: command line: [optimizer] ")
REFUSED = [
    (
        ["--optimizer.ns_dtype", "float16", "--optimizer.ns_mode", "exact"],
        "ns_dtype = 'float16': expected 'bfloat16' with ns_mode 'exact' (torch.optim.Muon's own update), "
        "or ns_mode 'batched'",
    ),
    (["--optimizer.normuon_beta2", "1"], "normuon_beta2 = 1.0: expected a number in [0, 1), or unset (Muon)"),
    (["--optimizer.ns_blocks", "head"], "ns_blocks = 'head': expected one of 'matrix', 'heads'"),
    (
        ["--optimizer.ns_blocks", "heads", "--optimizer.muon_params", r"\.feed_forward\.w[123]\.weight$"],
        "ns_blocks = 'heads': none of the llama3 debugmodel model's attention projections is on Muon "
        "(command line: [optimizer] muon_params), so no weight would be split by heads; "
        'add them or use ns_blocks = "matrix"',
    ),
]


@pytest.mark.parametrize("args, line", REFUSED)
def test_refusals_are_one_line_in_both_doors(capsys, monkeypatch, args, line):
    """Before launch, the same line whichever door (both name the command line, which set the value)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    for door in (TOML_DOOR, PYTHON_DOOR):
        assert main([*door, *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"config error: command line: [optimizer] {line}") and err.count("\n") == 1, err


def test_heads_on_attention_of_an_unknown_layout_is_refused(monkeypatch):
    """A model whose attention per-head Newton–Schulz does not know: the description's reason, by name."""
    from titan_dmuon.integration.models import attention_heads

    def unknown(model, tp_size=1):
        raise attention_heads.HeadBlocksNotSupported(
            "attention 'layers.0.attention' (x.Y) has a layout per-head Newton–Schulz does not know"
        )

    monkeypatch.setattr(attention_heads, "head_blocks", unknown)
    with pytest.raises(
        ConfigError,
        match="command line: \\[optimizer\\] ns_blocks = 'heads' with the llama3 debugmodel "
        "model: attention 'layers.0.attention' .* does not know; use ns_blocks = \"matrix\"",
    ):
        load_config(MAIN_JOB, ["--optimizer.ns_blocks", "heads"], world_size=2)


@pytest.mark.parametrize("key, value", [("normuon_beta2", 0.95), ("ns_dtype", "float16"), ("ns_blocks", "heads")])
def test_other_optimizers_refuse_them_by_name(tmp_path, key, value):
    """AdamW: a Muon-family key set in the file (as every DMuon key); naive_muon (the benchmarks' baseline):
    DMuon's only, it would not run them."""
    path = tmp_path / "adamw.toml"
    path.write_text(f'[optimizer]\nname = "AdamW"\n{key} = {value!r}\n'.replace("'", '"'))
    with pytest.raises(
        ConfigError, match=f'\\[optimizer\\] {key} applies to name = "dmuon" \\(or "naive_muon"\\) only'
    ):
        load_config(str(path), world_size=2)
    from benchmarks.naive_muon_job import NaiveMuonContainer

    with pytest.raises(
        ConfigError, match=f"\\[optimizer\\] {key} = {value!r} applies to optimizer.name = 'dmuon' only"
    ):
        path.write_text(f'[optimizer]\nname = "naive_muon"\n{key} = {value!r}\n'.replace("'", '"'))
        load_config(str(path), world_size=2, optimizer_config=NaiveMuonContainer.Config)
