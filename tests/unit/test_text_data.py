"""Tests of dsim.data.translation: the toy translation task, the parallel text file reader, the factory."""
from __future__ import annotations


import numpy as np
import pytest

from conftest import assert_one_line_error

from dsim.data import (EOT, PAD, UNK, TextTranslation, ToyTranslation, create_dataset,
                       write_pairs)
from dsim.data.factory import NAMES


def assert_batch_layout(batch, n, src_len, tgt_len):
    """Shapes, dtypes and the shift rule labels = tgt_ids[:, 1:] + [EOT]."""
    (src, tgt), labels = batch
    assert src.shape == (n, src_len) and tgt.shape == (n, tgt_len) and labels.shape == (n, tgt_len)
    assert src.dtype == tgt.dtype == labels.dtype == np.int64
    np.testing.assert_array_equal(labels[:, :-1], tgt[:, 1:])
    assert (labels[:, -1] == EOT).all()


def test_special_ids():
    assert (UNK, PAD, EOT) == (0, 1, 2)


# ---- ToyTranslation ----

@pytest.mark.parametrize("src_len,tgt_len", [(10, 10), (7, 12), (12, 5), (1, 1)])
def test_toy_layout_and_mapping_of_the_reversed_source(src_len, tgt_len):
    ds = ToyTranslation(500, src_len=src_len, tgt_len=tgt_len, vocab_size=50, seed=3, min_len=1)
    batch = ds.get(np.arange(500))
    assert_batch_layout(batch, 500, src_len, tgt_len)
    (src, tgt), _ = batch
    max_len = min(src_len, tgt_len)
    mapping = ds.mapping
    # the mapping fixes the specials and permutes the word ids
    np.testing.assert_array_equal(mapping[:3], [UNK, PAD, EOT])
    np.testing.assert_array_equal(np.sort(mapping[3:]), np.arange(3, 50))
    lengths = []
    for s, t in zip(src, tgt):
        length = int((s != PAD).sum())
        assert 1 <= length <= max_len
        assert (s[:length] >= 3).all() and (s[:length] < 50).all() and (s[length:] == PAD).all()
        np.testing.assert_array_equal(t[:length], mapping[s[:length][::-1]])
        assert (t[length:] == PAD).all()
        lengths.append(length)
    assert set(lengths) == set(range(1, max_len + 1))  # every length occurs


def test_toy_is_deterministic_and_rank_independent():
    ds = ToyTranslation(1000, seed=1)
    (s5, t5), l5 = ds.get([5])
    (s, t), lab = ds.get([3, 5, 7])
    np.testing.assert_array_equal(s5[0], s[1])
    np.testing.assert_array_equal(t5[0], t[1])
    np.testing.assert_array_equal(l5[0], lab[1])
    # another instance, another dataset size: the same samples
    (sb, tb), _ = ToyTranslation(10**9, seed=1).get([7, 3])
    np.testing.assert_array_equal(sb, s[[2, 0]])
    np.testing.assert_array_equal(tb, t[[2, 0]])
    # repeated indices repeat; another seed gives other data and another mapping
    (sr, _), _ = ds.get([7, 3, 7])
    np.testing.assert_array_equal(sr[0], sr[2])
    other = ToyTranslation(1000, seed=2)
    assert not np.array_equal(other.get([3, 5, 7])[0][0], s)
    assert not np.array_equal(other.mapping, ds.mapping)


def test_toy_ids_below_vocab_size_and_lengths_within_bounds():
    ds = ToyTranslation(10**6, src_len=8, tgt_len=6, vocab_size=20000, seed=0, min_len=3)
    (src, tgt), labels = ds.get(np.arange(0, 10**6, 97))
    for ids in (src, tgt, labels):
        assert ids.min() >= 0 and ids.max() < 20000
    lengths = (src != PAD).sum(axis=1)
    assert lengths.min() == 3 and lengths.max() == 6
    assert (src[:, 6:] == PAD).all()
    # the source tokens spread over the whole word range
    words = src[src != PAD]
    assert words.min() < 100 and words.max() > 19900


def test_toy_batch_is_made_from_its_indices_alone():
    """A batch of a dataset of 10**9 sentences is made from its 32 indices: what it allocates is batch-sized, never
    the dataset's (a timed check of this was flaky on a loaded machine; its speed is bench/'s to measure)."""
    import tracemalloc
    ds = ToyTranslation(10**9, seed=0)
    idx = np.random.default_rng(0).integers(0, 10**9, size=32)
    first = ds.get(idx)
    tracemalloc.start()
    try:
        again = ds.get(idx)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    assert all(np.array_equal(a, b) for a, b in zip(first, again))


def test_toy_bad_input():
    assert_one_line_error(lambda: ToyTranslation(0), "num_samples", "0")
    assert_one_line_error(lambda: ToyTranslation(10, vocab_size=3), "vocab_size", "3")
    assert_one_line_error(lambda: ToyTranslation(10, src_len=0), "src_len=0")
    assert_one_line_error(lambda: ToyTranslation(10, tgt_len=0), "tgt_len=0")
    assert_one_line_error(lambda: ToyTranslation(10, src_len=4, min_len=5), "min_len", "5", "4")
    assert_one_line_error(lambda: ToyTranslation(10, min_len=0), "min_len", "0")
    assert_one_line_error(lambda: ToyTranslation(10, seed=-1), "seed", "-1")
    assert_one_line_error(lambda: ToyTranslation(10).get([10]), "10")
    assert_one_line_error(lambda: ToyTranslation(10).get([-1]), "-1")


# ---- TextTranslation and write_pairs ----

PAIRS = [("the cat sat", "le chat assis"),
         ("the dog sat down", "le chien assis"),
         ("a cat", "un chat"),
         ("the end", "la fin fin")]


def test_text_vocabulary_and_ids(tmp_path):
    path = tmp_path / "pairs.txt"
    write_pairs(path, PAIRS)
    assert path.read_text(encoding="utf-8").splitlines()[0] == "the cat sat\tle chat assis"
    ds = TextTranslation(path, src_len=5, tgt_len=4)
    assert len(ds) == 4
    # most common first, ties in first-seen order, after the three specials
    assert list(ds.src_vocab) == ["UNK", "PAD", "EOT", "the", "cat", "sat", "dog", "down", "a", "end"]
    assert list(ds.src_vocab.values()) == list(range(10))
    # le(2) chat(2) assis(2) fin(2), then the words seen once
    assert list(ds.tgt_vocab)[3:] == ["le", "chat", "assis", "fin", "chien", "un", "la"]
    batch = ds.get([0, 1, 2, 3])
    assert_batch_layout(batch, 4, 5, 4)
    (src, tgt), labels = batch
    np.testing.assert_array_equal(src, [[3, 4, 5, PAD, PAD], [3, 6, 5, 7, PAD], [8, 4, PAD, PAD, PAD],
                                        [3, 9, PAD, PAD, PAD]])
    np.testing.assert_array_equal(tgt, [[3, 4, 5, PAD], [3, 7, 5, PAD], [8, 4, PAD, PAD], [9, 6, 6, PAD]])
    np.testing.assert_array_equal(labels[0], [4, 5, PAD, EOT])
    (s1, t1), l1 = ds.get([1])
    np.testing.assert_array_equal(s1[0], src[1])
    np.testing.assert_array_equal(l1[0], labels[1])


def test_text_truncates_and_caps_the_vocabulary_with_unk(tmp_path):
    path = tmp_path / "pairs.txt"
    write_pairs(path, PAIRS)
    ds = TextTranslation(path, src_len=2, tgt_len=2, vocab_size=5)
    assert ds.src_vocab == {"UNK": 0, "PAD": 1, "EOT": 2, "the": 3, "cat": 4}
    (src, tgt), labels = ds.get(np.arange(4))
    np.testing.assert_array_equal(src, [[3, 4], [3, UNK], [UNK, 4], [3, UNK]])
    np.testing.assert_array_equal(tgt, [[3, 4], [3, UNK], [UNK, 4], [UNK, UNK]])
    np.testing.assert_array_equal(labels, [[4, EOT], [UNK, EOT], [4, EOT], [UNK, EOT]])
    assert max(ds.src_vocab.values()) < 5 and max(ds.tgt_vocab.values()) < 5


def test_text_file_details(tmp_path):
    # blank lines, CRLF endings, a BOM, extra spaces and non-ASCII words are all fine
    path = tmp_path / "pairs.txt"
    path.write_bytes("\ufeffguten  Tag\tbonjour\r\n\r\n   \nschöne Grüße\t salutations \n".encode("utf-8"))
    ds = TextTranslation(path)
    assert len(ds) == 2
    assert list(ds.src_vocab)[3:] == ["guten", "Tag", "schöne", "Grüße"]
    assert list(ds.tgt_vocab)[3:] == ["bonjour", "salutations"]


def test_text_errors(tmp_path):
    path = tmp_path / "pairs.txt"
    lines = ["a b\tc d"] * 16 + ["no tab here"]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    msg = assert_one_line_error(lambda: TextTranslation(path), "malformed line 17", str(path),
                                "expected 'source<TAB>target'")
    assert msg.startswith(f"malformed line 17 in {path}: expected 'source<TAB>target'")
    path.write_text("a\tb\n\nc\td\te\n", encoding="utf-8")
    assert_one_line_error(lambda: TextTranslation(path), "malformed line 3", "2 tabs")
    path.write_text("a\tb\n  \tb\n", encoding="utf-8")
    assert_one_line_error(lambda: TextTranslation(path), "malformed line 2", "empty source")
    path.write_text("a\t \n", encoding="utf-8")
    assert_one_line_error(lambda: TextTranslation(path), "malformed line 1", "empty target")

    missing = tmp_path / "data" / "pairs.txt"
    assert_one_line_error(lambda: TextTranslation(missing), "not found", str(missing))
    assert_one_line_error(lambda: TextTranslation(tmp_path), "directory", str(tmp_path))
    path.write_bytes(b"caf\xe9\tcoffee\n")
    assert_one_line_error(lambda: TextTranslation(path), "not UTF-8", str(path), "0xe9", "offset 3")
    path.write_bytes(b"")
    assert_one_line_error(lambda: TextTranslation(path), "no source<TAB>target pairs", str(path))
    path.write_bytes(b"\n \n\n")
    assert_one_line_error(lambda: TextTranslation(path), "no source<TAB>target pairs")

    write_pairs(path, PAIRS)
    assert_one_line_error(lambda: TextTranslation(path, vocab_size=3), "vocab_size", "3")
    assert_one_line_error(lambda: TextTranslation(path, tgt_len=0), "tgt_len=0")
    assert_one_line_error(lambda: TextTranslation(path).get([4]), "4")
    assert_one_line_error(lambda: write_pairs(path, [("a\tb", "c")]), "pair 0")
    assert_one_line_error(lambda: write_pairs(path, [("a", "b"), ("", "c")]), "pair 1")


# ---- create_dataset ----

def test_create_dataset_translation(tmp_path):
    assert NAMES == ("synthetic", "mnist", "translation", "text")
    toy = create_dataset("translation", num_samples=40, seed=4, src_len=6, tgt_len=8, vocab_size=100)
    assert isinstance(toy, ToyTranslation) and len(toy) == 40 and toy.seed == 4
    assert_batch_layout(toy.get([0, 1]), 2, 6, 8)
    assert toy.get([0, 1])[0][0].max() < 100
    path = tmp_path / "pairs.txt"
    write_pairs(path, PAIRS)
    text = create_dataset("text", path, src_len=3, tgt_len=4, vocab_size=6)
    assert isinstance(text, TextTranslation) and len(text) == 4
    assert_batch_layout(text.get([2]), 1, 3, 4)
    assert len(text.src_vocab) == 6
    assert_one_line_error(lambda: create_dataset("text"), "'text'", "path")
    assert_one_line_error(lambda: create_dataset("wmt"), "wmt", "translation", "text")
