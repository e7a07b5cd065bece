"""Config values as their annotated types, for every door (TOML, the command line, ``with_dmuon``).

Kept apart from the checks and the doors so that each of them converts a value
the same way and describes the expected type with the same words.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal


def convert(value, annotation, *, from_cli: bool):
    """``value`` as ``annotation`` (TOML/Python values; strings too when ``from_cli``), else
    TypeError/ValueError (an empty message: ``describe(annotation)`` says what was expected)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return _convert_union(value, typing.get_args(annotation), from_cli)
    if origin is Literal:
        return _convert_literal(value, typing.get_args(annotation), from_cli)
    if origin in (list, tuple):
        return _convert_sequence(value, origin, typing.get_args(annotation), from_cli)
    if origin is dict:
        return _convert_table(value, typing.get_args(annotation), from_cli)
    if annotation is Any:
        return value
    scalar = next((fn for t, fn in _SCALARS.items() if annotation is t), None)  # (no hashing of annotations)
    if scalar is not None:
        return scalar(value, from_cli)
    raise TypeError(f"this key cannot be set from a TOML file (type {annotation})")


def _convert_union(value, args: tuple, from_cli: bool):
    """The first of ``args`` that takes ``value``; None (also "none"/"null" on the command line) for an
    optional value."""
    if type(None) in args and (value is None or (from_cli and str(value).lower() in ("none", "null"))):
        return None
    for option in (a for a in args if a is not type(None)):
        try:
            return convert(value, option, from_cli=from_cli)
        except (TypeError, ValueError):
            pass
    raise ValueError("")


def _convert_literal(value, args: tuple, from_cli: bool):
    if from_cli and not any(isinstance(a, str) for a in args):
        value = convert(value, type(args[0]), from_cli=True)
    if value not in args:
        raise ValueError("")
    return value


def _convert_sequence(value, origin, args: tuple, from_cli: bool):
    """A list or tuple (comma-separated on the command line), each item as its annotation."""
    if from_cli and isinstance(value, str):
        value = [v.strip() for v in value.split(",")] if value else []
    if not isinstance(value, (list, tuple)):
        raise TypeError("")
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(convert(v, args[0], from_cli=from_cli) for v in value)
        if len(value) != len(args):
            raise ValueError(f"{len(args)} values")
        return tuple(convert(v, a, from_cli=from_cli) for v, a in zip(value, args))
    if args and _is_table_list(args[0], from_cli):  # (e.g. [[optimizer.param_groups]])
        return [_convert_dataclass(v, args[0]) for v in value]
    return [convert(v, args[0], from_cli=from_cli) for v in value] if args else list(value)


def _is_table_list(item, from_cli: bool) -> bool:
    """A list of config dataclasses, which TOML writes as an array of tables (not the command line)."""
    return dataclasses.is_dataclass(item) and isinstance(item, type) and not from_cli


def _convert_table(value, args: tuple, from_cli: bool) -> dict:
    """A TOML table (``dict[str, Any]``: e.g. a param group's optimizer_kwargs), each value as its annotation."""
    if not isinstance(value, dict):
        raise TypeError("")
    key_type, value_type = args or (str, Any)
    return {
        convert(k, key_type, from_cli=from_cli): convert(v, value_type, from_cli=from_cli) for k, v in value.items()
    }


def _convert_dataclass(value, cls):
    """A TOML table as a config dataclass (e.g. one ``[[optimizer.param_groups]]`` entry as TorchTitan's
    ParamGroupConfig), each key as its field; ValueError names an unknown or missing key."""
    if not isinstance(value, dict):
        raise TypeError("")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r}")
    missing = [
        name
        for name, f in fields.items()
        if name not in value and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ValueError(f"missing key {missing[0]!r}")
    return cls(**{k: convert(v, hints[k], from_cli=False) for k, v in value.items()})


def _convert_bool(value, from_cli: bool) -> bool:
    if from_cli and isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    if not isinstance(value, bool):
        raise TypeError("")
    return value


def _convert_int(value, from_cli: bool) -> int:
    if from_cli and isinstance(value, str):
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError("")
    return value


def _convert_float(value, from_cli: bool) -> float:
    if from_cli and isinstance(value, str):
        value = float(value)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError("")
    return float(value)


def _convert_str(value, from_cli: bool) -> str:
    if not isinstance(value, str):
        raise TypeError("")
    return value


_SCALARS = {bool: _convert_bool, int: _convert_int, float: _convert_float, str: _convert_str}


def is_boolean(annotation) -> bool:
    """True for ``bool`` and ``bool | None``: the keys a bare ``--section.key`` flag can set."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    return annotation is bool or (bool in args and all(a in (bool, type(None)) for a in args))


def describe(annotation) -> str:
    """What ``annotation`` expects, in the words of an error message."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("unset" if a is type(None) else describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    plural = {bool: "true/false values", int: "integers", float: "numbers", str: "strings"}
    if origin is list and args and _is_table_list(args[0], False):
        return "a list of tables with keys " + ", ".join(f.name for f in dataclasses.fields(args[0]) if f.init)
    if origin is list:
        return f"a list of {plural.get(args[0], describe(args[0]))}" if args else "a list"
    if origin is dict or annotation is Any:
        return "a table" if origin is dict else "any value"
    if origin is tuple:
        return f"a list of {len(args)} {plural.get(args[0], describe(args[0]))}"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(annotation, str(annotation))
