"""The files a locally made corpus consists of, shared by every corpus (``assets``: the debug one;
``shakespeare_corpus``: real text): JSONL rows with a "text" field (TorchTitan's ``c4_test`` format)
and a byte-level BPE tokenizer (vocab 2000, within the debug models' 2048) trained on the first file,
made once under a lock (every rank of a job may ask at once) and written atomically.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from collections.abc import Callable

VOCAB_SIZE = 2000
SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>")


def tokenizer_dir(root: str) -> str:
    return os.path.join(root, "tokenizer")


def build_once(root: str, documents: dict[str, Callable[[], list[str]]]) -> str:
    """Write each JSONL file of ``documents`` (path -> a function giving its texts) unless present,
    then train the tokenizer on the first one, under ``root``'s lock; returns ``root``.

    Every rank of a job may call this at once (TorchTitan runs the config
    function on each): one makes the files under a lock, the others wait.
    """
    tok_dir = tokenizer_dir(root)
    tok_files = [os.path.join(tok_dir, name) for name in ("tokenizer.json", "tokenizer_config.json")]  # in order
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
