"""The daemon's Unix socket: its file and folder, and who is on the other end.

``prepare_socket_path`` makes the socket's folder ours (and not world-writable), refuses a live
daemon's socket and removes a stale one; ``peer_credentials`` reads a connected peer's pid, uid
and gid (SO_PEERCRED), which the server checks against ``allowed_uids``.
"""
from __future__ import annotations

import logging
import os
import socket
import stat
import struct

from statestore_async.errors import InterfaceError

log = logging.getLogger("statestore_async.daemon")

_PEERCRED = struct.Struct("3i")


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a connected Unix socket."""
    pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid, gid


def prepare_socket_path(path: str, socket_mode: int) -> None:
    """Create the socket's folder (owned by us), refuse a live daemon's socket, remove a stale one."""
    if len(os.fsencode(path)) > 107:
        raise InterfaceError(f"socket path {path!r} is longer than the 107 bytes AF_UNIX allows")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        dir_mode = 0o700 | (0o050 if socket_mode & 0o060 else 0) | (0o005 if socket_mode & 0o006 else 0)
        os.makedirs(folder, exist_ok=True)
        os.chmod(folder, dir_mode)
    st = os.stat(folder)
    if st.st_uid != os.geteuid():
        raise InterfaceError(f"socket folder {folder} belongs to uid {st.st_uid}, not to this daemon ({os.geteuid()})")
    if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
        raise InterfaceError(f"socket folder {folder} is world-writable: anyone could replace the socket")
    if not os.path.lexists(path):
        return
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise InterfaceError(f"{path} exists and is not a socket; not touching it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        log.info("removing stale socket %s", path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return
    except OSError as exc:
        raise InterfaceError(f"cannot tell whether a daemon serves {path}: {exc}") from None
    finally:
        probe.close()
    raise InterfaceError(f"a live daemon already serves {path}")
