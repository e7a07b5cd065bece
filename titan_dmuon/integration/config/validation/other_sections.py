"""Checks of ``[training]``, ``[validator]``, ``[checkpoint]`` and every section's own ``__post_init__``,
before launch."""

from __future__ import annotations

import copy
import dataclasses
import logging

from titan_dmuon.integration.config.validation.naming import ConfigError, Naming


def validate_training(training, names: Naming) -> None:
    for key in ("steps", "local_batch_size", "seq_len"):
        if getattr(training, key) <= 0:
            raise ConfigError(f"{names.key('training', key)} = {getattr(training, key)}: expected a positive integer")
    if training.max_norm <= 0:
        raise ConfigError(f"{names.key('training', 'max_norm')} = {training.max_norm}: expected a positive number")


def validate_validator(validator, world_size: int | None, names: Naming) -> None:
    """TorchTitan's validation reading all its data (``steps = -1``) runs as many batches on each rank
    as its share of the rows makes, and a rank with one more waits forever in a collective."""
    if validator.enable and validator.steps == -1 and world_size != 1:
        raise ConfigError(
            f"{names.key('validator', 'steps')} = -1 (all the held-out data) can hang with several ranks: "
            "each reads its own share of the rows, and a rank with one batch more waits forever in a collective; "
            f"set a count every rank can read, e.g. {names.how_to_set('validator', 'steps', 4)}"
        )


def validate_checkpoint(checkpoint, names: Naming) -> None:
    """TorchTitan's own rules for its HF export and import, which it checks only when it builds the
    checkpointer, after the process groups started."""
    for kind in ("last_save", "initial_load"):
        if getattr(checkpoint, f"{kind}_in_hf") and not getattr(checkpoint, f"{kind}_model_only"):
            raise ConfigError(
                f"{names.key('checkpoint', f'{kind}_in_hf')} = true needs {kind}_model_only = true (TorchTitan "
                f"{'saves' if kind == 'last_save' else 'loads'} only the model weights in HF format); add "
                f"{names.how_to_set('checkpoint', f'{kind}_model_only', True)}"
            )


def validate_sections(config, names: Naming) -> None:
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
            raise ConfigError(
                f"{names.source(field.name, text=message)}TorchTitan rejects the {field.name} settings: {message}"
            ) from None
        finally:
            logging.disable(previous)
