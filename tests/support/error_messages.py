"""Every error message the package raises, read from its source: what ``docs/troubleshooting.md``
must answer (``tests/unit/test_docs.py``), and its list (``python -m tests.support.error_messages`` prints each
site with the message as a template, ``{}`` where a value goes).

A site is a ``raise SomeError(...)`` in ``titan_dmuon/`` (not ``titan_dmuon/testing/``, the
tests' and benchmarks' models and baselines, which the product never imports). Its message is made of the string
literals in the call (f-strings, concatenations, every argument: ``OptionError(key, value,
expected)`` prints ``key = value: expected ...``). When the message is built elsewhere, the site
follows it: a call to a function of the package (``raise ConfigError(moe_problem(names))``) stands
for that function's returned messages, a name for what the enclosing function assigned to it.
What is left without any text of its own (a message passed on from another error, which is itself
a site) is named in ``PASSED_ON`` with the reason.
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "titan_dmuon")
ERRORS = {"ValueError", "TypeError", "RuntimeError", "NotImplementedError", "KeyError"}  # and the package's own
STABLE = 12  # characters: a clause this long is specific enough to find the message by
SHORT = 3  # shorter literals (": ", ", ") say nothing

# Sites whose message is another error's, raised at a site of its own (the key: module, enclosing
# function, exception class).
PASSED_ON = {
    (
        "titan_dmuon/integration/config/toml_file.py",
        "load_config",
        "ConfigError",
    ): "finalize's ConfigError (TorchTitan's own checks of the whole config), the file's name put first",
    (
        "titan_dmuon/integration/config/toml_file.py",
        "_base_config",
        "ConfigError",
    ): "config_function's ValueError ([model] name or flavor), with where the value was set",
    ("titan_dmuon/integration/config/values.py", "_convert_union", "ValueError"): "the caller writes the line",
    ("titan_dmuon/integration/config/values.py", "_convert_literal", "ValueError"): "the caller writes the line",
    ("titan_dmuon/integration/config/values.py", "_convert_sequence", "TypeError"): "the caller writes the line",
    ("titan_dmuon/integration/config/values.py", "_convert_bool", "TypeError"): "the caller writes the line",
    ("titan_dmuon/integration/config/values.py", "_convert_int", "TypeError"): "the caller writes the line",
    ("titan_dmuon/integration/config/values.py", "_convert_float", "TypeError"): "the caller writes the line",
    ("titan_dmuon/integration/config/values.py", "_convert_str", "TypeError"): "the caller writes the line",
    ("titan_dmuon/integration/config/values.py", "_convert_table", "TypeError"): "the caller writes the line",
    ("titan_dmuon/integration/config/values.py", "_convert_dataclass", "TypeError"): "the caller writes the line",
    (
        "titan_dmuon/integration/config/validation/optimizer_section.py",
        "validate_optimizer",
        "ConfigError",
    ): "check_supported's NotImplementedError or check_model's ModelNotSupported, named as the door names settings",
    (
        "titan_dmuon/integration/config/validation/parallelism_section.py",
        "validate_expert_parallelism",
        "ConfigError",
    ): "expert_parallel_limit's message after the door's section name",
}


@dataclass(frozen=True)
class Site:
    path: str  # relative to the repository
    line: int
    function: str
    error: str
    literals: tuple[str, ...]  # the message's own text, in order
    template: str  # the message with {} for each value

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.path, self.function, self.error)

    @property
    def fragments(self) -> list[str]:
        """Its text as a reader finds it: the clauses of its literals (split at ; : ( ) and at the end
        of a sentence, trimmed of separators), the meaningless short ones dropped."""
        out = []
        for text in self.literals:
            for piece in re.split(r"[;:()\n]|\.\s", text):
                piece = " ".join(piece.split()).strip(" ,.'\"[]{}=")
                if len(piece) >= SHORT:
                    out.append(piece)
        return out

    @property
    def stable(self) -> str | None:
        """The clause an entry must quote: the message's longest (None when all are short)."""
        longest = max(self.fragments, key=len, default="")
        return longest if len(longest) >= STABLE else None


def _literals(node: ast.AST) -> list[str | None]:
    """String pieces of an expression, None for each hole (a value)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value if isinstance(v, ast.Constant) else None for v in node.values]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _literals(node.left) + _literals(node.right)
    if isinstance(node, ast.IfExp):
        return _literals(node.body) + _literals(node.orelse)
    return [None]


def _error_classes(trees: dict[str, ast.Module]) -> set[str]:
    """The builtin errors, and every exception class the package defines (any depth of subclassing)."""
    names = set(ERRORS)
    classes = [n for tree in trees.values() for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    grew = True
    while grew:
        grew = False
        for c in classes:
            bases = {ast.unparse(b).split(".")[-1] for b in c.bases}
            if c.name not in names and bases & names:
                names.add(c.name)
                grew = True
    return names


def _functions(trees: dict[str, ast.Module]) -> dict[str, list[ast.FunctionDef]]:
    out: dict[str, list] = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.setdefault(node.name, []).append(node)
    return out


def _returned(function: ast.FunctionDef) -> list[list[str | None]]:
    """The messages a message-building function returns (one per ``return`` with text)."""
    out = []
    for node in ast.walk(function):
        if isinstance(node, ast.Return) and node.value is not None:
            pieces = _literals(node.value)
            if any(p for p in pieces):
                out.append(pieces)
    return out


def _messages(arg: ast.AST, enclosing, functions, seen=()) -> list[list[str | None]]:
    """The messages an argument of a raise stands for (several when it is built in several ways)."""
    pieces = _literals(arg)
    if any(p for p in pieces):
        return [pieces]
    if isinstance(arg, ast.IfExp):
        return _messages(arg.body, enclosing, functions, seen) + _messages(arg.orelse, enclosing, functions, seen)
    if isinstance(arg, ast.JoinedStr):  # only values: the text is in what they call (a message builder)
        return [
            m
            for v in arg.values
            if isinstance(v, ast.FormattedValue)
            for m in _messages(v.value, enclosing, functions, seen)
        ]
    if isinstance(arg, ast.Call):
        name = ast.unparse(arg.func).split(".")[-1]
        if name in functions and name not in seen:
            found = [m for f in functions[name] for m in _returned(f)]
            return found
    if isinstance(arg, ast.Name) and enclosing is not None:
        found = []
        for node in ast.walk(enclosing):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == arg.id for t in node.targets):
                found += _messages(node.value, None, functions, seen + (arg.id,))
        return found
    return []


def sites() -> list[Site]:
    trees = {}
    for folder, _, files in os.walk(PACKAGE):
        if os.path.relpath(folder, PACKAGE).split(os.sep)[0] == "testing":  # tests' and benchmarks' tools
            continue
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    trees[os.path.relpath(path, ROOT)] = ast.parse(f.read())
    errors, functions = _error_classes(trees), _functions(trees)
    out = []
    for path, tree in sorted(trees.items()):
        for function in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))] + [tree]:
            body = function.body if isinstance(function, ast.Module) else [function]
            for node in (n for b in body for n in ast.walk(b)):
                if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                    continue
                error = ast.unparse(node.exc.func).split(".")[-1]
                if error not in errors or _innermost(tree, node) is not (function if function is not tree else None):
                    continue
                args = list(node.exc.args) + [k.value for k in node.exc.keywords]
                name = function.name if function is not tree else "<module>"
                messages = [m for a in args for m in _messages(a, function, functions)] or [[]]
                for pieces in messages if len(args) == 1 else [[p for a in args for p in _literals(a)]]:
                    out.append(
                        Site(
                            path=path,
                            line=node.lineno,
                            function=name,
                            error=error,
                            literals=tuple(p for p in pieces if p),
                            template="".join("{}" if p is None else p for p in pieces),
                        )
                    )
    return out


def _innermost(tree: ast.Module, target: ast.AST):
    """The innermost function that contains ``target`` (None at module level)."""
    found = None
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(n is target for n in ast.walk(node)):
            if found is None or any(n is node for n in ast.walk(found)):
                found = node
    return found


def answered(site: Site, page: str) -> bool:
    """The page quotes the site's message: its longest clause, or (a message of short pieces only)
    every piece on one line."""
    if site.stable is not None:
        return site.stable in " ".join(page.split())
    return bool(site.fragments) and any(all(p in line for p in site.fragments) for line in page.splitlines())


if __name__ == "__main__":
    for s in sites():
        print(f"{s.path}:{s.line} {s.function} {s.error}: {s.template}")
