"""The Redis peer of the benchmarks: a local ``redis-server`` on a free loopback port, not durable
(``--save '' --appendonly no``), stopped afterwards. Shared by bench_daemon.py (column (c)) and
bench_spark.py (P4), so that both set it up the same way on a fresh machine.

    from redis_peer import RedisServer, RedisUnavailable

    with RedisServer() as server:       # installs Debian's redis-server with apt-get if missing
        server.port, server.client()    # a redis.Redis on it

``redis-server`` is looked up on PATH; when it is missing and we are root, Debian's package is
installed with apt-get (after an ``apt-get update`` if the first try finds nothing). Otherwise
``RedisUnavailable`` says what to run. ``python benchmarks/redis_peer.py`` checks this alone.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

START_TIMEOUT = 30.0  # seconds for redis-server to answer PING


class RedisUnavailable(RuntimeError):
    """No redis-server, and it could not be installed here."""


def _apt_install(package: str) -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", package], check=False,
                   stdout=subprocess.DEVNULL, env=env)


def ensure_redis_server() -> str:
    """The path of ``redis-server``, installed with apt-get first if it is missing and we are root."""
    exe = shutil.which("redis-server")
    if exe:
        return exe
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise RedisUnavailable("redis-server is missing: install it (`sudo apt-get install -y redis-server`)")
    print("redis-server is missing: installing Debian's package with apt-get ...", file=sys.stderr, flush=True)
    _apt_install("redis-server")
    if not shutil.which("redis-server"):  # a fresh machine has no package lists yet
        subprocess.run(["apt-get", "update", "-q"], check=False, stdout=subprocess.DEVNULL)
        _apt_install("redis-server")
    exe = shutil.which("redis-server")
    if not exe:
        raise RedisUnavailable("redis-server is missing and `apt-get install -y redis-server` did not install it")
    return exe


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A ``redis-server`` process on 127.0.0.1:``port``, its data folder removed when stopped."""

    def __init__(self, exe: str | None = None, start_timeout: float = START_TIMEOUT):
        self.exe = exe
        self.start_timeout = start_timeout
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self.folder: str | None = None

    def start(self) -> RedisServer:
        import redis

        exe = self.exe or ensure_redis_server()
        self.folder = tempfile.mkdtemp(prefix="ssb-redis-", dir="/tmp")
        self.port = free_loopback_port()
        self.proc = subprocess.Popen([exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", self.folder],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.start_timeout
        with redis.Redis(host="127.0.0.1", port=self.port) as r:
            while True:
                try:
                    r.ping()
                    return self
                except redis.ConnectionError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        code = self.proc.poll()
                        self.stop()
                        raise RedisUnavailable(f"redis-server did not answer on port {self.port} "
                                               f"(exit code {code})") from None
                    time.sleep(0.05)

    def client(self, **options):
        """A redis-py client on this server."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, **options)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":  # a check of this module alone: install if needed, start, round trip, stop
    with RedisServer() as server:
        c = server.client()
        c.set(b"k", b"v")
        assert c.get(b"k") == b"v"
        print(f"redis-server {c.info()['redis_version']} answered on 127.0.0.1:{server.port}")
        c.close()
    assert server.proc is not None and server.proc.poll() is not None
    print("stopped")
