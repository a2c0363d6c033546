"""statestore-async ls / show / export / diff / inspect on checkpoints written by the real Spark
operator (``test_state_reader.Profile``), on a ``file://`` root and on SeaweedFS. What the commands
print equals what ``state.reader`` / ``state.changes`` read; none of them writes to the root."""
from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from spark_cluster import Daemon
from test_state_reader import build_profile

from statestore_async.cli.main import main
from statestore_async.state.changes import load_changes_table
from statestore_async.state.reader import load_state_table


def run(*args, env=None):
    return CliRunner(env=env).invoke(main, list(args), catch_exceptions=False)


def _files(path) -> list[str]:
    return sorted(str(p) for p in path.rglob("*"))


def _same(a: list[dict], b: list[dict]) -> None:
    """Rows equal once JSON round-tripped (how ``show --json`` prints them)."""
    assert [json.loads(json.dumps(r, default=str)) for r in a] == [json.loads(json.dumps(r, default=str)) for r in b]


@pytest.fixture(scope="module")
def profile_root(spark, tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "state"
    with Daemon() as d:
        build_profile(spark, f"file://{path}", d.socket)
    return path, f"file://{path}"


@pytest.mark.spark
def test_ls_show_diff_inspect_read_and_never_write(profile_root):
    path, root = profile_root
    before = _files(path)
    r = run("ls", root)
    assert r.exit_code == 0, r.output
    assert "profile: versions 1..5 (5), 3 partitions, 16 key groups, keys ['user', 'shard']" in r.output
    assert "seen (list, ttl)" in r.output and "total (value)" in r.output
    assert "partition 2 (key groups 11..15)" in r.output and "orphaned" not in r.output
    (op,) = json.loads(run("ls", root, "--operator", "profile", "--json").output)
    assert op["version"] == 5 and len(op["partitions"]) == 3 and all(p["records"] > 0 for p in op["partitions"])

    expected = load_state_table(root, "profile", 3, include_expired=True).to_pylist()
    r = run("show", root, "--operator", "profile", "--version", "3", "--include-expired", "--limit", "0", "--json")
    assert r.exit_code == 0, r.output
    _same([json.loads(line) for line in r.output.splitlines()], expected)
    one = [x for x in expected if x["user"] == "u1" and x["shard"] == 1]
    r = run("show", root, "--operator", "profile", "--version", "3", "--include-expired", "--key", "u1", "--key", "1", "--json")
    _same([json.loads(line) for line in r.output.splitlines()], one)
    r = run("show", root, "--operator", "profile", "--version", "3", "--include-expired", "--limit", "4")
    assert r.output.count("user=") == 4 and "4 rows (--limit 4)" in r.output and "total={\"_1\"" in r.output
    r = run("show", root, "--operator", "profile", "--state-var", "nope")
    assert r.exit_code == 1 and "InterfaceError" in r.output and "'hist', 'last'" in r.output

    changes = load_changes_table(root, "profile", 1, 3, state_var="total").to_pylist()
    r = run("diff", root, "--operator", "profile", "--from", "1", "--to", "3", "--state-var", "total", "--json")
    assert r.exit_code == 0, r.output
    got = [json.loads(line) for line in r.output.splitlines()]
    key = lambda c: (c["version"], c["partition"], c["user"], c["shard"])
    _same(sorted(got, key=key), sorted(changes, key=key))
    r = run("diff", root, "--operator", "profile", "--from", "0", "--state-var", "last", "--limit", "3")
    assert r.output.count(" insert ") == 3 and "3 changes" in r.output
    r = run("diff", root, "--operator", "profile", "--from", "4", "--to", "2")
    assert r.exit_code == 1 and "from an older version to a newer one" in r.output

    r = run("inspect", root, "profile/_commits/5.json")
    assert r.exit_code == 0 and "manifest of profile version 5, 3 partitions" in r.output and '"ttl_entries": true' in r.output
    key_of = f"profile/0/default/{op['partitions'][0]['version']}_{op['partitions'][0]['ckptid']}.delta"
    r = run("inspect", root, key_of)
    assert r.exit_code == 0, r.output
    assert "status: named" in r.output and "checksums OK" in r.output
    assert _files(path) == before  # read-only commands created nothing


@pytest.mark.spark
def test_export_to_parquet_and_json_lines(profile_root, tmp_path):
    _path, root = profile_root
    expected = load_state_table(root, "profile", 4, include_expired=True)
    out = tmp_path / "state.parquet"
    r = run("export", root, "--operator", "profile", "--version", "4", "--include-expired", "--out", str(out))
    assert r.exit_code == 0, r.output
    assert f"wrote {expected.num_rows} rows of version 4 (3 partitions)" in r.output and "rows/s" in r.output
    assert "reading types: partition 3/3" in r.output and "writing rows: partition 3/3" in r.output  # not a terminal
    assert pq.read_table(out).equals(expected)
    r = run("export", root, "--operator", "profile", "--version", "4", "--include-expired", "--out", str(out))
    assert r.exit_code == 1 and "exists" in r.output
    lines = tmp_path / "seen.jsonl"
    r = run("export", root, "--operator", "profile", "--state-var", "seen", "--now-ms", "1003000", "--out", str(lines),
            "--json")
    doc = json.loads(r.output.splitlines()[-1])
    seen = load_state_table(root, "profile", state_var="seen", now_ms=1003000).to_pylist()
    assert doc["format"] == "jsonl" and doc["rows"] == len(seen) == len(lines.read_text().splitlines())
    _same([json.loads(x) for x in lines.read_text().splitlines()], seen)
    assert sorted(os.listdir(tmp_path)) == ["seen.jsonl", "state.parquet"]  # no temp file left


@pytest.mark.spark
def test_commands_on_seaweedfs(spark, seaweedfs, s3_bucket, tmp_path):
    root = f"s3://{s3_bucket}/ckpt"
    with Daemon(env=seaweedfs.env()) as d:
        build_profile(spark, root, d.socket, s3_options=seaweedfs.client_options(), report=False)
    env = seaweedfs.env()
    r = run("ls", root, "--json", env=env)
    assert r.exit_code == 0, r.output
    (op,) = json.loads(r.output)
    assert op["operator_id"] == "profile" and op["versions"] == [1, 2, 3, 4] and len(op["partitions"]) == 3
    opts = seaweedfs.client_options()
    expected = load_state_table(root, "profile", include_expired=True, s3_options=opts).to_pylist()
    r = run("show", root, "--operator", "profile", "--include-expired", "--limit", "0", "--json", env=env)
    _same([json.loads(line) for line in r.output.splitlines()], expected)
    out = tmp_path / "s.parquet"
    r = run("export", root, "--operator", "profile", "--include-expired", "--out", str(out), env=env)
    assert r.exit_code == 0, r.output
    assert pq.read_table(out).to_pylist() == load_state_table(root, "profile", include_expired=True, s3_options=opts).to_pylist()
    r = run("diff", root, "--operator", "profile", "--from", "2", "--state-var", "hist", "--json", env=env)
    got = [json.loads(line) for line in r.output.splitlines()]
    assert got and len(got) == load_changes_table(root, "profile", 2, state_var="hist", s3_options=opts).num_rows
    r = run("inspect", root, "profile/_commits/4.json", env=env)
    assert r.exit_code == 0 and "manifest of profile version 4" in r.output
    r = run("gc", root, "--operator", "profile", "--dry-run", env=env)
    assert r.exit_code == 0 and "would delete 0 files (0 orphaned attempts)" in r.output
