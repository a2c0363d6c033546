"""Every error statestore_async raises, in one tree.

``StateStoreError`` is the root. Under it:

* ``InterfaceError`` — the API was used wrongly (bad state transition, bad argument);
* ``CodecError`` — bytes that cannot be encoded or decoded (``EncodeError``/``DecodeError``);
* ``CorruptFileError`` — a checkpoint file that fails its checks, naming the file;
* ``ObjectStoreError`` — the object store failed or refused (``ObjectNotFound``, ``ObjectExists``,
  ``ObjectStoreAccess``, …) or an upload failed for good (``UploadFailed``);
* ``VersionError`` — a version/checkpoint that does not exist or cannot be reached;
* ``ProtocolError`` and the other wire errors (codes 50–59) — a broken or refused connection,
  a limit exceeded, an unknown handle, a daemon shutting down.

Each class carries a stable numeric ``code`` so that the wire protocol can send it and the client
can raise the same class again (see ``error_for_code``).
"""
from __future__ import annotations

_BY_CODE: dict[int, type[StateStoreError]] = {}


class StateStoreError(Exception):
    """Root of every statestore_async error."""

    code = 1
    # set on an error decoded from a peer's answer (``wire.protocol.decode_error``): the wire code
    remote_code: int

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "code" in cls.__dict__:
            other = _BY_CODE.get(cls.code)
            if other is not None and other is not cls:
                raise RuntimeError(f"error code {cls.code} used by {other.__name__} and {cls.__name__}")
            _BY_CODE[cls.code] = cls


_BY_CODE[StateStoreError.code] = StateStoreError


def error_for_code(code: int) -> type[StateStoreError]:
    """The error class registered for a wire code (the root class for an unknown code)."""
    return _BY_CODE.get(code, StateStoreError)


# --- misuse of the API -------------------------------------------------------------------------
class InterfaceError(StateStoreError):
    """The API was called in a way its contract does not allow."""

    code = 10


class StoreStateError(InterfaceError):
    """An operation that the store's state forbids (e.g. put after commit)."""

    code = 11


class StoreBrokenError(StateStoreError):
    """A commit's changes, or a switch to another version, failed part-way in memory (the daemon ran
    out of memory for the store's map): the map is neither the old state nor the new one. The store
    refuses every later request; the daemon drops it from memory, and the next open of a version a
    manifest names loads it again from its files. The version whose changes failed is not durable."""

    code = 18


class VersionIdleTimeoutError(StoreStateError):
    """The daemon aborted an open version that had no request for ``open_version_idle_timeout``
    seconds: its changes are gone and its store's writer slot is free; open the store again."""

    code = 17


class WriterConflictError(InterfaceError):
    """A second writer tried to open a store version that already has one."""

    code = 12


class OwnerConflictError(WriterConflictError):
    """An operator's state is owned by another writer (a streaming query): one writer per state.
    Raised before anything is written; the message names the owner and how to take over from a
    writer known to be dead."""

    code = 19


class KeyFormatError(InterfaceError):
    """A key that does not follow the store key layout (see ``statestore_async.codecs.keylayout``)."""

    code = 13


class OutputRowError(InterfaceError):
    """A processor's output row that does not fit the operator's output schema (wrong shape, a
    value of another type, a fraction or a number out of range for an integer column); the message
    names the column, the grouping key and the value."""

    code = 14


class StateDeclarationError(InterfaceError):
    """A state variable declared with another kind or TTL setting than the one its stored values
    were written with (the operator records each variable's declaration)."""

    code = 15


class SocketPathError(InterfaceError):
    """A daemon socket path that cannot hold a socket (too long, a file or folder is there, a
    parent is not a folder); the message names the path and how to fix it."""

    code = 16


# --- codecs --------------------------------------------------------------------------------------
class CodecError(StateStoreError, ValueError):
    """Bytes or values that a codec cannot handle."""

    code = 20


class EncodeError(CodecError):
    """A value that cannot be encoded (unsupported type, too deep, unencodable string)."""

    code = 21


class DecodeError(CodecError):
    """Bytes that are not a valid encoding (truncated, unknown tag, trailing bytes, …)."""

    code = 22


class CorruptBlockError(DecodeError):
    """A record block whose checksum, lengths or records do not check out."""

    code = 23


class CorruptFileError(DecodeError):
    """A checkpoint or manifest file that fails its checks. ``name`` says which file."""

    code = 24

    def __init__(self, name: str, reason: str, offset: int | None = None):
        self.name = name
        self.reason = reason
        self.offset = offset
        where = f" at byte {offset}" if offset is not None else ""
        super().__init__(f"corrupt checkpoint file {name!r}{where}: {reason}")

    def __reduce__(self) -> tuple[type[CorruptFileError], tuple[str, str, int | None]]:
        return (type(self), (self.name, self.reason, self.offset))


# --- versions ------------------------------------------------------------------------------------
class VersionError(StateStoreError):
    """A version or checkpoint that cannot be reached."""

    code = 30


class VersionNotFoundError(VersionError):
    """No committed (version, checkpoint id) of this store is known in memory or in files."""

    code = 31


class LineageError(VersionError):
    """Checkpoint files whose lineages do not link up."""

    code = 32


# --- object store --------------------------------------------------------------------------------
class ObjectStoreError(StateStoreError):
    """The object store failed; ``key`` names the object when known."""

    code = 40

    def __init__(self, message: str, key: str | None = None):
        self.key = key
        super().__init__(message)

    def __reduce__(self) -> tuple[type[ObjectStoreError], tuple[str, str | None]]:
        return (type(self), (self.args[0] if self.args else "", self.key))


class ObjectNotFoundError(ObjectStoreError):
    """The object does not exist."""

    code = 41


class ObjectExistsError(ObjectStoreError):
    """put_if_absent found the name taken: nothing was written."""

    code = 42


class CheckpointConflictError(ObjectExistsError):
    """A checkpoint file's name is taken by a file with other content: nothing was written.

    A retried upload whose first answer was lost finds its own bytes there and succeeds; this is
    raised only when the bytes differ, which means two writers used one checkpoint id.
    """

    code = 47


class StorageFullError(ObjectStoreError):
    """The storage has no room (ENOSPC/EDQUOT): nothing was written."""

    code = 43


class ObjectStoreUnavailableError(ObjectStoreError):
    """The object store could not be reached or kept failing after retries."""

    code = 44


class ObjectStoreAccessError(ObjectStoreError):
    """The object store refuses this daemon's requests for a reason retrying does not heal by
    itself: access denied, an unknown access key, a bad signature (a wrong secret key), no
    credentials, a missing bucket, a read-only folder. An operator must fix the configuration;
    the daemon reports itself degraded meanwhile (see docs/GUARANTEES.md)."""

    code = 45


class UploadFailedError(ObjectStoreError):
    """A checkpoint will not become durable: the upload of the file ``key`` names failed for good
    (a checkpoint whose lineage needs that file cannot be loaded either), or the daemon stopped
    before uploading it."""

    code = 46


# --- the wire protocol ---------------------------------------------------------------------------
class ProtocolError(StateStoreError):
    """The peer broke the protocol (bad frame, bad handshake, unexpected answer)."""

    code = 50


class FrameTooLargeError(ProtocolError):
    """A frame longer than the connection's limit; the connection is closed after it."""

    code = 51


class UnsupportedVersionError(ProtocolError):
    """HELLO offered no protocol version this side speaks."""

    code = 52


class UnknownOpcodeError(ProtocolError):
    """A request with an opcode (or flags) this side does not know."""

    code = 53


class HandshakeRequiredError(ProtocolError):
    """A request before a successful HELLO."""

    code = 54


class LimitExceededError(InterfaceError):
    """A request over a configured limit (batch size, frame size); nothing was applied."""

    code = 55


class PermissionDeniedError(StateStoreError):
    """The peer's uid is not on the daemon's allow-list."""

    code = 56


class UnknownHandleError(InterfaceError):
    """A handle this connection never opened, or already committed/aborted."""

    code = 57


class ConnectionLostError(ProtocolError):
    """The connection closed before the answer came."""

    code = 58


class ShuttingDownError(StateStoreError):
    """The daemon is stopping and takes no new work."""

    code = 59


class RetriesExhaustedError(ConnectionLostError):
    """The connection to the daemon was lost on every one of a bounded number of tries (each
    reconnected, restarting the daemon when needed); the last loss is the ``__cause__``."""

    code = 60


# --- added for issue 40 (roots, bounded waits, partial frames) ------------------------------------
class RootError(InterfaceError):
    """A checkpoint root that is not an object-store location the daemon accepts: empty, relative,
    with ``.`` or ``..`` segments, of an unknown scheme, or a ``file://`` URI naming another host.
    The message names the root and the form to use."""

    code = 70


class RootNotAllowedError(RootError):
    """A well-formed checkpoint root outside the daemon's ``allowed_roots``."""

    code = 71


class OpenTimeoutError(StateStoreError):
    """An OPEN that had to wait (for its store's earlier uploads to settle) waited longer than the
    daemon's ``open_wait_timeout``; the message says what it waited for and the last upload error."""

    code = 72


class FrameBudgetError(ProtocolError):
    """A request frame the daemon cannot buffer: the partial frames of all connections share one
    byte budget (``partial_frames_bytes``), and this frame is larger than it, or waited too long
    for room in it. The connection is closed (the stream cannot be resynchronised)."""

    code = 73
