"""Packed byte lists and pairs: a validated batch payload seen as a read-only sequence.

The batch calls' payloads (``framing.encode_list`` / ``encode_pairs``) stay packed from the socket
to the engine: the daemon validates a request's payload once and hands the engine a ``PackedList``
or ``PackedPairs``, which the engine's compiled routines read straight into its maps. Nothing here
knows about frames or the protocol.
"""
from __future__ import annotations

from statestore_async.codecs.framing import decode_list, decode_pairs


class _Packed:
    """A validated payload (``buf`` from ``offset`` to its end) seen as a read-only sequence.

    ``len()`` is free; the items are decoded on first use only. Equal to a list of the same items.
    """

    __slots__ = ("_items", "buf", "count", "offset")
    _decode = None

    def __init__(self, buf, offset: int, count: int):
        self.buf = buf
        self.offset = offset
        self.count = count
        self._items = None

    @property
    def items(self) -> list:
        if self._items is None:
            self._items = type(self)._decode(self.buf, self.offset)[0]
        return self._items

    def __len__(self) -> int:
        return self.count

    def __iter__(self):
        return iter(self.items)

    def __getitem__(self, i):
        return self.items[i]

    def __eq__(self, other):
        if isinstance(other, _Packed):
            other = other.items
        return self.items == other if isinstance(other, list) else NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.items!r})"


class PackedList(_Packed):
    """The byte strings of a validated ``encode_list`` payload."""

    __slots__ = ()
    _decode = staticmethod(decode_list)


class PackedPairs(_Packed):
    """The (key, value) pairs of a validated ``encode_pairs`` payload."""

    __slots__ = ()
    _decode = staticmethod(decode_pairs)
