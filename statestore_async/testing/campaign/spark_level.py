"""The Spark-level seeded fault campaign: real streaming queries under a nemesis, checked against
an exact oracle.

A schedule (``draw(seed)``) is a small workload and one to a few fault events, all drawn from the
seed. The workload: a stream of ``(user, event time)`` rows (``statestore_async.testing.sessions``,
3-5 micro-batches of one parquet file each, plus a trailing empty one), a processor — per-key or
vectorized event-time sessions with timers (fired timers marked in the output), or a per-user
counter whose state has a TTL on a processing-time clock —, the partition count, and where the
query stops and restarts (the input arrives in two parts; the second run may use another
partition count: a rescale). Its store root is a local folder or ``s3://`` (SeaweedFS behind the
fault proxy). An event: a fault, the batch (``step``) and the hook point (``phase``) where it
fires, and its parameters:

* ``daemon_kill`` / ``daemon_term``: SIGKILL / SIGTERM the node's daemon (the next task starts one);
* ``driver_kill``: SIGKILL the driver; a new driver restarts the query from its checkpoint;
* ``task_fail``: the task raises on its first attempt; Spark runs a second one;
* ``task_kill``: the task's Python worker (the daemon's client) is SIGKILLed; Spark retries the task;
* ``s3_outage`` / ``s3_latency`` / ``s3_lost_answer`` / ``s3_5xx``: through the fault proxy, every
  connection cut for a while, requests slowed, the answer of the next PUT under the root lost
  (the server did it), or a share of requests answered 503 for a while;
* ``disk_full``: the daemon's file cache (``cache_dir``, on a 64 MiB tmpfs of its own) has no
  space and no inodes left for a while (needs the right to mount; else it does not fire);
* ``clock_jump``: the processing-time clock jumps forward or back from a batch on (TTL counter).

Phases are the product's hook points (``spark.shared.hooks``, armed with ``testing.faults.arm``): ``before_commit`` and
``after_commit`` in tasks, ``before_fence``, ``after_manifest`` and ``after_sink`` in the driver;
``clock`` for a clock jump. Each event fires at most once (the control socket of ``Env`` decides),
so a replay of its batch runs clean.

``run`` runs the schedule's queries in the ``Env``'s long-lived driver (``spark_driver``), running
a query again after it failed and starting a new driver after one was killed, then checks:

* every batch's output equals the oracle's (the sessions a batch closes and the timers it fires;
  the counter's values), as multisets: a row missing is ``lost``, a row the oracle has that came
  twice (in one batch or two) is ``doubled``, anything else is ``wrong``;
* the final state (read from the files, ``state.reader.load_state``) equals the oracle's;
* every manifest version (the versions the driver answered durable) loads, every partition of it,
  from the object store alone — what a fresh daemon does;
* the daemon's RSS, sampled every 0.2 s, stays within ``memory_budget`` + 65 MiB + 48 MiB (the
  bound of docs/GUARANTEES.md).

Not injected at this level (the store level does them): ``speculative_dup`` (Spark launches no
speculative copy on a host that runs the task, and local mode is one host; ``task_fail`` after
the commit leaves the same two committed attempts of one version, one after the other),
``client_kill_mid_frame`` (a worker cannot be stopped between two bytes of one frame from a hook
point; ``task_kill`` kills it between frames).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from statestore_async.spark.shared import placement
from statestore_async.testing import sessions as S
from statestore_async.testing.campaign.spark_driver import REPLY, BatchClock

LEVEL = "spark"
FAULTS = ("daemon_kill", "daemon_term", "driver_kill", "task_fail", "task_kill", "s3_outage", "s3_latency",
          "s3_lost_answer", "s3_5xx", "disk_full", "clock_jump")
PHASES = ("before_commit", "after_commit", "before_fence", "after_manifest", "after_sink", "clock")
TASK_POINTS = ("before_commit", "after_commit")
DRIVER_POINTS = ("before_fence", "after_manifest", "after_sink")
PHASES_OF = {
    "daemon_kill": TASK_POINTS + ("before_fence", "after_manifest"),
    "daemon_term": TASK_POINTS + ("before_fence", "after_manifest"),
    "driver_kill": DRIVER_POINTS,
    "task_fail": TASK_POINTS,
    "task_kill": TASK_POINTS,
    "s3_outage": TASK_POINTS + ("before_fence",),
    "s3_latency": TASK_POINTS + ("before_fence",),
    "s3_lost_answer": TASK_POINTS + ("before_fence",),
    "s3_5xx": TASK_POINTS + ("before_fence",),
    "disk_full": TASK_POINTS + ("before_fence",),
    "clock_jump": ("clock",),
}
OPERATOR = "campaign"
MIB = 1 << 20
MEMORY_BUDGET = 64 * MIB
RSS_OVERHEAD = (65 + 48) * MIB   # the empty daemon's RSS and the working overhead (docs/GUARANTEES.md)
CLOCK_T0_MS = 1_800_000_000_000
CLOCK_STEP_MS = 10_000            # the processing-time clock's advance per batch
CACHE_BYTES = 16 * MIB             # the daemon's file cache, on a 64 MiB tmpfs when this process may mount one
MAX_RUNS = 10                     # query runs (failed, killed, clean) per part of a schedule


@dataclass(frozen=True)
class Event:
    """One nemesis action: ``fault`` at hook point ``phase`` of batch ``step``; ``params`` as
    ``(name, value)`` pairs (``partition``, ``attempt``, ``seconds``, ``delta_ms`` …)."""

    fault: str
    step: int
    phase: str
    params: tuple = ()

    def param(self, name: str, default: Any = None) -> Any:
        return dict(self.params).get(name, default)


@dataclass(frozen=True)
class Schedule:
    seed: int
    events: tuple[Event, ...]
    workload: dict = field(hash=False, compare=False)

    def describe(self) -> str:
        w = self.workload
        parts = f"{w['partitions'][0]}" + (f"->{w['partitions'][1]}" if w["partitions"][1] != w["partitions"][0] else "")
        head = (f"seed {self.seed}: {w['kind']} on {w['store']}, {w['users']} users, {w['batches']} batches "
                f"(restart after {w['split']}), partitions {parts}")
        lines = [head] + [f"  batch {e.step} {e.phase}: {e.fault} {dict(e.params) or ''}".rstrip() for e in self.events]
        return "\n".join(lines)


@dataclass
class Outcome:
    schedule: Schedule
    ok: bool
    lost: int
    doubled: int
    wrong: int
    unloadable: int
    rss_peak: int | None
    rss_bound: int | None
    coverage: set[tuple[str, str]]
    detail: str
    seconds: float
    runs: int = 0           # query runs, the failed and killed ones included
    drivers: int = 0        # drivers started for the schedule (after a driver_kill)


# -- drawing a schedule ---------------------------------------------------------------------------
def draw(seed: int, size: int = 3) -> Schedule:
    """The schedule of ``seed`` (deterministic): its workload and 1..``size`` events."""
    rng = random.Random(seed)
    kind = rng.choice(("perkey", "vectorized", "counter"))
    batches = rng.randint(3, 5)
    before = rng.randint(1, 4)
    after = rng.choice([n for n in (1, 2, 3, 4) if n != before]) if rng.random() < 0.4 else before
    workload: dict[str, Any] = {
        "kind": kind, "store": rng.choice(("file", "s3")), "users": rng.randint(15, 50), "batches": batches,
        "split": rng.randint(1, batches - 1), "partitions": (before, after), "stream_seed": rng.randrange(1 << 30),
        "ttl_ms": rng.choice((15_000, 25_000, 35_000))}
    faults = [f for f in FAULTS if (workload["store"] == "s3" or not f.startswith("s3_"))
              and (kind == "counter" or f != "clock_jump")]
    events = []
    for _ in range(rng.randint(1, size)):
        fault = rng.choice(faults)
        phase = rng.choice(PHASES_OF[fault])
        step = rng.randint(0, batches)  # batches + 1 files: the trailing empty one too
        parts = before if step < workload["split"] else after
        params: list[tuple[str, Any]] = []
        if phase in TASK_POINTS:
            params.append(("partition", rng.randrange(parts)))
        if fault in ("s3_outage", "disk_full"):
            params.append(("seconds", round(rng.uniform(0.5, 4.0), 1)))
        elif fault in ("s3_latency", "s3_5xx"):
            params.append(("seconds", round(rng.uniform(1.0, 4.0), 1)))
            params.append(("latency" if fault == "s3_latency" else "rate",
                           round(rng.uniform(0.1, 0.5), 2)))
        elif fault == "clock_jump":
            params.append(("delta_ms", rng.choice((-15_000, -5_000, 20_000, 40_000, 90_000))))
        events.append(Event(fault, step, phase, tuple(params)))
    return Schedule(seed, tuple(sorted(events, key=lambda e: (e.step, PHASES.index(e.phase), e.fault))), workload)


# -- the oracle -----------------------------------------------------------------------------------
Row = tuple[str, int, int, int]


def stream_of(schedule: Schedule) -> S.SessionStream:
    w = schedule.workload
    return S.generate(users=w["users"], batches=w["batches"], seed=w["stream_seed"], step_s=30, active=0.4)


def clock_of(schedule: Schedule) -> BatchClock:
    jumps: dict[int, int] = {}
    for e in schedule.events:
        if e.fault == "clock_jump":
            jumps[e.step] = jumps.get(e.step, 0) + int(e.param("delta_ms"))
    return BatchClock(CLOCK_T0_MS, CLOCK_STEP_MS, jumps)


def session_batches(stream: S.SessionStream) -> tuple[list[list[Row]], dict[str, list[S.Session]]]:
    """Per file (the trailing empty one included), the rows the session processors emit — the
    sessions the batch's watermark closes and, for a user without rows, a mark ``(user, at, at, 0)``
    per fired timer (as ``sessions.fired_timers``) —; and every user's open sessions at the end."""
    sessions: dict[str, list[S.Session]] = {}
    out: list[list[Row]] = []
    gap = stream.gap_ms
    for b, rows in enumerate([*stream.batches, []]):
        wm = stream.watermarks[b]
        emitted: list[Row] = []
        times: dict[str, list[int]] = {}
        for u, t in rows:
            if wm is None or t > wm:
                times.setdefault(u, []).append(t)
        for u, ts in times.items():
            closed, still = S.split_due(sessions.get(u, ()), wm, gap)
            emitted += [(u, *s) for s in closed]
            sessions[u] = S.add_events(still, ts, gap)
        for u, ss in sessions.items():
            if u not in times:
                closed, sessions[u] = S.split_due(ss, wm, gap)
                emitted += [(u, e + gap, e + gap, 0) for _, e, _ in closed] + [(u, *s) for s in closed]
        out.append(emitted)
    return out, {u: ss for u, ss in sessions.items() if ss}


def counter_batches(stream: S.SessionStream, clock: BatchClock, ttl_ms: int,
                    ) -> tuple[list[list[Row]], dict[str, tuple[int, tuple[int, int]]], int]:
    """Per file, the ``TtlCounter``'s rows at the batch's clock; the state live at the last batch's
    clock (``user -> (expires, (count, total))``) and that clock."""
    state: dict[str, tuple[int, tuple[int, int]]] = {}
    out: list[list[Row]] = []
    now = clock.now_ms(0)
    for b, rows in enumerate([*stream.batches, []]):
        now = clock.now_ms(b)
        per_user: dict[str, list[int]] = {}
        for u, t in rows:
            per_user.setdefault(u, []).append(t)
        emitted: list[Row] = []
        for u, ts in per_user.items():
            expires, (count, total) = state.get(u, (0, (0, 0)))
            if expires <= now:
                count, total = 0, 0
            count, total = count + len(ts), total + sum(t % 1000 for t in ts)
            state[u] = (now + ttl_ms, (count, total))
            emitted.append((u, count, total, len(ts)))
        out.append(emitted)
    return out, {u: v for u, v in state.items() if v[0] > now}, now


# -- the environment ------------------------------------------------------------------------------
class _Driver:
    """One ``spark_driver`` process in a session of its own, started at once; ``ready`` waits for
    its first line (its SparkSession is up)."""

    def __init__(self, master: str, log_path: str):
        env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop
        self.proc = subprocess.Popen([sys.executable, "-m", "statestore_async.testing.campaign.spark_driver", master],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env=env, start_new_session=True)
        self._ok = False
        self._stopped = False
        self._starting = threading.Thread(target=self._wait_ready, name="campaign-driver-start", daemon=True)
        self._starting.start()

    def _wait_ready(self) -> None:
        reply = self.reply(timeout=600)
        self._ok = bool(reply and reply.get("ready"))

    def ready(self) -> bool:
        self._starting.join()
        return self._ok and self.alive()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ask(self, job: dict, timeout: float) -> dict | None:
        """Send ``job``; its reply, or None when the driver died or hung (then it is killed)."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
        except OSError:
            return None
        return self.reply(timeout)

    def reply(self, timeout: float) -> dict | None:
        """The driver's next reply line, or None when it died (or gave none within ``timeout``:
        then it is killed)."""
        out = self.proc.stdout
        assert out is not None
        result: list[dict | None] = [None]

        def read() -> None:
            for line in out:
                if line.startswith(REPLY):
                    result[0] = json.loads(line[len(REPLY):])
                    return

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():  # hung
            self.stop()
            t.join(10)
        return result[0]

    def stop(self) -> None:
        """SIGKILL its session: the driver, its JVM and its Python workers."""
        if self._stopped:
            return
        self._stopped = True
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
        self._log.close()


class _Control(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    allow_reuse_address = True


class Env:
    """What schedules share: SeaweedFS and the fault proxy in front of it, the node's daemon socket
    (its daemon started by the first task, again after a kill), the control socket the hooks ask,
    and the long-lived driver process, with a spare one (started while the driver works, it
    takes over when a schedule kills the driver: no JVM start in the schedule's time). Everything
    is stopped on exit, even on failure."""

    def __init__(self, workdir: str, *, master: str = "local[2,3]", keep_failed: bool = True,
                 s3: bool = True, spare_driver: bool = True, log=None) -> None:
        self.workdir = os.path.abspath(workdir)
        self.master = master
        self.keep_failed = keep_failed
        self.s3 = s3
        self.log = log or (lambda msg: None)
        self.sockdir = ""  # short: a Unix socket path has at most 107 bytes
        self.seaweed: Any = None
        self.proxy: Any = None
        self.bucket = ""
        self.spare_driver = spare_driver
        self.driver: _Driver | None = None
        self._spare: _Driver | None = None
        self.drivers_started = 0
        self._server: _Control | None = None
        self._lock = threading.Lock()
        self._events: tuple[Event, ...] = ()
        self._fired: set[int] = set()
        self._coverage: set[tuple[str, str]] = set()
        self._root_prefix = ""
        self._timers: list[threading.Timer] = []
        self._outages = 0
        self.cache: Any = None  # the daemon's cache disk (``store_level.CacheDisk``), which disk_full fills

    # paths
    @property
    def socket(self) -> str:
        return os.path.join(self.sockdir, "d.sock")

    @property
    def control(self) -> str:
        return os.path.join(self.sockdir, "control.sock")

    def daemon_env(self) -> dict[str, str]:
        env = {"STATESTORE_MEMORY_BUDGET": str(MEMORY_BUDGET), "STATESTORE_EXIT_WHEN_IDLE": "0",
               "STATESTORE_CACHE_DIR": os.path.join(self.sockdir, "cache"), "STATESTORE_CACHE_BYTES": str(CACHE_BYTES)}
        if self.seaweed is not None:
            env.update(self.seaweed.env())
            env["STATESTORE_S3_ENDPOINT_URL"] = self.proxy.endpoint_url
        return env

    def s3_options(self, through_proxy: bool) -> dict[str, str]:
        opts = dict(self.seaweed.client_options())
        if through_proxy:
            opts["endpoint_url"] = self.proxy.endpoint_url
        return opts

    # lifecycle
    def __enter__(self) -> Env:
        os.makedirs(self.workdir, exist_ok=True)
        self.sockdir = tempfile.mkdtemp(prefix="ssc-camp-", dir="/tmp")
        try:
            if self.s3:
                from statestore_async.testing.faultproxy import FaultProxy
                from statestore_async.testing.seaweedfs import SeaweedFS

                self.seaweed = SeaweedFS(os.path.join(self.workdir, "seaweedfs")).start(timeout=90)
                self.bucket = self.seaweed.create_bucket()
                self.proxy = FaultProxy(self.seaweed.port, seed=1).start()
            self.cache = _cache_disk(os.path.join(self.sockdir, "cache"))
            env = self

            class Handler(socketserver.StreamRequestHandler):
                def handle(self) -> None:
                    message = json.loads(self.rfile.readline())
                    self.wfile.write(json.dumps({"act": env._fire(message)}).encode() + b"\n")

            self._server = _Control(self.control, Handler)
            threading.Thread(target=self._server.serve_forever, name="campaign-control", daemon=True).start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_driver(spare=True)
        for _ in range(2):
            if not placement.stop_daemon(self.socket, signal.SIGTERM, timeout=20):
                break
        placement.stop_daemon(self.socket, signal.SIGKILL, timeout=5)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self._reset_proxy()
        if self.cache is not None:
            self.cache.unmount()
            self.cache = None
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None
        if self.seaweed is not None:
            self.seaweed.stop()
            self.seaweed = None
        if self.sockdir:
            shutil.rmtree(self.sockdir, ignore_errors=True)

    # the driver
    def start_driver(self) -> None:
        """Make a new driver the current one: the spare when there is one (started while the
        previous driver worked, so a killed driver costs no JVM start), then start the next spare."""
        self.stop_driver()
        d, self._spare = self._spare, None
        if d is None or not d.ready():
            if d is not None:
                d.stop()
            d = _Driver(self.master, os.path.join(self.workdir, "driver.log"))
            if not d.ready():
                d.stop()
                raise RuntimeError(f"the campaign's driver did not start; see {self.workdir}/driver.log")
        self.driver = d
        self.drivers_started += 1
        if self.spare_driver:
            self._spare = _Driver(self.master, os.path.join(self.workdir, "driver.log"))

    def stop_driver(self, spare: bool = False) -> None:
        """Kill the current driver (and with ``spare`` the spare too)."""
        if self.driver is not None:
            self.driver.stop()
            self.driver = None
        if spare and self._spare is not None:
            self._spare.stop()
            self._spare = None

    def run_query(self, job: dict, timeout: float) -> tuple[str, str]:
        """Run ``job`` in the driver: ``("ok", "")``, ``("failed", error)``, or ``("killed", "")``
        when the driver died (the caller runs it again in a new driver)."""
        if self.driver is None or not self.driver.alive():
            self.start_driver()
        d = self.driver
        assert d is not None
        reply = d.ask(job, timeout)
        if reply is None:
            self.stop_driver()
            return "killed", ""
        return ("ok", "") if reply["ok"] else ("failed", str(reply.get("error")))

    # the nemesis
    def arm(self, events: tuple[Event, ...], root_prefix: str) -> None:
        with self._lock:
            self._events, self._fired, self._coverage = events, set(), set()
            self._root_prefix = root_prefix

    def disarm(self) -> set[tuple[str, str]]:
        with self._lock:
            self._events = ()
            coverage, self._coverage = self._coverage, set()
        self._reset_proxy()
        return coverage

    def _reset_proxy(self) -> None:
        for t in self._timers:
            t.cancel()
        self._timers = []
        if self.cache is not None:
            self.cache.free()
        if self.proxy is not None:  # a lost answer armed and not used names a root no later schedule has
            self.proxy.latency = 0.0
            self.proxy.error_rate = 0.0
            if self._outages:
                self.proxy.outage(0)  # ends it
        self._outages = 0

    def _later(self, seconds: float, fn) -> None:
        t = threading.Timer(seconds, fn)
        t.daemon = True
        t.start()
        self._timers.append(t)

    def _fire(self, message: dict) -> str:
        """A hook reached an armed event's point: fire it unless it fired already. The faults of
        this process are done here; the answer tells the hook what it does itself."""
        with self._lock:
            index = int(message["event"])
            if index in self._fired or index >= len(self._events):
                return ""
            self._fired.add(index)
            event = self._events[index]
            if event.fault == "disk_full" and not (self.cache is not None and self.cache.available):
                return ""  # no disk of its own to fill (mounting a tmpfs needs root): not fired
            self._coverage.add((event.fault, event.phase))
        self.log(f"fire {event.fault} at batch {message['batch']} {message['point']} partition "
                 f"{message.get('partition')} attempt {message.get('attempt')}")
        fault = event.fault
        if fault in ("driver_kill", "task_kill"):
            return "kill_self"
        if fault == "task_fail":
            return "fail"
        if fault in ("daemon_kill", "daemon_term"):
            pid = placement.daemon_pid(self.socket)
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL if fault == "daemon_kill" else signal.SIGTERM)
                except ProcessLookupError:
                    pass
            return ""
        seconds = float(event.param("seconds", 1.0))
        if fault == "disk_full":
            cache = self.cache
            cache.fill()
            self._later(seconds, cache.free)
            return ""
        proxy = self.proxy
        if proxy is None:
            return ""
        if fault == "s3_outage":
            self._outages += 1
            proxy.outage(seconds)
        elif fault == "s3_latency":
            proxy.latency = float(event.param("latency"))
            self._later(seconds, lambda: setattr(proxy, "latency", 0.0))
        elif fault == "s3_5xx":
            proxy.error_rate = float(event.param("rate"))
            self._later(seconds, lambda: setattr(proxy, "error_rate", 0.0))
        elif fault == "s3_lost_answer":
            proxy.drop_next_response("PUT", self._root_prefix)
        return ""


def _cache_disk(path: str) -> Any:
    """The daemon's cache folder on a tmpfs of its own (``store_level.CacheDisk``: mounted when this
    process may, else ``available`` is False and ``disk_full`` does not fire); None without it."""
    try:
        from statestore_async.testing.campaign.store_level import CacheDisk
    except ImportError:
        os.makedirs(path, exist_ok=True)
        return None
    from pathlib import Path

    disk = CacheDisk(Path(path))
    disk.mount()
    return disk


class _RssSampler:
    """The peak RSS of the daemon at ``socket`` (whichever process serves it), every ``every`` s."""

    def __init__(self, socket_path: str, every: float = 0.2):
        self.socket_path, self.every = socket_path, every
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="campaign-rss", daemon=True)

    def _run(self) -> None:
        pid = None
        while not self._stop.is_set():
            if pid is None or not os.path.exists(f"/proc/{pid}"):
                pid = placement.daemon_pid(self.socket_path)
            if pid is not None:
                try:
                    with open(f"/proc/{pid}/status") as f:
                        for line in f:
                            if line.startswith("VmRSS:"):
                                self.peak = max(self.peak, int(line.split()[1]) * 1024)
                except OSError:
                    pid = None
            self._stop.wait(self.every)

    def __enter__(self) -> _RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


# -- one schedule ---------------------------------------------------------------------------------
def _write_files(stream: S.SessionStream, folder: str, files: range) -> None:
    """Files ``files`` of the stream (``sessions.write_batches``' names and increasing mtimes; the
    one past the last batch is the trailing empty file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(folder, exist_ok=True)
    for i in files:
        rows = stream.batches[i] if i < len(stream.batches) else []
        path = os.path.join(folder, f"batch-{i:05d}.parquet")
        tmp = os.path.join(folder, f".batch-{i:05d}.parquet")
        pq.write_table(pa.table({"user": pa.array([u for u, _ in rows], pa.string()),
                                 "et": pa.array([t for _, t in rows], pa.int64())}), tmp)
        os.utime(tmp, (1_000_000 + i, 1_000_000 + i))
        os.replace(tmp, path)


def job_for(schedule: Schedule, env: Env, paths: dict[str, str], part: int) -> dict[str, Any]:
    """The driver's job for part ``part`` (0: up to the restart, 1: the rest) of ``schedule``."""
    w = schedule.workload
    stream = stream_of(schedule)
    clock = clock_of(schedule)
    events = [(i, e.phase, e.step, e.param("partition"), 0 if e.fault in ("task_fail", "task_kill") else None)
              for i, e in enumerate(schedule.events) if e.phase != "clock"]
    return {"kind": w["kind"], "src": paths["src"], "root": paths["root"], "ckpt": paths["ckpt"], "out": paths["out"],
            "operator": OPERATOR, "socket": env.socket, "control": env.control, "daemon_env": env.daemon_env(),
            "s3_options": env.s3_options(True) if w["store"] == "s3" else None, "partitions": w["partitions"][part],
            "key_groups": 16, "gap_ms": stream.gap_ms, "delay_ms": stream.delay_ms, "ttl_ms": w["ttl_ms"],
            "clock": {"t0_ms": clock.t0_ms, "step_ms": clock.step_ms, "jumps": {str(b): d for b, d in clock.jumps.items()}},
            "events": events, "fence_timeout": 15, "timeout": 300}


@dataclass
class Execution:
    """What running a schedule's queries left behind: its folder and root, and how it went."""

    folder: str
    paths: dict[str, str]            # src, root, ckpt, out
    stream: S.SessionStream
    finished: bool                   # both parts of the input processed to the end
    detail: str                      # the last error, when not finished
    rss_peak: int | None
    coverage: set[tuple[str, str]]
    runs: int
    drivers: int


def execute(schedule: Schedule, env: Env) -> Execution:
    """Run ``schedule``'s queries on fresh roots and checkpoints in ``env``: the first part of the
    input, then the rest (at the second partition count), each query run again after it failed or
    its driver was killed (``MAX_RUNS`` runs at most)."""
    w = schedule.workload
    if w["store"] == "s3" and env.seaweed is None:
        raise RuntimeError("this schedule's root is on s3:// and the Env was made with s3=False")
    name = f"s{schedule.seed}-{uuid.uuid4().hex[:6]}"
    folder = os.path.join(env.workdir, name)
    root = f"s3://{env.bucket}/{name}" if w["store"] == "s3" else f"file://{folder}/state"
    paths = {"src": os.path.join(folder, "src"), "root": root, "ckpt": os.path.join(folder, "ckpt"),
             "out": os.path.join(folder, "out")}
    stream = stream_of(schedule)
    env.arm(schedule.events, f"/{env.bucket}/{name}/" if w["store"] == "s3" else "")
    runs, drivers0, detail = 0, env.drivers_started, ""
    finished = True
    try:
        with _RssSampler(env.socket) as rss:
            for part, files in enumerate((range(0, w["split"]), range(w["split"], w["batches"] + 1))):
                _write_files(stream, paths["src"], files)
                job = job_for(schedule, env, paths, part)
                for _ in range(MAX_RUNS):
                    runs += 1
                    started = time.monotonic()
                    status, error = env.run_query(job, timeout=job["timeout"] + 60)
                    env.log(f"  part {part} run {runs}: {status} in {time.monotonic() - started:.1f}s {error[:300]}")
                    if status == "ok":
                        break
                    detail = error or detail
                else:
                    finished = False
                    detail = f"part {part} did not finish in {MAX_RUNS} runs; last error: {detail[:1500]}"
                    break
    finally:
        coverage = env.disarm()
    if finished:  # the batches at and after a clock jump ran with the jumped clock
        coverage |= {(e.fault, e.phase) for e in schedule.events if e.fault == "clock_jump"}
    return Execution(folder, paths, stream, finished, detail, rss.peak or None, coverage, runs,
                     env.drivers_started - drivers0)


def run(schedule: Schedule, env: Env) -> Outcome:
    """Run ``schedule`` (``execute``), then check it (``check``; module docstring). Its files are
    removed when it passed, kept (and named in ``detail``) when not, unless ``env.keep_failed`` is off."""
    t0 = time.monotonic()
    ex = execute(schedule, env)
    if ex.finished:
        outcome = check(schedule, env, ex)
    else:
        outcome = Outcome(schedule, False, 0, 0, 0, 0, ex.rss_peak, MEMORY_BUDGET + RSS_OVERHEAD, set(), ex.detail, 0.0)
    outcome.coverage, outcome.runs, outcome.drivers = ex.coverage, ex.runs, ex.drivers
    outcome.seconds = time.monotonic() - t0
    if outcome.ok or not env.keep_failed:
        shutil.rmtree(ex.folder, ignore_errors=True)
    else:
        outcome.detail += f" (files kept in {ex.folder})"
    return outcome


def _outputs(out: str) -> dict[int, list[Row]]:
    res: dict[int, list[Row]] = {}
    for name in os.listdir(out) if os.path.isdir(out) else ():
        if name.endswith(".json") and name[:-5].isdigit():
            with open(os.path.join(out, name)) as f:
                res[int(name[:-5])] = [tuple(r) for r in json.load(f)]
    return res


def compare_outputs(expected: list[list[Row]], got: dict[int, list[Row]]) -> tuple[int, int, int, str]:
    """``(lost, doubled, wrong, first difference)`` of the sink's rows per batch against the
    oracle's (see the module docstring)."""
    exp_all = Counter(r for rows in expected for r in rows)
    got_all = Counter(r for rows in got.values() for r in rows)
    lost = sum((exp_all - got_all).values())
    extra = got_all - exp_all
    doubled = sum(c for r, c in extra.items() if r in exp_all)
    wrong = sum(c for r, c in extra.items() if r not in exp_all)
    detail = ""
    misplaced = 0  # with the same rows in all: rows not in their batch
    for b in sorted(set(range(len(expected))) | set(got)):
        want = Counter(expected[b]) if b < len(expected) else Counter()
        have = Counter(got.get(b, []))
        if want != have:
            misplaced += sum((want - have).values())
            if not detail:
                missing = sorted((want - have).elements())[:3]
                surplus = sorted((have - want).elements())[:3]
                present = "absent" if b not in got else f"{len(got[b])} rows"
                detail = f"batch {b} ({present}): missing {missing}, unexpected {surplus}"
    if not (lost or doubled or wrong):
        wrong = misplaced
    return lost, doubled, wrong, detail


def _state_sessions(value: Any) -> list[tuple[int, int, int]]:
    """The open sessions a stored ``sessions`` value holds: the per-key processor's tuple of
    triples, or the vectorized one's row ``(start, end, events, more)`` (``more``: packed triples)."""
    import numpy as np

    if isinstance(value, tuple) and len(value) == 4 and (value[3] is None or isinstance(value[3], bytes)):
        if value[3]:
            flat = np.frombuffer(value[3], "<i8").reshape(-1, 3)
            return [(int(row[0]), int(row[1]), int(row[2])) for row in flat]
        return [(int(value[0]), int(value[1]), int(value[2]))]
    return [tuple(s) for s in value]


def check(schedule: Schedule, env: Env, ex: Execution) -> Outcome:
    """Compare a finished execution's outputs and state with ``schedule``'s oracle; load every
    manifest version; the daemon's RSS against its bound."""
    paths, stream, rss_peak = ex.paths, stream_of(schedule), ex.rss_peak
    w = schedule.workload
    s3_options = env.s3_options(False) if w["store"] == "s3" else None
    details: list[str] = []
    if w["kind"] == "counter":
        expected, final, now = counter_batches(stream, clock_of(schedule), w["ttl_ms"])
        stored = _final_state(paths["root"], s3_options, now, details)
        got_state: dict[str, Any] = {k[0]: (v[0], tuple(v[1])) for (n, k), v in stored.items() if n == "count"}
        want_state: dict = final
    else:
        expected, open_sessions = session_batches(stream)
        stored = _final_state(paths["root"], s3_options, None, details)
        got_state = {k[0]: sorted(_state_sessions(v)) for (n, k), v in stored.items() if n == "sessions"}
        want_state = {u: sorted(ss) for u, ss in open_sessions.items()}
        # and the timers: one per open session, at its close time
        timers: dict[str, list[int]] = {}
        for u, at in final_timers(paths["root"], s3_options):
            timers.setdefault(f"timers of {u}", []).append(at)
        got_state.update({k: sorted(v) for k, v in timers.items()})
        want_state.update({f"timers of {u}": sorted(e + stream.gap_ms for _, e, _ in ss)
                           for u, ss in open_sessions.items()})
    lost, doubled, wrong, first = compare_outputs(expected, _outputs(paths["out"]))
    if first:
        details.append(first)
    bad_state = sorted(k for k in set(got_state) | set(want_state) if got_state.get(k) != want_state.get(k))
    if bad_state:
        wrong += len(bad_state)
        k = bad_state[0]
        details.append(f"final state of {len(bad_state)} keys differs, e.g. {k}: stored {got_state.get(k)}, "
                       f"expected {want_state.get(k)}")
    unloadable, versions, why = load_every_version(paths["root"], s3_options, env)
    if unloadable:
        details.append(f"{unloadable} partition states of {versions} manifest versions do not load: {why}")
    bound = MEMORY_BUDGET + RSS_OVERHEAD
    if rss_peak is not None and rss_peak > bound:
        details.append(f"daemon RSS peak {rss_peak / MIB:.1f} MiB over its bound {bound / MIB:.1f} MiB")
    ok = not (lost or doubled or wrong or unloadable) and (rss_peak is None or rss_peak <= bound) and versions > 0
    if versions == 0:
        details.append("no manifest was written")
    return Outcome(schedule, ok, lost, doubled, wrong, unloadable, rss_peak, bound, set(), "; ".join(details), 0.0)


def _final_state(root: str, s3_options: dict | None, now_ms: int | None, details: list[str]) -> dict:
    """The latest manifest's state (``state.reader.load_state``; TTL'd values expired by ``now_ms`` left
    out), or ``{}`` with the reason in ``details`` when it does not load."""
    from statestore_async.state.reader import load_state

    try:
        return load_state(root, OPERATOR, s3_options=s3_options, now_ms=now_ms)
    except Exception as exc:  # any failure to read it is a finding
        details.append(f"the final state does not load: {type(exc).__name__}: {exc}"[:500])
        return {}


def final_timers(root: str, s3_options: dict | None) -> list[tuple[str, int]]:
    """``(user, at_ms)`` of every timer (its by-time record) in the latest manifest's state."""
    from statestore_async.codecs import valuecodec
    from statestore_async.files.manifest import list_manifest_versions, read_manifest
    from statestore_async.ids import DEFAULT_STORE_NAME
    from statestore_async.state import keys as state_keys
    from statestore_async.state.reader import load_records, on_root

    async def go(r: str, store: Any) -> list[tuple[str, int]]:
        versions = await list_manifest_versions(store, OPERATOR)
        if not versions:
            return []
        m = await read_manifest(store, OPERATOR, versions[-1])
        out = []
        for p, ref in enumerate(m.stores[DEFAULT_STORE_NAME]):
            for k, _ in await load_records(store, r, OPERATOR, p, ref):
                if len(k) > 2 and k[2] == state_keys.TIMER_AT:
                    _, _, at, enc = state_keys.parse_timer_at(k)
                    out.append((valuecodec.decode_row(enc)[0], at))
        return out

    try:
        return on_root(root, s3_options, go)
    except Exception:  # a state that does not load is counted by load_every_version
        return []


def load_every_version(root: str, s3_options: dict | None, env: Env) -> tuple[int, int, str]:
    """``(partition states that fail to load, manifest versions, first error)``: every partition of
    every manifest version loaded from the object store alone (``files.loader.load_store``)."""
    from statestore_async.files.loader import load_store
    from statestore_async.files.manifest import list_manifest_versions, read_manifest
    from statestore_async.ids import DEFAULT_STORE_NAME, StoreId
    from statestore_async.state.reader import on_root

    async def go(r: str, store: Any) -> tuple[int, int, str]:
        bad, why = 0, ""
        versions = await list_manifest_versions(store, OPERATOR)
        for v in versions:
            m = await read_manifest(store, OPERATOR, v)
            for p, ref in enumerate(m.stores[DEFAULT_STORE_NAME]):
                if ref.is_empty_state:
                    continue
                try:
                    await load_store(store, StoreId(r, OPERATOR, p), ref)
                except Exception as exc:  # any failure to load counts
                    bad += 1
                    why = why or f"version {v} partition {p} ({ref}): {type(exc).__name__}: {exc}"[:500]
        return bad, len(versions), why

    return on_root(root, s3_options, go)


# -- shrinking ------------------------------------------------------------------------------------
def shrink(schedule: Schedule, env: Env, budget: int = 30) -> Schedule:
    """The shortest failing schedule found within ``budget`` runs: drop events one at a time (keep
    a drop that still fails), then shorten the stream and the user count while it still fails."""
    best = schedule
    tries = 0
    changed = True
    while changed and tries < budget:
        changed = False
        for i in range(len(best.events)):
            if tries >= budget:
                break
            candidate = replace(best, events=best.events[:i] + best.events[i + 1:])
            tries += 1
            if not run(candidate, env).ok:
                best, changed = candidate, True
                break
        w = best.workload
        for smaller in ({"users": max(5, w["users"] // 2)},
                        {"batches": max(2, w["batches"] - 1), "split": min(w["split"], max(1, w["batches"] - 2))}):
            if tries >= budget or all(w[k] == v for k, v in smaller.items()):
                continue
            candidate = replace(best, workload={**w, **smaller},
                                events=tuple(e for e in best.events if e.step <= smaller.get("batches", w["batches"])))
            tries += 1
            if not run(candidate, env).ok:
                best, changed = candidate, True
                break
    return best


__all__ = [
    "DRIVER_POINTS",
    "FAULTS",
    "LEVEL",
    "PHASES",
    "TASK_POINTS",
    "Env",
    "Event",
    "Outcome",
    "Schedule",
    "check",
    "compare_outputs",
    "counter_batches",
    "draw",
    "run",
    "session_batches",
    "shrink",
]
