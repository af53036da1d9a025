"""Per-rank states inside ``torch.distributed.checkpoint``.

DCP stores one value per key across all ranks for non-tensor data, but every rank's data
position differs. ``PerRank`` keys the state by rank so each rank saves and loads its own.
The state travels as one JSON string: DCP loads into the structure of the current
``state_dict()``, and a fresh loader's nested structure need not match a saved one's.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from typing import Any, Protocol

from resumable._stand_ins import not_read_class
from resumable.errors import StateError
from resumable.order.topology import distributed_rank

METADATA_FILE = ".metadata"
METADATA_MODULE = "torch.distributed.checkpoint.metadata"
"""The module whose classes a checkpoint's metadata makes."""
METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}
"""Other globals it may make: the file storage's record of each item, layouts by name, paths."""


class SupportsState(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def rank_key(rank: int) -> str:
    return f"rank_{rank}"


class PerRank:
    """Wrap a pipeline or loader for ``dcp.save({"data": PerRank(loader)}, ...)``."""

    def __init__(self, stateful: SupportsState) -> None:
        self.stateful = stateful

    def state_dict(self) -> dict[str, str]:
        rank, _ = distributed_rank()
        return {rank_key(rank): json.dumps(self.stateful.state_dict())}

    def load_state_dict(self, state_dict: dict[str, str]) -> None:
        rank, world_size = distributed_rank()
        key = rank_key(rank)
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get(key), str):
            raise StateError(f"PerRank: the checkpoint has no state for rank {rank} of {world_size}")
        self.stateful.load_state_dict(_decode(state_dict[key], f"PerRank: rank {rank} of {world_size}"))


def load_all_ranks(checkpoint_id: str | os.PathLike[str], key: str = "data") -> list[dict[str, Any]]:
    """Every old rank's state from a ``torch.distributed.checkpoint`` saved with
    ``{key: PerRank(...)}``, in rank order: what ``Loader.load_state_dict`` takes to resume
    on another number of ranks. Collective when a process group is initialised."""
    metadata = read_metadata(checkpoint_id)
    prefix = f"{key}.{rank_key(0)[:-1]}"
    entries = [name[len(prefix) :] for name in metadata.state_dict_metadata if name.startswith(prefix)]
    stray = [entry for entry in entries if not (entry.isascii() and entry.isdigit())]
    if stray:
        raise StateError(
            f"PerRank: checkpoint {checkpoint_id} holds {prefix}{stray[0]} under {key!r}: not one JSON string per "
            "rank, as PerRank saves them"
        )
    ranks = sorted(int(entry) for entry in entries)
    if ranks != list(range(len(ranks))) or not ranks:
        raise StateError(f"PerRank: checkpoint {checkpoint_id} holds ranks {ranks} under {key!r}, not 0..n-1")
    target: dict[str, Any] = {key: {rank_key(rank): "" for rank in ranks}}
    load_checkpoint(target, checkpoint_id)
    return [_decode(target[key][rank_key(rank)], f"PerRank: checkpoint {checkpoint_id} rank {rank}") for rank in ranks]


def load_checkpoint(target: dict[str, Any], checkpoint_id: str | os.PathLike[str], rebuild: bool = False) -> None:
    """Load ``checkpoint_id`` into ``target``: the entries ``target`` names (``dcp.load``,
    collective in a process group), or with ``rebuild`` every entry, in this process alone (as
    torch's ``dcp_to_torch_save`` does). Byte entries are read safely (``weights_only_bytes``).
    StateError naming the directory where it cannot be read (a rank's file missing, cut short
    or damaged): torch raises ``CheckpointException``, which ``except Exception`` lets through."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    try:
        if rebuild:
            reader = FileSystemReader(os.fspath(checkpoint_id))
            _load_state_dict(target, storage_reader=reader, planner=rebuilding_planner(), no_dist=True)
        else:
            dcp_load(target, checkpoint_id=checkpoint_id, planner=given_planner())
    except (Exception, CheckpointException) as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        raise StateError(
            f"{os.fsdecode(os.fspath(checkpoint_id))}: cannot read this torch.distributed.checkpoint "
            f"({type(error).__name__}: {(lines[-1] if lines else ''):.300})"
        ) from error


def given_planner() -> Any:
    """A load planner that fills the state dict it is given (torch's default), reading byte
    entries safely (``weights_only_bytes``; one that is not plain data is refused)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class WeightsOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            super().load_bytes(read_item, weights_only_bytes(value, read_item.dest_index.fqn, stand_in=False))

    return WeightsOnlyPlanner()


def rebuilding_planner() -> Any:
    """A load planner that builds the state dict from the checkpoint's metadata (as torch's
    ``dcp_to_torch_save`` does), reading byte entries safely (``weights_only_bytes``; objects
    that are not plain data are read as ``NotRead`` stand-ins)."""
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner  # type: ignore[attr-defined]

    class WeightsOnlyRebuildingPlanner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            super().load_bytes(read_item, weights_only_bytes(value, read_item.dest_index.fqn, stand_in=True))

    return WeightsOnlyRebuildingPlanner()  # type: ignore[no-untyped-call]


def weights_only_bytes(value: io.BytesIO, entry: str, stand_in: bool) -> io.BytesIO:
    """A checkpoint's byte entry (a ``PerRank`` state, any object saved beside tensors), read by
    ``load_plain`` and saved again for torch's planner: torch's own planners read it with
    ``weights_only=False``, so a crafted entry would run its code. StateError naming ``entry``
    if it is not plain data and ``stand_in`` is false."""
    import torch

    try:
        plain = load_plain(value, stand_in=stand_in)
    except pickle.UnpicklingError as error:
        first_line = (str(error).strip().splitlines() or [""])[0]
        raise StateError(f"entry {entry!r} is not plain data ({first_line:.200})") from error
    again = io.BytesIO()
    torch.save(plain, again)
    again.seek(0)
    return again


def load_plain(file: str | io.BytesIO, stand_in: bool, map_location: str | None = None) -> Any:
    """``torch.load(file, weights_only=True)``: tensors, containers and plain values, no code of
    the file's run. With ``stand_in``, an object of any other class (a config object, an
    ``argparse.Namespace``, a datetime) is read as a ``NotRead`` stand-in instead of refusing
    the whole file (torch 2.5 and later); its class is never looked up, so nothing of it runs."""
    import torch
    from torch import serialization

    names: list[str] = []
    if stand_in and hasattr(serialization, "get_unsafe_globals_in_checkpoint"):
        try:
            names = serialization.get_unsafe_globals_in_checkpoint(file)
        except Exception:  # noqa: BLE001, S110 - it reads only torch's zip format: the legacy one loads as it is
            pass
        if isinstance(file, io.BytesIO):
            file.seek(0)
    if not names:
        return torch.load(file, weights_only=True, map_location=map_location)
    with serialization.safe_globals([(not_read_class(name), name) for name in names]):
        return torch.load(file, weights_only=True, map_location=map_location)


def read_metadata(checkpoint_id: str | os.PathLike[str]) -> Any:
    """The ``Metadata`` of a ``torch.distributed.checkpoint`` directory, read by an unpickler
    that makes only what such metadata holds (``MetadataUnpickler``). torch reads the same file
    with plain ``pickle.load``, which a crafted file turns into running its code; reading it
    here first refuses such a file before torch loads it. StateError if it cannot be read."""
    path = os.path.join(os.fsdecode(os.fspath(checkpoint_id)), METADATA_FILE)
    try:
        with open(path, "rb") as handle:
            return MetadataUnpickler(handle).load()
    except Exception as error:  # noqa: BLE001 - an unpickler fails in many ways on a damaged file
        raise StateError(f"{path}: cannot read a checkpoint's metadata ({type(error).__name__}: {error})") from error


class MetadataUnpickler(pickle.Unpickler):
    """Makes only the classes of ``torch.distributed.checkpoint.metadata``, torch's sizes,
    dtypes, layouts and memory formats, and ``METADATA_GLOBALS``; any other global is refused
    (``pickle.UnpicklingError``), so nothing else can be called."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module in (METADATA_MODULE, "torch") and "." not in name:
            found = super().find_class(module, name)
            if module == METADATA_MODULE and isinstance(found, type) and found.__module__ == module:
                return found  # its dataclasses and enums
            if found is torch.Size or isinstance(found, (torch.dtype, torch.layout, torch.memory_format)):
                return found
        raise pickle.UnpicklingError(f"refused to make {module}.{name}: not part of a checkpoint's metadata")


def _decode(encoded: Any, where: str) -> Any:
    """A state stored as a JSON string; StateError if it is damaged or not a string."""
    if not isinstance(encoded, str):
        raise StateError(
            f"{where}: expected the state as a JSON string (saved by PerRank), got {type(encoded).__name__}"
        )
    try:
        return json.loads(encoded)
    except (ValueError, RecursionError) as error:
        raise StateError(f"{where}: the stored state is not valid JSON ({error})") from error
