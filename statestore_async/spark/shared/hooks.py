"""Hook points: named points of a batch where a hook installed on an operator is called. The
product only marks the points; no operator has a hook until one is installed for it
(``install``, which the test suite's fault injection uses: ``statestore_async.testing.faults``),
and without one every point does nothing.

Task points: ``before_commit``, ``after_commit``; driver points: ``before_fence``,
``after_manifest``, ``after_sink`` (the batch's last step, its time-only batch included),
``time_only_before_fence``, ``time_only_after_manifest``. A task that retries its partition after
losing its daemon reaches ``before_commit`` again (``HookSite.retry`` counts its tries), as does a
batch whose stateful stage the driver runs again (a new job: ``attempt`` 0 again) for its points.

An operator's hook travels to its tasks in the ``TaskSpec``: it must pickle, and Spark's Python
workers must be able to import its module.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HookSite:
    """Where a hook point is reached: the point, the batch and, in a task, its partition and attempt."""

    point: str
    batch: int
    partition: int | None = None
    attempt: int = 0
    socket_path: str | None = None  # the operator's daemon socket (None: $STATESTORE_SOCKET or the default)
    retry: int = 0  # in a task: its try of the partition (0 first; more after losing its daemon)


Hook = Callable[[HookSite], None]

# operator -> its hook; weak, so an operator's hook goes with it
_installed: weakref.WeakKeyDictionary[Any, Hook] = weakref.WeakKeyDictionary()


def install(owner: object, hook: Hook | None) -> None:
    """Call ``hook`` at every hook point of ``owner`` (an operator) from now on; None removes it."""
    if hook is None:
        _installed.pop(owner, None)
    else:
        _installed[owner] = hook


def installed(owner: object) -> Hook | None:
    """The hook installed for ``owner``, None when there is none (its hook points do nothing)."""
    return _installed.get(owner)


def hook_point(hook: Hook | None, point: str, batch: int, partition: int | None = None, attempt: int = 0,
               socket_path: str | None = None, retry: int = 0) -> None:
    """A hook point: nothing when ``hook`` is None, else ``hook(HookSite(...))``."""
    if hook is not None:
        hook(HookSite(point, batch, partition, attempt, socket_path, retry))


__all__ = ["Hook", "HookSite", "hook_point", "install", "installed"]
