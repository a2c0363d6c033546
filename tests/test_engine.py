"""The versioned engine: versions, attempts, states, retries in memory, frozen views, cost of commit."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statestore_async.codecs.keylayout import store_key
from statestore_async.engine.store import State, VersionedStore
from statestore_async.errors import (
    InterfaceError,
    KeyFormatError,
    StoreStateError,
    VersionNotFoundError,
    WriterConflictError,
)
from statestore_async.ids import EMPTY_STATE, CheckpointRef, StoreId

SID = StoreId("file:///tmp/ckpt", "agg", 0)


def k(i: int) -> bytes:
    return store_key(i % 4096, b"key-%d" % i)


def commit_batch(store, version, puts=(), removes=(), ckptid=None):
    w = store.open(version)
    for key, value in puts:
        w.put(key, value)
    for key in removes:
        w.remove(key)
    return w.commit(ckptid)


def snapshot(store):
    return dict(store.items())


def test_each_batch_makes_a_new_version_and_leaves_the_previous_one_intact():
    s = VersionedStore(SID)
    d1 = commit_batch(s, 0, [(k(1), b"a"), (k(2), b"b")])
    assert d1.version == 1 and d1.lineage == (EMPTY_STATE,)
    v1 = snapshot(s)
    d2 = commit_batch(s, 1, [(k(1), b"A"), (k(3), b"c")], [k(2)])
    assert d2.version == 2 and d2.parent == d1.ref
    assert d2.records == {k(1): b"A", k(3): b"c", k(2): None}
    # the previous version is still reachable in memory, unchanged
    w = s.open(1, d1.ckptid)
    assert dict(w.items()) == v1
    w.abort()
    assert s.head == d1.ref


def test_state_machine_is_enforced():
    s = VersionedStore(SID)
    w = s.open(0)
    w.put(k(1), b"x")
    w.commit()
    assert w.state is State.COMMITTED
    for op in (lambda: w.put(k(2), b"y"), lambda: w.get(k(1)), lambda: w.remove(k(1)), w.commit, w.abort,
               lambda: list(w.scan(b""))):
        with pytest.raises(StoreStateError, match="already COMMITTED"):
            op()
    w2 = s.open(1)
    w2.abort()
    w2.abort()  # idempotent
    with pytest.raises(StoreStateError, match="already ABORTED"):
        w2.commit()


def test_one_writer_at_a_time():
    s = VersionedStore(SID)
    w = s.open(0)
    with pytest.raises(WriterConflictError):
        s.open(0)
    w.abort()
    s.open(0).abort()


def test_abort_drops_changes():
    s = VersionedStore(SID)
    commit_batch(s, 0, [(k(1), b"a")])
    w = s.open(1)
    w.put(k(1), b"changed")
    w.remove(k(1))
    w.put(k(9), b"new")
    w.abort()
    assert snapshot(s) == {k(1): b"a"} and s.head.version == 1


def test_failed_attempt_retries_from_old_version_in_memory_with_distinct_checkpoint_ids():
    s = VersionedStore(SID)
    base = commit_batch(s, 0, [(k(i), b"v0") for i in range(10)])
    first = commit_batch(s, 1, [(k(1), b"first")], [k(2)])
    # the task failed after committing: a retry opens version 1 again
    second = commit_batch(s, 1, [(k(1), b"second")], [k(3)])
    assert first.version == second.version == 2
    assert first.ckptid != second.ckptid
    assert s.head == second.ref
    assert s.get(k(1)) == b"second" and s.get(k(2)) == b"v0" and s.get(k(3)) is None
    # the manifest may pick either attempt: switching costs no file
    w = s.open(2, first.ckptid)
    assert w.get(k(1)) == b"first" and w.get(k(2)) is None and w.get(k(3)) == b"v0"
    w.abort()
    w = s.open(1, base.ckptid)
    assert dict(w.items()) == {k(i): b"v0" for i in range(10)}
    w.abort()


def test_ambiguous_or_unknown_versions_are_refused():
    s = VersionedStore(SID, history=4)
    commit_batch(s, 0, [(k(1), b"a")])
    a = commit_batch(s, 1, [(k(1), b"b")])
    commit_batch(s, 1, [(k(1), b"c")])
    s.open(1).abort()  # the head is version 1 again; two attempts at version 2 are in memory
    with pytest.raises(VersionNotFoundError, match="ambiguous"):
        s.open(2)
    w = s.open(2, a.ckptid)
    assert w.get(k(1)) == b"b"
    w.abort()
    with pytest.raises(VersionNotFoundError):
        s.open(7)
    with pytest.raises(VersionNotFoundError):
        s.open(2, "f" * 32)


def test_history_is_bounded():
    s = VersionedStore(SID, history=2)
    refs = [EMPTY_STATE]
    for v in range(6):
        refs.append(commit_batch(s, v, [(k(v), b"x")]).ref)
    assert s.known_states() == refs[-3:]
    with pytest.raises(VersionNotFoundError):
        s.open(2, refs[2].ckptid)


def test_reads_see_the_overlay_and_scan_merges_it():
    s = VersionedStore(SID)
    commit_batch(s, 0, [(store_key(1, b"a1"), b"1"), (store_key(1, b"a2"), b"2"), (store_key(2, b"b1"), b"3")])
    w = s.open(1)
    w.put(store_key(1, b"a3"), b"4")
    w.remove(store_key(1, b"a1"))
    w.put(store_key(1, b"a2"), b"22")
    assert w.get(store_key(1, b"a1")) is None
    assert w.get_many([store_key(1, b"a2"), store_key(2, b"b1"), store_key(9, b"zz")]) == [b"22", b"3", None]
    assert sorted(w.scan(store_key(1, b"a"))) == [(store_key(1, b"a2"), b"22"), (store_key(1, b"a3"), b"4")]
    assert len(w) == 3
    w.put_many([(store_key(3, b"c"), b"5")])
    w.remove_many([store_key(2, b"b1")])
    d = w.commit()
    assert d.records[store_key(2, b"b1")] is None
    assert len(s) == 3


def test_a_scan_before_any_write_leaves_the_version_without_an_order_index():
    """A batch may scan (its due timers) before it writes: the empty change table is not given an
    order index, which every later put of the version would keep sorted; a scan after the writes
    still sees them."""
    s = VersionedStore(SID)
    commit_batch(s, 0, [(store_key(1, b"a1"), b"1"), (store_key(2, b"b1"), b"2")])
    w = s.open(1)
    assert w.scan_range(store_key(1, b""), store_key(3, b"")) == [(store_key(1, b"a1"), b"1"),
                                                                 (store_key(2, b"b1"), b"2")]
    assert list(w.scan(store_key(1, b""))) == [(store_key(1, b"a1"), b"1")]
    w.put_many([(store_key(1, b"a%d" % i), b"x") for i in range(2, 200)])
    w.remove(store_key(2, b"b1"))
    layout = getattr(w._overlay, "_layout", None)  # the compiled table shows its internals
    if layout is not None:
        assert layout()["order_index"] is False
    assert len(w.scan_range(store_key(1, b""), store_key(3, b""))) == 199
    assert [kv[0] for kv in w.scan_range(store_key(2, b""), store_key(3, b""))] == []


def test_tombstone_of_a_missing_key_is_not_in_the_delta():
    s = VersionedStore(SID)
    w = s.open(0)
    w.put(k(1), b"x")
    w.remove(k(1))
    w.remove(k(2))
    d = w.commit()
    assert d.records == {}


def test_bad_keys_and_values_are_typed_errors_and_change_nothing():
    s = VersionedStore(SID)
    w = s.open(0)
    with pytest.raises(KeyFormatError):
        w.put(b"x", b"v")
    with pytest.raises(KeyFormatError):
        w.put("str-key", b"v")
    with pytest.raises(InterfaceError):
        w.put(k(1), "not bytes")
    with pytest.raises(KeyFormatError):
        w.put_many([(k(1), b"ok"), (b"", b"bad")])
    assert w.num_changes == 0  # put_many checks everything before applying anything
    w.put(bytearray(k(1)), memoryview(b"v"))
    assert w.get(k(1)) == b"v"


def test_memory_is_accounted():
    s = VersionedStore(SID, history=1)
    assert s.memory_bytes < 4096  # an empty table's fixed allocation
    w = s.open(0)
    w.put(k(1), b"x" * 1000)
    assert s.memory_bytes >= 1000
    w.commit()
    after_put = s.memory_bytes
    commit_batch(s, 1, removes=[k(1)])
    commit_batch(s, 2, [(k(2), b"y")])
    assert s.memory_bytes < after_put


def test_frozen_view_does_not_change_while_commits_go_on():
    s = VersionedStore(SID)
    commit_batch(s, 0, [(k(i), b"v1") for i in range(100)])
    frozen = dict(s.items())
    with s.freeze() as view:
        commit_batch(s, 1, [(k(i), b"v2") for i in range(0, 100, 2)] + [(k(1000), b"new")], [k(i) for i in range(1, 100, 3)])
        # a retry rolls back and forward too: still frozen
        w = s.open(1)
        w.put(k(5), b"other")
        w.commit()
        seen = {kk: view.get(kk) for kk in view.keys()}  # noqa: SIM118 - a FrozenView, not a dict
        assert seen == frozen
    assert s._views == []


class CountingDict(dict):
    """A dict that counts the per-key operations and whole-map iterations done on it."""

    def __init__(self, *a):
        super().__init__(*a)
        self.ops = 0
        self.iterations = 0

    def __contains__(self, key):
        self.ops += 1
        return super().__contains__(key)

    def __getitem__(self, key):
        self.ops += 1
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.ops += 1
        return super().get(key, default)

    def __setitem__(self, key, value):
        self.ops += 1
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self.ops += 1
        super().__delitem__(key)

    def pop(self, key, *default):
        self.ops += 1
        return super().pop(key, *default)

    def __iter__(self):
        self.iterations += 1
        return super().__iter__()

    def items(self):
        self.iterations += 1
        return super().items()

    def keys(self):
        self.iterations += 1
        return super().keys()

    def values(self):
        self.iterations += 1
        return super().values()

    def copy(self):
        self.iterations += 1
        return super().copy()


def _commit_and_rollback_ops(size, monkeypatch):
    """(map operations of a commit of 51 changes, of rolling it back) on a store of ``size`` keys."""
    # the reference table makes its map operations through a dict that the test can count; the
    # compiled table gives the same results (tests/test_table.py holds the two together)
    from statestore_async.codecs import twins
    from statestore_async.engine import store as engine

    ref = twins.reference("table")
    monkeypatch.setattr(engine, "_table", ref)
    monkeypatch.setattr(engine, "Table", ref.Table)
    data = ref.Table()
    ref.load_records(data, [(k(i), b"v") for i in range(size)])
    data._d = counting = CountingDict(data._d)
    s = VersionedStore(SID, data)
    w = s.open(0)
    for i in range(50):
        w.put(k(i), b"w")
    w.remove(k(size - 1))
    counting.ops = counting.iterations = 0
    w.commit()
    commit_ops, commit_iterations = counting.ops, counting.iterations
    counting.ops = 0
    s.open(0).abort()  # a retry of the same batch: the commit is rolled back
    return commit_ops, counting.ops, commit_iterations + counting.iterations


def test_commit_and_rollback_cost_changed_keys_not_state_size(monkeypatch):
    small = _commit_and_rollback_ops(1_000, monkeypatch)
    large = _commit_and_rollback_ops(100_000, monkeypatch)
    assert small == large  # the same map operations whatever the store's size
    commit_ops, rollback_ops, iterations = large
    assert 51 <= commit_ops <= 8 * 51 and 51 <= rollback_ops <= 8 * 51
    assert iterations == 0  # no walk over the map


def test_ckptid_and_versions_are_validated():
    with pytest.raises(InterfaceError):
        CheckpointRef(1, "nothex")
    with pytest.raises(InterfaceError):
        CheckpointRef(0, "a" * 32)
    with pytest.raises(InterfaceError):
        StoreId("file:///x", "../evil", 0)
    with pytest.raises(InterfaceError):
        StoreId("file:///x", "op", -1)
    s = VersionedStore(SID)
    w = s.open(0)
    d = w.commit("0" * 32)
    assert d.ckptid == "0" * 32


# --- a model check: random operations against a plain dict per version ---------------------------
ops = st.lists(
    st.tuples(st.sampled_from(["put", "remove"]), st.integers(0, 20), st.binary(max_size=4)), max_size=30
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(ops, st.booleans(), st.booleans(), st.sampled_from([None, "records", "idle", "open"])),
                min_size=1, max_size=8))
def test_model_random_batches_retries_and_aborts(batches):
    """Random batches, retries and aborts; commits deferred or not (``defer``: the changes reach the
    map later — read through the delta's records, applied when idle, or by the next open)."""
    s = VersionedStore(SID, history=8)
    model = {EMPTY_STATE: {}}
    head = EMPTY_STATE
    view = s.freeze()  # a view of the empty state, kept through everything
    for batch, do_commit, retry_previous, defer in batches:
        start = head
        if retry_previous and head.version > 0:
            # a retry of the previous batch: reopen the head's parent
            start = [r for r in model if r.version == head.version - 1][-1]
        w = s.open(start.version, start.ckptid)
        expected = dict(model[start])
        assert dict(w.items()) == expected
        for op, i, val in batch:
            if op == "put":
                w.put(k(i), val)
                expected[k(i)] = val
            else:
                w.remove(k(i))
                expected.pop(k(i), None)
        assert dict(w.items()) == expected
        if do_commit:
            before = model[start]
            touched = {key for _, i, _ in batch for key in [k(i)]}
            # every put, and every removal of a key that was there (removing nothing changes nothing)
            changes = {key: expected.get(key) for key in touched if key in expected or key in before}
            d = w.commit(defer=defer is not None)
            assert d.applied is (defer is None)
            if defer == "records":
                assert d.records == changes
            elif defer == "idle":
                s.apply_pending()
                assert d.applied and d.records == changes
            elif defer == "open":
                s.open(d.version, d.ckptid).abort()
                assert d.applied and d.records == changes
            else:
                assert d.records == changes
            model[d.ref] = expected
            head = d.ref
        else:
            w.abort()
            head = start
        assert dict(s.items()) == model[head]
    assert len(view) == 0 and view.keys() == []
    # every state still in the history opens to exactly its model
    for ref in s.known_states():
        w = s.open(ref.version, ref.ckptid)
        assert dict(w.items()) == model[ref]
        w.abort()


def test_a_snapshot_marked_late_still_cuts_later_lineages():
    s = VersionedStore(SID)
    refs = [commit_batch(s, v, [(k(v), b"x")]).ref for v in range(4)]  # versions 1..4
    s.mark_snapshot(refs[1])  # the snapshot of version 2 became durable after version 4 was made
    d = commit_batch(s, 4, [(k(9), b"y")])
    assert d.lineage == (refs[3], refs[2], refs[1])
    s.mark_snapshot(d.ref)
    assert commit_batch(s, 5, [(k(9), b"z")]).lineage == (d.ref,)


def test_deltas_since_snapshot_counts_the_chain_a_load_would_replay():
    s = VersionedStore(SID)
    assert s.deltas_since_snapshot() == 0
    refs = [commit_batch(s, v, [(k(v), b"x")]).ref for v in range(5)]
    assert s.deltas_since_snapshot() == 5
    s.mark_snapshot(refs[2])
    assert s.deltas_since_snapshot() == 2
    s.mark_snapshot(refs[4])
    assert s.deltas_since_snapshot() == 0


def test_prepare_commit_checks_what_commit_checks_and_names_its_state():
    store = VersionedStore(SID)
    w = store.open(0)
    w.put(store_key(0, b"a"), b"1")
    ref = w.prepare_commit("a" * 32)
    assert ref == CheckpointRef(1, "a" * 32)
    bound = w.upload_bound()
    delta = w.commit(ref.ckptid)
    assert delta.ref == ref
    assert delta.nbytes + 256 <= bound  # never below what the upload queue will count
    with pytest.raises(StoreStateError):
        w.prepare_commit()
    # a sibling attempt of the same version may not reuse a checkpoint id already committed
    w2 = store.open(0)
    with pytest.raises(InterfaceError, match="committed already"):
        w2.prepare_commit("a" * 32)
    fresh = w2.prepare_commit()
    assert fresh.version == 1 and fresh.ckptid != "a" * 32
    assert w2.commit(fresh.ckptid).ref == fresh
