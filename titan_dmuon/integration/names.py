"""Names the integration compares and writes, each declared once.

* ``[optimizer] name`` values (the TOML key, ``--optimizer.name``, ``DMuonOptimizersContainer.Config.name``);
* the optimizer names of TorchTitan's container (``ParamGroupConfig.optimizer_name``: what
  ``_resolve_optimizer_factory`` is asked for, and what a user's DMuon param group is named);
* ``[optimizer] muon_params``' default (``DEFAULT_MUON_PARAMS``);
* the figures ``DMuonMetricsProcessor`` logs each step (TensorBoard/W&B tags), and the keys of
  ``DMuon.last_step_stats`` they are made from (declared by the core: ``titan_dmuon.optim.optimizer.StepStat``).
"""

from __future__ import annotations

# ---- [optimizer] name ----------------------------------------------------------------------------------
DMUON = "dmuon"  # Muon on the dedicated weights (and experts), AdamW on the rest
ADAMW = "AdamW"  # TorchTitan's own optimizers: every parameter from the flat keys (lr, betas, eps, weight_decay)
ADAM = "Adam"
NAIVE_MUON = "naive_muon"  # the benchmarks' baseline, built only by its config module's container
OPTIMIZER_NAMES = (DMUON, ADAMW, ADAM, NAIVE_MUON)  # in the order error messages list them
ADAMW_NAMES = (ADAMW, ADAM)
MUON_FAMILY_NAMES = (DMUON, NAIVE_MUON)  # names that read the Muon keys (momentum, ns_*, adamw_*, muon_params...)
BASELINE_NAMES = (NAIVE_MUON,)  # built only by a container subclass that says so (baseline_optimizer)

# ---- [optimizer] muon_params: the Muon targets of TorchTitan's models by default --------------------------
# (here, not in training/parallelize.py, so that what must run without TorchTitan, ``python -m
# titan_dmuon.sizing`` on its shape tables, selects the same weights)
DEFAULT_MUON_PARAMS = (
    # attention: q/k/v/o, fused wqkv, MLA (wq or wq_a/wq_b, wkv_a, wkv_b)
    r"\.attention\.(qkv_linear\.)?w(q|k|v|o|qkv|q_a|q_b|kv_a|kv_b)\.weight$",
    r"\.feed_forward\.w[123]\.weight$",  # dense MLP
    r"\.moe\.routed_experts\.inner_experts\.w(1_EFD|2_EDF|3_EFD)$",  # routed experts, 3-D
    r"\.moe\.shared_experts\.w[123]\.weight$",  # shared experts
    r"\.moe\.router\.gate\.weight$",  # router (on Muon, as TorchTitan's recipe for Kimi/Moonlight)
)

# ---- optimizer names in TorchTitan's container (ParamGroupConfig.optimizer_name) -------------------------
DMUON_FACTORY = "DMuon"  # the param groups of the Muon targets
# A [[optimizer.param_groups]] entry that claims Muon targets into a DMuon param group of its own: "DMuon" as
# TorchTitan names its optimizers ("AdamW", "DistMuon"), or "dmuon" as [optimizer] name writes it.
DMUON_GROUP_NAMES = (DMUON_FACTORY, DMUON)
ADAMW_FACTORY = ADAMW  # the catch-all group of a dmuon job (TorchTitan's AdamW)


class Metric:
    """The per-step figures of ``DMuonMetricsProcessor`` (log line, TensorBoard/W&B tags)."""

    STEP_SECONDS = "time/step(s)"
    OPTIMIZER_STEP_SECONDS = "time/optimizer_step(s)"
    # every collective of the step, FSDP2's too ([metrics] count_all_comm = true)
    ALL_COMM_ELEMENTS = "comm/elements_per_rank"
    ALL_COMM_MB = "comm/MB_per_rank"
    ALL_COMM_LAUNCHES = "comm/launches_per_rank"
    # DMuon's own
    COMM_ELEMENTS = "dmuon/comm_elements_per_rank"
    COMM_MB = "dmuon/comm_MB_per_rank"
    DESIGN_ELEMENTS = "dmuon/design_elements_per_rank"
    LAUNCHES = "dmuon/launches_per_step"
    NS_MATRICES = "dmuon/ns_matrices"
    NS_MS = "dmuon/ns_ms"
    OWNER_IMBALANCE = "dmuon/owner_imbalance"
    PEAK_BUFFER_MB = "dmuon/peak_buffer_MB"
    HOST_MS = "dmuon/host_ms"
    FIRST_LAYER_WAIT_MS = "dmuon/first_layer_wait_ms"
    QK_MAX_LOGIT = "dmuon/qk_max_logit"
    QK_CLIPPED_HEADS = "dmuon/qk_clipped_heads"

    @staticmethod
    def part_comm_elements(part: int) -> str:
        """DMuon's elements per rank of one pipeline stage this rank holds (when it holds several)."""
        return f"dmuon/part{part}/comm_elements_per_rank"

    @staticmethod
    def part_design_elements(part: int) -> str:
        return f"dmuon/part{part}/design_elements_per_rank"
