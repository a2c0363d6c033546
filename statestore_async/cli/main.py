"""``statestore-async`` command line: ``serve``, ``health``, ``selftest``, ``inspect``, ``verify``, ``gc``,
and ``ls``, ``show``, ``export``, ``diff`` (``cli.state``), ``repartition`` (``cli.repartition``).

Settings come from flags > ``STATESTORE_*`` environment > ``--config`` TOML file > defaults
(``config.load_config``); every ``DaemonConfig`` setting has a flag (``--memory-budget 2GiB``).
"""
from __future__ import annotations

import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from statestore_async.cli.repartition import repartition as repartition_command
from statestore_async.cli.state import COMMANDS as STATE_COMMANDS
from statestore_async.cli.tooling import open_root, run_tool
from statestore_async.config import FIELDS, load_config
from statestore_async.errors import StateStoreError

if TYPE_CHECKING:
    from statestore_async.ids import CheckpointRef, StoreId

_F = TypeVar("_F", bound=Callable[..., Any])


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """statestore_async: a versioned key-value state store daemon for PySpark Structured Streaming."""


for _command in STATE_COMMANDS:  # ls, show, export, diff
    main.add_command(_command)
main.add_command(repartition_command)


def _setting_options(fn: _F) -> _F:
    for name in reversed(list(FIELDS)):
        f = FIELDS[name]
        help_text = f.metadata.get("help", "")
        choices = f.metadata.get("choices")
        if choices:
            shown = "|".join(c or "''" for c in choices)
            help_text += f" [{shown}]"
        fn = click.option(f"--{name.replace('_', '-')}", name, default=None, metavar="VALUE", help=help_text)(fn)
    return fn


@main.command()
@click.option("--config", "config_path", default=None, type=click.Path(dir_okay=False),
              help="TOML file with settings (also STATESTORE_CONFIG)")
@click.option("--print-config", is_flag=True, help="print the effective settings as TOML and exit")
@_setting_options
def serve(config_path: str | None, print_config: bool, **settings: str | None) -> None:
    """Run the daemon until SIGTERM/SIGINT (then finish requests and drain uploads).

    Exit status: 0 when every acknowledged commit was durable at the end; 3 when some were not
    (the drain timed out or uploads failed: the versions are in the log); 2 for a bad setting or a
    daemon that cannot start."""
    from statestore_async.daemon.server import run

    try:
        cfg = load_config(config_path, overrides=settings)
    except StateStoreError as exc:
        raise click.UsageError(str(exc)) from None
    if print_config:
        click.echo(cfg.to_toml(), nl=False)
        return
    try:
        code = run(cfg)
    except StateStoreError as exc:
        click.echo(f"statestore-async: {exc}", err=True)
        sys.exit(2)
    sys.exit(code)


def _socket_option(fn: _F) -> _F:
    return click.option("--socket", "socket_path", default=None,
                        help="daemon socket (default: STATESTORE_SOCKET or the built-in default)")(fn)


def _socket(path: str | None) -> str:
    return path or load_config(env=os.environ).socket


#: ``health`` exit status when the daemon answers but is degraded or stopping (with ``--ready``)
EXIT_DEGRADED = 3


@main.command()
@_socket_option
@click.option("--timeout", default=5.0, show_default=True, help="seconds to wait for the daemon")
@click.option("--ready", is_flag=True,
              help=f"readiness: also exit {EXIT_DEGRADED} when the daemon is degraded or stopping")
def health(socket_path: str | None, timeout: float, ready: bool) -> None:
    """Liveness (and, with --ready, readiness) probe.

    Exit 0 when the daemon answers HELLO, PING and STATS, 1 when it does not. A daemon that answers
    but is degraded (an object store refuses its uploads: credentials, permissions, a missing
    bucket, a full disk) prints "degraded:" and its reasons; it exits 0 — restarting it would lose
    the commits it holds and cure nothing — unless --ready is given: then it exits 3, as it does
    for a daemon that is stopping.
    """
    from statestore_async.client.clients import Client

    path = _socket(socket_path)
    try:
        client = Client(path, timeout=timeout, connect_timeout=timeout)
    except StateStoreError as exc:  # a path that cannot hold a socket (SocketPathError)
        click.echo(f"unhealthy: {path}: {exc}", err=True)
        sys.exit(1)
    try:
        token = os.urandom(8)
        if client.ping(token) != token:
            raise StateStoreError("PING answered with other bytes")
        report = client.stats().get("health") or {"status": "ok", "reasons": []}
    except (StateStoreError, OSError) as exc:
        click.echo(f"unhealthy: {path}: {exc}", err=True)
        sys.exit(1)
    finally:
        client.close()
    status = report.get("status", "ok")
    if status == "ok":
        click.echo(f"ok: {path}")
        return
    reasons = "; ".join(report.get("reasons") or []) or status
    click.echo(f"{status}: {path}: {reasons}", err=ready)
    if ready:
        sys.exit(EXIT_DEGRADED)


@main.command()
@_socket_option
@click.option("--root", required=True, help="checkpoint root URI; the scratch store goes under <root>/_selftest")
@click.option("--timeout", default=30.0, show_default=True, help="seconds to wait for durability")
def selftest(socket_path: str | None, root: str, timeout: float) -> None:
    """A put/commit/get round trip on a scratch store; exit 0 on success (the Helm test runs it)."""
    from statestore_async.client.clients import Client
    from statestore_async.files.names import file_key
    from statestore_async.ids import StoreId

    path = _socket(socket_path)
    scratch = root.rstrip("/") + "/_selftest"
    store_id = StoreId(scratch, f"selftest-{uuid.uuid4().hex[:12]}", os.getpid() % 100000)
    key, value = b"\x00\x00selftest", f"ok {time.time()}".encode()
    try:
        client = Client(path, timeout=timeout + 10)
    except StateStoreError as exc:  # a path that cannot hold a socket (SocketPathError)
        click.echo(f"selftest failed: {path}: {type(exc).__name__}: {exc}", err=True)
        sys.exit(1)
    written = []
    try:
        with client.open(store_id, 0) as h:
            h.put_many([(key, value)])
            ref = h.commit()
        written.append(ref)
        with client.open(store_id, ref.version, ref.ckptid) as h:
            got = h.get_many([key, b"\x00\x00absent"])
            h.abort()
        if got != [value, None]:
            raise StateStoreError(f"read back {got!r}, expected {[value, None]!r}")
        if not client.await_durable(store_id, ref, timeout):
            up = client.stats().get("uploader", {})
            pending = sum(n for state, n in up.get("states", {}).items() if state in ("queued", "uploading"))
            raise StateStoreError(
                f"checkpoint {ref} was not durable within {timeout}s (the daemon's uploads: {pending} waiting or "
                f"in flight, {up.get('retries', '?')} attempts failed and retried, {up.get('durable', '?')} durable); "
                "its log names each failed attempt and the object store's answer")
        click.echo(f"ok: {path} served a round trip on {store_id} ({ref})")
    except (StateStoreError, OSError) as exc:
        click.echo(f"selftest failed: {path}: {type(exc).__name__}: {exc}", err=True)
        sys.exit(1)
    finally:
        client.close()
        _cleanup(store_id, written, file_key)


def _cleanup(store_id: StoreId, refs: list[CheckpointRef], file_key: Callable[[StoreId, CheckpointRef, str], str]) -> None:
    """Delete the scratch files when this process can reach the object store (best effort)."""
    if not refs:
        return
    import asyncio

    from statestore_async.config import load_config
    from statestore_async.objectstore import open_object_store

    async def go() -> None:
        try:
            s3: dict[str, Any] = load_config().s3_options()
        except Exception:  # no readable daemon config here: the AWS chain's defaults
            s3 = {}
        # best effort: a few seconds, not the daemon's patient retries, when the root does not answer
        s3.update(max_attempts=2, connect_timeout=2.0, read_timeout=10.0)
        store = open_object_store(store_id.root, s3_options=s3)
        try:
            for ref in refs:
                for kind in ("delta", "snapshot"):
                    await store.delete(file_key(store_id, ref, kind))
        finally:
            await store.close()

    try:
        asyncio.run(go())
    except Exception as exc:  # the daemon's node may see a root this pod cannot
        click.echo(f"note: could not remove the scratch files of {store_id}: {exc}", err=True)


@main.command()
@click.argument("root")
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def inspect(root: str, key: str, as_json: bool) -> None:
    """Show and check one checkpoint file or manifest: ROOT is the checkpoint root URI, KEY the
    file's key under it (``<operator>/<partition>/default/<version>_<ckptid>.delta|.snapshot`` or
    ``<operator>/_commits/<version>.json``). A checkpoint file's status says what the operator's
    manifests make of it: named (a manifest's state), needed (in the lineage of one), orphaned (no
    manifest needs it: ``gc`` deletes it) or pending (newer than every manifest)."""
    import dataclasses

    from statestore_async.cli.offline import FileReport, ManifestReport, file_status, inspect_file, inspect_manifest

    async def go() -> tuple[FileReport | ManifestReport, str | None]:
        async with open_root(root) as objstore:
            if key.endswith(".json"):
                return await inspect_manifest(objstore, key), None
            report = await inspect_file(objstore, key)
            return report, await file_status(objstore, root, key)

    r, status = run_tool(go)
    if isinstance(r, ManifestReport):
        m = r.manifest
        if as_json:
            click.echo(json.dumps(r.to_json(), default=str))
            return
        click.echo(f"{r.key}: manifest of {m.operator_id} version {m.version}, {m.num_partitions} partitions, "
                   f"{m.num_key_groups} key groups, created {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(m.created))}; "
                   "checksum OK")
        for name in sorted(m.metadata):
            click.echo(f"  {name}: {json.dumps(m.metadata[name], sort_keys=True)}")
        for store, refs in sorted(m.stores.items()):
            for p, ref in enumerate(refs):
                click.echo(f"  {store}/{p}: {ref}")
        return
    if as_json:
        click.echo(json.dumps({**dataclasses.asdict(r), "kind_of_file": r.kind, "status": status}, default=str))
        return
    click.echo(f"{r.name}: {r.kind} of {r.store} at version {r.version} ({r.ckptid}), {r.size} bytes, codec {r.codec}")
    click.echo(f"  status: {status}")
    click.echo(f"  lineage: {' <- '.join(r.lineage) or '(none)'}")
    click.echo(f"  records: {r.records} ({r.tombstones} tombstones) in {len(r.blocks)} blocks; checksums OK")
    for off, length, count, first, last in r.blocks:
        click.echo(f"  block @{off}: {length} bytes, {count} records, key groups {first}..{last}")


@main.command()
@click.argument("root")
@click.option("--operator", "operator_id", required=True, help="operator id")
@click.option("--version", type=int, default=None, help="manifest version (default: the latest)")
def verify(root: str, operator_id: str, version: int | None) -> None:
    """Load every partition a manifest names from files alone, checking every checksum (exit 1 on error)."""
    from statestore_async.cli.offline import VerifyReport, verify_operator

    async def go() -> VerifyReport:
        async with open_root(root) as objstore:
            return await verify_operator(objstore, root, operator_id, version)

    r = run_tool(go)
    for (store, p), info in sorted(r.partitions.items()):
        click.echo(f"  {store}/{p}: {info['ref']} OK, {info['records']} records "
                   f"from {info['files']} files ({info['bytes']} bytes)")
    for (store, p), msg in sorted(r.errors.items()):
        click.echo(f"  {store}/{p}: FAILED {msg}", err=True)
    click.echo(f"version {r.version}: {len(r.partitions)} partitions OK, {len(r.errors)} failed")
    sys.exit(0 if r.ok else 1)


@main.command()
@click.argument("root")
@click.option("--operator", "operator_id", required=True, help="operator id")
@click.option("--keep", type=int, default=100, show_default=True, help="manifests (versions) to keep loadable")
@click.option("--dry-run", is_flag=True, help="list what would be deleted, delete nothing")
@click.option("--keep-orphans", is_flag=True,
              help="keep orphaned attempts at or above each partition's oldest kept state (the behaviour before)")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def gc(root: str, operator_id: str, keep: int, dry_run: bool, keep_orphans: bool, as_json: bool) -> None:
    """Delete checkpoint files and manifests that none of the last KEEP versions needs.

    Orphaned attempts (files no kept manifest's state needs: losing task attempts, batches whose
    manifest was never written) go too, unless --keep-orphans; files newer than the newest state
    a kept manifest names (a batch may be writing them) are never touched."""
    from statestore_async.cli.offline import GcReport, gc_operator

    async def go() -> GcReport:
        async with open_root(root) as objstore:
            return await gc_operator(objstore, root, operator_id, keep, dry_run=dry_run, orphans=not keep_orphans)

    r = run_tool(go)
    if as_json:
        click.echo(json.dumps({**r.to_json(), "dry_run": dry_run}))
        return
    verb = "would delete" if dry_run else "deleted"
    orphaned = set(r.orphaned_files)
    for k in r.deleted_files + r.deleted_manifests:
        click.echo(f"  {verb} {k}" + (" (orphaned attempt)" if k in orphaned else ""))
    click.echo(f"kept versions {r.kept_manifests[:1]}..{r.kept_manifests[-1:]}; {verb} {len(r.deleted_files)} files "
               f"({len(orphaned)} orphaned attempts) and {len(r.deleted_manifests)} manifests")


if __name__ == "__main__":
    main()
