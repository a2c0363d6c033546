"""Finding this node's daemon, and starting one when none answers (local mode needs no manual step).

The socket path is, in order: an explicit ``socket_path``, ``$STATESTORE_SOCKET``, then
``config.default_socket_path()``. In a cluster each node runs its own daemon (a DaemonSet, or the
autostart below) and its executors get the node's socket path through their environment.

Autostart: when nothing answers at the socket, the caller takes an ``fcntl`` lock on
``<socket>.lock`` (so concurrent tasks start one daemon, not several), checks again, and starts
``python -m statestore_async.cli serve --socket <socket>`` detached in its own session, logging to
``<socket dir>/daemon.log``; then it waits until the daemon answers PING. Such a daemon exits
once no client has been connected for a while and no upload is pending (its state is in the object
store): ``LOCAL_EXIT_WHEN_IDLE`` seconds for a local-mode Spark session (the operator's tasks tell
it so), ``AUTOSTART_EXIT_WHEN_IDLE`` on a cluster's executors (Python workers that idle for a
minute go, and a daemon that left would reload its state at the next batch), unless
``STATESTORE_EXIT_WHEN_IDLE`` says otherwise (``0``: never).

Lease: in local mode the driver holds one connection to its node's daemon while an operator is
open (``DaemonLease``), so that the daemon outlives idle workers between batches; the lease goes
with ``StatefulOperator.close()``, when the SparkContext stops, or when the driver exits. After
that the daemon exits ``LOCAL_EXIT_WHEN_IDLE`` seconds later. ``stop_daemon`` stops it at once.
"""
from __future__ import annotations

import fcntl
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from statestore_async.client.clients import Client
from statestore_async.config import default_socket_path
from statestore_async.daemon.unixsocket import peer_credentials
from statestore_async.errors import ConnectionLostError, StateStoreError

log = logging.getLogger(__name__)
AUTOSTART_EXIT_WHEN_IDLE = 600  # seconds: a daemon a task started on a cluster's executor
LOCAL_EXIT_WHEN_IDLE = 20  # seconds: a daemon a task of a local-mode session started
EXIT_WHEN_IDLE_ENV = "STATESTORE_EXIT_WHEN_IDLE"
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
            child_env.setdefault(EXIT_WHEN_IDLE_ENV, str(AUTOSTART_EXIT_WHEN_IDLE))
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


def local_daemon_env(env: dict[str, str] | None) -> dict[str, str]:
    """``env`` (a ``daemon_env``) for the tasks of a local-mode session: a daemon they start exits
    ``LOCAL_EXIT_WHEN_IDLE`` seconds after its last client, unless ``env`` or this process's
    environment set ``STATESTORE_EXIT_WHEN_IDLE``."""
    env = dict(env or {})
    if EXIT_WHEN_IDLE_ENV not in env and EXIT_WHEN_IDLE_ENV not in os.environ:
        env[EXIT_WHEN_IDLE_ENV] = str(LOCAL_EXIT_WHEN_IDLE)
    return env


class DaemonLease:
    """A driver's hold on its node's daemon (local mode): one open connection, so that the daemon's
    idle exit waits while the job runs. ``release()`` closes it; so does ``alive()`` turning false
    (checked every ``poll`` seconds by a daemon thread: the SparkContext stopped), and the process's
    exit. ``None`` from ``hold`` when no daemon answers."""

    def __init__(self, client: Client, alive: Callable[[], bool], poll: float = 1.0) -> None:
        self._client: Client | None = client
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(alive, poll), name="statestore-daemon-lease",
                                        daemon=True)
        self._thread.start()

    @property
    def held(self) -> bool:
        return self._client is not None

    def _watch(self, alive: Callable[[], bool], poll: float) -> None:
        while not self._stopped.wait(poll):
            try:
                ok = alive()
            except Exception:  # a context that cannot be asked is a stopped one
                ok = False
            if not ok:
                self.release()
                return

    def release(self) -> None:
        """Let the daemon go (its idle exit counts from the last connection's end). Idempotent."""
        self._stopped.set()
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()


def hold(socket_path: str | None, alive: Callable[[], bool]) -> DaemonLease | None:
    """A ``DaemonLease`` on the daemon at the socket (no autostart: the tasks start it), or None
    when none answers."""
    path = socket_path_for(socket_path)
    if not os.path.exists(path):
        return None
    client = Client(path, timeout=10.0, connect_timeout=2.0, name="statestore_async.lease")
    try:
        client.ping()
    except (StateStoreError, OSError) as exc:
        client.close()
        log.debug("no daemon to hold at %s: %s", path, exc)
        return None
    return DaemonLease(client, alive)
