"""The real-text study's reading of a job's log and its time to a loss (benchmarks/convergence_real_text.py):
the parts a two-hour run would otherwise find wrong at its end."""

import pytest

from benchmarks.convergence_real_text import median_step_s, parse_log, reach

TRAIN, HELD_OUT, STEP_S, OPTIMIZER_MS = (8.14389, 8.09961), (8.0958, 8.0168), (1.124, 0.543), (226.4, 99.5)
LOG = "".join(
    f"[rank0]:[titan] ... - root - INFO - step:  {s}  loss:  {TRAIN[s - 1]:.5f}  grad_norm:  0.8623  memory:  0.92GiB\n"
    f"[rank0]:[titan] ... - root - INFO - titan_dmuon: step {STEP_S[s - 1]:.3f}s, "
    f"optimizer {OPTIMIZER_MS[s - 1]:.1f} ms"
    "  dmuon: comm 7.2417M elements/rank/step\n"
    f"[rank0]:[titan] ... - root - INFO - validate step:  {s}  loss:  {HELD_OUT[s - 1]:.4f}  memory:  0.93GiB\n"
    for s in (1, 2)
)


def test_a_validation_line_is_not_read_as_the_steps_training_loss():
    """ "validate step:  2  loss: ..." contains "step:  2  loss:"; the first version read it as step 2's
    training loss (the held-out loss overwrote it: both columns showed 6.1094 at the last step)."""
    curves = parse_log(LOG, 2)
    assert curves["loss"] == list(TRAIN)
    assert curves["held_out"] == [(1, HELD_OUT[0]), (2, HELD_OUT[1])]
    assert curves["step_s"] == list(STEP_S) and curves["optimizer_ms"] == list(OPTIMIZER_MS)
    with pytest.raises(ValueError, match="held-out loss at step 3"):
        parse_log(LOG, 3)


def test_time_to_a_loss_is_interpolated_between_validations():
    run = {"config": "c", "held_out": [(1, 8.0), (3, 6.0), (5, 4.0)], "step_s": [1.0, 1.0, 2.0, 5.0, 3.0]}
    assert reach(run, 5.0) == 4.0  # halfway from step 3 to step 5
    assert reach(run, 8.5) == 1.0  # reached at the first validation
    assert reach(run, 3.0) is None


def test_training_seconds_run_on_the_configs_median_step():
    """Seconds are steps x the median step time over the config's seeds, steps 3 on (a slow step from
    other load on the machine does not move it): steps 3-5 of two seeds, 2, 5, 3 and 2, 2, 9 s -> 2.5 s."""
    runs = [
        {"config": "c", "step_s": [1.0, 1.0, 2.0, 5.0, 3.0]},
        {"config": "c", "step_s": [9.0, 9.0, 2.0, 2.0, 9.0]},
        {"config": "other", "step_s": [7.0] * 5},
    ]
    assert median_step_s(runs, "c") == 2.5
