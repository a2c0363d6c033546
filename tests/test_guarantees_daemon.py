"""What the daemon guarantees over a long life (issue 18, "Trust"), each shown on real daemons.

* the memory budget bounds what the daemon keeps: an evicted store is collectable, whatever the
  connections that used it still hold (finished handles hold no store), and the cyclic collector
  is never left off across the snapshot builder's pauses; a short soak keeps RSS under the budget;
* STATS and the metrics endpoint carry every key and metric, an empty daemon's too;
* an open version left without a request for ``open_version_idle_timeout`` is aborted (its
  writer slot freed) and its client told why on its next request, a connection stalled mid-frame
  included;
* a load whose snapshot is damaged falls back to an older state and its deltas; damaged files and
  failed loads are named in the daemon's log.

Every wait is for a condition, with a generous deadline; every process started is stopped.
"""
from __future__ import annotations

import asyncio
import gc
import socket
import threading
import time
import urllib.request
import weakref
from collections.abc import Callable
from typing import Any

import pytest

from statestore_async import errors
from statestore_async.client import AsyncClient, Client
from statestore_async.engine.store import VersionedStore
from statestore_async.files.loader import load_store
from statestore_async.files.names import DELTA, SNAPSHOT, file_key
from statestore_async.files.transfer import write_delta, write_snapshot
from statestore_async.ids import CheckpointRef, StoreId
from statestore_async.objectstore import LocalObjectStore
from statestore_async.wire import protocol as P

DEADLINE = 60.0  # seconds any awaited condition may take on a busy 2-core machine


def key(i: int) -> bytes:
    return b"\x00\x07" + b"key-%06d" % i


def wait_for(condition: Callable[[], Any], what: str, timeout: float = DEADLINE, every: float = 0.05) -> Any:
    """Poll ``condition`` until it returns something true; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = condition()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


async def async_wait_for(condition: Callable[[], Any], what: str, timeout: float = DEADLINE) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = condition()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.01)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nested_keys(d: dict, skip: frozenset[str] = frozenset()) -> set[str]:
    """Every key path of a nested dict (``a.b.c``), not descending into ``skip``."""
    out = set()
    for k, v in d.items():
        out.add(k)
        if isinstance(v, dict) and k not in skip:
            out |= {f"{k}.{sub}" for sub in nested_keys(v, skip)}
    return out


# --- STATS and metrics carry every key, also with no store -------------------------------------------
# the sections whose keys depend on what was served (requests by opcode, per object-store root)
DYNAMIC = frozenset({"requests_by_op", "object_stores"})
METRICS = ("statestore_connections", "statestore_requests_total", "statestore_request_errors_total",
           "statestore_stores", "statestore_memory_bytes", "statestore_memory_budget_bytes",
           "statestore_loads_total", "statestore_load_errors_total", "statestore_evictions_total",
           "statestore_broken_stores_dropped_total",
           "statestore_open_versions", "statestore_open_versions_expired_total",
           "statestore_upload_queue_bytes", "statestore_uploads_durable_total", "statestore_uploads_failed_total")


def scrape(port: int) -> tuple[int, dict[str, float]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        body = resp.read().decode()
        status = resp.status
    samples = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return status, samples


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_stats_and_metrics_carry_every_key_on_an_empty_daemon(daemon_process, tmp_path, loop):
    port = free_port()
    d = daemon_process("--loop", loop, "--metrics-port", str(port))
    with d.client() as c:
        empty = c.stats()
        status, samples = scrape(port)  # raised HTTP 500 (KeyError: 'stores') with no store held
        assert status == 200
        assert set(METRICS) <= set(samples), sorted(set(METRICS) - set(samples))
        assert samples["statestore_stores"] == 0 and samples["statestore_memory_bytes"] == 0
        for section in ("registry", "uploader", "maintenance"):
            assert empty[section], f"STATS section {section} is empty on an empty daemon"
        assert empty["registry"]["stores"] == 0 and empty["registry"]["memory_bytes"] == 0
        # the same keys once the daemon holds a store and has uploaded something
        sid = StoreId(f"file://{tmp_path}/root", "stats", 0)
        with c.open(sid, 0) as h:
            h.put_many([(key(1), b"v")])
            ref = h.commit()
        assert c.await_durable(sid, ref, DEADLINE)
        busy = c.stats()
        assert nested_keys(empty, DYNAMIC) == nested_keys(busy, DYNAMIC)
        status, busy_samples = scrape(port)
        assert status == 200 and set(busy_samples) == set(samples)
        assert busy_samples["statestore_stores"] == 1


# --- the memory budget bounds what the daemon keeps --------------------------------------------------
async def wait_evicted(d, sids, what: str) -> None:
    """Enforce the budget until none of ``sids`` is held (a snapshot's view keeps a store a moment)."""
    def gone():
        d.registry.enforce_budget()
        return all(d.registry.get(sid) is None for sid in sids)
    await async_wait_for(gone, what)


async def test_evicted_stores_are_collectable_while_their_connection_stays_open(daemon_factory, tmp_path):
    """Finished handles on an open connection, durable uploads, snapshots and retention hold no
    store: once evicted, a store (its map, history and deltas) is garbage."""
    d = await daemon_factory(snapshot_interval=1, retention_versions=2)  # a snapshot (and cleanup) each commit
    root = f"file://{tmp_path}/root"
    sids = [StoreId(root, "collect", p) for p in range(6)]
    watched: list[weakref.ref] = []
    last = {}
    async with AsyncClient(d.config.socket) as c:
        handles = []
        for sid in sids:
            ref = None
            for v in range(3):
                h = await c.open(sid, v, ref.ckptid if ref else None)
                await h.put_many([(key(i), b"%d-%d" % (v, i) * 20) for i in range(300)])
                ref = await h.commit()
                handles.append(h)
                watched.append(weakref.ref(d.registry.get(sid)))
            h = await c.open(sid, ref.version, ref.ckptid)
            assert await h.get_many([key(1)]) == [b"2-1" * 20]
            await h.abort()  # an aborted handle as well as committed ones
            handles.append(h)
            assert await c.await_durable(sid, ref, DEADLINE)
            last[sid] = ref
        await async_wait_for(lambda: not d.maintenance.stats()["in_progress"], "snapshots to finish")
        assert d.maintenance.counters["snapshots"] >= len(sids)
        d.registry.memory_budget = 1  # every idle, durable store goes
        await wait_evicted(d, sids, "the stores to be evicted")
        gc.collect()
        alive = list({id(s): s for s in (w() for w in watched) if s is not None}.values())
        assert not alive, (f"{len(alive)} of {len(sids)} evicted stores are still referenced, by "
                           f"{[type(r).__name__ for r in gc.get_referrers(alive[0])]}")
        del alive
        # the connection is still open and still knows its finished handles: a late request on one
        # is told what happened to it (not 'unknown handle'), from a record that holds no store
        with pytest.raises(errors.StoreStateError, match="already COMMITTED"):
            await c.call(lambda p: p.send_put_many(handles[0].handle, [(key(1), b"late")]))
        with pytest.raises(errors.StoreStateError, match="already ABORTED"):
            await c.call(lambda p: p.send_get_many(handles[3].handle, [key(1)]))
        await c.call(lambda p: p.send_abort(handles[3].handle))  # aborting twice stays fine
        # and a reopen loads the state again, equal
        h = await c.open(sids[0], 3, last[sids[0]].ckptid)
        assert await h.get_many([key(7)]) == [b"2-7" * 20]
        await h.abort()
        assert d.registry.counters["loads"] == 1


async def test_the_cyclic_collector_is_on_whenever_the_snapshot_builder_yields(daemon_factory, tmp_path):
    """The inline snapshot builder pauses the cyclic collector during each step only: whenever the
    event loop runs something else (a request, this test's poller), the collector is on."""
    assert gc.isenabled()
    d = await daemon_factory(snapshot_interval=1)
    sid = StoreId(f"file://{tmp_path}/root", "gc", 0)
    samples: list[tuple[int, bool]] = []
    stop = asyncio.Event()

    async def poll():
        while not stop.is_set():
            samples.append((d.maintenance.stats()["in_progress"], gc.isenabled()))
            await asyncio.sleep(0)

    poller = asyncio.get_running_loop().create_task(poll())
    try:
        async with AsyncClient(d.config.socket) as c:
            h = await c.open(sid, 0)
            # many records: the snapshot takes many steps (2048 records or one 64 KiB block each)
            await h.put_many([(key(i), b"%06d" % i * 8) for i in range(40_000)])
            ref = await h.commit()
            assert await c.await_durable(sid, ref, DEADLINE)
            await async_wait_for(lambda: d.maintenance.counters["snapshots"] >= 1
                                 and not d.maintenance.stats()["in_progress"], "the snapshot")
    finally:
        stop.set()
        await poller
    during = [enabled for busy, enabled in samples if busy]
    assert during, "the poller never ran while the snapshot was being built"
    assert all(during), f"the collector was off at {during.count(False)} of {len(during)} yields of the snapshot builder"
    assert gc.isenabled()


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


# The short soak: SOAK_CLIENTS connections, each looping open / put_many / commit over its own
# SOAK_STORES stores (SOAK_KEYS keys of SOAK_VALUE bytes: ~0.1-0.5 MB counted each, ~15 MB in all)
# under a budget of SOAK_BUDGET, for at least SOAK_SECONDS and SOAK_ROUNDS rounds of every store.
# The daemon keeps evicting and reloading. Its RSS must stay under its RSS once started (empty)
# + the budget + SOAK_MARGIN: what the budget does not count — the allocator's slack, the loads
# and snapshots in progress, the uploader's per-delta records, buffers. Measured on 2 busy cores:
# ~35 MB over the empty daemon; before evicted stores were collectable (finished handles kept
# them), RSS grew past 300 MB in the same run.
SOAK_CLIENTS = 3
SOAK_STORES = 20
SOAK_KEYS = 500
SOAK_VALUE = 100
SOAK_BUDGET = 4 << 20
SOAK_MARGIN = 64 << 20
SOAK_SECONDS = 20.0
SOAK_ROUNDS = 6
SOAK_DEADLINE = 600.0  # the rounds must be done by then, however busy the machine


def soak_client(socket_path: str, root: str, index: int, stop: threading.Event, rounds: list[int],
                errors_seen: list[BaseException]) -> None:
    try:
        sids = [StoreId(root, f"soak{index}", p) for p in range(SOAK_STORES)]
        refs = dict.fromkeys(sids, (0, None))
        keys = [key(i) for i in range(SOAK_KEYS)]
        with Client(socket_path, timeout=DEADLINE) as c:
            while not stop.is_set():
                value = b"%08d" % rounds[index] * (SOAK_VALUE // 8)
                for sid in sids:
                    version, ckptid = refs[sid]
                    h = c.open(sid, version, ckptid)
                    h.put_many([(k, value) for k in keys])
                    ref = h.commit()
                    refs[sid] = (ref.version, ref.ckptid)
                rounds[index] += 1
    except BaseException as exc:  # reported by the test
        errors_seen.append(exc)


@pytest.mark.slow  # a 20 s soak at least
def test_rss_stays_under_the_budget_in_a_short_soak(daemon_process, tmp_path):
    d = daemon_process("--memory-budget", str(SOAK_BUDGET), "--log-level", "warning")
    fixed = rss_bytes(d.pid)
    root = f"file://{tmp_path}/root"
    stop = threading.Event()
    rounds = [0] * SOAK_CLIENTS
    errors_seen: list[BaseException] = []
    threads = [threading.Thread(target=soak_client, args=(d.socket, root, i, stop, rounds, errors_seen), daemon=True)
               for i in range(SOAK_CLIENTS)]
    samples = []
    start = time.monotonic()
    for t in threads:
        t.start()
    try:
        # sample RSS (the sampling period only sets the resolution) until the work is done
        while not errors_seen and (time.monotonic() - start < SOAK_SECONDS or min(rounds) < SOAK_ROUNDS):
            assert time.monotonic() - start < SOAK_DEADLINE, f"only {rounds} rounds in {SOAK_DEADLINE:.0f} s"
            samples.append(rss_bytes(d.pid))
            time.sleep(0.25)
    finally:
        stop.set()
        for t in threads:
            t.join(DEADLINE)
    assert not errors_seen, errors_seen
    samples.append(rss_bytes(d.pid))
    with d.client() as c:
        registry = c.stats()["registry"]
    assert registry["evictions"] >= SOAK_STORES and registry["loads"] >= SOAK_STORES  # the budget was at work
    peak = max(samples)
    mib = 1 << 20
    print(f"soak: RSS empty {fixed / mib:.1f} MiB, peak {peak / mib:.1f} MiB, last {samples[-1] / mib:.1f} MiB; "
          f"rounds {rounds}; evictions {registry['evictions']}, loads {registry['loads']}")
    assert peak <= fixed + SOAK_BUDGET + SOAK_MARGIN, (
        f"daemon RSS peaked at {peak / mib:.1f} MiB: empty {fixed / mib:.1f} + budget {SOAK_BUDGET / mib:.0f} "
        f"+ margin {SOAK_MARGIN / mib:.0f} MiB exceeded ({rounds} rounds, {registry})")


# --- an open version left without a request loses its writer slot ------------------------------------
IDLE_LIMIT = 3.0  # open_version_idle_timeout of these tests: seconds, far above any gap between two requests


class RawConnection:
    """A client socket speaking the protocol by hand, to stall in the middle of a frame."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(DEADLINE)
        self.sock.connect(path)
        self.proto = P.ClientProtocol()
        self.request(self.proto.send_hello())

    def request(self, sent: tuple[int, bytes]):
        rid, data = sent
        self.sock.sendall(data)
        return self.answer(rid)

    def answer(self, rid: int):
        while True:
            ev = self.proto.next_event()
            if ev is P.NEED_DATA:
                data = self.sock.recv(1 << 16)
                assert data, "the daemon closed the connection"
                self.proto.receive_data(data)
                continue
            assert ev.request_id == rid, ev
            return ev

    def close(self) -> None:
        self.sock.close()


@pytest.mark.slow  # waits out the idle limit
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_stalled_writer_loses_its_slot_after_the_idle_limit(daemon_process, tmp_path, loop):
    d = daemon_process("--loop", loop, "--open-version-idle-timeout", str(IDLE_LIMIT))
    root = f"file://{tmp_path}/root"
    quiet, stalled, busy = (StoreId(root, "idle", p) for p in range(3))
    with d.client() as a, d.client() as b:
        # a client that opens, writes and then never commits nor sends anything on its version
        h = a.open(quiet, 0)
        h.put_many([(key(1), b"never committed")])
        last_request = {quiet: time.monotonic()}
        # a connection stalled in the middle of a PUT_MANY frame
        raw = RawConnection(d.socket)
        try:
            opened = raw.request(raw.proto.send_open(stalled, 0))
            last_request[stalled] = time.monotonic()
            handle = opened.value[0]
            rid, frame = raw.proto.send_put_many(handle, [(key(2), b"x" * 1000)])
            raw.sock.sendall(frame[: len(frame) // 2])
            # a client that keeps using its version longer than the limit keeps it: idle is not age
            kept = b.open(busy, 0)
            started = time.monotonic()
            for sid in (quiet, stalled):
                with pytest.raises(errors.WriterConflictError):
                    b.open(sid, 0)
            others, freed_after = {}, {}

            def step():
                assert kept.get_many([key(3)]) == [None]  # a request on the busy version, every 0.1 s
                for sid in (quiet, stalled):
                    if sid not in others:
                        try:
                            others[sid] = b.open(sid, 0)
                            freed_after[sid] = time.monotonic() - last_request[sid]
                        except errors.WriterConflictError:
                            pass
                return len(others) == 2 and time.monotonic() - started >= 2 * IDLE_LIMIT

            # both stalled slots are freed once the limit has passed without a request on them
            wait_for(step, "the stalled versions' writer slots to be freed", every=0.1)
            # not before the limit (less the time an answer takes to come back)
            assert min(freed_after.values()) >= IDLE_LIMIT - 0.5, freed_after
            other_quiet, other_stalled = others[quiet], others[stalled]
            kept.put_many([(key(3), b"kept")])
            assert kept.commit().version == 1
            # the stalled versions' changes are gone
            assert other_quiet.get_many([key(1)]) == [None]
            assert other_stalled.get_many([key(2)]) == [None]
            other_quiet.abort()
            other_stalled.abort()
            # the stalled peers are told why on their next request, naming the store and the limit
            with pytest.raises(errors.VersionIdleTimeoutError, match=rf"{quiet.operator_id}.*{IDLE_LIMIT:g} s"):
                h.put_many([(key(1), b"too late")])
            raw.sock.sendall(frame[len(frame) // 2:])  # the rest of the frame, at last
            late = raw.answer(rid)
            assert isinstance(late, P.ErrorResponse) and isinstance(late.error, errors.VersionIdleTimeoutError), late
            assert "open_version_idle_timeout" in str(late.error)
        finally:
            raw.close()
        stats = a.stats()
    assert stats["daemon"]["versions_expired"] == 2 and stats["daemon"]["open_versions"] == 0
    log = d.log()
    assert str(quiet.operator_id) in log and "open_version_idle_timeout" in log


# --- loads fall back from a damaged snapshot; failed loads are logged -------------------------------------
def commit_versions(c: Client, sid: StoreId, count: int, states: dict, refs: list, *, before_each=None) -> None:
    """Commit ``count`` versions of ``sid`` after ``refs[-1]`` (100 keys changed each), recording
    each state's full contents in ``states`` and its ref in ``refs``."""
    for _ in range(count):
        parent = refs[-1] if refs else CheckpointRef(0, "")
        if before_each is not None:
            before_each(parent)
        state = dict(states.get(parent, {}))
        v = parent.version + 1
        items = [(key(i), b"v%d-%d" % (v, i)) for i in range(v * 20, v * 20 + 100)]
        with c.open(sid, parent.version, parent.ckptid or None) as h:
            h.put_many(items)
            if v > 1:
                h.remove_many([key((v - 1) * 20)])
                state.pop(key((v - 1) * 20), None)
            ref = h.commit()
        state.update(items)
        states[ref] = state
        refs.append(ref)
    assert c.await_durable(sid, refs[-1], DEADLINE)


def read_all(c: Client, sid: StoreId, ref: CheckpointRef) -> dict:
    with c.open(sid, ref.version, ref.ckptid) as h:
        got = dict(h.scan())
        h.abort()
    return got


def test_a_truncated_snapshot_loads_from_an_older_snapshot_and_the_deltas(daemon_process, tmp_path):
    folder = tmp_path / "root"
    root = f"file://{folder}"
    sid = StoreId(root, "fallback", 0)
    states: dict = {}
    refs: list = []
    writer = daemon_process("--snapshot-interval", "2")

    def snapshot_of(ref):
        return folder / file_key(sid, ref, SNAPSHOT)

    with writer.client() as c:
        def wait_snapshots(parent):
            # before v3 and v5: the snapshot of v2 / v4 exists and its store knows it (later
            # lineages stop there): maintenance counts it in the same step
            if parent.version in (2, 4):
                wait_for(lambda: snapshot_of(parent).exists()
                         and c.stats()["maintenance"]["snapshots"] >= parent.version // 2,
                         f"the snapshot of {parent}")
        commit_versions(c, sid, 5, states, refs, before_each=wait_snapshots)
    assert writer.stop() == 0
    v2, v4, v5 = refs[1], refs[3], refs[4]
    assert snapshot_of(v2).exists() and snapshot_of(v4).exists() and not snapshot_of(v5).exists()
    damaged = snapshot_of(v4)
    data = damaged.read_bytes()
    damaged.write_bytes(data[: len(data) * 2 // 3])  # truncated, as by a crash or a bad copy

    reader = daemon_process()
    with reader.client() as c:
        # v4 itself: its snapshot is damaged; its delta's lineage leads to the snapshot of v2
        assert read_all(c, sid, v4) == states[v4]
        # v5, whose lineage names v4's snapshot as its base: the same fallback, one hop later
        assert read_all(c, sid, v5) == states[v5]
        assert c.stats()["registry"]["load_errors"] == 0
    log = reader.log()
    damaged_key = file_key(sid, v4, SNAPSHOT)
    assert f"snapshot {damaged_key} is damaged" in log, log
    assert "from older states" in log


def test_a_failed_load_is_logged_naming_the_file(daemon_process, tmp_path):
    folder = tmp_path / "root"
    root = f"file://{folder}"
    corrupt, broken = StoreId(root, "fail", 0), StoreId(root, "fail", 1)
    states: dict = {}
    refs: dict = {corrupt: [], broken: []}
    writer = daemon_process("--snapshot-interval", "1000")
    with writer.client() as c:
        for sid in (corrupt, broken):
            commit_versions(c, sid, 3, states, refs[sid])
    assert writer.stop() == 0
    # a delta in the middle of the lineage fails its checksum; another is gone: no fallback exists
    bad = folder / file_key(corrupt, refs[corrupt][1], DELTA)
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x40
    bad.write_bytes(bytes(data))
    gone = folder / file_key(broken, refs[broken][1], DELTA)
    gone.unlink()

    reader = daemon_process()
    with reader.client() as c:
        with pytest.raises(errors.CorruptFileError):
            read_all(c, corrupt, refs[corrupt][2])
        with pytest.raises(errors.LineageError):
            read_all(c, broken, refs[broken][2])
        assert c.stats()["registry"]["load_errors"] == 2
    log = reader.log()
    lines = [line for line in log.splitlines() if "cannot load" in line]
    assert any(file_key(corrupt, refs[corrupt][1], DELTA) in line and "CorruptFileError" in line for line in lines), log
    assert any(file_key(broken, refs[broken][1], DELTA) in line and "LineageError" in line for line in lines), log


async def test_the_loader_walks_past_damaged_and_missing_snapshots(tmp_path, caplog):
    """The load's report says which states it started from: the newest intact snapshot on the
    lineage, every delta after it; the damaged file is named in the log."""
    async with LocalObjectStore(tmp_path / "ckpt", fsync=False) as objstore:
        sid = StoreId(objstore.uri, "walk", 0)
        store = VersionedStore(sid)
        refs, states = [], {}
        for v in range(9):
            w = store.open(v)
            w.put_many([(key(i), b"%d" % v) for i in range(v * 10, v * 10 + 30)])
            d = w.commit()
            await write_delta(objstore, d)
            refs.append(d.ref)
            states[d.ref] = dict(store.items())
            if d.version in (3, 6):
                with store.freeze() as view:
                    await write_snapshot(objstore, view)
                store.mark_snapshot(d.ref)
        snap3, snap6 = (tmp_path / "ckpt" / file_key(sid, refs[v - 1], SNAPSHOT) for v in (3, 6))
        snap6.write_bytes(snap6.read_bytes()[:-40])  # the trailer cut off
        loaded, report = await load_store(objstore, sid, refs[8])  # v9: its lineage's base is v6
        assert dict(loaded.items()) == states[refs[8]]
        assert report.snapshot == refs[2] and [r.version for r in report.deltas] == [4, 5, 6, 7, 8, 9]
        assert report.damaged == [file_key(sid, refs[5], SNAPSHOT)]
        assert f"snapshot {file_key(sid, refs[5], SNAPSHOT)} is damaged" in caplog.text
        # with the older snapshot gone too, the walk goes on to version 0
        snap3.unlink()
        loaded, report = await load_store(objstore, sid, refs[5])  # v6 itself
        assert dict(loaded.items()) == states[refs[5]]
        assert report.snapshot is None and [r.version for r in report.deltas] == list(range(1, 7))
        assert report.missing_bases == [file_key(sid, refs[2], SNAPSHOT)]


async def test_the_uploader_forgets_its_oldest_durable_uploads_beyond_its_bound(tmp_path):
    """The records of finished uploads (kept for AWAIT_DURABLE) stay at ``keep_done``: the oldest
    durable ones go first, one per upload past the bound, and a failed one is never forgotten."""
    from statestore_async.daemon.uploader import Uploader, UploadState

    objstore = LocalObjectStore(str(tmp_path / "root"))
    uploader = Uploader(lambda root: objstore, keep_done=5)
    stores = [VersionedStore(StoreId(f"file://{tmp_path}/root", "trim", p)) for p in range(3)]
    refs: list[tuple[StoreId, CheckpointRef]] = []
    for round_ in range(6):
        for store in stores:
            w = store.open(store.head.version, store.head.ckptid)
            w.put(key(round_), b"v%d" % round_)
            delta = w.commit()
            refs.append((store.store_id, delta.ref))
            await uploader.submit(delta)
            await async_wait_for(lambda: uploader.idle, f"the upload of {delta.ref}")  # durable in commit order
    assert len(uploader._status) == 5
    assert all(uploader.state(s, r) is None for s, r in refs[:-5])  # the oldest, forgotten
    assert all(uploader.state(s, r) is UploadState.DURABLE for s, r in refs[-5:])
    assert len(uploader._durable_order) <= 5 + len(stores)  # the trimming order does not grow either
    await uploader.close()


async def test_a_stalled_object_store_pins_no_store_above_the_budget(daemon_factory, tmp_path):
    """Uploads held (an object store that stopped answering): commits to many stores fill the
    upload queue, then wait for room; meanwhile the stores whose commits are queued still leave
    memory, so stores + queue stay within the budget (one store's worth of slack). Once uploads
    resume, every commit becomes durable and every store reloads exactly (a load waits for its
    store's uploads)."""
    budget = 256 << 10
    d = await daemon_factory(memory_budget=budget)
    root = f"file://{tmp_path}/root"
    gate = asyncio.Event()
    objstore = d.objstores(root)
    real_put = objstore.put_if_absent

    async def held_put(k: str, data: bytes) -> Any:
        await gate.wait()
        return await real_put(k, data)

    objstore.put_if_absent = held_put
    sids = [StoreId(root, "stall", p) for p in range(24)]

    async def one(c: AsyncClient, sid: StoreId) -> CheckpointRef:
        h = await c.open(sid, 0)
        await h.put_many([(key(i), b"%s-%d" % (sid.partition_id.to_bytes(1, "big"), i) * 10) for i in range(200)])
        return await h.commit()

    async with AsyncClient(d.config.socket) as c:
        commits = [asyncio.create_task(one(c, sid)) for sid in sids]
        await async_wait_for(lambda: d.uploader._waiting, "commits waiting for room in the upload queue")
        # one store's worth of slack (its map: 200 records of ~60 bytes; at least 64 KiB), measured
        # on a store still in memory if any (on a busy machine all may have left already)
        store_bytes = max([64 << 10] + [s.memory_bytes for s in (d.registry.get(sid) for sid in sids) if s is not None])
        await async_wait_for(lambda: d.registry.memory_bytes + d.uploader.queued_bytes <= budget + store_bytes,
                             "stores + queue within the budget while uploads are stalled")
        assert d.registry.counters["evictions"] > 0
        gate.set()
        refs = await asyncio.gather(*commits)
        for sid, ref in zip(sids, refs):
            assert await c.await_durable(sid, ref, DEADLINE)
        for sid, ref in zip(sids, refs):
            h = await c.open(sid, ref.version, ref.ckptid)
            assert await h.get_many([key(7)]) == [b"%s-7" % sid.partition_id.to_bytes(1, "big") * 10]
            await h.abort()
