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

A record is `{"response": <response object>, "items": [<this request's input items, then its output>]}`, put with
the id it continues (`previous_response_id`) as its parent; `chain(id)` gives the records from the conversation's
first to `id`'s, in one query, and the history is their items. Each turn is stored once: a record holding the whole
history, as records were before, made a conversation of N turns cost N²/2 turns of space (a few long sessions
filled the caps) and every put encode all of it (load/probe_store_chain.py). A conversation (a first record and
every record that continues it, forks included) lives and goes as one: each put into it refreshes its TTL and makes
it the newest, and the caps evict the least recently continued conversation whole, so no record outlives one its
chain needs. A record deleted through the API while a later one continues it is kept, hidden, for that one's
chain, and goes when the last record continuing it is deleted; a record another continues cannot be replaced. Records stored before conversations existed have no parent
and hold their whole history, so they read the same.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import time
from collections import OrderedDict
from typing import Any, Callable, NamedTuple

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


# A database store's seq and expires for a record that continues a conversation: past every first record's, so only
# those are ever found as the oldest or the expired (a conversation's age is its first record's; they go together).
CONTINUED_SEQ = 2**63 - 1
CONTINUED_EXPIRES = float("inf")


def encode_record(record: Any, size: int | None, max_bytes: int) -> tuple[str, int] | None:
    """A database store's text of `record` and its size (the caller's, else the text's), or None when one record
    alone is larger than the byte cap."""
    text = json.dumps(record, separators=(",", ":"))
    size = len(text) if size is None else size
    return None if size > max_bytes else (text, size)


def chain_records(rows: list[tuple], now: float, links: bool = False) -> list[Any] | None:
    """A database store's chain from its query's rows (k, id, parent, expires, deleted, text), in any order: the
    records from the conversation's first to the asked one's, or None where that one is not visible (deleted, its
    conversation expired) or the walk did not reach a first record (an id in it not stored). `links`: each as
    (id, parent, record)."""
    if not rows:
        return None
    rows = sorted(rows, reverse=True)  # by k: the conversation's first record first
    first, asked = rows[0], rows[-1]
    if first[1] is None or first[2] is not None or first[3] <= now or asked[4]:
        return None
    # One decode a record: joining the texts into one first costs more (a copy of the whole history, 1.9 ms for
    # 1.6 MB here) than the calls it saves.
    if links:
        return [(row[1], row[2], json.loads(row[5])) for row in rows]
    return [json.loads(row[5]) for row in rows]


class ResponseStoreCore:
    """The in-memory store; also the model the database stores are tested against (records, conversations, caps,
    TTL)."""

    def __init__(self, max_items: int = 10_000, ttl_s: float = 3600.0, max_bytes: int = 512 * 1024 * 1024,
                 clock: Callable[[], float] = time.monotonic):
        self.max_items = max_items
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.clock = clock
        self._entries: dict[str, _Entry] = {}
        # A conversation's first record's id -> when the conversation expires; least recently continued first.
        self._conversations: OrderedDict[str, float] = OrderedDict()
        self._members: dict[str, set[str]] = {}  # first record's id -> the conversation's other records
        self._children: dict[str, int] = {}  # id -> how many stored records name it as their parent
        self.bytes = 0

    def __len__(self) -> int:
        """Records held, those deleted but kept for a later record's chain included (what the item cap counts)."""
        self._expire(self.clock())
        return len(self._entries)

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key)
        self.bytes -= entry.size
        if entry.parent is not None:
            left = self._children.pop(entry.parent) - 1
            if left:
                self._children[entry.parent] = left
        if entry.root is None:  # the conversation goes with its first record
            self._conversations.pop(key)
            for member in self._members.pop(key):
                self._drop(member)
        elif entry.root in self._members:
            self._members[entry.root].discard(key)

    def _expire(self, now: float) -> None:
        # Conversations are in refresh order and share one TTL, so the expired ones are at the front.
        while self._conversations:
            root, expires = next(iter(self._conversations.items()))
            if expires > now:
                break
            self._drop(root)

    def _root(self, key: str) -> str:
        return self._entries[key].root or key

    def put(self, key: str, record: Any, size: int | None = None, parent: str | None = None) -> bool:
        """Store `record`, continuing `parent`'s conversation when one is named. False, and nothing stored, when
        `parent` is not stored, `key` is stored and continued by another record, or the conversation with this
        record would be larger than a cap."""
        if size is None:
            size = len(json.dumps(record, separators=(",", ":")))
        now = self.clock()
        self._expire(now)
        old = self._entries.get(key)
        if (old is not None and self._children.get(key)) or parent == key or (
                parent is not None and parent not in self._entries):
            return False
        root = None if parent is None else self._root(parent)
        if root is not None:
            members = [root, *self._members[root]]
            held = sum(self._entries[m].size for m in members if m != key)
            if size + held > self.max_bytes or len(members) - (key in members) >= self.max_items:
                return False
        elif size > self.max_bytes:
            return False
        if old is not None:
            self._drop(key)
        self._entries[key] = _Entry(size, record, parent, root, False)
        self.bytes += size
        if root is None:
            self._conversations[key] = now + self.ttl_s
            self._members[key] = set()
        else:
            self._children[parent] = self._children.get(parent, 0) + 1
            self._members[root].add(key)
            self._conversations[root] = now + self.ttl_s  # continued: refreshed, and the newest
            self._conversations.move_to_end(root)
        while len(self._entries) > self.max_items or self.bytes > self.max_bytes:
            self._drop(next(iter(self._conversations)))
        return True

    def get(self, key: str) -> Any | None:
        self._expire(self.clock())
        entry = self._entries.get(key)
        return None if entry is None or entry.deleted else entry.record

    def visible(self, key: str) -> bool:
        return self.get(key) is not None

    def head(self, key: str) -> tuple[str | None, Any] | None:
        """`key`'s parent and record, where it is visible (StoreClient.chain: the rest of the chain may be held
        already)."""
        if self.get(key) is None:
            return None
        entry = self._entries[key]
        return entry.parent, entry.record

    def chain(self, key: str, links: bool = False) -> list[Any] | None:
        """The records of `key`'s chain, its conversation's first first and `key`'s own last; None where `key` is
        not stored. `links`: each as (id, parent, record)."""
        if self.get(key) is None:
            return None
        out = []
        while key is not None:
            entry = self._entries[key]
            out.append((key, entry.parent, entry.record) if links else entry.record)
            key = entry.parent
        return out[::-1]

    def delete(self, key: str) -> bool:
        self._expire(self.clock())
        entry = self._entries.get(key)
        if entry is None or entry.deleted:
            return False
        if self._children.get(key):  # later records continue it: gone from the API, kept for their chains
            self._entries[key] = entry._replace(deleted=True)
            return True
        self._drop(key)
        # Hidden records it was the last to continue: no chain needs them any more.
        parent = entry.parent
        while parent is not None and self._entries[parent].deleted and not self._children.get(parent):
            up = self._entries[parent].parent
            self._drop(parent)
            parent = up
        return True


class _Entry(NamedTuple):
    size: int
    record: Any
    parent: str | None
    root: str | None  # the conversation's first record; None for that record itself
    deleted: bool  # deleted through the API while later records' chains still need it


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

    async def put(self, key: str, record: Any, parent: str | None = None) -> bool:
        return await self._call(self.core.put, key, record, None, parent)

    async def get(self, key: str) -> Any | None:
        return await self._call(self.core.get, key)

    async def visible(self, key: str) -> bool:
        return await self._call(self.core.visible, key)

    async def head(self, key: str) -> tuple[str | None, Any] | None:
        return await self._call(self.core.head, key)

    async def chain(self, key: str, links: bool = False) -> list[Any] | None:
        return await self._call(self.core.chain, key, links)

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

    def __init__(self, backend: Any, timeout_s: float = 5.0, recent_bytes: int = 0):
        """`timeout_s`: the store's own bound on a call (`ingress.response_store_timeout_s`). The call through the
        handle gets twice that: past it the store's replica is gone or not yet replaced (Serve would hold the call
        until one runs), not merely slow, and the request gets the same 503 as an unreachable database.
        `recent_bytes`: keep the records this client stored, up to about that many bytes, to read chains from
        (`ingress.response_store_recent_bytes`; ingress/responses/recent.py); 0: every chain is read from the store."""
        from serve_app.ingress.responses.recent import RecentRecords

        self.backend = backend
        self._bound_s = 2 * timeout_s
        self._local = getattr(backend.put, "remote", None) is None  # a store object, not a deployment handle
        self.recent = RecentRecords(recent_bytes) if recent_bytes else None

    async def _call(self, method: str, *args, **kwargs) -> Any:
        try:
            if self._local:
                result = getattr(self.backend, method)(*args, **kwargs)
                return await result if inspect.isawaitable(result) else result
            return await asyncio.wait_for(getattr(self.backend, method).remote(*args, **kwargs), self._bound_s)
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

    async def put(self, key: str, record: Any, parent: str | None = None) -> bool:
        stored = await self._call("put", key, record, parent=parent)
        if stored and self.recent is not None:
            self.recent.remember(key, record, parent)
        return stored

    async def get(self, key: str) -> Any | None:
        return await self._call("get", key)

    async def chain(self, key: str) -> list[Any] | None:
        """`key`'s chain (store.py). Where this client holds the whole chain (ingress/responses/recent.py), its
        records come from memory and the store is asked only whether `key` is still visible (not deleted, expired
        or evicted: then the chain is not found, as from the store). Where it holds all but `key` itself (the
        front door's Router, or a replica the last turn did not go through), only `key`'s record is read. Records
        never change once stored, and a record that others continue is kept while they are, so the chain read
        back would be the same."""
        recent = self.recent
        if recent is None:
            return await self._call("chain", key)
        records = recent.chain(key)
        if records is not None:
            if await self._call("visible", key):
                recent.served += 1
                return records
            recent.forget(key)
            return None
        head = await self._call("head", key)
        if head is None:
            recent.forget(key)
            return None
        parent, record = head
        earlier = [] if parent is None else recent.chain(parent)
        if earlier is not None:
            recent.remember(key, record, parent)
            recent.extended += 1
            return [*earlier, record]
        links = await self._call("chain", key, links=True)  # kept, so the next turn reads only its own record
        if links is None:
            return None
        for id_, parent, record in links:
            recent.remember(id_, record, parent)
        return [record for _, _, record in links]

    async def delete(self, key: str) -> bool:
        if self.recent is not None:
            self.recent.forget(key)
        return await self._call("delete", key)


def _unavailable(message: str) -> ServiceError:
    return ServiceError("api_error", message, status=503, code="store_unavailable")
