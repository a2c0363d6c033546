"""Where an operator's state lives: its checkpoint root, as one URI every process reads alike, and
the S3 settings a driver-side reader uses for it."""
from __future__ import annotations

import os

from statestore_async.config import load_config
from statestore_async.errors import InterfaceError


def checkpoint_root(root: str) -> str:
    """A checkpoint root as the URI every process reads alike: ``s3://…`` and ``file:///abs`` as
    given, an absolute path as ``file:///abs`` (without a trailing slash). A relative path is
    refused (``InterfaceError`` naming it and the absolute URI it reads as here): the driver, the
    executors and their daemons each have their own working directory, and would each resolve it
    against theirs."""
    if not isinstance(root, str) or not root.strip():
        raise InterfaceError(f"the checkpoint root is a URI (file:///abs/path or s3://bucket/prefix), got {root!r}")
    if "://" in root:
        scheme, _, rest = root.partition("://")
        if scheme == "file" and not rest.startswith(("/", "localhost/")):
            raise InterfaceError(
                f"checkpoint root {root!r}: a file URI has three slashes, file:///abs/path ({rest.partition('/')[0]!r} "
                f"reads as a host name); did you mean 'file:///{rest}'?")
        return root.rstrip("/")
    path = root.removeprefix("file:")
    if not os.path.isabs(path):
        raise InterfaceError(
            f"checkpoint root {root!r} is a relative path: the driver, the executors and their daemons would each "
            f"resolve it against their own working directory. Give an absolute URI, e.g. "
            f"{'file://' + os.path.abspath(path)!r} (its reading in this process's directory), or s3://bucket/prefix")
    return ("file://" + os.path.abspath(path)).rstrip("/")


def s3_options_from_env() -> dict | None:
    """S3 settings for the driver's object store from ``STATESTORE_S3_*`` (credentials: the AWS chain)."""
    return load_config(env=os.environ).s3_options()


__all__ = ["checkpoint_root", "s3_options_from_env"]
