"""Daemon configuration: defaults < TOML file < ``STATESTORE_*`` environment < command-line flags.

Every setting has one name. In the TOML file it is a key (``memory_budget = "2GiB"``); in the
environment it is ``STATESTORE_`` + the name upper-cased (``STATESTORE_MEMORY_BUDGET=2GiB``); as a
flag it is ``--memory-budget 2GiB``. The file is named by ``--config`` or ``STATESTORE_CONFIG``.
The Helm chart renders exactly these keys into its ConfigMap; secrets (S3 keys) never go there:
S3 credentials come from the standard AWS chain (env, profile, web identity/IRSA).
"""
from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from statestore_async.errors import InterfaceError
from statestore_async.ids import RootParts, root_parts

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3,
          "gib": 1024**3, "ti": 1024**4, "tib": 1024**4}


def parse_size(value: object) -> int:
    """Bytes from ``123``, ``"64MiB"``, ``"2GiB"``, ``"1.5G"``."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise InterfaceError(f"a size is >= 0, got {value}")
        return value
    m = _SIZE_RE.match(str(value))
    if not m:
        raise InterfaceError(f"not a size: {value!r} (use e.g. 512MiB, 2GiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def default_socket_path() -> str:
    """``$XDG_RUNTIME_DIR/statestore-async/daemon.sock``, else a per-user folder under /tmp."""
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/statestore-async-{os.getuid()}"
    if base.startswith("/tmp/"):
        return f"{base}/daemon.sock"
    return f"{base}/statestore-async/daemon.sock"


def _uids(value: str | Iterable[str | int]) -> tuple[int, ...]:
    if isinstance(value, str):
        value = [v for v in re.split(r"[,\s]+", value.strip()) if v]
    try:
        return tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise InterfaceError(f"allowed_uids is a list of integers, got {value!r}") from None


def _roots(value: str | Iterable[str]) -> tuple[str, ...]:
    """Checkpoint-root prefixes from ``"s3://b/p,file:///data/state"`` or a TOML list; each must be a
    root the daemon would accept (``ids.root_parts``)."""
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",")]
    if not isinstance(value, (list, tuple)):
        raise InterfaceError(f"allowed_roots is a list of checkpoint roots, got {value!r}")
    roots = tuple(v for v in value if v)
    for r in roots:
        if not isinstance(r, str):
            raise InterfaceError(f"allowed_roots is a list of checkpoint roots, got {r!r}")
        try:
            root_parts(r)
        except InterfaceError as exc:
            raise InterfaceError(f"allowed_roots: {exc}") from None
    return roots


def _mode(value: int | str) -> int:
    if isinstance(value, int):
        return value
    try:
        return int(str(value), 8)
    except ValueError:
        raise InterfaceError(f"socket_mode is an octal mode like 0660, got {value!r}") from None


@dataclass(frozen=True)
class DaemonConfig:
    """Settings of one daemon (one per node)."""

    socket: str = field(default_factory=default_socket_path, metadata={"help": "Unix socket path"})
    socket_mode: int = field(default=0o660, metadata={"help": "socket file mode (octal)", "parse": _mode})
    allowed_uids: tuple[int, ...] = field(default=(), metadata={
        "help": "peer uids allowed (empty: the daemon's own uid)", "parse": _uids})
    allowed_roots: tuple[str, ...] = field(default=(), metadata={
        "help": "checkpoint roots the daemon serves, comma-separated prefixes matched on whole path segments "
                "(e.g. s3://bucket/prefix,file:///data/state); empty: any well-formed root",
        "parse": _roots})
    loop: str = field(default="uvloop", metadata={"help": "event loop: uvloop or asyncio", "choices": ("uvloop", "asyncio")})
    log_level: str = field(default="info", metadata={"help": "debug, info, warning, error",
                                                     "choices": ("debug", "info", "warning", "error")})
    log_format: str = field(default="text", metadata={"help": "text or json", "choices": ("text", "json")})
    memory_budget: int = field(default=2 << 30, metadata={
        "help": "bytes of state kept in memory before idle stores are evicted", "parse": parse_size})
    block_cache_bytes: int = field(default=0, metadata={
        "help": "part of memory_budget for the cached blocks of stores spilled to local disk (0 = a quarter of it)",
        "parse": parse_size})
    spill_min_bytes: int = field(default=1 << 20, metadata={
        "help": "an idle store whose map takes this much or more spills to its snapshot file on local disk "
                "(s3:// roots need cache_dir) when memory is over budget; a smaller one is evicted whole",
        "parse": parse_size})
    flush_min_bytes: int = field(default=1 << 20, metadata={
        "help": "over budget, an open version whose changes take this much or more writes them to local disk "
                "(the write buffer; in cache_dir/flushed, else a temporary folder)",
        "parse": parse_size})
    max_open_runs: int = field(default=256, metadata={
        "help": "open files for the runs of stores spilled to local disk (snapshots, stacked deltas, flushed "
                "changes): past it the least recently read are closed and opened again when read", "parse": int})
    max_frame_bytes: int = field(default=64 << 20, metadata={"help": "largest protocol frame accepted", "parse": parse_size})
    partial_frames_bytes: int = field(default=128 << 20, metadata={
        "help": "bytes the frames still arriving on all connections may hold together (at least max_frame_bytes); "
                "a connection whose frame does not fit waits (its reading paused) until others complete or go",
        "parse": parse_size})
    max_batch: int = field(default=100_000, metadata={"help": "most keys in one batched request", "parse": int})
    max_inflight: int = field(default=64, metadata={"help": "pipelined requests in flight per connection", "parse": int})
    cache_dir: str = field(default="", metadata={"help": "local cache of uploaded files ('' = off)"})
    cache_bytes: int = field(default=10 << 30, metadata={"help": "local cache size bound", "parse": parse_size})
    snapshot_interval: int = field(default=10, metadata={"help": "snapshot a store every N deltas", "parse": int})
    snapshot_delta_bytes: int = field(default=256 << 20, metadata={
        "help": "…or when its delta chain exceeds this", "parse": parse_size})
    snapshot_builder: str = field(default="inline", metadata={
        "help": "process: a worker process rebuilds snapshots from durable files; "
                "inline: the daemon encodes them between requests",
        "choices": ("process", "inline")})
    retention_versions: int = field(default=100, metadata={
        "help": "keep at least the last N versions loadable (>= 2)", "parse": int})
    upload_concurrency: int = field(default=8, metadata={"help": "parallel uploads", "parse": int})
    upload_queue_bytes: int = field(default=256 << 20, metadata={
        "help": "bytes queued for upload before commits wait", "parse": parse_size})
    upload_queue_count: int = field(default=1000, metadata={
        "help": "deltas queued for upload before commits wait (with upload_queue_bytes: whichever comes first)",
        "parse": int})
    open_version_idle_timeout: float = field(default=300.0, metadata={
        "help": "seconds an open version may go without a request before the daemon aborts it, freeing its "
                "store's writer slot (a stalled or vanished client); 0 = never",
        "parse": float})
    open_wait_timeout: float = field(default=30.0, metadata={
        "help": "seconds an OPEN waits at most for its store's earlier uploads to settle before it fails with "
                "OpenTimeoutError (a root refusing uploads fails it at once); below the clients' 60 s timeout",
        "parse": float})
    drain_timeout: float = field(default=60.0, metadata={
        "help": "seconds SIGTERM waits for queued uploads", "parse": float})
    exit_when_idle: float = field(default=0.0, metadata={
        "help": "exit (as on SIGTERM) after this many seconds with no client connected and no upload pending; 0 = never",
        "parse": float})
    s3_endpoint_url: str = field(default="", metadata={"help": "S3 endpoint (empty: AWS default)"})
    s3_region: str = field(default="", metadata={"help": "S3 region (empty: AWS chain)"})
    s3_sse: str = field(default="", metadata={"help": "server-side encryption: '', AES256 or aws:kms",
                                              "choices": ("", "AES256", "aws:kms")})
    s3_kms_key_id: str = field(default="", metadata={"help": "KMS key id for aws:kms"})
    s3_addressing_style: str = field(default="auto", metadata={"help": "auto, path or virtual",
                                                               "choices": ("auto", "path", "virtual")})
    metrics_port: int = field(default=0, metadata={"help": "Prometheus metrics port (0 = off)", "parse": int})
    metrics_host: str = field(default="127.0.0.1", metadata={"help": "address the metrics port binds"})

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_roots", _roots(self.allowed_roots))  # checked, also when given directly
        if self.retention_versions < 2:
            raise InterfaceError("retention_versions must be at least 2")
        if self.exit_when_idle < 0:
            raise InterfaceError("exit_when_idle must be >= 0 (0: never)")
        if self.partial_frames_bytes < self.max_frame_bytes:
            raise InterfaceError(f"partial_frames_bytes ({self.partial_frames_bytes}) must hold one largest frame: at "
                                 f"least max_frame_bytes ({self.max_frame_bytes})")
        if self.open_wait_timeout <= 0:
            raise InterfaceError("open_wait_timeout must be > 0 (seconds an OPEN waits for its store's uploads)")
        if self.open_version_idle_timeout < 0:
            raise InterfaceError("open_version_idle_timeout must be >= 0 (0: never)")
        for name in ("snapshot_interval", "upload_concurrency", "upload_queue_count", "max_batch", "max_inflight",
                     "max_open_runs"):
            if getattr(self, name) < 1:
                raise InterfaceError(f"{name} must be at least 1")
        for f in fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise InterfaceError(f"{f.name} must be one of {choices}, got {getattr(self, f.name)!r}")

    def s3_options(self) -> dict[str, str | None]:
        """Options for ``S3ObjectStore`` from the s3_* settings (credentials: the AWS chain)."""
        return {
            "endpoint_url": self.s3_endpoint_url or None,
            "region": self.s3_region or None,
            "sse": self.s3_sse or None,
            "kms_key_id": self.s3_kms_key_id or None,
            "addressing_style": self.s3_addressing_style,
        }

    @property
    def effective_allowed_uids(self) -> tuple[int, ...]:
        return self.allowed_uids or (os.getuid(),)

    @property
    def allowed_root_parts(self) -> tuple[RootParts, ...]:
        """``allowed_roots`` taken apart (``ids.check_root`` matches roots against them)."""
        return tuple(root_parts(r) for r in self.allowed_roots)

    def to_toml(self) -> str:
        """The settings as a TOML file (what ``--config`` reads)."""
        out = []
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "socket_mode":
                out.append(f'{f.name} = "{v:04o}"')
            elif isinstance(v, tuple):
                out.append(f"{f.name} = [{', '.join(_toml_str(x) if isinstance(x, str) else str(x) for x in v)}]")
            elif isinstance(v, str):
                out.append(f"{f.name} = {_toml_str(v)}")
            else:
                out.append(f"{f.name} = {v}")
        return "\n".join(out) + "\n"


def _toml_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


FIELDS = {f.name: f for f in fields(DaemonConfig)}


def _convert(name: str, value: object) -> object:
    f = FIELDS[name]
    parse = f.metadata.get("parse")
    try:
        if parse is not None:
            return parse(value)
        if isinstance(value, (list, dict)):
            raise InterfaceError(f"{name} is a single value, got {value!r}")
        return str(value)
    except InterfaceError:
        raise
    except (TypeError, ValueError) as exc:
        raise InterfaceError(f"bad value for {name}: {value!r} ({exc})") from None


def load_config(path: str | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, object] | None = None) -> DaemonConfig:
    """Build the config: defaults, then the TOML file, then ``STATESTORE_*`` env, then overrides."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}  # setting -> its parsed value, of the type of its field
    path = path or env.get("STATESTORE_CONFIG") or None
    if path:
        try:
            with open(path, "rb") as fh:
                raw = tomllib.load(fh)
        except OSError as exc:
            raise InterfaceError(f"cannot read config file {path}: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise InterfaceError(f"config file {path} is not valid TOML: {exc}") from None
        unknown = sorted(set(raw) - set(FIELDS))
        if unknown:
            raise InterfaceError(f"config file {path}: unknown settings {unknown}")
        values.update({k: _convert(k, v) for k, v in raw.items()})
    for name in FIELDS:
        var = "STATESTORE_" + name.upper()
        if var in env:
            values[name] = _convert(name, env[var])
    for name, v in (overrides or {}).items():
        if name not in FIELDS:
            raise InterfaceError(f"unknown setting {name!r}")
        if v is not None:
            values[name] = _convert(name, v)
    return dataclasses.replace(DaemonConfig(), **values)
