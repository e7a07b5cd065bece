"""TorchTitan's trainer run inside a worker pool: a job as ``./run_train.sh`` starts it (the same TOML file and
overrides through ``load_config``, ``DMuonTrainer``, TorchTitan's loop and log lines) without starting processes.

A job through ``run_train.sh`` spends most of its time before the first step (torchrun, and every rank
importing torch and TorchTitan: ~20 of a 4-rank TP job's 27 s here); in a pool that is paid once per
session. What only a real launch shows (run_train.sh and torchrun, the entry points, kills and restarts,
the process exit) stays in ``tests/e2e``.

The pool's gloo group is the job's world: TorchTitan's ``init_distributed`` keeps an initialised group and
skips the settings it would make, so the one that matters for the job's numbers (autograd without its
device threads, for the spmd_types backend under activation checkpointing) is made here, as is the
working directory (the configs' ``./assets`` paths). What TorchTitan changes in the process for a job
(its garbage-collection mode, the log level) is put back afterwards, so the next test in the worker
starts as it would have."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import types

from tests.support.run_train import ROOT


def train_in_process(rank: int, world: int, config: str, overrides: tuple[str, ...], log_rank: int) -> str | None:
    """Run on every rank of a pool: train ``train_configs/<config>`` (or a path) with ``overrides``; returns
    the log rank's log as text (``--local-ranks-filter`` of ``run_train.sh``), ``None`` elsewhere."""
    from titan_dmuon.integration import cpu

    cpu.enable()  # as the entry point does, before TorchTitan's trainer is imported
    import torch
    from torchtitan.tools.logging import logger

    from titan_dmuon.integration.config.toml_file import load_config

    path = config if os.path.isabs(config) else os.path.join("train_configs", config)
    lines: list[str] = []
    handler = _Collect(lines)
    with _process_as_torchrun_leaves_it(rank, world), _one_parallel_dims_per_layout():
        logger.addHandler(handler)
        try:
            job = load_config(path, list(overrides), world_size=world, this_machine=True)
            trainer = job.build()
            try:
                trainer.train()
            finally:
                trainer.close()
        finally:
            logger.removeHandler(handler)
        torch.distributed.barrier()  # (every rank done before the pool's next task reuses the group)
    return "\n".join(lines) if rank == log_rank else None


def run_job(pool, folder, *overrides: str, config: str = "debug_model.toml", log_rank: int = 0, timeout=240.0):
    """``train_in_process`` on every rank of ``pool``, the job's outputs in ``folder`` (``run_train``'s
    arguments); the log rank's log in the shape of a finished ``subprocess.run`` (``returncode``,
    ``stdout``, ``stderr``), so that ``run_train.parse`` reads it as it reads a ``run_train.sh`` job's."""
    overrides = ("--job.dump_folder", str(folder), "--metrics.disable_color_printing", "true", *overrides)
    logs = pool.run(train_in_process, config, overrides, log_rank, timeout=timeout)
    return types.SimpleNamespace(returncode=0, stdout=logs[log_rank], stderr="")


class _Collect(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(level=logging.INFO)
        self._lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self._lines.append(record.getMessage())


@contextlib.contextmanager
def _one_parallel_dims_per_layout():
    """The trainer's ParallelDims: one object per layout in this worker process, shared with
    ``titan_harness.parallel_dims`` (the spmd_types backend's annotations name the meshes of the first
    ParallelDims a process builds for a layout, and FSDP2 refuses a parameter annotated with another
    mesh object; a trainer process builds one)."""
    from torchtitan.distributed import ParallelDims

    from tests.support import titan_harness

    build = ParallelDims.from_config

    def from_config(parallelism, world_size):
        dims = build(parallelism, world_size)
        if dims.spmd_backend != "spmd_types":
            return dims
        if dims.pp == 1 and dims.tp * dims.cp > 1:
            key = (world_size, dims.dp_replicate, dims.ep, dims.tp, dims.cp)  # (the harness's keys)
        elif dims.pp > 1 and dims.tp == 1 and dims.cp > 1:
            key = ("pp", world_size, dims.pp, dims.dp_replicate, dims.cp)
        else:
            key = ("trainer", world_size, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, dims.pp, dims.ep)
        return titan_harness.SPMD_DIMS.setdefault(key, dims)

    ParallelDims.from_config = from_config
    try:
        yield
    finally:
        ParallelDims.from_config = build


@contextlib.contextmanager
def _process_as_torchrun_leaves_it(rank: int, world: int):
    """torchrun's rank variables, the repository as the working directory, INFO logging, autograd's device
    threads off (as TorchTitan's init_distributed sets it); afterwards each put back, and the garbage
    collector on again (TorchTitan's GarbageCollection disables it for the job)."""
    import torch
    from torchtitan.tools.logging import logger

    ranks = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world}
    environ = {key: os.environ.get(key) for key in ranks}
    cwd, level, was_gc = os.getcwd(), logger.level, gc.isenabled()
    os.environ.update({key: str(value) for key, value in ranks.items()})
    os.chdir(ROOT)
    logger.setLevel(logging.INFO)
    torch.autograd.set_multithreading_enabled(False)
    try:
        yield
    finally:
        torch.autograd.set_multithreading_enabled(True)
        logger.setLevel(level)
        os.chdir(cwd)
        for key, value in environ.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if was_gc:
            gc.enable()
        gc.collect()
