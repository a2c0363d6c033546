"""The store-level fault campaign in ``make test``: a sample of schedules with fixed seeds (each
must pass: nothing lost, nothing doubled, every version answered durable loads on a fresh node and
equals the oracle, the daemon's RSS within its bound), the draw's determinism, and the checker
itself shown to catch a damaged file, a wrong state and an RSS over its bound.

The long run (thousands of schedules) is ``benchmarks/campaign.py``; docs/CAMPAIGN.md has its record.
"""
from __future__ import annotations

import pytest

from statestore_async.files.names import DELTA, file_key
from statestore_async.testing.campaign import store_level as sl

# seeds 1..18, and 40 and 61 for a daemon killed (SIGKILL) mid-get and after its batch was durable:
# every fault of FAULTS is drawn in at least one of them
SAMPLE_SEEDS = (*range(1, 19), 40, 61)


@pytest.fixture(scope="module")
def env(seaweedfs, tmp_path_factory):
    with sl.Env(str(tmp_path_factory.mktemp("campaign")), seaweedfs=seaweedfs) as e:
        yield e


def quiet(seed: int) -> sl.Schedule:
    """The workload of ``seed`` with no fault."""
    s = sl.draw(seed)
    return sl.Schedule(s.seed, (), s.workload)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SAMPLE_SEEDS)
def test_a_sampled_schedule_loses_nothing_doubles_nothing_and_every_durable_version_loads(env, seed):
    o = sl.run(sl.draw(seed), env)
    assert o.ok, f"seed {seed}: {o.detail}\n{o.schedule.describe()}"
    assert (o.lost, o.doubled, o.wrong, o.unloadable) == (0, 0, 0, 0)
    assert o.checked_versions >= o.schedule.workload["parts"]  # at least the final versions were loaded
    assert o.rss_peak is not None and o.rss_bound is not None and o.rss_peak <= o.rss_bound


def test_the_sample_covers_every_fault():
    drawn = {e.fault for seed in SAMPLE_SEEDS for e in sl.draw(seed).events}
    assert drawn == set(sl.FAULTS)


def test_the_same_seed_draws_the_same_schedule_and_every_event_is_one_its_fault_allows():
    for seed in range(300):
        a, b = sl.draw(seed), sl.draw(seed)
        assert a == b and a.workload == b.workload and a.describe() == b.describe()
        assert all(e.phase in sl.ALLOWED[e.fault] and 0 <= e.step < a.workload["batches"] for e in a.events)
        assert all(0 <= e.param("part") < a.workload["parts"] for e in a.events)
        assert list(a.events) == sorted(a.events, key=lambda e: (e.step, sl.PHASES.index(e.phase),
                                                                  e.param("part", 0), e.fault))
    assert len({sl.draw(seed).describe() for seed in range(300)}) == 300
    pairs = {(e.fault, e.phase) for seed in range(2000) for e in sl.draw(seed).events}
    assert pairs == {(f, p) for f, phases in sl.ALLOWED.items() for p in phases}


def test_the_oracle_counts_what_a_batch_does():
    state, out = sl.apply_ops({1: 2}, [["inc", 1, 3], ["del", 1], ["inc", 1, 1], ["inc", 4, 2]])
    assert state == {1: 1, 4: 2} and out == [(1, 5), (1, None), (1, 1), (4, 2)]
    t = sl.Tally()
    got = {sl.key_bytes(1): sl.value_bytes(1, 1, 0), sl.key_bytes(4): sl.value_bytes(4, 4, 0),
           sl.key_bytes(5): sl.value_bytes(1, 5, 0)}
    t.compare("x", got, {1: 1, 4: 2, 7: 3}, 0)
    assert (t.lost, t.doubled, t.wrong) == (1, 1, 1)  # 7 missing, 4 counted twice, 5 should be gone


def test_the_checker_reports_a_durable_version_that_does_not_load(env, s3):
    """A delta the daemon made durable is damaged in S3 before the checks: that version and the
    ones built on it are reported unloadable."""
    def damage(run):
        part, ref = next(iter(run.durable))
        key = file_key(run.stores[part], ref, DELTA)
        bucket, _, prefix = run.root[len("s3://"):].partition("/")
        s3.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=b"not a checkpoint file")

    o = sl.run(quiet(7), env, before_check=damage)
    assert not o.ok and o.unloadable >= 1 and "does not load" in o.detail


@pytest.mark.parametrize("change, kind", [(+1, "lost"), (-1, "doubled")])
def test_the_checker_reports_a_state_that_is_not_the_oracles(env, change, kind):
    """The oracle's count of one key of the final version is changed before the checks: the store's
    count is then below it (lost) or above it (doubled), and the run fails naming the key."""
    def skew(run):
        final = run.states[0][-1]
        k = min(final)
        final[k] += change

    o = sl.run(quiet(7), env, before_check=skew)
    assert not o.ok and getattr(o, kind) >= 1, o.detail
    assert "oracle" in o.detail


def test_the_checker_reports_rss_over_the_bound(env, monkeypatch):
    monkeypatch.setattr(sl, "WORKING_OVERHEAD", -(1 << 40))
    o = sl.run(quiet(7), env)
    assert not o.ok and "peak RSS" in o.detail


def test_shrink_keeps_only_the_events_a_failure_needs(env, monkeypatch):
    """A failure that needs one event (here: the oracle skewed whenever a task failed) shrinks to
    that event alone."""
    base = sl.draw(7)
    extra = (sl.Event("s3_latency", 0, "get", (("part", 0), ("seconds", 0.5), ("latency", 0.05))),
             sl.Event("task_fail", 1, "put", (("part", 0),)),
             sl.Event("disk_full", 2, "upload", (("part", 0), ("seconds", 0.5))))
    schedule = sl.Schedule(base.seed, extra, base.workload)
    real_run = sl.run

    def failing_on_task_fail(s, e, **kw):
        o = real_run(s, e, **kw)
        if any(ev.fault == "task_fail" for ev in s.events):
            o.ok = False
        return o

    monkeypatch.setattr(sl, "run", failing_on_task_fail)
    small = sl.shrink(schedule, env, budget=10)
    assert [e.fault for e in small.events] == ["task_fail"]
