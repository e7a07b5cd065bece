"""Owner groups as TorchTitan's settings turn them on and off (the runtime's groups:
tests/distributed/test_owner_groups.py)."""

from __future__ import annotations

from titan_dmuon.plan.owner_groups import GroupOptions


def test_torchtitan_settings_turn_groups_on_off_and_keep_attention_whole_under_qk_clip():
    """optimizer.owner_groups (default on), owner_group_node_size / owner_group_ns_tflops, and the rules:
    ns_mode 'exact' keeps one owner per weight (torch.optim.Muon's own update), QK-clip keeps the
    attention projections whole (its per-head rescale reads their rows on one owner)."""
    from titan_dmuon.integration import cpu

    cpu.enable()
    from titan_dmuon.integration.components.optimizer_container import DMuonOptimizersContainer
    from titan_dmuon.integration.distributed.parallelize import ATTENTION_PARAMS, DedicationSettings

    def settings(**options):
        return DedicationSettings.of(DMuonOptimizersContainer.Config(name="dmuon", **options))

    assert settings().owner_groups == GroupOptions() and settings().keep_whole == ()
    assert settings(owner_groups=False).owner_groups is None
    assert settings(ns_mode="exact").owner_groups is None
    assert settings(normuon_beta2=0.95).owner_groups is None  # NorMuon's rows are whole rows
    assert settings(ns_dtype="float16").owner_groups is None  # the group's iteration is bf16
    assert settings(owner_group_node_size=4, owner_group_ns_tflops=300.0).owner_groups == GroupOptions(
        node_size=4, ns_tflops=300.0
    )
    assert settings(qk_clip_threshold=100.0).keep_whole == (ATTENTION_PARAMS,)
