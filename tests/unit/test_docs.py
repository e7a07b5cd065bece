"""The documentation keeps up with the code: every error message has its troubleshooting entry, every
public name its docstring and its place in the API reference, every relative link resolves, and the
README stays a front page. (CI also builds the site with ``mkdocs build --strict``: ``.ci/run``.)"""

from __future__ import annotations

import ast
import inspect
import os
import re
import unicodedata

import pytest

from tests.support import error_messages


ROOT = error_messages.ROOT
DOCS = os.path.join(ROOT, "docs")
README_MAX_LINES = 300


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _markdown_files() -> list[str]:
    out = [os.path.join(ROOT, "README.md")]
    for folder, _, files in os.walk(DOCS):
        out += [os.path.join(folder, name) for name in sorted(files) if name.endswith(".md")]
    return out


# ---- troubleshooting by error message ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def sites() -> list:
    """The scan parses every module of the package (seconds): once for the three tests that read it."""
    return error_messages.sites()


def test_every_error_message_has_a_troubleshooting_entry(sites):
    """Each message a user can meet (``tests/support/error_messages.py`` reads them from the source) is quoted
    in docs/troubleshooting.md by one of its own stable pieces of text, so a reader who searches for
    the line they got finds its cause and fix; a new or reworded message without an entry fails here."""
    page = _read(os.path.join(DOCS, "troubleshooting.md"))
    missing = [f"{s.path}:{s.line} {s.error}: {s.template}" for s in sites
               if s.fragments and not error_messages.answered(s, page)]
    assert not missing, "no entry in docs/troubleshooting.md for:\n" + "\n".join(missing)


def test_every_message_without_text_is_passed_on(sites):
    """A raise with no text of its own passes another error's message on (named in PASSED_ON, with why);
    an entry there that matches no such raise is stale."""
    textless = {s.key for s in sites if not s.fragments}
    assert textless == set(error_messages.PASSED_ON), (
        f"raises without text not in PASSED_ON: {sorted(textless - set(error_messages.PASSED_ON))}; "
        f"stale PASSED_ON entries: {sorted(set(error_messages.PASSED_ON) - textless)}")


def test_the_scan_finds_messages_built_elsewhere(sites):
    """The scan follows a message through a builder function and an assigned name: the fault-tolerance
    checks' lines (returned by fault_tolerance_problem, raised as ``problem``) and moe_problem's."""
    templates = [s.template for s in sites]
    assert any("TorchFT's state transfer to a joining group" in t for t in templates)
    assert any("balances its experts' load" in t for t in templates)
    assert len(templates) > 150


# ---- docstrings and the API reference ----------------------------------------------------------------------
def _public_api():
    import titan_dmuon
    from titan_dmuon.integration.config.python_config import with_dmuon

    return {**{name: getattr(titan_dmuon, name) for name in titan_dmuon.__all__}, "with_dmuon": with_dmuon}


def _attribute_docstrings(cls) -> dict[str, bool]:
    """Each annotated field of a dataclass body: whether a string literal (its docstring) follows it."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    out = {}
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            following = body[i + 1] if i + 1 < len(body) else None
            out[node.target.id] = (isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                                   and isinstance(following.value.value, str))
    return out


def test_every_public_name_has_a_docstring():
    """``titan_dmuon.__all__``, ``with_dmuon``, and of each public class every method and property it
    defines and every field of a dataclass: what the API reference is generated from (mkdocstrings
    leaves out what has no docstring, so a missing one would silently drop it from the site)."""
    missing = []
    for name, obj in _public_api().items():
        own = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
        if not (own or "").strip():
            missing.append(name)
        if not inspect.isclass(obj):
            continue
        for attr, value in vars(obj).items():
            if attr.startswith("_"):
                continue
            fn = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            if (callable(fn) or isinstance(value, property)) and not (getattr(fn, "__doc__", None) or "").strip():
                missing.append(f"{name}.{attr}")
        if hasattr(obj, "__dataclass_fields__"):
            missing += [f"{name}.{field}" for field, has in _attribute_docstrings(obj).items() if not has]
    assert not missing, f"public names without a docstring: {missing}"


def test_the_api_reference_renders_every_public_name():
    page = _read(os.path.join(DOCS, "reference", "api.md"))
    rendered = set(re.findall(r"^::: titan_dmuon\.(?:[\w.]+\.)?(\w+)\s*$", page, flags=re.M))
    assert not set(_public_api()) - rendered, f"not in docs/reference/api.md: {sorted(set(_public_api()) - rendered)}"


# ---- links and the README ---------------------------------------------------------------------------------
def _slug(heading: str) -> str:
    """Python-Markdown's toc slug (what mkdocs anchors use): ascii, lower case, punctuation dropped."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", text)).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(path: str) -> set[str]:
    """A page's headings as anchors, and the objects its ``::: path`` lines render (mkdocstrings'
    anchor is the object's path)."""
    text = re.sub(r"```.*?```", "", _read(path), flags=re.S)
    return ({_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M)}
            | set(re.findall(r"^::: ([\w.]+)\s*$", text, flags=re.M)))


def test_every_relative_link_resolves():
    """In README.md and docs/: a relative link names a file that exists and, after ``#``, a heading in it."""
    broken = []
    for path in _markdown_files():
        text = re.sub(r"```.*?```", "", _read(path), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("/"):
                continue
            file, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            where = f"{os.path.relpath(path, ROOT)}: {target}"
            if not os.path.exists(resolved):
                broken.append(f"{where} (no such file)")
            elif anchor and resolved.endswith(".md") and anchor not in _anchors(resolved):
                broken.append(f"{where} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_is_a_front_page():
    lines = _read(os.path.join(ROOT, "README.md")).count("\n")
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines; move detail into docs/ "
                                       f"(at most {README_MAX_LINES})")
