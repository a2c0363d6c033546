"""``Coordinator``: where each state partition lives, and which daemons hold copies no longer needed.

Driver side, optional and best effort (``StatefulOperator(coordinate=True)``, the default). A
daemon keeps a partition's store in memory after its task ends, so that the next batch's task on
the same node reopens it without reading anything. When Spark runs that partition on another node
(a lost executor, a rescheduled task), the old node's copy only costs memory until the daemon's
budget evicts it. The coordinator shortens that:

* every task that commits reports its *location* (host and daemon socket) and, from the daemon's
  answer to RELEASE, which partitions of the operator that daemon holds (``held``);
* before each batch it hands every task the partitions that each location holds but another
  location now owns (``releases``); a task whose daemon is at such a location asks it to drop
  them (``Client.release``: only idle, durable copies go; the others are asked again next time).

Correctness never depends on it: a store dropped by mistake is reloaded from its checkpoint files
when next opened, and a copy never released is evicted by the memory budget. A location with no
task in a batch is told nothing that batch.
"""
from __future__ import annotations

import socket
from collections.abc import Iterable, Mapping
from typing import Any


def location_of(socket_path: str) -> str:
    """This process's daemon, as the coordinator names it: host and socket path."""
    return f"{socket.gethostname()}:{socket_path}"


def local_socket(location: str | None) -> str | None:
    """The socket path of a daemon at ``location`` (``location_of``) when it is on this host (this
    process can reach it), else None."""
    if location is None:
        return None
    host, sep, path = location.partition(":")
    return path if sep and path and host == socket.gethostname() else None


class Coordinator:
    """Partition owners and per-location holdings, from the reports of committed tasks."""

    def __init__(self) -> None:
        self._owner: dict[int, str] = {}  # partition -> location of the task that last committed it
        self._held: dict[str, set[int]] = {}  # location -> partitions its daemon holds, as last reported
        self.counters = {"moves": 0, "released": 0, "kept": 0}

    def releases(self) -> dict[str, tuple[int, ...]]:
        """Per location: the partitions its daemon holds that another location owns now."""
        out = {}
        for loc, held in self._held.items():
            stale = tuple(sorted(p for p in held if self._owner.get(p, loc) != loc))
            if stale:
                out[loc] = stale
        return out

    def observe(self, reports: Iterable[tuple[int, Mapping[str, Any]]]) -> None:
        """Take one batch's reports: ``(partition, node)`` with ``node`` = ``{"location": …}``, plus
        ``held`` / ``released`` / ``kept`` when the task asked its daemon (``Client.release``)."""
        held_now: dict[str, set[int]] = {}
        for p, node in reports:
            loc = node["location"]
            old = self._owner.get(p)
            if old is not None and old != loc:
                self.counters["moves"] += 1
            self._owner[p] = loc
            seen = held_now.setdefault(loc, set())
            seen.add(p)
            if "held" in node:
                # several tasks of one daemon answer at different moments: their union (a
                # partition listed that has gone since is asked for again, harmlessly)
                seen.update(node["held"])
                self.counters["released"] += len(node.get("released", ()))
                self.counters["kept"] += len(node.get("kept", ()))
        for loc, seen in held_now.items():
            self._held[loc] = seen

    def locations(self) -> dict[int, str]:
        """Partition → the location of the task that last committed it."""
        return dict(sorted(self._owner.items()))

    def holdings(self) -> dict[str, list[int]]:
        """Location → the partitions its daemon held when last heard from."""
        return {loc: sorted(held) for loc, held in sorted(self._held.items())}
