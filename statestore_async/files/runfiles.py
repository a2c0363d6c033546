"""``RunFiles``: the open files of a daemon's cold runs, at most ``max_open`` at a time.

A spilled store reads its runs (its snapshot, the deltas stacked over it, changes flushed by an
open version) from files on local disk. Holding one open file per run took the daemon to ~870–1,600
open files under the 1,100-byte memory soak, past the soft limit of 1024 many systems start a
process with. ``RunFiles`` bounds them: each run's file is a ``RunFile`` that holds an open file
only while it is read or among the ``max_open`` most recently read; the least recently read are
closed and opened again on their next read.

Reopening by the file's own path is not safe: the object store's cache evicts its copies,
retention deletes old checkpoints and flushed changes are unlinked once opened, while a run still
reads them. So a run's file is first given a name of the daemon's own when it is opened: a hard
link (checked to name the file opened), in a folder of its own (``park_dir``; by default a folder
``statestore-runs-<pid>-*`` in the system's temporary folder, whose leftovers from a daemon that
died are removed when the next one starts). The link goes when the last run reading the file is
closed. A file that cannot be linked there (another file system, a file replaced or removed
before it was linked) keeps its open file for as long as it is read: ``pinned``, counted in ``stats``.

The daemon's open files for runs are therefore at most ``max_open`` plus the pinned ones plus the
files being read at that moment past the bound (one per thread reading).
"""
from __future__ import annotations

import atexit
import itertools
import os
import shutil
import tempfile
import threading
from collections import OrderedDict

from statestore_async.errors import CorruptFileError

# open files for runs by default (``max_open_runs``): a quarter of the soft limit of 1024 that many
# systems start a process with, leaving the rest to connections, uploads and the object store
DEFAULT_MAX_OPEN = 256
_PARK_PREFIX = "statestore-runs-"
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class RunFile:
    """One file read by one or more runs (``ColdRun.reopen`` shares it): ``pread`` opens it again
    when ``RunFiles`` closed it. ``release`` once per ``share``, plus once for its opener."""

    def __init__(self, files: RunFiles, path: str, fd: int) -> None:
        self.files = files
        self.path = path  # the path it was opened by (for messages)
        self._fd: int | None = fd
        st = os.fstat(fd)
        self.size = st.st_size
        self._ino = (st.st_ino, st.st_dev)  # the file a reopen must find
        self._parked: str | None = None  # the daemon's own name for it
        self.pinned = False  # no name of the daemon's own: keeps its open file
        self._refs = 1
        self._reads = 0  # reads in progress: not closed under them
        self.id = next(files._ids)

    def pread(self, length: int, offset: int) -> bytes:
        fd = self.files._acquire(self)
        try:
            return os.pread(fd, length, offset)
        finally:
            self.files._done(self)

    def share(self) -> RunFile:
        """Another run reads this file: it stays until each of them released it."""
        with self.files._lock:
            if self._refs <= 0:
                raise CorruptFileError(self.path, "the run's file was closed", None)
            self._refs += 1
        return self

    def release(self) -> None:
        """One run stopped reading the file; the last one closes it and removes its link."""
        self.files._release(self)

    @property
    def is_open(self) -> bool:
        return self._fd is not None


class RunFiles:
    """The open files of a daemon's runs, the least recently read closed past ``max_open`` (see the
    module doc). Thread-safe."""

    def __init__(self, max_open: int = DEFAULT_MAX_OPEN, park_dir: str | None = None) -> None:
        if max_open < 1:
            raise ValueError(f"max_open_runs must be at least 1, not {max_open}")
        self.max_open = max_open
        self._park_root = park_dir  # where the folder of links goes (None: the system's temporary folder)
        self._park: str | None = None  # that folder, made when first needed
        self._park_dev: int | None = None
        self._lock = threading.Lock()
        self._open: OrderedDict[int, RunFile] = OrderedDict()  # files holding an open file, least recently read first
        self._ids = itertools.count(1)
        self.files = 0  # files of runs not released
        self.opens = 0  # files opened again after being closed
        self.closes = 0  # files closed past max_open
        self.pinned = 0  # files that keep their open file (not linked)
        self.peak_open = 0

    def open(self, path: str) -> RunFile:
        """Open ``path`` (read-only) as a run's file, linked under the daemon's own name."""
        fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
        try:
            f = RunFile(self, path, fd)
            self._link(f, fd)
        except BaseException:
            os.close(fd)
            raise
        with self._lock:
            self.files += 1
            if not f.pinned:  # a pinned file is never closed: outside the LRU
                self._open[f.id] = f
            self._shrink_locked()
        return f

    # --- links -----------------------------------------------------------------------------------
    def _folder(self) -> str | None:
        with self._lock:
            if self._park is None:
                root = self._park_root or tempfile.gettempdir()
                try:
                    os.makedirs(root, exist_ok=True)
                    _remove_leftovers(root)
                    self._park = tempfile.mkdtemp(prefix=f"{_PARK_PREFIX}{os.getpid()}-", dir=root)
                    self._park_dev = os.stat(self._park).st_dev
                    atexit.register(_remove_folder, self._park, os.getpid())
                except OSError:
                    self._park = ""
            return self._park or None

    def _link(self, f: RunFile, fd: int) -> None:
        folder = self._folder()
        name = None if folder is None else os.path.join(folder, str(f.id))
        if name is not None and f._ino[1] == self._park_dev:
            try:
                os.link(f.path, name, follow_symlinks=True)
                st = os.stat(name)
                if (st.st_ino, st.st_dev) == f._ino:
                    f._parked = name
                    return
                os.unlink(name)  # the path names another file than the one opened (replaced since)
            except OSError:
                pass
        f.pinned = True
        with self._lock:
            self.pinned += 1

    # --- reading ---------------------------------------------------------------------------------
    def _acquire(self, f: RunFile) -> int:
        with self._lock:
            if f._refs <= 0:
                raise CorruptFileError(f.path, "the run's file was closed", None)
            fd = f._fd
            if fd is None:
                assert f._parked is not None
                try:
                    fd = os.open(f._parked, os.O_RDONLY | _O_CLOEXEC)
                except OSError as exc:
                    raise CorruptFileError(f.path, f"cannot open the run's file again ({f._parked}): {exc}",
                                           None) from None
                st = os.fstat(fd)
                if (st.st_ino, st.st_dev) != f._ino:
                    os.close(fd)
                    raise CorruptFileError(f.path, f"{f._parked} is another file than the run's", None)
                f._fd = fd
                self.opens += 1
            f._reads += 1
            if not f.pinned:
                self._open[f.id] = f
                self._open.move_to_end(f.id)
                self._shrink_locked()
            return fd

    def _done(self, f: RunFile) -> None:
        with self._lock:
            f._reads -= 1
            self._shrink_locked()

    def _shrink_locked(self) -> None:
        """Close the least recently read files past ``max_open`` that are not being read."""
        over = len(self._open) - self.max_open
        kept: list[RunFile] = []  # the least recently read that must stay open, oldest first
        while over > 0 and self._open:
            _, f = self._open.popitem(last=False)
            if f._reads or f._fd is None:
                kept.append(f)
                continue
            os.close(f._fd)
            f._fd = None
            self.closes += 1
            over -= 1
        for f in reversed(kept):  # back in their places, least recently read first
            self._open[f.id] = f
            self._open.move_to_end(f.id, last=False)
        self.peak_open = max(self.peak_open, len(self._open) + self.pinned)

    def _release(self, f: RunFile) -> None:
        with self._lock:
            if f._refs <= 0:
                return
            f._refs -= 1
            if f._refs:
                return
            self.files -= 1
            if f.pinned:
                self.pinned -= 1
            self._open.pop(f.id, None)
            fd, f._fd = f._fd, None
            parked, f._parked = f._parked, None
        if fd is not None:
            os.close(fd)
        if parked is not None:
            try:
                os.unlink(parked)
            except OSError:
                pass

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"files": self.files, "open": len(self._open) + self.pinned, "max_open": self.max_open,
                    "peak_open": self.peak_open, "opens": self.opens, "closes": self.closes, "pinned": self.pinned}


def _remove_folder(path: str, pid: int) -> None:
    """At exit: remove the folder of links ``path`` made by process ``pid`` (not by a forked child)."""
    if os.getpid() == pid:
        shutil.rmtree(path, ignore_errors=True)


def _remove_leftovers(root: str) -> None:
    """Remove the link folders in ``root`` of daemons no longer running (they died without
    removing theirs)."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        if not name.startswith(_PARK_PREFIX):
            continue
        pid = name[len(_PARK_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process
    return True


__all__ = ["DEFAULT_MAX_OPEN", "RunFile", "RunFiles"]
