"""The Responses store on PostgreSQL: for a multi-node cluster, where the ResponseStore replica may start on any
node (after a crash, a scale-down or a RayService upgrade that brings up a new cluster) and must still find every
stored response.

Same interface, layout and bounds as `SqliteResponseStore` (put/get/chain/delete; conversations with a wall-clock
TTL; past the item or byte cap the least recently continued conversations go first), records in their rows (an
update leaves a large value PostgreSQL keeps out of line where it is). The DSN comes from
`ingress.response_store_dsn` or the SERVE_APP_RESPONSE_STORE_DSN environment variable (a Kubernetes Secret in
kuberay/); it may hold a password, so it is never logged or echoed.
The schema is created on first use, under an advisory lock, so replicas that start at once do not race on it.
Puts take a second advisory lock: the caps hold over the whole table (its totals, kept by a trigger), and two
writers evicting at once would each see the other's rows half-applied. Calls are coroutines (psycopg's async API on
a small pool of connections, all on the event loop that makes the calls): they wait for the server on the loop,
never in a worker thread, which beside a busy ingress loop could wait seconds for the GIL at every step of a
statement (docs/serving-path.md, "The render thread's wait"; load/probe_store_wait.py --backend postgres).

An unreachable database raises `StoreUnavailable` (the routes answer 503 in the API's envelope); pooled connections
the server dropped (a database restart) are replaced once before a call gives up. So does a database that answers
too slowly: every statement runs under a `statement_timeout` of `timeout_s` (set in the connection's options, from
its first statement on; a DSN that sets its own keeps it), so a call stuck behind a lock or on an overloaded server
is cancelled by the server and answers 503. A server that stops answering altogether cannot cancel anything: the
store bounds each call on the client side too (`AsyncStore._bounded`, store.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Awaitable, Callable

import psycopg
from psycopg.conninfo import conninfo_to_dict

from serve_app.ingress.responses.store import (
    CONTINUED_EXPIRES,
    CONTINUED_SEQ,
    StoreUnavailable,
    chain_records,
    encode_record,
)
from serve_app.ingress.responses.store_sql import store_queries

log = logging.getLogger(__name__)

TABLE = "serve_app_responses"
# pg_advisory_xact_lock keys (any two bigints unique to this app): one for creating the schema, one for puts.
_SCHEMA_LOCK = 0x5E7E_A990_0001
_PUT_LOCK = 0x5E7E_A990_0002

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    id TEXT PRIMARY KEY,
    seq BIGSERIAL NOT NULL,
    expires DOUBLE PRECISION NOT NULL,
    size BIGINT NOT NULL,
    record TEXT NOT NULL
);
-- The conversation columns (sqlite_store.py's schema says what each holds); a table from before they existed gets
-- them here, its records each a conversation of one.
ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS parent TEXT;
ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS root TEXT;
ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS deleted BOOLEAN NOT NULL DEFAULT false;
CREATE INDEX IF NOT EXISTS {TABLE}_seq ON {TABLE} (seq);
CREATE INDEX IF NOT EXISTS {TABLE}_parent ON {TABLE} (parent);
CREATE INDEX IF NOT EXISTS {TABLE}_root ON {TABLE} (root);
CREATE INDEX IF NOT EXISTS {TABLE}_expires ON {TABLE} (expires);
CREATE OR REPLACE FUNCTION {TABLE}_conversation_dropped() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM {TABLE} WHERE root = OLD.id;
    RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER {TABLE}_conversation_dropped AFTER DELETE ON {TABLE}
    FOR EACH ROW WHEN (OLD.root IS NULL) EXECUTE FUNCTION {TABLE}_conversation_dropped();
CREATE TABLE IF NOT EXISTS {TABLE}_totals (
    one INT PRIMARY KEY CHECK (one = 0),
    items BIGINT NOT NULL,
    bytes BIGINT NOT NULL
);
CREATE OR REPLACE FUNCTION {TABLE}_count() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        UPDATE {TABLE}_totals SET items = items + 1, bytes = bytes + NEW.size;
    ELSIF TG_OP = 'DELETE' THEN
        UPDATE {TABLE}_totals SET items = items - 1, bytes = bytes - OLD.size;
    ELSE
        UPDATE {TABLE}_totals SET bytes = bytes - OLD.size + NEW.size;
    END IF;
    RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER {TABLE}_count AFTER INSERT OR DELETE OR UPDATE OF size ON {TABLE}
    FOR EACH ROW EXECUTE FUNCTION {TABLE}_count();
"""
# The caps are checked on every put against the totals the trigger keeps; counting and summing the table instead
# took time growing with it, under the put lock (load/probe_store_fill.py). A database without the totals row (new,
# or written before it existed) is counted once, with the table locked against writers for that moment: a writer
# whose row the count missed, its trigger having found no totals row to update, would be lost from the totals.
_COUNT_ONCE = f"""
LOCK TABLE {TABLE} IN SHARE ROW EXCLUSIVE MODE;
INSERT INTO {TABLE}_totals SELECT 0, COUNT(*), COALESCE(SUM(size), 0) FROM {TABLE} ON CONFLICT (one) DO NOTHING;
"""
# Chains, visibility and a put's state, as the SQLite store asks them (store_sql.py).
_SQL = store_queries(TABLE, f"{TABLE}_totals", lambda name: f"%({name})s")
_NEXT_SEQ = f"nextval(pg_get_serial_sequence('{TABLE}', 'seq'))"
_EVICT_BATCH = 16  # oldest conversations read at a time when the byte cap (not the item cap) says how many must go


class _Refused(Exception):
    """A put that stores nothing: raised inside its transaction so that what it did is rolled back."""


class PostgresResponseStore:
    def __init__(self, dsn: str, max_items: int = 10_000, ttl_s: float = 3600.0, max_bytes: int = 512 * 1024 * 1024,
                 clock: Callable[[], float] = time.time, pool_size: int = 8, connect_timeout_s: float | None = None,
                 timeout_s: float = 5.0):
        try:
            params = conninfo_to_dict(dsn)
        except psycopg.Error:  # libpq's message quotes the string, password included
            raise ValueError("the Responses store's PostgreSQL DSN is malformed (not shown: it may hold a "
                             "password)") from None
        self._dsn = dsn
        self._secrets = [s for s in (dsn, params.get("password")) if s]
        # The DSN's own connect_timeout wins; without one a down database fails a call in seconds, not minutes.
        self._connect_kwargs: dict[str, Any] = {}
        if "connect_timeout" not in params:
            self._connect_kwargs["connect_timeout"] = max(1, round(connect_timeout_s or timeout_s))
        # Every statement, the schema's included, is cancelled by the server past timeout_s. Prepended to the DSN's
        # own options: a later `-c` wins, so a statement_timeout the DSN sets is kept.
        self.timeout_s = timeout_s
        own = f"-c statement_timeout={max(1, round(timeout_s * 1000))}"
        self._connect_kwargs["options"] = f"{own} {params['options']}" if params.get("options") else own
        self.max_items = max_items
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.clock = clock
        self.pool_size = pool_size
        self._idle: list[psycopg.AsyncConnection] = []
        # At most pool_size calls hold a connection; the rest queue here (within the caller's bound). Without it a
        # burst of calls would open a connection each, past the server's max_connections (100 by default).
        self._slots = asyncio.Semaphore(pool_size)
        self._schema_ready = False
        self._evicted_seq = 0  # the seq of the last row this store evicted (rows below it are gone)

    def __repr__(self) -> str:  # never the DSN
        return f"PostgresResponseStore(table={TABLE!r}, max_items={self.max_items}, ttl_s={self.ttl_s})"

    # -- connections -----------------------------------------------------------------------------------------

    def _redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _unavailable(self, err: Exception) -> StoreUnavailable:
        log.warning("Responses store: PostgreSQL unavailable: %s", self._redact(str(err)).strip())
        if isinstance(err, psycopg.errors.QueryCanceled):  # our statement_timeout: reached, but stuck or slow
            return StoreUnavailable(f"the Responses store's PostgreSQL database did not answer within "
                                    f"{self.timeout_s:g} s; retry shortly")
        return StoreUnavailable("the Responses store's PostgreSQL database is unreachable; retry shortly")

    async def _connect(self) -> psycopg.AsyncConnection:
        conn = await psycopg.AsyncConnection.connect(self._dsn, autocommit=True,
                                                     application_name="serve_app-response-store",
                                                     **self._connect_kwargs)
        if not self._schema_ready:
            try:
                async with conn.transaction():
                    await conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
                    await conn.execute(_SCHEMA)
                    if await (await conn.execute(f"SELECT 1 FROM {TABLE}_totals")).fetchone() is None:
                        await conn.execute(_COUNT_ONCE)
            except BaseException:
                await conn.close()
                raise
            self._schema_ready = True
        return conn

    async def _take(self) -> tuple[psycopg.AsyncConnection, bool]:
        if self._idle:
            return self._idle.pop(), True
        return await self._connect(), False

    async def _give(self, conn: psycopg.AsyncConnection) -> None:
        if (not conn.closed and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
                and len(self._idle) < self.pool_size):
            self._idle.append(conn)
        else:
            await conn.close()

    async def _run(self, work: Callable[[psycopg.AsyncConnection], Awaitable[Any]]) -> Any:
        async with self._slots:
            return await self._run_on_a_connection(work)

    async def _run_on_a_connection(self, work: Callable[[psycopg.AsyncConnection], Awaitable[Any]]) -> Any:
        for attempt in range(2):
            try:
                conn, pooled = await self._take()
            except psycopg.OperationalError as err:
                raise self._unavailable(err) from None
            try:
                result = await work(conn)
            except psycopg.errors.QueryCanceled as err:  # statement_timeout: the server is there, retrying would
                await conn.close()  # only wait as long again
                raise self._unavailable(err) from None
            except psycopg.OperationalError as err:
                await conn.close()
                if pooled and attempt == 0:  # the server dropped idle connections (a restart): drop the rest of
                    await self.close()  # the pool too, and try once more on a fresh one
                    continue
                raise self._unavailable(err) from None
            except asyncio.CancelledError:  # the caller's bound ran out: the connection's state is unknown
                await conn.close()
                raise
            except BaseException:
                await self._give(conn)
                raise
            await self._give(conn)
            return result
        raise AssertionError("unreachable")

    # -- the store -------------------------------------------------------------------------------------------

    async def count(self) -> int:
        """How many unexpired records are stored (tests; the other stores' `len`)."""
        async def count(conn):
            await conn.execute(f"DELETE FROM {TABLE} WHERE expires <= %s", (self.clock(),))
            return (await (await conn.execute(f"SELECT items FROM {TABLE}_totals")).fetchone())[0]

        return await self._run(count)

    async def put(self, key: str, record: Any, size: int | None = None, parent: str | None = None) -> bool:
        """Store `record`, continuing `parent`'s conversation when one is named. False, and nothing stored, when
        `parent` is not stored, `key` is stored and continued by another record, or the conversation with this
        record would be larger than a cap (ResponseStoreCore.put)."""
        encoded = encode_record(record, size, self.max_bytes)
        if encoded is None:
            return False
        text, size = encoded
        now = self.clock()

        async def put(conn):
            try:
                async with conn.transaction():
                    evicted = await self._put(conn, key, text, size, parent, now)
            except _Refused:
                return False
            if evicted:  # committed: only now are the rows below it gone
                self._evicted_seq = max(self._evicted_seq, evicted)
            return True

        return await self._run(put)

    async def _put(self, conn: psycopg.AsyncConnection, key: str, text: str, size: int, parent: str | None,
                   now: float) -> int:
        """The put in its transaction (sqlite_store.py `_put`); the seq of the last conversation it evicted."""
        async def one(query: str, params: Any) -> tuple | None:
            return await (await conn.execute(query, params)).fetchone()

        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (_PUT_LOCK,))
        await conn.execute(f"DELETE FROM {TABLE} WHERE expires <= %s", (now,))
        continued, old_size, root, held_items, held_bytes, count, total = await one(_SQL.put_state, {"k": key, "p": parent})
        if continued or parent == key or (parent is not None and root is None):
            raise _Refused
        if root is not None and (held_items >= self.max_items or held_bytes + size > self.max_bytes):
            raise _Refused
        if old_size is not None:  # replaced: a record nothing continues (a first one has then no others)
            await conn.execute(f"DELETE FROM {TABLE} WHERE id = %s", (key,))
            count, total = count - 1, total - old_size
        # seq from the column's sequence, which only goes up (the eviction floor below relies on that).
        insert = (f"INSERT INTO {TABLE} (id, seq, expires, size, record, parent, root) "
                  f"VALUES (%s, {{}}, %s, %s, %s, %s, %s)")
        if root is None:
            await conn.execute(insert.format(_NEXT_SEQ), (key, now + self.ttl_s, size, text, None, None))
        else:
            await conn.execute(insert.format("%s"), (key, CONTINUED_SEQ, CONTINUED_EXPIRES, size, text, parent, root))
            await conn.execute(f"UPDATE {TABLE} SET seq = {_NEXT_SEQ}, expires = %s WHERE id = %s",
                               (now + self.ttl_s, root))
        count, total = count + 1, total + size  # what the trigger added
        evicted = 0
        while count > self.max_items or total > self.max_bytes:  # the least recently continued go, a batch at a time
            # From past the last conversation evicted: the index keeps the deleted rows' entries until a vacuum,
            # and a scan from the start would step over every one of them on every put at the cap. First records
            # take seq values from the sequence under the put lock, so no live one lies below it.
            cur = await conn.execute(
                f"SELECT r.id, r.seq, c.n, c.bytes FROM {TABLE} r CROSS JOIN LATERAL "
                f"(SELECT COUNT(*) AS n, COALESCE(SUM(m.size), 0) AS bytes FROM {TABLE} m "
                f"WHERE m.id = r.id OR m.root = r.id) c "
                f"WHERE r.seq > %s AND r.seq < %s ORDER BY r.seq LIMIT %s",
                (self._evicted_seq, CONTINUED_SEQ, max(count - self.max_items, _EVICT_BATCH)))
            gone = []
            for oid, oseq, n, nbytes in await cur.fetchall():
                if count <= self.max_items and total <= self.max_bytes:
                    break
                gone.append(oid)
                count, total, evicted = count - n, total - nbytes, oseq
            if not gone:  # totals off from the table (a writer that bypassed the trigger): never spin
                break
            await conn.execute(f"DELETE FROM {TABLE} WHERE id = ANY(%s)", (gone,))  # the trigger takes the rest
        return evicted

    async def get(self, key: str) -> Any | None:
        head = await self.head(key)
        return None if head is None else head[1]

    async def head(self, key: str) -> tuple[str | None, Any] | None:
        """`key`'s parent and record, where it is visible (StoreClient.chain)."""
        now = self.clock()

        async def head(conn):
            return await (await conn.execute(_SQL.get, {"key": key, "now": now})).fetchone()

        row = await self._run(head)
        return None if row is None else (row[1], json.loads(row[0]))

    async def visible(self, key: str) -> bool:
        """Whether `key` is stored and visible, without reading it (ingress/responses/recent.py)."""
        now = self.clock()

        async def visible(conn):
            return await (await conn.execute(_SQL.visible, {"key": key, "now": now})).fetchone()

        return await self._run(visible) is not None

    async def chain(self, key: str, links: bool = False) -> list[Any] | None:
        """The records of `key`'s chain, its conversation's first first and `key`'s own last; None where `key` is
        not stored. `links`: each as (id, parent, record)."""
        now = self.clock()

        async def chain(conn):
            return await (await conn.execute(_SQL.chain, {"key": key, "limit": self.max_items})).fetchall()

        return chain_records(await self._run(chain), now, links)

    async def delete(self, key: str) -> bool:
        now = self.clock()

        async def delete(conn):
            async with conn.transaction():
                # Under the put lock: a put continuing this record cannot slip in between the statements.
                await conn.execute("SELECT pg_advisory_xact_lock(%s)", (_PUT_LOCK,))
                if await (await conn.execute(_SQL.visible, {"key": key, "now": now})).fetchone() is None:
                    return False
                for statement in _SQL.delete:
                    await conn.execute(statement, {"key": key})
                return True

        return await self._run(delete)

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.close()
