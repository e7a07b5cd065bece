"""Where the weights live: settles the seeds' disagreement on DMuon-Z2 memory by measurement.

One seed says Z2 keeps P_M per rank resident, the other P_M/N. The runtime
tracks the bytes of packed buffers it allocates; at the end of forward Z2
holds every layer's full weights: P_M per rank. Z3 holds at most two
layers (the running one and the prefetched one). Between steps only the
owners' weights remain (P_M/N per rank), plus the first layer's buffer, whose
broadcast for the next forward starts at the end of the step.
"""

from tests.support.helpers import batches, distribute, toy_model, train
from titan_dmuon.runtime import CommLabel

LAYERS = 4


def _buffer_peaks(rank, world, mode):
    setup = distribute(toy_model(n_layers=LAYERS), mode, world)
    data = batches(3)
    train(setup, data[:1], rank, world)  # step 1 records the layer order (prefetching starts at step 2)
    setup.handle.reset_peak_buffer_bytes()
    train(setup, data[1:], rank, world)
    held = sum(p.numel() * p.element_size() for p in setup.handle.params)
    return setup.handle.peak_buffer_bytes, setup.handle.buffer_bytes, held, setup.handle.plan.total_numel


def test_z2_keeps_p_m_per_rank_and_z3_two_layers(pool2):
    z2 = pool2.run(_buffer_peaks, "z2")
    z3 = pool2.run(_buffer_peaks, "z3")
    p_m = z2[0][3]
    layer_bytes = p_m * 4 // LAYERS  # fp32 compute dtype in this test
    for (z2_peak, z2_now, held, _), (z3_peak, z3_now, _, _) in zip(z2, z3):
        assert z2_peak == p_m * 4  # the whole P_M, on every rank
        assert z3_peak == 2 * layer_bytes  # current layer + prefetched neighbour
        # after the step only the first layer's buffer is allocated: its broadcast for the next forward is in flight
        assert z2_now == z3_now == layer_bytes
        assert held < p_m * 4  # between steps each rank keeps only what it owns
    assert sum(r[2] for r in z2) == p_m * 4  # ... and together the owners keep P_M once


def _comm_stats_vs_ledger(rank, world, mode):
    from titan_dmuon import CommLedger

    setup = distribute(toy_model(), mode, world)
    data = batches(2)
    train(setup, data[:1], rank, world)
    setup.handle.pop_comm_stats()
    with CommLedger() as ledger:
        train(setup, data[1:], rank, world)
    own = setup.handle.pop_comm_stats()
    by_source = {
        source: (ledger.elements(source=source), ledger.bytes(source=source), ledger.launch_groups(source=source))
        for source in {record.source for record in ledger.select(source=CommLabel.DMUON)}
    }
    return own, by_source


def test_runtime_comm_stats_equal_the_ledger(pool4):
    """The figures TorchTitan logs come from the runtime's own count; it must agree with
    the ledger's independent count of the collectives actually issued."""
    for own, ledger in pool4.run(_comm_stats_vs_ledger, "hsdp"):
        assert own == ledger and own
