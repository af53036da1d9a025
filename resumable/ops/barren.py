"""Barren epochs: a node that keeps nothing of an endless upstream would read it for ever.

A streaming filter whose predicate drops every item, or a packer whose documents are all empty,
after ``repeat()`` or a mix with ``on_end="restart"``, would never hand out another item. Such
a node watches the record keys of what it drops in a row, and once a whole upstream epoch has
passed so, it warns, once (``BarrenEpochWarning``). Not an error: a predicate may keep rarely
or at random, and a rank's shard of a shuffled source changes with the epoch, so a later epoch
may still keep items.
"""

from __future__ import annotations

import warnings
from typing import Any

from resumable.core.keys import RecordKey, Stride
from resumable.core.node import Node
from resumable.errors import BarrenEpochWarning
from resumable.ops.mix import Mix


class BarrenEpochs:
    """The epochs, per origin, of the items dropped since the last one kept.

    Keys end in ``(epoch, index)``; after a mix they start with the component's name, and
    components run through their epochs independently, so epochs are counted per origin and an
    origin is barren only when every component the mix still chooses from is."""

    def __init__(self, upstream: Node[Any]) -> None:
        self._upstream = upstream
        self._spans: dict[RecordKey, list[int]] = {}  # origin -> [first epoch seen, latest]
        self._warned = False

    def clear(self) -> None:
        """An item was kept: the run of dropped ones is over."""
        self._spans.clear()

    def warn_once(self, key: RecordKey, message: str) -> None:
        """After dropping the item of ``key``: the first time a whole epoch has passed so, warn
        with ``message``, its ``{epoch}`` and ``{where}`` filled in (the first barren epoch, the
        mix component it belongs to). Made an error, the warning is raised again at each call
        until one returns."""
        if self._warned:
            return
        since = self.barren_since(key)
        if since is None:
            return
        epoch, where = since
        warnings.warn(BarrenEpochWarning(message.format(epoch=epoch, where=where)), stacklevel=3)
        self._warned = True

    def barren_since(self, key: RecordKey) -> tuple[int, str] | None:
        """After dropping the item of ``key``: the first epoch of which nothing was kept and a
        phrase naming its origin (a mix component), once no further epoch can keep anything."""
        origin, epoch = key[:-2], key[-2]
        span = self._spans.setdefault(origin, [epoch, epoch])
        span[1] = epoch
        if epoch <= span[0] + 1:
            return None
        names = _component_names(origin)
        mix = _mix_below(self._upstream)
        if names and mix is not None:
            barren = {_component_names(path) for path, (start, latest) in self._spans.items() if latest > start + 1}
            if not _all_barren(mix, (), barren):
                return None
        where = f" of mix component {'/'.join(map(str, names))}" if names else ""
        return span[0] + 1, where


def _mix_below(node: Node[Any] | None) -> Mix[Any] | None:
    """The mix ``node``'s items come from, through pass-through nodes, if any."""
    while node is not None and not isinstance(node, Mix):
        node = node.upstream
    return node


def _all_barren(mix: Mix[Any], prefix: RecordKey, barren: set[RecordKey]) -> bool:
    """Whether every component ``mix`` still chooses from has had a barren epoch: a component
    that is itself a mix (nested) when every one of its own has."""
    for name in mix.eligible:
        path = (*prefix, name)
        if path in barren:
            continue
        inner = _mix_below(mix.components[name])
        if inner is None or not _all_barren(inner, path, barren):
            return False
    return True


def _component_names(origin: RecordKey) -> RecordKey:
    """The mix components a key's prefix names (a shard's ``Stride`` names no component)."""
    return tuple(part for part in origin if not isinstance(part, Stride))
