"""Run a real daemon (``statestore-async serve``) as a separate process, for tests and benchmarks.

``DaemonProcesses`` is the one way tests start such a process: it waits until the socket answers
PING (with a generous deadline, the machine may be busy) and stops every daemon it started when it
is closed, also when the test failed. ``tests/conftest.py`` wraps it as the ``daemon_process``
fixture; a module-scoped fixture may use it directly as a context manager.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from statestore_async.client import Client
from statestore_async.errors import PermissionDeniedError, StateStoreError

START_TIMEOUT = 60.0  # seconds for a daemon to answer its first PING (a loaded 2-core CI machine)
STOP_TIMEOUT = 30.0  # seconds SIGTERM may take (drain) before SIGKILL


def serve_command(socket_path: str, *args: str) -> list[str]:
    """The command line of ``statestore-async serve`` on ``socket_path`` with this interpreter."""
    return [sys.executable, "-m", "statestore_async.cli", "serve", "--socket", socket_path, *args]


def wait_until_answering(proc: subprocess.Popen, socket_path: str, *, log_path: str | None = None,
                         timeout: float = START_TIMEOUT) -> None:
    """Return once the daemon at ``socket_path`` answers PING (a coded refusal of this peer's uid is
    an answer too); raise with its log if it exits first or stays silent for ``timeout`` seconds
    (it is killed then)."""

    def log() -> str:
        if log_path is None:
            return ""
        try:
            return Path(log_path).read_text(errors="replace")[-8000:]
        except OSError:
            return ""

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode} before answering: {log()}")
        try:
            with Client(socket_path, timeout=5, connect_timeout=1) as client:
                client.ping()
            return
        except PermissionDeniedError:
            return  # it answered: this uid is not on its allow-list
        except StateStoreError:
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"daemon did not answer PING in {timeout:.0f} s: {log()}") from None
            time.sleep(0.05)


def start_daemon(socket_path: str, *args: str, log_path: str, env: dict | None = None, cwd: str | None = None,
                 timeout: float = START_TIMEOUT) -> subprocess.Popen:
    """Start ``statestore-async serve --socket socket_path *args``; return once it answers PING.

    Its output goes to ``log_path``; a daemon that exits or never answers raises with its log.
    The caller stops it (``stop_daemon``); tests use ``DaemonProcesses``, which always does.
    """
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(serve_command(socket_path, *args), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env if env is not None else dict(os.environ), cwd=cwd)
    try:
        wait_until_answering(proc, socket_path, log_path=log_path, timeout=timeout)
    except BaseException:
        stop_daemon(proc, timeout=5)
        raise
    return proc


def stop_daemon(proc: subprocess.Popen, timeout: float = STOP_TIMEOUT) -> int:
    """SIGTERM (drain), then SIGKILL if it does not exit in ``timeout``; returns its exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class DaemonProcess:
    """One running ``statestore-async serve``: ``socket``, ``proc`` (the Popen), ``log_path``."""

    def __init__(self, proc: subprocess.Popen, socket: str, log_path: str):
        self.proc = proc
        self.socket = socket
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def client(self, **options) -> Client:
        return Client(self.socket, **options)

    def stop(self, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM (drain), SIGKILL after ``timeout``; its exit code."""
        return stop_daemon(self.proc, timeout)

    def kill(self) -> int:
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait()

    def __repr__(self) -> str:
        return f"<DaemonProcess pid={self.proc.pid} socket={self.socket!r} returncode={self.proc.returncode}>"


class DaemonProcesses:
    """Starts daemon processes and stops all of them on ``close`` (a context manager).

    ``start(*args, socket=None, env=None, cwd=None)`` runs ``serve --socket <socket> *args`` and
    returns a ``DaemonProcess`` once it answers PING. Without ``socket``, the socket is ``d.sock`` in
    a fresh short folder under /tmp (AF_UNIX paths are limited to 107 bytes) made with
    ``socket_dir_mode`` (0o755 lets another uid reach the socket). Logs go to ``log_dir``.
    """

    def __init__(self, log_dir: str | os.PathLike, *, stop_timeout: float = STOP_TIMEOUT):
        self.log_dir = Path(log_dir)
        self.stop_timeout = stop_timeout
        self.started: list[DaemonProcess] = []
        self._folders: list[str] = []

    def start(self, *args: str, socket: str | None = None, env: dict | None = None, cwd: str | None = None,
              socket_dir_mode: int | None = None, timeout: float = START_TIMEOUT) -> DaemonProcess:
        if socket is None:
            folder = tempfile.mkdtemp(prefix="ssd-", dir="/tmp")
            self._folders.append(folder)
            if socket_dir_mode is not None:
                os.chmod(folder, socket_dir_mode)
            socket = f"{folder}/d.sock"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = str(self.log_dir / f"daemon{len(self.started)}.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(serve_command(socket, *args), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env if env is not None else dict(os.environ),
                                    cwd=cwd)
        daemon = DaemonProcess(proc, socket, log_path)
        self.started.append(daemon)  # stopped on close even if it never answers
        wait_until_answering(proc, socket, log_path=log_path, timeout=timeout)
        return daemon

    __call__ = start

    def close(self) -> None:
        for daemon in self.started:
            stop_daemon(daemon.proc, self.stop_timeout)
        for folder in self._folders:
            shutil.rmtree(folder, ignore_errors=True)
        self.started.clear()
        self._folders.clear()

    def __enter__(self) -> DaemonProcesses:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def wait_until(condition, what: str, timeout: float = 60.0, every: float = 0.01) -> None:
    """Await until ``condition()`` is true, looking every ``every`` seconds; ``AssertionError``
    naming ``what`` after ``timeout`` seconds (a generous deadline, never a guessed sleep)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: still false after {timeout} s"
        await asyncio.sleep(every)
