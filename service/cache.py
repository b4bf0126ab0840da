"""Answers kept until the database changes.

A lookup through the ORM costs about a millisecond; the same answer from a
dict costs microseconds. SQLite tells a connection whether any other
connection committed since it last asked (PRAGMA data_version, a few
microseconds), so on SQLite every read checks that and a change drops every
entry: a winner a tuning process stores is served on the next request. Other
databases give no such signal: there an entry lives `ttl_s` seconds.
The least recently used entry goes when `max_entries` are held.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable, Hashable, TypeVar

from sqlalchemy import Engine

T = TypeVar("T")
MISSING = object()


class Cache:
    def __init__(self, engine: Engine, *, ttl_s: float = 1.0, max_entries: int = 20_000) -> None:
        self._entries: OrderedDict[Hashable, object] = OrderedDict()
        self._generation = 0
        self._max = max_entries
        self._ttl_s = ttl_s
        self._lock = threading.Lock()
        self._version: int | None = None
        self._expires = 0.0
        database = engine.url.database
        self._held = self._probe = None
        if engine.dialect.name == "sqlite" and database and database != ":memory:":
            # A connection of the engine's own (read-only, as the engine opens
            # it), kept out of the pool: data_version counts other connections' commits.
            self._held = engine.raw_connection()
            self._probe = self._held.driver_connection

    def find(self, key: Hashable) -> tuple[object, int]:
        """(the entry or MISSING, the generation to hand to `put`)."""
        with self._lock:
            self._drop_if_changed()
            value = self._entries.get(key, MISSING)
            if value is not MISSING:
                self._entries.move_to_end(key)
            return value, self._generation

    def put(self, key: Hashable, value: object, generation: int) -> None:
        """Keep `value`, computed after `find` returned `generation`."""
        with self._lock:
            # Computed across a drop: it may hold what the drop was for.
            if generation != self._generation:
                return
            self._entries[key] = value
            if len(self._entries) > self._max:
                self._entries.popitem(last=False)

    def get(self, key: Hashable, compute: Callable[[], T]) -> T:
        """The entry for `key`, from `compute()` when absent or out of date."""
        value, generation = self.find(key)
        if value is MISSING:
            value = compute()
            self.put(key, value, generation)
        return value

    def clear(self) -> None:
        with self._lock:
            self._clear()

    def close(self) -> None:
        if self._held is not None:
            self._held.close()

    def _clear(self) -> None:
        self._entries.clear()
        self._generation += 1

    def _drop_if_changed(self) -> None:
        if self._probe is not None:
            version = self._probe.execute("PRAGMA data_version").fetchone()[0]
            changed, self._version = version != self._version, version
        else:
            now = time.monotonic()
            changed = now >= self._expires
            if changed:
                self._expires = now + self._ttl_s
        if changed:
            self._clear()
