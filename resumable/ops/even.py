"""Even: every rank yields the same number of items per epoch, agreed once per epoch.

Packers and filters give each rank a different number of rows per epoch, so without this one
rank ends its epoch early and the next collective call of the training loop hangs. ``Even``
runs the epochs of its upstream itself and cuts this rank's continuous stream over them into
even-epochs: even-epoch ``k`` yields ``Q_k = min over ranks of (carry_r + n_r(k))`` items,
where ``n_r(k)`` is ``len(upstream)`` for upstream epoch ``k`` on rank ``r`` and ``carry_r``
the items of earlier upstream epochs rank ``r`` has counted but not yielded. Items beyond
``Q_k`` are carried into the next even-epoch, never dropped; ``leftover`` reports the carry.

The ranks agree with one ``all_reduce(MIN)`` per even-epoch, at its first item, which every
rank reaches at the same step; none while ``torch.distributed`` is not initialised.
"""

from __future__ import annotations

import sys
from typing import Any

from resumable.core.indexed import IndexedNode
from resumable.core.node import Node
from resumable.core.state import INT64_MAX, is_count, require, require_count
from resumable.errors import ConfigError, SourceError, StateError
from resumable.ops.batch import Batch
from resumable.ops.map import Map
from resumable.ops.mix import Mix
from resumable.ops.read_ahead import ReadAhead
from resumable.ops.repeat import Repeat
from resumable.order.topology import distributed_rank
from resumable.pack.node import Pack

TIMES = "times"
EPOCH = "epoch"
YIELDED = "yielded"
QUOTA = "quota"
CARRY = "carry"
COUNTED = "counted_epochs"
STARTED = "started_epochs"


def agree_min(offer: int, group: Any = None) -> int:
    """The smallest ``offer`` over the ranks of ``group`` (one ``all_reduce(MIN)``), or
    ``offer`` itself when ``torch.distributed`` is not initialised (a single rank).

    The tensor is a CPU int64 (gloo); on an NCCL group it lives on the current CUDA device."""
    torch = sys.modules.get("torch")  # no process group can exist before torch is imported
    if torch is None:
        return offer
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return offer
    tensor = torch.tensor([offer], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return int(tensor.item())


def unknown_length(upstream: Node[Any]) -> TypeError | None:
    """The TypeError that ``len(upstream)`` raises when no epoch's length can be known, told
    from the pipeline's structure without reading data; None when every epoch's is known.

    Known lengths come from indexed nodes, from nodes that take their upstream's (map,
    read-ahead, batch), from whole-epoch plans (``Pack`` without ``buffer_size``) and from a
    mix that drops exhausted components; any other node's length hook raises at once."""
    for node in upstream._subtree():
        if isinstance(node, (IndexedNode, Map, ReadAhead, Batch)):
            continue
        if (isinstance(node, Pack) and node.buffer_size is None) or (isinstance(node, Mix) and node.on_end == "drop"):
            continue
        try:
            node._known_length()
        except TypeError as error:
            return error
    return None


def collective_device(group: Any = None) -> Any:
    """Where a collective's tensor must live in ``group``: the current CUDA device under NCCL,
    else the CPU (gloo)."""
    torch = sys.modules["torch"]
    if torch.distributed.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Even(Node[Any]):
    """Yield the same number of items on every rank in each epoch, carrying the surplus over.

    Place it last (after ``.batch()``): it runs its upstream's epochs itself, like
    ``.repeat()`` (a ``Repeat`` below it is refused), so each of its epochs takes the rest of
    the previous upstream epoch's surplus first, then the next upstream epoch. The upstream's
    ``len()`` must be known (sources, shuffle, shard, whole-epoch ``bfd`` packing, ``batch``
    over those). ``times`` ends the run after that many epochs; ``leftover`` is then the items
    this rank never yielded. ``group`` is the process group to agree in (default: the world).

    Each epoch ends with StopIteration, at the same step on every rank; iterating again starts
    the next one. An epoch of zero items (a rank had nothing left) is empty on every rank.
    Inside a DataLoader worker of a multi-rank job it refuses to run: workers cannot join a
    collective; use it with ``num_workers=0`` per rank.
    """

    kind = "Even"

    upstream: Node[Any]

    def __init__(self, upstream: Node[Any], times: int | None = None, group: Any = None) -> None:
        super().__init__(upstream)
        if times is not None and (isinstance(times, bool) or not isinstance(times, int) or times <= 0):
            raise ConfigError(f"{self.kind}: times must be a positive int or None, got {times!r}")
        if any(isinstance(node, (Repeat, Even)) for node in upstream._subtree()):
            raise ConfigError(
                f"{self.kind}: its upstream {upstream!r} repeats already (a Repeat or an Even); drop it: "
                ".even(times) runs the upstream's epochs itself and goes last"
            )
        unknown = unknown_length(upstream)
        if unknown is not None:
            raise ConfigError(
                f"{self.kind}: needs the number of items of each upstream epoch, but len() is unknown ({unknown}); "
                "balance an upstream of known length (indexed sources and filters, shuffle, shard, "
                "strategy='bfd' packing, batch over those)"
            )
        self.times = times
        self.group = group
        self.epoch = 0
        self._yielded = 0
        self._quota: int | None = None
        self._carry = 0
        self._counted = 0  # upstream epochs whose length is counted
        self._started = 1  # upstream epochs entered (the upstream starts inside its first)

    @property
    def leftover(self) -> int:
        """Items of the upstream epochs counted so far that this rank has not yielded and will
        not yield in the current epoch: at the end of a run, what it never yielded."""
        return self._carry

    @property
    def quota(self) -> int | None:
        """Items of the current epoch on every rank; None before its first item."""
        return self._quota

    def _config(self) -> dict[str, Any]:
        return {TIMES: self.times}

    # -- iteration ----------------------------------------------------------------------------

    def _next(self) -> Any:
        quota = self._quota
        if quota is None:
            if self.times is not None and self.epoch >= self.times:
                raise StopIteration
            quota = self._agree()
        if self._yielded >= quota:
            raise StopIteration
        upstream = self.upstream
        while True:
            try:
                item = next(upstream)
            except StopIteration:
                if self._started >= self._counted:
                    raise SourceError(
                        f"{self.kind}: {upstream!r} ended after fewer items than its len() said"
                    ) from None
                upstream.next_epoch()
                self._started += 1
                continue
            self._yielded += 1
            return item

    def _agree(self) -> int:
        """Count the next upstream epoch and agree with the other ranks on this epoch's size."""
        self._refuse_dataloader_worker()
        offer = self._carry + self._next_length()
        quota = agree_min(offer, self.group)
        if quota > offer:
            raise StateError(f"{self.kind}: the ranks agreed on {quota} items, this rank has only {offer}")
        self._counted += 1
        self._carry = offer - quota
        self._quota = quota
        return quota

    def _next_length(self) -> int:
        """Items of the first upstream epoch not counted yet. When it lies beyond the one being
        read (surplus still to yield), the upstream visits it and comes back through its state."""
        upstream = self.upstream
        if self._counted < self._started:  # the one being read: at the start, after a rescale
            return len(upstream)
        if self._carry == 0:  # every counted item was yielded: the epoch being read is done
            upstream.next_epoch()
            self._started += 1
            return len(upstream)
        saved = upstream.get_state()
        for _ in range(self._counted - self._started + 1):
            upstream.next_epoch()
        length = len(upstream)
        upstream.set_state(saved)
        return length

    def _refuse_dataloader_worker(self) -> None:
        torch = sys.modules.get("torch")
        if torch is None or torch.utils.data.get_worker_info() is None:
            return
        if distributed_rank()[1] > 1:
            raise ConfigError(
                f"{self.kind}: runs inside a DataLoader worker of a multi-rank job, where it cannot agree with "
                "the other ranks (workers cannot join a collective); use it with num_workers=0 on every rank"
            )

    # -- epochs and state ---------------------------------------------------------------------

    def _begin_epoch(self, epoch: int | None) -> None:
        """The next even-epoch (numbered ``epoch`` when given), continuing the upstream's stream;
        before anything was counted, the upstream starts ``epoch`` as any node would."""
        if self._quota is None and self._counted == 0 and self._started == 1:
            self.upstream._begin_epoch(epoch)
        elif self._quota is not None:  # an epoch left before its end keeps its rest for the next
            self._carry += self._quota - self._yielded
        self.epoch = self.epoch + 1 if epoch is None else epoch
        self._yielded = 0
        self._quota = None
        self._ended = False

    def _progress(self) -> dict[str, Any]:
        return {
            EPOCH: self.epoch,
            YIELDED: self._yielded,
            QUOTA: self._quota,
            CARRY: self._carry,
            COUNTED: self._counted,
            STARTED: self._started,
        }

    def _restore(self, state: dict[str, Any], path: str) -> None:
        quota = require(state, QUOTA, (int, type(None)), path)
        if quota is not None and not is_count(quota):  # counts go through an int64 all_reduce
            raise StateError(f"{path}: state entry {QUOTA!r} is {quota!r}, expected an int in [0, {INT64_MAX}] or None")
        yielded = require_count(state, YIELDED, path, upper=quota or 0)
        carry = require_count(state, CARRY, path, upper=INT64_MAX)
        started, counted = require_count(state, STARTED, path), require_count(state, COUNTED, path)
        if counted + 1 < started:
            raise StateError(f"{path}: state has {STARTED}={started} but {COUNTED}={counted}")
        # Upstream epochs counted ahead of the one being read hold items still owed (the carry and
        # the rest of the quota); more of them is a damaged state, and each would be a next_epoch().
        owed = carry + (quota or 0) - yielded
        if counted - started > owed:
            raise StateError(
                f"{path}: state has {COUNTED}={counted} upstream epochs counted, {counted - started} ahead of "
                f"{STARTED}={started}, but only {owed} items owed ({CARRY}={carry}, {QUOTA}={quota}, "
                f"{YIELDED}={yielded})"
            )
        self.epoch = require_count(state, EPOCH, path)
        self._quota, self._yielded = quota, yielded
        self._carry = carry
        self._counted, self._started = counted, started

    def _rescale(self, olds: list[dict[str, Any]], path: str, consumer: int, num_consumers: int) -> dict[str, Any]:
        """A fresh agreement on the new ranks in the old ranks' epoch: the rescaled upstream's
        length is what remains for this consumer, so nothing is counted or carried yet. An
        epoch every old rank had finished stays finished."""
        state = self._fresh_rescaled(olds, path)
        epochs = {require_count(old, EPOCH, path) for old in olds}
        if len(epochs) != 1:
            raise StateError(
                f"{path}: old ranks were in different epochs {sorted(epochs)}; they come from different steps"
            )
        quotas = [require(old, QUOTA, (int, type(None)), path) for old in olds]
        finished = all(
            quota is not None and require_count(old, YIELDED, path) >= quota for old, quota in zip(olds, quotas)
        )
        state.update(
            {
                EPOCH: epochs.pop(),
                YIELDED: 0,
                QUOTA: 0 if finished else None,
                CARRY: 0,
                COUNTED: 0,
                STARTED: 1,
            }
        )
        return state
