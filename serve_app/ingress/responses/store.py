"""The bounded store of Responses (for `GET /v1/responses/{id}` and `previous_response_id`).

It lives OUTSIDE the ingress processes — one small Serve deployment every ingress replica calls — so a response
created through one replica is found through any other. Bounded two ways: entries expire after a TTL, and past the
item or byte cap the least recently used entries are evicted. Three stores behind one interface (put/get/delete),
chosen by `ingress.response_store_backend`: `SqliteResponseStore` (sqlite_store.py, the default: it survives a
restart of the app on one node), `PostgresResponseStore` (postgres_store.py: a server database, for a multi-node
cluster where the store's replica may come back on another node) and `ResponseStoreCore` (in memory); all plain
logic, unit-tested without Ray. A store whose database cannot be reached or used, or does not answer within
`ingress.response_store_timeout_s`, raises `StoreUnavailable`, which `StoreClient` turns into a 503
`store_unavailable` in the API's envelope.
`ResponseStore` is the thin deployment; `bind_store(settings)` is what `build_app` wires in (it is passed to the
Ingress deployment, arrives there as a DeploymentHandle and reaches the routes as a `StoreClient`).

With `ingress.response_store_placement: ingress` there is no such deployment: each ingress replica opens the
database itself (`open_local_store`), which SQLite's file locking shares between the replicas of one host and
PostgreSQL between any. A one-host service saves a whole Ray worker process, idle about 0.01 of a core
(docs/serving-path.md "What the idle service costs"), and a store call is made in the ingress itself instead of
an actor call (SQLite's on the event loop when it would not wait, else in a thread; PostgreSQL's awaited on the
loop; `AsyncStore._call`). The in-memory store has no such placement: each replica would keep its own.

A record is `{"response": <response object>, "items": [<input items of the whole chain, then this output>]}`, so a
follow-up with `previous_response_id` needs one lookup, not a walk up the chain.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import time
from collections import OrderedDict
from typing import Any, Callable

from ray import serve

from serve_app.errors import ServiceError, replica_gone
from serve_app.serve_tuning import with_replica_env

log = logging.getLogger(__name__)

DSN_ENV = "SERVE_APP_RESPONSE_STORE_DSN"


class StoreUnavailable(Exception):
    """The store's database cannot be reached. Plain (one message argument) so it crosses Ray intact."""


class WouldWait(Exception):
    """A store call made with `wait=False` found its store busy (the connection in use by a worker thread, or
    another process's write lock): nothing was done; make the call again with waiting allowed."""


def encode_record(record: Any, size: int | None, max_bytes: int) -> tuple[str, int] | None:
    """A database store's text of `record` and its size (the caller's, else the text's), or None when one record
    alone is larger than the byte cap."""
    text = json.dumps(record, separators=(",", ":"))
    size = len(text) if size is None else size
    return None if size > max_bytes else (text, size)


class ResponseStoreCore:
    def __init__(self, max_items: int = 10_000, ttl_s: float = 3600.0, max_bytes: int = 512 * 1024 * 1024,
                 clock: Callable[[], float] = time.monotonic):
        self.max_items = max_items
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.clock = clock
        self._entries: OrderedDict[str, tuple[float, int, Any]] = OrderedDict()  # id -> (expires, size, record)
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _drop(self, key: str) -> None:
        _, size, _ = self._entries.pop(key)
        self.bytes -= size

    def _expire(self, now: float) -> None:
        # Entries are in insertion/refresh order and share one TTL, so the expired ones are at the front.
        while self._entries:
            key, (expires, _, _) = next(iter(self._entries.items()))
            if expires > now:
                break
            self._drop(key)

    def put(self, key: str, record: Any, size: int | None = None) -> bool:
        """Store `record`; False (and nothing stored) when one record alone is larger than the byte cap."""
        if size is None:
            size = len(json.dumps(record, separators=(",", ":")))
        if size > self.max_bytes:
            return False
        now = self.clock()
        self._expire(now)
        if key in self._entries:
            self._drop(key)
        self._entries[key] = (now + self.ttl_s, size, record)
        self.bytes += size
        while len(self._entries) > self.max_items or self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def get(self, key: str) -> Any | None:
        now = self.clock()
        self._expire(now)
        entry = self._entries.get(key)
        return None if entry is None else entry[2]

    def delete(self, key: str) -> bool:
        if key in self._entries:
            self._drop(key)
            return True
        return False


def make_store(backend: str, path: str | None, max_items: int, ttl_s: float, max_bytes: int,
               dsn: str | None = None, environ=os.environ, timeout_s: float = 5.0):
    if backend == "sqlite":
        from serve_app.ingress.responses.sqlite_store import SqliteResponseStore

        return SqliteResponseStore(path, max_items=max_items, ttl_s=ttl_s, max_bytes=max_bytes, timeout_s=timeout_s)
    if backend == "postgres":
        # Read here, in the store's replica: that is the process that connects, and the DSN then never travels in
        # the deployment's arguments when it comes from the environment.
        dsn = dsn or environ.get(DSN_ENV)
        if not dsn:
            raise ValueError(f"ingress.response_store_backend is 'postgres' but no DSN is set: set "
                             f"ingress.response_store_dsn or the {DSN_ENV} environment variable")
        try:
            from serve_app.ingress.responses.postgres_store import PostgresResponseStore
        except ImportError as err:
            raise ImportError("ingress.response_store_backend 'postgres' needs psycopg: pip install "
                              "'serve_app[postgres]'") from err
        return PostgresResponseStore(dsn, max_items=max_items, ttl_s=ttl_s, max_bytes=max_bytes, timeout_s=timeout_s)
    return ResponseStoreCore(max_items=max_items, ttl_s=ttl_s, max_bytes=max_bytes)


class AsyncStore:
    """A store's put/get/delete as coroutines, bounded by `timeout_s`: what the ResponseStore deployment serves and
    what an ingress replica calls with the store in its own process (`open_local_store`)."""

    def __init__(self, max_items: int, ttl_s: float, max_bytes: int = 512 * 1024 * 1024, backend: str = "memory",
                 path: str | None = None, dsn: str | None = None, timeout_s: float = 5.0):
        self.core = make_store(backend, path, max_items, ttl_s, max_bytes, dsn, timeout_s=timeout_s)
        # How a call is made: PostgreSQL's are coroutines (psycopg's async API: they wait for the network on this
        # loop); the in-memory core is cheap enough to call inline; SQLite's are tried inline first (below).
        # "thread" (every call in a worker thread) is how SQLite's ran before (load/probe_store_wait.py).
        self.calls = {"postgres": "await", "memory": "inline", "sqlite": "inline_first"}[backend]
        self._checkpoints = backend == "sqlite"
        self.timeout_s = timeout_s
        self._checkpoint: asyncio.Task | None = None

    async def _call(self, fn, *args):
        if self.calls == "await":
            return await self._bounded(fn(*args))
        if self.calls == "inline":
            return fn(*args)
        if self.calls == "inline_first":
            # A worker thread beside a busy event loop can wait seconds for the GIL (docs/serving-path.md, "The
            # render thread's wait"; load/probe_store_wait.py: most puts of a burst timed out that way). A SQLite
            # call is CPU work under the GIL wherever it runs (encoding the record: ~0.1 ms for 4 KB, ~3 ms for
            # 400 KB here) and writes the OS buffers: so it is made here, unless it would wait for the connection
            # or another process's write lock (then in a thread). The WAL checkpoint, the one step that syncs the
            # disk, stays off the loop (`_after`).
            try:
                out = fn(*args, wait=False)
            except WouldWait:
                pass
            else:
                self._after()
                return out
        out = await self._bounded(asyncio.to_thread(fn, *args))
        if self._checkpoints:
            self._after()
        return out

    async def _bounded(self, call) -> Any:
        """`call`'s result within `timeout_s`. The databases bound their own waits (SQLite's busy timeout,
        PostgreSQL's statement_timeout), but a server that stops answering cannot cancel a statement: past the
        bound the caller gets its 503 at once, while the call is cancelled behind it without being waited for (a
        thread's runs on; psycopg gives a hung statement up to 10 s to cancel, then drops its connection)."""
        task = asyncio.ensure_future(call)
        try:
            done, _ = await asyncio.wait((task,), timeout=self.timeout_s)
        except asyncio.CancelledError:  # the request went away: so does its call
            task.cancel()
            raise
        if done:
            return task.result()
        task.cancel()
        task.add_done_callback(_unobserved)
        raise StoreUnavailable(f"the Responses store did not answer within {self.timeout_s:g} s; retry shortly")

    def _after(self) -> None:
        """Start a WAL checkpoint in a worker thread when the log has grown past its bound (one at a time; it
        uses its own connection, so calls go on meanwhile)."""
        if (self._checkpoint is None or self._checkpoint.done()) and self.core.checkpoint_due():
            self._checkpoint = asyncio.get_running_loop().create_task(asyncio.to_thread(self.core.checkpoint))
            self._checkpoint.add_done_callback(self._checkpointed)

    @staticmethod
    def _checkpointed(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.warning("Responses store: WAL checkpoint failed: %s", task.exception())

    async def put(self, key: str, record: Any) -> bool:
        return await self._call(self.core.put, key, record)

    async def get(self, key: str) -> Any | None:
        return await self._call(self.core.get, key)

    async def delete(self, key: str) -> bool:
        return await self._call(self.core.delete, key)


def _unobserved(task: asyncio.Task) -> None:
    """Retrieve a call's outcome that nobody waits for any more (asyncio would log it as never retrieved)."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("Responses store: a call past its bound ended with %r", task.exception())


# Serve's replica settings as on every replica of this app: its methods are async and never block the loop (the
# databases are waited for on it, or called in a thread), so they run on the replica's own loop, with no second
# thread.
@serve.deployment(name="ResponseStore", num_replicas=1, ray_actor_options=with_replica_env({"num_cpus": 0}))
class ResponseStore(AsyncStore):
    """One replica on purpose: with SQLite or in memory it is the single owner of the records (no cross-replica
    consistency to manage); with PostgreSQL the database owns them, and the replica may come back on any node."""


def _store_args(ing) -> tuple:
    return (ing.response_store_max_items, ing.response_store_ttl_s, ing.response_store_max_bytes,
            ing.response_store_backend, ing.response_store_path, ing.response_store_dsn, ing.response_store_timeout_s)


def bind_store(settings) -> Any:
    """The bound store deployment for `build_app` (serve_app/app.py); None when each ingress replica opens the
    store itself (`ingress.response_store_placement: ingress`)."""
    if settings.ingress.response_store_placement == "ingress":
        return None
    return ResponseStore.bind(*_store_args(settings.ingress))


def open_local_store(ingress_settings) -> AsyncStore:
    """The store in this process (`response_store_placement: ingress`), opened as the deployment would open it."""
    return AsyncStore(*_store_args(ingress_settings))


class StoreClient:
    """What the routes use: async put/get over a DeploymentHandle, over an `AsyncStore` in this process, or over a
    plain store object (unit tests)."""

    def __init__(self, backend: Any, timeout_s: float = 5.0):
        """`timeout_s`: the store's own bound on a call (`ingress.response_store_timeout_s`). The call through the
        handle gets twice that: past it the store's replica is gone or not yet replaced (Serve would hold the call
        until one runs), not merely slow, and the request gets the same 503 as an unreachable database."""
        self.backend = backend
        self._bound_s = 2 * timeout_s
        self._local = getattr(backend.put, "remote", None) is None  # a store object, not a deployment handle

    async def _call(self, method: str, *args) -> Any:
        try:
            if self._local:
                result = getattr(self.backend, method)(*args)
                return await result if inspect.isawaitable(result) else result
            return await asyncio.wait_for(getattr(self.backend, method).remote(*args), self._bound_s)
        except StoreUnavailable as err:  # through a handle: Ray's error, an instance of the store's too
            raise _unavailable(str(getattr(err, "cause", err))) from None
        except asyncio.TimeoutError:
            raise _unavailable(f"the Responses store's replica did not answer within {self._bound_s:g} s; "
                               "retry shortly") from None
        except Exception as err:
            if replica_gone(err):
                raise _unavailable(f"the Responses store's replica is gone ({type(err).__name__}); "
                                   "retry shortly") from None
            raise

    async def put(self, key: str, record: Any) -> bool:
        return await self._call("put", key, record)

    async def get(self, key: str) -> Any | None:
        return await self._call("get", key)

    async def delete(self, key: str) -> bool:
        return await self._call("delete", key)


def _unavailable(message: str) -> ServiceError:
    return ServiceError("api_error", message, status=503, code="store_unavailable")
