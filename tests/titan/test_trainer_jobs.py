"""The parallelisms through TorchTitan's trainer, in-process: the configs and flags a user passes to
``./run_train.sh``, run by ``DMuonTrainer`` on the session's worker pools (tests/support/trainer_jobs.py). Each
job starts where TorchTitan's AdamW starts with the same parallelism and seed (DMuon initialises the weights
it dedicates as TorchTitan does), trains, and moves the design's traffic. (Through run_train.sh itself:
tests/e2e/test_titan_e2e.py; moved here from there, MOVES.md.)"""

import os
import re

import pytest

from tests.support.run_train import ROOT, parse
from tests.support.trainer_jobs import run_job, train_in_process

TP = ("--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2")


def test_dmuon_starts_exactly_where_adamw_starts(pool2, tmp_path):
    """The same TOML apart from [optimizer], the same [debug] seed, no seed checkpoint: the first
    step of DMuon (Z3 and Z2) and of TorchTitan's AdamW sees the same loss and the same global
    gradient norm. DMuon's dedicated weights are initialised exactly as TorchTitan initialises
    them under FSDP2 (the same random numbers on every rank); this also checks the gradient scale
    (TorchTitan sums: divide factor 1) and the clip's count of owner-held plus FSDP-sharded
    gradients (each element once; summed in another order: 1e-5). The Z3 job also saves the documented
    HF export of its last step, which transformers loads."""
    export = _documented_export_flags()
    runs = {
        "adamw": parse(run_job(pool2, tmp_path / "a", "--training.steps", "1", config="debug_model_adamw.toml"))[0],
        "z3": parse(run_job(pool2, tmp_path / "b", "--training.steps", "1", *export))[0],
        "z2": parse(run_job(pool2, tmp_path / "c", "--training.steps", "3", config="debug_model_z2.toml"))[0],
    }
    assert sorted(runs["z2"]) == [1, 2, 3] and runs["z2"][3][0] < runs["z2"][1][0]  # and the Z2 config trains
    loss, norm = runs["adamw"][1]
    for name in ("z3", "z2"):
        assert runs[name][1][0] == loss, name
        assert runs[name][1][1] == pytest.approx(norm, rel=1e-4), name
    _check_export_loads_in_transformers(str(tmp_path / "b" / "checkpoint" / "step-1"))


def _documented_export_flags() -> list[str]:
    """The flags of the documented HF export command (docs/checkpoints/hf-export.md; tests/titan/test_hf_export.py
    checks the export's logits)."""
    with open(os.path.join(ROOT, "docs", "checkpoints", "hf-export.md")) as f:
        block = f.read().split("```bash\n", 1)[1].split("```", 1)[0]
    (command,) = [line for line in block.splitlines() if line.strip()]
    words = command.split()
    assert words[0] == "./run_train.sh", command
    return words[1:]


def _check_export_loads_in_transformers(folder: str) -> None:
    """The debug model's export, as docs/checkpoints/hf-export.md says: ``from_pretrained`` for the model and the
    tokenizer as they are, no ``sharded/`` folder left, the debug model's shape and the tokenizer's
    special tokens in the config, and the model runs on the tokenizer's ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert not os.path.exists(os.path.join(folder, "sharded")), os.listdir(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert (model.config.num_hidden_layers, model.config.hidden_size, model.config.vocab_size) == (6, 256, 2048)
    assert (
        (model.config.bos_token_id, model.config.eos_token_id)
        == (tokenizer.bos_token_id, tokenizer.eos_token_id)
        != (None, None)
    )
    ids = tokenizer("every rank owns one matrix once .", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(ids, labels=ids).loss)


def test_pipeline_parallel_job_starts_where_adamw_starts(pool4, tmp_path):
    """debug_model_pp.toml: pipeline parallelism 2 (Interleaved1F1B, 2 stages per pipeline rank,
    2 micro-batches) x FSDP 2. Step 1 sees AdamW's loss and global gradient norm with the same
    parallelism (the clip adds up the stages); DMuon moves the deferred design every step (each stage's
    weights broadcast once and reduced once, whatever the micro-batches), and trains."""
    pp = (
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        "Interleaved1F1B",
        "--training.disable_cuda_graphs",
        "true",
    )
    last_stage = 2  # (the loss lives on the last stage: pipeline rank 1 holds stages 1 and 3)
    adamw_job = run_job(
        pool4, tmp_path / "a", "--training.steps", "1", *pp, config="debug_model_adamw.toml", log_rank=last_stage
    )
    adamw, _ = parse(adamw_job)
    result = run_job(pool4, tmp_path / "b", "--training.steps", "3", config="debug_model_pp.toml", log_rank=last_stage)
    steps, comm = parse(result)
    assert sorted(steps) == [1, 2, 3] and steps[3][0] < steps[1][0]
    assert steps[1][0] == adamw[1][0]
    assert steps[1][1] == pytest.approx(adamw[1][1], rel=1e-4)
    assert len(comm) == 3 and all(elements == design > 0 for elements, _, design in comm[1:])
    # and per model part (this rank holds stages 1 and 3)
    parts = re.findall(r"part (\d+) ([\d.]+)M, design ([\d.]+)M", result.stdout)
    assert [p for p, _, _ in parts] == ["0", "1"] * 3 and all(float(e) == float(d) > 0 for _, e, d in parts[2:])


def test_pipeline_without_data_parallelism(pool2, tmp_path):
    """Pipeline parallelism 2 on 2 ranks, one data-parallel rank per stage. Regression: the dedication
    mesh was TorchTitan's world mesh whenever no data-parallel degree was > 1, i.e. the pipeline ranks,
    and the stages' plans (different weights) were "ownership plans differ across ranks"; it is the
    one-rank data-parallel mesh of each stage. Rank 0 (run_train.sh's default LOG_RANK, the first
    stage) logs the job's loss (it logged ``loss: -1.00000``: the loss lives on the last stage's
    ranks), and no warning that the loss is not visible."""
    result = run_job(
        pool2,
        tmp_path,
        "--training.steps",
        "2",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
        config="debug_model_pp.toml",
    )
    steps, comm = parse(result)
    assert "loss is not visible" not in result.stdout
    assert sorted(steps) == [1, 2] and steps[2][0] < steps[1][0]
    assert all(elements == design == 0 for elements, _, design in comm)  # one rank per stage: nothing to move


def test_tensor_parallel_job_starts_where_adamw_starts(pool4, tmp_path):
    """TP 2 x FSDP 2 (TorchTitan's default spmd_types backend, sequence parallel and loss parallel
    on): step 1 sees AdamW's loss and global gradient norm with the same parallelism (DMuon initialises
    the TP-local shards as TorchTitan does, the clip sums the owners' TP-shard gradients over dp x tp),
    and it trains. Rank 0's traffic is the design's average (FSDP's Z3 on TP-local elements plus the
    step's TP all-to-alls) up to which matrices it is the NS home of (tests/titan/test_tensor_parallel.py
    checks the average exactly)."""
    adamw, _ = parse(run_job(pool4, tmp_path / "a", "--training.steps", "1", *TP, config="debug_model_adamw.toml"))
    steps, comm = parse(run_job(pool4, tmp_path / "b", "--training.steps", "3", *TP))
    assert sorted(steps) == [1, 2, 3] and steps[3][0] < steps[1][0]
    assert steps[1][0] == adamw[1][0]
    assert steps[1][1] == pytest.approx(adamw[1][1], rel=1e-4)
    assert len(comm) == 3
    for elements, _, design in comm[1:]:
        assert elements == pytest.approx(design, rel=0.15) and design > 0


DEEPSEEK = ("--model.name", "deepseek_v3", "--training.seq_len", "64", "--activation_checkpoint.mode", "none")


def test_tensor_parallel_moe_job_starts_where_adamw_starts(pool4, tmp_path):
    """TorchTitan's deepseek_v3 debug model (MLA, a dense first layer, shared and 8 routed experts)
    with TP 2 x FSDP 2: step 1 sees AdamW's loss and gradient norm with the same parallelism and seed
    (the experts TorchTitan keeps per data-parallel rank, split by TP, and the weights TP replicates
    start as TorchTitan starts them), and it trains; rank 0's traffic is the design's average up to
    which matrices and experts it is the NS home of (tests/titan/test_tensor_parallel_moe.py checks the
    average exactly)."""
    job = (*TP, *DEEPSEEK)
    adamw, _ = parse(run_job(pool4, tmp_path / "a", "--training.steps", "1", *job, config="debug_model_adamw.toml"))
    steps, comm = parse(run_job(pool4, tmp_path / "b", "--training.steps", "3", *job))
    assert sorted(steps) == [1, 2, 3] and steps[3][0] < steps[1][0]
    assert steps[1][0] == adamw[1][0]
    assert steps[1][1] == pytest.approx(adamw[1][1], rel=1e-4)
    for elements, _, design in comm[1:]:
        assert elements == pytest.approx(design, rel=0.15) and design > 0


def test_context_parallel_job_starts_where_adamw_starts(pool4, tmp_path):
    """CP 2 x FSDP 2 and no other flag (here 4 steps): DMuon trains on this CPU (TorchTitan's default
    spmd_types backend; the CPU attention in place of FlexAttention, said in the log), the loss falls,
    and every step after the first moves the design's figure for N = 4 (the first also re-broadcasts the
    layer Z3 keeps and launches step 2's first broadcast). The same job with debug_model_adamw.toml
    (TorchTitan's AdamW) sees the same step-1 loss as printed and the same gradient norm (1e-4: the norm
    summed in another order): DMuon starts from TorchTitan's own initial weights under CP too."""
    cp = ("--parallelism.data_parallel_shard_degree", "2", "--parallelism.context_parallel_degree", "2")
    result = run_job(pool4, tmp_path / "dmuon", *cp, "--training.steps", "4")
    dmuon, comm = parse(result)
    assert "ContextParallelCausalAttention" in result.stdout
    adamw, _ = parse(run_job(pool4, tmp_path / "adamw", *cp, "--training.steps", "1", config="debug_model_adamw.toml"))
    assert sorted(dmuon) == list(range(1, 5)) and dmuon[4][0] < 0.9 * dmuon[1][0], dmuon
    assert dmuon[1][0] == adamw[1][0]
    assert dmuon[1][1] == pytest.approx(adamw[1][1], rel=1e-4)
    assert len(comm) == 4 and all(elements == design for elements, _, design in comm[1:]), comm


def test_ddp_mode_runs_at_the_all_reduce_floor(pool2, tmp_path):
    """reshard_after_forward left unset: under DDP the default is Z2 (a Z3 fallback would
    move 50% more: 3(N-1)/N instead of 2(N-1)/N)."""
    steps, comm = parse(
        run_job(
            pool2,
            tmp_path,
            "--training.steps",
            "3",
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--optimizer.reshard_after_forward",
            "none",
        )
    )
    assert sorted(steps) == [1, 2, 3]
    assert all(elements == design == pytest.approx(5.1118, abs=1e-4) for elements, _, design in comm[1:])  # 2(N-1)/N
    assert comm[0][0] == pytest.approx(5.1118 + 0.4260, abs=1e-4)  # + step 2's first broadcast, launched early


def test_qwen3_with_gradient_accumulation(pool2, tmp_path):
    """qwen3's debug model, two micro-batches per step: DMuon moves its volume per micro-batch."""
    steps, comm = parse(
        run_job(pool2, tmp_path, "--training.steps", "2", "--model.name", "qwen3", "--training.global_batch_size", "8")
    )
    assert sorted(steps) == [1, 2] and len(comm) == 2
    assert all(elements == design for elements, _, design in comm[1:])  # step 1 learns the layer order


def test_deepseek_v3_debugmodel_trains(pool2, tmp_path):
    """MLA attention, a dense first layer, shared and routed experts."""
    steps, comm = parse(run_job(pool2, tmp_path, "--training.steps", "3", *DEEPSEEK))
    assert sorted(steps) == [1, 2, 3] and steps[3][0] < steps[1][0]
    assert all(elements == design for elements, _, design in comm[1:])


def _stopped_before_loading(rank, world, config, overrides):
    """``train_in_process``, expected to be stopped by the check before a checkpoint load: this rank's error."""
    from titan_dmuon.integration.components.checkpoint import CheckpointError

    try:
        train_in_process(rank, world, config, overrides, log_rank=rank)
    except CheckpointError as e:
        return str(e)
    return None


def test_another_data_parallel_degree_stops_every_rank_before_loading(pool2, pool4, tmp_path):
    """The documented resharding (docs/checkpoints/torchtitan.md: a 2-rank job's checkpoint resumed by the HSDP
    job on 4 ranks) without ``--checkpoint.exclude_from_loading dataloader`` failed on every rank inside
    TorchTitan's dataloader (a missing dataloader.dp_rank_3); now every rank stops before loading with the line
    that names the option. (With the option it resumes: the documented command, run as written in
    tests/e2e/test_titan_checkpoint_e2e.py.)"""
    run_job(pool2, tmp_path, "--checkpoint.enable", "true", "--training.steps", "2")
    overrides = ("--job.dump_folder", str(tmp_path), "--metrics.disable_color_printing", "true")
    overrides += ("--checkpoint.enable", "true", "--training.steps", "4")
    errors = pool4.run(_stopped_before_loading, "debug_model_hsdp.toml", overrides)
    for error in errors:
        assert error is not None and "saved with data-parallel degree 2 and this job has 4" in error, errors
        assert "--checkpoint.exclude_from_loading dataloader" in error, errors
