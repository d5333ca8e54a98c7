"""The Responses store on SQLite: the embedded default, so stored responses survive a restart of the app.

Same interface and bounds as `ResponseStoreCore` (put/get/delete; a TTL; past the item or byte cap the oldest
stored entries go first), on a file on the local disk of the node running the ResponseStore replica. Expiry uses
wall-clock time, which, unlike a monotonic clock, means the same thing after a restart. Calls are blocking; the
deployment runs them in a worker thread (one connection, serialised by a lock).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable

from serve_app.ingress.responses.store import encode_record

DEFAULT_PATH = "~/.cache/serve_app/responses.sqlite3"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    expires REAL NOT NULL,
    size INTEGER NOT NULL,
    record TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_seq ON responses (seq);
CREATE INDEX IF NOT EXISTS responses_expires ON responses (expires);
"""


class SqliteResponseStore:
    def __init__(self, path: str | None = None, max_items: int = 10_000, ttl_s: float = 3600.0,
                 max_bytes: int = 512 * 1024 * 1024, clock: Callable[[], float] = time.time):
        self.path = Path(path or DEFAULT_PATH).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_items = max_items
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.clock = clock
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")  # readers do not wait for the writer
        self._db.execute("PRAGMA synchronous=NORMAL")  # durable across a process crash (not a power cut), faster
        self._db.executescript(_SCHEMA)

    def __len__(self) -> int:
        with self._lock:
            self._db.execute("DELETE FROM responses WHERE expires <= ?", (self.clock(),))
            return self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    def put(self, key: str, record: Any, size: int | None = None) -> bool:
        """Store `record`; False (and nothing stored) when one record alone is larger than the byte cap."""
        encoded = encode_record(record, size, self.max_bytes)
        if encoded is None:
            return False
        text, size = encoded
        now = self.clock()
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute("DELETE FROM responses WHERE expires <= ?", (now,))
                seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM responses").fetchone()[0]
                db.execute("INSERT OR REPLACE INTO responses (id, seq, expires, size, record) VALUES (?, ?, ?, ?, ?)",
                           (key, seq, now + self.ttl_s, size, text))
                count, total = db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses").fetchone()
                while count > self.max_items or total > self.max_bytes:
                    oldest, osize = db.execute("SELECT id, size FROM responses ORDER BY seq LIMIT 1").fetchone()
                    db.execute("DELETE FROM responses WHERE id = ?", (oldest,))
                    count, total = count - 1, total - osize
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return True

    def get(self, key: str) -> Any | None:
        with self._lock:
            row = self._db.execute("SELECT record FROM responses WHERE id = ? AND expires > ?",
                                   (key, self.clock())).fetchone()
        return None if row is None else json.loads(row[0])

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM responses WHERE id = ?", (key,)).rowcount > 0

    def close(self) -> None:
        with self._lock:
            self._db.close()
