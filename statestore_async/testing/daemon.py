"""Run a real daemon (``statestore-async serve``) as a separate process, for tests and benchmarks."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from statestore_async.client.clients import Client
from statestore_async.errors import StateStoreError


def start_daemon(socket_path: str, *args: str, log_path: str, env: dict | None = None, cwd: str | None = None,
                 timeout: float = 20.0) -> subprocess.Popen:
    """Start ``statestore-async serve --socket socket_path *args``; return once it answers PING.

    Its output goes to ``log_path``; a daemon that exits or never answers raises with its log.
    """
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "statestore_async.cli", "serve", "--socket", socket_path, *args],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env if env is not None else dict(os.environ), cwd=cwd)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}: {open(log_path).read()}")
        try:
            Client(socket_path, timeout=2, connect_timeout=1).ping()
            return proc
        except StateStoreError:
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"daemon did not answer in {timeout} s: {open(log_path).read()}") from None
            time.sleep(0.05)


def stop_daemon(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """SIGTERM (drain), then SIGKILL if it does not exit in ``timeout``; returns its exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
