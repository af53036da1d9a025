"""Typed errors. Validation never uses ``assert``: asserts vanish under ``python -O``."""

from __future__ import annotations


class ResumableError(Exception):
    """Base class of every error raised by resumable."""


class ConfigError(ResumableError, ValueError):
    """A node was built with invalid options (raised at construction, not during iteration)."""


class SourceError(ResumableError):
    """A data file is missing, empty, changed or holds a malformed record."""


class StateError(ResumableError):
    """A state does not belong to this pipeline: other node kind, version, options or files."""
