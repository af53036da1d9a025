"""``resumable.sources.remote.glob_regex``: an ``s3://`` glob selects, among a bucket's listed
keys, exactly the files the same glob selects over a local copy (``glob.glob(pattern,
recursive=True)``), odd names and escaped patterns included, and compiles without warnings."""

from __future__ import annotations

import glob
import os
import warnings
from pathlib import Path

import pytest

from resumable.sources.remote import glob_regex

TREE = [
    "p/a.jsonl",
    "p/b.jsonl",
    "p/.hidden.jsonl",
    "p/x[1].jsonl",
    "p/^.jsonl",
    "p/-.jsonl",
    "p/!.jsonl",
    "p/sp ace.jsonl",
    "p/sub/c.jsonl",
    "p/sub/.h/e.jsonl",
    "p/sub/deeper/d.jsonl",
    "p/.git/f.jsonl",
]
PATTERNS = [
    "p/*.jsonl",
    "p/**/*.jsonl",
    "p/**",
    "p/*/*.jsonl",
    "p/sub/*/d.jsonl",
    "p/?.jsonl",
    "p/[ab].jsonl",
    "p/[!a].jsonl",
    "p/[a-c].jsonl",
    "p/[^a].jsonl",
    "p/[-].jsonl",
    "p/[!!].jsonl",
    "p/.*.jsonl",
    "p/*[*",
    glob.escape("p/x[1].jsonl"),
    glob.escape("p/sp ace.jsonl"),
]


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tree")
    for name in TREE:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("{}\n")
    return root


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_remote_glob_selects_what_the_local_glob_selects(tree: Path, pattern: str) -> None:
    local = sorted(
        os.path.relpath(match, tree)
        for match in glob.glob(os.path.join(glob.escape(str(tree)), pattern), recursive=True)
        if os.path.isfile(match)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a class holding '[' once warned of a nested set
        wanted = glob_regex(pattern)
    assert sorted(name for name in TREE if wanted.fullmatch(name)) == local
