"""engine.table: the compiled and reference twins of ``Table`` agree with each other and with a plain
dict model — point operations, ordered reads, frozen views, the batch routines' answers (byte for
byte) and errors, apply/undo — on chosen and random operations; a bad batch changes nothing; and
the compiled table's allocations stay within 1.75× the record bytes at a million records."""
from __future__ import annotations

import random
import struct

import pytest
from conftest import implementations, lookup_args, max_examples, resolve_impl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from statestore_async.codecs import twins
from statestore_async.errors import InterfaceError, KeyFormatError, StateStoreError, StoreStateError

IMPLS = implementations("table")
FR = twins.reference("framing")
REF = twins.reference("table")  # the reference twin defines the batch checks' messages
PREF = twins.reference("payloads")  # the daemon's request routines on tables, which the table tests cover too
BC = twins.reference("blockcodec")  # defines the payloads chunk_packed writes
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
native_only = pytest.mark.skipif(twins.NO_EXTENSIONS, reason="compiled modules disabled")


@pytest.fixture(params=IMPLS)
def tb(request):
    return resolve_impl(request.param)


def _pl(table_module):
    """The twin of the request routines (``daemon.payloads``) that goes with a table twin."""
    return PREF if table_module is REF else twins.native("payloads")


def _all_impls():
    return [resolve_impl(p.values[0]) for p in IMPLS]


def _outcome(fn, *args, **kw):
    try:
        return ("ok", fn(*args, **kw))
    except (StateStoreError, TypeError, RuntimeError) as exc:
        return (type(exc).__name__, str(exc))


def _contents(t) -> list:
    return list(t.items())


def _model_items(model: dict, start: bytes = b"", stop: bytes | None = None) -> list:
    return sorted((k, v) for k, v in model.items() if k >= start and (stop is None or k < stop))


def _model_chunk(items: list, pos: int, max_bytes: int):
    out, size, i = [], 0, pos
    while i < len(items):
        k, v = items[i]
        s = len(k) + len(v or b"") + 11
        if out and size + s > max_bytes:
            break
        out.append((k, v))
        size += s
        i += 1
    return out, i


def _model_chunk_packed(items: list, pos: int, max_bytes: int):
    """TableView.chunk_packed by its definition: blockcodec's records payload of the records that
    fit ``max_bytes`` of payload (at least one), and their smallest and largest key group."""
    i = pos
    size = 0
    while i < len(items):
        k, v = items[i]
        s = len(BC.encode_records_raw([(k, v)]))
        if i > pos and size + s > max_bytes:
            break
        size += s
        i += 1
    if i == pos:
        return b"", pos, 0, 0
    kgs = [(k[0] << 8) | k[1] if len(k) >= 2 else 0 for k, _ in items[pos:i]]
    return BC.encode_records_raw(items[pos:i]), i, min(kgs), max(kgs)


def _all_packed(view, max_bytes: int) -> tuple[bytes, list]:
    """Every chunk_packed of a view from 0: the joined payloads, and the (count, lo, hi) of each."""
    pos, pays, parts = 0, [], []
    while True:
        pay, nxt, lo, hi = view.chunk_packed(pos, max_bytes)
        if nxt == pos:
            assert (pay, lo, hi) == (b"", 0, 0)
            return b"".join(pays), parts
        assert pay
        pays.append(pay)
        parts.append((nxt - pos, lo, hi))
        pos = nxt


def _table(tb, model: dict):
    t = tb.Table()
    for k, v in model.items():
        t.put(k, v)
    return t


def _check(t, model: dict) -> None:
    assert len(t) == len(model)
    assert t.record_bytes == sum(len(k) + len(v or b"") for k, v in model.items())
    assert _contents(t) == _model_items(model)


# keys share prefixes (a small alphabet), some are long (two-byte length varints), values are empty,
# short or long
key_st = st.one_of(st.lists(st.sampled_from(b"\x00\x01\x7f\xff"), max_size=5).map(bytes),
                   st.binary(min_size=126, max_size=140))
short_keys = st.lists(st.sampled_from(b"\x00\x01\x7f\xff"), max_size=5).map(bytes)
value_st = st.one_of(st.binary(max_size=8), st.binary(min_size=120, max_size=200))
opt_value_st = st.one_of(st.none(), value_st)
models = st.dictionaries(key_st, opt_value_st, max_size=16)
base_models = st.dictionaries(key_st, value_st, max_size=16)


# --- point operations -------------------------------------------------------------------------------
def test_point_operations(tb):
    t = tb.Table()
    assert len(t) == 0 and t.get(b"k") is None and b"k" not in t and t.record_bytes == 0
    t.put(b"k", b"value")
    t.put(b"tomb", None)
    t.put(bytearray(b"ba"), memoryview(b"mv"))
    assert len(t) == 3
    assert t.get(b"k") == b"value" and t.get(b"tomb") is None and t.get(b"ba") == b"mv"
    assert b"tomb" in t and b"k" in t and memoryview(b"ba") in t and b"x" not in t
    assert t.record_bytes == len(b"kvalue") + len(b"tomb") + len(b"bamv")
    t.put(b"k", b"")  # an empty value is a value, not a tombstone
    assert t.get(b"k") == b"" and b"k" in t
    t.put(b"tomb", b"back")
    assert t.get(b"tomb") == b"back"
    assert t.delete(b"tomb") is True and t.delete(b"tomb") is False and b"tomb" not in t
    assert t.delete(b"nothing") is False
    assert _contents(t) == [(b"ba", b"mv"), (b"k", b"")]
    assert t.keys() == [b"ba", b"k"]
    assert type(t.get(b"ba")) is bytes
    for bad in (("s", b"v"), (1, b"v")):
        with pytest.raises(KeyFormatError, match="keys are bytes"):
            t.put(*bad)
    with pytest.raises(InterfaceError, match="values are bytes"):
        t.put(b"k", "v")
    with pytest.raises(KeyFormatError):
        t.get("k")
    assert t.get(b"k") == b""
    assert t.nbytes > 0


def test_empty_key_and_shorter_prefix_first(tb):
    t = tb.Table()
    for k in (b"ab", b"a", b"", b"a\x00", b"b", b"\xff", b"a\xff\xff"):
        t.put(k, k + b"!")
    want = sorted([b"ab", b"a", b"", b"a\x00", b"b", b"\xff", b"a\xff\xff"])
    assert t.keys() == want
    assert t.get(b"") == b"!"
    assert t.scan(b"a") == [(k, k + b"!") for k in want if k.startswith(b"a")]
    assert t.scan(b"") == [(k, k + b"!") for k in want]
    assert t.scan(b"\xff") == [(b"\xff", b"\xff!")]
    assert t.scan(b"a\xff") == [(b"a\xff\xff", b"a\xff\xff!")]
    assert list(t.items(b"a", b"b")) == [(k, k + b"!") for k in want if b"a" <= k < b"b"]
    assert list(t.items(b"a\x00")) == [(k, k + b"!") for k in want if k >= b"a\x00"]
    assert list(t.items(b"\xff\x00")) == [] and list(t.items(b"b", b"a")) == []


def test_changing_the_table_while_iterating_raises(tb):
    t = tb.Table()
    for i in range(10):
        t.put(b"k%d" % i, b"v")
    it = t.items()
    assert next(it) == (b"k0", b"v")
    t.put(b"k0", b"w")
    with pytest.raises(RuntimeError, match="changed during iteration"):
        next(it)
    assert list(it) == []
    it = t.items()
    t.delete(b"nothing")
    with pytest.raises(RuntimeError):
        next(it)
    it = t.items()
    assert len(list(it)) == 10  # reading does not count as a change
    it = t.items(b"k5")
    assert t.scan(b"k") and t.keys()
    assert [k for k, _ in it] == [b"k%d" % i for i in range(5, 10)]


@SETTINGS
@given(model=models, probes=st.lists(key_st, max_size=6))
def test_reads_match_a_dict(tb, model, probes):
    t = _table(tb, model)
    _check(t, model)
    for k in probes + list(model):
        assert t.get(k) == model.get(k)
        assert (k in t) == (k in model)
        assert t.scan(k) == [(x, v) for x, v in _model_items(model) if x.startswith(k)]
        assert list(t.items(k)) == _model_items(model, k)
        assert list(t.items(b"", k)) == _model_items(model, b"", k)
    assert t.keys() == sorted(model)


# --- frozen views -----------------------------------------------------------------------------------
def test_a_view_keeps_what_was_frozen(tb):
    t = tb.Table()
    for i in range(200):
        t.put(b"k%03d" % i, b"v" * (i % 7))
    t.put(b"tomb", None)
    frozen = _contents(t)
    view = t.freeze()
    for i in range(0, 200, 3):
        t.put(b"k%03d" % i, b"changed" * (i % 5))  # other sizes: no overwrite in place
    for i in range(1, 200, 3):
        t.delete(b"k%03d" % i)
    t.put(b"new", b"n")
    base = _table(tb, {b"k%03d" % i: b"w" for i in range(2, 200, 3)})
    tb.apply(t, base)
    assert len(view) == 201
    assert list(view.items()) == frozen
    assert list(view.items(b"k1", b"k2")) == [kv for kv in frozen if b"k1" <= kv[0] < b"k2"]
    assert view.get(b"k001") == b"v" and view.get(b"new") is None and view.get(b"tomb") is None
    assert view.get(b"zzz") is None
    # chunks: in order, whole
    got, pos = [], 0
    while True:
        part, pos = view.chunk(pos, 100)
        if not part:
            break
        got += part
        assert sum(len(k) + len(v or b"") + 11 for k, v in part) <= 100 or len(part) == 1
    assert got == frozen and pos == len(frozen)
    assert view.chunk(0, 0)[0] == frozen[:1]
    assert view.chunk(len(frozen) + 5, 100) == ([], len(frozen) + 5)
    with pytest.raises(InterfaceError):
        view.chunk(-1, 100)
    it = view.items()
    next(it)
    view.release()
    view.release()
    for read in (lambda: len(view), lambda: view.get(b"k000"), lambda: view.items(), lambda: view.chunk(0, 10)):
        with pytest.raises(StoreStateError, match="released"):
            read()
    with pytest.raises(StoreStateError):
        next(it)
    # the table itself went on as told
    assert t.get(b"k000") == b"" and t.get(b"k001") is None and t.get(b"k002") == b"w" and t.get(b"new") == b"n"


def test_views_as_context_managers_and_several_at_once(tb):
    t = _table(tb, {b"a": b"1", b"b": b"2"})
    with t.freeze() as v1:
        t.put(b"a", b"11")
        with t.freeze() as v2:
            t.delete(b"b")
            assert list(v1.items()) == [(b"a", b"1"), (b"b", b"2")]
            assert list(v2.items()) == [(b"a", b"11"), (b"b", b"2")]
        with pytest.raises(StoreStateError):
            v2.get(b"a")
        t.put(b"c", b"3")
        assert v1.get(b"b") == b"2" and len(v1) == 2
    assert _contents(t) == [(b"a", b"11"), (b"c", b"3")]


@SETTINGS
@given(model=models, changes=st.lists(st.tuples(key_st, opt_value_st), max_size=20),
       chunk=st.integers(0, 300))
def test_views_after_random_changes(tb, model, changes, chunk):
    t = _table(tb, model)
    frozen = _model_items(model)
    view = t.freeze()
    for k, v in changes:
        if v is None and k in model:
            t.delete(k)
        else:
            t.put(k, v)
    assert list(view.items()) == frozen
    for k in model:
        assert view.get(k) == model[k]
    pos, got = 0, []
    while True:
        want = _model_chunk(frozen, pos, chunk)
        part, pos2 = view.chunk(pos, chunk)
        assert (part, pos2) == want
        if not part:
            break
        got += part
        pos = pos2
    assert got == frozen
    pos = 0
    while True:
        want = _model_chunk_packed(frozen, pos, chunk)
        assert view.chunk_packed(pos, chunk) == want
        if want[1] == pos:
            break
        pos = want[1]
    view.release()


@SETTINGS
@given(model=models, changes=st.lists(st.tuples(key_st, opt_value_st), max_size=20),
       ordered=st.booleans(), max_bytes=st.integers(-5, 400))
def test_freeze_gives_a_view_in_key_order(tb, model, changes, ordered, max_bytes):
    t = _table(tb, model)
    if ordered:  # a table keeping an order index, pending refs and dead records included
        list(t.items())
        for k, v in changes[: len(changes) // 2]:
            t.put(k, v)
            model[k] = v
    frozen = _model_items(model)
    view = t.freeze()
    for k, v in changes:
        if v is None and k in model:
            t.delete(k)
        else:
            t.put(k, v)
    assert len(view) == len(frozen) and list(view.items()) == frozen
    payload, parts = _all_packed(view, max_bytes)
    assert payload == BC.encode_records_raw(frozen)
    pos = 0
    for count, lo, hi in parts:
        assert (lo, hi) == _model_chunk_packed(frozen, pos, max_bytes)[2:]
        assert count == 1 or len(BC.encode_records_raw(frozen[pos:pos + count])) <= max_bytes
        pos += count
    view.release()
    with pytest.raises(StoreStateError):
        view.chunk_packed(0, 10)


def test_chunk_packed_arguments(tb):
    t = _table(tb, {b"\x01\x02a": b"v", b"\x00": None, b"": b"", b"\xff\xff" + b"k" * 200: b"w" * 300})
    view = t.freeze()
    items = list(view.items())
    assert [k for k, _ in items] == [b"", b"\x00", b"\x01\x02a", b"\xff\xff" + b"k" * 200]
    assert view.chunk_packed(0, 1 << 20) == (BC.encode_records_raw(items), 4, 0, 0xFFFF)
    assert view.chunk_packed(1, 0) == (BC.encode_records_raw(items[1:2]), 2, 0, 0)  # at least one
    assert view.chunk_packed(2, 7) == (BC.encode_records_raw(items[2:3]), 3, 0x0102, 0x0102)
    assert view.chunk_packed(4, 10) == (b"", 4, 0, 0)
    assert view.chunk_packed(99, 10) == (b"", 99, 0, 0)
    for pos, max_bytes in ((-1, 10), (True, 10), (0.5, 10), (0, None), (0, 1.5)):
        with pytest.raises(InterfaceError):
            view.chunk_packed(pos, max_bytes)
    assert view.chunk_packed(0, 1 << 80)[1] == 4 and view.chunk_packed(0, -(1 << 80))[1] == 1
    view.release()


@native_only
@pytest.mark.parametrize("shape", ["shared-prefixes", "one-bucket", "padded-ties", "random", "dead-records"])
def test_export_sort_orders_like_bytes(shape):
    """The compiled export sort (a counting pass on two bytes, then 16-byte prefixes, full compares
    on ties) on keys made to hit each of its paths: the order of sorted(bytes), as freeze gives."""
    nat = twins.native("table")
    rnd = random.Random(shape)
    if shape == "shared-prefixes":  # 16-byte prefixes tie: only the tails differ
        keys = {b"\x00\x07" + b"p" * 16 + rnd.randbytes(rnd.choice((0, 1, 3))) for _ in range(3000)}
    elif shape == "one-bucket":  # one key group: the radix passes do all the work
        keys = {b"\x12\x34" + rnd.randbytes(rnd.choice((0, 1, 2, 9, 17, 30))) for _ in range(20000)}
    elif shape == "padded-ties":  # b"ab" < b"ab\0" < b"ab\0\0": equal zero-padded prefixes
        keys = {b"\x00\x01" + b"a" * a + b"\x00" * z for a in range(20) for z in range(20)}
        keys |= {b"", b"\x00", b"\x01", b"\xff", b"\x00\x00", b"\xff\xff"}
    else:
        keys = {rnd.randbytes(rnd.choice((0, 1, 2, 3, 12, 20))) for _ in range(30000)}
    t = nat.Table()
    for k in keys:
        t.put(k, b"v" * (len(k) % 5) if rnd.random() > 0.1 else None)
    if shape == "dead-records":
        for k in rnd.sample(sorted(keys), len(keys) // 3):
            t.delete(k)
            keys.discard(k)
        for k in rnd.sample(sorted(keys), len(keys) // 3):
            t.put(k, b"longer value " * 3)  # moves the record: a dead one stays behind
    assert t._layout()["order_index"] is False
    view = t.freeze()
    assert t._layout()["order_index"] is False  # the table keeps no order index for it
    assert [k for k, _ in view.items()] == sorted(keys)
    with t.freeze() as frozen:
        assert list(view.items()) == list(frozen.items())
    view.release()


# --- batch routines ---------------------------------------------------------------------------------
@SETTINGS
@given(start=models, items=st.lists(st.tuples(st.binary(min_size=2, max_size=4), value_st), max_size=20))
def test_put_packed_and_put_items_set_in_order(tb, start, items):
    want = dict(start)
    want.update(items)
    for put in (lambda t: _pl(tb).put_packed(t, b"xy" + FR.encode_pairs(items), 2, 2),
                lambda t: _pl(tb).put_packed(t, FR.encode_pairs(items), 0, 2, len(items)),
                lambda t: tb.put_items(t, items, 2),
                lambda t: tb.put_items(t, iter(items), 2)):
        t = _table(tb, start)
        assert put(t) == len(items)
        _check(t, want)


@SETTINGS
@given(empty=st.booleans(), n=st.integers(0, 300), seed=st.integers(0, 2**16))
def test_put_packed_over_several_chunks(tb, empty, n, seed):
    """PUT_MANY and REMOVE_MANY work in chunks of 32 (PUT_MANY sizes an empty table for the whole
    batch at once): batches of several chunks, with keys repeated in them (the later pair wins),
    into an empty table or over one that holds some of their keys."""
    rng = random.Random(seed)
    start = {} if empty else {b"p%04d" % i: b"old" for i in range(0, 400, 7)}
    items = [(b"p%04d" % rng.randrange(400) + b"x" * rng.randrange(0, 14), rng.randbytes(rng.randrange(0, 24)))
             for _ in range(n)]
    t = _table(tb, start)
    assert _pl(tb).put_packed(t, FR.encode_pairs(items), 0, 2) == n
    want = dict(start)
    want.update(items)
    _check(t, want)
    gone = [b"p%04d" % rng.randrange(500) for _ in range(rng.randrange(0, 2 * n + 1))]  # removals too
    assert _pl(tb).remove_packed(t, FR.encode_list(gone), 0, 2) == len(gone)
    want.update(dict.fromkeys(gone))
    _check(t, want)


@SETTINGS
@given(start=models, ks=st.lists(st.binary(min_size=2, max_size=4), max_size=20))
def test_removes_put_tombstones(tb, start, ks):
    want = {**start, **dict.fromkeys(ks)}
    for rm in (lambda t: _pl(tb).remove_packed(t, FR.encode_list(ks), 0, 2),
               lambda t: _pl(tb).remove_packed(t, b"\x00" + FR.encode_list(ks), 1, 2, 100),
               lambda t: tb.remove_keys(t, ks, 2),
               lambda t: tb.remove_keys(t, (k for k in ks), 2)):
        t = _table(tb, start)
        assert rm(t) == len(ks)
        _check(t, want)


@SETTINGS
@given(overlay=models, base=base_models, ks=st.lists(key_st, max_size=20))
def test_reads_see_the_overlay_then_the_base(tb, overlay, base, ks):
    ks = ks + list(overlay)[:3] + list(base)[:3]
    want = [overlay[k] if k in overlay else base.get(k) for k in ks]
    o, b = _table(tb, overlay), _table(tb, base)
    assert tb.get_list(o, b, ks) == want
    assert tb.get_list(o, b, iter(ks)) == want
    assert _pl(tb).get_packed(o, b, FR.encode_list(ks), 0) == FR.encode_optional_list(want)
    assert _pl(tb).get_packed(o, b, b"\x01\x02" + FR.encode_list(ks), 2, len(ks)) == FR.encode_optional_list(want)
    alone = [base.get(k) for k in ks]
    assert tb.get_list(None, b, ks) == alone
    assert _pl(tb).get_packed(None, b, FR.encode_list(ks), 0) == FR.encode_optional_list(alone)


# keys and values of every length up to 40 (the native table compares and copies short ones without
# a call to memcmp / memcpy: lengths 4-7 and 8-16 by two overlapping loads), keys that differ from
# each other in one byte only, at each position
near_keys = st.integers(0, 40).flatmap(lambda n: st.tuples(st.binary(min_size=n, max_size=n),
                                                          st.lists(st.integers(0, max(n - 1, 0)), max_size=6)))


@SETTINGS
@given(shape=near_keys, lengths=st.lists(st.integers(0, 40), min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_keys_and_values_of_every_short_length(tb, shape, lengths, seed):
    stem, positions = shape
    keys = [stem] + [stem[:i] + bytes([stem[i] ^ 0x5A]) + stem[i + 1:] for i in positions if i < len(stem)]
    keys += [stem[:-1]] if stem else []
    rng = random.Random(seed)
    want: dict[bytes, bytes | None] = {}
    t, base = _table(tb, {}), _table(tb, {})
    for n in lengths:  # each round overwrites every key: in place when the length stays, moved when not
        items = [(k, rng.randbytes(n)) for k in keys]
        _pl(tb).put_packed(t, FR.encode_pairs(items), 0, 0)
        want.update(items)
        probes = keys + [stem + b"\x00"]
        expect = [want.get(k) for k in probes]
        assert _pl(tb).get_packed(t, base, FR.encode_list(probes), 0) == FR.encode_optional_list(expect)
        assert tb.get_list(t, base, probes) == expect
    _pl(tb).remove_packed(t, FR.encode_list(keys[:1]), 0, 0)
    want[keys[0]] = None
    _check(t, want)


def test_bad_batches_raise_as_framing_does_and_change_nothing(tb):
    start = {b"\x00\x01a": b"old", b"\x00\x01t": None}
    t = _table(tb, start)
    pairs = FR.encode_pairs([(b"\x00\x01b", b"v"), (b"\x00\x01c", b"w"), (b"\x00\x01d", b"")])
    keys = FR.encode_list([b"\x00\x01b", b"\x00\x01c", b"\x00\x01d"])
    bad_pairs = [pairs[:cut] for cut in range(len(pairs))] + [pairs + b"!", b"\xff\xff\xff\xff" + pairs[4:]]
    bad_lists = [keys[:cut] for cut in range(len(keys))] + [keys + b"!", b"\x09\x00\x00\x00" + keys[4:]]
    for buf in bad_pairs:
        got = _outcome(_pl(tb).put_packed, t, buf, 0, 2)
        assert got[0] == "DecodeError"
        assert got == _outcome(PREF.put_packed, REF.Table(), buf, 0, 2)  # framing's messages (and trailing bytes)
        if buf != pairs + b"!":
            assert got == _outcome(FR.check_pairs, buf, 0)
    for buf in bad_lists:
        for fn in (lambda b: _pl(tb).remove_packed(t, b, 0, 2), lambda b: _pl(tb).get_packed(None, t, b, 0)):
            got = _outcome(fn, buf)
            assert got[0] == "DecodeError"
            assert got == _outcome(PREF.remove_packed, REF.Table(), buf, 0, 2)
    # count above max_count, offset outside the buffer
    for fn, ov_fn, buf in ((lambda b, *a: _pl(tb).put_packed(t, b, *a), PREF.put_packed, pairs),
                           (lambda b, *a: _pl(tb).remove_packed(t, b, *a), PREF.remove_packed, keys)):
        got = _outcome(fn, buf, 0, 2, 2)
        assert got == ("DecodeError", got[1]) and "at most 2 allowed" in got[1]
        assert got == _outcome(ov_fn, REF.Table(), buf, 0, 2, 2)
        for offset in (-1, len(buf) + 1):
            assert _outcome(fn, buf, offset, 2) == _outcome(ov_fn, REF.Table(), buf, offset, 2)
    assert _outcome(_pl(tb).get_packed, None, t, keys, 0, 2) == _outcome(PREF.get_packed, None, REF.Table(), keys, 0, 2)
    # a short key: KeyFormatError, after the payload checks
    short = FR.encode_pairs([(b"\x00\x01b", b"v"), (b"z", b"v")])
    assert _outcome(_pl(tb).put_packed, t, short, 0, 2) == \
        ("KeyFormatError", "a store key starts with its 2-byte key group, got 1 bytes")
    assert _outcome(_pl(tb).put_packed, t, short + b"!", 0, 2)[0] == "DecodeError"
    assert _outcome(_pl(tb).remove_packed, t, FR.encode_list([b"\x00\x01b", b""]), 0, 2) == \
        ("KeyFormatError", "a store key starts with its 2-byte key group, got 0 bytes")
    # Python batches: the reference twin's checks and messages
    for bad in ([(b"\x00\x01b", b"v"), (b"x", b"v")], [(b"\x00\x01b", b"v"), (b"\x00\x01c", "str")],
                [(b"\x00\x01b", b"v"), ("str", b"v")], [(b"\x00\x01b", b"v"), (b"\x00\x01c",)],
                [(b"\x00\x01b", b"v"), 5], [(b"\x00\x01b", b"v"), (b"\x00\x01c", None)]):
        got = _outcome(tb.put_items, t, bad, 2)
        assert got[0] in ("KeyFormatError", "InterfaceError")
        assert got == _outcome(REF.put_items, REF.Table(), bad, 2)
    for bad in ([b"\x00\x01a", b"z"], [b"\x00\x01a", "str"], [b"\x00\x01a", None]):
        got = _outcome(tb.remove_keys, t, bad, 2)
        assert got[0] == "KeyFormatError"
        assert got == _outcome(REF.remove_keys, REF.Table(), bad, 2)
    for bad in ([(b"k", b"v"), (b"k2", "str")], [(b"k", b"v"), ("s", None)], [(b"k", None), (b"k",)]):
        assert _outcome(tb.load_records, t, bad)[0] in ("KeyFormatError", "InterfaceError")
    _check(t, start)


def test_bytes_like_items_are_copied(tb):
    t = tb.Table()
    tb.put_items(t, [(bytearray(b"\x00\x01k"), memoryview(b"v"))], 2)
    tb.remove_keys(t, [bytearray(b"\x00\x01r")], 2)
    tb.load_records(t, [(memoryview(b"\x00\x01m"), bytearray(b"w"))])
    assert _contents(t) == [(b"\x00\x01k", b"v"), (b"\x00\x01m", b"w"), (b"\x00\x01r", None)]
    assert tb.get_list(None, t, [bytearray(b"\x00\x01k"), b"\x00\x01r", b"x"]) == [b"v", None, None]
    with pytest.raises(KeyFormatError):
        tb.get_list(None, t, ["str"])


@native_only
@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=80), offset=st.integers(-1, 10), max_count=st.integers(0, 20),
       start=models, min_key=st.integers(0, 3))
def test_twins_agree_on_any_bytes(data, offset, max_count, start, min_key):
    ref, nat = twins.reference("table"), twins.native("table")
    pref, pnat = twins.reference("payloads"), twins.native("payloads")
    for name in ("put_packed", "remove_packed"):
        t1, t2 = _table(ref, start), _table(nat, start)
        assert _outcome(getattr(pref, name), t1, data, offset, min_key, max_count) == \
            _outcome(getattr(pnat, name), t2, data, offset, min_key, max_count)
        assert _contents(t1) == _contents(t2)
    t1, t2 = _table(ref, start), _table(nat, start)
    assert _outcome(pref.get_packed, t1, t1, data, offset, max_count) == \
        _outcome(pnat.get_packed, t2, t2, data, offset, max_count)


# --- apply / undo -----------------------------------------------------------------------------------
@SETTINGS
@given(base=base_models, changes=models)
def test_apply_and_roll_back(tb, base, changes):
    _check_apply(tb, base, changes)


def _check_apply(tb, base, changes):
    """``apply`` of ``changes`` over ``base`` gives the model's table, the effective changes and their
    pre-images; applying the pre-images gives ``base`` back."""
    b, c = _table(tb, base), _table(tb, changes)
    applied, undo = tb.apply(b, c)
    effective = {k: v for k, v in changes.items() if v is not None or k in base}
    after = dict(base)
    for k, v in effective.items():
        if v is None:
            del after[k]
        else:
            after[k] = v
    _check(b, after)
    assert _contents(applied) == _model_items(effective)
    assert (applied is c) == (len(effective) == len(changes))
    assert _contents(undo) == _model_items({k: base.get(k) for k in effective})
    again, redo = tb.apply(b, undo)
    _check(b, base)
    assert _contents(redo) == _contents(applied)
    assert again is undo  # every pre-image changes something
    _check(c, changes)  # the changes are left as they were


@SETTINGS
@given(n_base=st.integers(0, 300), n_changes=st.integers(0, 200), seed=st.integers(0, 2**16))
def test_apply_over_several_chunks(tb, n_base, n_changes, seed):
    """``apply`` works in chunks of 32 records: changes spanning several chunks, a removal of a
    missing key in any of them (the applied changes are then a copy without it)."""
    rng = random.Random(seed)
    base = {b"b%05d" % i: rng.randbytes(rng.randrange(0, 20)) for i in range(n_base)}
    changes: dict[bytes, bytes | None] = {}
    for _ in range(n_changes):
        k = b"b%05d" % rng.randrange(0, n_base + 50)
        changes[k] = None if rng.random() < 0.2 else rng.randbytes(rng.randrange(0, 20))
    _check_apply(tb, base, changes)


def test_apply_needs_two_tables(tb):
    t = _table(tb, {b"a": b"1"})
    with pytest.raises(InterfaceError):
        tb.apply(t, t)


@SETTINGS
@given(start=base_models, records=st.lists(st.tuples(key_st, opt_value_st), max_size=30))
def test_load_records(tb, start, records):
    t = _table(tb, start)
    assert tb.load_records(t, records) is None
    _check(t, _replay(start, records))
    t2 = tb.Table()
    tb.load_records(t2, iter(records))
    _check(t2, _replay({}, records))


@SETTINGS
@given(start=base_models, records=st.lists(st.tuples(key_st, opt_value_st), max_size=30))
def test_load_records_keeping_tombstones(tb, start, records):
    """A delta block read as a run: a None value sets a tombstone entry (the key present, no value)
    instead of deleting the key; both twins give the same entries, in key order."""
    t = _table(tb, start)
    tb.load_records(t, records, True)
    want = dict(start)
    want.update(records)
    assert list(t.items()) == sorted(want.items())
    assert len(t) == len(want)
    t2 = tb.Table()
    tb.load_records(t2, iter(records), keep_tombstones=True)
    assert list(t2.items()) == sorted(dict(records).items())


def _replay(start: dict, records) -> dict:
    d = dict(start)
    for k, v in records:
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    return d


# --- random operations, every twin in lockstep with a dict model ------------------------------------
class TableMachine(RuleBasedStateMachine):
    """Every implementation and a dict model take the same operations; every answer is compared."""

    def __init__(self):
        super().__init__()
        self.mods = _all_impls()
        self.tables = [m.Table() for m in self.mods]
        self.model: dict[bytes, bytes | None] = {}
        self.views: list[tuple[list, list]] = []  # (a view per implementation, the frozen items)

    def _same(self, results):
        assert all(r == results[0] for r in results), results

    @rule(k=key_st, v=opt_value_st)
    def put(self, k, v):
        for t in self.tables:
            t.put(k, v)
        self.model[k] = v

    @rule(k=key_st)
    def delete(self, k):
        self._same([t.delete(k) for t in self.tables] + [k in self.model])
        self.model.pop(k, None)

    @rule(items=st.lists(st.tuples(key_st, value_st), max_size=12), packed=st.booleans())
    def put_batch(self, items, packed):
        buf = b"\x07" + FR.encode_pairs(items)
        for m, t in zip(self.mods, self.tables):
            assert (_pl(m).put_packed(t, buf, 1, 0) if packed else m.put_items(t, items, 0)) == len(items)
        self.model.update(items)

    @rule(ks=st.lists(key_st, max_size=12), packed=st.booleans())
    def remove_batch(self, ks, packed):
        for m, t in zip(self.mods, self.tables):
            _pl(m).remove_packed(t, FR.encode_list(ks), 0, 0) if packed else m.remove_keys(t, ks, 0)
        self.model.update(dict.fromkeys(ks))

    @rule(records=st.lists(st.tuples(key_st, opt_value_st), max_size=12))
    def load(self, records):
        for m, t in zip(self.mods, self.tables):
            m.load_records(t, records)
        self.model = _replay(self.model, records)

    @rule(n=st.integers(50, 400), seed=st.integers(0, 2**32))
    def many_writes(self, n, seed):
        """Enough writes at once for the order index to merge its pending run and the arena to compact."""
        rnd = random.Random(seed)
        for _ in range(n):
            k = bytes([rnd.choice(b"\x00\x01\x7f\xff") for _ in range(rnd.randint(0, 4))])
            if rnd.random() < 0.25:
                for t in self.tables:
                    t.delete(k)
                self.model.pop(k, None)
            else:
                v = None if rnd.random() < 0.1 else rnd.randbytes(rnd.choice((0, 3, 8, 150)))
                for t in self.tables:
                    t.put(k, v)
                self.model[k] = v

    @rule(ks=st.lists(key_st, max_size=8), overlay=models)
    def get_many(self, ks, overlay):
        ks = ks + list(self.model)[:4]
        want = [overlay[k] if k in overlay else self.model.get(k) for k in ks]
        buf = FR.encode_list(ks)
        for m, t in zip(self.mods, self.tables):
            o = _table(m, overlay)
            assert _pl(m).get_packed(o, t, buf, 0) == FR.encode_optional_list(want)
            assert m.get_list(o, t, ks) == want
            assert _pl(m).get_packed(None, t, buf, 0) == FR.encode_optional_list([self.model.get(k) for k in ks])

    @rule(prefix=short_keys)
    def scan(self, prefix):
        want = [(k, v) for k, v in _model_items(self.model) if k.startswith(prefix)]
        self._same([t.scan(prefix) for t in self.tables] + [want])

    @rule(start=short_keys, stop=st.one_of(st.none(), short_keys))
    def items(self, start, stop):
        self._same([list(t.items(start, stop)) for t in self.tables] + [_model_items(self.model, start, stop)])

    @rule(bounds=st.lists(short_keys, max_size=8, unique=True), open_end=st.booleans())
    def ranges(self, bounds, open_end):
        """Many ranges in one call: the same as ``items`` of each, in turn (an empty range gives none)."""
        b = sorted(bounds)
        rs: list = list(zip(b[0::2], b[1::2]))
        if open_end and len(b) % 2:
            rs.append((b[-1], None))
        want = [kv for lo, hi in rs for kv in _model_items(self.model, lo, hi)]
        self._same([t.ranges(rs) for t in self.tables] + [want])

    @precondition(lambda self: len(self.views) < 4)
    @rule()
    def freeze(self):
        self.views.append(([t.freeze() for t in self.tables], _model_items(self.model)))

    @precondition(lambda self: len(self.views) < 4)
    @rule()
    def export(self):
        self.views.append(([t.freeze() for m, t in zip(self.mods, self.tables)], _model_items(self.model)))

    @precondition(lambda self: self.views)
    @rule(data=st.data())
    def read_view(self, data):
        views, frozen = data.draw(st.sampled_from(self.views))
        pos = data.draw(st.integers(0, len(frozen) + 1))
        max_bytes = data.draw(st.integers(0, 400))
        probe = data.draw(key_st)
        start = data.draw(short_keys)
        for v in views:
            assert len(v) == len(frozen)
            assert list(v.items()) == frozen
            assert list(v.items(start)) == [kv for kv in frozen if kv[0] >= start]
            assert v.chunk(pos, max_bytes) == _model_chunk(frozen, pos, max_bytes)
            assert v.chunk_packed(pos, max_bytes) == _model_chunk_packed(frozen, pos, max_bytes)
            assert v.get(probe) == dict(frozen).get(probe)

    @precondition(lambda self: self.views)
    @rule(data=st.data())
    def release(self, data):
        i = data.draw(st.integers(0, len(self.views) - 1))
        views, _ = self.views.pop(i)
        for v in views:
            v.release()

    @rule(changes=models, roll_back=st.booleans())
    def apply(self, changes, roll_back):
        # the committed table holds no tombstones: drop the model's before applying
        for k in [k for k, v in self.model.items() if v is None]:
            for t in self.tables:
                t.delete(k)
            del self.model[k]
        effective = {k: v for k, v in changes.items() if v is not None or k in self.model}
        undo_want = _model_items({k: self.model.get(k) for k in effective})
        results = []
        for m, t in zip(self.mods, self.tables):
            c = _table(m, changes)
            applied, undo = m.apply(t, c)
            results.append((applied is c, _contents(applied), _contents(undo)))
            if roll_back:
                m.apply(t, undo)
        self._same(results + [(len(effective) == len(changes), _model_items(effective), undo_want)])
        if not roll_back:
            self.model = {k: v for k, v in {**self.model, **effective}.items() if v is not None}

    @invariant()
    def same_contents(self):
        self._same([(len(t), t.record_bytes) for t in self.tables]
                   + [(len(self.model), sum(len(k) + len(v or b"") for k, v in self.model.items()))])
        for t in self.tables:
            for k in list(self.model)[:5]:
                assert t.get(k) == self.model[k]

    def teardown(self):
        for t in self.tables:
            assert _contents(t) == _model_items(self.model)
        for views, frozen in self.views:
            for v in views:
                assert list(v.items()) == frozen
                v.release()


TableMachine.TestCase.settings = settings(max_examples=max_examples(60), stateful_step_count=30, deadline=None)
test_table_machine = TableMachine.TestCase


@pytest.mark.parametrize("seed, scan_every", [(1, 40), (2, 0), (3, 7)])
def test_long_random_runs_agree(seed, scan_every):
    """Thousands of operations over a few hundred keys: the order index merges many times, the
    arena compacts (with and without the order index, with and without live views)."""
    rnd = random.Random(seed)
    mods = _all_impls()
    tables = [m.Table() for m in mods]
    model: dict[bytes, bytes | None] = {}
    views: list[tuple[list, list]] = []
    keyspace = [rnd.randbytes(rnd.choice((1, 2, 3, 5, 12))) for _ in range(600)]

    def same(values):
        assert all(v == values[-1] for v in values), values

    for step in range(6000):
        op = rnd.random()
        k = rnd.choice(keyspace)
        if op < 0.45:
            v = rnd.randbytes(rnd.choice((0, 1, 4, 9, 40, 130))) if rnd.random() > 0.05 else None
            for t in tables:
                t.put(k, v)
            model[k] = v
        elif op < 0.65:
            same([t.delete(k) for t in tables] + [k in model])
            model.pop(k, None)
        elif op < 0.75:
            ks = rnd.sample(keyspace, 20)
            want = FR.encode_optional_list([model.get(x) for x in ks])
            same([_pl(m).get_packed(None, t, FR.encode_list(ks), 0) for m, t in zip(mods, tables)] + [want])
        elif op < 0.8:
            batch = [(rnd.choice(keyspace), rnd.randbytes(rnd.choice((0, 5, 16)))) for _ in range(30)]
            for m, t in zip(mods, tables):
                _pl(m).put_packed(t, FR.encode_pairs(batch), 0, 0)
            model.update(batch)
        elif op < 0.82:
            changes = {rnd.choice(keyspace): (None if rnd.random() < 0.4 else rnd.randbytes(6)) for _ in range(25)}
            for x in [x for x, v in model.items() if v is None]:
                for t in tables:
                    t.delete(x)
                del model[x]
            results = []
            for m, t in zip(mods, tables):
                c = _table(m, changes)
                applied, undo = m.apply(t, c)
                results.append((_contents(applied), _contents(undo)))
            effective = {x: v for x, v in changes.items() if v is not None or x in model}
            results.append((_model_items(effective), _model_items({x: model.get(x) for x in effective})))
            same(results)
            model = {x: v for x, v in {**model, **effective}.items() if v is not None}
        elif op < 0.83 and len(views) < 2:
            views.append(([t.freeze() for t in tables], _model_items(model)))
        elif op < 0.85 and views:
            vs, frozen = views.pop(0)
            for v in vs:
                assert list(v.items()) == frozen
                assert v.chunk(len(frozen) // 2, 200) == _model_chunk(frozen, len(frozen) // 2, 200)
                v.release()
        if scan_every and step % scan_every == 0:
            p = k[:1]
            same([t.scan(p) for t in tables] + [[(x, v) for x, v in _model_items(model) if x.startswith(p)]])
        if step % 500 == 0:
            same([_contents(t) for t in tables] + [_model_items(model)])
    same([_contents(t) for t in tables] + [_model_items(model)])
    same([t.record_bytes for t in tables] + [sum(len(x) + len(v or b"") for x, v in model.items())])
    for vs, frozen in views:
        for v in vs:
            assert list(v.items()) == frozen
    for t in tables:  # the compiled twin went through what this test is for
        if hasattr(t, "_layout"):
            layout = t._layout()
            assert layout["compactions"] > 0
            assert layout["merges"] > (10 if scan_every else 0)


# --- memory (compiled twin: real allocation sizes) ---------------------------------------------------
def _packed_records(n: int, start: int = 0, value: bytes = b"v" * 16) -> bytes:
    """An encode_pairs payload of n records: 12-byte keys (2-byte group + 10 bytes), 16-byte values."""
    import numpy as np

    rec = np.dtype([("kl", "<u4"), ("g", ">u2"), ("k", ">u8"), ("pad", "u1", 2), ("vl", "<u4"), ("v", "S16")])
    a = np.zeros(n, dtype=rec)
    idx = np.arange(start, start + n, dtype=np.uint64)
    a["kl"] = 12
    a["g"] = (idx * 2654435761) % 65536
    a["k"] = idx
    a["vl"] = 16
    a["v"] = value
    return struct.pack("<I", n) + a.tobytes()


@native_only
def test_a_million_records_take_at_most_1_75_times_their_bytes():
    nat, pnat = twins.native("table"), twins.native("payloads")
    # a snapshot's load
    t = nat.Table()
    payload = _packed_records(1_000_000)
    items = FR.decode_pairs(payload)[0]
    nat.load_records(t, items)
    del items
    assert len(t) == 1_000_000 and t.record_bytes == 28_000_000
    assert t.nbytes <= 1.75 * t.record_bytes, t.nbytes / t.record_bytes
    # the same records put in batches of 1024 (as requests come), then overwritten in place
    t2 = nat.Table()
    for i in range(0, 1_000_000, 1024):
        n = min(1024, 1_000_000 - i)
        pnat.put_packed(t2, _packed_records(n, i), 0, 2)
    assert len(t2) == 1_000_000 and t2.nbytes <= 1.75 * t2.record_bytes, t2.nbytes / t2.record_bytes
    pnat.put_packed(t2, _packed_records(1024, 5000, b"w" * 16), 0, 2)
    assert t2.nbytes <= 1.75 * t2.record_bytes
    assert pnat.get_packed(None, t2, FR.encode_list([b"\xff" * 12]), 0) == FR.encode_optional_list([None])
    # no order index until an ordered call; a snapshot's freeze sorts for its view alone
    assert not t2._layout()["order_index"]
    before = t2.nbytes
    with t2.freeze() as view:
        first, _ = view.chunk(0, 1 << 16)
        assert [k for k, _ in first] == sorted(k for k, _ in first) and len(view) == len(t2)
    assert not t2._layout()["order_index"] and t2.nbytes == before
    # once an ordered read is made, the index costs 4 bytes a record more
    assert len(t2.scan(b"\x00\x01")) >= 1
    assert t2._layout()["order_index"]
    assert before < t2.nbytes <= before + 4.5 * len(t2)


@native_only
def test_garbage_is_reclaimed_once_no_view_holds_it():
    nat = twins.native("table")
    t = nat.Table()
    keys = [b"k%05d" % i for i in range(2000)]
    for k in keys:
        t.put(k, b"x" * 10)
    base = t.nbytes
    for rnd in range(30):  # overwrites of other sizes leave garbage; compaction takes it back
        for k in keys:
            t.put(k, b"y" * (12 + rnd % 2 * 20))
    assert t.nbytes < 4 * base
    view = t.freeze()
    frozen = list(view.items())
    for rnd in range(10):
        for k in keys:
            t.put(k, b"z" * (40 + rnd % 2 * 20))
    held = t.nbytes
    assert held > 4 * base  # append-only while the view lives
    assert list(view.items()) == frozen
    view.release()
    t.put(b"k00000", b"last")
    assert t.nbytes < held / 2
    assert t.get(b"k00000") == b"last" and t.get(b"k00001") == b"z" * 60
    for k in keys:
        t.delete(k)
    t.delete(b"k00000")
    assert len(t) == 0 and t.nbytes < base


# --- lookup_spans (a spilled version's reads, level by level) --------------------------------------------------
@SETTINGS
@given(entries=st.dictionaries(st.binary(max_size=40), st.none() | st.binary(max_size=40), max_size=40),
       probes=st.lists(st.binary(max_size=40), max_size=40), base=st.integers(0, 1 << 40), data=st.data())
def test_lookup_spans_fill_only_what_the_table_holds(tb, entries, probes, base, data):
    import numpy as np
    t = tb.Table()
    for k, v in entries.items():
        t.put(k, v)
    keys = probes + list(entries)
    js = np.array(data.draw(st.lists(st.integers(0, len(keys) - 1), unique=True)) if keys else [], np.int64)
    kbuf, koff, found, voff, vlen = lookup_args(keys)
    chunk = tb.lookup_spans(t, kbuf, koff, js, found, voff, vlen, base)
    hits = [j for j in js.tolist() if keys[j] in entries]
    assert chunk == b"".join(entries[keys[j]] or b"" for j in hits)  # the values, in the order of js
    for j, k in enumerate(keys):
        if j not in hits:
            assert (found[j], voff[j], vlen[j]) == (0, 0, 0)
        elif entries[k] is None:
            assert (found[j], vlen[j]) == (1, -1)
        else:
            assert found[j] == 1 and chunk[voff[j] - base : voff[j] - base + vlen[j]] == entries[k]


def test_lookup_spans_check_their_arguments_before_writing(tb):
    import numpy as np
    t = tb.Table()
    t.put(b"a", b"1")
    kbuf, koff, found, voff, vlen = lookup_args([b"a", b"b"])
    with pytest.raises(IndexError, match="out of range"):
        tb.lookup_spans(t, kbuf, koff, np.array([0, 2], np.int64), found, voff, vlen, 0)
    with pytest.raises(InterfaceError, match="2 key offsets, 2 found, 1 value offsets"):
        tb.lookup_spans(t, kbuf, koff, np.array([0], np.int64), found, voff[:1], vlen, 0)
    with pytest.raises(InterfaceError, match="not inside the 14-byte key buffer"):
        tb.lookup_spans(t, kbuf, np.array([9, 30], np.int64), np.array([0, 1], np.int64), found, voff, vlen, 0)
    with pytest.raises(InterfaceError, match="not inside"):
        tb.lookup_spans(t, kbuf, np.array([9, 2], np.int64), np.array([0, 1], np.int64), found, voff, vlen, 0)
    assert not found.any() and not voff.any() and not vlen.any()
    assert tb.lookup_spans(t, kbuf, koff, np.array([1, 0], np.int64), found, voff, vlen, 7) == b"1"
    assert found.tolist() == [1, 0] and (voff[0], vlen[0]) == (7, 1)
    with pytest.raises(InterfaceError, match="key 0 is already found"):
        tb.lookup_spans(t, kbuf, koff, np.array([0], np.int64), found, voff, vlen, 0)


@native_only
@pytest.mark.parametrize("op", ["apply", "put_packed", "remove_packed", "put_items", "remove_keys", "load_records"])
def test_a_batch_write_merges_the_order_index_once_at_its_end(op):
    """A batch of many new or removed keys into a table read in order merges its order index at
    most once, after the batch (a merge reads every sorted record): not once per eighth of the
    table as single writes do. Ordered reads see the batch whole."""
    nat, pnat = twins.native("table"), twins.native("payloads")
    t = nat.Table()
    nat.put_items(t, [(b"\x00\x01a%07d" % i, b"v") for i in range(0, 40_000, 2)], 2)
    assert len(t.scan(b"\x00\x01")) == 20_000  # builds the order index
    before = t._layout()["merges"]
    new = [(b"\x00\x01a%07d" % i, b"w") for i in range(1, 40_000, 2)]  # 20k new keys: 8 merges' worth
    gone = [b"\x00\x01a%07d" % i for i in range(0, 40_000, 2)]
    if op == "apply":
        changes = nat.Table()
        nat.put_items(changes, new, 2)
        nat.remove_keys(changes, gone, 2)
        nat.apply(t, changes)
        want = new
    elif op == "put_packed":
        pnat.put_packed(t, FR.encode_pairs(new), 0, 2)
        want = sorted(new + [(k, b"v") for k in gone])
    elif op == "remove_packed":
        pnat.remove_packed(t, FR.encode_list(gone), 0, 2)
        want = [(k, None) for k in gone]
    elif op == "put_items":
        nat.put_items(t, new, 2)
        want = sorted(new + [(k, b"v") for k in gone])
    elif op == "remove_keys":
        nat.remove_keys(t, gone, 2)
        want = [(k, None) for k in gone]
    else:
        nat.load_records(t, [(k, None) for k in gone] + new)
        want = new
    assert t._layout()["merges"] - before <= 1
    assert t.scan(b"\x00\x01") == want
    lo, hi = b"\x00\x01a0001000", b"\x00\x01a0001004"
    assert list(t.items(lo, hi)) == [x for x in want if lo <= x[0] < hi]
