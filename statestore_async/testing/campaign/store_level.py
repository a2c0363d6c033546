"""The store-level fault campaign: real daemons, real S3 (SeaweedFS behind the fault proxy), and a
model of the Spark driver's protocol instead of Spark.

A schedule (``draw(seed)``) is a workload and a list of nemesis events. The workload is a few
stores (partitions ``0..parts-1`` of one operator under a fresh root), a handful of batches, and
per batch and store a list of operations on counters: ``("inc", key, n)`` adds ``n`` to a key's
count, ``("del", key)`` removes the key. Counters make a replay that applies a batch twice visible
(a count too high: *doubled*), and a version missing a write visible (too low or absent: *lost*).

The driver runs each batch as Spark's would: every store's task opens the version the manifest
names (``open(store, b, ckptid)``), reads the keys it touches (GET_MANY), writes (PUT_MANY,
REMOVE_MANY) and commits version ``b + 1`` with a fresh checkpoint id; the driver then waits until
each committed version is durable (AWAIT_DURABLE) and only then records the batch in its manifest.
A task that fails is retried (a new checkpoint id); a batch that cannot finish (the daemon died,
AWAIT_DURABLE failed, the driver was killed) is replayed from the manifest, on a restarted daemon
when it died. The oracle is the state each version must have, computed by plain dicts.

Faults land at a batch (``Event.step``) and a phase of it: ``load`` (the batch's stores were
released so that their opens load them), ``open``, ``get``, ``put``, ``remove``, ``commit`` (of
one task, ``part``), ``upload`` (all committed, uploads in flight), ``await_durable`` (from a
thread while the driver waits), ``manifest`` (all durable, the manifest not yet written).
Only a batch's first attempt meets its events, so every batch finishes.

The checks (``run``): each batch's output (the counts its tasks computed) equals the oracle's;
every version AWAIT_DURABLE answered ``True`` — including those of attempts that were then
abandoned — loads on a daemon that never served the root (a fresh node with no cache, reading S3
directly) and equals the oracle's state of its version; the final versions do too; the daemon's
peak RSS (``VmHWM``) stays within its memory budget + its RSS when empty + the working overhead
that docs/GUARANTEES.md states. The verdict does not depend on timing: what a fault interrupts
may vary, but every outcome the protocol allows passes and anything else fails.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import random
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from statestore_async.client import Client
from statestore_async.client.blocking import StoreHandle
from statestore_async.errors import StateStoreError, WriterConflictError
from statestore_async.ids import CheckpointRef, StoreId
from statestore_async.testing.daemon import serve_command, start_daemon, stop_daemon, wait_until_answering
from statestore_async.testing.faultproxy import FaultProxy
from statestore_async.testing.seaweedfs import SeaweedFS

LEVEL = "store"
FAULTS: tuple[str, ...] = ("daemon_kill", "daemon_term", "driver_kill", "task_fail", "speculative_dup",
                           "s3_outage", "s3_latency", "s3_lost_answer", "s3_5xx", "disk_full",
                           "client_kill_mid_frame")
PHASES: tuple[str, ...] = ("load", "open", "get", "put", "remove", "commit", "upload", "await_durable",
                           "manifest")
TASK_PHASES = ("open", "get", "put", "remove", "commit")
# the phases each fault can meet (a task's failure or a client killed mid-frame is a task's; a
# speculative second attempt follows a commit)
ALLOWED: dict[str, tuple[str, ...]] = {
    "daemon_kill": PHASES,
    "daemon_term": PHASES,
    "driver_kill": PHASES[1:],
    "task_fail": TASK_PHASES,
    "speculative_dup": ("commit", "upload", "await_durable", "manifest"),
    "s3_outage": PHASES,
    "s3_latency": PHASES,
    "s3_lost_answer": PHASES,
    "s3_5xx": PHASES,
    "disk_full": PHASES,
    "client_kill_mid_frame": TASK_PHASES,
}
# a task's failure lands after its step (a commit answered, then the task fails); a speculative
# attempt starts after the commit it duplicates; every other fault lands before the step
AFTER_STEP = frozenset({"task_fail", "speculative_dup"})

MIB = 1 << 20
WORKING_OVERHEAD = 48 * MIB  # docs/GUARANTEES.md: RSS within budget + empty daemon + working overhead
# two daemon profiles: a roomy one, and a tight one whose stores are evicted, spilled and reloaded
PROFILES: dict[str, dict[str, str]] = {
    "roomy": {"memory_budget": "256MiB", "spill_min_bytes": "1MiB", "snapshot_interval": "10"},
    "tight": {"memory_budget": "256KiB", "spill_min_bytes": "8KiB", "snapshot_interval": "2"},
}
OPERATOR = "op"
MAX_BATCH_ATTEMPTS = 8
MAX_TASK_ATTEMPTS = 4
DURABLE_DEADLINE = 60.0  # seconds a batch attempt waits for its versions to be durable
OPEN_DEADLINE = 30.0  # seconds a task retries an OPEN refused by a writer slot not yet freed
DRAIN_TIMEOUT = 15.0
START_TIMEOUT = 180.0  # seconds a daemon may take to answer its first PING (many starting on a loaded machine)
CLIENT_TIMEOUT = 60.0


# --- schedules ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Event:
    """One nemesis action: ``fault`` at batch ``step``, ``phase``; ``params`` are (name, value) pairs
    (``part``: the task it meets; ``seconds``, ``rate``, ``latency``, ``delay``, ``winner``)."""

    fault: str
    step: int
    phase: str
    params: tuple = ()

    def param(self, name: str, default: Any = None) -> Any:
        for k, v in self.params:
            if k == name:
                return v
        return default

    def describe(self) -> str:
        extra = " ".join(f"{k}={v}" for k, v in self.params)
        return f"batch {self.step} {self.phase}: {self.fault} {extra}".rstrip()


@dataclass(frozen=True)
class Schedule:
    seed: int
    events: tuple[Event, ...]
    workload: dict = field(compare=False, hash=False)

    def describe(self) -> str:
        w = self.workload
        head = (f"seed {self.seed}: {w['parts']} stores x {w['batches']} batches, {w['keys']} keys, "
                f"value pad {w['pad']}, daemon {w['profile']}")
        return "\n".join([head] + [f"  {e.describe()}" for e in self.events] or [head])

    def to_json(self) -> dict:
        return {"seed": self.seed, "level": LEVEL,
                "events": [{"fault": e.fault, "step": e.step, "phase": e.phase, "params": [list(p) for p in e.params]}
                           for e in self.events]}


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
    checked_versions: int = 0
    attempts: int = 0

    def to_json(self) -> dict:
        return {"level": LEVEL, "seed": self.schedule.seed, "ok": self.ok, "lost": self.lost,
                "doubled": self.doubled, "wrong": self.wrong, "unloadable": self.unloadable,
                "rss_peak": self.rss_peak, "rss_bound": self.rss_bound,
                "coverage": sorted([f, p] for f, p in self.coverage), "detail": self.detail,
                "seconds": round(self.seconds, 3), "checked_versions": self.checked_versions,
                "attempts": self.attempts, "events": len(self.schedule.events)}


def _params(rng: random.Random, fault: str, parts: int) -> tuple:
    part = ("part", rng.randrange(parts))
    if fault == "s3_outage":
        return (part, ("seconds", rng.choice((0.2, 0.5, 1.0))))
    if fault == "s3_latency":
        return (part, ("seconds", rng.choice((0.3, 1.0))), ("latency", rng.choice((0.05, 0.2))))
    if fault in ("s3_lost_answer", "s3_5xx"):
        return (part, ("seconds", rng.choice((0.3, 1.0))), ("rate", rng.choice((0.3, 0.7, 1.0))))
    if fault == "disk_full":
        return (part, ("seconds", rng.choice((0.3, 1.0))))
    if fault == "speculative_dup":
        return (part, ("winner", rng.choice(("first", "dup"))))
    return (part,)


def draw(seed: int, size: int = 3) -> Schedule:
    """The schedule of ``seed``: same seed, same workload and events. ``size`` is the most events."""
    rng = random.Random(seed)
    parts = rng.randint(1, 3)
    batches = rng.randint(3, 6)
    keys = rng.choice((8, 40, 150))
    pad = rng.choice((0, 0, 64, 1500))
    profile = rng.choice(("roomy", "tight"))
    ops: list[list[list[list]]] = []
    for _ in range(batches):
        per_part = []
        for _ in range(parts):
            n = rng.randint(1, min(60, 2 * keys))
            task = []
            for _ in range(n):
                k = rng.randrange(keys)
                if rng.random() < 0.15:
                    task.append(["del", k])
                else:
                    task.append(["inc", k, rng.randint(1, 5)])
            per_part.append(task)
        ops.append(per_part)
    events = []
    for _ in range(rng.randint(1, max(1, size))):
        fault = rng.choice(FAULTS)
        phase = rng.choice(ALLOWED[fault])
        events.append(Event(fault, rng.randrange(batches), phase, _params(rng, fault, parts)))
    order = {p: i for i, p in enumerate(PHASES)}
    events.sort(key=lambda e: (e.step, order[e.phase], e.param("part", 0), e.fault))
    workload = {"parts": parts, "batches": batches, "keys": keys, "pad": pad, "profile": profile, "ops": ops}
    return Schedule(seed, tuple(events), workload)


# --- the oracle ---------------------------------------------------------------------------------
def key_bytes(i: int) -> bytes:
    return (i % 4096).to_bytes(2, "big") + b"k%06d" % i


def value_bytes(count: int, key: int, pad: int) -> bytes:
    """A counter's stored value: its count, and for one key in three ``pad`` bytes of filler."""
    return b"%d:" % count + (b"x" * pad if key % 3 == 0 else b"")


def parse_count(value: bytes) -> int | None:
    head, sep, _ = value.partition(b":")
    if not sep or not head.isdigit():
        return None
    return int(head)


def apply_ops(state: dict[int, int], ops: list[list]) -> tuple[dict[int, int], list[tuple[int, int | None]]]:
    """The state after ``ops`` and the batch's output: each operation's key and its count after it
    (None: deleted)."""
    new = dict(state)
    out: list[tuple[int, int | None]] = []
    for op in ops:
        if op[0] == "inc":
            new[op[1]] = new.get(op[1], 0) + op[2]
            out.append((op[1], new[op[1]]))
        else:
            new.pop(op[1], None)
            out.append((op[1], None))
    return new, out


def oracle(workload: dict) -> list[list[dict[int, int]]]:
    """``states[p][v]``: the counts of store ``p`` at version ``v``."""
    states: list[list[dict[int, int]]] = [[{}] for _ in range(workload["parts"])]
    for batch in workload["ops"]:
        for p, ops in enumerate(batch):
            states[p].append(apply_ops(states[p][-1], ops)[0])
    return states


@dataclass
class Tally:
    """Differences against the oracle: counts per kind and the first one, for a human."""

    lost: int = 0
    doubled: int = 0
    wrong: int = 0
    unloadable: int = 0
    details: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        if len(self.details) < 8:
            self.details.append(text)

    def compare(self, where: str, got: dict[bytes, bytes], want: dict[int, int], pad: int) -> None:
        """Count every difference between a store's contents ``got`` and the oracle's counts ``want``."""
        wanted = {key_bytes(k): (c, value_bytes(c, k, pad)) for k, c in want.items()}
        for k, (count, value) in wanted.items():
            have = got.get(k)
            if have is None:
                self.lost += 1
                self.note(f"{where}: key {k!r} missing (oracle count {count})")
                continue
            n = parse_count(have)
            if have == value:
                continue
            if n is not None and n > count:
                self.doubled += 1
                self.note(f"{where}: key {k!r} count {n} > oracle {count} (applied twice)")
            elif n is not None and n < count:
                self.lost += 1
                self.note(f"{where}: key {k!r} count {n} < oracle {count}")
            else:
                self.wrong += 1
                self.note(f"{where}: key {k!r} value {have[:40]!r} != oracle {value[:40]!r}")
        for k in got.keys() - wanted.keys():
            self.wrong += 1
            self.note(f"{where}: key {k!r} present, absent in the oracle (value {got[k][:40]!r})")

    def compare_output(self, where: str, got: list[tuple[int, int | None]], want: list[tuple[int, int | None]]) -> None:
        for (k, n), (_, m) in zip(got, want):
            if n == m:
                continue
            if n is None or (m is not None and n < m):
                self.lost += 1
            elif m is None or n > m:
                self.doubled += 1
            self.note(f"{where}: output of key {k}: {n} != oracle {m}")
        if len(got) != len(want):
            self.wrong += 1
            self.note(f"{where}: {len(got)} output rows != oracle {len(want)}")


# --- the shared, costly resources ---------------------------------------------------------------
def _vm_kib(pid: int, field_name: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _parse_size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for u, m in units.items():
        if text.endswith(u):
            return int(text[: -len(u)]) * m
    return int(text)


class CacheDisk:
    """The daemons' cache folder on a small tmpfs of its own, which ``fill`` makes full (no space,
    no inodes) until ``free``. Mounting needs root: without it ``available`` is False and the
    ``disk_full`` events do not fire (the coverage shows it)."""

    def __init__(self, path: Path):
        self.path = path
        self.available = False
        self._fillers: list[Path] = []
        self._lock = threading.Lock()

    def mount(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,nr_inodes=20000", "tmpfs", str(self.path)],
                           capture_output=True, text=True)
        self.available = r.returncode == 0

    def fill(self) -> None:
        with self._lock:
            if not self.available or self._fillers:
                return
            big = self.path / "filler-space"
            self._fillers.append(big)
            try:
                with open(big, "wb") as f:
                    chunk = b"\0" * MIB
                    while True:
                        f.write(chunk)
                        f.flush()
            except OSError:
                pass
            i = 0
            while True:
                p = self.path / f"filler-{i}"
                try:
                    p.touch()
                except OSError:
                    break
                self._fillers.append(p)
                i += 1

    def free(self) -> None:
        with self._lock:
            for p in self._fillers:
                with contextlib.suppress(OSError):
                    p.unlink()
            self._fillers.clear()

    def unmount(self) -> None:
        self.free()
        if self.available:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)
            self.available = False


class Env:
    """What schedules share: one SeaweedFS (or the one given), a bucket, the fault proxy in front of
    it, the cache tmpfs, the verifying daemon (no cache, S3 directly) and the daemons under test,
    kept between schedules while they live (one per profile). A context manager: everything it
    started is stopped on exit, also on failure.

    ``Env(workdir, seaweedfs=None, keep_logs=False)``: ``workdir`` holds logs and the cache disk;
    ``seaweedfs`` reuses a running ``SeaweedFS``."""

    def __init__(self, workdir: str, *, seaweedfs: SeaweedFS | None = None, keep_logs: bool = False):
        self.workdir = Path(workdir)
        self.keep_logs = keep_logs
        self._given_s3 = seaweedfs
        self.s3: SeaweedFS | None = None
        self.proxy: FaultProxy | None = None
        self.bucket = ""
        self.cache = CacheDisk(self.workdir / "cache-disk")
        self.sockdir = ""
        self.verifier: subprocess.Popen | None = None
        self.verifier_socket = ""
        self.daemons: dict[str, Daemon] = {}
        self.closed = False
        self._serial = 0

    # -- lifecycle --
    def __enter__(self) -> Env:
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
            (self.workdir / "logs").mkdir(exist_ok=True)
            self.sockdir = tempfile.mkdtemp(prefix="ssc-", dir="/tmp")
            self.s3 = self._given_s3 or SeaweedFS(str(self.workdir / "seaweedfs")).start()
            self.bucket = self.s3.create_bucket(f"campaign-{uuid.uuid4().hex[:10]}")
            self.proxy = FaultProxy(self.s3.port).start()
            self.cache.mount()
            self.start_verifier()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.closed = True  # no daemon starts after this
        for d in list(self.daemons.values()):
            d.stop()
        self.daemons.clear()
        if self.verifier is not None:
            stop_daemon(self.verifier, 10)
            self.verifier = None
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None
        self.cache.unmount()
        if self.s3 is not None and self._given_s3 is None:
            self.s3.stop()
            shutil.rmtree(self.workdir / "seaweedfs", ignore_errors=True)
        self.s3 = None
        if self.sockdir:
            shutil.rmtree(self.sockdir, ignore_errors=True)

    def daemon_env(self) -> dict[str, str]:
        assert self.s3 is not None
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "STATESTORE_"))}
        env.update({"AWS_ACCESS_KEY_ID": self.s3.access_key, "AWS_SECRET_ACCESS_KEY": self.s3.secret_key,
                    "AWS_DEFAULT_REGION": "us-east-1"})
        return env

    def log_path(self, what: str) -> str:
        self._serial += 1
        return str(self.workdir / "logs" / f"{what}-{self._serial}.log")

    def start_verifier(self) -> None:
        assert self.s3 is not None
        self.verifier_socket = f"{self.sockdir}/verify.sock"
        self.verifier = start_daemon(
            self.verifier_socket, "--s3-endpoint-url", self.s3.endpoint_url, "--s3-region", "us-east-1",
            "--s3-addressing-style", "path", "--cache-dir", "", "--memory-budget", "64MiB",
            log_path=self.log_path("verifier"), env=self.daemon_env(), timeout=START_TIMEOUT)

    def verifier_client(self) -> Client:
        if self.verifier is None or self.verifier.poll() is not None:
            self.start_verifier()
        return Client(self.verifier_socket, timeout=CLIENT_TIMEOUT)

    def daemon(self, profile: str) -> Daemon:
        """The daemon under test of ``profile``, started if it is not running."""
        d = self.daemons.get(profile)
        if d is None:
            d = self.daemons[profile] = Daemon(self, profile)
        d.ensure()
        return d

    def reset_faults(self) -> None:
        if self.proxy is not None:
            self.proxy.outage(0)
            self.proxy.latency = 0.0
            self.proxy.error_rate = 0.0
            self.proxy.drop_response_rate = 0.0
        self.cache.free()


class Daemon:
    """A daemon under test (``serve`` through the fault proxy, its cache on the tmpfs); it is killed,
    terminated and started again by the nemesis. Tracks its peak RSS against its bound."""

    def __init__(self, env: Env, profile: str):
        self.env = env
        self.profile = profile
        self.socket = ""
        self.proc: subprocess.Popen | None = None
        # the next daemon, started ahead in the background: a restart on a loaded machine takes
        # seconds, and a schedule should not wait for it (each daemon has a socket of its own)
        self.standby: tuple[subprocess.Popen, str, str] | None = None
        self.log_paths: list[str] = []
        self.draining: list[subprocess.Popen] = []
        self.empty_rss: int | None = None
        self.peak = 0
        self.budget = _parse_size(PROFILES[profile]["memory_budget"])
        self._started = 0

    def args(self) -> list[str]:
        env = self.env
        assert env.proxy is not None
        p = PROFILES[self.profile]
        cache = str(env.cache.path / self.profile) if env.cache.available else str(env.workdir / f"cache-{self.profile}")
        return ["--s3-endpoint-url", env.proxy.endpoint_url, "--s3-region", "us-east-1", "--s3-addressing-style",
                "path", "--cache-dir", cache, "--cache-bytes", "16MiB", "--memory-budget", p["memory_budget"],
                "--spill-min-bytes", p["spill_min_bytes"], "--snapshot-interval", p["snapshot_interval"],
                "--drain-timeout", str(DRAIN_TIMEOUT), "--open-wait-timeout", "20"]

    @property
    def bound(self) -> int | None:
        return None if self.empty_rss is None else self.budget + self.empty_rss + WORKING_OVERHEAD

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _spawn(self) -> tuple[subprocess.Popen, str, str]:
        if self.env.closed:
            raise RuntimeError("the campaign's Env is closed: no daemon starts")
        self._started += 1
        sock = f"{self.env.sockdir}/{self.profile}-{self._started}.sock"
        log = self.env.log_path(f"daemon-{self.profile}")
        with open(log, "wb") as f:
            proc = subprocess.Popen(serve_command(sock, *self.args()), stdout=f, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=self.env.daemon_env())
        return proc, sock, log

    def ensure(self) -> None:
        """A running daemon: the current one, else the standby (started ahead), else a new one."""
        if self.alive():
            return
        proc, sock, log = self.standby if self.standby is not None else self._spawn()
        self.standby = None
        self.log_paths.append(log)
        try:
            wait_until_answering(proc, sock, log_path=log, timeout=START_TIMEOUT)
        except BaseException:
            stop_daemon(proc, 5)
            raise
        self.proc, self.socket = proc, sock
        if self.empty_rss is None:
            time.sleep(1.0)  # settled, as benchmarks/bench_memory_soak.py measures it (once per profile)
            self.empty_rss = _vm_kib(proc.pid, "VmRSS")
        self.standby = self._spawn()

    def sample(self) -> None:
        if self.proc is not None:
            hwm = _vm_kib(self.proc.pid, "VmHWM")
            if hwm is not None:
                self.peak = max(self.peak, hwm)

    def kill(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.sample()
            self.proc.kill()
            self.proc.wait()

    def terminate(self) -> None:
        """SIGTERM: it drains in the background while a successor may start."""
        if self.alive():
            assert self.proc is not None
            self.sample()
            self.proc.terminate()
            self.draining.append(self.proc)
            self.proc = None  # its successor serves while it drains

    def reap(self) -> list[int]:
        """Wait for the daemons draining after SIGTERM (their exit codes; SIGKILL past the drain)."""
        codes = []
        for proc in self.draining:
            try:
                codes.append(proc.wait(DRAIN_TIMEOUT + 15))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait())
        self.draining.clear()
        return codes

    def stop(self) -> None:
        self.sample()
        if self.proc is not None:
            stop_daemon(self.proc, DRAIN_TIMEOUT + 15)
            self.proc = None
        if self.standby is not None:
            stop_daemon(self.standby[0], 10)
            self.standby = None
        self.reap()

    def client(self) -> Client:
        return Client(self.socket, timeout=CLIENT_TIMEOUT, connect_timeout=5)


# --- the run ------------------------------------------------------------------------------------
class TaskFailed(Exception):
    """A task's injected failure (Spark retries the task)."""


class DriverKilled(Exception):
    """The driver's injected death: the batch in flight is replayed from the manifest."""


class Nemesis:
    """The schedule's events not yet fired, and what they did."""

    def __init__(self, schedule: Schedule, env: Env, run: Run):
        self.pending = list(schedule.events)
        self.env = env
        self.run = run
        self.fired: list[tuple[Event, str]] = []
        self.coverage: set[tuple[str, str]] = set()
        self.timers: list[threading.Timer] = []
        self.driver_killed = threading.Event()
        self.lock = threading.Lock()

    def take(self, batch: int, phase: str, part: int | None, *, after: bool | None = None,
             faults: tuple[str, ...] | None = None) -> list[Event]:
        with self.lock:
            got = [e for e in self.pending
                   if e.step == batch and e.phase == phase
                   and (part is None or e.param("part", 0) == part)
                   and (after is None or (e.fault in AFTER_STEP) == after)
                   and (faults is None or e.fault in faults)]
            for e in got:
                self.pending.remove(e)
            return got

    def later(self, seconds: float, fn: Callable[[], None]) -> None:
        t = threading.Timer(seconds, fn)
        t.daemon = True
        self.timers.append(t)
        t.start()

    def fire(self, e: Event, note: str = "") -> None:
        """Do ``e`` now (driver_kill, task_fail raise; speculative_dup is the driver's)."""
        env, proxy = self.env, self.env.proxy
        assert proxy is not None
        seconds = float(e.param("seconds", 1.0))
        fired = True
        if e.fault == "daemon_kill":
            self.run.daemon.kill()
        elif e.fault == "daemon_term":
            self.run.daemon.terminate()
        elif e.fault == "s3_outage":
            proxy.outage(seconds)
        elif e.fault == "s3_latency":
            proxy.latency = float(e.param("latency", 0.1))
            self.later(seconds, lambda: setattr(proxy, "latency", 0.0))
        elif e.fault == "s3_5xx":
            proxy.error_rate = float(e.param("rate", 0.5))
            self.later(seconds, lambda: setattr(proxy, "error_rate", 0.0))
        elif e.fault == "s3_lost_answer":
            proxy.drop_response_rate = float(e.param("rate", 0.5))
            self.later(seconds, lambda: setattr(proxy, "drop_response_rate", 0.0))
        elif e.fault == "disk_full":
            fired = env.cache.available
            if fired:
                env.cache.fill()
                self.later(seconds, env.cache.free)
        elif e.fault == "driver_kill":
            self.driver_killed.set()
        elif e.fault in ("task_fail", "speculative_dup", "client_kill_mid_frame"):
            pass  # done by the caller
        else:
            raise ValueError(f"unknown fault {e.fault!r}")
        if fired:
            with self.lock:
                self.fired.append((e, note))
                self.coverage.add((e.fault, e.phase))

    def close(self) -> None:
        for t in self.timers:
            t.cancel()
        self.timers.clear()
        self.env.reset_faults()


class Run:
    """One schedule's execution: the driver, its tasks, the manifest, what became durable."""

    def __init__(self, schedule: Schedule, env: Env):
        self.schedule = schedule
        self.env = env
        w = schedule.workload
        self.w = w
        self.root = f"s3://{env.bucket}/s{schedule.seed}-{uuid.uuid4().hex[:8]}"
        self.stores = [StoreId(self.root, OPERATOR, p) for p in range(w["parts"])]
        self.states = oracle(w)
        self.daemon = env.daemon(w["profile"])
        self.nemesis = Nemesis(schedule, env, self)
        self.manifest: list[CheckpointRef] = [CheckpointRef(0, "")] * w["parts"]
        self.durable: dict[tuple[int, CheckpointRef], None] = {}  # (part, ref) answered durable, in order
        self.tally = Tally()
        self.clients: list[Client] = []
        self.attempts = 0
        self.log: list[str] = []
        self._ckpt = 0

    def ckptid(self) -> str:
        self._ckpt += 1
        return hashlib.md5(f"{self.root}/{self._ckpt}".encode()).hexdigest()

    def client(self) -> Client:
        c = self.daemon.client()
        self.clients.append(c)
        return c

    def drop_clients(self) -> None:
        for c in self.clients:
            c.close()
        self.clients.clear()

    # -- a task --
    def open(self, client: Client, part: int, base: CheckpointRef) -> StoreHandle:
        deadline = time.monotonic() + OPEN_DEADLINE
        while True:
            try:
                return client.open(self.stores[part], base.version, base.ckptid or None)
            except WriterConflictError:
                # the daemon has not yet seen the connection of a killed attempt go
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def task(self, batch: int, part: int, client: Client, first: bool, cut: str | None = None,
             signal_fd: int | None = None, base: CheckpointRef | None = None) -> tuple[CheckpointRef, list]:
        """One attempt of store ``part``'s task of ``batch``: its committed ref and its output.
        ``cut``: send only half of that phase's request, then tell ``signal_fd`` and wait to die.
        ``base``: the version it opens (the manifest's, by default)."""
        ops = self.w["ops"][batch][part]
        pad = self.w["pad"]
        if base is None:
            base = self.manifest[part]

        def point(phase: str, after: bool) -> None:
            if not first or cut is not None:
                return
            for e in self.nemesis.take(batch, phase, part, after=after,
                                       faults=tuple(f for f in FAULTS if f not in ("speculative_dup",
                                                                                    "client_kill_mid_frame"))):
                self.nemesis.fire(e)
                if e.fault == "task_fail":
                    raise TaskFailed(f"injected at {phase} of batch {batch} store {part}")
                if e.fault == "driver_kill":
                    raise DriverKilled(f"injected at {phase} of batch {batch}")
            if self.nemesis.driver_killed.is_set():
                raise DriverKilled(f"at {phase} of batch {batch}")

        def cut_here(phase: str, make: Callable[[Any], tuple[int, bytes]]) -> None:
            if cut != phase:
                return
            proto, _ = client._ensure()
            _, frame = make(proto)
            assert client._sock is not None
            client._sock.sendall(frame[: max(1, len(frame) // 2)])
            assert signal_fd is not None
            os.write(signal_fd, b"x")
            time.sleep(3600)

        point("open", False)
        cut_here("open", lambda p: p.send_open(self.stores[part], base.version, base.ckptid or None))
        with self.open(client, part, base) as h:
            point("open", True)
            touched = sorted({op[1] for op in ops})
            keys = [key_bytes(k) for k in touched]
            point("get", False)
            cut_here("get", lambda p: p.send_get_many(h.handle, keys))
            got = h.get_many(keys)
            point("get", True)
            state: dict[int, int] = {}
            for k, v in zip(touched, got):
                if v is not None:
                    n = parse_count(v)
                    if n is None:
                        raise AssertionError(f"store {part} version {base.version}: key {k} has value {v[:40]!r}")
                    state[k] = n
            new, out = apply_ops(state, ops)
            puts = [(key_bytes(k), value_bytes(n, k, pad)) for k, n in sorted(new.items()) if k in touched]
            removes = [key_bytes(k) for k in touched if k not in new]
            point("put", False)
            cut_here("put", lambda p: p.send_put_many(h.handle, puts))
            if puts:
                h.put_many(puts)
            point("put", True)
            point("remove", False)
            cut_here("remove", lambda p: p.send_remove_many(h.handle, removes))
            if removes:
                h.remove_many(removes)
            point("remove", True)
            point("commit", False)
            ckptid = self.ckptid()
            cut_here("commit", lambda p: p.send_commit(h.handle, ckptid))
            ref = h.commit(ckptid)
        point("commit", True)
        return ref, out

    def killed_mid_frame(self, batch: int, part: int, phase: str) -> None:
        """Run the task in a child process that sends half of ``phase``'s request and is SIGKILLed."""
        r, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 1
            try:
                os.close(r)
                c = self.daemon.client()
                self.task(batch, part, c, True, cut=phase, signal_fd=wfd)
            except BaseException:
                code = 2
            finally:
                os._exit(code)
        os.close(wfd)
        try:
            ready, _, _ = select.select([r], [], [], 60)
            got = os.read(r, 1) if ready else b""
        finally:
            os.close(r)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        if got:
            self.nemesis.coverage.add(("client_kill_mid_frame", phase))
            self.nemesis.fired.append((Event("client_kill_mid_frame", batch, phase, (("part", part),)), ""))

    def run_task(self, batch: int, part: int, first: bool) -> tuple[CheckpointRef, list]:
        """A task with Spark's task retries: an injected failure or a killed child is retried."""
        if first:
            for phase in TASK_PHASES:
                for e in self.nemesis.take(batch, phase, part, faults=("client_kill_mid_frame",)):
                    self.killed_mid_frame(batch, part, e.phase)
        last: BaseException | None = None
        for attempt in range(MAX_TASK_ATTEMPTS):
            client = self.client()
            try:
                return self.task(batch, part, client, first and attempt == 0)
            except TaskFailed as exc:
                last = exc
                self.log.append(f"batch {batch} store {part}: task failed ({exc}); retried")
                continue
        raise RuntimeError(f"batch {batch} store {part}: task failed {MAX_TASK_ATTEMPTS} times: {last}")

    def duplicate(self, batch: int, part: int, base: CheckpointRef | None = None) -> CheckpointRef:
        """A second attempt of ``part``'s task of ``batch`` on its own connection (speculation)."""
        ref, out = self.task(batch, part, self.client(), False, base=base)
        self.check_output(batch, part, out, "speculative attempt")
        return ref

    def check_output(self, batch: int, part: int, out: list, what: str) -> None:
        want = apply_ops(self.states[part][batch], self.w["ops"][batch][part])[1]
        self.tally.compare_output(f"batch {batch} store {part} {what}", out, want)

    # -- the driver --
    def await_durable(self, refs: list[tuple[int, CheckpointRef]]) -> None:
        client = self.client()
        deadline = time.monotonic() + DURABLE_DEADLINE
        for part, ref in refs:
            while True:
                if self.nemesis.driver_killed.is_set():
                    raise DriverKilled("while awaiting durability")
                if client.await_durable(self.stores[part], ref, timeout=0.5):
                    self.durable[(part, ref)] = None
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"store {part} {ref} not durable within {DURABLE_DEADLINE} s "
                                       f"(no fault active)")

    def batch(self, batch: int, first: bool) -> None:
        parts = self.w["parts"]
        nem = self.nemesis
        if first:
            loads = nem.take(batch, "load", None)
            if loads:
                with self.daemon.client() as c:
                    c.release(self.root, OPERATOR, list(range(parts)))
                for e in loads:
                    nem.fire(e)
        refs: dict[int, CheckpointRef] = {}
        dups: list[tuple[int, CheckpointRef, str]] = []

        def speculate(phase: str) -> None:
            for e in nem.take(batch, phase, None, faults=("speculative_dup",)) if first else []:
                p = e.param("part", 0)
                if p in refs:
                    dups.append((p, self.duplicate(batch, p), e.param("winner", "first")))
                    nem.fire(e)

        for part in range(parts):
            ref, out = self.run_task(batch, part, first)
            self.check_output(batch, part, out, "task")
            refs[part] = ref
        speculate("commit")
        if first:
            for e in nem.take(batch, "upload", None, faults=tuple(f for f in FAULTS if f != "speculative_dup")):
                nem.fire(e)
                if e.fault == "driver_kill":
                    raise DriverKilled("after the commits")
        speculate("upload")
        # faults during the wait come from a thread after a short delay; the driver waits for them
        waiting = nem.take(batch, "await_durable", None) if first else []
        thread, failures = None, []
        if waiting:
            def during() -> None:
                for e in waiting:
                    if e.fault != "speculative_dup":
                        nem.fire(e)
                        continue
                    p = e.param("part", 0)
                    try:
                        dups.append((p, self.duplicate(batch, p), e.param("winner", "first")))
                        nem.fire(e)
                    except (StateStoreError, OSError) as exc:
                        self.log.append(f"speculative attempt of store {p} failed: {exc}")
                    except BaseException as exc:  # a wrong answer: the main thread raises it
                        failures.append(exc)

            thread = threading.Timer(0.02, during)
            thread.start()
        try:
            self.await_durable(sorted(refs.items()))
        finally:
            if thread is not None:
                thread.join()
        if failures:
            raise failures[0]
        if nem.driver_killed.is_set():
            raise DriverKilled("while awaiting durability")
        chosen = dict(refs)
        for p, ref, winner in dups:
            if winner == "dup":
                chosen[p] = ref
        self.await_durable(sorted({(p, r) for p, r, _ in dups} | set(chosen.items())))
        if first:
            for e in nem.take(batch, "manifest", None, faults=tuple(f for f in FAULTS if f != "speculative_dup")):
                nem.fire(e)
                if e.fault == "driver_kill":
                    raise DriverKilled("before the manifest")
        before = self.manifest
        self.manifest = [chosen[p] for p in range(parts)]
        # a late attempt that commits after the batch is done: it must change nothing the
        # manifest names; what it committed must load if it is answered durable
        for e in nem.take(batch, "manifest", None, faults=("speculative_dup",)) if first else []:
            p = e.param("part", 0)
            try:
                late = self.duplicate(batch, p, base=before[p])
                nem.fire(e)
                self.await_durable([(p, late)])
            except (StateStoreError, OSError, DriverKilled) as exc:
                self.log.append(f"late attempt of store {p}: {type(exc).__name__}: {exc}")

    def drive(self) -> None:
        for b in range(self.w["batches"]):
            last: BaseException | None = None
            for attempt in range(MAX_BATCH_ATTEMPTS):
                self.attempts += 1
                self.nemesis.driver_killed.clear()
                try:
                    self.daemon.ensure()
                    self.batch(b, attempt == 0)
                    break
                except (StateStoreError, OSError, TaskFailed, DriverKilled, RuntimeError) as exc:
                    last = exc
                    self.log.append(f"batch {b} attempt {attempt}: {type(exc).__name__}: {exc}"[:300])
                finally:
                    self.daemon.sample()
                    self.drop_clients()
                # a batch's later attempts meet no event: those its first attempt did not reach are spent
                with self.nemesis.lock:
                    self.nemesis.pending = [e for e in self.nemesis.pending if e.step != b]
            else:
                raise AssertionError(f"batch {b} did not finish in {MAX_BATCH_ATTEMPTS} attempts: {last}")

    # -- the checks --
    def verify(self) -> int:
        """Load every version answered durable on the fresh node; compare with the oracle."""
        pad = self.w["pad"]
        wanted = dict(self.durable)
        for p, ref in enumerate(self.manifest):
            if ref.version:
                wanted[(p, ref)] = None
        checked = 0
        with self.env.verifier_client() as c:
            for p, ref in wanted:
                where = f"store {p} {ref}"
                try:
                    got = self._load(c, p, ref)
                except (StateStoreError, OSError) as exc:
                    self.tally.unloadable += 1
                    self.tally.note(f"{where}: answered durable, does not load: {type(exc).__name__}: {exc}"[:400])
                    continue
                checked += 1
                self.tally.compare(where, got, self.states[p][ref.version], pad)
            with contextlib.suppress(StateStoreError, OSError):
                c.release(self.root, OPERATOR, list(range(self.w["parts"])))
        return checked

    def _load(self, c: Client, part: int, ref: CheckpointRef) -> dict[bytes, bytes]:
        for i in range(3):
            try:
                with c.open(self.stores[part], ref.version, ref.ckptid) as h:
                    return dict(h.scan())
            except WriterConflictError:
                if i == 2:
                    raise
                time.sleep(0.1)
        raise AssertionError("unreachable")


def run(schedule: Schedule, env: Env, *, before_check: Callable[[Run], None] | None = None) -> Outcome:
    """Run ``schedule`` on ``env`` (a fresh root) and check it; the Outcome says what was found.
    ``before_check(run)`` is called between the run and the checks (the tests of the checker use it
    to damage a file or the oracle, and show that the checks catch it)."""
    start = time.monotonic()
    try:
        r = Run(schedule, env)
    except (StateStoreError, OSError, RuntimeError) as exc:  # no daemon could be started
        return Outcome(schedule, False, 0, 0, 0, 0, None, None, set(),
                       f"the campaign could not start: {type(exc).__name__}: {exc}"[:2000], time.monotonic() - start)
    error = ""
    checked = 0
    try:
        try:
            r.drive()
        finally:
            r.nemesis.close()
            r.drop_clients()
            codes = r.daemon.reap()
            r.daemon.sample()
        bad = [c for c in codes if c not in (0, 3)]
        if bad:
            error = f"a terminated daemon exited with {bad} (0 or 3 expected)"
        if before_check is not None:
            before_check(r)
        checked = r.verify()
    except AssertionError as exc:
        error = str(exc)
    except (StateStoreError, OSError, RuntimeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    t = r.tally
    bound = r.daemon.bound
    peak = r.daemon.peak or None
    over = False
    if peak is not None and bound is not None and peak > bound:
        over = True
        t.note(f"daemon peak RSS {peak / MIB:.1f} MiB > bound {bound / MIB:.1f} MiB")
    ok = not error and not (t.lost or t.doubled or t.wrong or t.unloadable) and not over
    detail = "; ".join(([error] if error else []) + t.details)
    if not ok and r.log:
        detail += " | log: " + " / ".join(r.log[-6:])
    if ok and not env.keep_logs:
        for path in r.daemon.log_paths:
            with contextlib.suppress(OSError):
                os.unlink(path)
        r.daemon.log_paths.clear()
    elif not ok:
        detail += f" | daemon logs: {', '.join(r.daemon.log_paths[-3:])}"
    return Outcome(schedule, ok, t.lost, t.doubled, t.wrong, t.unloadable, peak, bound,
                   set(r.nemesis.coverage), detail, time.monotonic() - start, checked, r.attempts)


def shrink(schedule: Schedule, env: Env, budget: int = 30) -> Schedule:
    """The shortest failing schedule found by dropping events (halves first, then one at a time)
    and re-running: each candidate kept only if it still fails. At most ``budget`` runs."""
    best = schedule
    runs = 0

    def fails(events: tuple[Event, ...]) -> bool:
        nonlocal runs
        runs += 1
        return not run(replace(best, events=events), env).ok

    chunk = max(1, len(best.events) // 2)
    while chunk >= 1 and runs < budget:
        i, shrunk = 0, False
        while i < len(best.events) and runs < budget:
            candidate = best.events[:i] + best.events[i + chunk:]
            if candidate != best.events and fails(candidate):
                best = replace(best, events=candidate)
                shrunk = True
            else:
                i += chunk
        if not shrunk:
            chunk //= 2
    return best


def schedules(seed: int, count: int, size: int = 3) -> Iterator[Schedule]:
    """Schedule ``i`` of a campaign started at ``seed`` is ``draw(seed + i)``."""
    for i in range(count):
        yield draw(seed + i, size)
