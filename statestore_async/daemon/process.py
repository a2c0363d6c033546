"""What the daemon sets up in its own process: its logs (text or JSON lines), glibc malloc's
behaviour (freed memory handed back to the system) and the open files limit."""
from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from typing import cast

from statestore_async.config import DaemonConfig

log = logging.getLogger("statestore_async.daemon")


# --- logs ----------------------------------------------------------------------------------------
class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg (+ exc)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage(), "pid": record.process}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def configure_logging(config: DaemonConfig) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if config.log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("statestore_async")
    root.handlers[:] = [handler]
    root.setLevel(config.log_level.upper())
    root.propagate = False



# glibc's mallopt parameters, the size from which its malloc maps memory of its own, and how many
# malloc arenas the daemon's threads share
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD = 128 << 10
ARENA_MAX = 2


def return_freed_memory() -> bool:
    """Make glibc's malloc give large blocks back to the system as soon as they are freed, and keep
    the threads' small blocks in few heaps.

    By default glibc raises its mmap threshold each time a mapped block is freed (up to 32 MiB),
    so later tables, payloads and file buffers of a few MiB come from the heap, where freed memory
    stays resident: the daemon's RSS then drifts far above what its stores hold, and the memory
    budget would not bound it. A fixed threshold keeps every block of 128 KiB or more mapped on its
    own and unmapped when freed (and a growing table's arena is moved by ``mremap``, not copied).
    glibc also gives each thread that allocates its own heap (up to 8 per core), each keeping
    freed pages resident; the encoding and IO threads then share one heap besides the event
    loop's (``ARENA_MAX``): -3.7 MiB of peak RSS in ``benchmarks/bench_budget_rss.py --rounds 20``
    (156.5 -> 152.8 MiB). Set before any thread allocates (``run``). Nothing happens on a C library
    without ``mallopt``. True when both settings took."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_ARENA_MAX, ARENA_MAX))


def give_back_free_pages() -> None:
    """Return the free pages inside malloc's heap to the system (glibc's ``malloc_trim``).

    Evicted stores free many small blocks (their Python objects, small tables) scattered through
    the heap; the heap can only shrink from its top, so without this their pages stay resident
    while a few live blocks sit between them. Costs a walk of the heap (~1 ms for tens of MiB)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _malloc_trim() -> Callable[[int], int] | None:
    import ctypes

    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return cast("Callable[[int], int]", fn)


_MALLOC_TRIM = _malloc_trim()


def raise_open_files_limit() -> tuple[int, int]:
    """Raise the soft limit of open files to the hard one; the (soft, hard) limits after.

    Spilled stores read their runs (a snapshot, the deltas stacked over it, flushed changes)
    through at most ``max_open_runs`` open files (``files.runfiles``), connections take one each,
    and a soft limit of 1024, which many systems start a process with, leaves little room (opens
    then fail with EMFILE). The hard limit is what the system allows."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        want = hard if hard != resource.RLIM_INFINITY else max(soft, OPEN_FILES_WANTED)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open files limit from %d to %d: %s", soft, want, exc)
    if soft < OPEN_FILES_WANTED:
        log.warning("the open files limit is %d: spilled stores' runs take up to max_open_runs, connections one each; raise it "
                    "(ulimit -n, LimitNOFILE) to at least %d", soft, OPEN_FILES_WANTED)
    return soft, hard


# open files a daemon with spilled stores may need (a soft limit below this is logged)
OPEN_FILES_WANTED = 4096


