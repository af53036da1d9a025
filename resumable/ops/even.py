"""Even: every rank yields the same number of items per epoch, agreed once per epoch.

Packers and filters give each rank a different number of rows per epoch, so without this one
rank ends its epoch early and the next collective call of the training loop hangs. ``Even``
runs the epochs of its upstream itself and cuts this rank's continuous stream over them into
even-epochs: even-epoch ``k`` yields ``Q_k = min over ranks of (carry_r + n_r(k))`` items,
where ``n_r(k)`` is ``len(upstream)`` for upstream epoch ``k`` on rank ``r`` and ``carry_r``
the items of earlier upstream epochs rank ``r`` has counted but not yielded. Items beyond
``Q_k`` are carried into the next even-epoch, never dropped; ``leftover`` reports the carry.

The ranks agree with one ``all_reduce(MIN)`` per even-epoch, at its first item, which every
rank reaches at the same step; none while ``torch.distributed`` is not initialised. Inside
DataLoader workers, which cannot join a collective, every consumer (rank ``r``, worker ``w``)
offers through the process group's key-value store instead and all take the minimum over all
``world_size * num_workers`` consumers (``store_min``), so every rank yields ``num_workers * Q``.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from itertools import count
from typing import Any

from resumable.core.indexed import IndexedNode
from resumable.core.node import Node
from resumable.core.options import int_option
from resumable.core.state import INT64_MAX, epoch_after, is_count, require, require_count, require_epoch
from resumable.errors import ConfigError, SourceError, StateError
from resumable.ops.batch import Batch
from resumable.ops.map import Map
from resumable.ops.mix import Mix
from resumable.ops.read_ahead import ReadAhead
from resumable.ops.repeat import Repeat
from resumable.order.topology import dataloader_worker, distributed_rank
from resumable.pack.node import Pack

TIMES = "times"
EPOCH = "epoch"
YIELDED = "yielded"
QUOTA = "quota"
CARRY = "carry"
COUNTED = "counted_epochs"
STARTED = "started_epochs"

# Store keys: NAMESPACE_ROOT/<restart>/<dataset>/<epoch>/<consumers>/<consumer> (see store_min).
NAMESPACE_ROOT = "resumable/even"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"  # torchrun's attempt: restarted jobs keep the agent's store

_datasets = count()  # datasets built in this process: the same sequence on every rank


@dataclass(frozen=True)
class StoreRef:
    """Where DataLoader workers agree: the TCPStore behind the process group (host, port, the
    group's timeout) and a key prefix of the dataset their rank built."""

    host: str
    port: int
    timeout_s: float
    namespace: str


# In a DataLoader worker: the store its parent handed down (see inherit_store).
_inherited_store: StoreRef | None = None


def new_namespace() -> str:
    """A key prefix for one dataset: ranks build their datasets in the same order, so the
    n-th of every rank gets the same one, and a torchrun restart gets fresh ones."""
    return f"{NAMESPACE_ROOT}/{os.environ.get(RESTART_COUNT, '0')}/{next(_datasets)}"


def default_store() -> tuple[str, int, float] | None:
    """``(host, port, timeout in seconds)`` of the TCPStore behind the default process group,
    or None without one (torch.distributed not initialised, or another kind of store).

    torch has no public accessor for the default group's store: this is the one use of its
    private ``_get_default_store`` (torch 2.x); ``underlying_store`` unwraps its prefixes."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    store = dist.distributed_c10d._get_default_store()
    timeout = store.timeout
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        return None
    return str(store.host), int(store.port), float(timeout.total_seconds())


def inherit_store(store: StoreRef | None) -> None:
    """Record, in a DataLoader worker, the store its parent process agrees through."""
    global _inherited_store
    _inherited_store = store


def store_min(offer: int, store: StoreRef, epoch: int, consumer: int, consumers: int) -> int:
    """The smallest ``offer`` over ``consumers`` consumers: set key
    ``<namespace>/<epoch>/<consumers>/<consumer>``, wait for every consumer's, take the minimum.

    One connection and a few round trips per call. Offers are a function of the state at the
    start of the epoch, so agreeing an epoch again (a restore before its agreement) finds the
    same keys and the same minimum."""
    dist = sys.modules["torch"].distributed
    timeout = timedelta(seconds=store.timeout_s)
    client = dist.TCPStore(store.host, store.port, is_master=False, timeout=timeout, wait_for_workers=False)
    keys = [f"{store.namespace}/{epoch}/{consumers}/{c}" for c in range(consumers)]
    client.set(keys[consumer], str(offer))
    client.wait(keys, timeout)
    return min(int(value) for value in client.multi_get(keys))


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
    Inside DataLoader workers (``rs.torch.Loader``, ``PipelineDataset``) every worker of every
    rank agrees through the process group's store (``store_min``) on one count for all;
    ``group`` then does not apply.
    """

    kind = "Even"

    upstream: Node[Any]

    def __init__(self, upstream: Node[Any], times: int | None = None, group: Any = None) -> None:
        super().__init__(upstream)
        times = int_option(self.kind, TIMES, times, optional=True)
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
        self._rejoin = False  # restored after this epoch's agreement: take part in it once more

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

    def _why_short(self) -> str:
        """What an upstream that ended short holds that makes its ``len()`` an upper bound."""
        skipping = [node for node in self.upstream._subtree() if getattr(node, "skips_malformed", False)]
        if not skipping:
            return ""
        return (
            f": {skipping[0]!r} skips malformed records (on_error='skip'), which its len() counts; .even() needs the "
            "length an epoch yields, so read it with on_error='raise', or index what parses once with "
            ".filter(predicate, index=True) right after it (its len() is exact)"
        )

    def _next(self) -> Any:
        quota = self._quota
        if quota is None:
            if self.times is not None and self.epoch >= self.times:
                raise StopIteration
            quota = self._agree()
        elif self._rejoin:
            self._rejoin = False
            self._agree_min(self._carry + quota)  # the offer it made: carry is offer - quota until the epoch ends
        if self._yielded >= quota:
            raise StopIteration
        upstream = self.upstream
        while True:
            before = upstream._mark()  # one per item of .even(), which goes last: per batch
            try:
                item = next(upstream)
            except StopIteration:
                if self._started >= self._counted:
                    raise SourceError(
                        f"{self.kind}: {upstream!r} ended after fewer items than its len() said{self._why_short()}"
                    ) from None
                upstream.next_epoch()
                self._started += 1
                continue
            except Exception:
                # An error at its item (a map's, a collate function's) moved the upstream on: the
                # item is gone, as without .even(), and counts against the quota, so the epoch
                # still ends at the same step on every rank and its upstream's at its length. One
                # that left the upstream where it was (a file briefly unreadable) is tried again
                # by the next call, and counts then.
                if upstream._mark() != before:
                    self._yielded += 1
                raise
            self._yielded += 1
            return item

    def _agree(self) -> int:
        """Count the next upstream epoch and agree with the other ranks on this epoch's size."""
        offer = self._carry + self._next_length()
        quota = self._agree_min(offer)
        if quota > offer:
            raise StateError(f"{self.kind}: the consumers agreed on {quota} items, this one has only {offer}")
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

    def _agree_min(self, offer: int) -> int:
        """The minimum offer over the ranks (``agree_min``) or, in a DataLoader worker, over every
        worker of every rank (``store_min``) when its rank handed down a store."""
        worker, num_workers = dataloader_worker()
        torch = sys.modules.get("torch")
        if torch is None or torch.utils.data.get_worker_info() is None:
            return agree_min(offer, self.group)
        rank, world_size = distributed_rank()
        if _inherited_store is not None:
            consumers = world_size * num_workers
            return store_min(offer, _inherited_store, self.epoch, rank * num_workers + worker, consumers)
        if world_size > 1:
            raise ConfigError(
                f"{self.kind}: runs inside a DataLoader worker of a multi-rank job, but no process group store "
                "was handed down to agree through: iterate it with rs.torch.Loader or PipelineDataset built after "
                "torch.distributed.init_process_group (a TCPStore), or use num_workers=0"
            )
        return offer

    # -- epochs and state ---------------------------------------------------------------------

    def _begin_epoch(self, epoch: int | None) -> None:
        """The next even-epoch (numbered ``epoch`` when given), continuing the upstream's stream;
        before anything was counted, the upstream starts ``epoch`` as any node would."""
        if self._quota is None and self._counted == 0 and self._started == 1:
            self.upstream._begin_epoch(epoch)
        elif self._quota is not None:  # an epoch left before its end keeps its rest for the next
            self._carry += self._quota - self._yielded
        self.epoch = epoch_after(self.kind, self.epoch, epoch)
        self._yielded = 0
        self._quota = None
        self._rejoin = False
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
        self.epoch = require_epoch(state, EPOCH, path)
        self._quota, self._yielded = quota, yielded
        self._carry = carry
        self._counted, self._started = counted, started
        # Every consumer restores, some saved before the epoch's agreement and some after (a
        # state taken before each DataLoader worker handed out its first batch of the epoch, or a
        # rank whose first item came later): those before wait in it for every consumer, so
        # those after take part in it again at their next item, with the offer they made.
        self._rejoin = quota is not None
        if quota == 0 and counted == 0:
            # Rescaled after every old rank had finished this epoch (``_rescale``): what remains
            # of the upstream epoch, now loaded, is the old ranks' carry, counted already. So it
            # is carried into the next epoch, with the next upstream epoch, as it would have been.
            self._counted, self._carry = 1, len(self.upstream)

    def _rescale(self, olds: list[dict[str, Any]], path: str, consumer: int, num_consumers: int) -> dict[str, Any]:
        """A fresh agreement on the new ranks in the old ranks' epoch: the rescaled upstream's
        length is what remains for this consumer, so nothing is counted or carried yet. An
        epoch every old rank had finished stays finished (quota 0, nothing counted), and what
        remains is then the old carry: ``_restore`` counts it as this consumer's carry once the
        rescaled upstream, whose length only it knows, is loaded."""
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
