"""Fault injection for the Spark tests: SIGKILL the node's daemon or the current process, or raise,
at a named point of a batch.

The product has only hook points (``statestore_async.spark.shared.hooks``), which do nothing unless
a hook is installed for the operator; ``arm`` installs the hook of a list of faults (or a hook of
one's own) on an operator::

    from statestore_async.testing import faults
    op = StatefulOperator(...)
    faults.arm(op, [{"point": "before_commit", "batch": 2, "action": "kill_daemon", "partition": 0}])

A ``Fault`` fires at ``point`` of ``batch``, and when set only for ``partition`` and ``attempt``
(task points). Points: ``before_commit``, ``after_commit`` (tasks); ``before_fence``,
``after_manifest``, ``after_sink`` (the batch's last step, its time-only batch included),
``time_only_before_fence``, ``time_only_after_manifest`` (driver). Actions: ``kill_daemon``
(SIGKILL the daemon at the operator's socket), ``kill_self`` (SIGKILL the current process),
``fail`` (raise ``InjectedFault``).

The operator hands its hook (a ``FaultPlan``) to its tasks in the ``TaskSpec``: it pickles by
reference to this module, which Spark's Python workers import when they unpickle it.
"""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from statestore_async.errors import InterfaceError
from statestore_async.spark.shared import hooks, placement
from statestore_async.spark.shared.hooks import Hook, HookSite

FaultSite = HookSite  # where a fault's hook point is reached
FaultHook = Hook


@dataclass(frozen=True)
class Fault:
    """A fault a test arms on an operator: at ``point`` of ``batch`` (and ``partition``, ``attempt``
    when set) do ``action`` (``kill_daemon``, ``kill_self``, ``fail``)."""

    point: str
    batch: int
    action: str
    partition: int | None = None
    attempt: int | None = 0


class InjectedFault(RuntimeError):
    """What a ``fail`` fault raises."""


ACTIONS = ("kill_daemon", "kill_self", "fail")


def matches(fault: Fault, site: FaultSite) -> bool:
    """Whether ``fault`` is armed for ``site``: same point and batch, and the partition and the
    attempt when the fault names them."""
    if fault.point != site.point or fault.batch != site.batch:
        return False
    if fault.partition is not None and fault.partition != site.partition:
        return False
    return fault.attempt is None or fault.attempt == site.attempt


def act(action: str, site: FaultSite) -> None:
    """Do ``action`` at ``site`` (see the module docstring); InterfaceError for an unknown action."""
    if action == "kill_daemon":
        pid = placement.daemon_pid(site.socket_path)
        if pid:
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
    elif action == "kill_self":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "fail":
        raise InjectedFault(f"test hook: fail at {site.point} of batch {site.batch} partition {site.partition} "
                            f"attempt {site.attempt}")
    else:
        raise InterfaceError(f"unknown fault action {action!r}")


@dataclass(frozen=True)
class FaultPlan:
    """The fault hook of one operator: at each hook point, the action of every fault armed there, in order."""

    faults: tuple[Fault, ...]

    def __call__(self, site: FaultSite) -> None:
        for fault in self.faults:
            if matches(fault, site):
                act(fault.action, site)


def arm(operator: object, faults: Iterable[Fault | Mapping[str, Any]] | Hook) -> Hook | None:
    """Install on ``operator`` the hook of ``faults`` (``Fault`` records or dicts of their fields: a
    ``FaultPlan``), or ``faults`` itself when it is a hook (a callable of ``FaultSite``); no faults
    remove the operator's hook. Returns the hook installed (None: none)."""
    if callable(faults):
        hook: Hook | None = faults
    else:
        plan = tuple(Fault(**f) if isinstance(f, Mapping) else f for f in faults)
        hook = FaultPlan(plan) if plan else None
    hooks.install(operator, hook)
    return hook


__all__ = ["ACTIONS", "Fault", "FaultHook", "FaultPlan", "FaultSite", "InjectedFault", "act", "arm", "matches"]
