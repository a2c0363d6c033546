"""Fault injection for the Spark tests: SIGKILL the node's daemon or the current process, or raise,
at a named point of a batch.

The product has only hook points (``statestore_async.spark.runtime.fault_point``), which do
nothing unless an operator is built with ``faults``; those need the hook maker this module
installs, in every process that builds such operators (the test session, a child driver)::

    from statestore_async.testing import faults
    faults.install()
    op = StatefulOperator(..., faults=[{"point": "before_commit", "batch": 2, "action": "kill_daemon",
                                        "partition": 0}])

    python -m statestore_async.testing.faults SCRIPT ARGS...   # SCRIPT as __main__, maker installed

A fault (``runtime.Fault``) fires at ``point`` of ``batch``, and when set only for ``partition``
and ``attempt`` (task points). Points: ``before_commit``, ``after_commit`` (tasks);
``before_fence``, ``after_manifest``, ``after_sink`` (the batch's last step, its time-only batch
included), ``time_only_before_fence``, ``time_only_after_manifest`` (driver). Actions: ``kill_daemon`` (SIGKILL the daemon at the
operator's socket), ``kill_self`` (SIGKILL the current process), ``fail`` (raise ``InjectedFault``).

The operator hands its ``FaultPlan`` to its tasks in the ``TaskSpec``: it pickles by reference to
this module, which Spark's Python workers import when they unpickle it (no install needed there).
"""
from __future__ import annotations

import os
import runpy
import signal
import sys
import time
from dataclasses import dataclass

from statestore_async.errors import InterfaceError
from statestore_async.spark import placement
from statestore_async.spark.runtime import Fault, FaultSite, InjectedFault, install_fault_hook_maker

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


def install() -> None:
    """Make ``FaultPlan`` this process's fault hook maker (idempotent): operators built afterwards
    may be given ``faults``."""
    install_fault_hook_maker(FaultPlan)


def uninstall() -> None:
    """Remove this process's fault hook maker: operators with ``faults`` are refused again."""
    install_fault_hook_maker(None)


def main(argv: list[str]) -> None:
    """``python -m statestore_async.testing.faults SCRIPT ARGS...``: run SCRIPT as ``__main__``
    with ``sys.argv = [SCRIPT, *ARGS]``, the maker installed (a child driver whose faults a test arms)."""
    if not argv:
        raise SystemExit("usage: python -m statestore_async.testing.faults SCRIPT [ARGS...]")
    install()
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as ``python SCRIPT`` would
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    # through the module's own name: the maker installed must be ``statestore_async.testing.faults.
    # FaultPlan``, which tasks can unpickle, not this ``__main__``'s copy of it
    from statestore_async.testing import faults as _faults

    _faults.main(sys.argv[1:])
