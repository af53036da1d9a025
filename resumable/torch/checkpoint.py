"""Trainer checkpoints (model, optimiser, data state) written atomically with torch.save."""

from __future__ import annotations

import os
from typing import Any

import torch

from resumable.checkpoint import write_atomically


def save(checkpoint: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """``torch.save`` to a temporary file, fsync, rename: a crash keeps the previous file.

    Missing directories are created, and the file's mode follows the umask as ``torch.save``'s
    does, so that other users' jobs (evaluation) can read it where the umask lets them.
    """
    write_atomically(path, lambda out: torch.save(checkpoint, out))


def load(path: str | os.PathLike[str], map_location: Any = None) -> dict[str, Any]:
    """``torch.load`` with ``weights_only=True``: tensors and plain data, nothing unpickled."""
    loaded: dict[str, Any] = torch.load(path, map_location=map_location, weights_only=True)
    return loaded
