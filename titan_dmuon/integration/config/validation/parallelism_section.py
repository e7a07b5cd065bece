"""Checks of the ``[parallelism]`` section that TorchTitan makes only after the process groups started: the
degrees against the world size, expert, context and pipeline parallelism, and DMuon's unsupported layouts.
"""

from __future__ import annotations

import difflib
import re
import types

from titan_dmuon.integration import cpu
from titan_dmuon.integration.config.validation.naming import ConfigError, Naming
from titan_dmuon.integration.distributed import context_parallel
from titan_dmuon.integration.distributed.degrees import expert_region_ranks
from titan_dmuon.integration.distributed.parallelize import expert_parallel_limit
from titan_dmuon.integration.names import DMUON


def check_supported(*, parallelism, compile_config, training) -> None:
    """DMuon's TorchTitan limits (NotImplementedError, which validate_dmuon words for the door)."""
    if parallelism.tensor_parallel_degree > 1:
        if parallelism.spmd_backend == "partial_dtensor":
            raise NotImplementedError(
                "parallelism.tensor_parallel_degree > 1 with parallelism.spmd_backend = 'partial_dtensor': "
                "that backend "
                "makes tensor-parallel weights DTensors before FSDP2, and DMuon dedicates TP-local shards as the "
                "'spmd_types' backend (the default) keeps them; use spmd_backend = 'spmd_types'"
            )
        if compile_config.enable_async_tensor_parallel:
            raise NotImplementedError(
                "compile.enable_async_tensor_parallel = true with optimizer.name = 'dmuon': async TP fuses the "
                "tensor-parallel collectives with the matmuls inside compiled graphs, which DMuon's swapped-in "
                "weight views are not tested under; set it to false (TP stays synchronous)"
            )
    if parallelism.spmd_backend == "full_dtensor":
        raise NotImplementedError(
            "parallelism.spmd_backend = 'full_dtensor' makes every parameter a DTensor before FSDP2, and DMuon's "
            "dedicated weights are plain tensors on their owners; use 'spmd_types' (the default) or 'partial_dtensor'"
        )
    if training.enable_cpu_offload:
        raise NotImplementedError(
            "training.enable_cpu_offload = true is not supported with optimizer.name = 'dmuon' (owners keep their "
            "weights on the device); set it to false or use optimizer.name = 'AdamW'"
        )


LOAD_BALANCERS = ("headtail", "ptrr", None)


def validate_context_parallel(config, names: Naming, *, this_machine: bool) -> None:
    """Context parallelism's settings TorchTitan checks only once the process groups started (or at its
    first step), QK-clip's, and what a machine without an accelerator runs (``cpu.py``)."""
    p, opt = config.parallelism, config.optimizer
    balancer = p.context_parallel_load_balancer
    if balancer not in LOAD_BALANCERS:
        raise ConfigError(
            f"{names.key('parallelism', 'context_parallel_load_balancer')} = {balancer!r}: expected "
            "'headtail' (the default), 'ptrr' or none (unset)"
        )
    cp = p.context_parallel_degree
    if cp == 1:
        return
    with_cp = f"with parallelism.context_parallel_degree = {cp}"
    divisor = 2 * cp * (p.tensor_parallel_degree if p.enable_sequence_parallel else 1)
    if config.training.seq_len % divisor:
        raise ConfigError(
            f"{names.key('training', 'seq_len')} = {config.training.seq_len} {with_cp}: TorchTitan cuts each sequence "
            f"into 2 x {cp} chunks (and by tensor_parallel_degree under sequence parallelism); use a seq_len divisible "
            f"by {divisor}"
        )
    if opt.name == DMUON and opt.qk_clip_threshold is not None and balancer == "ptrr":
        raise ConfigError(
            f"{names.key('optimizer', 'qk_clip_threshold')} = {opt.qk_clip_threshold!r} with "
            "parallelism.context_parallel_load_balancer = 'ptrr': QK-clip takes each rank's queries against the keys "
            "at or before their positions in the sequence, which it knows for the head-tail load balancer (or none) "
            "but not for PTRR, whose order follows FlexAttention's block mask; "
            "use 'headtail' (the default) with QK-clip"
        )
    if this_machine and not cpu.accelerator_present():
        if p.spmd_backend != context_parallel.CONTEXT_PARALLEL_BACKEND:
            raise ConfigError(
                f"{names.key('parallelism', 'spmd_backend')} = {p.spmd_backend!r} {with_cp} on a machine without an "
                f"accelerator: {context_parallel.CONTEXT_PARALLEL_BACKEND_REASON}; "
                f"use {context_parallel.CONTEXT_PARALLEL_BACKEND!r} (the default)"
            )
        if balancer == "ptrr":
            raise ConfigError(
                f"{names.key('parallelism', 'context_parallel_load_balancer')} = 'ptrr' {with_cp} on a "
                f"machine without an accelerator: {context_parallel.PTRR_REASON}"
            )


def validate_parallelism(p, world_size: int | None, names: Naming) -> None:
    degrees = {
        "data_parallel_replicate_degree": p.data_parallel_replicate_degree,
        "tensor_parallel_degree": p.tensor_parallel_degree,
        "pipeline_parallel_degree": p.pipeline_parallel_degree,
        "context_parallel_degree": p.context_parallel_degree,
    }
    for key, degree in {**degrees, "expert_parallel_degree": p.expert_parallel_degree}.items():
        if degree < 1:
            raise ConfigError(f"{names.key('parallelism', key)} = {degree}: expected an integer >= 1")
    shard = p.data_parallel_shard_degree
    if shard != -1 and shard < 1:
        raise ConfigError(
            f"{names.key('parallelism', 'data_parallel_shard_degree')} = {shard}: "
            "expected -1 (use the remaining ranks) or an integer >= 1"
        )
    others = 1
    for degree in degrees.values():
        others *= degree
    product = " * ".join(f"{k}({v})" for k, v in degrees.items())
    if world_size is not None and shard == -1 and world_size % others:
        raise ConfigError(
            f"{names.section('parallelism', *degrees)} {product} = {others} does not divide the world size {world_size}"
        )
    if world_size is not None and shard != -1 and shard * others != world_size:
        raise ConfigError(
            f"{names.section('parallelism', 'data_parallel_shard_degree', *degrees)} "
            f"data_parallel_shard_degree({shard}) * {product} = {shard * others}, but the world size is {world_size}; "
            "the degrees must multiply to the number of processes (data_parallel_shard_degree = -1 infers it)"
        )
    ep, shard_ranks = p.expert_parallel_degree, _expert_region_ranks(p, world_size)
    if ep > 1 and shard_ranks is not None and shard_ranks % ep:
        divisors = [d for d in range(1, shard_ranks + 1) if shard_ranks % d == 0]
        raise ConfigError(
            f"{names.key('parallelism', 'expert_parallel_degree')} = {ep}: expected a divisor of "
            f"data_parallel_shard_degree * context_parallel_degree * tensor_parallel_degree = {shard_ranks} "
            f"(TorchTitan forms the expert-parallel groups from those ranks): one of {', '.join(map(str, divisors))}"
        )


def validate_pipeline(config, names: Naming) -> None:
    """What TorchTitan's pipeline_llm checks only after the process groups started: the schedule's
    name, the split of the model into stages (TorchTitan's own functions, on the config) and the
    micro-batch size."""
    p = config.parallelism
    if p.pipeline_parallel_degree == 1 or p.pipeline_parallel_schedule_csv:
        return
    from torch.distributed.pipelining.schedules import get_schedule_class
    from torchtitan.distributed import pipeline_parallel

    key = names.key("parallelism", "pipeline_parallel_schedule")
    try:
        schedule = get_schedule_class(p.pipeline_parallel_schedule)
    except ValueError as e:  # (its message lists torch's schedules)
        valid = [
            n
            for n in re.findall(r"'(\w+)'", str(e).partition("valid options are")[2])
            if n not in ("PipelineScheduleSingle", "PipelineScheduleMulti")
        ]
        close = difflib.get_close_matches(p.pipeline_parallel_schedule, valid, n=1, cutoff=0.5)
        raise ConfigError(
            f"{key} = {p.pipeline_parallel_schedule!r}: not a schedule of torch.distributed.pipelining"
            f"{f' (did you mean {close[0]!r}?)' if close else ''}; expected one of {', '.join(valid)}"
        ) from None
    if schedule.__name__ in ("PipelineScheduleSingle", "PipelineScheduleMulti"):
        raise ConfigError(
            f"{key} = {p.pipeline_parallel_schedule!r} is an abstract base class: "
            "use a schedule such as 1F1B or Interleaved1F1B"
        )
    spec = config.model_spec
    if spec is None or spec.pipelining_fn is not pipeline_parallel.pipeline_llm:
        return  # (another model family's pipelining checks its own split)
    degree = p.pipeline_parallel_degree
    where = names.source(
        "parallelism", "pipeline_parallel_degree", "pipeline_parallel_schedule", "pipeline_parallel_layers_per_stage"
    )
    try:
        # (of ParallelDims it reads the pipeline degree only: none exists before the process groups)
        stages, layers, first, last = pipeline_parallel._get_pipeline_metadata(
            types.SimpleNamespace(pp=degree), p, spec.model
        )
        if p.module_fqns_per_model_part is None:
            pipeline_parallel._generate_llm_fqn_per_model_part(stages, layers, first, last)
    except ValueError as e:
        too_many = "cannot be greater than effective layers" in str(e) or "empty stages" in str(e)
        if p.pipeline_parallel_layers_per_stage is None and too_many:
            per_rank = stages // degree
            raise ConfigError(
                f"{where}parallelism.pipeline_parallel_degree = {degree} with pipeline_parallel_schedule "
                f"{p.pipeline_parallel_schedule!r} ({per_rank} stage{'s' if per_rank > 1 else ''} per pipeline rank) "
                f"splits the {spec.name} {spec.flavor} model into {stages} stages, and TorchTitan needs at least "
                f"one of its {layers + first + last} layers per stage ({layers} layers, the embedding counted as "
                f"{first}, the head as {last}); use pipeline_parallel_degree <= {(layers + first + last) // per_rank}"
                + (" or a single-stage schedule (1F1B, GPipe)" if per_rank > 1 else "")
            ) from None
        message = " ".join(str(e).split())
        raise ConfigError(
            f"{where}TorchTitan cannot split the {spec.name} {spec.flavor} model into pipeline stages: {message}"
        ) from None
    if config.training.local_batch_size % p.pipeline_parallel_microbatch_size:
        raise ConfigError(
            f"{names.key('parallelism', 'pipeline_parallel_microbatch_size')} = {p.pipeline_parallel_microbatch_size}: "
            f"expected a divisor of training.local_batch_size ({config.training.local_batch_size})"
        )


def _expert_region_ranks(p, world_size: int | None) -> int | None:
    """dp_shard x cp x tp (the ranks TorchTitan splits into expert-FSDP x EP), once it is known."""
    shard = p.data_parallel_shard_degree
    if shard == -1:
        if world_size is None:
            return None
        shard = world_size // (
            p.data_parallel_replicate_degree
            * p.context_parallel_degree
            * p.tensor_parallel_degree
            * p.pipeline_parallel_degree
        )
    return expert_region_ranks(shard=shard, cp=p.context_parallel_degree, tp=p.tensor_parallel_degree)


def validate_expert_parallelism(p, world_size: int | None, experts: int, *, dmuon: bool, names: Naming) -> None:
    efsdp_ep = _expert_region_ranks(p, world_size)
    if dmuon and efsdp_ep is not None and efsdp_ep > experts:
        raise ConfigError(
            f"{names.section('parallelism', 'expert_parallel_degree', 'data_parallel_shard_degree')} "
            f"{expert_parallel_limit(efsdp_ep, experts)}"
        )
