"""``S3ObjectStore``: the object-store contract on S3 (or any S3-compatible server) via aiobotocore.

- One aiobotocore session per process; one client per store, opened on first use and closed by
  ``close()`` (``async with`` does both).
- ``put_if_absent`` is a conditional PUT (``If-None-Match: *``): 412 → ``ObjectExistsError``;
  409 ``ConditionalRequestConflict`` (a concurrent conditional write in progress) is retried and
  then resolves to a winner or ``ObjectExistsError``. Large bodies go by multipart upload, the
  condition on ``CompleteMultipartUpload``; a multipart upload that fails or is cancelled is
  aborted. ``abort_incomplete_uploads(prefix)`` aborts what a killed process left under a prefix.
- Credentials come from the standard AWS chain (env, profile, web identity/IRSA, instance role)
  unless given explicitly; endpoint and region from options or the chain.
- Throttling, 5xx and connection errors are retried by botocore's retry mode; what still fails
  raises ``ObjectStoreUnavailableError``. A refusal that retrying does not heal (access denied, an
  unknown key id, a bad signature, no credentials, a missing bucket) raises
  ``ObjectStoreAccessError``.
- Optional server-side encryption: ``sse="AES256"`` or ``sse="aws:kms"`` with ``kms_key_id``.
"""
from __future__ import annotations

import asyncio
import contextlib
import io
import logging
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import urlparse

from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    CredentialRetrievalError,
    EndpointConnectionError,
    NoCredentialsError,
    PartialCredentialsError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)
from botocore.utils import parse_timestamp

from statestore_async.errors import (
    InterfaceError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectStoreAccessError,
    ObjectStoreError,
    ObjectStoreUnavailableError,
)
from statestore_async.objectstore.base import ObjectInfo, ObjectStore, check_key

log = logging.getLogger(__name__)

_SESSION: Any = None  # an aiobotocore AioSession (untyped)
_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
_EXISTS = {"PreconditionFailed", "412"}
_CONFLICT = {"ConditionalRequestConflict", "409"}
# refusals that retrying does not heal: the credentials, the permissions or the bucket are wrong
_ACCESS = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled", "InvalidToken",
           "ExpiredToken", "TokenRefreshRequired", "AccountProblem", "InvalidBucketName", "403"}
_NO_UPLOAD = {"NoSuchUpload"}
# seconds a cancelled upload still waits for its CreateMultipartUpload answer, to abort what it created
CANCELLED_CREATE_WAIT = 30.0
MIN_PART = 5 << 20


STREAM_BODY_BYTES = 1 << 20


class _MemoryReader(io.RawIOBase):
    """A seekable read-only file over a bytes-like object, for large request bodies.

    Given bytes, botocore and aiohttp end up copying the whole body in one go on the event loop
    (a BytesIO's buffer is unshared: ~2-3 ms for a 10 MB snapshot). A file is streamed instead;
    botocore seeks it back for a retry. A read gives at most ``READ_CHUNK`` bytes whatever it asks
    for: aiohttp asks for 1 MiB at a time and hands each to the socket in one write, which on
    loopback held the event loop ~0.5 ms per MiB, back to back (a 5 ms stall seen mid-COMMIT).
    """

    READ_CHUNK = 256 << 10

    def __init__(self, data: bytes | memoryview) -> None:
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:  # a bytearray or writable memoryview
        n = max(0, min(len(buffer), self.READ_CHUNK, len(self._view) - self._pos))
        buffer[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def __len__(self) -> int:
        return len(self._view)


def _body(data: bytes | memoryview) -> _MemoryReader | bytes:
    return _MemoryReader(data) if len(data) >= STREAM_BODY_BYTES else bytes(data)


def _parse_timestamp(value: Any) -> datetime:
    """S3 timestamps (ISO 8601 in XML bodies, RFC 1123 in headers) with the standard library's C
    parsers. botocore's default goes through dateutil at ~70 µs each: a LIST page of a hundred
    objects held the daemon's event loop for ~10 ms on timestamps alone."""
    if isinstance(value, str):
        try:
            t = datetime.fromisoformat(value)
            return t if t.tzinfo is not None else t.replace(tzinfo=UTC)
        except ValueError:
            pass
        try:
            return parsedate_to_datetime(value)
        except (TypeError, ValueError):
            pass
    parsed: datetime = parse_timestamp(value)
    return parsed


def _session() -> Any:
    global _SESSION
    if _SESSION is None:
        _SESSION = get_session()
        _SESSION.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=_parse_timestamp)
    return _SESSION


async def warm_up() -> None:
    """Create and close one S3 client, so botocore loads its models (~0.1 s of CPU) now — at
    daemon start — and not inside the event loop on the first upload. No request is sent."""
    async with _session().create_client("s3", region_name="us-east-1", endpoint_url="http://127.0.0.1:9",
                                        aws_access_key_id="warm-up", aws_secret_access_key="warm-up"):
        pass


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", "")) or str(
        exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")
    )


class S3ObjectStore(ObjectStore):
    """An object store over ``s3://bucket/prefix``."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        aws_access_key_id: str | None = None,
        aws_secret_access_key: str | None = None,
        aws_session_token: str | None = None,
        sse: str | None = None,
        kms_key_id: str | None = None,
        addressing_style: str = "auto",
        retry_mode: str = "standard",
        max_attempts: int = 8,
        connect_timeout: float = 5.0,
        read_timeout: float = 30.0,
        max_pool_connections: int = 32,
        multipart_threshold: int = 64 << 20,
        part_size: int = 16 << 20,
        conflict_retries: int = 5,
    ):
        if not bucket:
            raise InterfaceError("an S3 object store needs a bucket")
        if sse not in (None, "", "AES256", "aws:kms"):
            raise InterfaceError(f"sse must be AES256 or aws:kms, got {sse!r}")
        if part_size < MIN_PART:
            raise InterfaceError(f"S3 parts are at least {MIN_PART} bytes")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._client_args: dict[str, Any] = {
            "endpoint_url": endpoint_url or None,
            "region_name": region or None,
            "aws_access_key_id": aws_access_key_id,
            "aws_secret_access_key": aws_secret_access_key,
            "aws_session_token": aws_session_token,
            "config": AioConfig(
                retries={"mode": retry_mode, "max_attempts": max_attempts},
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                max_pool_connections=max_pool_connections,
                # Bodies are sent as UNSIGNED-PAYLOAD with no extra transport checksum: headers stay
                # signed, TLS protects the body in transit, and every checkpoint file carries xxh3
                # checksums that each reader verifies. Hashing multi-MB snapshot bodies (SHA-256 or
                # CRC) would otherwise take milliseconds of the daemon's event loop per request.
                s3={"addressing_style": addressing_style, "payload_signing_enabled": False},
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        }
        self._sse: dict[str, str] = {}
        if sse:
            self._sse["ServerSideEncryption"] = sse
            if sse == "aws:kms" and kms_key_id:
                self._sse["SSEKMSKeyId"] = kms_key_id
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        self.conflict_retries = conflict_retries
        self.counts: Counter[str] = Counter()  # requests by kind: PUT, GET, HEAD, LIST, DELETE, MPU
        self._stack: contextlib.AsyncExitStack | None = None
        self._client: Any = None  # an aiobotocore S3 client, opened on first use
        self._lock = asyncio.Lock()
        self._closed = False

    @classmethod
    def from_uri(cls, uri: str, **options: Any) -> S3ObjectStore:
        p = urlparse(uri)
        if p.scheme != "s3" or not p.netloc:
            raise InterfaceError(f"not an s3://bucket/prefix URI: {uri!r}")
        return cls(p.netloc, p.path, **options)

    async def _get_client(self) -> Any:
        if self._closed:
            raise InterfaceError("the object store is closed")
        if self._client is None:
            async with self._lock:
                if self._client is None:
                    stack = contextlib.AsyncExitStack()
                    self._client = await stack.enter_async_context(_session().create_client("s3", **self._client_args))
                    self._stack = stack
        return self._client

    def _full(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _rel(self, full: str) -> str:
        return full[len(self.prefix) + 1 :] if self.prefix else full

    def _error(self, exc: Exception, key: str | None, what: str) -> ObjectStoreError:
        if isinstance(exc, ClientError):
            code = _code(exc)
            if code in _NOT_FOUND:
                return ObjectNotFoundError(f"object {key!r} not found in {self.uri}", key)
            if code == "NoSuchBucket":
                return ObjectStoreAccessError(f"bucket {self.bucket!r} does not exist ({what} {key!r})", key)
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code in _ACCESS or status == 403:
                return ObjectStoreAccessError(f"S3 refused to {what} {key!r} in {self.uri}: {code} "
                                              f"({exc.response.get('Error', {}).get('Message', '')})", key)
            if code in ("SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout") or status >= 500:
                return ObjectStoreUnavailableError(f"S3 kept failing to {what} {key!r}: {code}", key)
            return ObjectStoreError(f"S3 refused to {what} {key!r}: {code} {exc}", key)
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
            return ObjectStoreAccessError(f"no AWS credentials found to {what} {key!r}: {exc}", key)
        if isinstance(exc, CredentialRetrievalError):
            return ObjectStoreAccessError(f"cannot get AWS credentials to {what} {key!r}: {exc}", key)
        if isinstance(exc, (EndpointConnectionError, BotoConnectionError, OSError, asyncio.TimeoutError)):
            return ObjectStoreUnavailableError(f"S3 unreachable to {what} {key!r}: {exc}", key)
        return ObjectStoreError(f"cannot {what} {key!r}: {exc}", key)

    # --- writes ----------------------------------------------------------------------------------
    async def _put_object(self, key: str, data: bytes, conditional: bool) -> ObjectInfo:
        client = await self._get_client()
        full = self._full(key)
        extra = dict(self._sse)
        if conditional:
            extra["IfNoneMatch"] = "*"
        if len(data) >= self.multipart_threshold:
            return await self._multipart(client, key, full, data, extra)
        attempt = 0
        while True:
            try:
                self.counts["PUT"] += 1
                resp = await client.put_object(Bucket=self.bucket, Key=full, Body=_body(data), **extra)
                return ObjectInfo(key, len(data), resp.get("ETag", "").strip('"') or None)
            except ClientError as exc:
                code = _code(exc)
                if conditional and code in _EXISTS:
                    raise ObjectExistsError(f"object {key!r} exists already in {self.uri}", key) from None
                if conditional and code in _CONFLICT and attempt < self.conflict_retries:
                    attempt += 1
                    await asyncio.sleep(0.05 * 2**attempt)
                    continue
                raise self._error(exc, key, "write") from exc
            except (TimeoutError, BotoCoreError, OSError) as exc:
                raise self._error(exc, key, "write") from exc

    async def _multipart(self, client: Any, key: str, full: str, data: bytes, extra: dict[str, str]) -> ObjectInfo:
        create_extra = {k: v for k, v in extra.items() if k != "IfNoneMatch"}
        self.counts["MPU"] += 1
        create = asyncio.ensure_future(client.create_multipart_upload(Bucket=self.bucket, Key=full, **create_extra))
        try:
            up = await asyncio.shield(create)
        except asyncio.CancelledError:
            # cancelled while the request was on its way: the upload may exist already. Learn its
            # id (bounded), abort it, then give in to the cancellation.
            try:
                up = await asyncio.wait_for(create, CANCELLED_CREATE_WAIT)
            except BaseException:
                create.cancel()
                raise asyncio.CancelledError from None
            await self._abort_upload(client, key, full, up["UploadId"])
            raise
        except (ClientError, BotoCoreError, OSError) as exc:
            raise self._error(exc, key, "start a multipart upload of") from exc
        upload_id = up["UploadId"]
        view = memoryview(data)
        try:
            parts = []
            for i, start in enumerate(range(0, len(view), self.part_size), start=1):
                self.counts["PUT"] += 1
                r = await client.upload_part(Bucket=self.bucket, Key=full, UploadId=upload_id, PartNumber=i,
                                             Body=_body(view[start : start + self.part_size]))
                parts.append({"ETag": r["ETag"], "PartNumber": i})
            complete = {"IfNoneMatch": "*"} if "IfNoneMatch" in extra else {}
            resp = await client.complete_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id,
                                                          MultipartUpload={"Parts": parts}, **complete)
            return ObjectInfo(key, len(data), resp.get("ETag", "").strip('"') or None)
        except BaseException as exc:
            # never leave the parts behind (a cancelled upload too: the daemon's drain timed out);
            # after a CompleteMultipartUpload whose answer was lost this is a no-op (NoSuchUpload)
            await self._abort_upload(client, key, full, upload_id)
            if isinstance(exc, ClientError) and "IfNoneMatch" in extra and _code(exc) in _EXISTS:
                raise ObjectExistsError(f"object {key!r} exists already in {self.uri}", key) from None
            if isinstance(exc, (ClientError, BotoCoreError, OSError)):
                raise self._error(exc, key, "write") from exc
            raise

    async def _abort_upload(self, client: Any, key: str, full: str, upload_id: str) -> bool:
        """Abort one multipart upload; True if aborted, False if it was gone or the abort failed
        (logged: a bucket lifecycle rule removes what is left, see docs/GUARANTEES.md)."""
        self.counts["MPU_ABORT"] += 1
        try:
            await client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
            return True
        except ClientError as exc:
            if _code(exc) in _NO_UPLOAD or _code(exc) in _NOT_FOUND:
                return False
            log.warning("cannot abort the multipart upload %s of %r in %s: %s", upload_id, key, self.uri, exc)
        except (TimeoutError, BotoCoreError, OSError) as exc:
            log.warning("cannot abort the multipart upload %s of %r in %s: %s", upload_id, key, self.uri, exc)
        return False

    async def abort_incomplete_uploads(self, prefix: str) -> int:
        """Abort every incomplete multipart upload of a key under ``prefix`` (what a process
        killed in the middle of one left behind: S3 keeps, and bills, its parts until aborted).
        Returns how many were aborted. Aborting another live writer's upload makes its
        ``CompleteMultipartUpload`` fail; the daemon's uploader retries such a failure."""
        client = await self._get_client()
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        found: list[tuple[str, str]] = []
        paginator = client.get_paginator("list_multipart_uploads")
        try:
            async for page in paginator.paginate(Bucket=self.bucket, Prefix=full):
                self.counts["LIST"] += 1
                found.extend((u["Key"], u["UploadId"]) for u in page.get("Uploads", []) or [])
        except (TimeoutError, ClientError, BotoCoreError, OSError) as exc:
            raise self._error(exc, prefix, "list the multipart uploads under") from exc
        aborted = 0
        for full_key, upload_id in found:
            if await self._abort_upload(client, self._rel(full_key), full_key, upload_id):
                aborted += 1
                log.info("aborted the incomplete multipart upload %s of %r in %s", upload_id,
                         self._rel(full_key), self.uri)
        return aborted

    async def put_if_absent(self, key: str, data: bytes) -> ObjectInfo:
        return await self._put_object(key, data, conditional=True)

    async def put(self, key: str, data: bytes) -> ObjectInfo:
        return await self._put_object(key, data, conditional=False)

    # --- reads -----------------------------------------------------------------------------------
    async def _get_response(self, key: str, start: int | None, end: int | None) -> Any:
        client = await self._get_client()
        args = {"Bucket": self.bucket, "Key": self._full(key)}
        if start is not None or end is not None:
            if end is not None and end <= (start or 0):
                return None
            args["Range"] = f"bytes={start or 0}-{'' if end is None else end - 1}"
        self.counts["GET"] += 1
        try:
            return await client.get_object(**args)
        except ClientError as exc:
            if _code(exc) in ("InvalidRange", "416"):
                return None
            raise self._error(exc, key, "read") from exc
        except (TimeoutError, BotoCoreError, OSError) as exc:
            raise self._error(exc, key, "read") from exc

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        resp = await self._get_response(key, start, end)
        if resp is None:
            return b""
        try:
            async with resp["Body"] as body:
                data: bytes = await body.read()
                return data
        except (TimeoutError, BotoCoreError, OSError) as exc:
            raise self._error(exc, key, "read") from exc

    async def get_stream(self, key: str, chunk_size: int = 1 << 20) -> AsyncIterator[bytes]:
        resp = await self._get_response(key, None, None)
        if resp is None:
            return
        try:
            async with resp["Body"] as body:
                async for chunk in body.iter_chunks(chunk_size):
                    yield chunk
        except (TimeoutError, BotoCoreError, OSError) as exc:
            raise self._error(exc, key, "read") from exc

    async def head(self, key: str) -> ObjectInfo:
        client = await self._get_client()
        self.counts["HEAD"] += 1
        try:
            r = await client.head_object(Bucket=self.bucket, Key=self._full(key))
        except (TimeoutError, ClientError, BotoCoreError, OSError) as exc:
            raise self._error(exc, key, "stat") from exc
        mtime = r.get("LastModified")
        return ObjectInfo(key, r["ContentLength"], r.get("ETag", "").strip('"') or None,
                          mtime.timestamp() if mtime else None)

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        client = await self._get_client()
        full = (f"{self.prefix}/{prefix}" if self.prefix else prefix)
        paginator = client.get_paginator("list_objects_v2")
        try:
            async for page in paginator.paginate(Bucket=self.bucket, Prefix=full):
                self.counts["LIST"] += 1
                for o in page.get("Contents", []):
                    yield ObjectInfo(self._rel(o["Key"]), o["Size"], o.get("ETag", "").strip('"') or None,
                                     o["LastModified"].timestamp() if o.get("LastModified") else None)
        except (TimeoutError, ClientError, BotoCoreError, OSError) as exc:
            raise self._error(exc, prefix, "list") from exc

    async def delete(self, key: str) -> None:
        client = await self._get_client()
        self.counts["DELETE"] += 1
        try:
            await client.delete_object(Bucket=self.bucket, Key=self._full(key))
        except ClientError as exc:
            if _code(exc) in _NOT_FOUND:
                return
            raise self._error(exc, key, "delete") from exc
        except (TimeoutError, BotoCoreError, OSError) as exc:
            raise self._error(exc, key, "delete") from exc

    async def delete_many(self, keys: Iterable[str]) -> None:
        """One DeleteObjects request per 1000 keys (each S3 request costs the event loop ~1 ms of
        botocore; retention deletes ten files at a time)."""
        keys = list(keys)
        if not keys:
            return
        client = await self._get_client()
        for start in range(0, len(keys), 1000):
            chunk = keys[start : start + 1000]
            self.counts["DELETE"] += 1
            try:
                r = await client.delete_objects(Bucket=self.bucket, Delete={
                    "Objects": [{"Key": self._full(k)} for k in chunk], "Quiet": True})
            except (TimeoutError, ClientError, BotoCoreError, OSError) as exc:
                raise self._error(exc, chunk[0], "delete") from exc
            errors = [e for e in r.get("Errors", []) if e.get("Code") not in _NOT_FOUND]
            if errors:
                key = self._rel(errors[0].get("Key", ""))
                raise ObjectStoreError(f"S3 refused to delete {key!r} (and {len(errors) - 1} more): "
                                       f"{errors[0].get('Code')} {errors[0].get('Message', '')}", key)

    async def close(self) -> None:
        self._closed = True
        if self._stack is not None:
            stack, self._stack, self._client = self._stack, None, None
            await stack.aclose()
