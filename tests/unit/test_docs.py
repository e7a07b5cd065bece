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
        if os.path.relpath(folder, DOCS).split(os.sep)[0] == "includes":
            continue  # snippets appended to pages (abbreviations), not pages
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
    missing = [
        f"{s.path}:{s.line} {s.error}: {s.template}"
        for s in sites
        if s.fragments and not error_messages.answered(s, page)
    ]
    assert not missing, "no entry in docs/troubleshooting.md for:\n" + "\n".join(missing)


def test_every_message_without_text_is_passed_on(sites):
    """A raise with no text of its own passes another error's message on (named in PASSED_ON, with why);
    an entry there that matches no such raise is stale."""
    textless = {s.key for s in sites if not s.fragments}
    assert textless == set(error_messages.PASSED_ON), (
        f"raises without text not in PASSED_ON: {sorted(textless - set(error_messages.PASSED_ON))}; "
        f"stale PASSED_ON entries: {sorted(set(error_messages.PASSED_ON) - textless)}"
    )


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
            out[node.target.id] = (
                isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            )
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
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M)} | set(
        re.findall(r"^::: ([\w.]+)\s*$", text, flags=re.M)
    )


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
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; move detail into docs/ (at most {README_MAX_LINES})"
    )


# ---- what a reader meets first: a TL;DR, formulas as math, diagrams as drawn -----------------------------
def test_every_page_opens_with_a_tldr():
    """Each page's first paragraph after its title is a ``> **TL;DR**`` of at most three lines (the
    README's comes after its one-line tagline; docs/index.md is only a stand-in for the README)."""
    missing = []
    for path in _markdown_files():
        if os.path.relpath(path, DOCS) == "index.md":
            continue
        paragraphs = _read(path).split("\n", 1)[1].strip("\n").split("\n\n")
        quote = paragraphs[1 if path.endswith("README.md") else 0].splitlines()  # the README: under its tagline
        if not (
            quote and quote[0].startswith("> **TL;DR**") and len(quote) <= 3 and all(q.startswith(">") for q in quote)
        ):
            missing.append(os.path.relpath(path, ROOT))
    assert not missing, f"pages without a TL;DR of 1-3 lines right under the title: {missing}"


# Plain-text formulas a page must write as $...$ math; lines printed by a command (pasted tables and their
# captions, code blocks) are left as printed.
PLAIN_FORMULA = re.compile(r"P_M|P_E|\([NRTG]\s*[−-]\s*1\)\s*/|X_i|A_jj|2⁻|[a-z][²³]|·\s*P\b")
PRINTED = {  # (page, a piece of the line): printed by the command beside it, pasted as printed
    ("docs/performance.md", "in units of P_M, measured by the CommLedger"),  # benchmarks/comm_table.py
    ("docs/performance.md", "(P_M = 3.146M Muon-target elements"),  # benchmarks/memory_table.py
}


def test_formulas_are_written_as_math():
    """A formula in prose is LaTeX between dollars (rendered to MathML by docs/hooks.py), not plain text
    such as ``2(N−1)/N · P_M``; tables and lines a command printed stay as printed."""
    plain = []
    for path in _markdown_files():
        rel = os.path.relpath(path, ROOT)
        text = re.sub(r"\$\$.*?\$\$", "", re.sub(r"```.*?```", "", _read(path), flags=re.S), flags=re.S)
        for line in text.splitlines():
            bare = re.sub(r"\$[^$]+\$", "", re.sub(r"`[^`]*`", "", line))
            if (
                PLAIN_FORMULA.search(bare)
                and not (line.lstrip().startswith("|") and rel == "docs/performance.md")
                and not any(rel == page and piece in line for page, piece in PRINTED)
            ):
                plain.append(f"{rel}: {line.strip()[:100]}")
    assert not plain, "formulas in plain text (write them as $...$):\n" + "\n".join(plain)


def test_the_diagrams_are_what_their_script_draws():
    """docs/diagrams/*.svg are generated: a hand edit, or a script change without rerunning it
    (``python docs/diagrams/make_diagrams.py``), fails here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_diagrams", os.path.join(DOCS, "diagrams", "make_diagrams.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    drawn = module.render_all(write=False)
    stale = [name for name, svg in drawn.items() if _read(os.path.join(DOCS, "diagrams", name)) != svg]
    assert not stale, f"rerun python docs/diagrams/make_diagrams.py: {stale} differ from what it draws"
    assert len(drawn) == 3
