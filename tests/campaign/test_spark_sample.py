"""A sample of the Spark-level fault campaign (``statestore_async.testing.campaign.spark_level``):
three fixed seeds that together run the per-key and the vectorized sessions and the TTL counter,
with a rescale, under daemon kills and terms, a killed and a failed task, a lost S3 answer, a full
cache disk and a clock jump; and the checker itself, which must see a wrong answer when there is
one. The long run (hundreds of seeds) is ``benchmarks/campaign.py --level spark``.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace

import pytest

from statestore_async.testing.campaign import spark_level as L

# 486: per-key sessions on s3://, 4 -> 1 partitions, the daemon SIGKILLed after a manifest, a PUT's
#      answer lost before a fence;
# 422: vectorized sessions on a local root, 1 -> 4 partitions, a task's Python worker SIGKILLed
#      after its commit, the daemon SIGTERMed before a commit;
# 26:  the TTL counter, the daemon's cache disk full after a commit, the clock 5 s back.
SEEDS = (486, 422, 26)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with L.Env(str(tmp_path_factory.mktemp("spark-campaign")), spare_driver=False) as env:  # no seed kills the driver
        yield env


def test_the_sample_covers_both_session_processors_the_ttl_counter_and_a_rescale():
    schedules = [L.draw(s) for s in SEEDS]
    assert {s.workload["kind"] for s in schedules} == {"perkey", "vectorized", "counter"}
    assert any(s.workload["partitions"][0] != s.workload["partitions"][1] for s in schedules)
    assert L.draw(486).describe() == L.draw(486).describe()  # a seed is its schedule
    assert L.draw(486).events == L.draw(486).events


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_seed_passes(env, seed):
    schedule = L.draw(seed)
    o = L.run(schedule, env)
    assert o.ok, f"{schedule.describe()}\n{o.detail}"
    assert (o.lost, o.doubled, o.wrong, o.unloadable) == (0, 0, 0, 0)
    assert o.rss_peak is not None and o.rss_bound is not None and o.rss_peak <= o.rss_bound
    assert o.coverage, "no fault fired"
    assert o.coverage <= {(e.fault, e.phase) for e in schedule.events}


def _read(out: str, batch: int) -> list:
    with open(os.path.join(out, f"{batch}.json")) as f:
        return json.load(f)


def _rewrite(out: str, batch: int, rows: list) -> None:
    with open(os.path.join(out, f"{batch}.json"), "w") as f:
        json.dump(rows, f)


@pytest.mark.spark
@pytest.mark.slow
def test_the_checker_sees_lost_doubled_and_wrong_rows_a_wrong_oracle_and_a_state_that_does_not_load(env):
    schedule = replace(L.draw(422), events=())  # vectorized sessions, no fault
    ex = L.execute(schedule, env)
    try:
        assert ex.finished, ex.detail
        assert L.check(schedule, env, ex).ok
        out = ex.paths["out"]
        got = {int(n[:-5]): _read(out, int(n[:-5])) for n in os.listdir(out) if n[:-5].isdigit()}
        b = min(i for i, rows in got.items() if rows)  # the first batch that emitted rows
        c = max(got) if max(got) != b else min(got)   # another batch
        rows, rows_c = got[b], got[c]

        _rewrite(out, b, rows[1:])  # a row lost
        o = L.check(schedule, env, ex)
        assert (o.ok, o.lost, o.doubled, o.wrong) == (False, 1, 0, 0) and f"batch {b}" in o.detail
        _rewrite(out, b, rows)
        _rewrite(out, c, [*rows_c, rows[0]])  # a row of batch b again in batch c
        o = L.check(schedule, env, ex)
        assert (o.ok, o.lost, o.doubled, o.wrong) == (False, 0, 1, 0) and f"batch {c}" in o.detail
        _rewrite(out, c, rows_c)
        _rewrite(out, b, [[rows[0][0], rows[0][1], rows[0][2], rows[0][3] + 1], *rows[1:]])  # a wrong value
        o = L.check(schedule, env, ex)
        assert (o.ok, o.lost, o.doubled, o.wrong) == (False, 1, 0, 1)
        _rewrite(out, b, rows)
        assert L.check(schedule, env, ex).ok

        other = replace(schedule, workload={**schedule.workload, "stream_seed": schedule.workload["stream_seed"] + 1})
        o = L.check(other, env, ex)  # the oracle of another stream
        assert not o.ok and o.lost and o.wrong

        state = ex.paths["root"].removeprefix("file://")
        deltas = sorted(os.path.join(d, n) for d, _, names in os.walk(state) for n in names if n.endswith(".delta"))
        assert deltas
        os.remove(deltas[0])
        o = L.check(schedule, env, ex)
        assert not o.ok and o.unloadable >= 1 and "do not load" in o.detail
    finally:
        shutil.rmtree(ex.folder, ignore_errors=True)


def test_compare_outputs_counts_each_kind_of_difference():
    expected = [[("a", 1, 2, 1)], [("b", 3, 4, 2), ("c", 5, 6, 1)]]
    assert L.compare_outputs(expected, {0: [("a", 1, 2, 1)], 1: [("b", 3, 4, 2), ("c", 5, 6, 1)]})[:3] == (0, 0, 0)
    assert L.compare_outputs(expected, {0: [("a", 1, 2, 1)], 1: [("b", 3, 4, 2)]})[:3] == (1, 0, 0)
    assert L.compare_outputs(expected, {0: [("a", 1, 2, 1)] * 2, 1: [("b", 3, 4, 2), ("c", 5, 6, 1)]})[:3] == (0, 1, 0)
    assert L.compare_outputs(expected, {0: [("a", 1, 2, 1)], 1: [("b", 3, 4, 2), ("c", 5, 6, 1)],
                                        2: [("z", 0, 0, 0)]})[:3] == (0, 0, 1)
    # the right rows, one in the wrong batch
    lost, doubled, wrong, detail = L.compare_outputs(expected, {0: [], 1: [("a", 1, 2, 1), ("b", 3, 4, 2),
                                                                          ("c", 5, 6, 1)]})
    assert (lost, doubled) == (0, 0) and wrong == 1 and detail.startswith("batch 0")


def test_shrink_keeps_only_what_makes_the_schedule_fail(monkeypatch):
    schedule = L.draw(1000)
    assert len(schedule.events) == 3
    culprit = schedule.events[1]
    ran = []

    def run(s: L.Schedule, env) -> L.Outcome:  # fails while the culprit event is in the schedule
        ran.append(s)
        ok = culprit not in s.events
        return L.Outcome(s, ok, 0, 0, 0 if ok else 1, 0, None, None, set(), "", 0.0)

    monkeypatch.setattr(L, "run", run)
    small = L.shrink(schedule, env=None, budget=30)
    assert small.events == (culprit,)
    assert small.workload["users"] < schedule.workload["users"] and small.workload["batches"] >= culprit.step
    assert 0 < len(ran) <= 30
