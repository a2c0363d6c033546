"""Per-entry TTL of list and map state (issue 19, as ``transformWithStateInPandas`` has it): each
entry of a TTL'd ``list_state`` / ``map_state`` carries its own expiry; expired entries are
invisible, and removed in the batch they expire in whether or not it touches their key (through
the expiry index), counted in ``timings["ttl_removed"]``. Runs ``task.partition.run_partition`` against a
real daemon batch after batch (``test_spark_timers.Job``) and reads the checkpoint files back."""
from __future__ import annotations

import pytest
from test_spark_timers import OUT, Job

from statestore_async import errors
from statestore_async.codecs import valuecodec
from statestore_async.spark.api.processors import StatefulProcessor, StateHandle, check_declarations
from statestore_async.state import keys as state_keys


class Bag(StatefulProcessor):
    def init(self, handle):
        self.items = handle.list_state("items", ttl_ms=1000)
        self.seen = handle.map_state("seen", ttl_ms=1000)

    def handle_rows(self, key, rows, state):
        for (v,) in rows:
            self.items.append(v)
            self.seen.update(v % 3, v)
        yield (key[0], 0, ",".join(map(str, self.items.get())), len(self.seen.items()))


def state_records(job: Job) -> dict:
    return {tuple(valuecodec.decode_row(k[2:])): valuecodec.decode_row(v) for k, v in job.records().items()
            if state_keys.is_state_key(k)}


def removed(job: Job) -> int:
    return sum(r.timings.get("ttl_removed", 0) for r in job.reports)


def test_entries_expire_one_by_one_and_leave_the_files_in_their_batch(daemon, root):
    job = Job(root, daemon.socket, Bag(), time_mode="none", op="bag")
    assert sorted(job.run([("a", 1), ("a", 2), ("b", 10), ("c", 5)], now_ms=0)) == [
        ("a", 0, "1,2", 2), ("b", 0, "10", 1), ("c", 0, "5", 1)]
    assert sorted(job.run([("a", 4), ("c", 6)], now_ms=600)) == [("a", 0, "1,2,4", 2), ("c", 0, "5,6", 2)]
    st = state_records(job)
    assert st[("items", "a")] == (1600, [(1000, 1), (1000, 2), (1600, 4)])  # one expiry per entry
    assert st[("seen", "a")] == (1600, {1: (1600, 4), 2: (1000, 2)})
    # t=1200: a (no rows) loses 1, 2 and its map entry 2; b (no rows) is gone; c (rows) sees 6, 8 only
    assert job.run([("c", 8)], now_ms=1200) == [("c", 0, "6,8", 2)]
    assert removed(job) == 3 + 2 + 2
    st = state_records(job)
    assert st == {("items", "a"): (1600, [(1600, 4)]), ("seen", "a"): (1600, {1: (1600, 4)}),
                  ("items", "c"): (2200, [(1600, 6), (2200, 8)]), ("seen", "c"): (2200, {0: (1600, 6), 2: (2200, 8)})}
    assert job.run([("a", 7)], now_ms=1300) == [("a", 0, "4,7", 1)]  # 7 % 3 == 1 replaces 4's entry
    job.run([], now_ms=1700)  # a's 4 and c's 6 expire, no key touched
    assert removed(job) == 1 + 2
    st = state_records(job)
    assert st == {("items", "a"): (2300, [(2300, 7)]), ("seen", "a"): (2300, {1: (2300, 7)}),
                  ("items", "c"): (2200, [(2200, 8)]), ("seen", "c"): (2200, {2: (2200, 8)})}
    job.run([], now_ms=2400)
    assert removed(job) == 4
    assert job.records() == {}  # state and expiry index: nothing left


def test_put_and_remove_keep_per_entry_expiries(daemon, root):
    class Ops(StatefulProcessor):
        def init(self, handle):
            self.items = handle.list_state("items", ttl_ms=1000)
            self.seen = handle.map_state("seen", ttl_ms=1000)

        def handle_rows(self, key, rows, state):
            (v,), = rows
            if v < 0:
                self.items.put([-v])           # every entry replaced: one new expiry
                self.seen.remove(1)
            else:
                self.items.append(v)
                self.seen.update(v, v)
            yield (key[0], 0, repr((self.items.get(), self.seen.items(), self.seen.get(1), self.seen.contains(2))),
                   len(self.seen.values()))

    job = Job(root, daemon.socket, Ops(), time_mode="none", op="ops")
    job.run([("a", 1)], now_ms=0)
    job.run([("a", 2)], now_ms=500)
    assert job.run([("a", -9)], now_ms=900) == [("a", 0, repr(([9], [(2, 2)], None, True)), 1)]
    assert state_records(job) == {("items", "a"): (1900, [(1900, 9)]), ("seen", "a"): (1500, {2: (1500, 2)})}
    job.run([], now_ms=1600)
    assert removed(job) == 1 and state_records(job) == {("items", "a"): (1900, [(1900, 9)])}


def test_the_old_whole_list_layout_is_refused():
    h = StateHandle()
    h.list_state("items", ttl_ms=5)
    h.map_state("seen", ttl_ms=5)
    h.list_state("plain")
    decl = h.declarations()
    assert decl["items"] == {"kind": "list", "ttl": True, "ttl_entries": True}
    assert decl["plain"] == {"kind": "list", "ttl": False}
    check_declarations(decl, decl)  # the same: fine
    with pytest.raises(errors.StateDeclarationError, match=r"TTL for the whole list.*TTL per entry"):
        check_declarations({"items": {"kind": "list", "ttl": True}}, decl)
    with pytest.raises(errors.StateDeclarationError, match="map_state with a TTL per entry"):
        check_declarations({"seen": {"kind": "map", "ttl": False}}, decl)


def test_a_task_refuses_state_written_with_the_whole_list_layout(daemon, root):
    job = Job(root, daemon.socket, Bag(), time_mode="none", op="old", out=OUT)
    with pytest.raises(errors.StateDeclarationError, match="items"):
        job.run([("a", 1)], now_ms=0, declared={"items": {"kind": "list", "ttl": True}})
