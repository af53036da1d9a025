"""Stand-ins for the objects of a checkpoint that are not plain data, so that a checkpoint can be
read (``python -m resumable inspect``) without running anything of the file's."""

from __future__ import annotations

import hashlib
from typing import Any


class NotRead:
    """What an object a checkpoint holds is read as when its class is no plain data's: its
    class's name, and the arguments and state it was saved with (plain data or stand-ins)."""

    saved_as = "?"
    arguments: tuple[tuple[Any, ...], dict[str, Any]]
    state: Any

    def __new__(cls, *args: Any, **kwargs: Any) -> NotRead:
        stand_in = super().__new__(cls)
        stand_in.arguments = (args, kwargs)
        stand_in.state = None
        return stand_in

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Takes whatever the object was saved with (see ``__new__``)."""

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __reduce__(self) -> tuple[Any, ...]:
        """Saved again as itself (a DCP entry goes through ``torch.save`` once more)."""
        return _not_read_again, (self.saved_as, self.arguments, self.state)

    def __repr__(self) -> str:
        return f"<{self.saved_as}: not read>"


def not_read_class(name: str) -> type[NotRead]:
    """The ``NotRead`` class standing in for the global ``name`` (``module.Name``), one per name,
    kept in this module so that it pickles by reference (a DCP entry holding the class itself,
    a numpy array's, is saved once more)."""
    attribute = "NotRead_" + hashlib.sha256(name.encode()).hexdigest()[:20]
    made = type(attribute, (NotRead,), {"saved_as": name, "__module__": __name__, "__qualname__": attribute})
    kept: type[NotRead] = globals().setdefault(attribute, made)
    return kept


def _not_read_again(name: str, arguments: tuple[tuple[Any, ...], dict[str, Any]], state: Any) -> NotRead:
    stand_in = not_read_class(name)(*arguments[0], **arguments[1])
    stand_in.state = state
    return stand_in
