"""A pipeline as a ``torch.utils.data.IterableDataset``."""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Union

from torch.utils.data import IterableDataset, get_worker_info

from resumable.errors import ConfigError, StateError
from resumable.loader_state import PIPELINE
from resumable.node import Node
from resumable.order.topology import distributed_rank, inherit_rank

PipelineOrFactory = Union[Node[Any], Callable[[], Node[Any]]]


class WorkerIterator:
    """What ``iter(PipelineDataset)`` returns: the pipeline, whose state it reports as one
    JSON string. StatefulDataLoader diffs, copies and ships a worker's state with every
    batch; a string leaf makes that O(1) however large the state (packer references)."""

    def __init__(self, pipeline: Node[Any]) -> None:
        self.pipeline = pipeline

    def __iter__(self) -> WorkerIterator:
        return self

    def __next__(self) -> Any:
        return next(self.pipeline)

    def state_dict(self) -> dict[str, str]:
        return {PIPELINE: json.dumps(self.pipeline.get_state(), separators=(",", ":"))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        encoded = state_dict.get(PIPELINE) if isinstance(state_dict, dict) else None
        if not isinstance(encoded, str):
            raise StateError(f"PipelineDataset: expected {{{PIPELINE!r}: <JSON string>}}, got {state_dict!r:.200}")
        try:
            state = json.loads(encoded)
        except (ValueError, RecursionError) as error:
            raise StateError(f"PipelineDataset: the pipeline state is not valid JSON ({error})") from error
        self.pipeline.set_state(state)


class PipelineDataset(IterableDataset):  # type: ignore[type-arg]
    """Each DataLoader worker iterates its own copy of the pipeline, which reads a disjoint
    partition: ``.shard()`` resolves ``rank * num_workers + worker`` inside the worker.

    The rank is read in the main process (torch.distributed is not initialised inside
    workers) when the dataset is built and at each ``set_epoch``, and handed to the workers.

    Epochs: the first ``iter()`` in a process starts epoch ``epoch`` (set in the main process
    before workers start, by ``rs.torch.Loader`` or by ``set_epoch``); each later ``iter()``
    starts the epoch set since, or else the next one. So fresh workers, persistent workers
    (which keep their own copy of this object) and the main process all shuffle anew each epoch.
    ``iter()`` returns a ``WorkerIterator`` over the pipeline: its ``state_dict()`` is what a
    ``StatefulDataLoader`` snapshots in each worker with every batch.
    """

    def __init__(self, pipeline: PipelineOrFactory) -> None:
        super().__init__()
        if isinstance(pipeline, Node):
            self._pipeline: Node[Any] | None = pipeline
            self._factory: Callable[[], Node[Any]] | None = None
        elif callable(pipeline):
            self._pipeline, self._factory = None, pipeline
        else:
            raise ConfigError(f"PipelineDataset: expected a pipeline or a function building one, got {pipeline!r}")
        self.epoch = 0
        self.rank = distributed_rank()
        # In the process that iterates: (process id, epoch told by set_epoch, epoch started).
        self._started: tuple[int, int, int] | None = None
        # After an elastic rescale: the JSON pipeline state each worker (0 without workers)
        # continues the epoch from, applied at the next iter() (see rs.torch.Loader).
        self.rescaled: dict[int, str] | None = None

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next ``iter()`` starts (in every worker); also re-reads the rank."""
        self.epoch = epoch
        self.rank = distributed_rank()

    @property
    def pipeline(self) -> Node[Any]:
        """This process's pipeline, built on first use when a factory was given."""
        if self._pipeline is None:
            built = self._factory()  # type: ignore[misc]
            if not isinstance(built, Node):
                raise ConfigError(f"PipelineDataset: the factory returned {type(built).__name__}, not a pipeline")
            self._pipeline = built
        return self._pipeline

    def __iter__(self) -> WorkerIterator:
        if get_worker_info() is not None:
            inherit_rank(*self.rank)
        pipe = self.pipeline
        pid, started = os.getpid(), self._started
        if started is None or started[0] != pid or started[1] != self.epoch:
            epoch = self.epoch
        else:
            epoch = started[2] + 1
        pipe.start_epoch(epoch)
        self._started = (pid, self.epoch, epoch)
        if self.rescaled is not None:
            info = get_worker_info()
            pipe.set_state(json.loads(self.rescaled[info.id if info is not None else 0]))
            self.rescaled = None  # later epochs start whole
        return WorkerIterator(pipe)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._factory is not None:
            state["_pipeline"] = None  # each process builds its own
        return state
