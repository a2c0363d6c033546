"""Finding this node's daemon, and starting one when none answers (local mode needs no manual step).

The socket path is, in order: an explicit ``socket_path``, ``$STATESTORE_SOCKET``, then
``config.default_socket_path()``. In a cluster each node runs its own daemon (a DaemonSet, or the
autostart below) and its executors get the node's socket path through their environment.

Autostart: when nothing answers at the socket, the caller takes an ``fcntl`` lock on
``<socket>.lock`` (so concurrent tasks start one daemon, not several), checks again, and starts
``python -m statestore_async.cli serve --socket <socket>`` detached in its own session, logging to
``<socket dir>/daemon.log``; then it waits until the daemon answers PING. Such a daemon exits
``AUTOSTART_EXIT_WHEN_IDLE`` seconds after its last client went away (the Spark application ended,
or its workers idled out), unless ``STATESTORE_EXIT_WHEN_IDLE`` says otherwise (``0``: never).
"""
from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
import time

from statestore_async.client.clients import Client
from statestore_async.config import default_socket_path
from statestore_async.daemon.unixsocket import peer_credentials
from statestore_async.errors import ConnectionLostError, StateStoreError

AUTOSTART_EXIT_WHEN_IDLE = 600  # seconds
_STARTED: list[subprocess.Popen] = []  # keep Popen objects alive (no ResourceWarning, reaped lazily)


class DaemonUnavailableError(ConnectionLostError):
    """No daemon answers at the socket and none could be started."""


def socket_path_for(socket_path: str | None = None) -> str:
    """The socket this process should use (explicit, ``$STATESTORE_SOCKET``, or the default)."""
    return socket_path or os.environ.get("STATESTORE_SOCKET") or default_socket_path()


def _answers(path: str, timeout: float = 2.0) -> bool:
    if not os.path.exists(path):
        return False
    c = Client(path, timeout=timeout, connect_timeout=timeout, name="statestore_async.placement")
    try:
        c.ping()
        return True
    except (StateStoreError, OSError):
        return False
    finally:
        c.close()


def start_daemon(path: str, *, env: dict | None = None, args: list[str] | None = None, timeout: float = 30.0) -> None:
    """Start a daemon at ``path`` unless one answers there (race-free across processes)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, mode=0o700, exist_ok=True)
    with open(path + ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if _answers(path):
                return
            for p in _STARTED:
                p.poll()
            log = open(os.path.join(folder, "daemon.log"), "ab")  # noqa: SIM115 - the child keeps it; closed below
            cmd = [sys.executable, "-m", "statestore_async.cli", "serve", "--socket", path, *(args or [])]
            child_env = {**os.environ, **(env or {})}
            # left alone, a daemon a task started would outlive the Spark application: it exits once
            # no worker has been connected for a while (its state is in the object store)
            child_env.setdefault("STATESTORE_EXIT_WHEN_IDLE", str(AUTOSTART_EXIT_WHEN_IDLE))
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=child_env, start_new_session=True, close_fds=True)
            log.close()
            _STARTED.append(proc)
            deadline = time.monotonic() + timeout
            while not _answers(path, 1.0):
                if proc.poll() is not None:
                    raise DaemonUnavailableError(
                        f"the daemon started at {path} exited with {proc.returncode}; see {folder}/daemon.log")
                if time.monotonic() > deadline:
                    raise DaemonUnavailableError(f"the daemon started at {path} did not answer within {timeout}s")
                time.sleep(0.05)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def connect(socket_path: str | None = None, *, autostart: bool = True, env: dict | None = None) -> Client:
    """The process-wide client of this node's daemon, starting the daemon first if needed."""
    path = socket_path_for(socket_path)
    client = Client.shared(path)
    try:
        client.ping()
        return client
    except (StateStoreError, OSError) as exc:
        if not autostart:
            raise DaemonUnavailableError(f"no daemon answers at {path}: {exc}") from None
    start_daemon(path, env=env)
    client.ping()
    return client


def daemon_pid(socket_path: str | None = None) -> int | None:
    """The pid of the daemon serving the socket (SO_PEERCRED), or None when none listens."""
    path = socket_path_for(socket_path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2.0)
    try:
        s.connect(path)
        return peer_credentials(s)[0]
    except OSError:
        return None
    finally:
        s.close()


def stop_daemon(socket_path: str | None = None, sig: int = signal.SIGTERM, timeout: float = 30.0) -> bool:
    """Signal the daemon serving the socket and wait until it is gone; False if none was running."""
    pid = daemon_pid(socket_path)
    if pid is None:
        return False
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in _STARTED:
            p.poll()
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if _zombie(pid):
            return True
        time.sleep(0.05)
    return False


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
