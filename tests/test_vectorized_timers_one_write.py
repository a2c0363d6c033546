"""A ``VectorizedProcessor``'s batch with timers writes once: the due timers are found while
``process`` runs (its changes are not written yet), so the task itself applies what ``process``
did to what fires, to the state ``handle_expired_timers`` gets and to what ``timers.list()`` shows
during it, and the later change of a key wins in the one write. Against a real daemon, batch
after batch with ``task.partition.run_partition`` (``test_spark_timers.Job``); the committed records are
read back from the checkpoint files."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
from test_spark_timers import Job
from test_spark_vectorized_timers import timer_records

from statestore_async.spark.api.processors import VectorizedProcessor
from statestore_async.state import keys as state_keys

DELETE = -1  # a row value: delete the key's stored timer (at its state's deadline), register none


class Mixed(VectorizedProcessor):
    """``process``: a row ``v >= 0`` registers a timer at ``v``, ``DELETE`` deletes the key's stored
    timer; the state counts rows and keeps the first timer's time. ``handle_expired_timers``: one
    row per fired timer, ``n = rows counted * 1000 + the key's timers listed``; it deletes the key's
    timers at 500 and removes the state of key ``d``."""

    state_name = "s"
    state_schema = pa.schema([("count", pa.int64()), ("deadline", pa.int64())])

    def process(self, keys, rows, offsets, state, exists):
        v = rows["v"].to_numpy()
        key_of_row = np.repeat(np.arange(keys.num_rows), np.diff(offsets))
        deadline = state["deadline"].fill_null(0).to_numpy()
        gone = np.unique(key_of_row[v == DELETE])
        self.timers.delete(gone, deadline[gone])
        self.timers.register(key_of_row[v != DELETE], v[v != DELETE])
        first = np.where(exists, deadline, v[offsets[:-1]])
        count = state["count"].fill_null(0).to_numpy() + np.diff(offsets)
        return pa.table({"count": count, "deadline": first}), None

    def handle_expired_timers(self, keys, timers, state, exists):
        listed = np.bincount(self.timers.list()["key_index"].to_numpy(), minlength=keys.num_rows)
        idx = timers["key_index"].to_numpy()
        n = state["count"].fill_null(-1).to_numpy()[idx] * 1000 + listed[idx]
        self.timers.delete(np.arange(keys.num_rows), 500)
        keep = np.array([k != "d" for k in keys["k"].to_pylist()])
        return state, pa.table({"k": timers["k"], "at": timers["at_ms"], "kind": timers["kind"], "n": n}), keep


def test_what_fires_and_what_is_written_follow_process_changes_not_yet_written(daemon, root):
    job = Job(root, daemon.socket, Mixed(), op="onewrite")
    assert job.run([("a", 100), ("b", 100), ("c", 100)], now_ms=0) == []
    # a deletes its due stored timer (it does not fire); b registers one at a due time (it fires
    # beside its stored one) and one at 500 (not due; the firing call deletes it); c has no rows (its
    # stored timer fires, with its stored state); d is new (its due timer fires with the state
    # process gave it, which the call then removes)
    rows = [("a", DELETE), ("b", 120), ("b", 500), ("d", 130)]
    fired = job.run(rows, now_ms=150)
    # b: 3 rows counted, listed 100 (stored, firing), 120 and 500 (registered by process)
    assert sorted(fired) == [("b", 100, "processing", 3003), ("b", 120, "processing", 3003),
                             ("c", 100, "processing", 1001), ("d", 130, "processing", 1001)]
    recs = job.records()
    assert timer_records(recs) == []  # fired, deleted by process, deleted by the call: none left
    states = sorted(k for k in recs if state_keys.is_state_key(k))
    assert len(states) == 3 and not any(k.endswith(b"d") for k in states)  # a, b, c; d removed by the call
    assert job.run([], now_ms=10_000) == []  # b's timer at 500 is gone, a's deleted one never fires
