"""Benchmark ``.cache()``: a second epoch reads cached records instead of re-tokenising.

    .venv/bin/python bench/bench_cache.py [--records 20000] [--words 160] [--dir /tmp/x]

The map is a tokeniser-like pure-Python function (``re.findall`` over ~``--words`` words, a
vocabulary dict lookup per word and a byte-level fallback for unknown words, into an int32
numpy array) costing ~50-100 us per record on one core. Each figure is one full pass over
``--records`` in-memory documents, end to end through the pipeline:

- no cache: ``from_list(docs).map(tokenize)``, what every epoch costs without a cache;
- disk cold: the first epoch with ``.cache(dir)`` (tokenise + write Arrow blocks, fsync'd);
- disk warm: the second epoch, sequential, then shuffled (``.cache(dir).shuffle(0)``);
- restarted: a new pipeline over the filled directory (what a restarted job sees);
- memory warm: the second epoch of ``.cache()`` (in-memory LRU).

Target: disk warm at least 5x faster than no cache.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import resumable as rs  # noqa: E402

WORD = re.compile(r"\w+|[^\w\s]")
SYLLABLES = ["ka", "lo", "mi", "tor", "en", "si", "qua", "ber", "ny", "ux", "pre", "dal"]


def make_docs(count: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    vocabulary = ["".join(rng.choices(SYLLABLES, k=rng.randint(1, 4))) for _ in range(3000)]
    docs = []
    for _ in range(count):
        n = max(1, int(rng.gauss(words, words / 4)))
        docs.append(" ".join(rng.choice(vocabulary) + ("." if rng.random() < 0.08 else "") for _ in range(n)))
    return docs


def make_tokenizer(docs: list[str]) -> Callable[[str], dict[str, Any]]:
    counts: dict[str, int] = {}
    for doc in docs[:2000]:
        for word in WORD.findall(doc):
            counts[word] = counts.get(word, 0) + 1
    vocab = {word: 256 + i for i, word in enumerate(sorted(counts, key=counts.__getitem__, reverse=True)[:4000])}

    def tokenize(text: str) -> dict[str, Any]:
        ids: list[int] = []
        for word in WORD.findall(text):
            token = vocab.get(word)
            if token is not None:
                ids.append(token)
            else:
                ids.extend(word.encode())  # byte fallback
        return {"input_ids": np.array(ids, dtype=np.int32), "num_words": len(ids)}

    return tokenize


def timed(pipe: rs.Node[Any]) -> tuple[float, int]:
    start = time.perf_counter()
    count = sum(1 for _ in pipe)
    return time.perf_counter() - start, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--words", type=int, default=160)
    parser.add_argument("--dir", default=None, help="cache directory (default: a fresh temp dir)")
    args = parser.parse_args()

    docs = make_docs(args.records, args.words)
    tokenize = make_tokenizer(docs)
    directory = args.dir or tempfile.mkdtemp(prefix="bench-cache-")
    n = len(docs)

    def row(name: str, seconds: float, base: float | None = None) -> None:
        ratio = f"{base / seconds:7.1f}x" if base else "        "
        print(f"{name:<28} {seconds * 1e3:9.1f} ms {seconds / n * 1e6:8.2f} us/record {ratio}")

    print(f"{n} records, ~{args.words} words each; cache in {directory}")
    # pyarrow initialises lazily (~0.5 s on first use): pay it outside the timings.
    timed(rs.from_list(docs[:10]).map(tokenize).cache(tempfile.mkdtemp(prefix="bench-cache-warmup-")))
    baseline, count = timed(rs.from_list(docs).map(tokenize))
    assert count == n
    row("no cache (every epoch)", baseline)

    pipe = rs.from_list(docs).map(tokenize).cache(directory)
    cold, _ = timed(pipe)
    row("disk cold (epoch 1)", cold, baseline)
    warm, _ = timed(pipe)
    row("disk warm (epoch 2)", warm, baseline)
    shuffled = rs.from_list(docs).map(tokenize).cache(directory).shuffle(0)
    warm_shuffled, _ = timed(shuffled)
    row("disk warm, shuffled", warm_shuffled, baseline)
    restarted = rs.from_list(docs).map(tokenize).cache(directory)
    restart, _ = timed(restarted)
    row("restarted job (warm dir)", restart, baseline)
    assert restarted.computed == 0, "a restarted job recomputed records"

    memory = rs.from_list(docs).map(tokenize).cache()
    timed(memory)
    memory_warm, _ = timed(memory)
    row("memory warm (epoch 2)", memory_warm, baseline)

    size = sum(os.path.getsize(os.path.join(pipe.path, f)) for f in os.listdir(pipe.path))  # type: ignore[arg-type]  # a disk cache: its path is set
    print(f"cache size on disk: {size / 1e6:.1f} MB in {len(os.listdir(pipe.path))} files")  # type: ignore[arg-type]  # a disk cache: its path is set
    ratio = baseline / warm
    print(f"second epoch speed-up with .cache(dir): {ratio:.1f}x (target >= 5x): {'PASS' if ratio >= 5 else 'FAIL'}")


if __name__ == "__main__":
    main()
