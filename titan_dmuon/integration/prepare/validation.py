"""Every check of a DMuon job config, in one module, for every door.

``validate_dmuon`` runs in ``with_dmuon``, in the TOML layer, in the
pre-launch check of ``run_train.sh`` (``integration/check.py``) and again in
DMuonTrainer on the config TorchTitan actually builds (command-line overrides
applied), always before any process group exists. Each problem is one
ConfigError line that names the setting, the bad value and how to fix it in
the door it is printed in (``Naming``): ``optimizer.momentum = 1.5: expected a
number in [0, 1)``; the TOML layer also names the file and writes keys as
``[section] key``.

Checks that need the model (``optimizer.muon_params`` against its parameter
names and shapes, expert counts for expert parallelism) build it on the meta
device, as TorchTitan's trainer does before parallelizing: no memory, no
process group, well under a second even for a 70B model.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import logging
import re
import types
from collections.abc import Mapping

import torch
from torch import nn

from titan_dmuon.integration import cpu
from titan_dmuon.integration.prepare.fault_tolerance_checks import fault_tolerance_problem, moe_problem
from titan_dmuon.integration.names import ADAMW_NAMES, BASELINE_NAMES, DMUON, MUON_FAMILY_NAMES, NAIVE_MUON
from titan_dmuon.integration.training.models import ModelNotSupported, check_model
from titan_dmuon.integration.training.optimizer_container import (
    ADAMW_ONLY_KEYS,
    DMUON_OPTION_KEYS,
    MUON_FAMILY_KEYS,
    DMuonOptimizersContainer,
    baseline_not_built,
)
from titan_dmuon.integration.training.parallelize import (
    DEFAULT_MUON_PARAMS,
    expert_parallel_limit,
    expert_region_ranks,
    fused_qkv_blocks,
    routed_expert_counts,
)
from titan_dmuon.group_plan import GroupOptions
from titan_dmuon.options import ADAMW_KEYS, DMuonOptions, OptionError
from titan_dmuon.runtime import canonical_fqn

ADAMW_EXAMPLE = "train_configs/debug_model_adamw.toml"
# Muon-family keys only DMuon runs (the benchmarks' naive_muon baseline does not): their off values
DMUON_ONLY_DEFAULTS = {"normuon_beta2": None, "ns_dtype": "bfloat16", "ns_blocks": "matrix"}


class ConfigError(ValueError):
    """A bad job config: names the setting, the bad value and what is expected (from TOML, also where)."""


class Naming:
    """How a message names a setting in its door. Python configs: ``optimizer.momentum``; TOML adds the file."""

    def key(self, section: str, key: str) -> str:
        return f"{section}.{key}"

    def section(self, section: str, *keys: str) -> str:
        return f"{section}:"

    def source(self, section: str, *keys: str, text: str = "") -> str:
        """Prefix for messages that name their settings themselves (``text``: the message, e.g.
        TorchTitan's, whose settings say where the value came from)."""
        return ""

    def how_to_set(self, section: str, key: str, value) -> str:
        """The fix as this door writes it, with the command-line spelling both doors accept."""
        return f"{section}.{key} = {value!r} ({command_line(section, key, value)})"


PYTHON_NAMES = Naming()


def command_line(section: str, key: str, value) -> str:
    """``--section.key value`` as TorchTitan's command line takes it (the TOML door accepts it too;
    tuples only as TorchTitan writes them, space-separated)."""
    if isinstance(value, bool):
        return f"--{section}.{key}" if value else f"--{section}.no-{key}"
    if isinstance(value, (tuple, list)):
        return f"--{section}.{key} " + " ".join(str(v) for v in value)
    return f"--{section}.{key} {value}"


def toml_value(value) -> str:
    """``value`` as a TOML file writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _validate_owner_groups(opt, names: Naming) -> None:
    """The owner groups' settings, checked as ``GroupOptions`` checks them (one line naming the key)."""
    for key, field_name in (("owner_group_node_size", "node_size"), ("owner_group_ns_tflops", "ns_tflops")):
        try:
            GroupOptions(**{field_name: getattr(opt, key)})
        except ValueError as e:
            expected = str(e).split("expected ", 1)[-1]
            raise ConfigError(f"{names.key('optimizer', key)} = {getattr(opt, key)!r}: expected {expected}") from None


def validate_dmuon(
    config, *, world_size: int | None = None, names: Naming = PYTHON_NAMES, this_machine: bool = False
) -> list[str]:
    """Every cross-key check of a DMuonTrainer.Config (any optimizer name); ConfigError on the first.

    ``this_machine``: the job is about to run here (DMuonTrainer, the entry points, the pre-launch
    check), so also check what this machine can run (a cluster config may be loaded anywhere).
    Returns warnings (settings that are valid but probably not meant); DMuonTrainer logs them,
    once, on the config it builds.
    """
    opt = config.optimizer
    if not isinstance(opt, DMuonOptimizersContainer.Config):
        raise ConfigError(f"optimizer: {type(opt).__qualname__} is not DMuon's optimizer config; set DMuon up with with_dmuon(config)")
    if opt.name in BASELINE_NAMES and not opt.builds_baseline(opt.name):
        raise ConfigError(baseline_not_built(opt.name, names.key("optimizer", "name")))
    if opt.name in MUON_FAMILY_NAMES:
        try:
            DMuonOptions(**{k: getattr(opt, k) for k in DMUON_OPTION_KEYS})
        except OptionError as e:
            raise ConfigError(f"{names.key('optimizer', e.key)} = {e.value!r}: expected {e.expected}") from None
        for pattern in opt.muon_params:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(f"{names.key('optimizer', 'muon_params')}: bad regex {pattern!r} ({e})") from None
        _validate_owner_groups(opt, names)
        if opt.name == DMUON:
            try:
                check_supported(parallelism=config.parallelism, compile_config=config.compile, training=config.training)
                check_model(config.model_spec)
            except (NotImplementedError, ModelNotSupported) as e:
                raise ConfigError(f"{names.source('optimizer', 'name', text=str(e))}{e}") from None
        for key, default in DMUON_ONLY_DEFAULTS.items():
            if opt.name != DMUON and getattr(opt, key) != default:
                raise ConfigError(
                    f"{names.key('optimizer', key)} = {getattr(opt, key)!r} applies to optimizer.name = 'dmuon' only "
                    f"({opt.name!r} does not run it); leave it unset or use name = 'dmuon'"
                )
        if opt.qk_clip_threshold is not None:
            key = names.key("optimizer", "qk_clip_threshold")
            if opt.name != DMUON:
                raise ConfigError(f"{key} = {opt.qk_clip_threshold!r}: QK-clip runs with optimizer.name = 'dmuon' only")
            if config.compile.enable and "model" in config.compile.components:
                raise ConfigError(
                    f"{key} = {opt.qk_clip_threshold!r} with compile.enable = true: QK-clip captures the logits with an "
                    "eager forward hook on each inner_attention, which TorchTitan's fullgraph-compiled blocks cannot "
                    "contain; turn compile off (or take 'model' out of compile.components) with QK-clip"
                )
    elif opt.name in ADAMW_NAMES:
        _validate_adamw_switch(opt, names)
    _validate_training(config.training, names)
    _validate_validator(config.validator, world_size, names)
    _validate_checkpoint(config.checkpoint, names)
    _validate_parallelism(config.parallelism, world_size, names)
    _validate_context_parallel(config, names, this_machine=this_machine)
    _validate_pipeline(config, names)
    _validate_sections(config, names)
    problem = fault_tolerance_problem(config, names, this_machine=this_machine) if _fault_tolerant(config) else None
    if problem is not None:
        raise ConfigError(problem)
    return _validate_against_model(config, world_size, names)


def _fault_tolerant(config) -> bool:
    """TorchFT is on (a config with a fault_tolerance section: DMuon's fault-tolerant trainer)."""
    ft = getattr(config, "fault_tolerance", None)
    return ft is not None and ft.enable


def check_supported(*, parallelism, compile_config, training) -> None:
    """DMuon's TorchTitan limits (NotImplementedError, which validate_dmuon words for the door)."""
    if parallelism.tensor_parallel_degree > 1:
        if parallelism.spmd_backend == "partial_dtensor":
            raise NotImplementedError(
                "parallelism.tensor_parallel_degree > 1 with parallelism.spmd_backend = 'partial_dtensor': that backend "
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


def _validate_context_parallel(config, names: Naming, *, this_machine: bool) -> None:
    """Context parallelism's settings TorchTitan checks only once the process groups started (or at its
    first step), QK-clip's, and what a machine without an accelerator runs (``cpu.py``)."""
    p, opt = config.parallelism, config.optimizer
    balancer = p.context_parallel_load_balancer
    if balancer not in LOAD_BALANCERS:
        raise ConfigError(f"{names.key('parallelism', 'context_parallel_load_balancer')} = {balancer!r}: expected "
                          "'headtail' (the default), 'ptrr' or none (unset)")
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
            "but not for PTRR, whose order follows FlexAttention's block mask; use 'headtail' (the default) with QK-clip"
        )
    if this_machine and not cpu.accelerator_present():
        if p.spmd_backend != cpu.CONTEXT_PARALLEL_BACKEND:
            raise ConfigError(
                f"{names.key('parallelism', 'spmd_backend')} = {p.spmd_backend!r} {with_cp} on a machine without an "
                f"accelerator: {cpu.CONTEXT_PARALLEL_BACKEND_REASON}; use {cpu.CONTEXT_PARALLEL_BACKEND!r} (the default)"
            )
        if balancer == "ptrr":
            raise ConfigError(f"{names.key('parallelism', 'context_parallel_load_balancer')} = 'ptrr' {with_cp} on a "
                              f"machine without an accelerator: {cpu.PTRR_REASON}")


def _validate_adamw_switch(opt, names: Naming) -> None:
    """TorchTitan's AdamW trains every parameter from the flat keys (lr, betas, eps, weight_decay).
    A DMuon config switched to AdamW (``--optimizer.name AdamW``) still carries Muon's lr there
    (e.g. 0.05) and AdamW's in ``adamw_*``; training would silently use Muon's."""
    differ = [
        (plain, adamw) for adamw, plain in ADAMW_KEYS.items()
        if _comparable(getattr(opt, plain)) != _comparable(getattr(opt, adamw))
    ]
    if not differ:
        return
    values = ", ".join(f"{plain} = {getattr(opt, plain)!r} but {adamw} = {getattr(opt, adamw)!r}" for plain, adamw in differ)
    fix = " ".join(command_line("optimizer", plain, getattr(opt, adamw)) for plain, adamw in differ)
    raise ConfigError(
        f"{names.key('optimizer', 'name')} = {opt.name!r} trains every parameter with TorchTitan's {opt.name} from "
        f"optimizer.lr/betas/eps/weight_decay, and they disagree with this config's AdamW settings (adamw_*, "
        f"which DMuon uses for the non-Muon parameters): {values}; to train with {opt.name} at those settings "
        f"pass {fix}"
    )


def _comparable(value):
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _validate_training(training, names: Naming) -> None:
    for key in ("steps", "local_batch_size", "seq_len"):
        if getattr(training, key) <= 0:
            raise ConfigError(f"{names.key('training', key)} = {getattr(training, key)}: expected a positive integer")
    if training.max_norm <= 0:
        raise ConfigError(f"{names.key('training', 'max_norm')} = {training.max_norm}: expected a positive number")


def _validate_validator(validator, world_size: int | None, names: Naming) -> None:
    """TorchTitan's validation reading all its data (``steps = -1``) runs as many batches on each rank
    as its share of the rows makes, and a rank with one more waits forever in a collective."""
    if validator.enable and validator.steps == -1 and world_size != 1:
        raise ConfigError(
            f"{names.key('validator', 'steps')} = -1 (all the held-out data) can hang with several ranks: "
            "each reads its own share of the rows, and a rank with one batch more waits forever in a collective; "
            f"set a count every rank can read, e.g. {names.how_to_set('validator', 'steps', 4)}"
        )


def _validate_checkpoint(checkpoint, names: Naming) -> None:
    """TorchTitan's own rules for its HF export and import, which it checks only when it builds the
    checkpointer, after the process groups started."""
    for kind in ("last_save", "initial_load"):
        if getattr(checkpoint, f"{kind}_in_hf") and not getattr(checkpoint, f"{kind}_model_only"):
            raise ConfigError(
                f"{names.key('checkpoint', f'{kind}_in_hf')} = true needs {kind}_model_only = true (TorchTitan "
                f"{'saves' if kind == 'last_save' else 'loads'} only the model weights in HF format); add "
                f"{names.how_to_set('checkpoint', f'{kind}_model_only', True)}"
            )


def _validate_sections(config, names: Naming) -> None:
    """Each section's own checks (its ``__post_init__``), which TorchTitan runs when it builds the
    section: in the TOML door after the process groups started (the door sets fields one by one),
    in the Python door inside its command-line parser. Run on a copy, its log lines muted."""
    for field in dataclasses.fields(config):
        section = getattr(config, field.name)
        post_init = getattr(type(section), "__post_init__", None)
        if not dataclasses.is_dataclass(section) or isinstance(section, type) or post_init is None:
            continue
        previous = logging.root.manager.disable
        logging.disable(logging.WARNING)
        try:
            post_init(copy.copy(section))
        except (ValueError, AssertionError) as e:
            message = " ".join(str(e).split())
            raise ConfigError(f"{names.source(field.name, text=message)}TorchTitan rejects the {field.name} settings: {message}") from None
        finally:
            logging.disable(previous)


def _validate_parallelism(p, world_size: int | None, names: Naming) -> None:
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
        raise ConfigError(f"{names.section('parallelism', *degrees)} {product} = {others} does not divide the world size {world_size}")
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


def _validate_pipeline(config, names: Naming) -> None:
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
        valid = [n for n in re.findall(r"'(\w+)'", str(e).partition("valid options are")[2])
                 if n not in ("PipelineScheduleSingle", "PipelineScheduleMulti")]
        close = difflib.get_close_matches(p.pipeline_parallel_schedule, valid, n=1, cutoff=0.5)
        raise ConfigError(
            f"{key} = {p.pipeline_parallel_schedule!r}: not a schedule of torch.distributed.pipelining"
            f"{f' (did you mean {close[0]!r}?)' if close else ''}; expected one of {', '.join(valid)}"
        ) from None
    if schedule.__name__ in ("PipelineScheduleSingle", "PipelineScheduleMulti"):
        raise ConfigError(f"{key} = {p.pipeline_parallel_schedule!r} is an abstract base class: use a schedule such as 1F1B or Interleaved1F1B")
    spec = config.model_spec
    if spec is None or spec.pipelining_fn is not pipeline_parallel.pipeline_llm:
        return  # (another model family's pipelining checks its own split)
    degree = p.pipeline_parallel_degree
    where = names.source("parallelism", "pipeline_parallel_degree", "pipeline_parallel_schedule",
                         "pipeline_parallel_layers_per_stage")
    try:
        # (of ParallelDims it reads the pipeline degree only: none exists before the process groups)
        stages, layers, first, last = pipeline_parallel._get_pipeline_metadata(types.SimpleNamespace(pp=degree), p, spec.model)
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
        raise ConfigError(f"{where}TorchTitan cannot split the {spec.name} {spec.flavor} model into pipeline stages: {message}") from None
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
        shard = world_size // (p.data_parallel_replicate_degree * p.context_parallel_degree
                               * p.tensor_parallel_degree * p.pipeline_parallel_degree)
    return expert_region_ranks(shard=shard, cp=p.context_parallel_degree, tp=p.tensor_parallel_degree)


# ---- checks against the model's parameters (built on the meta device) ----------------------
def _validate_against_model(config, world_size: int | None, names: Naming) -> list[str]:
    opt, p = config.optimizer, config.parallelism
    muon = opt.name in MUON_FAMILY_NAMES
    if not muon and p.expert_parallel_degree == 1 and not _fault_tolerant(config):
        return []  # nothing below needs the model: do not build it
    model = meta_model(config, names)
    warnings = _validate_muon_params(model, opt.muon_params, config.model_spec, names) if muon else []
    if opt.name == DMUON and opt.qk_clip_threshold is not None:
        _validate_qk_clip(model, opt, config.model_spec, names, tp=p.tensor_parallel_degree)
    if opt.name == DMUON and opt.ns_blocks != "matrix":
        _validate_head_blocks(model, opt, config.model_spec, names, tp=p.tensor_parallel_degree)
    experts = routed_expert_counts(model)
    if experts and _fault_tolerant(config) and any(getattr(m, "load_balance_coeff", None) is not None
                                                   for m in model.modules() if hasattr(m, "routed_experts")):
        raise ConfigError(moe_problem(names))
    if p.expert_parallel_degree > 1 and experts:
        _validate_expert_parallelism(p, world_size, min(experts), dmuon=opt.name == DMUON, names=names)
    return warnings


def _validate_qk_clip(model: nn.Module, opt, spec, names: Naming, *, tp: int = 1) -> None:
    """QK-clip needs attention it knows the q/k row layout of, and those weights on Muon (dedicated)."""
    from titan_dmuon.integration.training.attention_clip import QKClipNotSupported, attention_descriptions, clip_weights

    key = names.key("optimizer", "qk_clip_threshold")
    try:
        descriptions = attention_descriptions(model, tp_size=tp)
    except QKClipNotSupported as e:
        raise ConfigError(f"{key} = {opt.qk_clip_threshold!r} with the {spec.name} {spec.flavor} model: {e}") from None
    if not descriptions:
        raise ConfigError(f"{key} = {opt.qk_clip_threshold!r}: the {spec.name} {spec.flavor} model has no attention module to clip")
    names_of = {id(p): canonical_fqn(n) for n, p in model.named_parameters()}
    patterns = [re.compile(p) for p in opt.muon_params]
    for param in clip_weights(descriptions):
        name = names_of.get(id(param), "?")
        if not any(p.search(name) for p in patterns):
            raise ConfigError(
                f"{key} = {opt.qk_clip_threshold!r}: QK-clip rescales {name} on its Muon owner after the update, but "
                f"{names.key('optimizer', 'muon_params')} leaves it to AdamW; add it to the Muon targets"
            )


def _validate_head_blocks(model: nn.Module, opt, spec, names: Naming, *, tp: int = 1) -> None:
    """Per-head Newton–Schulz needs attention whose head layout it knows, and some of its projections on Muon."""
    from titan_dmuon.integration.training.attention_heads import HeadBlocksNotSupported, head_blocks

    key, model_name = names.key("optimizer", "ns_blocks"), f"the {spec.name} {spec.flavor} model"
    try:
        blocks = head_blocks(model, tp_size=tp)
    except HeadBlocksNotSupported as e:
        raise ConfigError(f"{key} = {opt.ns_blocks!r} with {model_name}: {e}; use ns_blocks = \"matrix\"") from None
    weights = [*blocks.split_rows, *blocks.split_cols]
    if not weights:
        raise ConfigError(f"{key} = {opt.ns_blocks!r}: {model_name} has no attention module to split by heads; "
                          "use ns_blocks = \"matrix\"")
    names_of = {id(p): canonical_fqn(n) for n, p in model.named_parameters()}
    patterns = [re.compile(p) for p in opt.muon_params]
    if not any(any(p.search(names_of.get(id(w), "")) for p in patterns) for w in weights):
        raise ConfigError(
            f"{key} = {opt.ns_blocks!r}: none of {model_name}'s attention projections is on Muon "
            f"({names.key('optimizer', 'muon_params')}), so no weight would be split by heads; add them or use "
            "ns_blocks = \"matrix\""
        )


def meta_model(config, names: Naming = PYTHON_NAMES) -> nn.Module:
    """The job's model on the meta device, built as TorchTitan's trainer builds it (after its
    ``update_from_config``, on a copy: the trainer updates the config's own model config later)."""
    spec = config.model_spec
    model_config = copy.deepcopy(spec.model)
    try:
        model_config.update_from_config(config=config)
        with torch.device("meta"):
            return model_config.build()
    except (ValueError, TypeError, AssertionError, NotImplementedError) as e:
        message = " ".join(str(e).split()) or type(e).__name__
        raise ConfigError(
            f"{names.source('model', text=message)}TorchTitan cannot build the {spec.name} {spec.flavor} model for this "
            f"job: {message}"
        ) from None


def _validate_muon_params(model: nn.Module, patterns, spec, names: Naming) -> list[str]:
    """Each regex of ``optimizer.muon_params`` must select only matrices DMuon can train, and each
    entry of a list the user wrote must select something (DMuon's default list covers every
    supported family, so its entries for other families match nothing here)."""
    named = [(canonical_fqn(n), p) for n, p in model.named_parameters() if p.requires_grad]
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    key, model_name = names.key("optimizer", "muon_params"), f"the {spec.name} {spec.flavor} model"
    own_list = tuple(patterns) != DEFAULT_MUON_PARAMS
    selected: dict[int, str] = {}
    for pattern in patterns:
        regex = re.compile(pattern)
        hits = [(n, p) for n, p in named if regex.search(n)]
        if not hits and own_list:
            raise ConfigError(
                f"{key} entry '{pattern}' matches no parameter of {model_name}{_close_names(pattern, model)}; "
                f"its parameters are {', '.join(_overview(model))}"
            )
        for name, param in hits:
            if id(param) in embeddings:
                raise ConfigError(
                    f"{key} entry '{pattern}' selects {name}, the token embedding (an nn.Embedding): an embedding is a "
                    "lookup table whose rows are indexed by token ids, while Muon orthogonalises matrices that act on "
                    "activations, so it stays on AdamW; narrow or remove the entry"
                )
            if param.ndim not in (2, 3):
                raise ConfigError(
                    f"{key} entry '{pattern}' selects {name} of shape {tuple(param.shape)}: Muon needs 2-D weight "
                    "matrices or 3-D expert weights (experts, rows, cols), and norms and biases stay on AdamW; "
                    "narrow the entry (e.g. end it with the projection's name and \\.weight$)"
                )
            selected[id(param)] = name
    if not selected:
        listed = ", ".join(repr(p) for p in patterns)
        raise ConfigError(
            f"{key} = [{listed}] matches no parameter of {model_name}; its parameters are {', '.join(_overview(model))}"
        )
    return _fused_qkv_left_out(model, selected, key)


def _fused_qkv_left_out(model: nn.Module, selected: dict[int, str], key: str) -> list[str]:
    """A list written for separate q/k/v weights (README style: ``.attention.w``) puts the output
    projection on Muon but not TorchTitan's fused wqkv: valid, but probably not meant."""
    fqns = {id(p): canonical_fqn(n) for n, p in model.named_parameters()}
    left_out = set()
    for weight in fused_qkv_blocks(model):
        name = fqns[id(weight)]
        attention = name.removesuffix(".wqkv.weight").rsplit(".", 1)[0] + "."
        if id(weight) not in selected and any(n.startswith(attention) for n in selected.values()):
            left_out.add(_collapsed(name))
    return [
        f"{key} puts attention weights on Muon but leaves {name} (TorchTitan's fused q/k/v weight) on AdamW; "
        f"add the regex {_exact_regex(name)} to the list to train it with Muon (per q/k/v block)"
        for name in sorted(left_out)
    ]


def _validate_expert_parallelism(p, world_size: int | None, experts: int, *, dmuon: bool, names: Naming) -> None:
    efsdp_ep = _expert_region_ranks(p, world_size)
    if dmuon and efsdp_ep is not None and efsdp_ep > experts:
        raise ConfigError(
            f"{names.section('parallelism', 'expert_parallel_degree', 'data_parallel_shard_degree')} "
            f"{expert_parallel_limit(efsdp_ep, experts)}"
        )


def _collapsed(name: str) -> str:
    """``layers.3.attention.wo.weight`` as ``layers.*.attention.wo.weight``: one entry per kind of weight."""
    return re.sub(r"(?<=\.)\d+(?=\.)", "*", name)


def _overview(model: nn.Module) -> list[str]:
    return list(dict.fromkeys(_collapsed(canonical_fqn(n)) for n, _ in model.named_parameters()))


def _exact_regex(collapsed: str) -> str:
    return r"\." + re.escape(collapsed.split(".*.", 1)[-1]) + "$"


def _close_names(pattern: str, model: nn.Module) -> str:
    """" (close names: ...)" for an entry that matches nothing, from its literal text."""
    literal = re.sub(r"\\(.)", r"\1", pattern).strip("^$")
    close = difflib.get_close_matches(literal, _overview(model), n=3, cutoff=0.5)
    hint = ""
    if re.search(r"\bw[qkv]\b", literal) and fused_qkv_blocks(model):
        hint = "; this model fuses wq/wk/wv into one qkv_linear.wqkv weight"
    return (f" (close names: {', '.join(close)})" if close else "") + hint


# ---- TOML: keys the job set that its optimizer would ignore or read differently ------------------
def validate_optimizer_keys(opt, sources: Mapping[str, str], *, file_name: str | None, config_file: str) -> None:
    """``sources``: each [optimizer] key the job set -> where (the file or "command line");
    ``file_name``: the file's own ``name``. Only the TOML door knows which keys were set."""
    muon_family = opt.name in MUON_FAMILY_NAMES
    switched = file_name is not None and (file_name in MUON_FAMILY_NAMES) != muon_family
    for key, source in sources.items():
        if muon_family and key in ADAMW_ONLY_KEYS:
            hint = f"; with name = \"dmuon\" use adamw_{key} for the non-Muon parameters"
            raise ConfigError(f"{source}: [optimizer] {key} applies to name = \"AdamW\" only{hint}")
        if not muon_family and key in MUON_FAMILY_KEYS:
            raise ConfigError(
                f"{source}: [optimizer] {key} applies to name = \"dmuon\" (or \"naive_muon\") only, not {opt.name!r}; "
                f"{_how_to_switch(opt, sources, config_file, switched)}"
            )
        if opt.name == NAIVE_MUON and key == "reshard_after_forward":
            raise ConfigError(
                f"{source}: [optimizer] reshard_after_forward applies to name = \"dmuon\" only; "
                "naive_muon follows parallelism.fsdp_reshard_after_forward"
            )
    shared = _read_as_another_optimizers(sources) if switched else []
    if shared:
        key = shared[0]
        raise ConfigError(
            f"{sources[key]}: [optimizer] {key} = {getattr(opt, key)!r} is written for name = {toml_value(file_name)} "
            f"(the file's optimizer), and the command line switches to name = {toml_value(opt.name)}, which would read "
            f"it as {'Muon' if muon_family else opt.name}'s {key}; give that on the command line too: "
            f"--optimizer.{key} <value>"
        )


def _read_as_another_optimizers(sources: Mapping[str, str]) -> list[str]:
    """The shared keys (Muon's with dmuon, AdamW's otherwise) that only the file set."""
    return [k for k in ("lr", "weight_decay") if sources.get(k, "command line") != "command line"]


def _how_to_switch(opt, sources: Mapping[str, str], config_file: str, switched: bool) -> str:
    muon_keys = [k for k in sources if k in MUON_FAMILY_KEYS]
    in_file = [k for k in muon_keys if sources[k] != "command line"]
    on_cli = [f"--optimizer.{k}" for k in muon_keys if sources[k] == "command line"]
    steps = ([f"remove {', '.join(in_file)} from [optimizer] in {config_file}"] if in_file else []) + (
        [f"leave out {' '.join(on_cli)}"] if on_cli else []
    )
    shared = _read_as_another_optimizers(sources) if switched else []
    if shared:
        values = " ".join(f"--optimizer.{k} <value>" for k in shared)
        steps.append(f"give {opt.name}'s {' and '.join(shared)} (the file's are Muon's): {values}")
    return (
        f"to train this job with {opt.name}, {' and '.join(steps)}, "
        f"or start from an {opt.name} file such as {ADAMW_EXAMPLE}"
    )
