"""Packed byte lists and pairs: a validated batch payload seen as a read-only sequence.

The batch calls' payloads (``framing.encode_list`` / ``encode_pairs``) stay packed from the socket
to the engine: the daemon validates a request's payload once and hands the engine a ``PackedList``
or ``PackedPairs``, which the engine's compiled routines read straight into its maps. Nothing here
knows about frames or the protocol.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Generic, TypeVar, overload

from statestore_async.codecs.framing import decode_list, decode_pairs

if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any, ClassVar, SupportsIndex

    from statestore_async._ref import Buffer

_T = TypeVar("_T")


class _Packed(Generic[_T]):
    """A validated payload (``buf`` from ``offset`` to its end) seen as a read-only sequence.

    ``len()`` is free; the items are decoded on first use only. Equal to a list of the same items.
    """

    __slots__ = ("_items", "buf", "count", "offset")
    #: ``framing.decode_list`` or ``decode_pairs``, set by each subclass
    _decode: ClassVar[staticmethod[[Buffer, int], tuple[list[Any], int]]] = None  # type: ignore[assignment]

    def __init__(self, buf: Buffer, offset: int, count: int) -> None:
        self.buf = buf
        self.offset = offset
        self.count = count
        self._items: list[_T] | None = None

    @property
    def items(self) -> list[_T]:
        if self._items is None:
            self._items = type(self)._decode(self.buf, self.offset)[0]
        return self._items

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[_T]:
        return iter(self.items)

    @overload
    def __getitem__(self, i: SupportsIndex) -> _T: ...
    @overload
    def __getitem__(self, i: slice) -> list[_T]: ...

    def __getitem__(self, i: SupportsIndex | slice) -> _T | list[_T]:
        return self.items[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _Packed):
            other = other.items
        return self.items == other if isinstance(other, list) else NotImplemented

    __hash__ = None  # type: ignore[assignment]  # unhashable, like a list

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.items!r})"


class PackedList(_Packed[bytes]):
    """The byte strings of a validated ``encode_list`` payload."""

    __slots__ = ()
    _decode = staticmethod(decode_list)


class PackedPairs(_Packed[tuple[bytes, bytes]]):
    """The (key, value) pairs of a validated ``encode_pairs`` payload."""

    __slots__ = ()
    _decode = staticmethod(decode_pairs)
