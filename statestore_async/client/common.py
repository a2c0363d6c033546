"""What both clients share: how a request is given to them, the default timeout and its error.

A request is a function of the connection's ``ClientProtocol`` that encodes it and returns
``(request id, bytes)``, as every ``ClientProtocol.send_*`` does::

    client.call(lambda p: p.send_commit(handle, ckptid))                           # Request
    client.call_batch(ClientProtocol.send_put_many, handle, items, pairs=True, ...)  # BatchRequest

The client calls it with the protocol of the connection it is about to send on.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from statestore_async.wire.protocol import ClientProtocol, ConnectionLostError

DEFAULT_TIMEOUT = 60.0

Frame = tuple[int, bytes]
"""(request id, the request's bytes): what a ``ClientProtocol.send_*`` returns."""

Request = Callable[[ClientProtocol], Frame]
"""One request, e.g. ``lambda p: p.send_ping(payload)``."""

BatchRequest = Callable[[ClientProtocol, int, list[Any]], Frame]
"""A batch request of ``(handle, items)``: ``ClientProtocol.send_get_many`` / ``send_put_many`` /
``send_remove_many``. Called once per request when the batch is split."""

ColumnsRequest = Callable[..., Frame]
"""A batch request of ``(handle, n, *columns)`` (Arrow layout, see ``codecs.arrowframes``):
``ClientProtocol.send_get_many_buffers`` / ``send_put_many_buffers`` / ``send_remove_many_buffers``."""


class RequestTimeoutError(ConnectionLostError):
    """No answer within the client's timeout (the connection is closed: the daemon aborts its versions)."""


def scan_ranges_request(handle: int, ranges: tuple[tuple[bytes, bytes | None], ...], limit: int | None) -> Request:
    """The SCAN_RANGES request of ``ranges`` (checked already) for both clients' ``scan_ranges``."""

    def encode(p: ClientProtocol) -> Frame:
        return p.send_checked_scan_ranges(handle, ranges, limit)

    return encode
