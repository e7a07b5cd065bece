"""What DMuon checks before a fault-tolerant (TorchFT) job starts: settings, torchft, the lighthouse.

Apart from ``integration/distributed/fault_tolerance.py`` (the trainer side) so that validation can run these
without importing the trainer: every check returns the problem as one line (or None) and
``validation.validate_dmuon`` raises it as its ConfigError.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import time
import urllib.parse

import torch

from titan_dmuon.integration.names import DMUON

SEMI_SYNC_METHODS = ("diloco", "local_sgd")
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
CONNECT_TIMEOUT_ENV = "TORCHFT_CONNECT_TIMEOUT_SEC"  # TorchFT's own variable for its connections
DEFAULT_CONNECT_WAIT_S = 10.0
ASYNC_QUORUM_REASON = (
    "with an asynchronous quorum a live group builds the state it sends to a joining group on "
    "TorchFT's quorum thread while its own forward runs (FSDP2 reshards the parameters under it: "
    "torchtitan issue 4753), and the joining group loads that state only after its forward and "
    "backward ran on its old weights; DMuon runs TorchFT with a synchronous quorum, which waits "
    "for the quorum (and any state transfer) before the forward"
)


def torchft_missing() -> bool:
    return importlib.util.find_spec("torchft") is None


class LighthouseUnreachable(RuntimeError):
    """No TorchFT lighthouse answers where TORCHFT_LIGHTHOUSE points."""


def check_lighthouse(*, wait_s: float | None = None) -> str:
    """The lighthouse address (TORCHFT_LIGHTHOUSE), once something accepts connections there;
    LighthouseUnreachable (one line, with the fix) after ``wait_s`` seconds (default
    TORCHFT_CONNECT_TIMEOUT_SEC, else 10 s) of refused or timed-out connections, polling."""
    address = os.environ.get(LIGHTHOUSE_ENV)
    start = "start one first (torchft_lighthouse --min_replicas 1 --bind [::]:29510) and set"
    if not address:
        raise LighthouseUnreachable(
            f"fault_tolerance.enable = true needs a TorchFT lighthouse and {LIGHTHOUSE_ENV} is not set: {start} "
            f"{LIGHTHOUSE_ENV}=http://<its host>:29510"
        )
    parsed = urllib.parse.urlparse(address if "://" in address else f"http://{address}")
    host, port = parsed.hostname, parsed.port
    if not host or not port:
        raise LighthouseUnreachable(f"{LIGHTHOUSE_ENV}={address!r}: expected http://<host>:<port>")
    if wait_s is None:
        wait_s = float(os.environ.get(CONNECT_TIMEOUT_ENV) or DEFAULT_CONNECT_WAIT_S)
    deadline, problem = time.monotonic() + wait_s, None
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, wait_s))):
                return address
        except OSError as e:
            problem = e.strerror or type(e).__name__
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    raise LighthouseUnreachable(
        f"no TorchFT lighthouse answers at {address} ({LIGHTHOUSE_ENV}; {problem} for {wait_s:g} s): {start} "
        f"{LIGHTHOUSE_ENV} to its address"
    )


def fault_tolerance_problem(config, names, *, this_machine: bool) -> str | None:
    """The first fault-tolerance setting DMuon cannot run, in one line worded for the door (``names``:
    validation's Naming); None when it can, or when ``fault_tolerance.enable`` is false."""
    ft, p, opt = config.fault_tolerance, config.parallelism, config.optimizer

    def key(k: str) -> str:
        return names.key("fault_tolerance", k)

    if not ft.enable:
        return None
    if torchft_missing():
        return f"{key('enable')} = true needs TorchFT, which is not installed: pip install -e '.[ft]' (torchft==0.2.0)"
    if ft.group_size < 1:
        return (
            f"{key('group_size')} = {ft.group_size}: expected the number of replica groups (>= 1), "
            "the same in every group"
        )
    if not 0 <= ft.replica_id < ft.group_size:
        return (
            f"{key('replica_id')} = {ft.replica_id}: expected this group's index, 0 to "
            f"group_size - 1 = {ft.group_size - 1}"
        )
    if not 1 <= ft.min_replica_size <= ft.group_size:
        return f"{key('min_replica_size')} = {ft.min_replica_size}: expected 1 to group_size = {ft.group_size}"
    if ft.process_group not in ("gloo", "nccl"):
        return f"{key('process_group')} = {ft.process_group!r}: expected 'gloo' or 'nccl'"
    if this_machine and ft.process_group == "nccl" and not torch.cuda.is_available():
        return f"{key('process_group')} = 'nccl' on a machine without CUDA: use 'gloo'"
    method = ft.semi_sync_method
    if method is not None and method.lower() not in SEMI_SYNC_METHODS:
        return (
            f"{key('semi_sync_method')} = {method!r}: expected unset (gradients averaged every step) "
            f"or one of {', '.join(map(repr, SEMI_SYNC_METHODS))}"
        )
    if method is not None and method.lower() == "diloco":
        fragments = ft.num_fragments
        if fragments < 1 or ft.sync_steps < fragments or ft.sync_steps % fragments:
            return (
                f"{key('sync_steps')} = {ft.sync_steps} with num_fragments = {fragments}: DiLoCo syncs "
                "one fragment at a time, so sync_steps must be a multiple of num_fragments (>= 1)"
            )
        if fragments > 1 and getattr(config.model_spec, "fragment_fn", None) is None:
            return (
                f"{key('num_fragments')} = {fragments}: the {config.model_spec.name} model spec has no "
                "fragment function (TorchTitan's torchft.llama3 registry has one); use num_fragments = 1"
            )
    if not config.checkpoint.enable:
        return (
            f"{key('enable')} = true with {names.key('checkpoint', 'enable')} = false: TorchFT's state transfer to a "
            "joining group sends what the checkpointer registers, and without checkpointing nothing is registered "
            "(torchtitan issue 4209); set checkpoint.enable = true (a large checkpoint.interval keeps saves rare)"
        )
    if opt.name == DMUON:
        if p.data_parallel_replicate_degree > 1:
            return (
                f"{names.key('parallelism', 'data_parallel_replicate_degree')} = {p.data_parallel_replicate_degree} "
                f"with {key('enable')} = true: DMuon's HSDP reduces each gradient to one global owner across the "
                "replicas and only that owner keeps its momentum, so a lost replica would take it along; under "
                "TorchFT the replica groups are the replicas and each group dedicates on its own mesh "
                "(data_parallel_replicate_degree = 1; fault_tolerance.group_size groups)"
            )
        for degree in ("pipeline_parallel_degree", "tensor_parallel_degree", "context_parallel_degree"):
            if getattr(p, degree) > 1:
                return (
                    f"{names.key('parallelism', degree)} = {getattr(p, degree)} with {key('enable')} = true: "
                    "DMuon under TorchFT is built and tested with data parallelism inside each group "
                    "(FSDP, or one rank); set it to 1"
                )
        if opt.qk_clip_threshold is not None:
            return (
                f"{names.key('optimizer', 'qk_clip_threshold')} = {opt.qk_clip_threshold!r} "
                f"with {key('enable')} = true: "
                "QK-clip's per-head max logit would cover one group's batch only, so the groups would clip "
                "differently: per step they would drift apart (TorchFT's state transfer needs them identical), and "
                "under semi-synchronous training (DiLoCo, LocalSGD) the sync would average weights each group clipped "
                "on its own batch, which the clip's bound (every head's logit at most tau on the job's batch) does "
                "not cover; leave QK-clip off under TorchFT"
            )
    if this_machine:
        try:
            check_lighthouse()
        except LighthouseUnreachable as e:
            return str(e)
    return None


def moe_problem(names) -> str:
    """Why a MoE model with load balancing is refused under TorchFT (validation checks the model)."""
    return (
        f"{names.key('fault_tolerance', 'enable')} = true with a MoE model that balances its experts' load "
        "(load_balance_coeff): TorchTitan updates the expert bias from the token counts of one group only, so the "
        "groups would drift apart and TorchFT's state transfer needs them identical; set the MoE's "
        "load_balance_coeff to None, or train without fault tolerance"
    )


def fault_tolerant(config) -> bool:
    """TorchFT is on (a config with a fault_tolerance section: DMuon's fault-tolerant trainer)."""
    ft = getattr(config, "fault_tolerance", None)
    return ft is not None and ft.enable
