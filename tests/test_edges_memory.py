"""Issue 40, edge 1: the memory budget holds when stores grow past ``spill_min_bytes``.

Before: a store too large to be evicted whole but without a snapshot at its head to spill onto
was kept in memory until maintenance wrote that snapshot (``continue``: neither spilled nor
evicted), and a spilled store holding less than ``spill_min_bytes`` was never evicted. Under the
soak with growing stores (``benchmarks/bench_memory_soak.py --new-keys``) the daemon's own count
went to 835 MiB against a 32 MiB budget within two minutes, with 433,055 spill requests, no
eviction after 30 s and 3,273 open files. Real daemons in-process (both loops), local roots."""
from __future__ import annotations

from statestore_async.client.clients import AsyncClient
from statestore_async.daemon.registry import MAX_SPILL_WAITS
from statestore_async.ids import StoreId
from statestore_async.testing.daemon import wait_until

DEADLINE = 60.0



def items(p: int, n: int, size: int = 100) -> list[tuple[bytes, bytes]]:
    return [(b"\x00\x01" + b"p%03d-k%06d" % (p, i), b"v" * size) for i in range(n)]


async def test_large_idle_stores_without_a_snapshot_leave_memory_but_a_few_that_wait_to_spill(daemon_factory,
                                                                                             tmp_path):
    d = await daemon_factory(memory_budget=256 << 10, spill_min_bytes=64 << 10, snapshot_interval=1000)
    sids = [StoreId(f"file://{tmp_path}/root", "big", p) for p in range(5)]
    reg = d.registry
    assert reg is not None
    refs = {}
    async with AsyncClient(d.config.socket) as c:
        for p, sid in enumerate(sids):
            h = await c.open(sid, 0)
            await h.put_many(items(p, 3000))  # ~350 KB each: over the budget, far over spill_min_bytes
            refs[sid] = ref = await h.commit()
            assert await c.await_durable(sid, ref, DEADLINE)
        reg.enforce_budget()
        # none has a snapshot at its head (snapshot_interval 1000): MAX_SPILL_WAITS of them wait in
        # memory for the snapshot asked for them, the others leave memory whole
        held = [s for s in sids if reg.get(s) is not None]
        assert len(held) <= MAX_SPILL_WAITS, f"{len(held)} idle stores stayed in memory waiting for a snapshot"
        # those spill onto their snapshots once written, and the count comes back under the budget
        await wait_until(lambda: all(reg.get(s) is None or reg.get(s).cold is not None for s in held),
                       "the waiting stores to spill")
        reg.enforce_budget()
        assert reg.memory_bytes <= reg.memory_budget
        for p, sid in enumerate(sids):  # every one reads back, from memory, its snapshot or its files
            h = await c.open(sid, refs[sid].version, refs[sid].ckptid)
            assert await h.get_many([items(p, 1)[0][0]]) == [b"v" * 100]
            await h.abort()


async def test_small_spilled_stores_leave_memory_when_together_they_pass_the_budget(daemon_factory, tmp_path):
    d = await daemon_factory(memory_budget=64 << 20, spill_min_bytes=32 << 10, snapshot_interval=1)
    reg = d.registry
    assert reg is not None
    sids = [StoreId(f"file://{tmp_path}/root", "many", p) for p in range(6)]
    refs = {}
    async with AsyncClient(d.config.socket) as c:
        for p, sid in enumerate(sids):
            h = await c.open(sid, 0)
            await h.put_many(items(p, 1000))
            refs[sid] = ref = await h.commit()
            assert await c.await_durable(sid, ref, DEADLINE)
        # each gets its snapshot (snapshot_interval 1), then spills onto it once memory is short
        await wait_until(lambda: all(reg.get(s) is not None and reg.get(s).has_snapshot(reg.get(s).head)
                                   for s in sids), "every store's snapshot")
        reg.memory_budget = 1
        reg.enforce_budget()
        spilled_or_gone = [reg.get(s) is None or reg.get(s).cold is not None for s in sids]
        assert all(spilled_or_gone)
        # spilled stores each hold less than spill_min_bytes: together they are still over the
        # budget of 1 byte, so they leave memory too
        assert len(reg) == 0 and reg.memory_bytes <= reg.memory_budget
        reg.memory_budget = 64 << 20
        for p, sid in enumerate(sids):  # each loads back from its files
            h = await c.open(sid, refs[sid].version, refs[sid].ckptid)
            assert await h.get_many([items(p, 1)[0][0]]) == [b"v" * 100]
            await h.abort()


def test_the_daemon_raises_its_open_files_limit_to_the_hard_one(tmp_path, sockdir):
    """Spilled stores hold one open file per run (~870-1,600 in the 1,100-byte soak): a daemon
    started with a soft limit of 256 raises it to the hard limit at start."""
    import resource
    import subprocess

    from statestore_async.testing.daemon import serve_command, stop_daemon, wait_until_answering

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    socket_path = f"{sockdir}/d.sock"
    log_path = f"{tmp_path}/daemon.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(serve_command(socket_path), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL,
                                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)))
    try:
        wait_until_answering(proc, socket_path, log_path=log_path)
        with open(f"/proc/{proc.pid}/limits") as fh:
            line = next(x for x in fh if x.startswith("Max open files"))
        soft_now = int(line.split()[3])
        assert soft_now == hard, line
    finally:
        assert stop_daemon(proc) == 0
