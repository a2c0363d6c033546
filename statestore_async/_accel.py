"""Picks the compiled (Cython) or the pure-Python implementation of a codec module.

Each ``_ext/<name>.pyx`` is built as ``statestore_async._native.<name>`` and has a reference twin
``statestore_async._ref.<name>`` with the same functions. The compiled one is used unless
``STATESTORE_NO_EXTENSIONS=1`` is set or it was not built (then a warning says so once).
"""
from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType

NO_EXTENSIONS = os.environ.get("STATESTORE_NO_EXTENSIONS", "") not in ("", "0")


def reference(name: str) -> ModuleType:
    """The pure-Python reference module ``statestore_async._ref.<name>``."""
    return importlib.import_module(f"statestore_async._ref.{name}")


def native(name: str) -> ModuleType:
    """The compiled module ``statestore_async._native.<name>`` (ImportError when not built)."""
    return importlib.import_module(f"statestore_async._native.{name}")


def implementation(name: str) -> ModuleType:
    """The module to use for ``name``: compiled when available and allowed, else the reference."""
    if NO_EXTENSIONS:
        return reference(name)
    try:
        return native(name)
    except ImportError as exc:
        warnings.warn(
            f"statestore_async: compiled module {name!r} not available ({exc}); using the slower "
            "pure-Python reference. Build it with `make build`.",
            RuntimeWarning,
            stacklevel=2,
        )
        return reference(name)
