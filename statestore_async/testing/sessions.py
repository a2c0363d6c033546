"""Gap-based sessionization by event time, for tests and benchmarks: a deterministic event stream
and the same logic written four ways — a plain-Python batch computation, Spark's
``applyInPandasWithState`` with ``GroupStateTimeout.EventTimeTimeout``, Spark's
``transformWithStateInPandas`` with event-time timers, and this project's ``StatefulOperator``.

A session of a user is a maximal run of the user's events whose consecutive event times are at
most ``gap_ms`` apart; it is emitted once, as ``(user, start_ms, end_ms, events)``, in the batch
whose watermark first passes ``end + gap`` (no later event can join it then: every event that is
not late is after the watermark). Late events (event time <= the batch's watermark) are dropped.

The stream (``generate``) is built so that the four agree exactly although the engines differ in
details: event times are whole seconds and ``gap_ms`` ends in 500 ms, so a session's close time
never equals a watermark (Spark's ``applyInPandasWithState`` fires a timeout when it is *below*
the watermark, timers when *at or below*); and a late event is at or before the watermark of the
*previous* batch, every other event after the watermark of its own batch (Spark filters late rows
with the previous batch's watermark, and closes sessions with the current one; this project uses
the current one for both). ``sessions_of`` then computes the expected sessions from the admitted
events alone, as a batch job would.
"""
from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from statestore_async.spark.shared.eventtime import next_watermark

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

Session = tuple[int, int, int]            # (start_ms, end_ms, events)
Emitted = tuple[str, int, int, int]       # (user, start_ms, end_ms, events)
OUTPUT_SCHEMA = "user string, start_ms bigint, end_ms bigint, events bigint"
INPUT_SCHEMA = "user string, et bigint"
T0_MS = 1_700_000_000_000                 # the stream's first second
ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"


@dataclass(frozen=True)
class SessionStream:
    """Micro-batches of ``(user, event time ms)``, the session gap and the watermark delay, and the
    watermark of every batch (``watermarks[b]``; ``watermarks[len(batches)]`` is the one after the
    last batch, which a trailing batch without events uses)."""

    batches: list[list[tuple[str, int]]]
    gap_ms: int
    delay_ms: int
    watermarks: list[int | None]

    @property
    def final_watermark(self) -> int | None:
        return self.watermarks[-1]

    def admitted(self) -> list[tuple[str, int]]:
        """Every event that is not late (event time > its batch's watermark)."""
        return [(u, t) for b, rows in enumerate(self.batches) for u, t in rows if not _late(t, self.watermarks[b])]

    def late(self) -> list[int]:
        """Per batch, its late events."""
        return [sum(_late(t, self.watermarks[b]) for _, t in rows) for b, rows in enumerate(self.batches)]


def _late(t: int, watermark: int | None) -> bool:
    return watermark is not None and t <= watermark


def generate(users: int = 200, batches: int = 8, seed: int = 0, gap_s: int = 30, delay_s: int = 20,
             step_s: int = 45, active: float = 0.5, out_of_order: float = 0.15, late: float = 0.05) -> SessionStream:
    """A deterministic stream: in batch ``b`` each user is active with probability ``active`` (so
    users go quiet and come back) and then has 1-3 events in the batch's ``step_s`` seconds; some
    users also send an out-of-order event (between the batch's watermark and its time span) or a
    late one (at or before the previous batch's watermark). ``gap_ms = gap_s * 1000 + 500``."""
    rng = random.Random(seed)
    gap_ms, delay_ms, step = gap_s * 1000 + 500, delay_s * 1000, step_s * 1000
    names = [f"u{i:06d}" for i in range(users)]
    out: list[list[tuple[str, int]]] = []
    marks: list[int | None] = [None]
    top: int | None = None
    for b in range(batches):
        wm, prev = marks[b], marks[b - 1] if b else None
        start = T0_MS + b * step
        rows: list[tuple[str, int]] = []
        for u in names:
            if rng.random() < active:
                rows += [(u, start + 1000 * rng.randrange(step_s)) for _ in range(rng.randint(1, 3))]
            if wm is not None and rng.random() < out_of_order and start - wm > 1000:
                rows.append((u, wm + 1000 * rng.randint(1, (start - wm) // 1000)))  # after W(b): admitted
            if prev is not None and rng.random() < late:
                rows.append((u, prev - 1000 * rng.randrange(60)))  # at or before W(b-1): late for everyone
        rng.shuffle(rows)
        out.append(rows)
        batch_top = max((t for _, t in rows), default=None)
        if batch_top is not None:
            top = batch_top if top is None else max(top, batch_top)
        marks.append(next_watermark(marks[b], top, delay_ms))
    return SessionStream(out, gap_ms, delay_ms, marks)


# -- the logic, shared by every implementation ----------------------------------------------------
def add_events(sessions: Iterable[Session], times: Iterable[int], gap_ms: int) -> list[Session]:
    """``sessions`` (non-overlapping) with the events at ``times`` added: runs within ``gap_ms`` of
    each other merge (an event may join two sessions into one). Sorted by start."""
    parts = sorted([*map(tuple, sessions), *((t, t, 1) for t in times)])
    merged: list[Session] = []
    for s, e, n in parts:
        if merged and s - merged[-1][1] <= gap_ms:
            ps, pe, pn = merged[-1]
            merged[-1] = (ps, max(pe, e), pn + n)
        else:
            merged.append((s, e, n))
    return merged


def split_due(sessions: Iterable[Session], watermark: int | None, gap_ms: int) -> tuple[list[Session], list[Session]]:
    """``(closed, open)``: a session is closed once the watermark passed ``end + gap``."""
    closed: list[Session] = []
    still: list[Session] = []
    for start, end, n in sessions:
        due = watermark is not None and watermark > 0 and end + gap_ms <= watermark
        (closed if due else still).append((start, end, n))
    return closed, still


def timer_changes(before: Iterable[Session], after: Iterable[Session], gap_ms: int) -> tuple[list[int], list[int]]:
    """``(delete, register)``: the timers to move when a user's sessions go from ``before`` (as
    stored, closed ones included) to ``after`` — one timer per open session, at its close time, so
    no timer fires for a session that grew or closed early."""
    old = {e + gap_ms for _, e, _ in before}
    new = {e + gap_ms for _, e, _ in after}
    return sorted(old - new), sorted(new - old)


def fired_timers(stream: SessionStream, trailing_empty: bool = True) -> list[tuple[int, str, int]]:
    """``(batch, user, at_ms)`` of every timer this project's processors fire (one timer per open
    session, at its close time), sorted: in batch ``b`` a user without admitted events whose open
    sessions the watermark closed fires their timers; a user with events closes them in its rows'
    call, deleting their timers (they never fire). ``trailing_empty``: as ``write_batches``."""
    sessions: dict[str, list[Session]] = {}
    out: list[tuple[int, str, int]] = []
    files = [*stream.batches, []] if trailing_empty else list(stream.batches)
    for b, rows in enumerate(files):
        wm = stream.watermarks[b]
        times: dict[str, list[int]] = {}
        for u, t in rows:
            if not _late(t, wm):
                times.setdefault(u, []).append(t)
        for u, ts in times.items():
            _, still = split_due(sessions.get(u, ()), wm, stream.gap_ms)
            sessions[u] = add_events(still, ts, stream.gap_ms)
        for u, ss in sessions.items():
            if u not in times:
                closed, sessions[u] = split_due(ss, wm, stream.gap_ms)
                out += [(b, u, e + stream.gap_ms) for _, e, _ in closed]
    return sorted(out)


def sessions_of(stream: SessionStream) -> list[Emitted]:
    """The plain-Python batch computation: the sessions of the admitted events that the final
    watermark closed, sorted."""
    per_user: dict[str, list[int]] = {}
    for u, t in stream.admitted():
        per_user.setdefault(u, []).append(t)
    out = []
    for u, times in per_user.items():
        closed, _ = split_due(add_events((), times, stream.gap_ms), stream.final_watermark, stream.gap_ms)
        out += [(u, *s) for s in closed]
    return sorted(out)


# -- input files ----------------------------------------------------------------------------------
def write_batches(stream: SessionStream, folder: str, trailing_empty: bool = True) -> int:
    """One parquet file per batch in ``folder`` (``maxFilesPerTrigger=1`` reads one per batch, in
    order: their modification times increase), plus an empty one when ``trailing_empty`` (its batch
    has no events and uses the final watermark, as Spark's no-data batch or a heartbeat would).
    Returns the number of files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(folder, exist_ok=True)
    files = [*stream.batches, []] if trailing_empty else list(stream.batches)
    for i, rows in enumerate(files):
        path = os.path.join(folder, f"batch-{i:05d}.parquet")
        pq.write_table(pa.table({"user": pa.array([u for u, _ in rows], pa.string()),
                                 "et": pa.array([t for _, t in rows], pa.int64())}), path)
        os.utime(path, (1_000_000 + i, 1_000_000 + i))
    return len(files)


def read_stream(spark: SparkSession, folder: str) -> DataFrame:
    """The files of ``write_batches`` as a stream, one file per micro-batch."""
    return spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", 1).parquet(folder)


def run_to_end(df: DataFrame, checkpoint: str, sink: Any, timeout: int = 600) -> None:
    """Run ``df.writeStream.foreachBatch(sink)`` over everything available (AvailableNow), raising
    the query's error."""
    q = (df.writeStream.outputMode("update").foreachBatch(sink).option("checkpointLocation", checkpoint)
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


def collect_into(out: list[Emitted], batch_ids: list[int] | None = None):
    """A foreachBatch sink that appends the emitted sessions to ``out`` (and, given
    ``batch_ids``, each call's batch id to it)."""

    def sink(df: DataFrame, batch_id: int) -> None:
        if batch_ids is not None:
            batch_ids.append(batch_id)
        out.extend((r[0], int(r[1]), int(r[2]), int(r[3])) for r in df.collect())

    return sink


def checksum(sessions: Iterable[Emitted]) -> tuple[int, int]:
    """``(count, sum of Spark's xxhash64(user, start_ms, end_ms, events))`` of emitted sessions: what
    ``checksum_into`` computes in the JVM (a session lost, doubled or changed changes it)."""
    from statestore_async.codecs import sparkhash

    rows = list(sessions)
    if not rows:
        return 0, 0
    return len(rows), sum(int(h) for h in sparkhash.hash_rows(rows, ["string", "bigint", "bigint", "bigint"]))


def checksum_into(out: list[tuple[int, int]]):
    """A foreachBatch sink that appends the batch's ``checksum`` to ``out``, computed by one
    aggregate in the JVM (for benchmarks: no row crosses to the driver)."""

    def sink(df: DataFrame, batch_id: int) -> None:
        from pyspark.sql import functions as F

        h = F.xxhash64("user", "start_ms", "end_ms", "events").cast("decimal(38,0)")
        r = df.agg(F.count(F.lit(1)).alias("n"), F.sum(h).alias("h")).collect()[0]
        out.append((int(r["n"]), int(r["h"] or 0)))

    return sink


# -- Spark's applyInPandasWithState (GroupStateTimeout.EventTimeTimeout) ------------------------------
# the open sessions of a user as JSON text (PySpark 4.3's Python workers fail to parse an array type
# in a state schema: KeyError 'elementType' in ArrayType.fromJson)
STATE_SCHEMA = "sessions string"


def _load(state_tuple: tuple | None) -> list[Session]:
    return [(int(s), int(e), int(n)) for s, e, n in json.loads(state_tuple[0])] if state_tuple else []


def _dump(sessions: list[Session]) -> tuple[str]:
    return (json.dumps(sessions),)


def _frame(user: str, sessions: list[Session]):
    import pandas as pd  # type: ignore[import-untyped]

    return pd.DataFrame({"user": pd.Series([user] * len(sessions), dtype=object),
                         "start_ms": pd.Series([s for s, _, _ in sessions], dtype="int64"),
                         "end_ms": pd.Series([e for _, e, _ in sessions], dtype="int64"),
                         "events": pd.Series([n for _, _, n in sessions], dtype="int64")})


def group_state_sessions(gap_ms: int):
    """The function for ``applyInPandasWithState``: one timeout per user, at its earliest open
    session's close time; on data, sessions already due close first (a timeout may not be set
    before the watermark)."""

    def fn(key: tuple, pdfs: Iterator[Any], state: Any) -> Iterator[Any]:
        (user,) = key
        wm = state.getCurrentWatermarkMs()
        sessions = _load(state.get if state.exists else None)
        closed, sessions = split_due(sessions, wm, gap_ms)
        if not state.hasTimedOut:
            times = [int(t) for pdf in pdfs for t in pdf["et"].tolist()]
            sessions = add_events(sessions, times, gap_ms)
        if sessions:
            state.update(_dump(sessions))
            state.setTimeoutTimestamp(min(e for _, e, _ in sessions) + gap_ms)
        else:
            state.remove()
        if closed:
            yield _frame(user, closed)

    return fn


def apply_in_pandas_with_state(events: DataFrame, gap_ms: int, delay_ms: int) -> DataFrame:
    """The sessions by ``applyInPandasWithState`` over ``events`` (columns user, et in ms)."""
    from pyspark.sql import functions as F
    from pyspark.sql.streaming.state import GroupStateTimeout

    return (events.withColumn("ts", F.timestamp_millis("et")).withWatermark("ts", f"{delay_ms} milliseconds")
            .groupBy("user").applyInPandasWithState(group_state_sessions(gap_ms), OUTPUT_SCHEMA, STATE_SCHEMA,
                                                    "update", GroupStateTimeout.EventTimeTimeout))


# -- Spark's transformWithStateInPandas (event-time timers) -------------------------------------------
def tws_processor(gap_ms: int):
    """A ``pyspark.sql.streaming.StatefulProcessor`` for ``transformWithStateInPandas``: a timer at
    each open session's close time, moved when the session grows or closes (``timer_changes``)."""
    from pyspark.sql.streaming import StatefulProcessor

    class TwsSessions(StatefulProcessor):
        def init(self, handle: Any) -> None:
            self.handle = handle
            self.state = handle.getValueState("sessions", STATE_SCHEMA)

        def _step(self, user: str, wm: int, times: list[int], firing: int | None = None) -> Iterator[Any]:
            before = _load(self.state.get() if self.state.exists() else None)
            closed, sessions = split_due(before, wm, gap_ms)
            sessions = add_events(sessions, times, gap_ms)
            gone, new = timer_changes(before, sessions, gap_ms)
            for t in gone:
                if t != firing:  # Spark removes the firing timer itself, after this call
                    self.handle.deleteTimer(t)
            for t in new:
                self.handle.registerTimer(t)
            if sessions:
                self.state.update(_dump(sessions))
            else:
                self.state.clear()
            if closed:
                yield _frame(user, closed)

        def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: Any) -> Iterator[Any]:
            times = [int(t) for pdf in rows for t in pdf["et"].tolist()]
            yield from self._step(key[0], timerValues.getCurrentWatermarkInMs(), times)

        def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Iterator[Any]:
            yield from self._step(key[0], timerValues.getCurrentWatermarkInMs(), [],
                                  expiredTimerInfo.getExpiryTimeInMs())

        def close(self) -> None:
            pass

    return TwsSessions()


def transform_with_state_in_pandas(events: DataFrame, gap_ms: int, delay_ms: int) -> DataFrame:
    """The sessions by ``transformWithStateInPandas`` (time mode EventTime) over ``events``. Needs
    the RocksDB state store provider (``ROCKSDB_PROVIDER``) in the session's configuration."""
    from pyspark.sql import functions as F

    return (events.withColumn("ts", F.timestamp_millis("et")).withWatermark("ts", f"{delay_ms} milliseconds")
            .groupBy("user").transformWithStateInPandas(tws_processor(gap_ms), OUTPUT_SCHEMA, "Update", "EventTime"))


# -- this project's StatefulOperator ----------------------------------------------------------------
def session_processor(gap_ms: int, mark_timers: bool = False):
    """A per-key ``StatefulProcessor`` of this project with event-time timers (``handle.timers``,
    ``handle.watermark_ms``, ``handle_expired_timer``): the same steps as the Spark versions.
    ``mark_timers``: every fired timer also emits ``(user, at_ms, at_ms, 0)`` (a session has at
    least one event: the rows with ``events == 0`` are the fired timers, see ``fired_timers``)."""
    from statestore_async.spark.api.processors import StatefulProcessor

    class Sessions(StatefulProcessor):
        def init(self, handle: Any) -> None:
            self.handle = handle
            self.sessions = handle.value_state("sessions")

        def _step(self, key: tuple, times: list[int]) -> Iterator[Emitted]:
            before = self.sessions.get() or ()
            closed, sessions = split_due(before, self.handle.watermark_ms, gap_ms)
            sessions = add_events(sessions, times, gap_ms)
            gone, new = timer_changes(before, sessions, gap_ms)
            timers = self.handle.timers
            for t in gone:  # a fired timer is already gone: deleting it again does nothing
                timers.delete(t)
            for t in new:
                timers.register(t)
            if sessions:
                self.sessions.update(tuple(sessions))
            else:
                self.sessions.clear()
            for s in closed:
                yield (key[0], *s)

        def handle_rows(self, key: tuple, rows: list[tuple], state: Any) -> Iterator[Emitted]:
            yield from self._step(key, [et for (et,) in rows])

        def handle_expired_timer(self, key: tuple, timer: Any, state: Any) -> Iterator[Emitted]:
            if mark_timers:
                yield (key[0], timer.at_ms, timer.at_ms, 0)
            yield from self._step(key, [])

    return Sessions()


def vectorized_session_processor(gap_ms: int, mark_timers: bool = False):
    """A ``VectorizedProcessor`` of this project for the same job: numpy over the partition's keys.

    State per user: its one open session (``start``, ``end``, ``events``), or, when it has several,
    all of them in ``more`` as packed little-endian int64 triples (start, end, events): read and
    written as one numpy array per partition, no Python object per user. Timers as
    ``timer_changes``: one per open session, at its close time; only the timers that change are
    deleted and registered. ``mark_timers``: as ``session_processor``'s."""
    import numpy as np
    import pyarrow as pa

    from statestore_async.spark.api.processors import VectorizedProcessor

    big = np.int64(1 << 40)  # > any time span of a partition's sessions: keys' runs never touch
    triple = np.dtype("<i8")

    def merge(kidx: np.ndarray, s: np.ndarray, e: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, ...]:
        """Intervals (key index, start, end, events) sorted by key then start, merged within the
        gap per key: the merged intervals as the same four arrays."""
        if not len(kidx):
            return kidx, s, e, n
        # the running max of ends within each key: ends shifted per key so one accumulate serves all
        base = s.min()
        shifted = (e - base) + kidx * big
        run = np.maximum.accumulate(shifted)
        new = np.ones(len(kidx), bool)
        new[1:] = (kidx[1:] != kidx[:-1]) | ((s[1:] - base + kidx[1:] * big) - run[:-1] > gap_ms)
        first = np.flatnonzero(new)
        return (kidx[first], s[first], np.maximum.reduceat(e, first), np.add.reduceat(n, first))

    def unpack(more: Any) -> tuple[np.ndarray, np.ndarray]:
        """(key index of each session, sessions as rows of (start, end, events)) of a ``more`` column."""
        arr = more.combine_chunks() if isinstance(more, pa.ChunkedArray) else more
        if arr.null_count == len(arr):
            return np.zeros(0, np.int64), np.zeros((0, 3), np.int64)
        off = np.frombuffer(arr.buffers()[1], np.int32)[arr.offset:arr.offset + len(arr) + 1]
        flat = np.frombuffer(arr.buffers()[2], triple, count=(int(off[-1]) - int(off[0])) // 8, offset=int(off[0]))
        return np.repeat(np.arange(len(arr)), np.diff(off) // 24), flat.reshape(-1, 3)

    def pack(nkeys: int, k: np.ndarray, s: np.ndarray, e: np.ndarray, n: np.ndarray) -> pa.Array:
        """The ``more`` column of ``nkeys`` keys whose sessions are (``k`` sorted, ``s``, ``e``, ``n``):
        null for a key without any."""
        counts = np.bincount(k, minlength=nkeys)
        off = np.zeros(nkeys + 1, np.int32)
        np.cumsum(counts * 24, out=off[1:])
        data = np.stack([s, e, n], axis=1).astype(triple).tobytes()
        valid = pa.array(counts > 0)
        return pa.Array.from_buffers(pa.binary(), nkeys, [valid.buffers()[1], pa.py_buffer(off), pa.py_buffer(data)],
                                     null_count=int(nkeys - np.count_nonzero(counts)))

    def by_key_then_start(kidx: np.ndarray, s: np.ndarray) -> np.ndarray:
        """``np.lexsort((s, kidx))``: one stable argsort of both packed in an int64 when they fit
        (the input is mostly runs already sorted by key: ~15x faster than lexsort at ~80k)."""
        if not len(kidx):
            return np.zeros(0, np.int64)
        lo = int(s.min())
        if int(kidx.max()) < (1 << 22) and int(s.max()) - lo < int(big):
            return np.argsort((kidx << 40) | (s - lo), kind="stable")
        return np.lexsort((s, kidx))

    def contained(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
        """``np.isin(values, sorted_set)`` for a sorted ``sorted_set`` (a binary search each)."""
        if not len(sorted_set):
            return np.zeros(len(values), bool)
        pos = np.searchsorted(sorted_set, values)
        pos[pos == len(sorted_set)] = 0
        return sorted_set[pos] == values

    def timer_ids(k: np.ndarray, close: np.ndarray, t0: int) -> np.ndarray:
        return (k.astype(np.int64) << 42) | (close - t0)  # close - t0 < 2**42 ms (139 years)

    class VectorizedSessions(VectorizedProcessor):
        state_name = "sessions"
        state_schema = pa.schema([("start", pa.int64()), ("end", pa.int64()), ("events", pa.int64()),
                                  ("more", pa.binary())])

        def _sessions(self, nkeys: int, state: Any, exists: np.ndarray, times: np.ndarray | None,
                      tkeys: np.ndarray | None) -> tuple[Any, Any, np.ndarray]:
            """Every key's stored sessions and new event times, merged in one pass of numpy; the
            new state, the closed sessions (key index, start, end, events) and which keys keep a state."""
            wm = self.watermark_ms
            more = state["more"]
            several_k, several = unpack(more)
            one = np.flatnonzero(exists & ~more.is_valid().to_numpy(zero_copy_only=False)) if several_k.size \
                else np.flatnonzero(exists)
            ki = [one, several_k]
            ss = [state["start"].fill_null(0).to_numpy()[one], several[:, 0]]
            ee = [state["end"].fill_null(0).to_numpy()[one], several[:, 1]]
            nn = [state["events"].fill_null(0).to_numpy()[one], several[:, 2]]
            old_k, old_close = np.concatenate(ki), np.concatenate(ee) + gap_ms
            if times is not None and tkeys is not None:
                ki.append(tkeys)
                ss.append(times)
                ee.append(times)
                nn.append(np.ones(len(times), np.int64))
            kidx, s, e, n = (np.concatenate(x).astype(np.int64) for x in (ki, ss, ee, nn))
            order = by_key_then_start(kidx, s)
            kidx, s, e, n = merge(kidx[order], s[order], e[order], n[order])
            due = (e + gap_ms <= wm) if wm is not None and wm > 0 else np.zeros(len(e), bool)
            closed = (kidx[due], s[due], e[due], n[due])
            kidx, s, e, n = kidx[~due], s[~due], e[~due], n[~due]
            # timers: one per open session; those of sessions that did not change stay as they are
            new_close = e + gap_ms
            if len(old_k) and len(kidx):
                t0 = int(min(old_close.min(), new_close.min()))
                old_ids, new_ids = timer_ids(old_k, old_close, t0), timer_ids(kidx, new_close, t0)
                gone, added = ~contained(old_ids, np.sort(new_ids)), ~contained(new_ids, np.sort(old_ids))
                self.timers.delete(old_k[gone], old_close[gone])
                self.timers.register(kidx[added], new_close[added])
            else:
                self.timers.delete(old_k, old_close)
                self.timers.register(kidx, new_close)
            per_key = np.bincount(kidx, minlength=nkeys)
            single = per_key[kidx] == 1
            new_s, new_e, new_n = np.zeros(nkeys, np.int64), np.zeros(nkeys, np.int64), np.zeros(nkeys, np.int64)
            new_s[kidx[single]], new_e[kidx[single]], new_n[kidx[single]] = s[single], e[single], n[single]
            multi = ~single
            new_more = pack(nkeys, kidx[multi], s[multi], e[multi], n[multi])
            new_state = pa.table({"start": new_s, "end": new_e, "events": new_n, "more": new_more})
            return new_state, closed, per_key > 0

        def _output(self, keys: Any, closed: tuple[np.ndarray, ...]) -> Any:
            k, s, e, n = closed
            return pa.table({"user": keys.column(0).take(pa.array(k, pa.int64())), "start_ms": s, "end_ms": e,
                             "events": n})

        def process(self, keys, rows, offsets, state, exists):
            times = rows.column(0).to_numpy(zero_copy_only=False).astype(np.int64)
            tkeys = np.repeat(np.arange(keys.num_rows), np.diff(offsets))
            new_state, closed, valid = self._sessions(keys.num_rows, state, np.asarray(exists, bool), times, tkeys)
            return new_state, self._output(keys, closed), valid

        def handle_expired_timers(self, keys, timers, state, exists):
            new_state, closed, valid = self._sessions(keys.num_rows, state, np.asarray(exists, bool), None, None)
            out = self._output(keys, closed)
            if mark_timers:
                at = timers["at_ms"]
                out = pa.concat_tables([pa.table({"user": timers["user"], "start_ms": at, "end_ms": at,
                                                  "events": pa.array(np.zeros(len(at), np.int64))}), out])
            return new_state, out, valid

    return VectorizedSessions()


def session_operator(root: str, operator_id: str, gap_ms: int, delay_ms: int, num_partitions: int = 2,
                     vectorized: bool = False, mark_timers: bool = False, **kw: Any):
    """The ``StatefulOperator`` that sessionizes ``(user, et)`` rows (``et`` in ms), per key or
    vectorized (``mark_timers``: see ``session_processor``)."""
    from datetime import timedelta

    from statestore_async.spark.driver.operator import StatefulOperator

    processor = (vectorized_session_processor(gap_ms, mark_timers) if vectorized else
                 session_processor(gap_ms, mark_timers))
    return StatefulOperator(root, operator_id, ["user"], processor, OUTPUT_SCHEMA, num_partitions,
                            value_columns=["et"], time_mode="event", event_time_column="et",
                            watermark_delay=timedelta(milliseconds=delay_ms), **kw)


__all__ = [
    "INPUT_SCHEMA", "OUTPUT_SCHEMA", "ROCKSDB_PROVIDER", "SessionStream", "add_events", "apply_in_pandas_with_state",
    "checksum", "checksum_into", "collect_into", "fired_timers", "generate", "group_state_sessions", "read_stream", "run_to_end",
    "session_operator", "session_processor", "sessions_of", "split_due", "timer_changes",
    "transform_with_state_in_pandas", "tws_processor", "vectorized_session_processor", "write_batches",
]
