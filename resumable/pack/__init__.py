"""Sequence packing: documents' token ids into fixed-length rows for LLM training.

    pipe = rs.from_list(docs).shuffle(0).pack(2048, strategy="best_fit").batch(8, collate_fn=collate_rows)

See ``Pack`` for the options, ``resumable.pack.rows`` for the output format and
``resumable.pack.strategies`` for the bin-packing algorithms.
"""

from resumable.pack._buffered import expand_references
from resumable.pack.node import Pack, PackStats
from resumable.pack.rows import IGNORE_INDEX, collate_rows

__all__ = ["IGNORE_INDEX", "Pack", "PackStats", "collate_rows", "expand_references"]
