"""The pre-launch check: a job's config validated once, before torchrun starts any worker.

    WORLD_SIZE=2 python -m titan_dmuon.integration.config.check --config_file FILE.toml [--section.key value ...]
    WORLD_SIZE=2 python -m titan_dmuon.integration.config.check --module M --config F [TorchTitan's overrides ...]

``run_train.sh`` runs it with the arguments it gives the workers. Every
worker validates the config too (users may launch torchrun themselves), but
there the message can be lost: when one rank fails first, torchrun kills the
others, rank 0 (the one whose output is shown) included, before it logs.
Here it is one line, printed last, exit status 2. The config is built as the
workers build it (TOML: ``load_config``; Python: TorchTitan's ConfigManager,
i.e. the config function and then TorchTitan's own command-line overrides)
and checked as DMuonTrainer checks it, model on the meta device included: no
process group, nothing downloaded, a few seconds. Quiet when the config is good.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import logging
import os
import re
import sys
import warnings

from titan_dmuon.integration import cpu

cpu.enable()  # as every door does, before TorchTitan's trainer is imported

from torchtitan.config import ConfigManager  # noqa: E402

from titan_dmuon.integration.config.toml_file import apply_command_line, command_line_names, load_config  # noqa: E402
from titan_dmuon.integration.config.validation.naming import ConfigError  # noqa: E402
from titan_dmuon.integration.config.validation.validate import validate_dmuon  # noqa: E402 (after cpu.enable())
from titan_dmuon.integration.train import split_config_file  # noqa: E402
from titan_dmuon.integration.trainer import DMuonTrainer  # noqa: E402

USAGE = (
    "usage: python -m titan_dmuon.integration.config.check "
    "(--config_file FILE.toml | --module M --config F) [overrides ...]"
)


def check(args: list[str], *, world_size: int | None) -> None:
    """ConfigError (one line) unless the job these worker arguments describe would pass DMuon's checks."""
    config_file, overrides = split_config_file(args)
    if config_file is not None:
        load_config(config_file, overrides, world_size=world_size, this_machine=True)
        return
    if not any(a == "--config" or a.startswith("--config=") for a in args):
        raise ConfigError(f"command line: expected --config_file FILE.toml or --module M --config F; {USAGE}")
    config = _torchtitan_config(args, world_size=world_size)
    if isinstance(config, DMuonTrainer.Config):  # (a plain TorchTitan config is TorchTitan's to check)
        names = command_line_names(args, otherwise=f"config {_config_function(args)}")
        validate_dmuon(config, world_size=world_size, names=names, this_machine=True)  # as DMuonTrainer does


def _config_function(args: list[str]) -> str:
    """The ``--config F`` these arguments name (errors name it where a value came from it)."""
    for i, arg in enumerate(args):
        if arg.startswith("--config="):
            return arg.partition("=")[2]
        if arg == "--config" and i + 1 < len(args):
            return args[i + 1]
    return "the config function"


def _torchtitan_config(args: list[str], *, world_size: int | None):
    """The config ``torchtitan.train`` builds from these arguments: TorchTitan's ConfigManager calls
    the config function, then applies its command-line overrides (tyro)."""
    captured = io.StringIO()
    show_tyros_message = True
    try:
        with contextlib.redirect_stderr(captured):
            return ConfigManager().parse_args(list(args))
    except SystemExit as e:  # tyro printed why (a framed message) and exits
        if e.code in (0, None):
            raise
        try:
            _explain_rejection(args, world_size)
        except ConfigError as explained:
            show_tyros_message = False  # the one line says it all
            raise explained from None
        summary = _summary_of_box(captured.getvalue())
        raise ConfigError(f"command line: {summary} (TorchTitan's parser; its message is above)") from None
    except ConfigError:
        raise  # (from with_dmuon in the config function)
    except (ValueError, ImportError) as e:  # --module/--config not found; TorchTitan's own checks
        raise ConfigError(f"command line: {' '.join(str(e).split())}") from None
    finally:
        if show_tyros_message:
            sys.stderr.write(captured.getvalue())  # tyro's own message, before the one line


def _explain_rejection(args: list[str], world_size: int | None) -> None:
    """TorchTitan's parser (tyro) rejected these arguments with a framed message, many lines long.
    Apply their ``--section.key value`` overrides the TOML door's way to the config function's
    config and check it: a wrong value, or a check TorchTitan runs as it builds a section (e.g.
    ``checkpoint.keep_latest_k = 1``), is then the TOML door's one line, a ConfigError. Returns if
    it finds nothing (tyro's own message then stands)."""
    try:  # (ConfigManager's own first half: the config function's config, the overrides left over)
        config, overrides = ConfigManager()._load_config(list(args))
    except Exception:  # noqa: BLE001 - (the caller reports tyro's message)
        return
    names = apply_command_line(config, overrides)
    if isinstance(config, DMuonTrainer.Config):
        validate_dmuon(config, world_size=world_size, names=names, this_machine=True)


def _summary_of_box(text: str) -> str:
    """The first paragraph of tyro's framed message under its title (e.g. "Unrecognized options:
    --training.stepz, 3"), its wrapped lines joined; framed with box characters on a terminal, with
    dashes otherwise."""
    lines = []
    for line in text.splitlines():
        stripped = line.strip()
        rule = stripped.startswith(("╭", "╰")) or (stripped != "" and set(stripped) <= set("─-│ "))
        lines.append((rule, re.sub(r"[│╭╮╰╯]", "", line).strip(" ─")))
    start = next((i + 1 for i, (rule, _) in enumerate(lines) if rule), 0)
    paragraph = list(itertools.takewhile(lambda line: not line[0] and line[1], lines[start:]))
    return " ".join(content for _, content in paragraph) or "the arguments were rejected"


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    world_size = int(os.environ["WORLD_SIZE"]) if os.environ.get("WORLD_SIZE") else None
    try:
        with _quiet():
            check(args, world_size=world_size)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


@contextlib.contextmanager
def _quiet():
    """No warnings from the check itself: the workers log TorchTitan's and DMuon's, once."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        root.setLevel(level)


if __name__ == "__main__":
    sys.exit(main())
