"""Context parallelism through ./run_train.sh, as a user runs it (in-process CP:
tests/titan/test_context_parallel.py)."""

import pytest

from tests.support.run_train import parse, run_train

CP_COMMAND = ("--parallelism.data_parallel_shard_degree", "2", "--parallelism.context_parallel_degree", "2")


def test_run_train_with_context_parallelism_as_written(tmp_path):
    """``NGPU=4 CONFIG_FILE=train_configs/debug_model.toml ./run_train.sh`` with CP 2 x FSDP 2 and no other
    flag (here 4 steps): DMuon trains on this CPU (TorchTitan's default spmd_types backend; the CPU
    attention in place of FlexAttention, said in the log), the loss falls, and every step after the
    first moves the design's figure for N = 4 (the first also re-broadcasts the layer Z3 keeps and
    launches step 2's first broadcast). The same command with debug_model_adamw.toml (TorchTitan's
    AdamW) sees the same step-1 loss as printed and the same gradient norm (1e-4: the norm summed in
    another order): DMuon starts from TorchTitan's own initial weights under CP too."""
    result = run_train(tmp_path / "dmuon", *CP_COMMAND, "--training.steps", "4", ngpu=4)
    dmuon, comm = parse(result)
    assert "ContextParallelCausalAttention" in result.stdout + result.stderr
    adamw, _ = parse(
        run_train(tmp_path / "adamw", *CP_COMMAND, "--training.steps", "1", config="debug_model_adamw.toml", ngpu=4)
    )
    assert sorted(dmuon) == list(range(1, 5)) and dmuon[4][0] < 0.9 * dmuon[1][0], dmuon
    assert dmuon[1][0] == adamw[1][0]
    assert dmuon[1][1] == pytest.approx(adamw[1][1], rel=1e-4)
    assert len(comm) == 4 and all(elements == design for elements, _, design in comm[1:]), comm
