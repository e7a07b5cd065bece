"""``python -m titan_dmuon.env``: the environment report to paste into a bug report.

What decides how a DMuon job runs and what it computes, in one plain-text block: the versions (Python,
torch, TorchTitan, torchft, titan_dmuon), the process-group backends, the devices, the CPU kernels
torch picks (a bf16 matmul's last bits differ between AVX2, AVX-512 and AMX), DMuon's option defaults,
and the environment variables that change any of these. Package versions are read from their
installed metadata, so nothing here imports TorchTitan or torchft (and their absence is reported,
not raised). ``report()`` returns the text; ``__main__`` prints it.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
from importlib import metadata

PACKAGES = ("torch", "torchtitan", "torchft", "titan_dmuon")
ENV_PREFIXES = ("ONEDNN_", "DNNL_", "TORCH_NCCL_", "NCCL_", "MALLOC_", "TORCH_DISTRIBUTED_", "TITAN_DMUON_")
ENV_NAMES = (
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_LAUNCH_BLOCKING",
    "PYTORCH_CUDA_ALLOC_CONF",
    "GLOO_SOCKET_IFNAME",
    "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE",
)


def report() -> str:
    """The report, one ``key: value`` line each, under a heading per part."""
    parts = [
        ("versions", _versions()),
        ("distributed backends", _backends()),
        ("devices", _devices()),
        ("CPU kernels", _cpu_kernels()),
        ("DMuon option defaults", _option_defaults()),
        ("environment variables", _environment()),
    ]
    lines = []
    for title, rows in parts:
        lines.append(f"== {title}")
        lines += [f"{key}: {value}" for key, value in rows]
    return "\n".join(lines)


def installed_version(package: str) -> str:
    """The installed distribution's version, or "not installed" (read from its metadata: never imported)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _versions() -> list[tuple[str, str]]:
    rows = [("python", f"{sys.version.split()[0]} ({platform.python_implementation()}, {platform.platform()})")]
    rows += [(name, installed_version(name)) for name in PACKAGES]
    import torch

    rows.append(("torch (imported)", f"{torch.__version__} from {os.path.dirname(torch.__file__)}"))
    rows.append(("torch built with CUDA", str(torch.version.cuda)))
    import titan_dmuon

    rows.append(("titan_dmuon (imported)", os.path.dirname(titan_dmuon.__file__)))
    return rows


def _backends() -> list[tuple[str, str]]:
    import torch.distributed as dist

    if not dist.is_available():
        return [("torch.distributed", "not available")]
    return [
        (name, "available" if getattr(dist, f"is_{name}_available")() else "not available")
        for name in ("gloo", "nccl", "mpi")
    ]


def _devices() -> list[tuple[str, str]]:
    import torch

    rows = [("CPU cores (os.cpu_count)", str(os.cpu_count())), ("torch threads", str(torch.get_num_threads()))]
    if not torch.cuda.is_available():
        return rows + [("CUDA", "not available")]
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        rows.append(
            (
                f"cuda:{index}",
                f"{props.name}, {props.total_memory / 2**30:.1f} GiB, compute capability {props.major}.{props.minor}",
            )
        )
    return rows


def _cpu_kernels() -> list[tuple[str, str]]:
    """The ISA torch's CPU kernels dispatch to, and what oneDNN (bf16 matmuls) may use."""
    import torch

    rows = [
        ("torch CPU capability", _tried(torch.backends.cpu.get_cpu_capability)),
        ("oneDNN (mkldnn) available", str(torch.backends.mkldnn.is_available())),
    ]
    for name, probe in (
        ("AVX-512", "_is_avx512_supported"),
        ("AVX-512 bf16", "_is_avx512_bf16_supported"),
        ("AMX tiles", "_is_amx_tile_supported"),
    ):
        check = getattr(torch.cpu, probe, None)  # (private probes: reported when this torch has them)
        rows.append((name, _tried(check) if check is not None else "unknown on this torch"))
    return rows


def _option_defaults() -> list[tuple[str, str]]:
    from titan_dmuon.options import DMuonOptions

    defaults = DMuonOptions()
    return [(field.name, repr(getattr(defaults, field.name))) for field in dataclasses.fields(DMuonOptions)]


def _environment() -> list[tuple[str, str]]:
    names = sorted(n for n in os.environ if n in ENV_NAMES or n.startswith(ENV_PREFIXES))
    return [(n, os.environ[n]) for n in names] or [("(none of them set)", ", ".join(ENV_PREFIXES + ENV_NAMES))]


def _tried(probe) -> str:
    try:
        return str(probe())
    except Exception as e:  # noqa: BLE001 - a probe this torch cannot answer is reported, not raised
        return f"unknown ({type(e).__name__})"
