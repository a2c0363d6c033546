"""Shared fixtures: both codec implementations, a local PySpark session, AWS env hygiene, daemons
in-process and as processes; the Hypothesis profiles; the ``spark`` marker on every Spark test."""
from __future__ import annotations

import asyncio
import os
import socket

import pytest
import uvloop
from hypothesis import settings

from statestore_async.codecs import twins

# Hypothesis profiles: "full" (``make test``: the counts written in the tests) and "fast" (``make
# test-fast`` sets STATESTORE_HYPOTHESIS_PROFILE=fast): a tenth of the examples, at least 10. A test
# without its own count gets the profile's; a test with ``@settings(max_examples=N)`` is scaled at
# collection (``_scale_hypothesis_examples``); a @given function defined inside a test, which
# collection cannot see, writes ``max_examples=max_examples(N)``.
HYPOTHESIS_PROFILE = os.environ.get("STATESTORE_HYPOTHESIS_PROFILE", "full")
settings.register_profile("full")  # the defaults
settings.register_profile("fast", max_examples=10)
settings.load_profile(HYPOTHESIS_PROFILE)


def max_examples(full: int) -> int:
    """``full`` under the full profile; a tenth of it (at least 10) under the fast one."""
    return max(10, full // 10) if HYPOTHESIS_PROFILE == "fast" else full


def _scale_hypothesis_examples(item) -> None:
    """Under the fast profile, a Hypothesis test that states its own ``max_examples`` runs
    ``max_examples(N)`` of them. Its settings are the ones ``@settings``/``@given`` attach to the
    test function (``_hypothesis_internal_use_settings``, read when the test runs); a Hypothesis
    that stops attaching them leaves the count unchanged."""
    fn = getattr(item, "obj", None)
    fn = getattr(fn, "__func__", fn)  # a method: its function carries the settings
    stated = getattr(fn, "_hypothesis_internal_use_settings", None)
    if not getattr(fn, "is_hypothesis_test", False) or not isinstance(stated, settings):
        return
    if getattr(fn, "_statestore_examples_scaled", False):  # parametrized: one function, several items
        return
    fn._statestore_examples_scaled = True
    wanted = max_examples(stated.max_examples)
    if wanted < stated.max_examples:
        fn._hypothesis_internal_use_settings = settings(stated, max_examples=wanted)


def pytest_asyncio_loop_factories(config, item):
    """Every async test runs twice: under plain asyncio and under uvloop (the daemon's default)."""
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """A test that asks for the ``spark`` fixture starts a Spark session: it carries the ``spark``
    marker whether or not its module says so, so that ``-m "not spark"`` never starts the JVM.
    Under the fast Hypothesis profile, stated example counts are scaled down."""
    for item in items:
        if "spark" in getattr(item, "fixturenames", ()) and item.get_closest_marker("spark") is None:
            item.add_marker(pytest.mark.spark)
        if HYPOTHESIS_PROFILE == "fast":
            _scale_hypothesis_examples(item)


def implementations(name: str):
    """pytest params for the reference and the compiled twin of ``name``.

    A compiled module that is missing is a failure, not a skip, unless STATESTORE_NO_EXTENSIONS=1.
    """
    params = [pytest.param(twins.reference(name), id="ref")]
    if not twins.NO_EXTENSIONS:
        params.append(pytest.param(name, id="native"))
    return params


def resolve_impl(param):
    """Turn a param made by ``implementations`` into a module (importing the compiled one now)."""
    if isinstance(param, str):
        return twins.native(param)
    return param


def lookup_args(keys):
    """A batch lookup's arguments for ``keys`` (``lookup_spans``, ``block_indexes``): the packed keys,
    their offsets and empty found / value-offset / value-length arrays."""
    import numpy as np
    fr = twins.reference("framing")
    kbuf = fr.encode_list(keys)
    n = len(keys)
    koff = np.frombuffer(fr.list_offsets(kbuf)[0], np.int64)
    return kbuf, koff, np.zeros(n, np.uint8), np.zeros(n, np.int64), np.zeros(n, np.int64)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def _no_real_aws_credentials(monkeypatch):
    """Real AWS credentials of the machine must never reach a test."""
    for var in list(os.environ):
        if var.startswith("AWS_"):
            monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="session")
def spark(tmp_path_factory):
    """One local[2] SparkSession for the whole run (starting Spark costs seconds)."""
    pyspark = pytest.importorskip("pyspark")
    from pyspark.sql import SparkSession

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", os.sys.executable)
    tmp = tmp_path_factory.mktemp("spark")
    session = (
        SparkSession.builder.master("local[2]")
        .appName("statestore_async-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.warehouse.dir", str(tmp / "warehouse"))
        .config("spark.local.dir", str(tmp / "local"))
        .config("spark.driver.extraJavaOptions", f"-Djava.io.tmpdir={tmp} -XX:-UsePerfData")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
    assert pyspark


@pytest.fixture(scope="session")
def seaweedfs():
    """A real S3 server (SeaweedFS) on loopback for the whole run, stopped at the end."""
    from statestore_async.testing.seaweedfs import SeaweedFS

    server = SeaweedFS().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(seaweedfs):
    """A fresh bucket on the SeaweedFS server."""
    return seaweedfs.create_bucket()


@pytest.fixture
def aws_env(monkeypatch, seaweedfs):
    """The standard AWS chain (of this process and of the daemons it starts) reaches SeaweedFS."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweedfs.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweedfs.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


@pytest.fixture
def proxy(seaweedfs):
    """A fault-injecting proxy in front of SeaweedFS (``statestore_async.testing.faultproxy``)."""
    from statestore_async.testing.faultproxy import FaultProxy

    p = FaultProxy(seaweedfs.port).start()
    yield p
    p.stop()


@pytest.fixture
def s3(seaweedfs):
    """A direct S3 client on the server (not through the proxy): the test's own eyes."""
    import botocore.session

    return botocore.session.get_session().create_client(
        "s3", endpoint_url=seaweedfs.endpoint_url, aws_access_key_id=seaweedfs.access_key,
        aws_secret_access_key=seaweedfs.secret_key, region_name="us-east-1")


@pytest.fixture
def sockdir():
    """A short folder under /tmp for Unix sockets (AF_UNIX paths are limited to 107 bytes)."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="ssa-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemon_process(tmp_path):
    """Start real daemon processes (``statestore-async serve``): ``daemon_process(*args, socket=None,
    env=None, cwd=None, socket_dir_mode=None)`` returns a ``DaemonProcess`` (``.socket``, ``.proc``,
    ``.log()``) once its socket answers PING; every one is stopped at the end of the test, pass or fail.
    A module-scoped fixture uses ``statestore_async.testing.daemon.DaemonProcesses`` the same way."""
    from statestore_async.testing.daemon import DaemonProcesses

    with DaemonProcesses(tmp_path / "daemons") as daemons:
        yield daemons.start


@pytest.fixture
async def daemon_factory(sockdir):
    """Start in-process daemons: ``await daemon_factory(open_objstore=None, **settings)``; all are
    stopped (drained) at the end of the test."""
    from statestore_async.config import DaemonConfig
    from statestore_async.daemon.server import Daemon

    started = []

    async def make(*, open_objstore=None, **settings):
        settings.setdefault("socket", f"{sockdir}/d{len(started)}/d.sock")
        d = Daemon(DaemonConfig(**settings), open_objstore=open_objstore)
        await d.start()
        started.append(d)
        return d

    try:
        yield make
    finally:
        for d in started:
            await d.stop()


@pytest.fixture
def daemon():
    """A daemon process for task-level tests (``spark_cluster.Daemon``), stopped afterwards; a
    module may define its own ``daemon`` (e.g. module-scoped) instead."""
    from spark_cluster import Daemon

    with Daemon() as d:
        yield d


@pytest.fixture
def root(tmp_path):
    """A ``file://`` checkpoint root in the test's temporary folder."""
    return f"file://{tmp_path}/state"
