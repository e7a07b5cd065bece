"""End to end: ./run_train.sh on this machine (CPU, gloo), as a user runs it."""

import os
import re
import socket
import subprocess
import sys

import pytest

from tests.support.run_train import ROOT, STEP, parse, run_train, tensorboard_tags
from titan_dmuon.integration.names import Metric


def test_main_job_trains_and_logs_dmuon_figures(tmp_path):
    """The README's main job: debug model, DMuon-Z3, 2 ranks, 20 steps, TensorBoard on."""
    result = run_train(tmp_path, "--metrics.enable_tensorboard", "true")
    steps, comm = parse(result)
    assert sorted(steps) == list(range(1, 21))
    assert steps[20][0] < 0.8 * steps[1][0], steps
    assert len(comm) == 20
    # Z3 with the last layer kept for backward: 3(N-1)/N * P_M - (N-1)/N * P_layer, P_M = 5,111,808 in 6
    # layers; step 1 (which learns the layer order) re-broadcasts the last layer and already launches
    # step 2's first broadcast.
    for elements, megabytes, design in comm[1:]:
        assert elements == design == pytest.approx(7.2417, abs=1e-4)
        assert megabytes == pytest.approx(19.5953, abs=1e-3)  # bf16 broadcasts, fp32 reduce
    assert comm[0][0] == pytest.approx(7.6677 + 0.4260, abs=1e-4)
    assert "--config_file train_configs/debug_model.toml" in result.stdout  # run_train.sh prints its command
    tags = tensorboard_tags(tmp_path)
    assert {Metric.COMM_ELEMENTS, Metric.NS_MS, Metric.OWNER_IMBALANCE, "grad_norm"} <= tags


def test_dmuon_starts_exactly_where_adamw_starts(tmp_path):
    """The same TOML apart from [optimizer], the same [debug] seed, no seed checkpoint: the first
    step of DMuon (Z3 and Z2) and of TorchTitan's AdamW sees the same loss and the same global
    gradient norm. DMuon's dedicated weights are initialised exactly as TorchTitan initialises
    them under FSDP2 (the same random numbers on every rank); this also checks the gradient scale
    (TorchTitan sums: divide factor 1) and the clip's count of owner-held plus FSDP-sharded
    gradients (each element once; summed in another order: 1e-5)."""
    export = _documented_export_flags()  # (the Z3 run also saves the documented HF export of its last step)
    runs = {
        "adamw": parse(run_train(tmp_path / "a", "--training.steps", "1", config="debug_model_adamw.toml"))[0],
        "z3": parse(run_train(tmp_path / "b", "--training.steps", "1", *export))[0],
        "z2": parse(run_train(tmp_path / "c", "--training.steps", "3", config="debug_model_z2.toml"))[0],
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


# The HSDP config (4 ranks) runs in test_titan_checkpoint_e2e.py::test_documented_checkpoint_commands_run_as_written.


def test_pipeline_parallel_job_starts_where_adamw_starts(tmp_path):
    """debug_model_pp.toml: pipeline parallelism 2 (Interleaved1F1B, 2 stages per pipeline rank,
    2 micro-batches) x FSDP 2 through run_train.sh. Step 1 sees AdamW's loss and global gradient
    norm with the same parallelism (the clip adds up the stages); DMuon moves the deferred
    design every step (each stage's weights broadcast once and reduced once, whatever the
    micro-batches), and trains."""
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
    last_stage = {"LOG_RANK": "2"}  # (the loss lives on the last stage: pipeline rank 1 holds stages 1 and 3)
    adamw, _ = parse(
        run_train(tmp_path / "a", "--training.steps", "1", *pp, config="debug_model_adamw.toml", ngpu=4, env=last_stage)
    )
    result = run_train(tmp_path / "b", "--training.steps", "3", config="debug_model_pp.toml", ngpu=4, env=last_stage)
    steps, comm = parse(result)
    assert sorted(steps) == [1, 2, 3] and steps[3][0] < steps[1][0]
    assert steps[1][0] == adamw[1][0]
    assert steps[1][1] == pytest.approx(adamw[1][1], rel=1e-4)
    assert len(comm) == 3 and all(elements == design > 0 for elements, _, design in comm[1:])
    # and per model part (this rank holds stages 1 and 3)
    parts = re.findall(r"part (\d+) ([\d.]+)M, design ([\d.]+)M", result.stdout + result.stderr)
    assert [p for p, _, _ in parts] == ["0", "1"] * 3 and all(float(e) == float(d) > 0 for _, e, d in parts[2:])


def test_pipeline_without_data_parallelism(tmp_path):
    """Pipeline parallelism 2 on 2 ranks, one data-parallel rank per stage. Regression: the dedication
    mesh was TorchTitan's world mesh whenever no data-parallel degree was > 1, i.e. the pipeline ranks,
    and the stages' plans (different weights) were "ownership plans differ across ranks"; it is the
    one-rank data-parallel mesh of each stage. With run_train.sh's default LOG_RANK=0 (the first
    stage) the log shows the job's loss (it showed ``loss: -1.00000``: the loss lives on the last
    stage's ranks), and no warning that the loss is not visible."""
    result = run_train(
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
    assert "loss is not visible" not in result.stdout + result.stderr
    assert sorted(steps) == [1, 2] and steps[2][0] < steps[1][0]
    assert all(elements == design == 0 for elements, _, design in comm)  # one rank per stage: nothing to move


def test_tensor_parallel_job_starts_where_adamw_starts(tmp_path):
    """TP 2 x FSDP 2 (TorchTitan's default spmd_types backend, sequence parallel and loss parallel
    on) through run_train.sh: step 1 sees AdamW's loss and global gradient norm with the same
    parallelism (DMuon initialises the TP-local shards as TorchTitan does, the clip sums the owners'
    TP-shard gradients over dp x tp), and it trains. Rank 0's traffic is the design's average
    (FSDP's Z3 on TP-local elements plus the step's TP all-to-alls) up to which matrices it is the
    NS home of (tests/titan/test_tensor_parallel.py checks the average exactly)."""
    tp = ("--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2")
    adamw, _ = parse(run_train(tmp_path / "a", "--training.steps", "1", *tp, config="debug_model_adamw.toml", ngpu=4))
    steps, comm = parse(run_train(tmp_path / "b", "--training.steps", "3", *tp, ngpu=4))
    assert sorted(steps) == [1, 2, 3] and steps[3][0] < steps[1][0]
    assert steps[1][0] == adamw[1][0]
    assert steps[1][1] == pytest.approx(adamw[1][1], rel=1e-4)
    assert len(comm) == 3
    for elements, _, design in comm[1:]:
        assert elements == pytest.approx(design, rel=0.15) and design > 0


def test_tensor_parallel_moe_job_starts_where_adamw_starts(tmp_path):
    """TorchTitan's deepseek_v3 debug model (MLA, a dense first layer, shared and 8 routed experts)
    with TP 2 x FSDP 2 through run_train.sh: step 1 sees AdamW's loss and gradient norm with the same
    parallelism and seed (the experts TorchTitan keeps per data-parallel rank, split by TP, and the
    weights TP replicates start as TorchTitan starts them), and it trains; rank 0's traffic is the
    design's average up to which matrices and experts it is the NS home of
    (tests/titan/test_tensor_parallel_moe.py checks the average exactly). (qwen3's moe_debug costs ~20 s
    per step here: the README's figures for it come from the same commands.)"""
    job = (
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--model.name",
        "deepseek_v3",
        "--training.seq_len",
        "64",
        "--activation_checkpoint.mode",
        "none",
    )
    adamw, _ = parse(run_train(tmp_path / "a", "--training.steps", "1", *job, config="debug_model_adamw.toml", ngpu=4))
    steps, comm = parse(run_train(tmp_path / "b", "--training.steps", "3", *job, ngpu=4))
    assert sorted(steps) == [1, 2, 3] and steps[3][0] < steps[1][0]
    assert steps[1][0] == adamw[1][0]
    assert steps[1][1] == pytest.approx(adamw[1][1], rel=1e-4)
    for elements, _, design in comm[1:]:
        assert elements == pytest.approx(design, rel=0.15) and design > 0


def test_ddp_mode_runs_at_the_all_reduce_floor(tmp_path):
    """reshard_after_forward left unset: under DDP the default is Z2 (a Z3 fallback would
    move 50% more: 3(N-1)/N instead of 2(N-1)/N)."""
    steps, comm = parse(
        run_train(
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


def test_qwen3_with_gradient_accumulation(tmp_path):
    """qwen3's debug model, two micro-batches per step: DMuon moves its volume per micro-batch."""
    steps, comm = parse(
        run_train(tmp_path, "--training.steps", "2", "--model.name", "qwen3", "--training.global_batch_size", "8")
    )
    assert sorted(steps) == [1, 2] and len(comm) == 2
    assert all(elements == design for elements, _, design in comm[1:])  # step 1 learns the layer order


def test_two_node_launch_on_one_machine(tmp_path):
    """Two run_train.sh invocations, NNODES=2, one process each, rendezvous on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "CONFIG_FILE": "train_configs/debug_model.toml",
        "NGPU": "1",
        "NNODES": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "PYTHON": sys.executable,
    }
    cmd = [
        "./run_train.sh",
        "--job.dump_folder",
        str(tmp_path),
        "--metrics.disable_color_printing",
        "true",
        "--training.steps",
        "4",
    ]
    nodes = [
        subprocess.Popen(
            cmd,
            cwd=ROOT,
            env={**env, "NODE_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=420)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    steps = {int(s): float(loss) for s, loss, _ in STEP.findall(outputs[0])}
    assert sorted(steps) == [1, 2, 3, 4] and steps[4] < steps[1]
    assert "--nnodes 2 --node_rank 0" in outputs[0]


def test_config_error_stops_before_any_process_group(tmp_path):
    """The entry point run_train.sh launches on every rank: a bad key exits with status 2."""
    env = {**os.environ, "WORLD_SIZE": "2"}
    cmd = [
        sys.executable,
        "-m",
        "titan_dmuon.integration.train",
        "--config_file",
        "train_configs/debug_model.toml",
        "--training.stepz",
        "3",
    ]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "command line: unknown key [training] stepz (did you mean 'steps'?)" in result.stdout + result.stderr
    assert "Building device mesh" not in result.stdout + result.stderr


def test_deepseek_v3_debugmodel_trains(tmp_path):
    """MLA attention, a dense first layer, shared and routed experts: DMuon through run_train.sh."""
    steps, comm = parse(
        run_train(
            tmp_path,
            "--model.name",
            "deepseek_v3",
            "--training.steps",
            "3",
            "--training.seq_len",
            "64",
            "--activation_checkpoint.mode",
            "none",
        )
    )
    assert sorted(steps) == [1, 2, 3] and steps[3][0] < steps[1][0]
    assert all(elements == design for elements, _, design in comm[1:])


def test_run_train_sh_stops_before_torchrun_with_the_line_last(tmp_path):
    """A config error (here a misspelt key): the message is the last line and no torchrun is started
    (run_train.sh prints the torchrun command just before it runs it)."""
    env = {**os.environ, "CONFIG_FILE": "train_configs/debug_model.toml", "NGPU": "2", "PYTHON": sys.executable}
    result = subprocess.run(
        ["./run_train.sh", "--job.dump_folder", str(tmp_path), "--training.stepz", "3"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert (
        result.stderr.rstrip("\n")
        .rsplit("\n", 1)[-1]
        .startswith("config error: command line: unknown key [training] stepz (did you mean 'steps'?)")
    ), result.stderr[-2000:]
    assert "torch.distributed.run" not in result.stdout + result.stderr
