"""What the offline commands share (``cli.main``'s inspect / verify / gc, ``cli.state``,
``cli.repartition``): a checkpoint root opened without creating anything, a tool run with its
typed errors printed, and a progress display for long runs."""
from __future__ import annotations

import os
import sys
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

import click

from statestore_async.config import load_config
from statestore_async.errors import StateStoreError

if TYPE_CHECKING:
    from statestore_async.objectstore.base import ObjectStore

_T = TypeVar("_T")


def open_root(root: str) -> ObjectStore:
    """The object store of a checkpoint root for the offline commands, with the S3 settings of the
    daemon config if readable. They never create anything but what they were asked to: a local
    root is opened without creating its folder, and one that does not exist is an error (a
    mistyped root), not an empty store."""
    from urllib.parse import unquote, urlparse

    from statestore_async.errors import ObjectNotFoundError
    from statestore_async.objectstore import open_object_store

    parsed = urlparse(root)
    if parsed.scheme in ("", "file"):
        path = unquote(parsed.path) if parsed.scheme == "file" else root
        if not os.path.isdir(path):
            raise ObjectNotFoundError(f"no checkpoint root at {root!r}: {os.path.abspath(path)!r} is not a folder "
                                      "(nothing was created)", root)
        return open_object_store(root, create=False)
    try:
        s3 = load_config().s3_options()
    except StateStoreError:
        s3 = None
    return open_object_store(root, s3_options=s3)


def run_tool(coro_fn: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    import asyncio

    try:
        return asyncio.run(coro_fn())
    except StateStoreError as exc:
        click.echo(f"statestore-async: {type(exc).__name__}: {exc}", err=True)
        sys.exit(1)


class Progress:
    """Progress of an export: a rich bar on a terminal, a plain line per partition otherwise."""

    def __init__(self) -> None:
        self.bar: Any = None
        self.tasks: dict[str, Any] = {}
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=Console(stderr=True), transient=False)

    def __enter__(self) -> Progress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def __call__(self, phase: str, done: int, total: int) -> None:
        label = {"types": "reading types", "rows": "writing rows"}.get(phase, phase)
        if self.bar is None:
            click.echo(f"{label}: partition {done}/{total}", err=True)
            return
        if phase not in self.tasks:
            self.tasks[phase] = self.bar.add_task(label, total=total)
        self.bar.update(self.tasks[phase], completed=done)
