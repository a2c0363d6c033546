"""spark.task.timers and the per-key ``Timers``: a task's timers as columns agree with a plain model.

``TaskTime`` keeps the batch's keys, the stored due timers and the changes as arrays; these tests
give it keys and stored timers directly (no daemon: ``due_now`` and ``timer_changes`` read none)
and check what fires, in which order, and what the batch writes, against the records written one
by one (``state.keys.timer_at_key`` / ``timer_by_key_key``) and a sort of plain tuples.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statestore_async import errors
from statestore_async.codecs import keylayout, valuecodec
from statestore_async.spark.api.timers import Timers
from statestore_async.spark.task.timers import TaskTime
from statestore_async.state import keys as tk

G = 16
KINDS = (tk.PROCESSING, tk.EVENT)
NOW, WATERMARK = 1_000, 500


def _task(n_keys: int, kgs: list[int]) -> tuple[TaskTime, Timers, list[bytes]]:
    timers = Timers("processing", True)
    tt = TaskTime(None, 0, 1, G, NOW, WATERMARK, timers)  # type: ignore[arg-type]  # no daemon: nothing is read
    enc = valuecodec.encode_keys([(f"user{i}",) for i in range(n_keys)])
    tt.enc = pa.array(enc, pa.binary())
    tt.kg = np.array(kgs, np.int64)
    return tt, timers, enc


def _store_order(tt: TaskTime, enc: list[bytes], timers: list[tuple[str, int, int]]) -> None:
    """Give ``tt`` the stored due timers ``(kind, at, key index)`` in the order a scan reads them."""
    rows = sorted(timers, key=lambda t: (int(tt.kg[t[2]]), tk.KIND_BYTE[t[0]], t[1], enc[t[2]]))
    tt.stored_due = (np.array([tk.KIND_BYTE[k] for k, _, _ in rows], np.uint8),
                     np.array([a for _, a, _ in rows], np.int64), np.array([i for _, _, i in rows], np.int64))


kind_st, at_st = st.sampled_from(KINDS), st.integers(-5, 1_200)
timer_st = st.tuples(kind_st, at_st)


def _keys(data: st.DataObject, most: int) -> tuple[int, list[int], TaskTime, Timers, list[bytes]]:
    """A task of 1..``most`` keys in random key groups: (n, their key groups, the task, its timers, keys)."""
    n = data.draw(st.integers(1, most))
    kgs = data.draw(st.lists(st.integers(0, G - 1), min_size=n, max_size=n))
    return (n, kgs, *_task(n, kgs))


def _rows(data: st.DataObject, timers: Timers, n: int, most: int) -> dict[tuple[int, str, int], bool]:
    """The rows' calls: each registers or deletes a timer of its key; the last word per timer."""
    final: dict[tuple[int, str, int], bool] = {}
    for i, kind, at, on in data.draw(st.lists(st.tuples(st.integers(0, n - 1), kind_st, at_st, st.booleans()),
                                              max_size=most)):
        timers.key_index = i
        (timers.register if on else timers.delete)(at, kind)
        final[(i, kind, at)] = on
    timers.key_index = -1
    return final


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_due_now_fires_what_a_plain_model_fires_in_its_order(data):
    n, kgs, tt, timers, enc = _keys(data, 12)
    limit = {tk.PROCESSING: NOW, tk.EVENT: WATERMARK}
    stored = data.draw(st.sets(st.tuples(st.sampled_from(KINDS), st.integers(-5, 1_000), st.integers(0, n - 1))))
    stored = {(k, a, i) for k, a, i in stored if a <= limit[k]}  # the scan reads only due ones
    _store_order(tt, enc, sorted(stored))
    state = {(i, k, a): True for k, a, i in stored}
    state.update(_rows(data, timers, n, 30))  # some due, some not; some of the stored ones deleted
    want = sorted(((a, tk.KIND_BYTE[k], kgs[i], enc[i], k, i) for (i, k, a), on in state.items()
                   if on and a <= limit[k]))
    assert tt.due_now() == [(a, k, i) for a, _, _, _, k, i in want]


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_timer_changes_are_the_records_written_one_by_one(data):
    n, kgs, tt, timers, enc = _keys(data, 10)
    final = _rows(data, timers, n, 40)
    puts, removes = tt.timer_changes()
    prefixes = keylayout.prefixes(G)

    def records(on: bool) -> list[bytes]:
        out = []
        for (i, kind, at), o in final.items():
            if o is on:
                kg = prefixes[kgs[i]]
                out += [tk.timer_at_key(kg, kind, at, enc[i]), tk.timer_by_key_key(kg, enc[i], kind, at)]
        return sorted(out)

    assert sorted(puts.to_pylist()) == records(True)
    assert sorted(removes.to_pylist()) == records(False)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_list_is_the_stored_timers_with_the_batch_changes(data):
    """``list`` before and after other keys' changes, and while its own change: a plain set model."""
    timers = Timers("event", True)
    existing = data.draw(st.dictionaries(st.integers(0, 3), st.sets(timer_st, max_size=4)))
    timers.load_timers = lambda: {i: set(ts) for i, ts in existing.items()}
    model = {i: set(ts) for i, ts in existing.items()}
    for i, kind, at, op in data.draw(st.lists(st.tuples(st.integers(0, 3), kind_st, at_st,
                                                        st.sampled_from(("register", "delete", "list"))), max_size=40)):
        timers.key_index = i
        if op == "list":
            assert timers.list(kind) == sorted(a for k, a in model.get(i, ()) if k == kind)
        else:
            getattr(timers, op)(at, kind)
            (model.setdefault(i, set()).add if op == "register" else model.setdefault(i, set()).discard)((kind, at))


def test_a_checked_call_and_the_fast_path_record_the_same_timer():
    """``register(at)`` (the time mode's kind, checked inline) and ``register(at, kind)`` (checked by
    the full path) are one timer; a bad time or kind is refused either way."""
    timers = Timers("processing", True)
    timers.key_index = 0
    timers.register(10)
    timers.register(10, "processing")
    timers.delete(11, "event")
    assert timers.batch_changes == {(0, tk.KIND_BYTE[tk.PROCESSING], 10): True, (0, tk.KIND_BYTE[tk.EVENT], 11): False}
    for bad in (True, 1.5, np.int64(3), 1 << 63):
        with pytest.raises(errors.InterfaceError, match="at_ms"):
            timers.register(bad)
    with pytest.raises(errors.InterfaceError, match="kind"):
        timers.register(1, "wall")
    timers.key_index = -1
    with pytest.raises(errors.InterfaceError, match="no current key"):
        timers.register(1)
