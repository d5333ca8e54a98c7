"""The Responses store on SQLite: the embedded default, so stored responses survive a restart of the app.

Same interface and bounds as `ResponseStoreCore` (put/get/chain/delete; conversations with a TTL; past the item or
byte cap the least recently continued conversations go first), on a file on the local disk of the node running the
ResponseStore replica. Expiry uses wall-clock time, which, unlike a monotonic clock, means the same thing after a
restart. Calls are blocking (one connection, serialised by a lock). `AsyncStore` makes each call on its event loop
first with `wait=False`: the call runs only if the connection is free and no other process holds the write lock,
else it raises `WouldWait` having done nothing, and is made again in a worker thread. The WAL checkpoint (the step
that syncs the disk) is left to `checkpoint`, on a connection of its own, which `AsyncStore` runs in a thread once
enough has been written.

A database that cannot be used (a file that is not a database, a directory it cannot write, a write lock another
process holds past `timeout_s`) raises `StoreUnavailable`, as the PostgreSQL store does when its server is down,
so the routes answer 503 `store_unavailable` instead of a 500. The connection is opened on first use and again
after a failure, so a store whose file is fixed (or unlocked) recovers without a restart.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable

from serve_app.ingress.responses.store import (
    CONTINUED_EXPIRES,
    CONTINUED_SEQ,
    StoreUnavailable,
    WouldWait,
    chain_records,
    encode_record,
)
from serve_app.ingress.responses.store_sql import store_queries

log = logging.getLogger(__name__)

DEFAULT_PATH = "~/.cache/serve_app/responses.sqlite3"
_CHECKPOINT_PAGES = 1000  # SQLite's default auto-checkpoint size (pages of 4 KiB)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    expires REAL NOT NULL,
    size INTEGER NOT NULL,
    record TEXT NOT NULL,  -- '' since records have a table of their own (a database from before keeps them here)
    parent TEXT,  -- the record this one continues (previous_response_id)
    root TEXT,  -- its conversation's first record; NULL for that one, whose seq and expires are the conversation's
    deleted INTEGER NOT NULL DEFAULT 0  -- deleted through the API, kept while a later record's chain needs it
);
-- The record's text, apart from its row: every put into a conversation updates its first record's row, and SQLite
-- rewrites a whole row on any update.
CREATE TABLE IF NOT EXISTS records (
    id TEXT PRIMARY KEY,
    record TEXT NOT NULL
);
CREATE TRIGGER IF NOT EXISTS responses_dropped AFTER DELETE ON responses
    BEGIN DELETE FROM records WHERE id = OLD.id; END;
CREATE INDEX IF NOT EXISTS responses_seq ON responses (seq);
CREATE INDEX IF NOT EXISTS responses_expires ON responses (expires);
CREATE TABLE IF NOT EXISTS totals (
    one INTEGER PRIMARY KEY CHECK (one = 0),
    items INTEGER NOT NULL,
    bytes INTEGER NOT NULL
);
CREATE TRIGGER IF NOT EXISTS responses_added AFTER INSERT ON responses
    BEGIN UPDATE totals SET items = items + 1, bytes = bytes + NEW.size; END;
CREATE TRIGGER IF NOT EXISTS responses_removed AFTER DELETE ON responses
    BEGIN UPDATE totals SET items = items - 1, bytes = bytes - OLD.size; END;
CREATE TRIGGER IF NOT EXISTS responses_resized AFTER UPDATE OF size ON responses
    BEGIN UPDATE totals SET bytes = bytes - OLD.size + NEW.size; END;
"""
# The caps are checked on every put against `totals`, which the triggers keep: counting and summing the table
# instead took time growing with it, on the event loop (1.66 ms a put against 0.35 ms with 5,000-5,999 stored 80 KB
# records; load/probe_store_fill.py, README). A database without the totals row (new, or written before it existed)
# is counted once when a connection opens it. Only then: a write on every open would make reads fail while another
# client holds the write lock, where WAL lets them go on.
# A database written before conversations existed gets their columns (its records hold their whole history: each is
# a conversation of one) the first time a store opens it, under the write lock; what uses them after that.
_CONVERSATION_COLUMNS = {"parent": "TEXT", "root": "TEXT", "deleted": "INTEGER NOT NULL DEFAULT 0"}
_CONVERSATION_SCHEMA = """
CREATE INDEX IF NOT EXISTS responses_parent ON responses (parent);
CREATE INDEX IF NOT EXISTS responses_root ON responses (root);
CREATE TRIGGER IF NOT EXISTS responses_conversation_dropped AFTER DELETE ON responses WHEN OLD.root IS NULL
    BEGIN DELETE FROM responses WHERE root = OLD.id; END;
"""
# Chains, visibility and a put's state, as the PostgreSQL store asks them (store_sql.py). A record's text is in
# `records`, or in its row where a database from before that table stored it.
_SQL = store_queries("responses", "totals", lambda name: f":{name}", text="COALESCE(x.record, r.record)",
                     text_join="LEFT JOIN records x ON x.id = r.id")
_COUNT_ONCE = ("INSERT OR IGNORE INTO totals SELECT 0, COUNT(*), COALESCE(SUM(size), 0) FROM responses "
               "WHERE NOT EXISTS (SELECT 1 FROM totals)")


def _columns(db: sqlite3.Connection) -> set[str]:
    return {row[1] for row in db.execute("PRAGMA table_info(responses)")}


class SqliteResponseStore:
    def __init__(self, path: str | None = None, max_items: int = 10_000, ttl_s: float = 3600.0,
                 max_bytes: int = 512 * 1024 * 1024, clock: Callable[[], float] = time.time, timeout_s: float = 5.0):
        self.path = Path(path or DEFAULT_PATH).expanduser()
        self.max_items = max_items
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.clock = clock
        self.timeout_s = timeout_s  # how long a write waits for another process's write lock
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._waits = True  # whether `_db` waits for another process's write lock (its busy timeout is set)
        self._checkpoint_lock = threading.Lock()
        self._checkpoint_db: sqlite3.Connection | None = None
        self.written = 0  # bytes of records put since the last checkpoint began (what the WAL has grown by, about)
        try:
            self._run(lambda db: None)  # open now, so a bad path shows in the log at start
        except StoreUnavailable:
            pass  # logged; every call tries again and answers 503 until the database can be used

    def _unavailable(self, err: Exception) -> StoreUnavailable:
        log.warning("Responses store: SQLite database %s unusable: %s", self.path, err)
        return StoreUnavailable(f"the Responses store's SQLite database is unavailable ({err}); retry shortly")

    def _open(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=self.timeout_s)
        try:
            db.execute("PRAGMA journal_mode=WAL")  # readers do not wait for the writer
            db.execute("PRAGMA synchronous=NORMAL")  # durable across a process crash (not a power cut), faster
            # Commits do not checkpoint until the log is 4x SQLite's default: `checkpoint` (in a thread) does it
            # first; this bound only holds when nobody calls it.
            db.execute(f"PRAGMA wal_autocheckpoint={4 * _CHECKPOINT_PAGES}")
            db.executescript(_SCHEMA)
            if _CONVERSATION_COLUMNS.keys() - _columns(db):
                db.execute("BEGIN IMMEDIATE")
                try:
                    for name in _CONVERSATION_COLUMNS.keys() - _columns(db):  # again: another opener may have
                        db.execute(f"ALTER TABLE responses ADD COLUMN {name} {_CONVERSATION_COLUMNS[name]}")
                    db.execute("COMMIT")
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
            db.executescript(_CONVERSATION_SCHEMA)
            if db.execute("SELECT 1 FROM totals").fetchone() is None:
                db.execute(_COUNT_ONCE)  # atomic: a row another writer adds meanwhile is counted or waits
        except BaseException:
            db.close()
            raise
        return db

    def _run(self, work: Callable[[sqlite3.Connection], Any], wait: bool = True) -> Any:
        """`work` on the connection. `wait=False`: raise WouldWait, having done nothing, where the call would wait
        (the lock held by another thread, no connection yet, another process's write lock)."""
        if not self._lock.acquire(blocking=wait):
            raise WouldWait
        try:
            if self._db is None:
                if not wait:
                    raise WouldWait  # opening writes the schema, which may wait for the write lock
                self._db, self._waits = self._open(), True
            if wait != self._waits:  # set on a change only: most calls in a row are inline (`wait=False`)
                self._db.execute(f"PRAGMA busy_timeout={round(self.timeout_s * 1000) if wait else 0}")
                self._waits = wait
            return work(self._db)
        except (sqlite3.Error, OSError) as err:
            if not wait and getattr(err, "sqlite_errorcode", None) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
                raise WouldWait from None
            if self._db is not None:  # reopened on the next call: a replaced or repaired file is seen afresh
                self._db.close()
                self._db = None
            raise self._unavailable(err) from None
        finally:
            self._lock.release()

    def checkpoint_due(self) -> bool:
        return self.written >= _CHECKPOINT_PAGES * 4096

    def checkpoint(self) -> None:
        """Copy the write-ahead log into the database (PASSIVE: waits for nobody, and nobody waits for it), on a
        connection of its own so that calls go on meanwhile."""
        self.written = 0
        with self._checkpoint_lock:
            try:
                if self._checkpoint_db is None:
                    self._checkpoint_db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None,
                                                          timeout=self.timeout_s)
                self._checkpoint_db.execute("PRAGMA wal_checkpoint(PASSIVE)")
            except (sqlite3.Error, OSError) as err:
                if self._checkpoint_db is not None:
                    self._checkpoint_db.close()
                    self._checkpoint_db = None
                raise self._unavailable(err) from None

    def __len__(self) -> int:
        def count(db):
            db.execute("DELETE FROM responses WHERE expires <= ?", (self.clock(),))
            return db.execute("SELECT items FROM totals").fetchone()[0]

        return self._run(count)

    def put(self, key: str, record: Any, size: int | None = None, parent: str | None = None,
            wait: bool = True) -> bool:
        """Store `record`, continuing `parent`'s conversation when one is named. False, and nothing stored, when
        `parent` is not stored, `key` is stored and continued by another record, or the conversation with this
        record would be larger than a cap (ResponseStoreCore.put)."""
        encoded = encode_record(record, size, self.max_bytes)
        if encoded is None:
            return False
        text, size = encoded
        now = self.clock()

        def put(db):
            db.execute("BEGIN IMMEDIATE")
            try:
                stored = self._put(db, key, text, size, parent, now)
                db.execute("COMMIT" if stored else "ROLLBACK")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
            if stored:
                self.written += len(text)
            return stored

        return self._run(put, wait)

    def _put(self, db: sqlite3.Connection, key: str, text: str, size: int, parent: str | None, now: float) -> bool:
        # Expired conversations go first (their first records; the trigger takes the rest).
        db.execute("DELETE FROM responses WHERE expires <= ?", (now,))
        continued, old_size, root, held_items, held_bytes, count, total = db.execute(
            _SQL.put_state, {"k": key, "p": parent}).fetchone()
        if continued or parent == key or (parent is not None and root is None):
            return False
        if root is not None and (held_items >= self.max_items or held_bytes + size > self.max_bytes):
            return False
        if old_size is not None:  # replaced: a record nothing continues (a first one has then no others)
            db.execute("DELETE FROM responses WHERE id = ?", (key,))
            count, total = count - 1, total - old_size
        insert = "INSERT INTO responses (id, seq, expires, size, record, parent, root) VALUES (?, ?, ?, ?, '', ?, ?)"
        seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM responses WHERE seq < ?",
                         (CONTINUED_SEQ,)).fetchone()[0]
        if root is None:
            db.execute(insert, (key, seq, now + self.ttl_s, size, None, None))
        else:
            db.execute(insert, (key, CONTINUED_SEQ, CONTINUED_EXPIRES, size, parent, root))
            # Continued: the conversation's TTL starts again, and it is now the newest.
            db.execute("UPDATE responses SET seq = ?, expires = ? WHERE id = ?", (seq, now + self.ttl_s, root))
        db.execute("INSERT OR REPLACE INTO records (id, record) VALUES (?, ?)", (key, text))
        count, total = count + 1, total + size  # what the trigger added
        while count > self.max_items or total > self.max_bytes:  # the least recently continued conversations go
            row = db.execute("SELECT id FROM responses WHERE seq < ? ORDER BY seq LIMIT 1",
                             (CONTINUED_SEQ,)).fetchone()
            if row is None:  # totals off from the table (a writer that bypassed the triggers): never spin
                break
            db.execute("DELETE FROM responses WHERE id = ?", row)
            count, total = db.execute("SELECT items, bytes FROM totals").fetchone()
        return True

    def get(self, key: str, wait: bool = True) -> Any | None:
        head = self.head(key, wait)
        return None if head is None else head[1]

    def head(self, key: str, wait: bool = True) -> tuple[str | None, Any] | None:
        """`key`'s parent and record, where it is visible (StoreClient.chain)."""
        row = self._run(lambda db: db.execute(_SQL.get, {"key": key, "now": self.clock()}).fetchone(), wait)
        return None if row is None else (row[1], json.loads(row[0]))

    def visible(self, key: str, wait: bool = True) -> bool:
        """Whether `key` is stored and visible, without reading it (ingress/responses/recent.py)."""
        now = self.clock()
        return self._run(lambda db: db.execute(_SQL.visible, {"key": key, "now": now}).fetchone(), wait) is not None

    def chain(self, key: str, links: bool = False, wait: bool = True) -> list[Any] | None:
        """The records of `key`'s chain, its conversation's first first and `key`'s own last; None where `key` is
        not stored. `links`: each as (id, parent, record)."""
        now = self.clock()
        rows = self._run(lambda db: db.execute(_SQL.chain, {"key": key, "limit": self.max_items}).fetchall(), wait)
        return chain_records(rows, now, links)

    def delete(self, key: str, wait: bool = True) -> bool:
        now = self.clock()

        def delete(db):
            db.execute("BEGIN IMMEDIATE")
            try:
                found = db.execute(_SQL.visible, {"key": key, "now": now}).fetchone() is not None
                if found:
                    for statement in _SQL.delete:
                        db.execute(statement, {"key": key})
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
            return found

        return self._run(delete, wait)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
        with self._checkpoint_lock:
            if self._checkpoint_db is not None:
                self._checkpoint_db.close()
                self._checkpoint_db = None
