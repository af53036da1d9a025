"""The package's top level: what ``import resumable as rs`` gives, and what it does not load."""

from __future__ import annotations

import subprocess
import sys

import pytest

import resumable as rs
from resumable.ops.parallel_map import MapError

FRESH_INTERPRETER = """
import sys
import resumable as rs
print("torch" in sys.modules)
loader = rs.torch.Loader(rs.from_list([1, 2, 3]).batch(2))
print("torch" in sys.modules, rs.torch is sys.modules["resumable.torch"], [b for b in loader])
"""


def test_rs_torch_is_imported_on_first_use_only() -> None:
    """``rs.torch.Loader`` works after a plain ``import resumable as rs`` (as the README writes
    it), and a program that never touches ``rs.torch`` does not load torch."""
    result = subprocess.run([sys.executable, "-c", FRESH_INTERPRETER], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["False", "True True [[1, 2], [3]]"]


def test_every_exported_name_exists_and_map_errors_are_rs_map_error() -> None:
    assert all(hasattr(rs, name) for name in rs.__all__)
    assert rs.MapError is MapError and issubclass(rs.MapError, rs.ResumableError)
    with pytest.raises(rs.MapError, match="record 2 is broken"):
        list(rs.from_list([1, 2]).map(fail_on_two, num_workers=1))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        rs.nope  # noqa: B018


def fail_on_two(x: int) -> int:
    if x == 2:
        raise ValueError("record 2 is broken")
    return x


def test_every_warning_class_of_the_package_is_an_exported_resumable_warning() -> None:
    """A user silences or raises every warning of the library with one filter on
    ``rs.ResumableWarning``: each warning class defined anywhere in the package derives from it
    and is exported as ``rs.<name>``."""
    import importlib
    import pkgutil

    found = set()
    for module_info in pkgutil.walk_packages(rs.__path__, "resumable."):
        if module_info.name.startswith("resumable.torch") or module_info.name.endswith("__main__"):
            continue  # imports torch, or runs the command line; defines no warning
        module = importlib.import_module(module_info.name)
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, Warning) and value.__module__.startswith("resumable"):
                found.add(value)
    assert found == {
        rs.ResumableWarning,
        rs.SidecarWarning,
        rs.CacheWarning,
        rs.ChunkCacheWarning,
        rs.BarrenEpochWarning,
    }
    assert all(issubclass(kind, rs.ResumableWarning) and getattr(rs, kind.__name__) is kind for kind in found)
