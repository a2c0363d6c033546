"""The user API: ``StatefulProcessor`` (per key, plain Python values) and ``VectorizedProcessor`` (Arrow).

Per-key processors declare their state in ``init(handle)`` and get, for every grouping key of the
batch, its rows and its state::

    class RunningTotal(StatefulProcessor):
        def init(self, handle):
            self.total = handle.value_state("total")             # (count, sum)

        def handle_rows(self, key, rows, state):
            count, total = self.total.get() or (0, 0)
            count, total = count + len(rows), total + sum(r[0] for r in rows)
            self.total.update((count, total))
            yield (*key, count, total)

State variables are bound to the key being handled: inside ``handle_rows`` they read and write that
key's state (``state`` is the same set of variables by name: ``state.total`` / ``state["total"]``).
Values are plain Python values encoded with ``statestore_async.codecs.valuecodec`` (None, bool, int, float,
str, bytes, tuples, lists, dicts, dates, datetimes, Decimals); never a pandas object per key.

Storage of one state variable of one grouping key — one store record, so any access is O(1):

* key: ``key group (2 bytes) + valuecodec.encode_key((state_name, *grouping_key))``;
* value: ``valuecodec.encode_row(value)``; a ``ListState`` stores one list, a ``MapState`` one dict;
* with a TTL the value is ``encode_row((expires_at_ms, value))``: past its expiry it reads as absent
  and is removed by the first batch whose clock passes it (through an expiry index, ``state.keys``;
  or when a batch touches its key). An update refreshes the expiry. A list or map with a TTL has
  one expiry per entry: ``encode_row((latest expiry, [(expires_at_ms, value), ...]))`` or
  ``encode_row((latest expiry, {map key: (expires_at_ms, value)}))`` (``TTLListState``,
  ``TTLMapState``; declared with ``"ttl_entries"``). The clock is the
  driver's wall clock at the start of the batch (``batch_time_ms``), the same for every task of it.

A TTL has a unit: ``ttl=timedelta(minutes=1)``, ``ttl_seconds=60`` or ``ttl_ms=60_000`` (PySpark's
``TTLConfig`` takes milliseconds); a bare number (``ttl=60_000``) is refused. Declaring or dropping a
TTL changes the value layout, and so does changing a variable's kind: every task records its
declarations (``declarations``), the operator keeps them in the manifest's metadata
(``"states"``), and a task whose processor declares a recorded variable differently refuses to run
(``StateDeclarationError``, ``check_declarations``). Changing the length of a TTL is fine.

Timers (``handle.timers``, also ``state.timers``, bound to the current key like the variables):
``register(at_ms, kind=None)``, ``delete(at_ms, kind=None)``, ``list(kind=None)`` (sorted), where
``kind`` is ``"processing"`` or ``"event"`` and None means the operator's ``time_mode``. A processor
that uses timers defines ``handle_expired_timer(key, timer, state)``: it is called once per due
timer (``ExpiredTimer(at_ms, kind)``), after the batch's rows, in time order within the partition,
also for keys without rows; see ``docs/SPARK.md`` (Timers and TTL) and ``state.keys``.

Vectorized processors get a whole state partition at once (see ``VectorizedProcessor``).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

import pyarrow as pa

from statestore_async.errors import InterfaceError, StateDeclarationError
from statestore_async.ids import _check_name
from statestore_async.spark.api.timers import ExpiredTimer, Timers, VectorizedTimers
from statestore_async.spark.api.variables import (
    LIST,
    MAP,
    VALUE,
    VECTORIZED,
    Declaration,
    ListState,
    MapState,
    TTLListState,
    TTLMapState,
    ValueState,
    _StateVar,
    ttl_to_ms,
)


class StateHandle:
    """Given to ``StatefulProcessor.init``: declares the processor's state variables. Also holds the
    key-bound ``timers`` and the batch's clock values ``processing_time_ms`` (the batch's time,
    the same for every task of it) and ``watermark_ms`` (the event-time watermark the batch uses,
    None before there is one), set before every call."""

    def __init__(self, time_mode: str = "none", timers_enabled: bool = False):
        self.variables: dict[str, _StateVar] = {}
        self.timers = Timers(time_mode, timers_enabled)
        self.processing_time_ms: int = 0
        self.watermark_ms: int | None = None

    def _add(self, cls, name: str, ttl: timedelta | None, ttl_seconds: float | None, ttl_ms: int | None):
        _check_name("state name", name)
        if name in self.variables:
            raise InterfaceError(f"state {name!r} is declared twice")
        ms = ttl_to_ms(name, ttl, ttl_seconds, ttl_ms)
        if ms is not None:
            cls = {ListState: TTLListState, MapState: TTLMapState}.get(cls, cls)
        var = self.variables[name] = cls(name, ms)
        return var

    # A TTL: ``ttl=timedelta(...)``, ``ttl_seconds=`` or ``ttl_ms=`` (see ``ttl_to_ms``).
    def value_state(self, name: str, ttl: timedelta | None = None, *, ttl_seconds: float | None = None,
                    ttl_ms: int | None = None) -> ValueState:
        return self._add(ValueState, name, ttl, ttl_seconds, ttl_ms)

    def list_state(self, name: str, ttl: timedelta | None = None, *, ttl_seconds: float | None = None,
                   ttl_ms: int | None = None) -> ListState:
        return self._add(ListState, name, ttl, ttl_seconds, ttl_ms)

    def map_state(self, name: str, ttl: timedelta | None = None, *, ttl_seconds: float | None = None,
                  ttl_ms: int | None = None) -> MapState:
        return self._add(MapState, name, ttl, ttl_seconds, ttl_ms)

    def declarations(self) -> dict[str, Declaration]:
        """Every declared variable's ``declaration()``, by name."""
        return {name: v.declaration() for name, v in self.variables.items()}


class KeyState:
    """The state variables by name (``state.total`` or ``state["total"]``), bound to the current key;
    ``state.timers`` is the key's timers (a variable named "timers" is then ``state["timers"]``)."""

    def __init__(self, variables: Mapping[str, Any], timers: Timers | None = None):
        self._vars = variables
        if timers is not None:
            self.__dict__["timers"] = timers

    def __getattr__(self, name):
        try:
            return self.__dict__["_vars"][name]
        except KeyError:
            if name == "timers":
                raise InterfaceError("timers need a processor that defines handle_expired_timer(self, key, timer, "
                                     "state): define it to receive the timers it registers") from None
            raise AttributeError(f"no state variable {name!r} (declared: {sorted(self._vars)})") from None

    def __getitem__(self, name) -> _StateVar:
        return self._vars[name]


class StatefulProcessor:
    """Per-key stateful logic; subclass it. One instance per task (it is pickled to the executors)."""

    def init(self, handle: StateHandle) -> None:
        """Declare state variables with ``handle.value_state/list_state/map_state``."""
        raise NotImplementedError

    def handle_rows(self, key: tuple, rows: list[tuple], state: KeyState) -> Iterable[tuple]:
        """Handle one grouping key's rows of this batch; return or yield output tuples."""
        raise NotImplementedError

    def handle_expired_timer(self, key: tuple, timer: ExpiredTimer, state: KeyState) -> Iterable[tuple]:
        """Handle one due timer of ``key`` (optional: define it to use timers); return or yield
        output tuples. The timer is deleted before the call, in the same commit; the key's state
        and timers are bound as in ``handle_rows``."""
        raise NotImplementedError

    def handle_initial_state(self, key: tuple, rows: list[tuple], state: KeyState) -> Iterable[tuple]:
        """Handle one grouping key's rows of the operator's ``initial_state`` (optional: define it to
        use ``initial_state=``): called once per key, before the first batch, with the key's state
        and timers bound as in ``handle_rows``; return or yield output tuples (they join the first
        batch's output)."""
        raise NotImplementedError

    def close(self) -> None:
        """Called once per task after the last key (optional)."""


def uses_timers(processor: object) -> bool:
    """Whether a processor defines ``handle_expired_timer`` (and so may register timers)."""
    fn = getattr(type(processor), "handle_expired_timer", None)
    return fn is not None and fn is not StatefulProcessor.handle_expired_timer


def uses_initial_state(processor: object) -> bool:
    """Whether a per-key processor defines ``handle_initial_state`` (and so takes ``initial_state=``)."""
    fn = getattr(type(processor), "handle_initial_state", None)
    return fn is not None and fn is not StatefulProcessor.handle_initial_state


class VectorizedProcessor:
    """Whole-partition, columnar stateful logic; subclass it.

    ``state_schema`` (a ``pyarrow.Schema``) declares the per-key state columns. For each task the
    runtime passes, for the ``n`` distinct grouping keys of the partition's rows:

    * ``keys``: a ``pyarrow.Table`` of the key columns, one row per key;
    * ``rows``: a ``pyarrow.Table`` of the value columns, sorted by key, so key ``i``'s rows are
      ``rows[offsets[i]:offsets[i+1]]``;
    * ``offsets``: a numpy int64 array of length ``n + 1``;
    * ``state``: a ``pyarrow.Table`` with ``state_schema``, one row per key (all null where the
      key has no state), and a numpy bool mask ``exists``.

    ``process`` returns ``(new_state, output)``: ``new_state`` a table of ``state_schema`` with one
    row per key (a row whose ``valid`` entry is False is removed; pass ``valid=None`` to keep all),
    and ``output`` a table matching the operator's output schema. Each state row is stored as one
    record, ``encode_row(tuple of the row)`` under ``encode_key((state_name, *key))``.

    Timers: a processor that defines ``handle_expired_timers`` registers and deletes timers in bulk
    with ``self.timers`` (a ``VectorizedTimers``: keys by their row in the call's ``keys``) in
    ``process`` and ``handle_expired_timers``; ``self.processing_time_ms`` and
    ``self.watermark_ms`` are the batch's clock and watermark. After ``process``, the partition's
    due timers (processing: ``at_ms <= processing_time_ms``, event: ``at_ms <= watermark_ms``) go
    to one call of ``handle_expired_timers``, also for keys without rows and in batches without
    rows; each fires once, deleted in the commit that holds what the call wrote.
    """

    state_name = "state"
    state_schema = None  # pyarrow.Schema
    # set by the runtime before every call (see "Timers" above)
    timers: VectorizedTimers = VectorizedTimers()
    processing_time_ms: int = 0
    watermark_ms: int | None = None

    def process(self, keys, rows, offsets, state, exists):
        """Return ``(new_state_table, output_table)`` or ``(new_state_table, output_table, valid_mask)``."""
        raise NotImplementedError

    def handle_expired_timers(self, keys, timers, state, exists):
        """The partition's due timers (optional: define it to use ``self.timers``). ``keys``: one
        row per key with a due timer; ``timers``: one row per due timer, in firing order, with the
        key columns, ``key_index`` (int64, the row of ``keys``), ``at_ms`` (int64) and ``kind``
        (string); ``state`` / ``exists``: those keys' state after this batch's ``process``. Returns
        what ``process`` returns, for ``keys``."""
        raise NotImplementedError


def check_processor(processor: StatefulProcessor | VectorizedProcessor, time_mode: str = "none") -> bool:
    """What a task would find wrong with ``processor``'s state declarations, raised when the
    operator is made, on the driver (``StateDeclarationError``): a ``StatefulProcessor`` whose
    ``init`` fails or declares no state variable, a ``VectorizedProcessor`` without a
    ``pyarrow.Schema`` as ``state_schema``. Returns whether the processor has time work (timers or
    state with a TTL: its tasks run even without rows)."""
    name = type(processor).__name__
    if isinstance(processor, VectorizedProcessor):
        if not isinstance(getattr(processor, "state_schema", None), pa.Schema):
            raise StateDeclarationError(
                f"{name}.state_schema must be a pyarrow.Schema (the columns of a key's state row), got "
                f"{type(getattr(processor, 'state_schema', None)).__name__}")
        return uses_vectorized_timers(processor)
    h = StateHandle(time_mode, uses_timers(processor))
    try:
        processor.init(h)
    except InterfaceError:
        raise
    except Exception as exc:
        raise StateDeclarationError(
            f"{name}.init(handle) failed when the operator checked its declarations on the driver: "
            f"{type(exc).__name__}: {exc}. init should only declare state variables (handle.value_state, "
            "list_state, map_state) and set attributes") from exc
    if not h.variables:
        raise StateDeclarationError(
            f"{name}.init declared no state: declare the state the processor keeps per key in init, e.g. "
            "self.total = handle.value_state('total') (see docs/SPARK.md, 'State variables')")
    return uses_timers(processor) or any(v.ttl_ms is not None for v in h.variables.values())


def uses_vectorized_timers(processor: object) -> bool:
    """Whether a ``VectorizedProcessor`` defines ``handle_expired_timers``."""
    fn = getattr(type(processor), "handle_expired_timers", None)
    return fn is not None and fn is not VectorizedProcessor.handle_expired_timers


def vectorized_declarations(processor: VectorizedProcessor) -> dict[str, Declaration]:
    """A ``VectorizedProcessor``'s one state variable, as ``StateHandle.declarations`` gives them.
    Its records are ``encode_row(tuple of the state row)`` without expiry: the layout of a
    ``value_state`` without a TTL holding tuples (the two may replace each other)."""
    return {processor.state_name: {"kind": VECTORIZED, "ttl": False}}


def _layout(d: Mapping[str, Any]) -> tuple[Any, bool, bool]:
    kind = d.get("kind")
    return (VALUE if kind == VECTORIZED else kind), bool(d.get("ttl")), bool(d.get("ttl_entries"))


def _describe(d: Mapping[str, Any]) -> str:
    kind = d.get("kind")
    if kind == VECTORIZED:
        return "the VectorizedProcessor's state"
    if d.get("ttl") and kind in (LIST, MAP):
        return (f"{kind}_state with a TTL per entry" if d.get("ttl_entries") else
                f"{kind}_state with a TTL for the whole {kind} (the layout before per-entry TTLs)")
    return f"{kind}_state {'with' if d.get('ttl') else 'without'} a TTL"


def check_declarations(recorded: Mapping[str, Declaration] | None, current: Mapping[str, Declaration],
                       where: str = "") -> None:
    """``StateDeclarationError`` when a state variable of ``current`` was recorded (by an earlier
    batch of the operator) with another kind or another TTL setting (with or without: the length
    may change). Variables new in ``current``, or only in ``recorded``, are fine. ``recorded`` None
    (the first batch, or state written before declarations were recorded): nothing to check."""
    if not recorded:
        return
    bad = [f"{name!r} was {_describe(recorded[name])} and is now {_describe(d)}"
           for name, d in current.items() if name in recorded and _layout(recorded[name]) != _layout(d)]
    if bad:
        raise StateDeclarationError(
            f"{where}state variable {'; '.join(bad)}. The stored values were written for the old declaration "
            "(a TTL or a kind changes how a value is stored) and would be misread or reset. Keep the old "
            "declaration, or declare the variable under a new name (reading the old one in handle_rows to "
            "migrate it), or start a new operator_id.")


def check_picklable(processor: object) -> None:
    """``InterfaceError`` naming what makes ``processor`` unpicklable (an attribute, or the path to
    it inside an attribute: ``self.cfg['conn']``) when cloudpickle, which Spark sends it to the
    executors with, cannot pickle it. Runs once on the driver, when the operator is created."""
    try:
        from pyspark import cloudpickle as pickler
    except ImportError:  # pragma: no cover - pyspark ships cloudpickle
        import pickle as pickler  # type: ignore[no-redef]
    try:
        pickler.dumps(processor)
        return
    except Exception as exc:
        first = exc
    culprits = _unpicklable(pickler, processor, "self", 3)
    what = "; ".join(f"{path} (a {type(value).__name__}: {_short(err)})" for path, value, err in culprits[:5])
    name = type(processor).__name__
    raise InterfaceError(
        f"the processor {name} cannot be pickled (Spark pickles it to send it to the executors): "
        + (f"{what}. Create such objects in {name}.init(), which runs in each task, rather than in __init__ "
           "(or keep them out of the processor)" if culprits else f"{type(first).__name__}: {_short(first)}"))


def _short(exc: object, limit: int = 160) -> str:
    s = str(exc)
    return s if len(s) <= limit else s[:limit] + "…"


def _unpicklable(pickler: Any, obj: object, path: str, depth: int) -> list[tuple[str, object, Exception]]:
    """The innermost parts of ``obj`` (attributes, dict values, sequence items, ``depth`` levels
    down) that do not pickle, as (path, value, error)."""
    if isinstance(obj, Mapping):
        parts: Iterable[tuple[str, object]] = ((f"{path}[{k!r}]", v) for k, v in obj.items())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        parts = ((f"{path}[{i}]", v) for i, v in enumerate(obj))
    elif isinstance(getattr(obj, "__dict__", None), dict):
        parts = ((f"{path}.{k}", v) for k, v in vars(obj).items())
    else:
        return []
    found: list[tuple[str, object, Exception]] = []
    for p, v in parts:
        try:
            pickler.dumps(v)
        except Exception as exc:
            inner = _unpicklable(pickler, v, p, depth - 1) if depth > 1 else []
            found.extend(inner or [(p, v, exc)])
    return found


def merge_declarations(recorded: Mapping[str, Declaration] | None,
                       reported: Iterable[Mapping[str, Declaration] | None]) -> dict[str, Declaration] | None:
    """What the next manifest records: the ``recorded`` declarations updated with the tasks'
    (``reported``; equal to the recorded ones where both name a variable, ``check_declarations``
    saw to it). A variable no longer declared stays recorded: its values stay in the store, and
    declaring it again differently would misread them. None when nothing was ever declared."""
    merged = dict(recorded or {})
    for r in reported:
        if r:
            merged.update(r)
    return merged or None
