"""The built documentation site, as a reader's browser gets it: every image a page shows is there and
reads as a PNG or SVG, every formula became MathML at build time (no TeX left over, no latex2mathml
error), and nothing is loaded from the network (no CDN script, web font or remote image), so the site
reads offline. The site is built here with ``mkdocs build --strict`` (a few seconds); without the
``docs`` extra the tests skip, unless ``TITAN_DMUON_DOCS_REQUIRED=1`` (CI sets it after installing the
extra) makes that a failure."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest

from tests.support import error_messages

ROOT = error_messages.ROOT
IMAGE_SUFFIXES = (".png", ".svg", ".jpg", ".jpeg", ".gif", ".webp")
MATHML_NS = "{http://www.w3.org/1998/Math/MathML}"


def _require(module: str):
    if os.environ.get("TITAN_DMUON_DOCS_REQUIRED") == "1":
        return __import__(module)
    return pytest.importorskip(module, reason=f"the docs extra is not installed ({module}): pip install -e '.[docs]'")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> str:
    for module in ("mkdocs", "mkdocstrings", "material", "latex2mathml", "pymdownx"):
        _require(module)
    out = str(tmp_path_factory.mktemp("site"))
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", out],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
    return out


def _pages(site: str) -> list[str]:
    return sorted(
        os.path.join(folder, name) for folder, _, names in os.walk(site) for name in names if name.endswith(".html")
    )


class _Refs(HTMLParser):
    """Every img src, every link href that names an image, scripts and stylesheets."""

    def __init__(self):
        super().__init__()
        self.images, self.loads = [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs.get("src") or "")
        elif tag == "a" and (attrs.get("href") or "").split("#")[0].lower().endswith(IMAGE_SUFFIXES):
            self.images.append(attrs["href"])
        elif tag == "script" and attrs.get("src"):
            self.loads.append(attrs["src"])
        elif tag == "link" and (attrs.get("rel") or "") in ("stylesheet", "preconnect", "preload", "icon"):
            self.loads.append(attrs.get("href") or "")


def _refs(page: str) -> _Refs:
    parser = _Refs()
    with open(page, encoding="utf-8") as f:
        parser.feed(f.read())
    return parser


def test_every_image_is_in_the_site_and_reads(site):
    """An image a page shows, or links to for its full size, is a file of the site: a PNG with PNG's
    signature or an SVG that parses as XML (a broken path, an LFS pointer or a truncated file fails)."""
    broken, shown = [], 0
    for page in _pages(site):
        for src in _refs(page).images:
            shown += 1
            where = f"{os.path.relpath(page, site)}: {src}"
            if re.match(r"[a-z]+:", src) or src.startswith("//"):
                broken.append(f"{where} (not in the site: a reader offline cannot load it)")
                continue
            path = os.path.normpath(os.path.join(os.path.dirname(page), src.split("#")[0].split("?")[0]))
            if not os.path.isfile(path):
                broken.append(f"{where} (no such file)")
            elif path.endswith(".png"):
                with open(path, "rb") as f:
                    if f.read(8) != b"\x89PNG\r\n\x1a\n":
                        broken.append(f"{where} (not a PNG)")
            elif path.endswith(".svg"):
                try:
                    ET.parse(path)
                except ET.ParseError as exc:
                    broken.append(f"{where} (SVG does not parse: {exc})")
    assert not broken, "broken images:\n" + "\n".join(broken)
    assert shown >= 7, f"only {shown} images found in the site: the scan is not seeing the pages' images"


def _prose(html: str) -> str:
    """A page's HTML without code, preformatted text and the MathML itself."""
    return re.sub(r"<(pre|code|math)\b.*?</\1>", "", html, flags=re.S)


def test_every_formula_is_rendered_mathml(site):
    """No formula reaches the reader as TeX: the hook turned every ``$...$``/``$$...$$`` into MathML,
    each a well-formed <math> without latex2mathml's <merror>; the formulas' pages have them."""
    problems, count = [], {}
    for page in _pages(site):
        with open(page, encoding="utf-8") as f:
            html = f.read()
        name = os.path.relpath(page, site)
        prose = _prose(html)
        if 'class="arithmatex"' in html:
            problems.append(f"{name}: an arithmatex block was not converted")
        for tex in re.findall(r"\\[(\[]|\$\$|\$[^$\s<][^$<]*\\[a-zA-Z]+[^$<]*\$", prose):
            problems.append(f"{name}: TeX left in the page: {tex[:60]!r}")
        maths = re.findall(r"<math\b.*?</math>", html, flags=re.S)
        count[name] = len(maths)
        for math in maths:
            try:
                element = ET.fromstring(math)
            except ET.ParseError as exc:
                problems.append(f"{name}: MathML does not parse ({exc}): {math[:80]}")
                continue
            if element.find(f".//{MATHML_NS}merror") is not None:
                problems.append(f"{name}: latex2mathml could not read a formula: {math[:120]}")
    assert not problems, "\n".join(problems)
    for page in ("concepts/index.html", "index.html", "owner-groups/index.html", "newton-schulz/index.html"):
        assert count.get(page, 0) >= 3, f"{page} has {count.get(page, 0)} rendered formulas; expected its formulas"


def test_nothing_is_loaded_from_the_network(site):
    """Scripts, stylesheets and fonts come from the site itself: the build and the reader need no
    network (no MathJax or KaTeX from a CDN, no Google Fonts)."""
    remote = [
        f"{os.path.relpath(page, site)}: {url}"
        for page in _pages(site)
        for url in _refs(page).loads
        if re.match(r"(https?:)?//", url)
    ]
    assert not remote, "loaded from the network:\n" + "\n".join(sorted(set(remote)))


def test_long_signatures_are_formatted(site):
    """The API reference sets a long signature one parameter a line (mkdocstrings formats it with ruff,
    the docs extra's formatter; without one it would be one overflowing line)."""
    with open(os.path.join(site, "reference", "api", "index.html"), encoding="utf-8") as f:
        html = f.read()
    signatures = re.findall(r'<div class="doc-signature[^"]*">(.*?)</div>', html, flags=re.S)
    text = [re.sub(r"<[^>]+>", "", s) for s in signatures]
    dedicate = [t for t in text if t.lstrip().startswith("dedicate_params(")]
    assert dedicate, "no signature of dedicate_params in the API reference"
    lines = dedicate[0].strip().splitlines()
    assert len(lines) > 5 and all(len(line) <= 100 for line in lines), dedicate[0]
