"""Issue 40, edge 4: checkpoint roots are checked. A malformed root (empty, relative, with ``.`` or
``..`` segments, an unknown scheme, a ``file://`` URI naming another host) is refused at OPEN with
``RootError`` naming it; with ``allowed_roots`` every root outside those prefixes is refused with
``RootNotAllowedError``. Nothing is created for a refused root. Real daemons, in-process (both
loops) and as a process configured by ``STATESTORE_ALLOWED_ROOTS``."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from statestore_async import errors
from statestore_async.client.clients import AsyncClient, Client
from statestore_async.config import DaemonConfig, load_config
from statestore_async.ids import CheckpointRef, StoreId, check_root, new_checkpoint_id, root_parts

BAD_ROOTS = [
    "",
    "   ",
    "relative/dir",
    "file:relative/dir",
    "ftp://host/state",
    "gs://bucket/state",
    "file://otherhost/data/state",
    "s3:///no-bucket",
    "s3://user@bucket/p",
    "file:///data/../etc",
    "file:///data/./state",
    "file:///data/%2e%2e/etc",
    "/data/../../x",
    "s3://bucket/a/../b",
    "file:///data/state?x=1",
    "file:///data/st\x00ate",
]


@pytest.mark.parametrize("root", BAD_ROOTS)
def test_malformed_roots_are_refused_naming_the_root(root):
    with pytest.raises(errors.RootError) as exc:
        root_parts(root)
    assert repr(root) in str(exc.value)
    assert "file:///" in str(exc.value) or "s3://" in str(exc.value)  # the fix: the accepted forms


@pytest.mark.parametrize("root, parts", [
    ("file:///data/state", ("file", "", ("data", "state"))),
    ("file:/data/state/", ("file", "", ("data", "state"))),
    ("file://localhost/data//state", ("file", "", ("data", "state"))),
    ("/data/state", ("file", "", ("data", "state"))),
    ("s3://bucket", ("s3", "bucket", ())),
    ("s3://bucket/pre/fix/", ("s3", "bucket", ("pre", "fix"))),
    ("file:///data/st..ate", ("file", "", ("data", "st..ate"))),  # dots inside a name are a name
])
def test_well_formed_roots_normalise(root, parts):
    p = root_parts(root)
    assert (p.scheme, p.bucket, p.segments) == parts


def test_allowed_roots_match_whole_segments():
    allowed = (root_parts("file:///data/state"), root_parts("s3://bucket/prefix"))
    for ok in ("file:///data/state", "file:///data/state/", "file:///data/state/job1", "/data/state/x",
               "s3://bucket/prefix", "s3://bucket/prefix/job"):
        check_root(ok, allowed)
    for refused in ("file:///data/state2", "file:///data", "file:///proc/self", "s3://bucket/prefix2",
                    "s3://bucket", "s3://other/prefix", "s3://data/state"):
        with pytest.raises(errors.RootNotAllowedError) as exc:
            check_root(refused, allowed)
        assert repr(refused) in str(exc.value) and "allowed_roots" in str(exc.value)


def test_allowed_roots_setting_from_env_toml_and_flags(tmp_path):
    env = {"STATESTORE_ALLOWED_ROOTS": "s3://bucket/prefix, file:///data/state"}
    assert load_config(env=env).allowed_roots == ("s3://bucket/prefix", "file:///data/state")
    toml = tmp_path / "d.toml"
    toml.write_text('allowed_roots = ["s3://b/p", "file:///x"]\n')
    cfg = load_config(str(toml), env={})
    assert cfg.allowed_roots == ("s3://b/p", "file:///x")
    assert load_config(env={}, overrides={"allowed_roots": "file:///y"}).allowed_roots == ("file:///y",)
    # the printed settings read back the same
    again = tmp_path / "again.toml"
    again.write_text(cfg.to_toml())
    assert load_config(str(again), env={}) == cfg
    assert DaemonConfig().allowed_roots == ()
    with pytest.raises(errors.InterfaceError, match=r"allowed_roots.*'ftp://x'"):
        load_config(env={"STATESTORE_ALLOWED_ROOTS": "ftp://x"})
    with pytest.raises(errors.InterfaceError, match="allowed_roots"):
        DaemonConfig(allowed_roots=("file:///a/../b",))


async def test_open_refuses_malformed_roots_and_creates_nothing(daemon_factory, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative root would resolve here
    d = await daemon_factory()
    async with AsyncClient(d.config.socket) as c:
        for root in ["", "relative/dir", "file:relative/dir", "ftp://host/state", "file://otherhost/x",
                     f"file://{tmp_path}/a/../escaped", f"file://{tmp_path}/a/%2e%2e/escaped"]:
            sid = StoreId(root, "op", 0)
            with pytest.raises(errors.RootError) as exc:
                await c.open(sid, 0)
            assert repr(root) in str(exc.value)
            with pytest.raises(errors.RootError):
                await c.open(sid, 3, new_checkpoint_id())
            with pytest.raises(errors.RootError):
                await c.await_durable(sid, CheckpointRef(1, new_checkpoint_id()), 1)
            with pytest.raises(errors.RootError):
                await c.release(root, "op", [0])
        # the connection goes on, and a good root works
        h = await c.open(StoreId(f"file://{tmp_path}/good", "op", 0), 0)
        await h.put_many([(b"\x00\x01k", b"v")])
        ref = await h.commit()
        assert await c.await_durable(StoreId(f"file://{tmp_path}/good", "op", 0), ref, 30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good"]
    assert d.registry is not None and len(d.registry) == 1


async def test_allowed_roots_refuse_every_other_root_at_open(daemon_factory, tmp_path):
    allowed = f"file://{tmp_path}/allowed"
    d = await daemon_factory(allowed_roots=(allowed, "s3://bucket/prefix"))
    async with AsyncClient(d.config.socket) as c:
        for root in [f"file://{tmp_path}/allowed2", f"file://{tmp_path}/other", "file:///proc/self",
                     f"file://{tmp_path}", "s3://bucket/prefix2", "s3://other/prefix"]:
            sid = StoreId(root, "op", 0)
            with pytest.raises(errors.RootNotAllowedError) as exc:
                await c.open(sid, 0)
            assert repr(root) in str(exc.value) and "allowed_roots" in str(exc.value)
            with pytest.raises(errors.RootNotAllowedError):
                await c.await_durable(sid, CheckpointRef(1, new_checkpoint_id()), 1)
        for root in [allowed, f"{allowed}/job1", f"file://{tmp_path}//allowed/job2/"]:
            sid = StoreId(root, "op", 0)
            h = await c.open(sid, 0)
            await h.put_many([(b"\x00\x01k", b"v")])
            ref = await h.commit()
            assert await c.await_durable(sid, ref, 30)
            h = await c.open(sid, ref.version, ref.ckptid)
            await h.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["allowed"]


def test_a_daemon_process_takes_allowed_roots_from_its_environment(daemon_process, tmp_path):
    """What an autostarted daemon gets: STATESTORE_ALLOWED_ROOTS in its environment."""
    allowed = f"file://{tmp_path}/allowed"
    env = {**os.environ, "STATESTORE_ALLOWED_ROOTS": f"s3://bucket/p,{allowed}"}
    d = daemon_process("--loop", "asyncio", env=env)
    with Client(d.socket) as c:
        with pytest.raises(errors.RootNotAllowedError) as exc:
            c.open(StoreId(f"file://{tmp_path}/elsewhere", "op", 0), 0)
        assert "elsewhere" in str(exc.value)
        sid = StoreId(f"{allowed}/q", "op", 0)
        h = c.open(sid, 0)
        h.put_many([(b"\x00\x01k", b"v")])
        ref = h.commit()
        assert c.await_durable(sid, ref, 30)
    assert not Path(tmp_path, "elsewhere").exists()
    assert d.stop() == 0



def test_the_helm_chart_sets_allowed_roots_from_the_object_store_root(tmp_path):
    """The chart's daemon serves ``objectStore.root`` and ``objectStore.extraAllowedRoots`` only."""
    from test_helm import _helm_path, render

    helm = _helm_path()
    r = render(helm, "--set", "objectStore.root=s3://bucket/ckpt")
    toml = tmp_path / "statestore.toml"
    toml.write_text(r.toml_text)
    cfg = load_config(str(toml), env={})
    assert cfg.allowed_roots == ("s3://bucket/ckpt",)
    r = render(helm, "--set", "objectStore.root=s3://bucket/ckpt",
               "--set", "objectStore.extraAllowedRoots={file:///data/state,s3://other}")
    toml.write_text(r.toml_text)
    cfg = load_config(str(toml), env={})
    assert cfg.allowed_roots == ("s3://bucket/ckpt", "file:///data/state", "s3://other")
    check_root("s3://bucket/ckpt/job1", cfg.allowed_root_parts)
    with pytest.raises(errors.RootNotAllowedError):
        check_root("s3://bucket/elsewhere", cfg.allowed_root_parts)
