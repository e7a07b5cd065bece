"""DMuon against a single-process torch.optim.Muon + torch.optim.AdamW reference."""

import pytest
import torch

from tests.helpers import (
    TOLERANCE, batches, bitwise_equal, distribute, full_state, global_loss, max_diff, reference_train, toy_model, train,
)

STEPS = 5


def _vs_reference(rank, world, mode):
    data = batches(STEPS)
    model = toy_model()
    ref, ref_losses, _ = reference_train(model, data)
    setup = distribute(model, mode, world)
    losses = global_loss([l for l, _ in train(setup, data, rank, world)])
    return max_diff(full_state(setup), ref), losses, ref_losses


@pytest.mark.parametrize("mode", ["ddp", "z2", "z3"])
def test_two_ranks_match_reference(pool2, mode):
    for diff, losses, ref_losses in pool2.run(_vs_reference, mode):
        assert diff < TOLERANCE
        assert losses == pytest.approx(ref_losses, abs=1e-4)
        assert losses[-1] < losses[0]


@pytest.mark.parametrize("mode", ["z3", "hsdp"])
def test_four_ranks_match_reference(pool4, mode):
    for diff, losses, ref_losses in pool4.run(_vs_reference, mode):
        assert diff < TOLERANCE
        assert losses == pytest.approx(ref_losses, abs=1e-4)
