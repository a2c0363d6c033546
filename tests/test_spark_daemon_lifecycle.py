"""An autostarted daemon ends with the job that used it (issue 39).

A local-mode driver (this file run as a script, in its own process) whose operator's tasks start the
node's daemon (no daemon answers at the operator's socket) runs two batches, then, on the test's
word, ends its job — ``op.close()`` and ``spark.stop()``, or ``spark.stop()`` alone — and stays
alive. The daemon must be gone within ``placement.LOCAL_EXIT_WHEN_IDLE`` seconds (and a generous
margin for a busy machine) of that, while the driver process still runs: the driver's lease went
with the job, the Python workers with the SparkContext.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from statestore_async.spark.shared import placement

pytestmark = [pytest.mark.spark, pytest.mark.slow]
MARGIN = 60.0  # seconds past the stated idle exit: a busy machine's Python workers take a while to go


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _line(proc: subprocess.Popen, prefix: str, timeout: float = 300.0) -> str:
    """The first line of the driver's output that starts with ``prefix`` (its other lines skipped)."""
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"the driver ended (rc {proc.poll()}) before printing {prefix!r}")
        if line.startswith(prefix):
            return line[len(prefix):].strip()
    raise AssertionError(f"no {prefix!r} from the driver within {timeout}s")


@pytest.mark.parametrize("end", ["close", "stop"])
def test_the_autostarted_daemon_is_gone_soon_after_the_job_ends(tmp_path, end):
    sock = str(tmp_path / "node" / "statestore.sock")
    env = {k: v for k, v in os.environ.items() if k not in (placement.EXIT_WHEN_IDLE_ENV, "STATESTORE_SOCKET")}
    env.update(SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "job", sock, f"file://{tmp_path}/state", end],
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    pid = None
    try:
        pid = int(_line(proc, "daemon pid "))
        assert _alive(pid)
        assert proc.stdin is not None
        proc.stdin.write("end\n")
        proc.stdin.flush()
        _line(proc, "job ended")
        ended = time.monotonic()
        deadline = ended + placement.LOCAL_EXIT_WHEN_IDLE + MARGIN
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(pid), f"the daemon outlived the job by {time.monotonic() - ended:.0f}s"
        assert proc.poll() is None  # the driver process still runs: the job's end let the daemon go
    finally:
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


# --- the driver, in its own process -------------------------------------------------------------------
def job_main(sock: str, root: str, end: str) -> int:

    from spark_cluster import driver_session

    from statestore_async.spark import StatefulOperator
    from statestore_async.spark.api.examples import CountSum

    spark = driver_session()
    op = StatefulOperator(root, "life", ["key"], CountSum(), "key string, count bigint, sum bigint", 2,
                          socket_path=sock)
    df = spark.createDataFrame([(f"k{i % 5}", i) for i in range(50)], "key string, value bigint")
    for b in range(2):
        op.process_batch(df, b, lambda out, _: out.collect())
    print(f"daemon pid {placement.daemon_pid(sock)}", flush=True)
    sys.stdin.readline()
    if end == "close":
        op.close()
    spark.stop()
    print("job ended", flush=True)
    sys.stdin.readline()  # the driver process stays until the test ends it
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["job"]:
        sys.exit(job_main(*sys.argv[2:5]))
    sys.exit("usage: test_spark_daemon_lifecycle.py job SOCKET ROOT close|stop")
