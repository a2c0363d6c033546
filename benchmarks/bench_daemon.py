"""Throughput of the daemon against an in-process dict and against Redis, in one table.

    .venv/bin/python benchmarks/bench_daemon.py [--seconds 1.5] [--batches 1,16,128,1024,10000]
    .venv/bin/python benchmarks/bench_daemon.py --frames 1000000     # fire random/mutated frames

One "op" is one key read or written. Each round writes a batch of B (key, value) pairs and reads
the same B keys back:

  (a) dict    an in-process Python dict: ``d.update(items)`` then ``[d.get(k) for k in keys]``
  (b) daemon  our blocking client → daemon (a separate process, uvloop): put_many + get_many
  (c) redis   redis-py against a local ``redis-server`` (``--save '' --appendonly no``), one
              pipeline per round: MSET + MGET (SET + GET at batch 1)
  (d) arrow   the same client and daemon, batches as pyarrow binary arrays: put_many_arrow +
              get_many_arrow (no Python object per key or value on the client; needs pyarrow)
  (e) floor   the same client against a server with no engine (``--bare-server``, its own process,
              uvloop): our protocol and socket, PUT_MANY answered with its count, GET_MANY with a
              fixed 32-byte value per key. What (b) could reach with an infinitely fast store.

Round-trip latency p50/p99 is measured at batch 1 (one get_many / one GET per round trip), next to
the machine's own: a 16-byte message echoed between two Python processes over a Unix socket pair
with blocking calls and no protocol at all. Each (b) round makes two round trips (put_many and
get_many both wait for their answer), so at batch B, (b) >= 50% of (a) leaves two such round trips
and every byte of encoding, decoding and storing inside twice (a)'s time for the round.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import charts
from redis_peer import RedisServer, RedisUnavailable

from statestore_async.client.clients import Client
from statestore_async.codecs import framing
from statestore_async.ids import StoreId
from statestore_async.testing.daemon import start_daemon as start_daemon_process
from statestore_async.testing.daemon import stop_daemon, wait_until_answering
from statestore_async.wire import protocol as P

KEY_POOL = 10000


def keys_and_values(n: int):
    keys = [b"\x00\x01" + b"key-%012d" % i for i in range(n)]
    return keys, [b"v" * 32 for _ in range(n)]


def run_for(seconds: float, fn, ops_per_call: int) -> float:
    """ops/s of calling ``fn`` repeatedly for about ``seconds``."""
    fn()  # warm up
    n = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        fn()
        n += 1
        now = time.perf_counter()
        if now >= deadline:
            return n * ops_per_call / (now - start)


def latencies(fn, count: int) -> tuple[float, float]:
    samples = []
    for _ in range(count):
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    samples.sort()
    return samples[len(samples) // 2] / 1000, samples[int(len(samples) * 0.99)] / 1000


# --- the daemon -----------------------------------------------------------------------------------------
def start_daemon(folder: str, *extra: str) -> tuple[subprocess.Popen, str]:
    sock = f"{folder}/d.sock"
    proc = start_daemon_process(sock, "--log-level", "warning", "--max-batch", "100000", *extra,
                                log_path=f"{folder}/daemon.log")
    return proc, sock


# --- (e): the protocol and the socket without an engine ---------------------------------------------------
BARE_VALUE = b"v" * 32


def bare_server(path: str) -> None:
    """Serve HELLO, OPEN, PING, PUT_MANY, GET_MANY and ABORT with the daemon's protocol code and no
    store: the floor under (b). Runs until killed."""
    import asyncio

    import uvloop

    from statestore_async.ids import CheckpointRef
    from statestore_async.wire.events import Abort, GetMany, Hello, Open, Ping, PutMany
    from statestore_async.wire.protocol import Op, ServerProtocol

    limits = {"max_frame_bytes": 64 << 20, "max_batch": 100_000, "max_inflight": 64, "daemon": "bare"}

    class Bare(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport
            self.proto = ServerProtocol(max_batch=limits["max_batch"])

        def data_received(self, data):
            proto = self.proto
            proto.receive_data(data)
            for ev in proto.events():
                rid = ev.request_id
                cls = ev.__class__
                if cls is GetMany:
                    out = proto.send_values(rid, [BARE_VALUE] * len(ev.keys))
                elif cls is PutMany:
                    out = proto.send_count(rid, Op.PUT_MANY, len(ev.items))
                elif cls is Hello:
                    out = proto.send_hello(rid, limits)
                elif cls is Open:
                    out = proto.send_opened(rid, 1, CheckpointRef(ev.version, ev.ckptid or ""))
                elif cls is Ping:
                    out = proto.send_pong(rid, ev.payload)
                elif cls is Abort:
                    out = proto.send_aborted(rid)
                else:
                    raise SystemExit(f"the bare server does not serve {cls.__name__}")
                self.transport.write(out)

    async def main():
        server = await asyncio.get_running_loop().create_unix_server(Bare, path=path)
        async with server:
            await server.serve_forever()

    uvloop.run(main())


def start_bare_server(folder: str) -> tuple[subprocess.Popen, str]:
    sock = f"{folder}/bare.sock"
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--bare-server", sock],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        wait_until_answering(proc, sock)
    except BaseException:
        stop_daemon(proc, timeout=5)
        raise
    return proc, sock


def bare_round_trip(count: int = 5000) -> float:
    """p50 µs of a 16-byte message echoed by a forked child over a Unix socket pair (blocking calls)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:  # the echo: no protocol, no allocation beyond the buffer
        try:
            a.close()
            buf = bytearray(64)
            while True:
                n = b.recv_into(buf)
                if not n:
                    break
                b.sendall(buf[:n])
        finally:
            os._exit(0)
    b.close()
    msg, buf = b"x" * 16, bytearray(64)

    def once():
        a.sendall(msg)
        got = 0
        while got < 16:
            n = a.recv_into(buf)
            if not n:
                raise SystemExit("the echo process died")
            got += n

    try:
        for _ in range(500):
            once()
        return latencies(once, count)[0]
    finally:
        a.close()
        os.waitpid(pid, 0)


# --- the table ------------------------------------------------------------------------------------------
def bench(args) -> None:
    batches = [int(b) for b in args.batches.split(",")]
    all_keys, all_values = keys_and_values(KEY_POOL)
    redis_server = r = None
    if not args.no_redis:  # first: on a fresh machine this installs redis-server
        try:
            redis_server = RedisServer().start()
            r = redis_server.client()
        except RedisUnavailable as exc:
            print(f"{exc} (column (c) is skipped)", file=sys.stderr)
    folder = tempfile.mkdtemp(prefix="ssb-", dir="/tmp")
    daemon, sock = start_daemon(folder)
    bare, bare_sock = start_bare_server(folder)
    rows = []
    engine_us: dict[int, float] = {}
    try:
        import pyarrow as pa
    except ImportError:
        pa = None
    try:
        client = Client(sock)
        h = client.open(StoreId(f"file://{folder}/root", "bench", 0), 0)
        bare_client = Client(bare_sock)
        hb = bare_client.open(StoreId(f"file://{folder}/root", "bench", 0), 0)
        for b in batches:
            keys = [all_keys[i % KEY_POOL] for i in range(b)]
            items = list(zip(keys, [all_values[i % KEY_POOL] for i in range(b)]))
            mapping = dict(items)
            d: dict = {}

            def dict_round():
                d.update(items)
                [d.get(k) for k in keys]

            def daemon_round():
                h.put_many(items)
                h.get_many(keys)

            def bare_round():
                hb.put_many(items)
                hb.get_many(keys)

            a = run_for(args.seconds, dict_round, 2 * b)
            c_ops = run_for(args.seconds, daemon_round, 2 * b)
            floor = run_for(args.seconds, bare_round, 2 * b)
            if pa is not None:
                akeys, avalues = pa.array(keys, pa.binary()), pa.array([v for _, v in items], pa.binary())

                def arrow_round():
                    h.put_many_arrow(akeys, avalues)
                    h.get_many_arrow(akeys)

                ar = run_for(args.seconds, arrow_round, 2 * b)
            else:
                ar = float("nan")
            if r is not None:
                if b == 1:
                    k, v = items[0]

                    def redis_round():
                        p = r.pipeline(transaction=False)
                        p.set(k, v)
                        p.get(k)
                        p.execute()
                else:
                    def redis_round():
                        p = r.pipeline(transaction=False)
                        p.mset(mapping)
                        p.mget(keys)
                        p.execute()
                rd = run_for(args.seconds, redis_round, 2 * b)
            else:
                rd = float("nan")
            rows.append((b, a, c_ops, rd, ar, floor))
            engine_us[b] = engine_round_us(keys, [v for _, v in items])
        p50, p99 = latencies(lambda: h.get_many(all_keys[:1]), 5000)
        if r is not None:
            rp50, rp99 = latencies(lambda: r.get(all_keys[0]), 5000)
        else:
            rp50 = rp99 = float("nan")
        bare_rt = bare_round_trip()
        h.abort()
        client.close()
        bare_client.close()
    finally:
        stop_daemon(daemon)
        bare.kill()
        bare.wait()
        if redis_server is not None:
            r.close()
            redis_server.stop()
        shutil.rmtree(folder, ignore_errors=True)
    show(rows, (p50, p99, rp50, rp99, bare_rt))
    show_engine_share(rows, engine_us)
    if charts.chart_path(args):
        groups = [f"batch {b:,}" for b, *_ in rows]
        charts.bar_charts(charts.chart_path(args), "Daemon throughput: keys read or written per second", [
            charts.Panel("ops/s (log scale)", groups, {
                "(a) in-process dict": [a for _, a, *_ in rows], "(b) our daemon": [c for _, _, c, *_ in rows],
                "(c) redis-py pipelined": [rd for _, _, _, rd, *_ in rows],
                "(e) protocol, no store": [fl for *_, fl in rows]}, "ops/s", log=True),
            charts.Panel("our daemon (b) as a share of", groups, {
                "(a) in-process dict": [c / a for _, a, c, *_ in rows],
                "(e) protocol, no store": [c / fl for _, _, c, _, _, fl in rows]}, "ratio",
                fmt=lambda v: f"{v:.0%}", reference=(1.0, "100%"))],
            charts.measured_caption(f"1 op = 1 key; each round puts a batch and reads it back; round trip at batch 1: "
                                    f"p50 {p50:.0f} µs, p99 {p99:.0f} µs"))


def engine_round_us(keys: list[bytes], values: list[bytes], seconds: float = 1.0) -> float:
    """µs the daemon's engine work of one (b) round takes in-process: the PUT_MANY payload into an
    open version's overlay, then the GET_MANY answer for the same keys (the request routines of
    ``daemon.payloads`` on ``engine.table`` tables, as the daemon calls them)."""
    from statestore_async.daemon import payloads as P
    from statestore_async.engine import table as T

    pairs, klist = framing.encode_pairs(list(zip(keys, values))), framing.encode_list(keys)
    base, overlay = T.Table(), T.Table()
    P.put_packed(overlay, pairs, 0, 2)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            P.put_packed(overlay, pairs, 0, 2)
            P.get_packed(overlay, base, klist, 0)
        n += 20
    return (time.perf_counter() - t0) / n * 1e6


def show_engine_share(rows, engine_us: dict[int, float]) -> None:
    """The engine's own work per round next to (e)'s whole round: what separates (b) from (e) when
    nothing else does (the daemon's engine work partly overlaps the client's encoding of its next
    request, so (b)/(e) can come out a little above ``(e) / ((e) + engine)``)."""
    for b, _, c, _, _, fl in rows:
        if b < 1024:
            continue
        e_round = 2 * b / fl * 1e6
        serial = e_round / (e_round + engine_us[b])
        print(f"  batch {b}: (e) round {e_round:,.0f} µs; the engine's work {engine_us[b]:,.1f} µs in-process "
              f"({engine_us[b] / e_round:.0%} of it; (e)/((e)+engine) = {serial:.1%}); (b)/(e) measured {c / fl:.1%}")


def show(rows, lat) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover
        Console = None
    headers = ["batch", "(a) dict ops/s", "(b) daemon ops/s", "(c) redis ops/s", "(b)/(a)", "(b)/(c)",
               "(d) arrow ops/s", "(d)/(a)", "(d)/(c)", "(e) floor ops/s", "(e)/(a)", "(b)/(e)"]
    body = [[f"{b}", f"{a:,.0f}", f"{c:,.0f}", f"{rd:,.0f}", f"{c / a:.1%}", f"{c / rd:.2f}x",
             f"{ar:,.0f}", f"{ar / a:.1%}", f"{ar / rd:.2f}x", f"{fl:,.0f}", f"{fl / a:.1%}", f"{c / fl:.1%}"]
            for b, a, c, rd, ar, fl in rows]
    title = (f"round trip at batch 1: daemon p50 {lat[0]:.0f} µs p99 {lat[1]:.0f} µs | "
             f"redis GET p50 {lat[2]:.0f} µs p99 {lat[3]:.0f} µs | "
             f"bare socket echo between two Python processes p50 {lat[4]:.0f} µs")
    if Console is not None:
        t = Table(title="statestore_async daemon throughput (1 op = 1 key read or written)", caption=title)
        for hd in headers:
            t.add_column(hd, justify="right")
        for row in body:
            t.add_row(*row)
        Console(width=max(160, shutil.get_terminal_size().columns)).print(t)
    else:
        print(" | ".join(headers))
        for row in body:
            print(" | ".join(row))
        print(title)
    big = [(b, a, c, rd) for b, a, c, rd, _, _ in rows if b >= 1024]
    if big:
        ok_a = all(c >= 0.5 * a for _, a, c, _ in big)
        ok_c = all(c >= 3 * rd for _, _, c, rd in big if rd == rd)
        print(f"targets at batch >= 1024: (b) >= 50% of (a): {'met' if ok_a else 'NOT met'}; "
              f"(b) >= 3x (c): {'met' if ok_c else 'NOT met'}")
        for b, a, _, _ in big:
            budget = 2 * (2 * b / a) * 1e6  # twice (a)'s µs per round
            print(f"  batch {b}: (a) takes {budget / 2:,.0f} µs per round; 50% of (a) allows {budget:,.0f} µs per "
                  f"(b) round, of which two bare round trips take {2 * lat[4]:,.0f} µs")


# --- frames mode ----------------------------------------------------------------------------------------
def fire_frames(args) -> None:
    """Send N random/mutated frames (in streams of 500 on fresh connections); check each is answered."""
    folder = tempfile.mkdtemp(prefix="ssb-", dir="/tmp")
    daemon, sock = start_daemon(folder, "--max-frame-bytes", "4096", "--max-batch", "16")
    rng = random.Random(args.seed)
    sent = answered = errors = closes = 0
    t0 = time.perf_counter()
    try:
        while sent < args.frames:
            n = min(500, args.frames - sent)
            stream, rids = [], []
            for i in range(n):
                rid = i + 1
                kind = rng.random()
                if kind < 0.4:
                    payload = struct.pack("<I", 1) + framing.encode_pairs(
                        [(b"\x00\x01" + rng.randbytes(3), rng.randbytes(5)) for _ in range(rng.randint(0, 6))])
                    frame = bytearray(framing.encode_frame(P.Op.PUT_MANY, 0, rid, payload))
                    for _ in range(rng.randint(0, 3)):
                        frame[rng.randrange(10, len(frame))] = rng.randrange(256)
                    frame = bytes(frame)
                else:
                    frame = framing.encode_frame(rng.randrange(256), rng.choice([0, 0, 1, 2]), rid,
                                                 rng.randbytes(rng.randint(0, 40)))
                stream.append(frame)
                rids.append(rid)
            cp = P.ClientProtocol()
            prefix = cp.send_hello()[1] + cp.send_open(StoreId(f"file://{folder}/root", "frames", 0), 0)[1]
            got, closed = _exchange(sock, prefix + b"".join(stream), 2 + n)
            answered += got[0] - 2
            errors += got[1]
            closes += closed
            sent += n
            if got[0] - 2 != n:
                raise SystemExit(f"only {got[0] - 2} of {n} frames were answered")
            if daemon.poll() is not None:
                raise SystemExit("the daemon died")
        Client(sock).ping()
    finally:
        stop_daemon(daemon)
        shutil.rmtree(folder, ignore_errors=True)
    dt = time.perf_counter() - t0
    print(f"{sent:,} frames sent, {answered:,} answered ({errors:,} with a coded error) in {dt:.1f}s "
          f"({sent / dt:,.0f} frames/s); the daemon kept serving")


def _exchange(sock_path: str, data: bytes, expect: int):
    import selectors

    s = socket.socket(socket.AF_UNIX)
    s.connect(sock_path)
    s.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE)
    out = memoryview(data)
    buf = bytearray()
    finals = errs = 0
    closed = False
    while finals < expect and not closed:
        for _, mask in sel.select(10):
            if mask & selectors.EVENT_WRITE and out:
                try:
                    out = out[s.send(out[:65536]):]
                except BlockingIOError:
                    pass
                if not out:
                    sel.modify(s, selectors.EVENT_READ)
            if mask & selectors.EVENT_READ:
                chunk = s.recv(1 << 20)
                if not chunk:
                    closed = True
                    break
                buf += chunk
                frames, used, _ = framing.split_frames(buf, 1 << 30)
                del buf[:used]
                for _, flags, _, _ in frames:
                    if not flags & P.MORE:
                        finals += 1
                    errs += bool(flags & P.ERROR)
    s.close()
    return (finals, errs), closed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=1.5, help="time per measurement")
    ap.add_argument("--batches", default="1,16,128,1024,10000")
    ap.add_argument("--no-redis", action="store_true")
    ap.add_argument("--frames", type=int, default=0, help="fire N random/mutated frames instead")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bare-server", metavar="SOCKET", help=argparse.SUPPRESS)  # (e)'s server process
    charts.add_chart_args(ap, "bench_daemon")
    args = ap.parse_args()
    if args.bare_server:
        bare_server(args.bare_server)
    elif args.frames:
        fire_frames(args)
    else:
        bench(args)


if __name__ == "__main__":
    main()
