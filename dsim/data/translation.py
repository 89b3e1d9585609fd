"""Translation data for the distributed Transformer page: a toy task made on demand, or a text file.

Token ids follow the page's sample tokenizer: UNK=0, PAD=1, EOT=2, then words from 3 on, most common
first. A batch is ((src_ids, tgt_ids), labels), all int64, padded with PAD and truncated to the
lengths; labels are tgt_ids shifted left by one with EOT appended, exactly as the sample does.
"""
from __future__ import annotations

import os
from collections import Counter

import numpy as np

from .errors import DatasetError

UNK, PAD, EOT = 0, 1, 2
SPECIALS = {"UNK": UNK, "PAD": PAD, "EOT": EOT}
FIRST_WORD = 3            # id of the most common word
_MAPPING_TAG = 0x7A4B1    # separate the token-mapping stream from the per-sample hashes
_SAMPLE_TAG = 0x7A4B2
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def shift_labels(tgt_ids: np.ndarray) -> np.ndarray:
    """Labels of decoder inputs (n, tgt_len): tgt_ids shifted left by one, EOT in the last column."""
    labels = np.empty_like(tgt_ids)
    labels[:, :-1] = tgt_ids[:, 1:]
    labels[:, -1] = EOT
    return labels


def _check_sizes(src_len, tgt_len, vocab_size) -> tuple[int, int, int]:
    """The three sizes as ints, or a DatasetError naming the bad one."""
    if int(src_len) < 1 or int(tgt_len) < 1:
        raise DatasetError(f"sequence lengths must be >= 1, got src_len={src_len}, tgt_len={tgt_len}")
    if int(vocab_size) < FIRST_WORD + 1:
        raise DatasetError(f"vocab_size must be >= {FIRST_WORD + 1} (3 special ids and a word), "
                           f"got {vocab_size}")
    return int(src_len), int(tgt_len), int(vocab_size)


def _check_indices(indices, n: int) -> np.ndarray:
    """indices as a flat int64 array, every one in [0, n)."""
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise DatasetError(f"sample index out of range [0, {n}): {idx[(idx < 0) | (idx >= n)][0]}")
    return idx


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on a uint64 array: a cheap, well-spread hash (wraps mod 2**64)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class ToyTranslation:
    """Sample i: L random tokens (L in [min_len, min(src_len, tgt_len)]); its target maps the
    reversed source through one fixed permutation of the word ids. Made on demand from (seed, i)."""

    def __init__(self, num_samples: int, src_len: int = 10, tgt_len: int = 10, vocab_size: int = 20000,
                 seed: int = 0, min_len: int = 3):
        if int(num_samples) < 1:
            raise DatasetError(f"translation dataset needs num_samples >= 1, got {num_samples}")
        if int(seed) < 0:
            raise DatasetError(f"translation dataset needs seed >= 0, got {seed}")
        self.src_len, self.tgt_len, self.vocab_size = _check_sizes(src_len, tgt_len, vocab_size)
        self.max_len = min(self.src_len, self.tgt_len)
        if not 1 <= int(min_len) <= self.max_len:
            raise DatasetError(f"min_len must be in [1, min(src_len, tgt_len)] = [1, {self.max_len}], "
                               f"got {min_len}")
        self.num_samples, self.seed, self.min_len = int(num_samples), int(seed), int(min_len)
        # the specials map to themselves, the words through one permutation the seed draws
        words = np.random.default_rng([self.seed, _MAPPING_TAG]).permutation(self.vocab_size - FIRST_WORD)
        self.mapping = np.concatenate([np.arange(FIRST_WORD), words + FIRST_WORD]).astype(np.int64)
        self._key = _mix(_mix(np.array([self.seed], dtype=np.uint64) + _GOLDEN) ^ np.uint64(_SAMPLE_TAG))[0]

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        return (f"ToyTranslation(num_samples={self.num_samples}, src_len={self.src_len}, "
                f"tgt_len={self.tgt_len}, vocab_size={self.vocab_size}, seed={self.seed}, "
                f"min_len={self.min_len})")

    def tokens(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """Lengths (n,) and source tokens (n, max_len) of samples `indices` (tokens past L unused)."""
        idx = _check_indices(indices, self.num_samples)
        # sample i is a pure function of (seed, i): hashes of (key, i, column), no shared generator
        stream = _mix(self._key ^ _mix(idx.astype(np.uint64) + _GOLDEN))
        cols = np.arange(1, self.max_len + 2, dtype=np.uint64) * _GOLDEN
        words = _mix(stream[:, None] + cols)  # column 0 draws the length, the others the tokens
        span = np.uint64(self.max_len - self.min_len + 1)
        lengths = (words[:, 0] % span).astype(np.int64) + self.min_len
        tokens = (words[:, 1:] % np.uint64(self.vocab_size - FIRST_WORD)).astype(np.int64) + FIRST_WORD
        return lengths, tokens

    def get(self, indices) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
        """((src_ids (n, src_len), tgt_ids (n, tgt_len)), labels (n, tgt_len)), int64, PAD-padded."""
        lengths, tokens = self.tokens(indices)
        n, cols = len(lengths), np.arange(self.max_len)
        inside = cols < lengths[:, None]
        # target column j holds source token L-1-j, mapped
        rev = np.take_along_axis(tokens, np.maximum(lengths[:, None] - 1 - cols, 0), axis=1)
        src = np.full((n, self.src_len), PAD, dtype=np.int64)
        tgt = np.full((n, self.tgt_len), PAD, dtype=np.int64)
        src[:, :self.max_len] = np.where(inside, tokens, PAD)
        tgt[:, :self.max_len] = np.where(inside, self.mapping[rev], PAD)
        return (src, tgt), shift_labels(tgt)


def build_vocab(sentences, vocab_size: int) -> dict[str, int]:
    """word -> id: the specials, then the words of `sentences` (token lists) most common first
    (ties: first seen first), only as many as have ids < vocab_size."""
    counts = Counter(word for words in sentences for word in words)
    vocab = dict(SPECIALS)
    for word, _ in counts.most_common():  # most_common is stable: ties keep first-seen order
        if len(vocab) >= vocab_size:
            break
        vocab.setdefault(word, len(vocab))
    return vocab


def encode(sentences, vocab: dict[str, int], length: int) -> np.ndarray:
    """Token lists as ids (n, length): unknown words UNK, PAD after the end, truncated to length."""
    ids = np.full((len(sentences), length), PAD, dtype=np.int64)
    for k, words in enumerate(sentences):
        row = [vocab.get(word, UNK) for word in words[:length]]
        ids[k, :len(row)] = row
    return ids


def read_pairs(path: str) -> list[tuple[list[str], list[str]]]:
    """The (source words, target words) of each non-blank `source<TAB>target` line of path."""
    if not os.path.exists(path):
        raise DatasetError(f"translation file not found: {path}")
    if os.path.isdir(path):
        raise DatasetError(f"translation path is a directory, not a file: {path}")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise DatasetError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path} is not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start}") from None
    pairs = []
    # split on newlines only: str.splitlines would also break on form feeds and the like
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.rstrip("\r")
        if not line.strip():
            continue
        sides = line.split("\t")
        words = [side.split() for side in sides]
        if len(sides) != 2 or not all(words):
            why = (f"{len(sides) - 1} tabs" if len(sides) != 2
                   else "empty source" if not words[0] else "empty target")
            raise DatasetError(f"malformed line {number} in {path}: expected 'source<TAB>target' ({why})")
        pairs.append((words[0], words[1]))
    if not pairs:
        raise DatasetError(f"no source<TAB>target pairs in {path}")
    return pairs


class TextTranslation:
    """Sentence pairs from a `source<TAB>target` text file, whitespace-tokenized, one vocabulary
    per side built from the file itself."""

    def __init__(self, path, src_len: int = 10, tgt_len: int = 10, vocab_size: int = 20000):
        self.path = os.fspath(path)
        self.src_len, self.tgt_len, self.vocab_size = _check_sizes(src_len, tgt_len, vocab_size)
        pairs = read_pairs(self.path)
        sources, targets = [s for s, _ in pairs], [t for _, t in pairs]
        self.src_vocab = build_vocab(sources, self.vocab_size)
        self.tgt_vocab = build_vocab(targets, self.vocab_size)
        self._src = encode(sources, self.src_vocab, self.src_len)
        self._tgt = encode(targets, self.tgt_vocab, self.tgt_len)

    def __len__(self) -> int:
        return len(self._src)

    def __repr__(self) -> str:
        return (f"TextTranslation({self.path!r}, n={len(self)}, src_vocab={len(self.src_vocab)}, "
                f"tgt_vocab={len(self.tgt_vocab)})")

    def get(self, indices) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
        """((src_ids (n, src_len), tgt_ids (n, tgt_len)), labels (n, tgt_len)), int64, PAD-padded."""
        idx = _check_indices(indices, len(self))
        tgt = self._tgt[idx]
        return (self._src[idx], tgt), shift_labels(tgt)


def write_pairs(path, pairs) -> None:
    """Write (source, target) sentence pairs to path, one `source<TAB>target` line each, UTF-8."""
    path = os.fspath(path)
    lines = []
    for k, (src, tgt) in enumerate(pairs):
        for side in (src, tgt):
            if not str(side).strip() or any(c in str(side) for c in "\t\r\n"):
                raise DatasetError(f"write_pairs {path}: pair {k} has an empty side or a tab/newline "
                                   f"in {side!r}")
        lines.append(f"{src}\t{tgt}\n")
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.writelines(lines)
