"""Synthetic JSONL corpora for benchmarks: ``{"id": i, "text": "..."}`` lines of Zipf-distributed
words with log-normal document lengths, generated with numpy (no per-word Python work)."""

from __future__ import annotations

import os

import numpy as np
import numpy.typing as npt

WORDS_MU = 6.5
"""Log-normal document length in words: median exp(6.5) ~ 665 words, mean ~ 1100 (~ 6.5 KB)."""
WORDS_SIGMA = 1.0
VOCAB_SIZE = 30_000
ZIPF_EXPONENT = 1.1
WORD_LENGTHS = (2, 12)
"""Range of generated word lengths in letters; frequent words get the short ones."""
SPECIAL_WORDS = (
    b"\\n\\n",  # a JSON-escaped paragraph break
    b'\\"quoted\\"',
    b"caf\xc3\xa9",  # UTF-8, as written by ensure_ascii=False
    b"\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e",
    b"na\\u00efve",
    b"1,234.5",
)
"""Tokens that make the text look like real JSONL: escapes and multi-byte UTF-8, all valid JSON."""
SPECIAL_RANKS = 20
"""Rank of the first special word: frequent enough to show up in every document."""
BATCH_BYTES = 8 << 20
"""Text generated per vectorised step; bounds the temporary index arrays to ~8x that."""


def make_jsonl_corpus(path: str, target_bytes: int, seed: int = 0) -> str:
    """Write a JSONL corpus of at least ``target_bytes`` bytes at ``path`` and return ``path``.

    Deterministic for a given (``target_bytes``, ``seed``). An existing file of at least
    ``target_bytes`` is reused as is; a new one is written to a temp name and renamed, so a
    killed run never leaves a truncated corpus that later runs would reuse.
    """
    if os.path.exists(path) and os.path.getsize(path) >= target_bytes:
        return path
    rng = np.random.default_rng(seed)
    pool, word_offsets, word_lengths = _vocabulary(rng)
    probabilities = 1.0 / np.arange(1, VOCAB_SIZE + 1) ** ZIPF_EXPONENT
    probabilities /= probabilities.sum()
    mean_word_bytes = float((probabilities * word_lengths).sum())
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temp = f"{path}.{os.getpid()}.tmp"
    written = 0
    next_id = 0
    try:
        with open(temp, "wb") as out:
            while written < target_bytes:
                docs = max(1, int(BATCH_BYTES / (mean_word_bytes * np.exp(WORDS_MU + WORDS_SIGMA**2 / 2))))
                counts = np.maximum(1, np.rint(rng.lognormal(WORDS_MU, WORDS_SIGMA, docs))).astype(np.int64)
                words = rng.choice(VOCAB_SIZE, size=int(counts.sum()), p=probabilities)
                text, word_ends = _join_words(pool, word_offsets, word_lengths, words)
                doc_ends = word_ends[np.cumsum(counts) - 1]
                doc_starts = np.concatenate(([0], doc_ends[:-1] + 1))
                lines = []
                for start, end in zip(doc_starts.tolist(), doc_ends.tolist(), strict=True):
                    lines.append(b'{"id": %d, "text": "%s"}\n' % (next_id, text[start:end]))
                    next_id += 1
                    written += len(lines[-1])
                    if written >= target_bytes:
                        break
                out.write(b"".join(lines))
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise
    return path


def _vocabulary(rng: np.random.Generator) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Random lowercase words (shortest for the most frequent ranks) plus the special words.

    Returns the words concatenated, each followed by a space, with their offsets and lengths.
    """
    lengths = np.sort(rng.integers(WORD_LENGTHS[0], WORD_LENGTHS[1] + 1, VOCAB_SIZE))
    letters = rng.integers(ord("a"), ord("z") + 1, int(lengths.sum()), dtype=np.uint8)
    words = np.split(letters, np.cumsum(lengths)[:-1])
    encoded = [word.tobytes() for word in words]
    encoded[SPECIAL_RANKS : SPECIAL_RANKS + len(SPECIAL_WORDS)] = SPECIAL_WORDS
    word_lengths = np.array([len(word) for word in encoded], dtype=np.int64)
    pool = np.frombuffer(b" ".join(encoded) + b" ", dtype=np.uint8)
    word_offsets = np.concatenate(([0], np.cumsum(word_lengths + 1)[:-1]))
    return pool, word_offsets, word_lengths


def _join_words(
    pool: npt.NDArray[np.uint8],
    word_offsets: npt.NDArray[np.int64],
    word_lengths: npt.NDArray[np.int64],
    words: npt.NDArray[np.int64],
) -> tuple[bytes, npt.NDArray[np.int64]]:
    """The words, space-separated, as bytes, and the end offset of each word in them (one gather)."""
    spans = word_lengths[words] + 1  # the word and its trailing space
    ends = np.cumsum(spans)
    shift = np.repeat(word_offsets[words] - (ends - spans), spans)
    text = pool[np.arange(int(ends[-1]), dtype=np.int64) + shift]
    return text.tobytes(), ends - 1
