"""Helpers for the Spark tests: input files, streaming runs, an oracle, daemons, a standalone cluster.

* ``write_batches`` — micro-batches of ``(key string, value bigint)`` as parquet files (2 per batch);
* ``run_stream`` — a file-source query (``maxFilesPerTrigger=2``, ``Trigger.AvailableNow``) into a
  foreachBatch function, raising the query's error;
* ``spark_oracle`` — Spark's own streaming ``groupBy(key).agg(count, sum)`` (update mode) per batch;
* ``Daemon`` — a daemon process on a private socket, stopped (SIGKILL if needed) on exit;
* ``StandaloneCluster`` — master + 2 workers on 127.0.0.1, each with its own daemon socket
  (recipe: ../shared/SPARK_CLUSTER.md), every process stopped on exit.
"""
from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from statestore_async.spark.shared import placement
from statestore_async.testing import faults

SCHEMA = "key string, value bigint"


def write_batches(folder: str, batches: int, rows: int, keys: int, seed: int = 0, first: int = 0) -> list[list[tuple]]:
    """Write batches ``first..first+batches-1`` (2 files each, increasing mtimes); returns their rows."""
    os.makedirs(folder, exist_ok=True)
    out = []
    base = time.time() - 10_000 + first * 10
    for b in range(first, first + batches):
        rng = np.random.Generator(np.random.PCG64(seed * 1000 + b))
        k = rng.integers(0, keys, rows)
        v = rng.integers(0, 1000, rows)
        names = np.char.add("k", np.char.zfill(k.astype(str), 8))
        t = pa.table({"key": pa.array(names.tolist(), pa.string()), "value": pa.array(v, pa.int64())})
        half = rows // 2
        for i, part in enumerate((t.slice(0, half), t.slice(half))):
            path = os.path.join(folder, f"b{b:05d}-{i}.parquet")
            pq.write_table(part, path)
            os.utime(path, (base + b * 10 + i, base + b * 10 + i))
        out.append(list(zip(t["key"].to_pylist(), t["value"].to_pylist())))
    return out


def dict_oracle(batches: list[list[tuple]]) -> tuple[list[dict], dict]:
    """Per batch ``{key: (count, sum)}`` after the batch, for keys of the batch; and the final state."""
    state: dict = {}
    per_batch = []
    for rows in batches:
        touched = set()
        for k, v in rows:
            c, s = state.get(k, (0, 0))
            state[k] = (c + 1, s + v)
            touched.add(k)
        per_batch.append({k: state[k] for k in touched})
    return per_batch, state


def stream(spark, src: str, max_files: int = 2):
    return spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", max_files).parquet(src)


def run_stream(spark, src: str, checkpoint: str, fn, timeout: float = 240.0, transform=None, mode: str = "append"):
    """Run a query over ``src`` to the end (AvailableNow) with ``foreachBatch(fn)``; raise its error."""
    df = stream(spark, src)
    if transform is not None:
        df = transform(df)
    q = (df.writeStream.outputMode(mode).foreachBatch(fn).option("checkpointLocation", checkpoint)
         .trigger(availableNow=True).start())
    try:
        q.awaitTermination(timeout)
    finally:
        if q.isActive:
            q.stop()
            raise TimeoutError(f"the query did not finish within {timeout}s")
    exc = q.exception()
    if exc is not None:
        raise exc
    return q


def spark_oracle(spark, src: str, checkpoint: str) -> dict[int, dict]:
    """Spark's own streaming aggregation: ``{batch_id: {key: (count, sum)}}`` (update mode)."""
    from pyspark.sql import functions as F

    out: dict[int, dict] = {}

    def collect(df, batch_id):
        out[batch_id] = {r["key"]: (r["count"], r["sum"]) for r in df.collect()}

    run_stream(spark, src, checkpoint, collect,
               transform=lambda d: d.groupBy("key").agg(F.count("*").alias("count"), F.sum("value").alias("sum")),
               mode="update")
    return out


def collector(out: dict):
    """A sink that stores ``{batch_id: {key: (count, sum)}}`` of the operator's output."""

    def sink(df, batch_id):
        out[batch_id] = {r[0]: (r[1], r[2]) for r in df.collect()}

    return sink


def final_count_sum(state: dict, name: str = "total") -> dict:
    """``{key: (count, sum)}`` from ``load_state`` output of a count/sum operator."""
    return {k[0]: tuple(v) for (n, k), v in state.items() if n == name}


class Daemon:
    """A daemon process on ``socket`` (started with ``placement.start_daemon``), stopped on ``close``."""

    def __init__(self, env: dict | None = None, folder: str | None = None):
        self.folder = folder or tempfile.mkdtemp(prefix="ssd-", dir="/tmp")
        self.socket = os.path.join(self.folder, "d.sock")
        self.env = env
        placement.start_daemon(self.socket, env=env)

    def pid(self):
        return placement.daemon_pid(self.socket)

    def kill(self) -> None:
        placement.stop_daemon(self.socket, signal.SIGKILL, timeout=10)

    def close(self) -> None:
        """Stop whatever daemon serves the socket now (tasks may have restarted it)."""
        for _ in range(3):
            if not placement.stop_daemon(self.socket, signal.SIGTERM, timeout=20):
                break
        placement.stop_daemon(self.socket, signal.SIGKILL, timeout=5)
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CLUSTER_CONF = {
    "spark.executor.cores": "1", "spark.cores.max": "2", "spark.executor.memory": "512m",
    "spark.network.timeout": "10s", "spark.executor.heartbeatInterval": "1s", "spark.network.timeoutInterval": "1s",
    "spark.excludeOnFailure.enabled": "true", "spark.excludeOnFailure.task.maxTaskAttemptsPerExecutor": "1",
}


class StandaloneCluster:
    """A Spark standalone master and two workers (A, B) on 127.0.0.1; worker n's executors get
    ``STATESTORE_SOCKET=<run>/node<n>/d.sock`` (a per-node daemon, autostarted by the first task)."""

    def __init__(self, extra_env: dict | None = None):
        import pyspark

        self.spark_home = os.path.dirname(pyspark.__file__)
        self.run = tempfile.mkdtemp(prefix="ssc-cluster-", dir="/tmp")
        self.port = free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.extra_env = extra_env or {}

    def socket(self, node: str) -> str:
        return os.path.join(self.run, f"node{node}", "d.sock")

    def _env(self, **more) -> dict:
        env = dict(os.environ, SPARK_HOME=self.spark_home, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable,
                   SPARK_DAEMON_MEMORY="256m",
                   SPARK_MASTER_OPTS="-Dspark.worker.timeout=10 -Dspark.master.rest.enabled=false",
                   SPARK_WORKER_OPTS="-Dspark.worker.timeout=10", **self.extra_env)
        env.update(more)
        return env

    def _spawn(self, name: str, args: list[str], env: dict) -> None:
        log = open(os.path.join(self.run, f"{name}.log"), "wb")
        self.procs[name] = subprocess.Popen([os.path.join(self.spark_home, "bin", "spark-class"), *args], env=env,
                                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        log.close()

    def _wait_log(self, name: str, text: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        path = os.path.join(self.run, f"{name}.log")
        while time.monotonic() < deadline:
            if text in open(path, errors="replace").read():
                return
            if self.procs[name].poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"{name} did not log {text!r}: {open(path, errors='replace').read()[-3000:]}")

    def start_worker(self, node: str) -> None:
        d = os.path.join(self.run, f"node{node}")
        os.makedirs(os.path.join(d, "tmp"), exist_ok=True)
        env = self._env(STATESTORE_SOCKET=self.socket(node), SPARK_LOCAL_DIRS=os.path.join(d, "local"),
                        _JAVA_OPTIONS=f"-Djava.io.tmpdir={d}/tmp -XX:-UsePerfData")
        name = f"worker{node}-{len([k for k in self.procs if k.startswith('worker' + node)])}"
        self._spawn(name, ["org.apache.spark.deploy.worker.Worker", self.url, "--host", "127.0.0.1", "--cores", "1",
                           "--memory", "1g", "--webui-port", str(free_port()), "--work-dir", os.path.join(d, "work")],
                    env)
        self._wait_log(name, "Successfully registered with master")
        self.current = getattr(self, "current", {})
        self.current[node] = name

    def start(self) -> StandaloneCluster:
        self._spawn("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port",
                               str(self.port), "--webui-port", str(free_port())], self._env())
        self._wait_log("master", "I have been elected leader")
        for n in ("A", "B"):
            self.start_worker(n)
        return self

    def kill_node(self, node: str) -> None:
        """SIGKILL worker ``node``, its executor JVMs, and its daemon."""
        w = self.procs[self.current[node]]
        kids = subprocess.run(["pgrep", "-P", str(w.pid), "-f", "CoarseGrainedExecutorBackend"], capture_output=True,
                              text=True).stdout.split()
        for pid in [w.pid, *map(int, kids)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        placement.stop_daemon(self.socket(node), signal.SIGKILL, timeout=10)
        w.wait(10)

    def session(self, app: str = "statestore_async-cluster-test"):
        from pyspark.sql import SparkSession

        os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
        os.environ["PYSPARK_PYTHON"] = sys.executable  # the driver names the workers' Python (sc.pythonExec)
        b = (SparkSession.builder.master(self.url).appName(app).config("spark.ui.enabled", "false")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.sql.shuffle.partitions", "2"))
        for k, v in CLUSTER_CONF.items():
            b = b.config(k, v)
        return b.getOrCreate()

    def executor_count(self, spark) -> int:
        ids = spark.sparkContext._jsc.sc().getExecutorIds().mkString(",")
        return len([i for i in ids.split(",") if i])

    def stop(self) -> None:
        for name, p in list(self.procs.items()):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for name, p in list(self.procs.items()):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(5)
        for node in ("A", "B"):
            placement.stop_daemon(self.socket(node), signal.SIGKILL, timeout=10)
        shutil.rmtree(self.run, ignore_errors=True)

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc):
        self.stop()


# --- a driver in its own process: ``python tests/spark_cluster.py job …`` ----------------------------
def job_main(argv: list[str]) -> int:
    """Run the count/sum operator over ``--src`` to the end; each batch's output goes to ``<out>/<b>.json``.

    ``--faults`` is a JSON list of ``testing.faults.Fault`` fields. Used by the tests that kill the driver
    or need task retries (``--master 'local[2,2]'``).
    """
    import argparse
    import json

    ap = argparse.ArgumentParser()
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--src", required=True)
    ap.add_argument("--root", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--socket", default="", help="daemon socket ('' = $STATESTORE_SOCKET of the executors)")
    ap.add_argument("--faults", default="[]")
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--key-groups", type=int, default=128)
    ap.add_argument("--vectorized", action="store_true")
    ap.add_argument("--cluster", action="store_true", help="standalone-cluster settings (2 executors of 1 core)")
    ap.add_argument("--s3-options", default=None, help="JSON options for the driver's S3 object store")
    ap.add_argument("--mark-at", type=int, default=-1, help="create <out>/at-<b> when batch b starts")
    a = ap.parse_args(argv)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from statestore_async.spark import StatefulOperator
    from statestore_async.spark.api.examples import CountSum, VectorizedCountSum

    spark = driver_session(a.master, CLUSTER_CONF if a.cluster else None)
    os.makedirs(a.out, exist_ok=True)
    if a.cluster:
        deadline = time.monotonic() + 60
        while len([i for i in spark.sparkContext._jsc.sc().getExecutorIds().mkString(",").split(",") if i]) < 2:
            if time.monotonic() > deadline:
                raise SystemExit("the executors did not register")
            time.sleep(0.2)

    def sink(df, batch_id):
        rows = {r[0]: [r[1], r[2]] for r in df.collect()}
        tmp = os.path.join(a.out, f".{batch_id}.json")
        with open(tmp, "w") as f:
            json.dump(rows, f)
        os.replace(tmp, os.path.join(a.out, f"{batch_id}.json"))

    op = StatefulOperator(a.root, "counts", ["key"], VectorizedCountSum() if a.vectorized else CountSum(),
                          "key string, count bigint, sum bigint", num_partitions=a.partitions, num_key_groups=a.key_groups,
                          socket_path=a.socket or None, fence_timeout=30 if a.cluster else 10,
                          s3_options=json.loads(a.s3_options) if a.s3_options else None)
    faults.arm(op, json.loads(a.faults))
    inner = op.foreach_batch(sink)

    def fn(df, batch_id):
        if batch_id == a.mark_at:
            open(os.path.join(a.out, f"at-{batch_id}"), "w").close()
        inner(df, batch_id)

    run_stream(spark, a.src, a.ckpt, fn)
    with open(os.path.join(a.out, "progress.json"), "a") as f:
        for p in op.history:
            f.write(json.dumps({"batch": p.batch_id, "refs": {k: [v.version, v.ckptid] for k, v in p.refs.items()},
                                "locations": p.locations}) + "\n")
    spark.stop()
    return 0


def run_job(args: list[str], timeout: float = 180.0) -> subprocess.CompletedProcess:
    """Run ``job_main`` in a child process (its own Spark driver); returns the completed process.

    Its ``--faults`` are armed on its operator (``statestore_async.testing.faults.arm``; with none,
    the hook points cost nothing)."""
    return run_driver(os.path.abspath(__file__), ["job", *args], timeout)


def run_driver(script: str, args: list[str], timeout: float = 300.0) -> subprocess.CompletedProcess:
    """``script`` run as ``__main__`` with ``args`` in a child process (a driver of its own), this
    folder on its path; every process of its session is killed afterwards (the JVM and Python workers a SIGKILLed
    driver leaves). Returns the completed process, stdout and stderr together."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, script, *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the driver's JVM and Python workers, if any are left
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def driver_session(master: str = "local[2]", conf: dict[str, str] | None = None):
    """The SparkSession of a driver in its own process (``run_driver``): loopback only, no UI, two
    shuffle partitions, errors only in the log."""
    from pyspark.sql import SparkSession

    b = (SparkSession.builder.master(master).config("spark.ui.enabled", "false")
         .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
         .config("spark.sql.shuffle.partitions", "2"))
    for k, v in (conf or {}).items():
        b = b.config(k, v)
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def json_batch_sink(out: str):
    """A foreachBatch sink writing each batch's session rows ``(user, start, end, events)`` to
    ``<out>/<batch id>.json`` atomically: a batch written again replaces its file."""
    from statestore_async.testing.campaign.spark_driver import json_sink

    return json_sink(out)


def read_outputs(out: str) -> dict[int, dict]:
    import json

    res = {}
    for path in glob.glob(os.path.join(out, "[0-9]*.json")):
        with open(path) as f:
            res[int(os.path.basename(path)[:-5])] = {k: tuple(v) for k, v in json.load(f).items()}
    return res


if __name__ == "__main__":
    if sys.argv[1:2] == ["job"]:
        sys.exit(job_main(sys.argv[2:]))
    sys.exit("usage: spark_cluster.py job --src … --root … --ckpt … --out … --socket …")
