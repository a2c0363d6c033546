"""Issue 40, edge 1: the open files of spilled stores' runs are bounded (``max_open_runs``).

Before: each run of a spilled store (its snapshot, the deltas stacked over it, flushed changes)
held an open file for as long as the run lived: the 1,100-byte memory soak
(``benchmarks/bench_memory_soak.py``) reached ~870–1,600 open files, and the workload of
``test_a_daemon_keeps_its_open_files_within_max_open_runs`` below took the daemon from 15 open files
to 389 (40 stores, 12 rounds), with no setting to bound them. Now ``files.runfiles.RunFiles``
keeps at most ``max_open_runs`` of them open and opens the others again, through a link of the
daemon's own, when they are read."""
from __future__ import annotations

import os
import shutil
import threading

import pytest

from statestore_async.client import Client
from statestore_async.config import DaemonConfig
from statestore_async.engine.store import VersionedStore
from statestore_async.errors import InterfaceError
from statestore_async.files.checkpoint import encode_snapshot
from statestore_async.files.coldrun import BlockCache, ColdRun
from statestore_async.files.runfiles import RunFiles
from statestore_async.ids import StoreId

MAX_OPEN = 32
# files a daemon opens for moments besides its runs' (an upload or a snapshot being written, a
# snapshot worker's pipes): what the bound allows on top of its idle files and its runs'
SLACK = 16
SID = StoreId("file:///unused", "op", 0)


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_daemon_keeps_its_open_files_within_max_open_runs(daemon_process, tmp_path):
    d = daemon_process("--memory-budget", "2MiB", "--spill-min-bytes", "32KiB", "--max-open-runs", str(MAX_OPEN),
                       "--log-level", "warning")
    root = f"file://{tmp_path}/root"
    sids = [StoreId(root, "files", p) for p in range(40)]
    refs: dict[StoreId, tuple[int, str | None]] = dict.fromkeys(sids, (0, None))
    keys = [b"\x00\x01" + b"k%06d" % i for i in range(300)]
    idle = open_files(d.pid)
    bound = idle + 1 + MAX_OPEN + SLACK  # + this test's connection
    peak, held = idle, 0
    with Client(d.socket, timeout=120) as c:
        for rnd in range(12):  # each round's commits stack one more delta run over each spilled store
            for sid in sids:
                h = c.open(sid, *refs[sid])
                h.put_many([(k, b"%04d" % rnd * 50) for k in keys])
                ref = h.commit()
                refs[sid] = (ref.version, ref.ckptid)
                peak = max(peak, open_files(d.pid))
            held = max(held, c.stats()["registry"]["run_files_files"])
        # every store reads back its last values, through runs opened again past the bound
        for sid in sids:
            h = c.open(sid, *refs[sid])
            assert h.get_many(keys[::37]) == [b"%04d" % 11 * 50] * len(keys[::37])
            h.abort()
        reg = c.stats()["registry"]
    assert held > 3 * MAX_OPEN, f"the workload held only {held} runs' files: it does not test the bound"
    assert reg["run_files_peak_open"] <= MAX_OPEN and reg["run_files_pinned"] == 0
    assert reg["run_files_closes"] > 0  # files closed past the bound (opened again if read: the unit tests below)
    assert peak <= bound, f"{peak} open files, bound {bound} ({idle} idle + 1 connection + {MAX_OPEN} + {SLACK})"


def runs_over(tmp_path, n: int, files: RunFiles) -> tuple[list[ColdRun], list[VersionedStore]]:
    cache = BlockCache(0, files)  # no cached blocks: every read goes to the file
    runs, stores = [], []
    for i in range(n):
        s = VersionedStore(SID)
        w = s.open(0)
        w.put_many([(b"\x00\x01" + b"k%04d" % j, b"run%03d-%04d" % (i, j)) for j in range(200)])
        w.commit()
        path = str(tmp_path / f"s{i}")
        with s.freeze() as view:
            data = encode_snapshot(view, block_bytes=512)
        with open(path, "wb") as fh:
            fh.write(data)
        runs.append(ColdRun.open(path, SID, s.head, cache))
        stores.append(s)
    return runs, stores


def test_runs_read_on_after_their_paths_are_removed_and_their_files_closed(tmp_path):
    files = RunFiles(2, park_dir=str(tmp_path / "park"))
    runs, _ = runs_over(tmp_path, 6, files)
    for i in range(6):
        os.unlink(tmp_path / f"s{i}")  # as the object store's cache evicting its copy, or retention
    assert files.stats()["open"] <= 2 and files.stats()["files"] == 6
    for _ in range(2):
        for i, run in enumerate(runs):
            assert run.get(b"\x00\x01k0007") == b"run%03d-0007" % i
    st = files.stats()
    assert st["peak_open"] <= 2 and st["opens"] >= 6 and st["pinned"] == 0
    park = list((tmp_path / "park").iterdir())
    assert len(park) == 1 and len(os.listdir(park[0])) == 6  # one link per run's file
    twin = runs[0].reopen()  # shares the file: closing the run leaves the twin readable
    runs[0].close()
    assert twin.get(b"\x00\x01k0001") == b"run000-0001"
    twin.close()
    for run in runs[1:]:
        run.close()
    assert os.listdir(park[0]) == [] and files.stats()["files"] == 0 and files.stats()["open"] == 0


def test_concurrent_readers_over_a_small_bound_read_the_right_files(tmp_path):
    files = RunFiles(2, park_dir=str(tmp_path / "park"))
    runs, _ = runs_over(tmp_path, 8, files)
    errors: list[BaseException] = []

    def read(seed: int) -> None:
        try:
            for k in range(300):
                i = (seed * 7 + k) % len(runs)
                j = (seed + k * 13) % 200
                assert runs[i].get(b"\x00\x01" + b"k%04d" % j) == b"run%03d-%04d" % (i, j)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=read, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[0]
    # files being read stay open past the bound: at most one per reading thread
    assert files.stats()["peak_open"] <= 2 + len(threads)
    for run in runs:
        run.close()


def test_a_file_that_cannot_be_linked_keeps_its_open_file(tmp_path):
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another file system than the test's folder")
    park = "/dev/shm/" + tmp_path.name
    files = RunFiles(1, park_dir=park)
    try:
        runs, _ = runs_over(tmp_path, 3, files)  # the links would cross file systems: each run is pinned
        st = files.stats()
        assert st["pinned"] == 3 and st["open"] == 3
        for i, run in enumerate(runs):
            assert run.get(b"\x00\x01k0003") == b"run%03d-0003" % i
        for run in runs:
            run.close()
        assert files.stats()["pinned"] == 0 and files.stats()["open"] == 0
    finally:
        shutil.rmtree(park, ignore_errors=True)


def test_leftover_link_folders_of_a_daemon_no_longer_running_are_removed(tmp_path):
    dead = tmp_path / "park" / "statestore-runs-999999999-x"  # no such process
    dead.mkdir(parents=True)
    (dead / "1").write_bytes(b"left by a daemon that died")
    ours = tmp_path / "park" / f"statestore-runs-{os.getpid()}-other"  # another RunFiles of this process
    ours.mkdir()
    files = RunFiles(4, park_dir=str(tmp_path / "park"))
    runs, _ = runs_over(tmp_path, 1, files)
    assert not dead.exists() and ours.exists()
    runs[0].close()


def test_max_open_runs_below_one_is_refused_by_name():
    with pytest.raises(InterfaceError, match="max_open_runs must be at least 1"):
        DaemonConfig(socket="/tmp/x.sock", max_open_runs=0)
    with pytest.raises(ValueError, match="max_open_runs must be at least 1"):
        RunFiles(0)
