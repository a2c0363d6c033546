"""Peer credentials: a uid that is not on the allow-list gets a coded error and a close."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from statestore_async import errors
from statestore_async.wire import protocol as P
from statestore_async.client.clients import Client

NOBODY = 65534


@pytest.fixture
def start_daemon(tmp_path):
    procs = []
    folders = []

    def start(*args: str) -> str:
        folder = tempfile.mkdtemp(prefix="ssp-", dir="/tmp")
        os.chmod(folder, 0o755)  # so that another uid can reach the socket at all
        folders.append(folder)
        sock = f"{folder}/d.sock"
        log_path = tmp_path / f"daemon{len(procs)}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "statestore_async.cli", "serve", "--socket", sock,
                                     "--socket-mode", "0666", *args], stdout=log, stderr=subprocess.STDOUT)
        procs.append(proc)
        deadline = time.monotonic() + 20
        while not os.path.exists(sock):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"daemon did not start: {log_path.read_text()}")
            time.sleep(0.05)
        return sock

    try:
        yield start
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for f in folders:
            shutil.rmtree(f, ignore_errors=True)


def ping_as(sock: str, uid: int) -> int:
    """Fork, become ``uid``, ping: 0 refused with PermissionDeniedError, 1 served, 2 anything else."""
    pid = os.fork()
    if pid == 0:
        code = 2
        try:
            if uid != os.getuid():
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            try:
                Client(sock, timeout=5, connect_timeout=5).ping(b"x")
                code = 1
            except P.PermissionDeniedError:
                code = 0
            except BaseException as exc:  # noqa: BLE001
                sys.stderr.write(f"unexpected: {exc!r}\n")
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch uid")
def test_a_uid_off_the_list_is_refused(start_daemon):
    sock = start_daemon()  # allow-list: the daemon's own uid (root)
    assert ping_as(sock, NOBODY) == 0
    assert ping_as(sock, os.getuid()) == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch uid")
def test_a_uid_on_the_list_is_served(start_daemon):
    sock = start_daemon("--allowed-uids", f"0,{NOBODY}")
    assert ping_as(sock, NOBODY) == 1


def test_own_uid_refused_when_not_listed(start_daemon):
    sock = start_daemon("--allowed-uids", str(os.getuid() + 1))
    with pytest.raises(P.PermissionDeniedError) as info:
        Client(sock, timeout=5).ping()
    assert info.value.code == P.PermissionDeniedError.code
    assert isinstance(info.value, errors.StateStoreError)
