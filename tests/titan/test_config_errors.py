"""Bad job configs stop before any process group, in one line that reaches the user.

In-process where possible (``load_config``, ``with_dmuon``, TorchTitan's own command-line
parsing, the pre-launch check); the end-to-end run of ``run_train.sh``: tests/e2e/test_titan_e2e.py.
Every check here was missing once: its test says what happened without it.
"""

import ast
import logging
import os

import pytest

from tests.support.titan_configs import MOE, one_line_error, parse_args, toml_file
from titan_dmuon import with_dmuon
from titan_dmuon.integration.config.check import check, main
from titan_dmuon.integration.config.finalize import prepare_for_build
from titan_dmuon.integration.config.toml_file import load_config
from titan_dmuon.integration.config.validation.validate import validate_dmuon

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAIN_JOB = "train_configs/debug_model.toml"
DMUON = '[optimizer]\nname = "dmuon"\nlr = 0.02\n'
FUSED_QKV_REGEX = r"\.attention\.qkv_linear\.wqkv\.weight$"


pytestmark = pytest.mark.usefixtures("in_repo_root")  # (tests/titan/conftest.py)


def _llama3():
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    return llama3_debugmodel()


# ---- the restructure -----------------------------------------------------------------------------
def test_integration_modules_import_each_other_without_a_cycle():
    """setup.py (now doors/python_config.py) and trainer.py imported each other (hidden in
    function-level imports); every import between integration modules, at any level and across its
    subpackages, now goes one way."""
    folder = os.path.join(ROOT, "titan_dmuon", "integration")
    graph = {}
    for directory, _, files in os.walk(folder):
        package = os.path.relpath(directory, folder).replace(os.sep, ".").strip(".")
        for file in sorted(f for f in files if f.endswith(".py") and f != "__init__.py"):
            name = f"{package}.{file[:-3]}" if package else file[:-3]
            with open(os.path.join(directory, file)) as f:
                tree = ast.parse(f.read())
            deps = set()
            for node in ast.walk(tree):
                module = (node.module or "") if isinstance(node, ast.ImportFrom) else ""
                if module.startswith("titan_dmuon.integration"):
                    inner = module[len("titan_dmuon.integration") :].lstrip(".")
                    # ``from titan_dmuon.integration[.pkg] import x``: x is a module when it is one
                    deps |= {f"{inner}.{a.name}".lstrip(".") for a in node.names} | {inner}
            graph[name] = deps - {name, ""}
    assert {"config.python_config", "trainer", "cpu"} <= set(graph)  # the walk found the modules

    def reaches(start, target, seen=()):
        return any(d == target or (d not in seen and reaches(d, target, (*seen, d))) for d in graph.get(start, ()))

    assert [m for m in graph if reaches(m, m)] == []
    assert not os.path.exists(os.path.join(ROOT, "titan_dmuon", "train.py"))  # moved, no shim left


# ---- 1. switching optimizer ------------------------------------------------------------------------
def test_python_door_switch_to_adamw_names_the_values_and_the_fix():
    """``CONFIG=llama3_debugmodel_dmuon ./run_train.sh --optimizer.name AdamW`` trained TorchTitan's
    AdamW at lr 0.05, DMuon's Muon lr (the config's AdamW lr 8e-4 was dropped). Refused, and the
    suggested command line (TorchTitan's spelling, tuples included) then passes."""
    message = one_line_error(validate_dmuon, parse_args("--optimizer.name", "AdamW"))
    assert "optimizer.name = 'AdamW'" in message and "lr = 0.05 but adamw_lr = 0.0008" in message
    assert message.endswith("pass --optimizer.lr 0.0008"), message
    validate_dmuon(parse_args("--optimizer.name", "AdamW", "--optimizer.lr", "0.0008"))

    args = (
        "--optimizer.name",
        "Adam",
        "--optimizer.adamw_betas",
        "0.8",
        "0.9",
        "--optimizer.adamw_weight_decay",
        "0.0",
    )
    message = one_line_error(validate_dmuon, parse_args(*args))
    assert (
        "betas = (0.9, 0.95) but adamw_betas = (0.8, 0.9)" in message
        and "weight_decay = 0.1 but adamw_weight_decay = 0.0" in message
    )
    fix = message.split(" pass ", 1)[1].split()
    assert fix == ["--optimizer.lr", "0.0008", "--optimizer.betas", "0.8", "0.9", "--optimizer.weight_decay", "0.0"]
    config = parse_args(*args, *fix)
    validate_dmuon(config)
    assert (config.optimizer.lr, config.optimizer.betas, config.optimizer.weight_decay) == (8e-4, (0.8, 0.9), 0.0)


def test_toml_adamw_sets_adamw_keys_from_the_flat_keys(tmp_path):
    """With name = "AdamW" the file sets lr/betas/eps/weight_decay; adamw_* kept the base config's and
    the switch check would refuse every TOML AdamW job whose values differ from TorchTitan's."""
    body = '[optimizer]\nname = "AdamW"\nlr = 1e-3\nbetas = [0.8, 0.9]\neps = 1e-6\nweight_decay = 0.0\n'
    opt = load_config(toml_file(tmp_path, body), world_size=2).optimizer
    assert (opt.adamw_lr, opt.adamw_betas, opt.adamw_eps, opt.adamw_weight_decay) == (1e-3, (0.8, 0.9), 1e-6, 0.0)
    assert load_config("train_configs/debug_model_adamw.toml", world_size=2).optimizer.adamw_lr == 8e-4


def test_toml_door_switch_to_adamw_says_how():
    """The main job with --optimizer.name AdamW was refused for its momentum key, without saying how to
    switch; now the message names every Muon key to remove and the AdamW file to start from."""
    message = one_line_error(load_config, MAIN_JOB, ["--optimizer.name", "AdamW"], world_size=2)
    assert message.startswith(f'{MAIN_JOB}: [optimizer] momentum applies to name = "dmuon"')
    assert (
        "remove momentum, nesterov, ns_steps, adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay, "
        f"reshard_after_forward from [optimizer] in {MAIN_JOB}" in message
    )
    assert "--optimizer.lr <value> --optimizer.weight_decay <value>" in message
    assert message.endswith("or start from an AdamW file such as train_configs/debug_model_adamw.toml")


@pytest.mark.parametrize(
    "file_name, switch_to, reads_as", [("dmuon", "AdamW", "AdamW's lr"), ("AdamW", "dmuon", "Muon's lr")]
)
def test_toml_switch_does_not_reinterpret_the_files_lr(tmp_path, file_name, switch_to, reads_as):
    """A file without Muon keys (only lr) switched on the command line silently read its lr as the
    other optimizer's: Muon's 0.02 became AdamW's, or AdamW's 1e-3 Muon's."""
    path = toml_file(tmp_path, f'[optimizer]\nname = "{file_name}"\nlr = 0.02\n')
    message = one_line_error(load_config, path, ["--optimizer.name", switch_to], world_size=2)
    assert f'[optimizer] lr = 0.02 is written for name = "{file_name}"' in message and reads_as in message
    assert message.endswith("--optimizer.lr <value>")
    assert (
        load_config(path, ["--optimizer.name", switch_to, "--optimizer.lr", "0.001"], world_size=2).optimizer.lr
        == 0.001
    )


# ---- 2. the pre-launch check -------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, phrase",
    [
        (["--config_file", MAIN_JOB, "--training.stepz", "3"], "command line: unknown key [training] stepz"),
        (["--config_file", MAIN_JOB, "--parallelism.data_parallel_shard_degree", "3"], "world size is 2"),
        (
            ["--module", "titan_dmuon", "--config", "llama3_debugmodel_dmuon", "--optimizer.name", "AdamW"],
            "pass --optimizer.lr 0.0008",
        ),
        (
            [
                "--module",
                "titan_dmuon",
                "--config",
                "llama3_debugmodel_dmuon",
                "--parallelism.data_parallel_shard_degree",
                "3",
            ],
            "world size is 2",
        ),
        (
            ["--module", "titan_dmuon", "--config", "llama3_debugmodel_dmuon", "--training.stepz", "3"],
            "command line: unknown key [training] stepz (did you mean 'steps'?)",
        ),
        (["--module", "titan_dmuon", "--config", "nope"], "Config function 'nope' not found"),
        (["--training.steps", "3"], "expected --config_file FILE.toml or --module M --config F"),
    ],
)
def test_prelaunch_check_builds_the_config_as_the_workers_do(args, phrase):
    """Config errors were raised only inside the torchrun workers, where torchrun may kill rank 0
    before it logs (when rank 1 fails first). The check builds the config as the workers do
    (TOML, or TorchTitan's config function plus its own overrides) with the world size."""
    assert phrase in one_line_error(check, args, world_size=2)


def test_prelaunch_check_passes_good_jobs_quietly(capsys):
    for args in (
        ["--config_file", MAIN_JOB, "--optimizer.no-nesterov"],
        ["--module", "titan_dmuon", "--config", "llama3_debugmodel_dmuon", "--optimizer.no-nesterov"],
        ["--module", "torchtitan.models.llama3", "--config", "llama3_debugmodel"],  # not DMuon: TorchTitan's to check
    ):
        assert main(args) == 0
    assert capsys.readouterr().err == ""


def test_prelaunch_check_prints_one_line_last_and_exits_2(capsys, monkeypatch):
    """What tyro rejects and the TOML door's reading of the overrides does not explain keeps tyro's
    framed message, with its first paragraph (wrapped lines joined: it was cut after one) last."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["--module", "titan_dmuon", "--config", "llama3_debugmodel_dmuon", "--stepz", "3"]) == 2
    err = capsys.readouterr().err.rstrip("\n")
    assert "Unrecognized options" in err.rsplit("\n", 1)[0]  # TorchTitan's own message first
    assert err.rsplit("\n", 1)[1].startswith("config error: command line: Unrecognized options: --stepz, 3")
    from titan_dmuon.integration.config.check import _summary_of_box

    box = (
        "╭─ Invalid choice ────────╮\n│ invalid choice 'x' for argument '--a.b'. Expected  │\n│ one of ('p', 'q'). │\n"
        "│ ────────────────── │\n│ For full helptext, run check.py --help │\n╰────────────────╯\n"
    )
    assert _summary_of_box(box) == "invalid choice 'x' for argument '--a.b'. Expected one of ('p', 'q')."


# ---- every bad input before launch, in one line, in both doors (the TOML file and a Python config) ----
TOML_DOOR = ["--config_file", MAIN_JOB]
PYTHON_DOOR = ["--module", "titan_dmuon", "--config", "llama3_debugmodel_dmuon"]


@pytest.mark.parametrize(
    "args, world, line",
    [
        (
            ["--optimizer.ns_mode", "exakt"],
            2,
            "command line: [optimizer] ns_mode = 'exakt': expected one of 'batched', 'exact'",
        ),
        (
            ["--optimizer.qk_clip_threshold", "abc"],
            2,
            "command line: [optimizer] qk_clip_threshold = 'abc': expected a number or unset",
        ),
        (
            ["--checkpoint.last_save_in_hf"],
            2,
            "command line: [checkpoint] last_save_in_hf = true needs last_save_model_only = true "
            "(TorchTitan saves only the model weights in HF format); "
            "add [checkpoint] last_save_model_only = true (--checkpoint.last_save_model_only)",
        ),
        (
            ["--checkpoint.keep_latest_k", "1"],
            2,
            "command line: TorchTitan rejects the checkpoint settings: "
            "We need to maintain at least 2 checkpoint replicas",
        ),
    ],
    ids=["ns_mode", "qk_clip_threshold", "last_save_in_hf", "keep_latest_k"],
)
def test_bad_values_are_the_same_line_in_both_doors(capsys, monkeypatch, args, world, line):
    """The Python door printed tyro's framed message (7 to 18 lines) and a cut summary
    ("... Expected one of"), or passed the check and died after launch (last_save_in_hf without
    last_save_model_only, a rule TorchTitan checks when it builds its checkpointer): now each is
    the TOML door's line, alone, exit status 2."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    for door in (TOML_DOOR, PYTHON_DOOR):
        assert main([*door, *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"config error: {line}"), err
    if "last_save_in_hf" in line:  # the fix, as the line writes it, passes
        for door in (TOML_DOOR, PYTHON_DOOR):
            check([*door, *args, "--checkpoint.last_save_model_only"], world_size=world)


def test_ns_method_other_than_torch_is_refused_with_the_exact_mode_in_both_doors(capsys, monkeypatch):
    """ns_mode "exact" is torch.optim.Muon's own update: any other ns_method is one line naming both keys,
    before launch, the same line whichever door (both name where the value came from: the command line)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    line = (
        "ns_method = 'gram': expected 'torch' with ns_mode 'exact' (torch.optim.Muon's own update), "
        "or ns_mode 'batched'"
    )
    args = ["--optimizer.ns_method", "gram", "--optimizer.ns_mode", "exact"]
    for door in (TOML_DOOR, PYTHON_DOOR):
        assert main([*door, *args]) == 2
        err = capsys.readouterr().err
        assert err == f"config error: command line: [optimizer] {line}\n", err
        assert main([*door, "--optimizer.ns_method", "gram"]) == 0


@pytest.mark.parametrize(
    "args, world, line",
    [
        (
            ["--parallelism.pipeline_parallel_degree", "8"],
            8,
            "parallelism.pipeline_parallel_degree = 8 with pipeline_parallel_schedule 'Interleaved1F1B' "
            "(2 stages per pipeline rank) splits the llama3 debugmodel model into 16 stages, and TorchTitan "
            "needs at least one of its 8 layers per stage (6 layers, the embedding counted as 1, the head as 1); "
            "use pipeline_parallel_degree <= 4 or a single-stage schedule (1F1B, GPipe)",
        ),
        (
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_schedule",
                "Interleaved1FB1",
            ],
            2,
            "pipeline_parallel_schedule = 'Interleaved1FB1': not a schedule of torch.distributed.pipelining "
            "(did you mean 'Interleaved1F1B'?); expected one of 1F1B, Interleaved1F1B, GPipe, LoopedBFS, "
            "InterleavedZeroBubble, ZBVZeroBubble, DualPipeV",
        ),
        (
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_schedule",
                "PipelineScheduleMulti",
            ],
            2,
            "pipeline_parallel_schedule = 'PipelineScheduleMulti' is an abstract base class: "
            "use a schedule such as 1F1B or Interleaved1F1B",
        ),
        (
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_schedule",
                "PipelineScheduleSingle",
            ],
            2,
            "pipeline_parallel_schedule = 'PipelineScheduleSingle' is an abstract base class: "
            "use a schedule such as 1F1B or Interleaved1F1B",
        ),
        (
            ["--parallelism.tensor_parallel_degree", "3", "--parallelism.data_parallel_shard_degree", "2"],
            6,
            "TorchTitan cannot build the llama3 debugmodel model for this job: "
            "tensor_parallel_degree (3) must divide n_heads (16).",
        ),
    ],
    ids=["pp_stages_over_layers", "pp_schedule_name", "pp_schedule_multi_base", "pp_schedule_single_base", "tp_heads"],
)
def test_parallelism_errors_before_launch_name_the_command_line(args, world, line):
    """PP degree 8 on 8 ranks and a misspelt schedule passed the check and failed after launch in
    TorchTitan's pipeline_llm (231 / 166 lines); torch.distributed.pipelining's abstract bases
    (PipelineScheduleMulti, PipelineScheduleSingle) are names get_schedule_class accepts but no
    schedule (regression: no test named them, so dropping the refusal passed); a TP degree from the
    command line was blamed on the TOML file. Each is one line now, naming where the value came from, in both doors (the
    Python door gave no source: the pre-launch check did not know which settings the command line
    had changed)."""
    toml = one_line_error(check, [*TOML_DOOR, *args], world_size=world)
    assert toml.startswith("command line: ") and toml.endswith(line), toml
    python = one_line_error(check, [*PYTHON_DOOR, *args], world_size=world)
    assert python.startswith("command line: ") and python.endswith(line), python
    fixed = ["--parallelism.pipeline_parallel_degree", "4", "--parallelism.data_parallel_shard_degree", "2"]
    check([*TOML_DOOR, *fixed], world_size=8)  # the advice works (4 x 2 stages of the 8 layers)


# ---- 3. checks against the model (meta device) ----------------------------------------------
def test_muon_params_entry_matching_nothing_is_named_with_close_names():
    """``^output\\.weight$`` (the head is lm_head.weight) failed after the process groups started,
    inside DMuon's dedication, as a 130-150 line traceback."""
    message = one_line_error(with_dmuon, _llama3(), muon_params=[r"\.feed_forward\.w1\.weight$", r"^output\.weight$"])
    assert message.startswith(
        r"optimizer.muon_params entry '^output\.weight$' matches no parameter of the llama3 debugmodel model"
    )
    assert "lm_head.weight" in message.split("; its parameters")[0] and "layers.*.attention.wo.weight" in message
    with_dmuon(_llama3())  # DMuon's default list has entries for other families: not an error


def test_muon_params_selecting_a_norm_is_refused():
    message = one_line_error(with_dmuon, _llama3(), muon_params=[r"\.feed_forward\.", r"norm\.weight$"])
    assert r"entry 'norm\.weight$' selects layers.0.attention_norm.weight of shape (256,)" in message
    assert "Muon needs 2-D weight matrices or 3-D expert weights" in message and "stay on AdamW" in message


def test_muon_params_selecting_the_token_embedding_is_refused():
    """The embedding is 2-D, so it passed every shape check and was trained with Muon."""
    message = one_line_error(with_dmuon, _llama3(), muon_params=[r"\.attention\.wo\.weight$", "tok_embeddings"])
    assert "entry 'tok_embeddings' selects tok_embeddings.weight, the token embedding (an nn.Embedding)" in message
    assert "lookup table" in message and "orthogonalises matrices that act on activations" in message
    assert "stays on AdamW" in message


def test_readme_style_muon_params_work_on_llama3_and_warn_about_the_fused_wqkv(tmp_path, caplog):
    """The README's plain-PyTorch selection (``.attention.w``, ``.feed_forward.w``) on llama3 failed
    with "split_rows names a parameter that is not being dedicated"; it now trains and leaves the
    fused wqkv on AdamW, which DMuonTrainer says once, with the regex that would include it."""
    readme = [".attention.w", ".feed_forward.w"]
    config = with_dmuon(_llama3(), muon_params=readme)
    (warning,) = validate_dmuon(config)
    assert "leaves layers.*.attention.qkv_linear.wqkv.weight (TorchTitan's fused q/k/v weight) on AdamW" in warning
    assert f"add the regex {FUSED_QKV_REGEX} to the list" in warning
    body = DMUON + 'muon_params = [".attention.w", ".feed_forward.w"]\n'
    assert load_config(toml_file(tmp_path, body), world_size=2).optimizer.muon_params == readme
    with caplog.at_level(logging.WARNING):
        prepare_for_build(config)
    assert [r.getMessage() for r in caplog.records if "fused q/k/v" in r.getMessage()] == [warning]
    assert validate_dmuon(with_dmuon(_llama3(), muon_params=[*readme, FUSED_QKV_REGEX])) == []  # the advice works


def test_impossible_expert_parallel_degree_is_a_config_error(tmp_path, monkeypatch):
    """expert_parallel_degree 3 on 2 ranks failed in TorchTitan's mesh setup after the process groups
    started (its expert mesh had 2 // 3 = 0 ranks)."""
    message = one_line_error(load_config, toml_file(tmp_path, MOE + "expert_parallel_degree = 3\n"), world_size=2)
    assert "[parallelism] expert_parallel_degree = 3: expected a divisor of" in message and "= 2" in message
    assert message.endswith("one of 1, 2")
    # which divides which: 4 on 2 ranks is refused, 2 on 4 ranks is a valid layout (with the operands
    # swapped, 3 on 2 ranks was still refused and only the end-to-end EP runs failed)
    message = one_line_error(
        load_config, toml_file(tmp_path, MOE + "expert_parallel_degree = 4\n", "four.toml"), world_size=2
    )
    assert "[parallelism] expert_parallel_degree = 4: expected a divisor of" in message
    load_config(toml_file(tmp_path, MOE + "expert_parallel_degree = 2\n", "two.toml"), world_size=4)
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = parse_args("--parallelism.expert_parallel_degree", "3", config="qwen3_moe_debug_dmuon")
    import torch.distributed as dist

    assert "parallelism.expert_parallel_degree = 3: expected a divisor" in one_line_error(config.build)
    assert not dist.is_initialized()


def test_expert_parallelism_over_more_ranks_than_experts_is_refused_at_config_time(tmp_path):
    """DMuon needs whole experts per rank under EP; this was found only in the parallelize step."""
    body = MOE + 'expert_parallel_degree = 2\nspmd_backend = "partial_dtensor"\n'
    message = one_line_error(load_config, toml_file(tmp_path, body), world_size=128)
    assert "expert parallelism with 128 expert-FSDP x EP ranks and 64 experts" in message
    assert "lower data_parallel_shard_degree" in message
    load_config(toml_file(tmp_path, body, "ok.toml"), world_size=64)


def test_expert_parallelism_with_spmd_types_is_accepted_on_this_machine(tmp_path):
    """TorchTitan's default spmd_types EP all-to-all (uneven splits) ran into gloo's equal-size
    all_to_all and was refused here; the CPU accommodation routes it through all_to_all_single
    (tests/titan/test_tensor_parallel_moe.py runs it), so the job validates as it is, in both doors."""
    path = toml_file(tmp_path, MOE + "expert_parallel_degree = 2\n")
    load_config(path, world_size=2, this_machine=True)
    config = parse_args("--parallelism.expert_parallel_degree", "2", config="qwen3_moe_debug_dmuon")
    validate_dmuon(config, world_size=2, this_machine=True)


def test_torchtitans_own_checks_are_one_line_config_errors(tmp_path):
    """TorchTitan's Trainer.Config checks and model-config update raised ValueError tracebacks."""
    path = toml_file(tmp_path, DMUON + "[debug]\nbatch_invariant = true\n")
    message = one_line_error(load_config, path, world_size=2)
    assert message == f"{path}: TorchTitan rejects this config: Batch-invariant mode is not supported in pre-training."
    message = one_line_error(
        load_config, toml_file(tmp_path, DMUON + "[training]\nseq_len = 200000\n", "b.toml"), world_size=2
    )
    assert (
        "TorchTitan cannot build the llama3 debugmodel model for this job: Training sequence length 200000 exceeds"
        in message
    )


# ---- 5. command-line booleans and the CUDA-graph warning -------------------------------------------------
def test_toml_command_line_takes_torchtitans_flags():
    """The TOML door took only ``--section.key true|false``; TorchTitan's flags (the spelling DMuon's
    messages use, and the Python door's) were errors, and ``--training.steps --optimizer.lr 1``
    took "--optimizer.lr" as the number of steps."""
    flags = [
        "--optimizer.no-nesterov",
        "--metrics.count_all_comm",
        "--training.disable-cuda-graphs",
        "--checkpoint.no_enable",
    ]
    for config in (load_config(MAIN_JOB, flags, world_size=2), parse_args(*flags)):
        assert config.optimizer.nesterov is False and config.metrics.count_all_comm is True
        assert config.training.disable_cuda_graphs is True and config.checkpoint.enable is False
    unset_or_flag = ["--optimizer.no-reshard_after_forward"]  # (true/false/unset: TorchTitan wants a value)
    assert load_config(MAIN_JOB, unset_or_flag, world_size=2).optimizer.reshard_after_forward is False
    assert load_config(MAIN_JOB, ["--optimizer.nesterov", "false"], world_size=2).optimizer.nesterov is False
    message = one_line_error(load_config, MAIN_JOB, ["--training.steps", "--optimizer.lr", "1"], world_size=2)
    assert message == "command line: --training.steps needs a value ([training] steps expects an integer)"
    message = one_line_error(load_config, MAIN_JOB, ["--training.no-steps"], world_size=2)
    assert "--training.no-steps sets false, a flag for true/false keys only" in message


def test_cuda_graph_warning_only_after_overrides_and_where_capture_could_happen(tmp_path, monkeypatch, caplog):
    """The warning fired on every CPU run, and in the Python door even with --training.disable_cuda_graphs
    given (it ran before TorchTitan applied the overrides). Now with_dmuon and TOML turn capture off
    silently; DMuonTrainer warns only for an explicit false, and only with CUDA."""
    import torch

    with caplog.at_level(logging.WARNING):
        assert with_dmuon(_llama3()).training.disable_cuda_graphs is True
        assert load_config(MAIN_JOB, world_size=2).training.disable_cuda_graphs is True
        explicit = load_config(toml_file(tmp_path, DMUON + "[training]\ndisable_cuda_graphs = false\n"), world_size=2)
        assert explicit.training.disable_cuda_graphs is False  # the job's own setting, for the trainer to warn about
        assert prepare_for_build(explicit).training.disable_cuda_graphs is True
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        prepare_for_build(parse_args("--training.disable_cuda_graphs"))
        assert not [r for r in caplog.records if "cuda_graphs" in r.getMessage()]
        prepare_for_build(parse_args("--training.no-disable_cuda_graphs"))
    (warning,) = [r.getMessage() for r in caplog.records if "cuda_graphs" in r.getMessage()]
    assert (
        warning.startswith("training.disable_cuda_graphs = false: DMuon's hooks")
        and "Pass --training.disable_cuda_graphs" in warning
    )


def test_no_two_modules_of_the_package_share_a_base_name():
    """titan_dmuon/optim/optimizer.py and integration/optimizer.py (and two qk_clip.py) held different things
    under one name: a newcomer (and a traceback) could not tell them apart. Base names are unique."""
    seen = {}
    for directory, _, files in os.walk(os.path.join(ROOT, "titan_dmuon")):
        for file in files:
            if file.endswith(".py") and file not in ("__init__.py", "__main__.py"):  # (a package's entry points)
                seen.setdefault(file, []).append(os.path.relpath(os.path.join(directory, file), ROOT))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


def test_the_product_never_imports_the_testing_package():
    """integration/optimizer.py imported titan_dmuon.testing's NaiveFSDPMuon for name = "naive_muon": the
    package that says it is not part of DMuon was on the product's import path. Only tests and benchmarks
    import it now (benchmarks/naive_muon_job.py's container subclass builds the baseline)."""
    package = os.path.join(ROOT, "titan_dmuon")
    scanned, importers = 0, []
    for directory, _, files in os.walk(package):
        if os.path.relpath(directory, package).split(os.sep)[0] == "testing":
            continue
        for file in (f for f in files if f.endswith(".py")):
            path = os.path.join(directory, file)
            with open(path) as f:
                tree = ast.parse(f.read())
            scanned += 1
            for node in ast.walk(tree):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom):
                    modules = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                if any(m == "titan_dmuon.testing" or m.startswith("titan_dmuon.testing.") for m in modules):
                    importers.append(os.path.relpath(path, ROOT))
    assert scanned > 30 and importers == []


_MUTATORS = {
    "append",
    "extend",
    "insert",
    "update",
    "setdefault",
    "pop",
    "popitem",
    "clear",
    "add",
    "discard",
    "remove",
}
# FSDP2's own memo of generated classes (torch's _fully_shard.py: cls_to_fsdp_cls): one class per module class,
# so that compiled code does not see a new type per module; it caches a pure function, it owns no job's state
_MEMOS = {"titan_dmuon/runtime/handle.py": {"_ROOT_CLASSES"}}


def test_no_module_level_state_in_the_package():
    """optimizer_container.py kept a module-level registry (``_REGISTERED``, filled when a benchmark module
    was imported) and runtime/comm.py a process-wide launch counter: state no object owned. No module of
    the package binds a name at module level that it then mutates (a method that changes it, an item
    assignment, ``next()``, ``global``), memos of pure functions named above aside."""
    found = []
    for directory, _, files in os.walk(os.path.join(ROOT, "titan_dmuon")):
        for file in (f for f in files if f.endswith(".py")):
            path = os.path.join(directory, file)
            with open(path) as f:
                tree = ast.parse(f.read())
            module_names = {
                t.id
                for node in tree.body
                if isinstance(node, (ast.Assign, ast.AnnAssign))
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                if isinstance(t, ast.Name)
            } - _MEMOS.get(os.path.relpath(path, ROOT).replace(os.sep, "/"), set())
            for node in ast.walk(tree):
                mutated = None
                if isinstance(node, ast.Global):
                    mutated = ",".join(node.names)
                elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) in _MUTATORS:
                    mutated = getattr(node.func.value, "id", None)
                elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "next" and node.args:
                    mutated = getattr(node.args[0], "id", None)
                elif isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
                    mutated = getattr(node.value, "id", None)
                if mutated is not None and (isinstance(node, ast.Global) or mutated in module_names):
                    found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {mutated}")
    assert found == []


def test_naive_muon_is_one_line_before_launch_outside_its_config_module(tmp_path, monkeypatch, capsys):
    """``name = "naive_muon"`` (the benchmarks' baseline) through the TOML door, whose optimizer config is
    DMuon's (its container builds no baseline): one line before launch naming the config module whose
    container does, and the same line if DMuon's container is built anyway; through that module
    (TorchTitan's ``--module``, as benchmarks/bench_debug_model.py runs it) the same file passes the check,
    in this process too (nothing a module did at import decides it: the config's class does)."""
    import importlib

    import torch

    from titan_dmuon.integration.components.optimizer_container import DMuonOptimizersContainer
    from titan_dmuon.integration.names import NAIVE_MUON

    job = importlib.import_module("benchmarks.naive_muon_job")  # (imported first: it must not change the product)
    monkeypatch.setenv("WORLD_SIZE", "2")
    path = toml_file(tmp_path, '[optimizer]\nname = "naive_muon"\nlr = 0.05\nadamw_lr = 8e-4\n')
    message = one_line_error(load_config, path, world_size=2)
    assert "[optimizer] name = 'naive_muon': the benchmarks' baseline" in message
    assert "MODULE=benchmarks.naive_muon_job CONFIG=from_toml NAIVE_MUON_CONFIG_FILE=<job.toml>" in message
    assert main(["--config_file", path]) == 2
    assert capsys.readouterr().err.startswith("config error: ")
    with pytest.raises(ValueError, match="optimizer.name = 'naive_muon': the benchmarks' baseline"):
        DMuonOptimizersContainer.Config(name=NAIVE_MUON).build(model_parts=[torch.nn.Linear(2, 2)])

    monkeypatch.setenv(job.CONFIG_FILE_ENV, path)
    config = job.from_toml()
    assert type(config.optimizer) is job.NaiveMuonContainer.Config and config.optimizer.name == NAIVE_MUON
    assert main(["--module", "benchmarks.naive_muon_job", "--config", "from_toml"]) == 0, capsys.readouterr().err
