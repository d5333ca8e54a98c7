"""A real PostgreSQL server for tests: pgserver's PostgreSQL 16 binaries on a data directory of the test session,
listening on a Unix socket only. Each test that needs an empty database gets a fresh one (`fresh_database`)."""

from __future__ import annotations

import asyncio
import itertools
import threading
from pathlib import Path

import psycopg

_names = itertools.count()


def start(data_dir: Path):
    """Start a server on `data_dir` (created empty); `.cleanup()` stops it."""
    import pgserver

    return pgserver.get_server(data_dir, cleanup_mode="stop")


def fresh_database(server, prefix: str = "t") -> str:
    """The DSN of a new, empty database on `server`."""
    name = f"{prefix}_{next(_names)}"
    with psycopg.connect(server.get_uri(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return server.get_uri(name)


class Blocking:
    """A `PostgresResponseStore` (whose calls are coroutines) called from plain test code, as the other stores
    are: its calls run on an event loop of its own in a thread, the one loop its connections belong to, and
    callers in several threads share it as concurrent requests share an ingress's loop."""

    def __init__(self, store):
        self.store = store
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def put(self, key, record, size=None, parent=None):
        return self.run(self.store.put(key, record, size, parent))

    def get(self, key):
        return self.run(self.store.get(key))

    def head(self, key):
        return self.run(self.store.head(key))

    def chain(self, key, links=False):
        return self.run(self.store.chain(key, links))

    def visible(self, key):
        return self.run(self.store.visible(key))

    def delete(self, key):
        return self.run(self.store.delete(key))

    def __len__(self):
        return self.run(self.store.count())

    def close(self):
        self.run(self.store.close())

    def stop(self):
        """Close the store and end its loop's thread."""
        self.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()
