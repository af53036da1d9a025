"""resumable: checkpointable data-loading pipelines for training large models.

import resumable as rs
pipe = rs.jsonl("data/*.jsonl").shuffle(seed=0).shard().map(tokenize).batch(8)
state = pipe.get_state()   # small JSON dict; pipe.set_state(state) continues exactly

``rs.torch`` (the DataLoader side) is imported on first use, so a program that does not use it
does not load torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from resumable import nodes
from resumable.checkpoint import load_state, save_state
from resumable.core.indexed import IndexedNode
from resumable.core.node import Node
from resumable.errors import (
    BarrenEpochWarning,
    CacheWarning,
    ChunkCacheWarning,
    ConfigError,
    MapError,
    ResumableError,
    ResumableWarning,
    SidecarWarning,
    SourceError,
    StateError,
)
from resumable.ops.mix import mix
from resumable.order.topology import Topology
from resumable.sources.arrow import arrow, from_hf
from resumable.sources.jsonl import jsonl
from resumable.sources.memory import from_list
from resumable.sources.parquet import parquet
from resumable.sources.stream import jsonl_stream

__version__ = "0.1.0"

__all__ = [
    "CacheWarning",
    "ChunkCacheWarning",
    "ConfigError",
    "BarrenEpochWarning",
    "IndexedNode",
    "MapError",
    "Node",
    "ResumableError",
    "ResumableWarning",
    "SidecarWarning",
    "SourceError",
    "StateError",
    "Topology",
    "arrow",
    "from_hf",
    "from_list",
    "jsonl",
    "jsonl_stream",
    "load_state",
    "mix",
    "nodes",
    "parquet",
    "save_state",
]

LAZY_SUBMODULES = ("torch",)
"""Submodules reached as ``rs.<name>`` without an import of their own, imported on first use."""


def __getattr__(name: str) -> Any:
    if name in LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")  # also sets it as an attribute here
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
