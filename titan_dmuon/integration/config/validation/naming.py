"""How a config problem is told: ``ConfigError`` (one line: the setting, the bad value, the fix) and ``Naming``
(how each door spells a setting: ``optimizer.momentum`` in Python, ``[optimizer] momentum`` in a TOML file).
"""

from __future__ import annotations

import json


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
