"""Every node's constructor, for building pipelines without the fluent methods."""

from resumable.core.indexed import IndexedNode
from resumable.core.node import Node
from resumable.errors import MapError
from resumable.ops.batch import Batch
from resumable.ops.cache import Cache
from resumable.ops.even import Even
from resumable.ops.filter import Filter
from resumable.ops.indexed_filter import IndexedFilter
from resumable.ops.map import IndexedMap, Map
from resumable.ops.mix import Mix
from resumable.ops.parallel_map import ParallelMap
from resumable.ops.prefetch import Prefetch
from resumable.ops.repeat import Repeat
from resumable.order.block_shuffle import BlockShuffle
from resumable.order.shard import Shard
from resumable.order.shuffle import Shuffle
from resumable.pack.node import Pack
from resumable.sources.arrow import ArrowSource, HfSource
from resumable.sources.jsonl import JsonlSource
from resumable.sources.memory import FromList
from resumable.sources.parquet import ParquetSource
from resumable.sources.source import Source
from resumable.sources.stream import JsonlStream

__all__ = [
    "ArrowSource",
    "Batch",
    "BlockShuffle",
    "Cache",
    "Even",
    "Filter",
    "FromList",
    "HfSource",
    "IndexedFilter",
    "IndexedMap",
    "IndexedNode",
    "JsonlSource",
    "JsonlStream",
    "Map",
    "MapError",
    "Mix",
    "Node",
    "Pack",
    "ParallelMap",
    "ParquetSource",
    "Prefetch",
    "Repeat",
    "Shard",
    "Shuffle",
    "Source",
]
