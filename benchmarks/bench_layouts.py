"""Which in-memory data layout should the engine use? Four candidates, one adapter, one table.

    .venv/bin/python benchmarks/bench_layouts.py            # 1M records, 64 MiB budget (~65 s on 2 cores)
    .venv/bin/python benchmarks/bench_layouts.py --quick    # 100k records, 8 MiB budget (a smoke run)

Candidates (each behind ``Layout`` below: what ``engine.store`` needs of its data):

  (a) table   ``statestore_async.engine.table.Table``: a Cython arena hash table with ordered scans;
              the overlay is a second Table, commit is ``table.apply`` (changes + pre-images).
  (b) lmdb    LMDB through py-lmdb, one environment per store in a temp folder (writemap, no
              fsync: durability is the object store's); the overlay is a dict, an open version
              reads through a read transaction (MVCC), commit is one write transaction whose
              ``replace``/``pop`` give the pre-images, freeze is a read transaction.
  (c) rocksdb RocksDB through rocksdict (raw bytes mode, WAL off), block cache bounded to the
              memory budget (partitioned index and 10-bit bloom filter blocks charged to it); the
              overlay is a dict, commit is a multi_get of the pre-images and one WriteBatch,
              freeze is a snapshot plus an iterator made at once (rocksdict's snapshot iteration
              does not read the snapshot), bulk loads go through SstFileWriter + ingest.
  (d) dict    the engine's layout until 5f084bc: ``dict[bytes, bytes]`` with a dict overlay and the
              compiled routines of ``engine.overlay`` (put_packed, get_packed, apply_changes,
              group_records, gather_records) exactly as ``engine/store.py`` used them at bea55b6.

Records are like workload W's state: 12-byte keys (2-byte key group, G = 4096, + 10 digits) and
16-byte values (two int64). Every candidate runs in fresh subprocesses (one for the measurements
at N records, one for the memory-budget case), so resident memory is the candidate's own.

What is measured (the rows of the table):
  1. resident bytes per record at N loaded: RSS after the load minus RSS before, / N (and / 28 raw
     bytes); the files of LMDB and RocksDB on disk are shown next to it (page cache, not RSS);
  2. one daemon round at batch 1024 against N records: put 1024 records from an ``encode_pairs``
     payload into the open version, then the ``encode_optional_list`` answer for the same keys;
     also a GET of 1024 keys the open version has not written (the committed state's read path);
  3. commit of 1% and of 100% of the keys changed (apply + pre-images for undo);
  4. freeze a view for a snapshot, commit 1% while it lives, and read all of it in key order
     (64 KiB chunks of records, as the inline snapshot writer takes them; the view must show none
     of that commit); the dict gives key-group order (its snapshot path);
  5. rollback of the last commit (apply its pre-images);
  6. load N records from a list of (key, value) pairs into an empty store;
  7. a state 4× the memory budget: peak RSS, RSS after reads (anon / file-backed), point GETs
     (batches of 1024 random keys) right after the files' page cache was dropped and again;
  8. a prefix scan that matches 10 keys: the first one (the Table builds its order index) and the
     median; measured last, so that no row above runs with an order index it did not build.

The machine is shared and noisy: compare the candidates' figures within one run.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import charts
import numpy as np

from statestore_async.codecs import framing
from statestore_async.engine.levels import merge_ordered

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

KEY_GROUPS = 4096
KEY_BYTES = 12
VALUE_BYTES = 16
RAW = KEY_BYTES + VALUE_BYTES
BATCH = 1024
MIN_KEY = 2  # the key-group prefix
MAX_COUNT = (1 << 32) - 1
CHUNK_BYTES = 64 << 10  # records per snapshot step (daemon/maintenance.py STEP_BLOCK_BYTES)
LOAD_CHUNK = 65536  # records per load step (a snapshot file is read block by block)
MIB = 1 << 20
# the dict's accounting (engine/store.py ENTRY_OVERHEAD at bea55b6); only the dict routines use it
DICT_ENTRY_OVERHEAD = 2 * 33 + 40

LAYOUTS = {
    "table": "(a) Table",
    "lmdb": "(b) LMDB",
    "rocksdb": "(c) RocksDB",
    "dict": "(d) dict (bea55b6)",
}


# --------------------------------------------------------------------------------------------------
# the data: key i is key group i // per_group, then the 10 digits of i % per_group (so keys in index
# order are in key order); value = (tag, i) as two little-endian uint64
# --------------------------------------------------------------------------------------------------
class Dataset:
    def __init__(self, n: int):
        self.n = n
        self.per_group = -(-n // KEY_GROUPS)

    def keys(self, idx) -> list[bytes]:
        idx = np.asarray(idx, dtype=np.int64)
        kg, j = np.divmod(idx, self.per_group)
        a = np.empty((len(idx), KEY_BYTES), np.uint8)
        a[:, 0] = kg >> 8
        a[:, 1] = kg & 0xFF
        for d in range(10):
            a[:, KEY_BYTES - 1 - d] = 48 + (j // 10**d) % 10
        b = a.tobytes()
        return [b[p:p + KEY_BYTES] for p in range(0, len(b), KEY_BYTES)]

    def values(self, idx, tag: int) -> list[bytes]:
        idx = np.asarray(idx, dtype=np.int64)
        a = np.empty((len(idx), 2), "<u8")
        a[:, 0] = tag
        a[:, 1] = idx
        b = a.tobytes()
        return [b[p:p + VALUE_BYTES] for p in range(0, len(b), VALUE_BYTES)]

    def records(self, idx, tag: int) -> list[tuple[bytes, bytes]]:
        return list(zip(self.keys(idx), self.values(idx, tag)))

    def chunks(self, tag: int = 1, size: int = LOAD_CHUNK):
        """All records in key order, ``size`` at a time (as a snapshot's blocks come)."""
        for start in range(0, self.n, size):
            yield self.records(np.arange(start, min(start + size, self.n)), tag)

    def scan_targets(self, count: int, rng) -> list[tuple[bytes, list[int]]]:
        """``count`` (prefix, the indices of its 10 keys): an 11-byte prefix = key group + 9 digits."""
        out = []
        while len(out) < count:
            i = int(rng.integers(0, self.n))
            kg, j = divmod(i, self.per_group)
            m = j // 10
            first = kg * self.per_group + 10 * m
            if 10 * m + 9 >= self.per_group or first + 9 >= self.n:
                continue
            out.append((kg.to_bytes(2, "big") + b"%09d" % m, list(range(first, first + 10))))
        return out


# --------------------------------------------------------------------------------------------------
# memory of this process
# --------------------------------------------------------------------------------------------------
_LIBC = ctypes.CDLL("libc.so.6")


def status() -> dict[str, int]:
    """VmRSS, VmHWM (peak), RssAnon, RssFile of this process, in bytes, after a full collection and
    a malloc_trim (so memory freed by Python goes back before it is counted)."""
    gc.collect()
    _LIBC.malloc_trim(0)
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[name] = int(rest.split()[0]) * 1024
    return out


def folder_bytes(path: str) -> int:
    """Bytes the files under ``path`` occupy on disk (allocated blocks: LMDB's file is sparse)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(dirpath, f)).st_blocks * 512
    return total


def drop_page_cache(path: str) -> None:
    """Ask the kernel to drop the cached pages of every file under ``path`` (none may be mapped)."""
    for dirpath, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# --------------------------------------------------------------------------------------------------
# the adapter: what engine.store needs of its data
# --------------------------------------------------------------------------------------------------
def _merge(changes, base):
    """Key-ordered union of two key-ordered (key, value|None) lists, ``changes`` winning; None
    hides (the engine's own merge, ``StoreVersion.scan``'s)."""
    return list(merge_ordered(changes, base))


def _decode_pairs_checked(buf, offset):
    items, end = framing.decode_pairs(buf, offset)
    for k, _ in items:
        if len(k) < MIN_KEY:
            raise ValueError("short key")
    return items


def _chunked(records_iter, max_bytes: int):
    """Lists of records whose ``len(k) + len(v) + 11`` add up to at most ``max_bytes``."""
    block: list = []
    size = 0
    for k, v in records_iter:
        n = len(k) + len(v) + 11
        if size and size + n > max_bytes:
            yield block
            block = []
            size = 0
        block.append((k, v))
        size += n
    if block:
        yield block


class Layout:
    """One store's committed state plus at most one open version (its overlay).

    ``load(chunks)`` builds the committed state from record lists; ``open()`` starts a version;
    ``put_packed`` / ``get_packed`` are the daemon's PUT_MANY / GET_MANY on it; ``commit()`` applies
    the overlay and returns the undo; ``rollback(undo)`` moves the committed state back;
    ``freeze()`` gives a view that later commits do not change, ``read_view`` its records in key
    order as lists, ``release`` ends it; ``scan(prefix)`` is the open version's ordered prefix scan.
    """

    name = ""
    note = ""

    def __init__(self, folder: str, cache_bytes: int):
        self.folder = folder
        self.cache_bytes = cache_bytes

    def load(self, chunks) -> None: ...
    def open(self) -> None: ...
    def put_packed(self, buf: bytes, offset: int) -> None: ...
    def get_packed(self, buf: bytes, offset: int) -> bytes: ...
    def commit(self): ...
    def rollback(self, undo) -> None: ...
    def abort(self) -> None: ...
    def freeze(self): ...
    def read_view(self, view, max_bytes: int): ...
    def release(self, view) -> None: ...
    def scan(self, prefix: bytes) -> list[tuple[bytes, bytes]]: ...

    def disk_bytes(self) -> int:
        return 0

    def export(self, max_bytes: int):
        """A layout's own faster path to write a snapshot, if it has one: (seconds to make the
        view, seconds to read it whole as encoded payloads, payload bytes); else None."""
        return None

    def cool(self) -> None:
        """Drop what the OS caches of this store's files (the disk-backed layouts reopen)."""

    def close(self) -> None: ...


class TableLayout(Layout):
    name = "table"

    def __init__(self, folder, cache_bytes):
        super().__init__(folder, cache_bytes)
        from statestore_async.daemon import payloads as P
        from statestore_async.engine import table as T

        self.T, self.P = T, P
        self.base = T.Table()
        self.ov = None

    def load(self, chunks):
        for records in chunks:
            self.T.load_records(self.base, records)

    def open(self):
        self.ov = self.T.Table()

    def put_packed(self, buf, offset):
        self.P.put_packed(self.ov, buf, offset, MIN_KEY, MAX_COUNT)

    def get_packed(self, buf, offset):
        return self.P.get_packed(self.ov, self.base, buf, offset, MAX_COUNT)

    def commit(self):
        records, undo = self.T.apply(self.base, self.ov)
        self.ov = None
        return records, undo  # the Delta keeps the records, the history both

    def rollback(self, undo):
        self.T.apply(self.base, undo[1])

    def abort(self):
        self.ov = None

    def freeze(self):
        return self.base.freeze()

    def read_view(self, view, max_bytes):
        pos = 0
        while True:
            block, pos = view.chunk(pos, max_bytes)
            if not block:
                return
            yield block

    def release(self, view):
        view.release()

    def scan(self, prefix):
        return _merge(self.ov.scan(prefix), self.base.scan(prefix))

    def export(self, max_bytes):
        # files.checkpoint's snapshot path since da2e2b5: freeze (export sort), then chunk_packed (blockcodec
        # record payloads written from the arena)
        t0 = time.perf_counter()
        view = self.base.freeze()
        t1 = time.perf_counter()
        pos = nbytes = 0
        while True:
            payload, pos, _, _ = view.chunk_packed(pos, max_bytes)
            if not payload:
                break
            nbytes += len(payload)
        t2 = time.perf_counter()
        view.release()
        return t1 - t0, t2 - t1, nbytes


BASELINE_COMMIT = "bea55b6"  # the last commit whose engine was a dict of bytes (engine.overlay)


def dict_routines():
    """The dict layout's compiled routines (``engine.overlay`` as of BASELINE_COMMIT), with where
    they came from. The engine no longer has them: they are built from that commit's
    ``_ext/overlay.pyx`` (git show + cythonize, into a cache folder) the first time, else the
    pure-Python twin of that commit is used (far slower: the row then says so)."""
    import importlib.util
    import subprocess

    cache = os.path.join(ROOT, ".cache", f"overlay-{BASELINE_COMMIT}")
    os.makedirs(cache, exist_ok=True)

    def source(path):
        return subprocess.run(["git", "-C", ROOT, "show", f"{BASELINE_COMMIT}:{path}"], check=True,
                              capture_output=True).stdout

    built = [f for f in os.listdir(cache) if f.startswith("overlay") and f.endswith(".so")]
    if not built:
        try:
            for path in ("_ext/overlay.pyx", "_ext/_wire.pxd"):
                with open(os.path.join(cache, os.path.basename(path)), "wb") as f:
                    f.write(source(path))
            subprocess.run([sys.executable, "-c",
                            "from setuptools import setup; from Cython.Build import cythonize; "
                            "setup(ext_modules=cythonize(['overlay.pyx'], language_level=3, "
                            "compiler_directives={'boundscheck': False, 'wraparound': False}), "
                            "script_args=['-q', 'build_ext', '--inplace'])"],
                           cwd=cache, check=True, capture_output=True)
            built = [f for f in os.listdir(cache) if f.startswith("overlay") and f.endswith(".so")]
        except (subprocess.CalledProcessError, OSError) as exc:
            print(f"(d) dict: could not build {BASELINE_COMMIT}'s overlay.pyx ({exc}); using its Python twin",
                  file=sys.stderr)
    if built:
        spec = importlib.util.spec_from_file_location("overlay", os.path.join(cache, built[0]))
        where = f"compiled from {BASELINE_COMMIT}:_ext/overlay.pyx"
    else:
        ref = os.path.join(cache, "overlay_ref.py")
        with open(ref, "wb") as f:
            f.write(source("statestore_async/_ref/overlay.py"))
        spec = importlib.util.spec_from_file_location("overlay_baseline", ref)
        where = f"the pure-Python twin of {BASELINE_COMMIT} (slow)"
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, where


class DictLayout(Layout):
    name = "dict"

    def __init__(self, folder, cache_bytes):
        super().__init__(folder, cache_bytes)
        self.R, src = dict_routines()
        self.note = f"routines: {src}"
        self.data: dict[bytes, bytes] = {}
        self.ov = None
        self.views: list = []

    def load(self, chunks):
        # the loader at bea55b6: dict(base_records); chunk by chunk here
        update = self.data.update
        for records in chunks:
            update(records)

    def open(self):
        self.ov = {}

    def put_packed(self, buf, offset):
        self.R.put_packed(self.ov, buf, offset, MIN_KEY, DICT_ENTRY_OVERHEAD, MAX_COUNT)

    def get_packed(self, buf, offset):
        return self.R.get_packed(self.ov, self.data, buf, offset, MAX_COUNT)

    def _mutate(self, changes):
        pre, records, _, _, _ = self.R.apply_changes(self.data, changes, DICT_ENTRY_OVERHEAD)
        for _, shadow in self.views:  # FrozenView._preserve: the first pre-image of a key is kept
            for k, old in zip(records, pre):
                if k not in shadow:
                    shadow[k] = old
        return records, pre

    def commit(self):
        undo = self._mutate(self.ov)
        self.ov = None
        return undo

    def rollback(self, undo):
        records, pre = undo
        self._mutate(dict(zip(records, pre)))

    def abort(self):
        self.ov = None

    def freeze(self):
        # FrozenView: the keys listed once, a shadow of pre-images that later mutations fill
        view = (list(self.data), {})
        self.views.append(view)
        return view

    def read_view(self, view, max_bytes):
        # files.checkpoint.snapshot_steps at bea55b6: group by key group 65536 keys at a time, then gather
        keys, shadow = view
        groups: list = [None] * (1 << 16)
        for start in range(0, len(keys), 65536):
            self.R.group_records(keys, start, start + 65536, shadow, self.data, groups)
        cursor = (0, 0)
        while True:
            block, cursor = self.R.gather_records(groups, cursor, max_bytes)
            if not block:
                return
            yield block

    def release(self, view):
        self.views.remove(view)

    def scan(self, prefix):
        # StoreVersion.scan at bea55b6: every key of the store is looked at
        overlay, base = self.ov, self.data
        found = [(k, v) for k, v in base.items() if k.startswith(prefix) and k not in overlay]
        found.extend((k, v) for k, v in overlay.items() if v is not None and k.startswith(prefix))
        return found


class LmdbLayout(Layout):
    name = "lmdb"

    def __init__(self, folder, cache_bytes):
        super().__init__(folder, cache_bytes)
        import lmdb

        self.lmdb = lmdb
        self.note = (f"py-lmdb {lmdb.__version__} (LMDB {'.'.join(map(str, lmdb.version()))}); writemap, "
                     "no sync, no readahead; overlay dict; reads in a read txn")
        self.path = os.path.join(folder, "lmdb")
        self.env = self._open()
        self.ov = None
        self.rtxn = None

    def _open(self):
        return self.lmdb.open(self.path, map_size=1 << 36, subdir=True, sync=False, metasync=False,
                              writemap=True, readahead=False, max_readers=64, max_dbs=0)

    def load(self, chunks):
        for records in chunks:
            # one write txn per chunk; the records come in key order (a snapshot's order)
            with self.env.begin(write=True) as txn:
                txn.cursor().putmulti(records, append=True)

    def open(self):
        self.ov = {}
        self.rtxn = self.env.begin(buffers=False)

    def put_packed(self, buf, offset):
        self.ov.update(_decode_pairs_checked(buf, offset))

    def get_packed(self, buf, offset):
        keys, _ = framing.decode_list(buf, offset)
        ov, get = self.ov, self.rtxn.get
        return framing.encode_optional_list([ov[k] if k in ov else get(k) for k in keys])

    def commit(self):
        ov = self.ov
        self.rtxn.abort()
        self.rtxn = self.ov = None
        with self.env.begin(write=True) as txn:
            rep, pop = txn.replace, txn.pop
            pre = [rep(k, v) if v is not None else pop(k) for k, v in ov.items()]
        return ov, pre

    def rollback(self, undo):
        records, pre = undo
        with self.env.begin(write=True) as txn:
            put, delete = txn.put, txn.delete
            for k, old in zip(records, pre):
                if old is None:
                    delete(k)
                else:
                    put(k, old)

    def abort(self):
        if self.rtxn is not None:
            self.rtxn.abort()
        self.rtxn = self.ov = None

    def freeze(self):
        return self.env.begin(buffers=False)

    def read_view(self, view, max_bytes):
        return _chunked(view.cursor().iternext(), max_bytes)

    def release(self, view):
        view.abort()

    def scan(self, prefix):
        found = []
        cur = self.rtxn.cursor()
        if cur.set_range(prefix):
            for k, v in cur.iternext():
                if not k.startswith(prefix):
                    break
                found.append((k, v))
        ov = self.ov
        if ov:
            changes = sorted((k, v) for k, v in ov.items() if k.startswith(prefix))
            return _merge(changes, [(k, v) for k, v in found])
        return found

    def disk_bytes(self):
        return folder_bytes(self.path)

    def cool(self):
        self.env.close()
        drop_page_cache(self.path)
        self.env = self._open()

    def close(self):
        self.abort()
        self.env.close()


class RocksLayout(Layout):
    name = "rocksdb"

    def __init__(self, folder, cache_bytes):
        super().__init__(folder, cache_bytes)
        import rocksdict

        self.r = rocksdict
        self.path = os.path.join(folder, "rocksdb")
        self.cache = rocksdict.Cache(cache_bytes)
        self.note = (f"rocksdict {_dist_version('rocksdict')}; block cache {cache_bytes // MIB} MiB (partitioned index "
                     "and 10-bit bloom filters charged to it), Snappy, memtable 16 MiB ×2, WAL off; overlay dict")
        self.db = self._open()
        self.ov = None
        self._sst = 0

    def _options(self):
        r = self.r
        opts = r.Options(raw_mode=True)
        opts.create_if_missing(True)
        bbo = r.BlockBasedOptions()
        bbo.set_block_cache(self.cache)
        # index and filter blocks are charged to the cache; partitioned, or each GET would look up
        # one whole-file index/filter block (~60 µs per single GET at 1M keys, measured)
        bbo.set_cache_index_and_filter_blocks(True)
        bbo.set_bloom_filter(10, False)
        bbo.set_index_type(r.BlockBasedIndexType.two_level_index_search())
        bbo.set_partition_filters(True)
        bbo.set_pin_top_level_index_and_filter(True)
        bbo.set_metadata_block_size(4096)
        opts.set_block_based_table_factory(bbo)
        opts.set_write_buffer_size(16 * MIB)
        opts.set_max_write_buffer_number(2)
        opts.set_max_background_jobs(2)
        return opts

    def _open(self):
        opts = self._options()
        # the default column family's options named too: else a reopened DB gets the defaults (an 8 MiB cache)
        db = self.r.Rdict(self.path, options=opts, column_families={"default": opts})
        wo = self.r.WriteOptions()
        wo.disable_wal = True
        db.set_write_options(wo)
        return db

    def load(self, chunks):
        # bulk load: one sorted SST file written as the records come, then ingested
        self._sst += 1
        sst = os.path.join(self.folder, f"load{self._sst}.sst")
        w = self.r.SstFileWriter(options=self._options())
        w.open(sst)
        n = 0
        for records in chunks:
            for k, v in records:
                w[k] = v
            n += len(records)
        if n:
            w.finish()
            self.db.ingest_external_file([sst])
        with contextlib.suppress(OSError):
            os.unlink(sst)

    def open(self):
        self.ov = {}

    def put_packed(self, buf, offset):
        self.ov.update(_decode_pairs_checked(buf, offset))

    def get_packed(self, buf, offset):
        keys, _ = framing.decode_list(buf, offset)
        ov = self.ov
        if ov:
            miss = [k for k in keys if k not in ov]
            got = iter(self.db.get(miss) if miss else ())
            vals = [ov[k] if k in ov else next(got) for k in keys]
        else:
            vals = self.db.get(keys)
        return framing.encode_optional_list(vals)

    def commit(self):
        ov = self.ov
        self.ov = None
        keys = sorted(ov)  # the pre-images read in key order: ~40% faster than the overlay's order at 1M
        pre = self.db.get(keys)
        wb = self.r.WriteBatch(raw_mode=True)
        put, delete = wb.put, wb.delete
        for k in keys:
            v = ov[k]
            if v is None:
                delete(k)
            else:
                put(k, v)
        self.db.write(wb)
        return keys, pre

    def rollback(self, undo):
        records, pre = undo
        wb = self.r.WriteBatch(raw_mode=True)
        for k, old in zip(records, pre):
            if old is None:
                wb.delete(k)
            else:
                wb.put(k, old)
        self.db.write(wb)

    def abort(self):
        self.ov = None

    def freeze(self):
        # rocksdict 0.3.29's Snapshot.items()/iter() read the live DB, not the snapshot (this
        # benchmark's isolation check caught it); an iterator made now holds RocksDB's implicit
        # snapshot (it pins the memtables and SST files of this moment), so the view is one
        return self.db.snapshot(), self.db.items()

    def read_view(self, view, max_bytes):
        return _chunked(view[1], max_bytes)

    def release(self, view):
        pass  # the caller lets go of the view: snapshot and iterator are released with it

    def scan(self, prefix):
        found = []
        it = self.db.iter()
        it.seek(prefix)
        while it.valid():
            k = it.key()
            if not k.startswith(prefix):
                break
            found.append((k, it.value()))
            it.next()
        del it
        ov = self.ov
        if ov:
            changes = sorted((k, v) for k, v in ov.items() if k.startswith(prefix))
            return _merge(changes, found)
        return found

    def disk_bytes(self):
        return folder_bytes(self.path)

    def cool(self):
        self.db.close()
        del self.db
        gc.collect()
        drop_page_cache(self.path)
        self.cache = self.r.Cache(self.cache_bytes)  # an empty block cache too
        self.db = self._open()

    def close(self):
        self.db.close()
        del self.db
        gc.collect()


CLASSES = {"table": TableLayout, "lmdb": LmdbLayout, "rocksdb": RocksLayout, "dict": DictLayout}


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "?"


# --------------------------------------------------------------------------------------------------
# the measurements (run in a worker subprocess, one candidate each)
# --------------------------------------------------------------------------------------------------
class Checks:
    def __init__(self):
        self.failed: list[str] = []

    def expect(self, ok: bool, what: str) -> None:
        if not ok and len(self.failed) < 5:
            self.failed.append(what)


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def put_all(layout: Layout, ds: Dataset, idx: np.ndarray, tag: int) -> None:
    for s in range(0, len(idx), BATCH):
        part = idx[s:s + BATCH]
        layout.put_packed(framing.encode_pairs(ds.records(part, tag)), 0)


def expected_answer(ds: Dataset, idx, tag: int) -> bytes:
    return framing.encode_optional_list(ds.values(idx, tag))


def worker_main(layout_name: str, n: int, seconds: float, budget: int, folder: str) -> dict:
    rng = np.random.default_rng(20261125)
    ds = Dataset(n)
    checks = Checks()
    res: dict = {}
    layout = CLASSES[layout_name](folder, budget)
    res["note"] = layout.note
    if layout_name == "table":
        mod = sys.modules[layout.T.Table.__module__]
        res["note"] = f"implementation: {mod.__name__} ({os.path.relpath(getattr(mod, '__file__', '?'), ROOT)})"
    # warm the allocator with one chunk's worth of Python objects, then the baseline
    warm = next(ds.chunks())
    del warm
    before = status()

    # 1. resident bytes per record (loaded chunk by chunk, as from a snapshot)
    t_load_chunks, _ = timed(partial(layout.load, ds.chunks()))
    after = status()
    res["load_chunks_s"] = t_load_chunks
    res["rss_per_record"] = (after["VmRSS"] - before["VmRSS"]) / n
    res["anon_per_record"] = (after["RssAnon"] - before["RssAnon"]) / n
    res["file_per_record"] = (after["RssFile"] - before["RssFile"]) / n
    res["disk_per_record"] = layout.disk_bytes() / n

    # 2. one daemon round at batch 1024: PUT_MANY payload into the open version, GET_MANY answer
    pool = [rng.choice(n, BATCH, replace=False) for _ in range(32)]
    puts = [framing.encode_pairs(ds.records(ix, 2)) for ix in pool]
    gets = [framing.encode_list(ds.keys(ix)) for ix in pool]
    layout.open()
    layout.put_packed(puts[0], 0)
    checks.expect(layout.get_packed(gets[0], 0) == expected_answer(ds, pool[0], 2), "round: GET answer after PUT")
    best = None
    for _ in range(3):
        rounds, t_put, t_get = 0, 0.0, 0.0
        deadline = time.perf_counter() + seconds / 3
        while time.perf_counter() < deadline:
            i = rounds % len(pool)
            t0 = time.perf_counter()
            layout.put_packed(puts[i], 0)
            t1 = time.perf_counter()
            layout.get_packed(gets[i], 0)
            t2 = time.perf_counter()
            t_put += t1 - t0
            t_get += t2 - t1
            rounds += 1
        cand = (rounds * BATCH / (t_put + t_get), t_put / rounds * 1e6, t_get / rounds * 1e6)
        if best is None or cand[0] > best[0]:
            best = cand
    res["round_rps"], res["round_put_us"], res["round_get_us"] = best
    layout.abort()
    # a GET of keys the version has not written: the committed state's read path
    layout.open()
    fresh = [rng.choice(n, BATCH, replace=False) for _ in range(32)]
    fresh_gets = [framing.encode_list(ds.keys(ix)) for ix in fresh]
    checks.expect(layout.get_packed(fresh_gets[0], 0) == expected_answer(ds, fresh[0], 1), "GET from committed state")
    best_get = 0.0
    for _ in range(3):
        count = 0
        t0 = time.perf_counter()
        deadline = t0 + seconds / 6
        while True:
            layout.get_packed(fresh_gets[count % len(fresh_gets)], 0)
            count += 1
            now = time.perf_counter()
            if now >= deadline:
                break
        best_get = max(best_get, count * BATCH / (now - t0))
    res["base_get_rps"] = best_get
    layout.abort()

    # 3 + 5. commit of 1% (three times, the median) and of 100% of the keys, each rolled back
    sample_check = rng.choice(n, BATCH, replace=False)
    sample_get = framing.encode_list(ds.keys(sample_check))
    for frac, tag, reps in ((0.01, 3, 3), (1.0, 4, 1)):
        commits, rollbacks = [], []
        for _ in range(reps):
            idx = rng.permutation(n)[: max(1, int(n * frac))]
            layout.open()
            put_all(layout, ds, idx, tag)
            t_commit, undo = timed(layout.commit)
            layout.open()
            changed = layout.get_packed(framing.encode_list(ds.keys(idx[:BATCH])), 0)
            checks.expect(changed == expected_answer(ds, idx[:BATCH], tag), f"commit {frac:.0%}: values")
            layout.abort()
            t_rollback, _ = timed(partial(layout.rollback, undo))
            undo = None
            layout.open()
            checks.expect(layout.get_packed(sample_get, 0) == expected_answer(ds, sample_check, 1), f"rollback {frac:.0%}")
            layout.abort()
            commits.append(t_commit)
            rollbacks.append(t_rollback)
        key = "1" if frac < 1 else "100"
        res[f"commit{key}_ms"] = statistics.median(commits) * 1e3
        res[f"rollback{key}_ms"] = statistics.median(rollbacks) * 1e3

    # 4. freeze for a snapshot; a 1% commit while the view lives (the view must not see it); then
    # read the whole view in key order
    t_freeze, view = timed(layout.freeze)
    idx = rng.permutation(n)[: max(1, n // 100)]
    layout.open()
    put_all(layout, ds, idx, 5)
    t_commit_frozen, undo = timed(layout.commit)

    def read_all(layout, view):
        count = nbytes = later = 0
        last = b""
        ordered = True
        for block in layout.read_view(view, CHUNK_BYTES):
            count += len(block)
            for k, v in block:
                nbytes += len(k) + len(v)
                later += v[0] == 5  # a value of the commit made after the freeze
            first = block[0][0][:2] if layout_name == "dict" else block[0][0]
            ordered &= first >= last
            last = block[-1][0][:2] if layout_name == "dict" else block[-1][0]
        return count, nbytes, ordered, later

    t_read, (count, nbytes, ordered, later) = timed(partial(read_all, layout, view))
    layout.release(view)
    view = None
    layout.rollback(undo)
    undo = None
    checks.expect(count == n and nbytes == n * RAW, f"read view: {count} records, {nbytes} bytes")
    checks.expect(ordered, "read view: not in key order")
    checks.expect(later == 0, f"read view: {later} values of a later commit")
    res["freeze_ms"] = t_freeze * 1e3
    res["commit_frozen_ms"] = t_commit_frozen * 1e3
    res["read_all_s"] = t_read
    exported = layout.export(CHUNK_BYTES)
    if exported is not None:
        res["export_s"], res["export_read_s"], export_bytes = exported
        checks.expect(export_bytes >= n * RAW, f"export: {export_bytes} payload bytes")

    # 8. prefix scan of 10 matches (in the open version, empty overlay); last, because the Table
    # keeps an order index from its first ordered call on, which the rows above must not get for free
    layout.open()
    targets = ds.scan_targets(50, rng)
    prefix, idx10 = targets[0]
    t_first, found = timed(partial(layout.scan, prefix))
    checks.expect(found == ds.records(idx10, 1), f"scan {prefix!r}: {len(found)} records")
    times = []
    budget_s = max(1.0, seconds)
    t_start = time.perf_counter()
    for prefix, idx10 in targets[1:]:
        t, found = timed(partial(layout.scan, prefix))
        times.append(t)
        checks.expect(len(found) == 10, f"scan {prefix!r}: {len(found)} records")
        if time.perf_counter() - t_start > budget_s and len(times) >= 3:
            break
    res["scan_first_ms"] = t_first * 1e3
    res["scan_median_ms"] = statistics.median(times) * 1e3
    res["scan_count"] = len(times)
    layout.abort()
    res["rss_per_record_after_scans"] = (status()["VmRSS"] - before["VmRSS"]) / n

    layout.close()
    layout = None
    gc.collect()

    # 6. load N records from a list of (k, v) pairs into an empty store
    records = [r for chunk in ds.chunks() for r in chunk]
    folder2 = os.path.join(folder, "second")
    os.makedirs(folder2)
    fresh_layout = CLASSES[layout_name](folder2, budget)
    t_list, _ = timed(partial(fresh_layout.load, [records]))
    fresh_layout.open()
    checks.expect(fresh_layout.get_packed(sample_get, 0) == expected_answer(ds, sample_check, 1), "load from list")
    fresh_layout.abort()
    fresh_layout.close()
    res["load_list_s"] = t_list
    res["checks"] = checks.failed
    return res


def worker_budget(layout_name: str, n: int, seconds: float, budget: int, folder: str) -> dict:
    """A state of ``n`` records (4× the budget in raw bytes): peak RSS and point GETs."""
    rng = np.random.default_rng(7)
    ds = Dataset(n)
    checks = Checks()
    layout = CLASSES[layout_name](folder, budget)
    before = status()
    t_load, _ = timed(partial(layout.load, ds.chunks()))
    loaded = status()
    res: dict = {"load_s": t_load, "rss_before": before["VmRSS"], "rss_loaded": loaded["VmRSS"],
                 "disk": layout.disk_bytes()}
    layout.cool()  # the files' pages leave the page cache, as a budget would have them
    cooled = status()
    res["rss_cooled"] = cooled["VmRSS"]
    pool = [rng.choice(n, BATCH, replace=False) for _ in range(128)]
    payloads = [framing.encode_list(ds.keys(ix)) for ix in pool]
    layout.open()
    # one pass right after the cache drop; then passes over the same keys for ``seconds``
    t0 = time.perf_counter()
    for p in payloads:
        layout.get_packed(p, 0)
    rates = [len(payloads) * BATCH / (time.perf_counter() - t0)]
    checks.expect(layout.get_packed(payloads[0], 0) == expected_answer(ds, pool[0], 1), "GET in the budget state")
    passes = 0
    t0 = time.perf_counter()
    while passes == 0 or time.perf_counter() - t0 < seconds:
        for p in payloads:
            layout.get_packed(p, 0)
        passes += 1
    rates.append(passes * len(payloads) * BATCH / (time.perf_counter() - t0))
    layout.abort()
    end = status()
    # the store's own: above what the process held before the load (interpreter, imports, data generator)
    res.update(gets_cold=rates[0], gets_warm=rates[1], peak=end["VmHWM"] - before["VmRSS"],
               anon_end=end["RssAnon"] - before["RssAnon"], file_end=end["RssFile"] - before["RssFile"],
               checks=checks.failed)
    layout.close()
    return res


# --------------------------------------------------------------------------------------------------
# the driver: dependencies, one subprocess per (candidate, part), the table
# --------------------------------------------------------------------------------------------------
def ensure_deps() -> None:
    try:
        import lmdb  # noqa: F401
        import rocksdict  # noqa: F401
    except ImportError:
        req = os.path.join(ROOT, "requirements", "bench.txt")
        print(f"installing {os.path.relpath(req, ROOT)} into {sys.executable}", file=sys.stderr, flush=True)
        subprocess.check_call([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", "-r", req])


def table_available(allow_reference: bool) -> str | None:
    """None when candidate (a), the compiled Table, imports; else why not."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the facade warns when it falls back to the reference twin
            from statestore_async.engine import table as T
    except ImportError as exc:
        return f"statestore_async.engine.table does not import ({exc})"
    missing = [f for f in ("Table", "apply", "load_records") if not hasattr(T, f)]
    if missing:
        return f"engine.table lacks {', '.join(missing)}"
    if not T.Table.__module__.startswith("statestore_async._native") and not allow_reference:
        return (f"engine.table is the pure-Python reference ({T.Table.__module__}), not the compiled candidate: "
                "run `make build` (or pass --allow-reference)")
    return None


def run_worker(part: str, layout: str, n: int, seconds: float, budget: int, timeout: float) -> dict:
    folder = tempfile.mkdtemp(prefix=f"bench_layouts_{layout}_")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", part, "--layout", layout, "--n", str(n),
           "--seconds", str(seconds), "--budget-bytes", str(budget), "--folder", folder]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    wall = time.perf_counter() - t0
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            out = json.loads(line[7:])
            out["wall_s"] = wall
            return out
    return {"error": f"exit code {proc.returncode}, no result (see stderr)"}


def fmt_int(x: float) -> str:
    return f"{x:,.0f}"


def render(results: dict, args, n_budget: int, budget: int, when: str) -> str:
    names = list(results)
    head = "| measurement | " + " | ".join(LAYOUTS[x] for x in names) + " |"
    lines = [head, "|---|" + "---|" * len(names)]

    def row(label, fn, part="main"):
        cells = []
        for name in names:
            r = results[name].get(part, {})
            if "error" in r:
                cells.append("n/a")
                continue
            try:
                cells.append(fn(r))
            except (KeyError, TypeError, ZeroDivisionError):
                cells.append("–")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    n = args.n
    row(f"1. RSS per record at {n:,} loaded (× raw {RAW} B)",
        lambda r: f"{r['rss_per_record']:.1f} B ({r['rss_per_record'] / RAW:.1f}×)")
    row("1. … of which file-backed (mapped pages)", lambda r: f"{r['file_per_record']:.1f} B")
    row("1. + its files on disk (page cache, not RSS)",
        lambda r: f"{r['disk_per_record']:.1f} B" if r["disk_per_record"] else "none")
    row("1. RSS per record at the end (after rows 2–5 and 8: commits, rollbacks, a view, scans)",
        lambda r: f"{r['rss_per_record_after_scans']:.1f} B")
    row(f"2. round at batch {BATCH}: put + get, records/s", lambda r: fmt_int(r["round_rps"]))
    row("2. … µs per round: put / get", lambda r: f"{r['round_put_us']:.0f} / {r['round_get_us']:.0f}")
    row(f"2. GET {BATCH} keys not in the overlay, records/s", lambda r: fmt_int(r["base_get_rps"]))
    row(f"3. commit 1% ({max(1, n // 100):,} keys) with undo (median of 3)", lambda r: f"{r['commit1_ms']:.1f} ms")
    row(f"3. commit 100% ({n:,} keys) with undo", lambda r: f"{r['commit100_ms']:.0f} ms")
    row("3. … 100% / 1% (100 = proportional to changes)", lambda r: f"{r['commit100_ms'] / r['commit1_ms']:.0f}")
    row("4. freeze a view", lambda r: f"{r['freeze_ms']:.2f} ms")
    row("4. commit 1% while the view lives", lambda r: f"{r['commit_frozen_ms']:.1f} ms")
    row(f"4. read the view in order ({CHUNK_BYTES >> 10} KiB chunks)",
        lambda r: f"{r['read_all_s'] * 1e3:.0f} ms ({n / r['read_all_s'] / 1e6:.1f}M rec/s)")
    row("4. the Table's snapshot path (da2e2b5): freeze (export sort) / all as encoded payloads (chunk_packed)",
        lambda r: f"{r['export_s'] * 1e3:.2f} ms / {r['export_read_s'] * 1e3:.0f} ms")
    row("5. rollback of a 1% commit (median of 3)", lambda r: f"{r['rollback1_ms']:.1f} ms")
    row("5. rollback of the 100% commit", lambda r: f"{r['rollback100_ms']:.0f} ms")
    row(f"6. load {n:,} records from a list",
        lambda r: f"{r['load_list_s'] * 1e3:.0f} ms ({n / r['load_list_s'] / 1e6:.1f}M rec/s)")
    bl = f"7. {n_budget:,} records ({n_budget * RAW / MIB:.0f} MiB raw) vs budget {budget / MIB:.0f} MiB:"
    row(f"{bl} peak RSS above the pre-load RSS (× budget)",
        lambda r: f"{r['peak'] / MIB:.0f} MiB ({r['peak'] / budget:.1f}×)", "budget")
    row("7. … RSS after the GETs, above pre-load: anon / file-backed",
        lambda r: f"{r['anon_end'] / MIB:.0f} / {r['file_end'] / MIB:.0f} MiB", "budget")
    row("7. … its files on disk", lambda r: f"{r['disk'] / MIB:.0f} MiB" if r["disk"] else "none", "budget")
    row("7. … point GETs/s (1024 a batch, 128 batches): just after dropping the page cache / the same keys again",
        lambda r: f"{fmt_int(r['gets_cold'])} / {fmt_int(r['gets_warm'])}", "budget")
    row("7. … load time (records generated on the way, in 64k chunks)", lambda r: f"{r['load_s']:.1f} s", "budget")
    row("8. prefix scan, 10 matches: first (Table: builds its order index) / median",
        lambda r: f"{r['scan_first_ms']:.3f} / {r['scan_median_ms']:.3f} ms")

    def check_cell(name):
        bad = []
        for part in ("main", "budget"):
            r = results[name].get(part, {})
            if "error" in r:
                bad.append(f"{part}: not run" if results[name].get("skipped") else f"{part}: {r['error']}")
            bad.extend(r.get("checks", []))
        if results[name].get("skipped"):
            return "not run"
        return "ok" if not bad else "FAIL: " + "; ".join(bad)

    lines.append("| results checked (values, rollbacks, order, counts) | " + " | ".join(check_cell(x) for x in names) + " |")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    out = [f"bench_layouts {'--quick ' if args.quick else ''}— {when}, {platform.machine()} {os.cpu_count()} cores, "
           f"Python {platform.python_version()}, {n:,} records of {KEY_BYTES}+{VALUE_BYTES} B; load average at the "
           f"start {args.load_start}, at the end {load}", ""]
    out.extend(lines)
    out.append("")
    for name in names:
        note = results[name].get("main", {}).get("note")
        if note:
            out.append(f"- {LAYOUTS[name]}: {note}")
        if "error" in results[name].get("main", {}):
            out.append(f"- {LAYOUTS[name]}: {results[name]['main']['error']}")
    walls = ", ".join(f"{x} {sum(results[x].get(p, {}).get('wall_s', 0) for p in ('main', 'budget')):.0f} s" for x in names)
    out.append(f"- wall time per candidate (both subprocesses): {walls}")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="100k records, an 8 MiB budget: a smoke run")
    ap.add_argument("--n", type=int, default=None, help="records of the main state (default 1M, --quick 100k)")
    ap.add_argument("--budget-mib", type=int, default=None, help="memory budget of row 7 (default 64, --quick 8)")
    ap.add_argument("--seconds", type=float, default=None, help="time per throughput figure (default 1.5, --quick 0.3)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="which candidates (default: all)")
    ap.add_argument("--json", help="also write the raw results here")
    ap.add_argument("--allow-reference", action="store_true",
                    help="run candidate (a) even when only its pure-Python reference twin is built")
    ap.add_argument("--worker", choices=("main", "budget"), help=argparse.SUPPRESS)
    ap.add_argument("--layout", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--budget-bytes", type=int, help=argparse.SUPPRESS)
    charts.add_chart_args(ap, "bench_layouts")
    args = ap.parse_args()
    if args.n is None:
        args.n = 100_000 if args.quick else 1_000_000
    if args.seconds is None:
        args.seconds = 0.3 if args.quick else 1.5
    if args.worker:
        fn = worker_main if args.worker == "main" else worker_budget
        out = fn(args.layout, args.n, args.seconds, args.budget_bytes, args.folder)
        print("RESULT " + json.dumps(out), flush=True)
        return 0

    args.load_start = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    budget = (args.budget_mib or (8 if args.quick else 64)) * MIB
    n_budget = 4 * budget // RAW
    ensure_deps()
    why_not = table_available(args.allow_reference) if "table" in args.layouts else None
    names = [x.strip() for x in args.layouts.split(",") if x.strip()]
    results: dict = {}
    for name in names:
        if name not in LAYOUTS:
            ap.error(f"unknown layout {name!r}")
        results[name] = {}
        if name == "table" and why_not:
            results[name] = {"main": {"error": why_not}, "budget": {"error": why_not}, "skipped": True}
            print(f"{LAYOUTS[name]}: skipped: {why_not}", file=sys.stderr, flush=True)
            continue
        for part, n in (("main", args.n), ("budget", n_budget)):
            print(f"{LAYOUTS[name]}: {part} ({n:,} records) …", file=sys.stderr, flush=True)
            results[name][part] = run_worker(part, name, n, args.seconds, budget, timeout=900)
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(render(results, args, n_budget, budget, when), flush=True)
    if charts.chart_path(args):
        def fig(key: str) -> dict:
            return {LAYOUTS[x]: [results[x].get("main", {}).get(key) or None] for x in names}

        charts.bar_charts(charts.chart_path(args), f"Engine layouts: {args.n:,} records of 12+16 bytes", [
            charts.Panel(f"round at batch {BATCH}: put + get", ["records/s"], fig("round_rps"), "records/s"),
            charts.Panel("GET of committed keys", ["records/s"], fig("base_get_rps"), "records/s"),
            charts.Panel("resident bytes per record", ["B / record"], fig("rss_per_record"), f"bytes (raw {RAW})",
                         fmt=lambda v: f"{v:.1f}", reference=(RAW, "raw")),
            charts.Panel("commit 1% with undo", ["ms"], fig("commit1_ms"), "ms", fmt=lambda v: f"{v:.3g} ms")],
            charts.measured_caption(f"load average at start {args.load_start}"), width=14.0)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"when": when, "n": args.n, "budget": budget, "n_budget": n_budget, "results": results}, fh, indent=1)
    failed = [x for x in names if any("error" in results[x].get(p, {}) or results[x].get(p, {}).get("checks")
                                      for p in ("main", "budget")) and not (x == "table" and why_not)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
