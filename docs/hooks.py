"""MkDocs hooks.

* Pages that other work adds have their place in ``mkdocs.yml``'s nav; until a page's file exists its
  entry is left out, so ``mkdocs build --strict`` passes before and after it lands.
* The home page is the README (``on_page_markdown``), and CONTRIBUTING.md is copied into the site as
  ``contributing.md`` (``on_files``): one text each for the repository and the site. Their links into
  ``docs/`` point within the site; links to other files of the repository (``tests/``, ``benchmarks/``,
  ``examples/``) point to them under ``repo_url``.
* Formulas: ``pymdownx.arithmatex`` (generic mode) marks ``$...$`` and ``$$...$$``; ``on_page_content``
  turns each into MathML at build time (latex2mathml), which browsers render natively: no JavaScript,
  no network when the site is built or read.
* A standalone image links to its own file, so a reader can open a wide plot at full size.
"""

from __future__ import annotations

import html
import logging
import os
import re

log = logging.getLogger("mkdocs.hooks.titan_dmuon")

GENERATED_PAGES = {"contributing.md": "CONTRIBUTING.md"}  # site page -> the repository file it copies
_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")
_MATH = re.compile(r'<(span|div) class="arithmatex">\\[(\[](.*?)\\[)\]]</\1>', re.S)
_STANDALONE_IMAGE = re.compile(r'<p>(<img [^>]*src="([^"]+)"[^>]*>)</p>')


def _present(entries, docs_dir: str) -> list:
    kept = []
    for entry in entries:
        if isinstance(entry, dict):
            ((title, target),) = entry.items()
            if isinstance(target, list):
                children = _present(target, docs_dir)
                if children:
                    kept.append({title: children})
                continue
            entry_path = target
        else:
            entry_path = entry
        if "://" in entry_path or entry_path in GENERATED_PAGES or os.path.exists(os.path.join(docs_dir, entry_path)):
            kept.append(entry)
        else:
            log.info("nav: %s is not written yet; left out", entry_path)
    return kept


def on_config(config):
    config.nav = _present(config.nav or [], config.docs_dir)
    return config


def _repo_root(config) -> str:
    return os.path.dirname(config.config_file_path)


def _relink(text: str, config) -> str:
    """A repository-root text (README, CONTRIBUTING) as a site page at the site's root."""
    repo_url = (config.repo_url or "").rstrip("/")

    def relink(match):
        label, target = match.group(1), match.group(2)
        if "://" in target or target.startswith("#"):
            return match.group(0)
        if target.startswith("docs/"):
            return f"[{label}]({target[len('docs/') :]})"
        for page, source in GENERATED_PAGES.items():
            if target.split("#")[0] == source:
                return f"[{label}]({page}{target[len(source) :]})"
        if repo_url:
            kind = "tree" if os.path.isdir(os.path.join(_repo_root(config), target.split("#")[0])) else "blob"
            return f"[{label}]({repo_url}/{kind}/main/{target})"
        return label

    return _LINK.sub(relink, text)


def on_files(files, config):
    from mkdocs.structure.files import File

    for page, source in GENERATED_PAGES.items():
        with open(os.path.join(_repo_root(config), source), encoding="utf-8") as f:
            files.append(File.generated(config, page, content=f.read()))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == "index.md":
        with open(os.path.join(_repo_root(config), "README.md"), encoding="utf-8") as f:
            markdown = f.read()
    if page.file.src_uri == "index.md" or page.file.src_uri in GENERATED_PAGES:
        return _relink(markdown, config)
    return markdown


def latex_to_mathml(latex: str, display: bool) -> str:
    """One formula as MathML; a formula latex2mathml cannot read fails the build, naming it."""
    from latex2mathml.converter import convert

    try:
        return convert(latex, display="block" if display else "inline")
    except Exception as exc:  # latex2mathml raises several types; the build must stop on any of them
        raise ValueError(f"docs: cannot render the formula ${latex}$ ({exc}); fix its LaTeX") from exc


def on_page_content(content, page, config, files):
    def render(match):
        display = match.group(1) == "div"
        mathml = latex_to_mathml(html.unescape(match.group(2)).strip(), display)
        return f'<div class="math-display">{mathml}</div>' if display else mathml

    content = _MATH.sub(render, content)
    return _STANDALONE_IMAGE.sub(
        lambda m: f'<p><a href="{m.group(2)}" title="Open the full-size image">{m.group(1)}</a></p>', content
    )
