"""A state written by the release before time-only batches is finished by one run of this code (issue 39).

The release (commit ``RELEASE``, taken from the repository's history with ``git archive``) runs an
event-time sessionization under ``Trigger.AvailableNow`` over the first three micro-batches: its
manifests have no pass ids and the sessions its last watermark closed are left unfired. Then this
checkout runs the same query, from the same Spark checkpoint and state, over the two batches that
arrived since: it emits exactly the oracle's sessions over the whole stream, none twice, in one run
and without a second source. Both drivers run in their own processes against one daemon of this
checkout. The release reuses this checkout's compiled modules, so the test is skipped once
``_ext/`` differs from the release's (its sources must then be built for it).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from statestore_async.testing import sessions as S

pytestmark = [pytest.mark.spark, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
RELEASE = "90240ac"  # main before time-only batches and write_sink's replay-safe layouts


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True)


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    """The release's package in a folder of its own, with this checkout's compiled modules."""
    if _git("cat-file", "-e", f"{RELEASE}^{{commit}}").returncode != 0:
        pytest.skip(f"commit {RELEASE} is not in this clone's history")
    if _git("diff", "--quiet", RELEASE, "HEAD", "--", "_ext").returncode != 0:
        pytest.skip(f"_ext/ changed since {RELEASE}: the release needs its own build")
    folder = tmp_path_factory.mktemp("release")
    archive = _git("archive", "--format=tar", RELEASE, "statestore_async")
    assert archive.returncode == 0, archive.stderr
    tar = folder / "release.tar"
    tar.write_bytes(archive.stdout)
    with tarfile.open(tar) as t:
        t.extractall(folder, filter="data")
    native = ROOT / "statestore_async" / "_native"
    for so in native.glob("*.so"):
        (folder / "statestore_async" / "_native" / so.name).write_bytes(so.read_bytes())
    return folder


def _drive(code: Path, src: str, state: str, ckpt: str, sock: str, out: str, gap: int, delay: int) -> str:
    env = dict(os.environ, PYTHONPATH=str(code), SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "job", src, state, ckpt, sock, out, str(gap),
                        str(delay)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_a_release_checkpoint_is_finished_by_one_run(release, tmp_path):
    from spark_cluster import Daemon

    stream = S.generate(users=80, batches=5, seed=29)
    src = str(tmp_path / "src")
    S.write_batches(S.SessionStream(stream.batches[:3], stream.gap_ms, stream.delay_ms, stream.watermarks[:4]), src,
                    trailing_empty=False)
    state, ckpt, out = f"file://{tmp_path}/state", str(tmp_path / "ckpt"), str(tmp_path / "out.jsonl")
    with Daemon() as d:
        first = _drive(release, src, state, ckpt, d.socket, out, stream.gap_ms, stream.delay_ms)
        assert f"code {release}" in first  # the release's package ran the driver
        commits = tmp_path / "state" / "sessions" / "_commits"
        assert sorted(int(p.stem) for p in commits.iterdir()) == [1, 2, 3]
        assert "pass_id" not in json.loads((commits / "3.json").read_text())["manifest"]["metadata"]
        S.write_batches(stream, src, trailing_empty=False)  # batches 3 and 4 arrive
        second = _drive(ROOT, src, state, ckpt, d.socket, out, stream.gap_ms, stream.delay_ms)
        assert f"code {ROOT}" in second
    rows = [tuple(json.loads(line)) for line in Path(out).read_text().splitlines()]
    assert len(rows) == len(set(rows))
    assert sorted(rows) == S.sessions_of(stream)


# --- the driver, in its own process (the package on PYTHONPATH: the release's or this checkout's) -----
def job_main(src: str, state: str, ckpt: str, sock: str, out: str, gap: str, delay: str) -> int:
    from pyspark import cloudpickle

    import statestore_async
    from statestore_async.testing import sessions

    print(f"code {Path(statestore_async.__file__).resolve().parents[1]}", flush=True)
    from spark_cluster import driver_session

    spark = driver_session()
    cloudpickle.register_pickle_by_value(sessions)
    got: list = []

    def sink(df, batch_id):
        got.extend([list(r) for r in df.collect()])

    op = sessions.session_operator(state, "sessions", int(gap), int(delay), socket_path=sock)
    sessions.run_to_end(sessions.read_stream(spark, src), ckpt, op.foreach_batch(sink))
    with open(out, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in got)
    spark.stop()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["job"]:
        sys.exit(job_main(*sys.argv[2:9]))
    sys.exit("usage: test_spark_release_compat.py job SRC STATE CKPT SOCKET OUT GAP DELAY")
