"""Run a real Spark Connect server — the one the pyspark wheel ships — on loopback, for tests.

``ConnectServer`` starts ``spark-submit --class org.apache.spark.sql.connect.service.SparkConnectServer``
from the installed pyspark in the foreground, as a child process of its own session that this process
owns (``start_new_session``; it also gets SIGTERM if this process dies), so ``stop()`` always ends it
and every process it started. The gRPC endpoint binds 127.0.0.1 on a free port
(``spark.connect.grpc.binding.address`` / ``spark.connect.grpc.binding.port``); the server runs Spark
in ``local[2]`` by default, and its Python processes (foreachBatch functions, UDF workers) run this
interpreter (``PYSPARK_PYTHON``), so they import ``statestore_async`` as the tests do.

The server runs from a Spark home of its own in ``workdir`` (links to the wheel's ``bin``, ``sbin``
and ``jars``) that lacks the wheel's ``python/lib/pyspark.zip``: Spark puts that zip first on its
Python processes' path, and Python compiles every module imported from it at each start (about 2.5
times the CPU of importing the installed, compiled pyspark), while Spark gives a foreachBatch
process a fixed 10 s to start and connect back. Without the zip they import the interpreter's own
pyspark — the same version, the one the client uses.

Its log, its temporary files, warehouse and scratch space stay in one folder (``workdir``);
``log_tail()`` returns the end of the log, and ``explained()`` appends it to any exception raised
in its block. ``client()`` gives a Connect client session for a block and leaves the process a
classic pyspark process afterwards (creating a Connect session marks the whole process as a
Connect client). ``running()`` is the body of a pytest fixture::

    @pytest.fixture(scope="module")
    def connect_server(tmp_path_factory):
        yield from running(tmp_path_factory.mktemp("connect"))
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
# A JVM starting Spark on a loaded 2-core machine can take a minute; the deadline only bounds a hang.
START_TIMEOUT = 300.0
# set by pyspark in a process that created a Connect client session; it switches the process's
# pyspark to Connect (pyspark.sql.utils.is_remote)
CONNECT_MODE_VAR = "SPARK_CONNECT_MODE_ENABLED"
STOP_TIMEOUT = 30.0  # seconds SIGTERM may take before SIGKILL
LOG_TAIL = 12_000  # characters of the log shown with an error

# WARN for Spark and its libraries; INFO for the lines a failing test needs: the server's start, the
# foreachBatch runner and the Python processes it starts (their output is logged by the JVM).
_LOG4J = """\
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss.SSS} %p %c{1}: %m%n%ex
logger.server.name = org.apache.spark.sql.connect.service.SparkConnectServer
logger.server.level = info
logger.service.name = org.apache.spark.sql.connect.service.SparkConnectService
logger.service.level = info
logger.foreachbatch.name = org.apache.spark.sql.connect.planner.StreamingForeachBatchHelper
logger.foreachbatch.level = info
logger.python.name = org.apache.spark.api.python
logger.python.level = info
"""


class ConnectServerError(RuntimeError):
    """The Spark Connect server could not be started (the message carries the end of its log)."""


def spark_home() -> str:
    """The installed pyspark's folder, which holds ``bin/spark-submit`` and the jars."""
    try:
        import pyspark
    except ImportError:
        raise ConnectServerError("pyspark is not installed: pip install -r requirements/test.txt") from None
    home = os.path.dirname(os.path.abspath(pyspark.__file__))
    if not os.path.exists(os.path.join(home, "bin", "spark-submit")):
        raise ConnectServerError(f"{home} has no bin/spark-submit: a pyspark wheel without Spark's launcher")
    if not any("spark-connect" in name for name in os.listdir(os.path.join(home, "jars"))):
        raise ConnectServerError(f"{home}/jars has no spark-connect jar: pyspark >= 4.0 ships it")
    return home


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _autogroup_nice() -> int | None:
    """The nice value of this process's scheduling group (``/proc/self/autogroup``), if the kernel
    groups tasks by session."""
    try:
        with open("/proc/self/autogroup") as f:
            return int(f.read().rsplit("nice", 1)[1])
    except (OSError, IndexError, ValueError):
        return None


def _child_setup(group_nice: int | None) -> Any:
    """What the server's process does before exec: die with its starter (SIGTERM when the process
    that started it dies), and give its new session the starter's scheduling weight: a session of
    its own is a new scheduling group at nice 0 where the kernel groups by session, which would let
    a server started from a low-priority shell compete with everything else at full weight."""

    def setup() -> None:
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass
        if group_nice:
            try:
                with open("/proc/self/autogroup", "w") as f:
                    f.write(str(group_nice))
            except OSError:
                pass

    return setup


class ConnectServer:
    """A Spark Connect server on ``url`` (``sc://127.0.0.1:<port>``), started by ``start()``.

    ``workdir`` (default: a fresh temporary folder, removed by ``stop()``) holds ``server.log`` and
    the server's scratch space. ``conf`` adds Spark settings (``--conf k=v``); ``python`` is the
    interpreter of its Python processes; ``driver_memory`` caps the server's heap.
    """

    def __init__(self, workdir: str | os.PathLike[str] | None = None, *, master: str = "local[2]",
                 python: str = sys.executable, conf: dict[str, str] | None = None,
                 driver_memory: str = "1g") -> None:
        self._own_dir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="spark-connect-"))
        self.master = master
        self.python = python
        self.conf = dict(conf or {})
        self.driver_memory = driver_memory
        self.port = 0
        self.log_path = self.workdir / "server.log"
        self.spark_home = self.workdir / "spark-home"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The client's connection string: ``SparkSession.builder.remote(server.url)``."""
        if not self.port:
            raise ConnectServerError("the Spark Connect server is not started: call start() first")
        return f"sc://127.0.0.1:{self.port}"

    def _link_spark_home(self) -> None:
        """``spark_home``: the wheel's launcher and jars, without its ``python/lib`` zips."""
        wheel = spark_home()
        self.spark_home.mkdir(parents=True, exist_ok=True)
        for name in ("bin", "sbin", "jars", "conf"):
            target, link = Path(wheel, name), self.spark_home / name
            if target.exists() and not link.is_symlink():
                link.symlink_to(target, target_is_directory=True)

    def command(self) -> list[str]:
        """The ``spark-submit`` command line that runs the server in the foreground."""
        home = str(self.spark_home)
        tmp = self.workdir / "tmp"
        java_opts = f"-Djava.io.tmpdir={tmp} -Dlog4j2.configurationFile={self.workdir / 'log4j2.properties'}"
        conf = {
            "spark.connect.grpc.binding.address": "127.0.0.1",
            "spark.connect.grpc.binding.port": str(self.port),
            "spark.connect.grpc.port.maxRetries": "0",  # the chosen port or a clear failure
            "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.ui.enabled": "false",
            "spark.sql.shuffle.partitions": "2",
            "spark.local.dir": str(self.workdir / "local"),
            "spark.sql.warehouse.dir": str(self.workdir / "warehouse"),
            "spark.driver.extraJavaOptions": java_opts,
            "spark.pyspark.python": self.python,
            "spark.pyspark.driver.python": self.python,
        }
        conf.update(self.conf)
        cmd = [os.path.join(home, "bin", "spark-submit"), "--class", SERVER_CLASS, "--master", self.master,
               "--name", "statestore_async Spark Connect", "--driver-memory", self.driver_memory]
        for key, value in conf.items():
            cmd += ["--conf", f"{key}={value}"]
        return cmd

    def env(self) -> dict[str, str]:
        """The server's environment: this one, with Spark found in the wheel and Python pinned."""
        env = dict(os.environ)
        for var in ("SPARK_REMOTE", CONNECT_MODE_VAR, "PYSPARK_SUBMIT_ARGS", "SPARK_CONF_DIR"):
            env.pop(var, None)  # a client setting of the caller's must not turn the server into a client
        env.update({
            "SPARK_HOME": str(self.spark_home),
            "SPARK_CONNECT_MODE": "0",  # as sbin/start-connect-server.sh: a server, not a Connect client
            "SPARK_LOCAL_IP": "127.0.0.1",
            "PYSPARK_PYTHON": self.python,
            "PYSPARK_DRIVER_PYTHON": self.python,
        })
        return env

    def start(self, timeout: float = START_TIMEOUT) -> Self:
        """Start the server; return once its gRPC port accepts connections. A server that exits or
        stays silent for ``timeout`` seconds is stopped and raises ``ConnectServerError`` with its log."""
        if self.proc is not None:
            raise ConnectServerError("this Spark Connect server was already started; make a new one")
        for sub in ("tmp", "local"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        (self.workdir / "log4j2.properties").write_text(_LOG4J)
        self._link_spark_home()
        self.port = free_port()
        with open(self.log_path, "wb") as log:
            # a session of its own: signals to the caller's process group do not reach it, and stop()
            # ends the whole group (the JVM and the Python workers it forked)
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env(), cwd=self.workdir,
                                         start_new_session=True, preexec_fn=_child_setup(_autogroup_nice()))
        try:
            self._wait_until_listening(timeout)
        except BaseException:
            self.stop(remove=False)
            raise
        return self

    def _wait_until_listening(self, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while True:
            status = self._exit_status()
            if status is not None:
                raise ConnectServerError(f"the Spark Connect server exited with {status} before "
                                         f"listening on 127.0.0.1:{self.port}; its log:\n{self.log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise ConnectServerError(f"the Spark Connect server did not listen on 127.0.0.1:{self.port} "
                                         f"within {timeout:.0f} s; its log:\n{self.log_tail()}")
            time.sleep(0.2)

    def alive(self) -> bool:
        return self.proc is not None and self._exit_status() is None

    def _exit_status(self) -> int | None:
        """The server's exit status (``-signal`` if killed), None while it runs; never reaps it, so
        that ``stop()`` can still end its process group."""
        assert self.proc is not None
        if self.proc.returncode is not None:
            return self.proc.returncode
        try:
            info = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)
        except ChildProcessError:
            return self.proc.poll()
        if info is None:
            return None
        return -info.si_status if info.si_code != os.CLD_EXITED else info.si_status

    def log_tail(self, chars: int = LOG_TAIL) -> str:
        """The end of the server's log (its JVM's output and its Python workers')."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"(no log at {self.log_path}: {e})"
        return text[-chars:] if len(text) > chars else text

    @contextlib.contextmanager
    def explained(self) -> Iterator[None]:
        """Any exception raised in the block carries the end of the server's log as a note."""
        try:
            yield
        except BaseException as e:
            e.add_note(f"--- Spark Connect server log ({self.log_path}), last {LOG_TAIL} characters ---\n"
                       f"{self.log_tail()}")
            raise

    def session(self) -> Any:
        """A new Connect client session on this server (``SparkSession.builder.remote(url).create()``).

        pyspark then marks this whole process as a Connect client (``SPARK_CONNECT_MODE_ENABLED``):
        ``pyspark.sql.functions`` builds Connect columns and a later classic
        ``SparkSession.builder.getOrCreate()`` fails (``CONNECT_URL_NOT_SET``). A process that also
        runs classic Spark uses ``client()``, which takes the mark away again."""
        from pyspark.sql import SparkSession

        return SparkSession.builder.remote(self.url).create()

    @contextlib.contextmanager
    def client(self) -> Iterator[Any]:
        """A Connect client session for the block, stopped after it, and the process's Connect mark
        (``SPARK_CONNECT_MODE_ENABLED``) restored as it was: classic Spark in the same process (a
        test run's shared local session) works again after the block."""
        before = os.environ.get(CONNECT_MODE_VAR)
        try:
            session = self.session()
            try:
                yield session
            finally:
                session.stop()
        finally:
            if before is None:
                os.environ.pop(CONNECT_MODE_VAR, None)
            else:
                os.environ[CONNECT_MODE_VAR] = before

    def stop(self, timeout: float = STOP_TIMEOUT, *, remove: bool = True) -> int | None:
        """SIGTERM to the server's process group, SIGKILL after ``timeout``; its exit code. With
        ``remove``, a temporary ``workdir`` of its own is deleted (a given one is kept)."""
        code = None
        if self.proc is not None:
            if self.proc.returncode is None:  # not reaped yet: the group id is still ours
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGTERM)
                self._wait_unreaped(timeout)
                # the whole group, the exited leader kept as a zombie so its id cannot be reused:
                # Python workers it forked must not outlive it
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
            code = self.proc.wait()
        if remove and self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return code

    def live_processes(self) -> list[int]:
        """Pids of the server's process group (the JVM and the Python processes it started) that
        still run (zombies, which run nothing, excepted): empty once ``stop()`` has ended it."""
        if self.proc is None:
            return []
        live = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            state, pgrp = fields[0], int(fields[2])
            if pgrp == self.proc.pid and state not in ("Z", "X"):
                live.append(int(entry))
        return live

    def _wait_unreaped(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the server to exit without reaping it (``WNOWAIT``)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._exit_status() is not None:
                return
            time.sleep(0.1)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.alive() else "stopped"
        return f"<ConnectServer {state} port={self.port} workdir={str(self.workdir)!r}>"


# Spark gives the Python process of a foreachBatch function a fixed 10 s to connect back to the
# server (PythonWorkerFactory.createSimpleWorker, not configurable in Spark 4.3); its imports (the
# Connect client: pandas, pyarrow, grpc) take longer than that on a loaded machine.
WORKER_CONNECT_TIMEOUT = "Timed out while waiting for the Python worker to connect back"


def start_query(writer: Any, attempts: int = 3) -> Any:
    """``writer.start()`` for a Connect ``DataStreamWriter``, started again (up to ``attempts``
    times in all) when the server gave up waiting for the foreachBatch Python process to connect
    back; any other error is raised at once."""
    for attempt in range(1, attempts + 1):
        try:
            return writer.start()
        except Exception as e:
            if WORKER_CONNECT_TIMEOUT not in str(e) or attempt == attempts:
                raise
    raise AssertionError("unreachable")


def running(workdir: str | os.PathLike[str], **options: Any) -> Iterator[ConnectServer]:
    """A started ``ConnectServer`` in ``workdir`` for the body of a pytest fixture (``yield from``);
    it is stopped when the fixture ends, whatever the tests did. ``options`` go to ``ConnectServer``."""
    server = ConnectServer(workdir, **options).start()
    try:
        yield server
    finally:
        server.stop()
