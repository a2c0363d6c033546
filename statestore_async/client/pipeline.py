"""The sans-IO half of a batch operation, shared by both clients.

``batch_frames`` / ``column_frames`` turn one batch into requests within the daemon's limits (one
request in the common case; runs of at most ``max_batch`` items and ``budget`` bytes otherwise).
``pipeline`` says in which order to send those requests and wait for their answers (at most
``max_inflight`` unanswered); each client drives it with its own IO (a blocking socket, asyncio).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass
from itertools import chain
from typing import Any

from statestore_async.client.common import BatchRequest, ColumnsRequest, Frame
from statestore_async.codecs.framing import HEADER_SIZE
from statestore_async.wire.protocol import ClientProtocol, ConnectionLostError, LimitExceededError

_FRAME_SLACK = 64
_BATCH_HEAD = HEADER_SIZE + 4  # frame header + handle, before the list a batch request carries


class Limits:
    """The daemon's limits from its HELLO answer, as the clients use them."""

    def __init__(self, limits: dict[str, Any]):
        self.max_batch = int(limits.get("max_batch", 100_000))
        self.max_inflight = max(1, int(limits.get("max_inflight", 64)))
        self.budget = int(limits.get("max_frame_bytes", 64 << 20)) - _FRAME_SLACK


# --- one batch → its requests ---------------------------------------------------------------------------
def split(items: list[Any], max_batch: int, budget: int, pairs: bool) -> list[list[Any]]:
    """Cut ``items`` (keys, or (key, value) pairs) into runs of at most ``max_batch`` items and
    ``budget`` encoded bytes.

    Runs of ``max_batch`` items are sized at C speed (``sum(map(len, ...))``); only a run over the
    byte budget is cut item by item."""
    n = len(items)
    per_item = 8 if pairs else 4
    out: list[list[Any]] = []
    for start in range(0, n, max_batch) if n > max_batch else (0,):
        run = items[start:start + max_batch] if n > max_batch else items
        flat = chain.from_iterable(run) if pairs else run
        if 4 + per_item * len(run) + sum(map(len, flat)) <= budget:
            out.append(run)
        else:
            out.extend(_split_bytes(run, budget, per_item, pairs))
    return out


def _split_bytes(items: list[Any], budget: int, per_item: int, pairs: bool) -> list[list[Any]]:
    """Cut a run of items into runs of at most ``budget`` encoded bytes, item by item."""
    out: list[list[Any]] = []
    cur: list[Any] = []
    cur_bytes = 4
    for x in items:
        s = (len(x[0]) + len(x[1]) if pairs else len(x)) + per_item
        if s + 4 > budget:
            raise LimitExceededError(f"one item of {s} bytes does not fit in a frame of {budget} bytes")
        if cur and cur_bytes + s > budget:
            out.append(cur)
            cur, cur_bytes = [], 4
        cur.append(x)
        cur_bytes += s
    if cur or not out:
        out.append(cur)
    return out


def batch_frames(proto: ClientProtocol, limits: Limits, encode: BatchRequest, handle: int, items: list[Any],
                 pairs: bool) -> Frame | Iterator[Frame]:
    """The request of one batch operation when it fits the daemon's limits (the common case: the
    frame is encoded once, its size checked after); else an iterator of the requests of the runs of
    ``split``, each encoded only when the pipeline takes it.

    An item that fits in no frame raises ``LimitExceededError`` before any request is sent."""
    if len(items) <= limits.max_batch:
        rid, data = encode(proto, handle, items)
        if len(data) - _BATCH_HEAD <= limits.budget:
            return rid, data
        proto.forget(rid)
    runs = split(items, limits.max_batch, limits.budget, pairs)
    return (encode(proto, handle, run) for run in runs)


def column_frames(proto: ClientProtocol, limits: Limits, encode: ColumnsRequest, handle: int, n: int,
                  cols: tuple[Any, ...]) -> list[Frame]:
    """The requests of a batch given as Arrow-layout columns: runs of at most ``max_batch`` items,
    halved until each frame fits the budget. All are encoded here, before any is sent."""
    todo = [(s, min(limits.max_batch, n - s)) for s in range(0, n, limits.max_batch)] or [(0, 0)]
    todo.reverse()
    out: list[Frame] = []
    try:
        while todo:
            start, count = todo.pop()
            rid, data = encode(proto, handle, count, *[(o, d, first + start, w) for o, d, first, w in cols])
            if len(data) - _BATCH_HEAD <= limits.budget:
                out.append((rid, data))
                continue
            proto.forget(rid)
            if count <= 1:
                raise LimitExceededError(f"one item of {len(data) - _BATCH_HEAD} bytes does not fit in a frame of "
                                         f"{limits.budget} bytes")
            todo += [(start + count // 2, count - count // 2), (start, count // 2)]
    except BaseException:
        for rid, _ in out:
            proto.forget(rid)
        raise
    return out


# --- its requests → sends and waits ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Send:
    """Send request ``rid`` (its bytes ``data``), then resume the pipeline with None.

    ``answers_due``: earlier requests are unanswered. The daemon stops reading a connection whose
    answers are not being read, so a blocking sender must then keep reading while it sends."""

    rid: int
    data: bytes
    answers_due: bool


@dataclass(frozen=True, slots=True)
class Await:
    """Wait for the answer to request ``rid``, then resume the pipeline with its value (``send``),
    or with its error (``throw``)."""

    rid: int


Step = Send | Await


def pipeline(frames: Iterable[Frame], window: int) -> Generator[Step, Any, list[Any]]:
    """The steps that pipeline ``frames`` (at most ``window`` unanswered), sending each as late as
    the window allows; returns the answers in request order.

    An error answer does not stop it: the other answers are still read, then the first error is
    raised. A ``ConnectionLostError`` thrown in (connection gone, or a request timed out) is raised
    at once; the driver then owns whatever was sent and not answered."""
    todo = iter(frames)
    unanswered: deque[int] = deque()
    answers: list[Any] = []
    first_error: Exception | None = None
    more = True
    while True:
        while more and len(unanswered) < window:
            frame = next(todo, None)
            if frame is None:
                more = False
                break
            yield Send(frame[0], frame[1], bool(unanswered))
            unanswered.append(frame[0])
        if not unanswered:
            break
        try:
            answers.append((yield Await(unanswered.popleft())))
        except ConnectionLostError:
            raise
        except Exception as exc:
            if first_error is None:
                first_error = exc
            answers.append(None)
    if first_error is not None:
        raise first_error
    return answers
