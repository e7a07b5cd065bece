"""Train a TorchTitan model from a TOML config, with DMuon when ``[optimizer] name = "dmuon"``.

    torchrun --nproc_per_node 2 -m titan_dmuon.integration.train --config_file train_configs/debug_model.toml \\
        [--section.key value ...]

(``run_train.sh`` wraps this.) Mirrors ``torchtitan.train.main``; the only
differences are the TOML config and, on a machine without an accelerator,
the CPU accommodations of ``titan_dmuon.integration.cpu``.
"""

from __future__ import annotations

import os
import sys

from titan_dmuon.integration import cpu

USAGE = "usage: python -m titan_dmuon.integration.train --config_file FILE.toml [--section.key value ...]"


def main(argv: list[str] | None = None) -> None:
    config_file, overrides = split_config_file(list(sys.argv[1:] if argv is None else argv))
    if not config_file:
        sys.exit(USAGE)
    cpu.enable()  # before TorchTitan's trainer is imported; a no-op with an accelerator

    import torch
    from torchtitan.tools.logging import init_logger, logger

    from titan_dmuon.integration.config.toml_file import ConfigError, load_config

    init_logger()
    world_size = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
    try:
        config = load_config(config_file, overrides, world_size=world_size, this_machine=True)
    except ConfigError as e:
        logger.error(f"config error: {e}")
        sys.exit(2)
    logger.info(f"titan_dmuon: {config_file}, optimizer {config.optimizer.name}")

    trainer = None
    try:
        try:
            trainer = config.build()
        except ConfigError:
            sys.exit(2)  # DMuonTrainer logged it; nothing was started
        if config.checkpoint.create_seed_checkpoint:
            trainer.checkpointer.save(curr_step=0, last_step=True)
        else:
            trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    logger.info("Process group destroyed")


def split_config_file(args: list[str]) -> tuple[str | None, list[str]]:
    """(the ``--config_file`` value, the other arguments: the overrides)."""
    rest, config_file, i = [], None, 0
    while i < len(args):
        if args[i] == "--config_file":
            config_file, i = (args[i + 1] if i + 1 < len(args) else None), i + 2
            continue
        if args[i].startswith("--config_file="):
            config_file = args[i].split("=", 1)[1]
        else:
            rest.append(args[i])
        i += 1
    return config_file, rest


if __name__ == "__main__":
    main()
