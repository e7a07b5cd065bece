"""MkDocs hooks.

* Pages that other work adds (plain PyTorch, its checkpoints, context parallelism, owner groups, Muon
  variants, runtime notes) have their place in ``mkdocs.yml``'s nav; until a page's file exists its
  entry is left out, so ``mkdocs build --strict`` passes before and after it lands.
* The home page is the README (``on_page_markdown``).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("mkdocs.hooks.optional_pages")


def _present(entries, docs_dir: str) -> list:
    kept = []
    for entry in entries:
        if isinstance(entry, dict):
            (title, target), = entry.items()
            if isinstance(target, list):
                children = _present(target, docs_dir)
                if children:
                    kept.append({title: children})
                continue
            entry_path = target
        else:
            entry_path = entry
        if "://" in entry_path or os.path.exists(os.path.join(docs_dir, entry_path)):
            kept.append(entry)
        else:
            log.info("nav: %s is not written yet; left out", entry_path)
    return kept


def on_config(config):
    config.nav = _present(config.nav or [], config.docs_dir)
    return config


def on_page_markdown(markdown, page, config, files):
    """The site's home page is the README (one text for both): its links into docs/ point within the
    site, and links to other files of the repository keep their text only."""
    if page.file.src_uri != "index.md":
        return markdown
    import re

    with open(os.path.join(os.path.dirname(config.config_file_path), "README.md"), encoding="utf-8") as f:
        readme = f.read()

    def relink(match):
        text, target = match.group(1), match.group(2)
        if target.startswith("docs/"):
            return f"[{text}]({target[len('docs/'):]})"
        if "://" in target or target.startswith("#"):
            return match.group(0)
        return text

    return re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", relink, readme)
