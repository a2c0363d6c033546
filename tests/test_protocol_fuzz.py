"""Random and mutated frames against a real daemon: every one is answered (or the connection is
closed after a coded error), another client is served meanwhile, and no partial batch is applied.

The expected answers come from the sans-IO ``ServerProtocol`` run over the same bytes; the expected
store contents from the engine run over the requests it decoded.
"""
from __future__ import annotations

import random
import selectors
import socket
import struct
import threading
import time
from collections import Counter

import pytest
from conftest import max_examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statestore_async import errors
from statestore_async.client import Client
from statestore_async.codecs import framing
from statestore_async.engine.store import VersionedStore
from statestore_async.ids import StoreId
from statestore_async.wire import protocol as P

MAX_FRAME = 4096
MAX_BATCH = 16


class Fuzzed:
    """A daemon process of this test alone: its socket, a root for its stores, the process."""

    def __init__(self, process, root: str):
        self.process = process
        self.sock = process.socket
        self.root = root


@pytest.fixture
def daemon(daemon_process, tmp_path):
    """A daemon with small limits, started for this test and stopped after it (pass or fail)."""
    process = daemon_process("--max-frame-bytes", str(MAX_FRAME), "--max-batch", str(MAX_BATCH),
                             "--log-level", "error", cwd=str(tmp_path))
    return Fuzzed(process, f"file://{tmp_path}/root")


class Witness:
    """Another client doing real work on the same daemon the whole time; its failures are collected."""

    def __init__(self, daemon: Fuzzed):
        self.daemon = daemon
        self.failures: list[str] = []
        self.rounds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        c = Client(self.daemon.sock, timeout=10)
        sid = StoreId(self.daemon.root, "witness", 0)
        ref = None
        try:
            while not self._stop.is_set():
                with c.open(sid, ref.version if ref else 0, ref.ckptid if ref else None) as h:
                    n = self.rounds
                    h.put_many([(b"\x00\x00w", b"%d" % n)])
                    if h.get_many([b"\x00\x00w"]) != [b"%d" % n]:
                        self.failures.append("witness read a wrong value")
                    ref = h.commit()
                self.rounds += 1
                time.sleep(0.002)
        except Exception as exc:
            self.failures.append(repr(exc))
        finally:
            c.close()

    def start(self) -> Witness:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def check_served_during(self, rounds_before: int) -> None:
        """No failure, and rounds were served after ``rounds_before`` (counted when the fuzzing began)."""
        assert self.failures == []
        assert self.rounds > rounds_before, "the other client was not served while the frames were fired"
        assert self.daemon.process.alive(), "the daemon died during the fuzzing"


@pytest.fixture
def witness(daemon):
    w = Witness(daemon).start()
    deadline = time.monotonic() + 30
    while w.rounds == 0 and not w.failures:  # it is working before the fuzzing starts
        assert time.monotonic() < deadline, "the witness never completed a round"
        time.sleep(0.01)
    yield w
    w.stop()


# --- building streams ---------------------------------------------------------------------------------
def _valid(rng: random.Random, rid: int, handle: int) -> bytes:
    def k():
        return b"\x00\x01" + rng.randbytes(rng.randint(0, 4))

    kind = rng.randrange(6)
    if kind == 0:
        items = [(k(), rng.randbytes(rng.randint(0, 12))) for _ in range(rng.randint(0, 8))]
        return framing.encode_frame(P.Op.PUT_MANY, 0, rid, struct.pack("<I", handle) + framing.encode_pairs(items))
    if kind == 1:
        keys = [k() for _ in range(rng.randint(0, 8))]
        return framing.encode_frame(P.Op.REMOVE_MANY, 0, rid, struct.pack("<I", handle) + framing.encode_list(keys))
    if kind == 2:
        keys = [k() for _ in range(rng.randint(0, 8))]
        return framing.encode_frame(P.Op.GET_MANY, 0, rid, struct.pack("<I", handle) + framing.encode_list(keys))
    if kind == 3:
        return framing.encode_frame(P.Op.SCAN, 0, rid, struct.pack("<IQ", handle, rng.randint(0, 5)) + b"\x00")
    if kind == 4:
        return framing.encode_frame(P.Op.PING, 0, rid, rng.randbytes(rng.randint(0, 30)))
    return framing.encode_frame(P.Op.STATS, 0, rid, b"")


def _mutate(rng: random.Random, frame: bytes, length_too: bool) -> bytes:
    b = bytearray(frame)
    for _ in range(rng.randint(1, 3)):
        how = rng.randrange(5)
        lo = 0 if length_too else 4
        if how == 0 and len(b) > lo:
            b[rng.randrange(lo, len(b))] ^= 1 << rng.randrange(8)
        elif how == 1 and len(b) > 10:  # cut the payload, keep the length field consistent
            n = rng.randrange(10, len(b))
            b = b[:n]
            b[0:4] = struct.pack("<I", n - 10)
        elif how == 2:  # append junk to the payload
            junk = rng.randbytes(rng.randint(1, 6))
            b += junk
            b[0:4] = struct.pack("<I", len(b) - 10)
        elif how == 3 and len(b) > 10:  # a random count field
            pos = rng.randrange(10, len(b))
            b[pos : pos + 4] = struct.pack("<I", rng.choice([0, 1, 17, 0xFFFF, 0xFFFFFFFF, rng.getrandbits(32)]))[: len(b) - pos]
        elif how == 4:
            b[4] = rng.choice([0, 12, 99, 255, rng.randrange(256)])
    return bytes(b)


def _garbage(rng: random.Random, rid: int) -> bytes:
    return framing.encode_frame(rng.randrange(256), rng.choice([0, 0, 0, 1, rng.randrange(256)]), rid,
                                rng.randbytes(rng.randint(0, 40)))


def build_stream(seed: int, n: int, mode: str) -> bytes:
    rng = random.Random(seed)
    parts = []
    for i in range(n):
        rid = rng.choice([i + 100, i + 100, 0, 0xFFFFFFFF, rng.getrandbits(32)])
        r = rng.random()
        if mode == "random" or r < 0.15:
            parts.append(_garbage(rng, rid))
        elif r < 0.6:
            parts.append(_valid(rng, rid, 1))
        else:
            parts.append(_mutate(rng, _valid(rng, rid, rng.choice([1, 1, 1, 2])), length_too=rng.random() < 0.01))
    if rng.random() < 0.05:
        parts.insert(rng.randrange(len(parts) + 1), struct.pack("<IBBI", MAX_FRAME + rng.randint(1, 1 << 30), 5, 0, 7))
    return b"".join(parts)


def reference(stream: bytes):
    """(expected final answers per request id, decoded events, fatal event or None, bytes left)."""
    sp = P.ServerProtocol(max_frame_bytes=MAX_FRAME, max_batch=MAX_BATCH)
    sp.greeted = True
    sp.receive_data(stream)
    events, fatal = [], None
    for ev in sp.events():
        if isinstance(ev, P.ConnectionFailed):
            fatal = ev
            break
        events.append(ev)
    expected = Counter(ev.request_id for ev in events)
    if fatal is not None:
        expected[fatal.request_id] += 1
    return expected, events, fatal, sp.buffered


def model(events):
    """The engine run over the decoded requests on handle 1: (version or None if ended, overlay map)."""
    store = VersionedStore(StoreId("file:///x", "m", 0))
    w = store.open(0)
    for ev in events:
        if getattr(ev, "handle", None) != 1:
            if isinstance(ev, (P.Open, P.AwaitDurable, P.Release)):
                return None
            continue
        try:
            if isinstance(ev, P.PutMany):
                w.put_many(ev.items)
            elif isinstance(ev, P.RemoveMany):
                w.remove_many(ev.keys)
            elif isinstance(ev, (P.Commit, P.Abort)):
                return None  # a mutation turned into a commit or abort: contents not compared
        except errors.StateStoreError:
            pass
    return dict(w.items())


# --- talking to the daemon ----------------------------------------------------------------------------
def exchange(sock_path: str, store: StoreId, stream: bytes, expected: Counter, fatal) -> tuple[Counter, bytes, bool]:
    """Open ``store`` (handle 1), send ``stream``, collect answers until all expected came or the close."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock_path)
    s.setblocking(False)
    cp = P.ClientProtocol()
    hello = cp.send_hello()[1] + cp.send_open(store, 0)[1]
    out = memoryview(hello + stream)
    got: Counter = Counter()
    errors_seen = []
    buf = bytearray()
    closed = False
    skip = 2  # the HELLO and OPEN answers
    need = sum(expected.values())
    sel = selectors.DefaultSelector()
    sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE)
    deadline = time.monotonic() + 20
    while not closed and (sum(got.values()) < need or out):
        assert time.monotonic() < deadline, f"answers missing: {expected - got}"
        for _, mask in sel.select(1):
            if mask & selectors.EVENT_WRITE and out:
                try:
                    out = out[s.send(out[:65536]):]
                except BlockingIOError:
                    pass
                except (BrokenPipeError, ConnectionResetError):
                    out = out[:0]  # the daemon closed after a framing error
                if not out:
                    sel.modify(s, selectors.EVENT_READ)
            if mask & selectors.EVENT_READ:
                try:
                    data = s.recv(1 << 20)
                except ConnectionResetError:
                    data = b""
                if not data:
                    closed = True
                    break
                buf += data
                frames, used, _ = framing.split_frames(buf, 1 << 30)
                del buf[:used]
                for opcode, flags, rid, payload in frames:
                    assert flags & P.RESPONSE
                    if skip:
                        skip -= 1
                        assert not flags & P.ERROR, P.decode_error(payload)
                        continue
                    if flags & P.ERROR:
                        err = P.decode_error(payload)
                        assert type(err) is not errors.StateStoreError, f"an uncoded error: {err}"
                        errors_seen.append(err)
                    if not flags & P.MORE:
                        got[rid] += 1
    return got, s, closed


SETTINGS = settings(max_examples=max_examples(220), deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def run_example(daemon: Fuzzed, seed: int, n: int, mode: str, tally: Counter) -> None:
    """Fire one stream of ``n`` frames on a fresh connection and check every answer, the contents
    of its version, and that nothing was committed; counts what was checked into ``tally``."""
    sock, root = daemon.sock, daemon.root
    stream = build_stream(seed, n, mode)
    expected, events, fatal, left = reference(stream)
    store = StoreId(root, f"fuzz-{mode}", seed % 1000000)
    got, s, closed = exchange(sock, store, stream, expected, fatal)
    tally["streams"] += 1
    tally["frames"] += n
    assert got == expected
    if fatal is not None:
        # the answer to the bad frame came, then the daemon closed
        s.settimeout(5)
        assert s.recv(1) == b"" or closed
        tally["closed after a framing error"] += 1
    want = model(events)
    c = Client(sock, timeout=10)
    if fatal is None and not left and want is not None:
        # the connection is healthy: its version holds exactly what the model says
        cp = P.ClientProtocol()
        rid, data = cp.send_scan(1)
        s.setblocking(True)
        s.settimeout(10)
        s.sendall(data)
        pairs, buf = [], bytearray()
        while True:
            chunk = s.recv(1 << 20)
            assert chunk
            buf += chunk
            frames, used, _ = framing.split_frames(buf, 1 << 30)
            del buf[:used]
            done = False
            for opcode, flags, frid, payload in frames:
                if frid == rid and opcode == P.Op.SCAN:
                    assert not flags & P.ERROR, P.decode_error(payload)
                    pairs += framing.decode_pairs(payload)[0]
                    done = not flags & P.MORE
            if done:
                break
        assert dict(pairs) == want
        tally["contents"] += 1
    s.close()
    if want is not None:
        # whatever was sent, nothing reached the committed state: version 0 is still empty
        deadline = time.monotonic() + 10
        while True:
            try:
                h = c.open(store, 0)
                break
            except errors.WriterConflictError:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        assert list(h.scan()) == []
        h.abort()
        tally["nothing committed"] += 1
    c.close()


def fuzz(daemon: Fuzzed, witness: Witness, mode: str, n: int) -> Counter:
    """Hypothesis draws the seeds; every stream is checked as it is fired; then what this test
    fired and checked is asserted (nothing here depends on another test)."""
    tally: Counter = Counter()
    rounds_before = witness.rounds

    @SETTINGS
    @given(seed=st.integers(0, 2**32 - 1))
    def example(seed):
        run_example(daemon, seed, n, mode, tally)

    example()
    print(mode, dict(tally))
    assert tally["streams"] >= SETTINGS.max_examples // 2, tally  # Hypothesis really ran the examples
    assert tally["frames"] == n * tally["streams"], tally
    # about 9 streams in 10 end on a healthy connection whose contents are compared with the model
    assert tally["contents"] >= tally["streams"] // 2, tally
    witness.check_served_during(rounds_before)
    return tally


def test_mutated_frames(daemon, witness):
    fuzz(daemon, witness, "mutated", 300)


def test_random_frames(daemon, witness):
    fuzz(daemon, witness, "random", 250)


def _seeds(mode: str, n: int, fatal: bool, count: int) -> list[int]:
    """The first ``count`` seeds whose stream ends (``fatal``) or not in a framing error, by the reference."""
    out = []
    seed = 0
    while len(out) < count:
        if (reference(build_stream(seed, n, mode))[2] is not None) == fatal:
            out.append(seed)
        seed += 1
    return out


def test_the_other_client_was_served_and_enough_frames_were_sent(daemon, witness):
    """Fixed streams, chosen so that both ends are exercised: connections closed after a framing
    error and healthy ones whose contents are checked; another client is served all along."""
    tally: Counter = Counter()
    rounds_before = witness.rounds
    for mode, n in (("mutated", 300), ("random", 250)):
        for fatal in (True, False):
            for seed in _seeds(mode, n, fatal, 6):
                run_example(daemon, seed, n, mode, tally)
    print(dict(tally))
    assert tally["frames"] == 12 * 300 + 12 * 250, tally
    assert tally["closed after a framing error"] == 12, tally
    assert tally["contents"] == 12, tally
    witness.check_served_during(rounds_before)
