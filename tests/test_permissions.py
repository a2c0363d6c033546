"""Peer credentials: a uid that is not on the allow-list gets a coded error and a close."""
from __future__ import annotations

import os
import sys

import pytest

from statestore_async import errors
from statestore_async.client import Client
from statestore_async.wire import protocol as P

NOBODY = 65534


@pytest.fixture
def start_daemon(daemon_process):
    """``start_daemon(*args)``: a daemon process whose socket (mode 0666, in a 0755 folder) another
    uid can reach; returns the socket path once it answers. Stopped at the end of the test."""

    def start(*args: str) -> str:
        return daemon_process("--socket-mode", "0666", *args, socket_dir_mode=0o755).socket

    return start


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
            except BaseException as exc:
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
