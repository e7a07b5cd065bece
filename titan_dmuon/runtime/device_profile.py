"""The figures owner groups are planned with, measured briefly on the job's own device when DMuon is built.

A ``GroupOptions`` figure left None (the default) is measured here, once, before the plan is made:

* Newton–Schulz throughput: the iteration on the shape class of the largest weight a group could take
  (its short side up to 1024, its long side up to four times that);
* the all-reduce's latency (one number) and bus bandwidth (1 MiB of fp32) on the shard group, the same
  figures inside a node and across nodes (a sub-group does not exist yet; NCCL's own tuning picks its
  algorithm per size and link on the real groups).

Every rank measures, then the slowest rank's times are taken on every rank (an all-reduce MAX over the
mesh's groups), so all ranks plan with the same figures; they are printed with the plan. Each figure is
the fastest of TIMED_RUNS runs (the latency's of LATENCY_RUNS) after a warm-up: a busy machine
(other processes on its cores) slows some runs by whole scheduler slices, and the fastest is the device's own speed.
Only when the plan could use a group at all: ``needs_measuring`` builds it first with free communication, and a plan
with no group then (communication only makes groups dearer) measures nothing. A resume may measure other
figures and plan other groups: checkpoints hold whole matrices (DTensors), so it still loads. On the fake
process group (tests, host-time benchmarks) nothing is timed: the H200's stated figures stand in.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
import torch.distributed as dist

from titan_dmuon.math.ns_methods import newton_schulz, ns_flops
from titan_dmuon.plan.owner_groups import GroupOptions
from titan_dmuon.runtime.mode import MeshInfo

logger = logging.getLogger(__name__)

NS_SHORT_CAP = 1024  # the timed Newton–Schulz's short side at most this, its long side at most 4x its short
LARGE_ALL_REDUCE_NUMEL = 2**18  # 1 MiB of fp32: the bandwidth's probe
TIMED_RUNS = 10
LATENCY_RUNS = 50  # (one number: ~50 x the latency in all; the fastest needs every rank on a core at once)


def free_communication(options: GroupOptions) -> GroupOptions:
    """``options`` with all-reduces that cost nothing (no latency, a bandwidth no link has): the plan that
    splits the most a given throughput allows."""
    return dataclasses.replace(options, latency_us=0.0, nic_latency_us=0.0, intra_node_gbps=1e12, nic_gbps=1e12)


def measured(options: GroupOptions, mesh: MeshInfo, shape: tuple[int, int]) -> GroupOptions:
    """``options`` with each figure left None measured on this job (the module's notes); ``shape``: the
    (short, long) of the largest weight a group could take. A collective on every rank of ``mesh``."""
    missing = options.unmeasured()
    if not missing:
        return options
    if dist.get_backend(mesh.shard_group) == "fake":  # (collectives that move nothing: no figure to measure)
        return options.stated()
    device = mesh.device
    short = min(shape[0], NS_SHORT_CAP)
    long = min(shape[1], 4 * short)
    times = torch.zeros(3, dtype=torch.float64)
    if "ns_tflops" in missing:
        matrix = torch.randn(1, short, long, generator=torch.Generator().manual_seed(0)).bfloat16().to(device)
        times[0] = _fastest_seconds(lambda: newton_schulz(matrix), device)
    if set(missing) - {"ns_tflops"}:
        small = torch.zeros(1, device=device)
        large = torch.zeros(LARGE_ALL_REDUCE_NUMEL, device=device)
        times[1] = _fastest_seconds(lambda: dist.all_reduce(small, group=mesh.shard_group), device, LATENCY_RUNS)
        times[2] = _fastest_seconds(lambda: dist.all_reduce(large, group=mesh.shard_group), device)
    agreed = times.to(device)
    for group in mesh.groups:  # the slowest rank's figures, on every rank
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    ns_seconds, small_seconds, large_seconds = (max(float(t), 1e-9) for t in agreed.cpu())
    n = mesh.shard_size
    bus_bytes = 2 * (n - 1) / n * LARGE_ALL_REDUCE_NUMEL * 4
    figures = {
        "ns_tflops": ns_flops(short, long) / ns_seconds / 1e12,
        "latency_us": small_seconds * 1e6,
        "nic_latency_us": small_seconds * 1e6,
        "intra_node_gbps": bus_bytes / max(large_seconds - small_seconds, 1e-9) / 1e9,
        "nic_gbps": bus_bytes / max(large_seconds - small_seconds, 1e-9) / 1e9,
    }
    result = dataclasses.replace(
        options,
        **{key: figures[key] for key in missing},
        source=f"measured on this {device.type} job: {', '.join(missing)}",
    )
    if dist.get_rank() == int(mesh.mesh.mesh.flatten()[0]):
        logger.info("DMuon: %s", result.describe())
    return result


def _fastest_seconds(run, device: torch.device, runs: int = TIMED_RUNS) -> float:
    """One warm-up, then the fastest of ``runs`` wall-clock runs (the device synchronised around each)."""
    run()
    samples = []
    for _ in range(runs):
        _synchronize(device)
        start = time.perf_counter()
        run()
        _synchronize(device)
        samples.append(time.perf_counter() - start)
    return min(samples)


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device).synchronize(device)
