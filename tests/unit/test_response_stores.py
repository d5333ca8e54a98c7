"""The Responses stores behind one interface (serve_app/ingress/responses/store.py): one behaviour table run
against each backend — in memory, SQLite on a file, PostgreSQL on a real server (the session's `postgres` fixture,
a fresh database per test). Then what only the persistent ones promise (a second store object on the same
database, as a restarted or a second store replica is, sees the first one's records and keeps the caps with it),
and PostgreSQL's own: schema creation by replicas starting at once, a dropped connection, an unreachable
database (503 in the API's envelope, the DSN's password nowhere)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import random
import signal
import sqlite3
import threading
from pathlib import Path

import httpx
import openai
import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from serve_app.ingress.context import IngressContext
from serve_app.ingress.responses.postgres_store import TABLE, PostgresResponseStore
from serve_app.ingress.responses.sqlite_store import SqliteResponseStore
from serve_app.ingress.responses.store import DSN_ENV, ResponseStore, ResponseStoreCore, StoreClient, \
    StoreUnavailable, make_store
from serve_app.ingress.server import create_app
from tests.support.postgres import Blocking, fresh_database
from test_responses_routes import SETTINGS, StubService


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def backend(request):
    return request.param


@pytest.fixture
def open_store(backend, request, tmp_path):
    """`open_store(**caps)`: a store object of this test's backend. For sqlite and postgres every call opens
    another object on the same database (what a restarted, or a second, store replica does)."""
    dsn = fresh_database(request.getfixturevalue("postgres")) if backend == "postgres" else None
    opened = []

    def open_(max_items=100, ttl_s=1e9, max_bytes=10_000, clock=None, timeout_s=5.0):
        clock = clock or Clock()
        if backend == "memory":
            s = ResponseStoreCore(max_items=max_items, ttl_s=ttl_s, max_bytes=max_bytes, clock=clock)
        elif backend == "sqlite":
            s = SqliteResponseStore(open_.path, max_items=max_items, ttl_s=ttl_s, max_bytes=max_bytes,
                                    clock=clock, timeout_s=timeout_s)
        else:
            s = Blocking(PostgresResponseStore(open_.dsn, max_items=max_items, ttl_s=ttl_s, max_bytes=max_bytes,
                                               clock=clock, timeout_s=timeout_s))
        opened.append(s)
        return s

    open_.dsn = dsn
    open_.path = str(tmp_path / "r.db")
    yield open_
    for s in opened:
        getattr(s, "stop", getattr(s, "close", lambda: None))()


persistent = pytest.mark.parametrize("backend", ["sqlite", "postgres"])
postgres_only = pytest.mark.parametrize("backend", ["postgres"])


# -- the behaviour table, every backend -------------------------------------------------------------------------


def test_put_get_delete(open_store):
    s = open_store()
    record = {"response": {"id": "resp_1", "output": [{"text": "ünïcode \u0000 nul"}]}, "items": [1, [2], None]}
    assert s.put("resp_1", record) is True
    assert s.get("resp_1") == record and s.get("resp_nope") is None
    assert s.visible("resp_1") is True and s.visible("resp_nope") is False
    assert s.delete("resp_1") is True and s.get("resp_1") is None and s.visible("resp_1") is False
    assert s.delete("resp_1") is False and len(s) == 0


def test_entries_expire_after_the_ttl(open_store):
    clock = Clock()
    s = open_store(ttl_s=60, clock=clock)
    s.put("a", {"v": 1})
    clock.t += 30
    s.put("b", {"v": 2})
    assert s.get("a") == {"v": 1}
    clock.t += 31  # a is 61 s old, b 31 s
    assert s.get("a") is None and s.get("b") == {"v": 2} and len(s) == 1
    assert s.visible("a") is False and s.visible("b") is True
    clock.t += 30
    assert s.get("b") is None and len(s) == 0


def test_overwrite_refreshes_ttl_and_age(open_store):
    clock = Clock()
    s = open_store(max_items=2, ttl_s=10, clock=clock)
    s.put("a", 1)
    s.put("b", 2)
    clock.t += 8
    s.put("a", 3)  # now the newest, with a new TTL
    s.put("c", 4)  # past the item cap: the oldest goes, which is now b
    assert s.get("b") is None and s.get("a") == 3 and s.get("c") == 4
    clock.t += 7  # 15 s after a's first put, 7 after its second
    assert s.get("a") == 3 and len(s) == 2
    clock.t += 4
    assert s.get("a") is None and len(s) == 0


def test_item_cap_evicts_the_oldest(open_store):
    s = open_store(max_items=3)
    for i in range(5):
        assert s.put(f"r{i}", {"i": i})
    assert len(s) == 3 and s.get("r0") is None and s.get("r1") is None
    assert [s.get(f"r{i}")["i"] for i in (2, 3, 4)] == [2, 3, 4]


def test_byte_cap_evicts_the_oldest_and_refuses_a_record_larger_than_the_cap(open_store):
    s = open_store(max_bytes=100)
    assert s.put("x", "y" * 40) and s.put("z", "w" * 40)  # 42 bytes each as JSON
    assert s.put("q", "v" * 40)  # 126 bytes in all: the oldest goes
    assert s.get("x") is None and s.get("z") == "w" * 40 and s.get("q") == "v" * 40
    assert s.put("huge", "h" * 200) is False and s.get("huge") is None
    assert s.get("z") is not None  # a refused record evicts nothing


def test_memory_store_accounts_bytes_back_to_zero():
    clock = Clock()
    s = ResponseStoreCore(max_items=10, ttl_s=5, max_bytes=100, clock=clock)
    s.put("a", "x" * 10)
    assert s.bytes == 12
    clock.t += 6
    assert s.get("a") is None and s.bytes == 0


# -- chains: each record holds its own turn and names the one it continues ---------------------------------------


def test_a_chain_reads_back_root_first(open_store):
    s = open_store()
    assert s.put("a", {"items": ["a"]}) and s.put("b", {"items": ["b"]}, parent="a")
    assert s.put("c", {"items": ["c"]}, parent="b") and s.put("b2", {"items": ["b2"]}, parent="a")  # a fork
    assert s.chain("c") == [{"items": ["a"]}, {"items": ["b"]}, {"items": ["c"]}]
    assert s.chain("b2") == [{"items": ["a"]}, {"items": ["b2"]}]
    assert s.chain("a") == [{"items": ["a"]}] and s.chain("nope") is None
    assert s.get("b") == {"items": ["b"]} and len(s) == 4


def test_a_put_whose_parent_is_not_stored_or_descends_from_it_stores_nothing(open_store):
    s = open_store()
    assert s.put("x", 1, parent="nope") is False and s.get("x") is None and len(s) == 0
    s.put("a", 1)
    s.put("b", 2, parent="a")
    assert s.put("a", 3, parent="b") is False  # a cycle
    assert s.put("a", 3, parent="a") is False
    assert s.get("a") == 1 and s.chain("b") == [1, 2]


def test_a_chain_past_a_cap_is_refused_whole(open_store):
    s = open_store(max_items=3, max_bytes=100)
    assert s.put("a", "y" * 38) and s.put("b", "y" * 38, parent="a")  # 40 bytes each as JSON
    assert s.put("c", "y" * 28, parent="b") is False  # 110 bytes with its chain: more than the cap
    assert s.put("c", "y" * 8, parent="b")  # 90
    assert s.put("d", 1, parent="c") is False  # four records: more than the item cap
    assert s.chain("c") == ["y" * 38, "y" * 38, "y" * 8] and len(s) == 3


def test_a_record_keeps_its_chain_alive_past_the_chains_own_ttl(open_store):
    clock = Clock()
    s = open_store(ttl_s=10, clock=clock)
    s.put("a", 1)
    s.put("x", 0)
    clock.t += 8
    s.put("b", 2, parent="a")  # refreshes a (and not x)
    clock.t += 5  # 13 s after a's put, 5 after b's
    assert s.get("x") is None and s.get("a") == 1 and s.chain("b") == [1, 2]
    clock.t += 6
    assert s.chain("b") is None and s.get("a") is None and len(s) == 0


def test_eviction_takes_the_least_recently_continued_conversation_whole(open_store):
    s = open_store(max_items=5)
    s.put("a", 1)
    s.put("x", 0)
    s.put("b", 2, parent="a")  # a's conversation is now the newer
    s.put("y", 3)
    s.put("z", 4)
    s.put("w", 5)  # six: x goes, not a
    assert s.get("x") is None and s.chain("b") == [1, 2]
    s.put("b2", 6, parent="a")  # a fork: the same conversation, continued again (y goes)
    s.put("v", 7)  # z goes
    assert s.get("y") is None and s.get("z") is None and s.chain("b2") == [1, 6] and len(s) == 5
    s.put("u", 8)  # w goes
    s.put("t", 9)  # the oldest conversation is now a's: all three of its records go at once
    assert [s.get(k) for k in ("a", "b", "b2", "w")] == [None] * 4 and len(s) == 3


def test_a_record_another_continues_cannot_be_replaced(open_store):
    s = open_store()
    s.put("a", 1)
    s.put("b", 2, parent="a")
    assert s.put("a", 3) is False and s.chain("b") == [1, 2]
    assert s.put("b", 4, parent="a") and s.chain("b") == [1, 4]  # nothing continues b: replaced
    assert s.put("b", 5) and s.chain("b") == [5] and s.put("a", 6) and s.chain("a") == [6] and len(s) == 2


def test_deleting_a_record_a_later_one_continues_hides_it_and_keeps_that_chain(open_store):
    s = open_store()
    s.put("a", 1)
    s.put("b", 2, parent="a")
    assert s.delete("a") is True and s.get("a") is None and s.chain("a") is None
    assert s.delete("a") is False and s.put("x", 9, parent="a") is True  # hidden, yet a chain may still go on
    assert s.chain("b") == [1, 2] and s.chain("x") == [1, 9] and len(s) == 3
    assert s.delete("b") and s.chain("b") is None and len(s) == 2  # a: x still continues it
    assert s.delete("x") and len(s) == 0  # a went with the last record that continued it
    s.put("a", 7)  # stored again: visible again
    assert s.get("a") == 7 and s.chain("a") == [7]


def test_hidden_records_go_with_the_last_record_that_needs_them(open_store):
    """A chain a → b → c → d with b and c deleted (hidden, kept for d): deleting d takes c and b with it, not a
    (visible) nor a fork's ancestors that another record still continues."""
    s = open_store()
    for key, parent in [("a", None), ("b", "a"), ("c", "b"), ("d", "c"), ("e", "b")]:
        assert s.put(key, key, parent=parent)
    assert s.delete("b") and s.delete("c") and len(s) == 5
    assert s.chain("d") == ["a", "b", "c", "d"] and s.chain("e") == ["a", "b", "e"]
    assert not s.visible("b") and not s.visible("c") and s.visible("d")  # hidden: in chains only
    assert s.head("d") == ("c", "d") and s.head("c") is None and s.head("a") == (None, "a")
    assert s.chain("d", links=True) == [("a", None, "a"), ("b", "a", "b"), ("c", "b", "c"), ("d", "c", "d")]
    assert s.delete("d") and len(s) == 3  # c went; b stays for e
    assert s.chain("e") == ["a", "b", "e"] and s.get("a") == "a"
    assert s.delete("e") and len(s) == 1 and s.chain("a") == ["a"]  # b went; a is visible: it stays
    assert s.delete("a") and len(s) == 0


# -- persistent backends: a second store object on the same database --------------------------------------------


@persistent
def test_a_reopened_store_finds_the_records(open_store):
    first = open_store()
    first.put("resp_1", {"response": {"id": "resp_1"}, "items": [1, 2]})
    first.close()
    assert open_store().get("resp_1") == {"response": {"id": "resp_1"}, "items": [1, 2]}


@persistent
def test_two_stores_on_one_database_see_each_others_writes_and_share_the_caps(open_store):
    """Two store replicas (or a store replica and its replacement) on one database."""
    clock = Clock()
    a, b = open_store(max_items=3, ttl_s=60, clock=clock), open_store(max_items=3, ttl_s=60, clock=clock)
    a.put("r1", {"by": "a"})
    assert b.get("r1") == {"by": "a"}
    b.put("r2", {"by": "b"})
    assert a.get("r2") == {"by": "b"}
    assert b.delete("r1") and a.get("r1") is None
    a.put("r3", 3)
    b.put("r4", 4)
    a.put("r5", 5)  # four entries: the cap holds over both writers' records, the oldest (b's r2) goes
    assert a.get("r2") is None and len(b) == 3
    clock.t += 61
    assert b.get("r5") is None and len(a) == 0


@persistent
def test_concurrent_puts_from_two_stores_keep_the_caps(open_store):
    stores = [open_store(max_items=20), open_store(max_items=20)]
    errors = []

    def writer(n):
        try:
            for i in range(30):
                stores[n].put(f"w{n}-{i}", {"i": i})
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(n,)) for n in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(stores[0]) == 20
    # Only the oldest went: what is left of each writer's puts is its newest ones, whatever the interleaving.
    kept = [[i for i in range(30) if stores[1 - n].get(f"w{n}-{i}") is not None] for n in (0, 1)]
    assert len(kept[0]) + len(kept[1]) == 20
    assert all(k == list(range(30 - len(k), 30)) for k in kept)


@persistent
def test_conversations_put_at_once_from_two_stores_are_never_cut(backend, open_store):
    """Two store objects on one database, three writers each continuing conversations of their own, with the item
    cap evicting all along: every record still stored reads back a whole chain of its own conversation's turns, and
    the totals stay exact."""
    stores = [open_store(max_items=25), open_store(max_items=25)]
    errors = []

    def writer(n):
        try:
            last: dict[int, str | None] = {}
            for t in range(15):
                for c in range(3):
                    key = f"w{n}-c{c}-t{t}"
                    parent = last.get(c)
                    if not stores[n % 2].put(key, {"conv": f"{n}-{c}", "t": t}, None, parent):
                        assert stores[n % 2].put(key, {"conv": f"{n}-{c}", "t": t})  # its chain was evicted
                    last[c] = key
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    stored = [f"w{n}-c{c}-t{t}" for n in range(3) for c in range(3) for t in range(15)
              if stores[0].get(f"w{n}-c{c}-t{t}") is not None]
    assert 0 < len(stored) <= 25 and len(stores[1]) <= 25
    for key in stored:
        chain = stores[1].chain(key)
        assert chain is not None and chain[-1] == stores[0].get(key), key
        assert {r["conv"] for r in chain} == {chain[-1]["conv"]}, key
        assert [r["t"] for r in chain] == list(range(chain[0]["t"], chain[-1]["t"] + 1)), key
    counted, table = _totals(backend, open_store)
    assert tuple(counted) == tuple(table)


def _totals(backend: str, open_store) -> tuple[tuple[int, int], tuple[int, int]]:
    """(what the store's totals row says, what counting the table gives): the caps are checked against the first."""
    if backend == "sqlite":
        with sqlite3.connect(open_store.path) as conn:
            return (conn.execute("SELECT items, bytes FROM totals").fetchone(),
                    conn.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses").fetchone())
    with psycopg.connect(open_store.dsn) as conn:
        return (conn.execute(f"SELECT items, bytes FROM {TABLE}_totals").fetchone(),
                conn.execute(f"SELECT COUNT(*), COALESCE(SUM(size), 0)::bigint FROM {TABLE}").fetchone())


@persistent
@pytest.mark.parametrize("seed", range(3))
def test_random_calls_agree_with_the_in_memory_store_and_keep_the_totals_exact(backend, open_store, seed):
    """Puts (new keys, overwrites, sizes near the byte cap, continuing another key's chain or not), gets, chains,
    deletes and the clock moving on, from two store objects on one database, against the in-memory store as the
    model: every answer agrees, and the totals the caps are checked against equal the table's own count and sum
    throughout."""
    rng = random.Random(seed)
    clock = Clock()
    caps = dict(max_items=rng.choice([3, 8, 20]), ttl_s=50, max_bytes=rng.choice([200, 1_000, 10_000]))
    model = ResponseStoreCore(clock=clock, **caps)
    stores = [open_store(clock=clock, **caps), open_store(clock=clock, **caps)]
    keys = [f"r{i}" for i in range(25)]
    recent: list[str] = []  # the last keys put: conversations going on, and forks of them
    for step in range(160):
        s, key = rng.choice(stores), rng.choice(keys)
        op = rng.random()
        if op < 0.5:
            size = rng.choice([1, 10, 60, rng.randrange(1, caps["max_bytes"] // 4 + 20)])
            record = {"step": step, "text": "é\n\"" * rng.randrange(3)}
            parent = rng.choice([None, rng.choice(keys), *recent[-3:], *recent[-1:] * 3])
            stored = s.put(key, record, size, parent)
            assert stored is model.put(key, record, size, parent), (step, key, parent)
            recent += [key] * stored
        elif op < 0.75:
            key = rng.choice([key, *recent[-2:]])
            assert s.get(key) == model.get(key), (step, key)
            assert s.chain(key) == model.chain(key), (step, key)
            assert s.chain(key, links=True) == model.chain(key, links=True), (step, key)
            assert s.head(key) == model.head(key), (step, key)
        elif op < 0.9:
            key = rng.choice([key, *recent[-6:]])
            expected = model.get(key) is not None  # an expired key may linger in either store until swept
            if expected:
                assert s.delete(key) is model.delete(key) is True, (step, key)
            else:
                s.delete(key), model.delete(key)
        else:
            clock.t += rng.choice([1, 10, 30])
        if step % 20 == 19:
            stored, counted = _totals(backend, open_store)
            assert tuple(stored) == tuple(counted), step
            assert len(s) == len(model), step
    assert {k: s.get(k) for k in keys} == {k: model.get(k) for k in keys}
    assert {k: s.chain(k) for k in keys} == {k: model.chain(k) for k in keys}
    stored, counted = _totals(backend, open_store)
    assert tuple(stored) == tuple(counted)


_SCHEMA_BEFORE_TOTALS = """CREATE TABLE {t} (id TEXT PRIMARY KEY, seq {seq} NOT NULL, expires {real} NOT NULL,
    size BIGINT NOT NULL, record TEXT NOT NULL)"""


@persistent
def test_a_database_written_before_the_totals_existed_is_counted_on_open(backend, open_store):
    """A store file or database from before the totals table and the chains: its rows are counted when a store
    opens it, so the caps hold over them at once, and read as chains of one."""
    rows = [(f"old{i}", i + 1, 1e12, 20, '{"old": %d}' % i) for i in range(5)]
    if backend == "sqlite":
        with sqlite3.connect(open_store.path) as conn:
            conn.execute(_SCHEMA_BEFORE_TOTALS.format(t="responses", seq="INTEGER", real="REAL"))
            conn.executemany("INSERT INTO responses VALUES (?, ?, ?, ?, ?)", rows)
    else:
        with psycopg.connect(open_store.dsn) as conn:
            conn.execute(_SCHEMA_BEFORE_TOTALS.format(t=TABLE, seq="BIGSERIAL", real="DOUBLE PRECISION"))
            conn.cursor().executemany(f"INSERT INTO {TABLE} (id, expires, size, record) VALUES (%s, %s, %s, %s)",
                                      [(i, e, n, r) for i, _, e, n, r in rows])  # seq from the old BIGSERIAL
    s = open_store(max_items=6, max_bytes=10_000)
    assert len(s) == 5 and s.get("old0") == {"old": 0}
    s.put("new1", 1, 20)
    s.put("new2", 2, 20)  # seven rows: the oldest of the old ones goes
    assert len(s) == 6 and s.get("old0") is None and s.get("old1") == {"old": 1} and s.get("new1") == 1
    stored, counted = _totals(backend, open_store)
    assert tuple(stored) == tuple(counted) == (6, 120)
    # Its records (each holding its whole history) are chains of one, and a new record may continue one.
    assert s.chain("old4") == [{"old": 4}] and s.put("new3", 3, 20, "old4")
    assert s.chain("new3") == [{"old": 4}, 3] and open_store().chain("new3") == [{"old": 4}, 3]


# -- persistent backends: a database that fails or hangs is StoreUnavailable (503), never a 500 or a hang --------


class _WriteLock:
    """Another client holding the store's table locked, as a stuck migration or a long transaction does: SQLite's
    write lock (in WAL mode readers go on), PostgreSQL's ACCESS EXCLUSIVE lock (everything waits)."""

    def __init__(self, backend: str, open_store):
        self.backend, self.open_store = backend, open_store

    def __enter__(self):
        if self.backend == "sqlite":
            self.conn = sqlite3.connect(self.open_store.path, isolation_level=None)
            self.conn.execute("BEGIN IMMEDIATE")
        else:
            self.conn = psycopg.connect(self.open_store.dsn)
            self.conn.execute(f"LOCK TABLE {TABLE} IN ACCESS EXCLUSIVE MODE")
        return self

    def __exit__(self, *exc):
        self.conn.rollback()
        self.conn.close()


@persistent
def test_a_database_locked_by_another_client_is_store_unavailable_and_recovers(backend, open_store):
    """Without a bound the call would wait as long as the lock is held (PostgreSQL: forever)."""
    s = open_store(timeout_s=0.2)
    s.put("a", 1)
    with _WriteLock(backend, open_store):
        calls = [lambda: s.put("b", 2), lambda: s.delete("a")]
        if backend == "postgres":
            calls.append(lambda: s.get("a"))
        for call in calls:
            with pytest.raises(StoreUnavailable) as err:
                call()
            assert "retry shortly" in str(err.value)
    assert s.get("a") == 1 and s.put("b", 2) and s.get("b") == 2  # the lock released, the same store serves


@persistent
def test_a_database_file_that_is_not_a_database_is_store_unavailable(backend, open_store):
    if backend == "postgres":  # PostgreSQL's counterpart: a database that is not there
        open_store.dsn = make_conninfo(open_store.dsn, dbname="no_such_database")
    else:
        Path(open_store.path).write_bytes(b"this is not a database " * 100)
    s = open_store()
    for call in (lambda: s.get("a"), lambda: s.put("a", 1), lambda: s.delete("a"), lambda: len(s)):
        with pytest.raises(StoreUnavailable):
            call()


def test_sqlite_store_recovers_once_its_file_is_usable(tmp_path):
    path = tmp_path / "r.db"
    path.write_bytes(b"garbage " * 100)
    s = SqliteResponseStore(str(path))
    with pytest.raises(StoreUnavailable):
        s.put("a", 1)
    path.unlink()  # an operator removes the broken file: no restart needed
    assert s.put("a", 1) and s.get("a") == 1
    s.close()


async def test_postgres_connections_carry_the_statement_timeout_unless_the_dsn_sets_its_own(postgres):
    dsn = fresh_database(postgres)
    for store_dsn, expected in ((dsn, "3s"), (make_conninfo(dsn, options="-c statement_timeout=99"), "99ms")):
        s = PostgresResponseStore(store_dsn, timeout_s=3)
        conn, _ = await s._take()
        try:
            assert (await (await conn.execute("SHOW statement_timeout")).fetchone())[0] == expected
        finally:
            await conn.close()


# -- PostgreSQL -------------------------------------------------------------------------------------------------


@postgres_only
def test_replicas_starting_at_once_create_the_schema_once(open_store):
    stores = [open_store() for _ in range(6)]
    start = threading.Barrier(len(stores))
    errors = []

    def first_use(n):
        try:
            start.wait()
            stores[n].put(f"r{n}", n)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=first_use, args=(n,)) for n in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and sorted(stores[0].get(f"r{n}") for n in range(6)) == list(range(6))
    with psycopg.connect(open_store.dsn) as conn:
        assert conn.execute("SELECT COUNT(*) FROM pg_tables WHERE tablename = %s", (TABLE,)).fetchone()[0] == 1


@postgres_only
def test_a_connection_the_server_dropped_is_replaced(open_store):
    s = open_store()
    s.put("a", 1)
    held = [s.run(s.store._take())[0] for _ in range(3)]  # three connections in the pool, as concurrent calls
    for conn in held:  # leave it
        s.run(s.store._give(conn))
    with psycopg.connect(open_store.dsn, autocommit=True) as conn:  # what a database restart does to the pool
        killed = conn.execute("SELECT COUNT(pg_terminate_backend(pid)) FROM pg_stat_activity "
                              "WHERE application_name = 'serve_app-response-store' "
                              # this test's database only: the session's PostgreSQL also serves the integration
                              # server's store, whose connections are not this pool's
                              "AND datname = current_database()").fetchone()[0]
    assert killed == 3
    assert s.get("a") == 1 and s.put("b", 2) and s.get("b") == 2


DOWN = "postgresql://agent:hunter2-secret@127.0.0.1:1/responses"  # nothing listens on port 1


def test_unreachable_database_raises_store_unavailable_without_the_password(caplog):
    s = Blocking(PostgresResponseStore(DOWN, connect_timeout_s=2))
    with caplog.at_level(logging.DEBUG):
        for call in (lambda: s.get("a"), lambda: s.put("a", 1), lambda: s.delete("a"), lambda: len(s)):
            with pytest.raises(StoreUnavailable) as err:
                call()
            assert "unreachable" in str(err.value) and "hunter2" not in str(err.value)
    assert "Connection refused" in caplog.text  # the operator sees why
    assert "hunter2" not in caplog.text and "hunter2" not in repr(s.store)
    s.stop()


def test_malformed_dsn_fails_at_start_without_echoing_it():
    with pytest.raises(ValueError) as err:
        PostgresResponseStore("host=db password=hunter2 =broken")
    assert "malformed" in str(err.value) and "hunter2" not in str(err.value)


@pytest.fixture(params=["postgres_down", "sqlite_corrupt", "sqlite_locked", "postgres_locked"])
def failing_store(request, tmp_path):
    """(kind, store): a store whose database cannot serve: PostgreSQL down, an SQLite file that is not a database,
    or either one locked by another client past the store's timeout."""
    kind = request.param
    if kind == "postgres_down":
        yield kind, PostgresResponseStore(DOWN, connect_timeout_s=2)
        return
    if kind == "sqlite_corrupt":
        (tmp_path / "r.db").write_bytes(b"garbage " * 100)
        yield kind, SqliteResponseStore(str(tmp_path / "r.db"))
        return
    backend = kind.split("_")[0]
    where = type("Where", (), {})()  # what _WriteLock reads: the SQLite path or the PostgreSQL DSN
    if backend == "sqlite":
        where.path = str(tmp_path / "r.db")
        store = SqliteResponseStore(where.path, timeout_s=0.2)
        store.put("resp_1", {"response": {"id": "resp_1"}, "items": []})
    else:
        where.dsn = fresh_database(request.getfixturevalue("postgres"))
        writer = Blocking(PostgresResponseStore(where.dsn))
        writer.put("resp_1", {"response": {"id": "resp_1"}, "items": []})
        writer.stop()
        store = PostgresResponseStore(where.dsn, timeout_s=0.2)  # its connections open on the test's own loop
    with _WriteLock(backend, where):
        yield kind, store
    close = store.close()
    if inspect.isawaitable(close):
        asyncio.run(close)


async def test_a_failing_database_answers_503_in_the_openai_envelope(failing_store):
    kind, store = failing_store
    app = create_app(IngressContext(settings=SETTINGS, service=StubService(), secret=b"s",
                                    response_store=StoreClient(store)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as c:
        answers = {"delete": await c.delete("/v1/responses/resp_1"),
                   "get": await c.get("/v1/responses/resp_1"),
                   "follow-up": await c.post("/v1/responses", json={"model": "m1", "input": "hi",
                                                                    "previous_response_id": "resp_1"})}
    # SQLite runs in WAL mode: reads go on while another client holds the write lock; only writes wait.
    refused = ["delete"] if kind == "sqlite_locked" else list(answers)
    for what, r in answers.items():
        if what not in refused:
            assert r.status_code == 200, (what, r.text)
            continue
        assert r.status_code == 503, (what, r.text)
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "store_unavailable"
        assert "retry shortly" in err["message"] and "hunter2" not in r.text
    # Storing after an answer is best effort: the answer still goes out.
    client = openai.AsyncOpenAI(api_key="x", base_url="http://app/v1", max_retries=0,
                                http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)))
    assert (await client.responses.create(model="m1", input="hi")).output_text == "Hello"


# -- the deployment's wiring ------------------------------------------------------------------------------------


def test_postgres_dsn_from_config_else_from_the_environment(postgres):
    dsn = fresh_database(postgres)
    with pytest.raises(ValueError, match=f"response_store_dsn or the {DSN_ENV}"):
        make_store("postgres", None, 10, 60, 1000, None, environ={})
    from_env = Blocking(make_store("postgres", None, 10, 60, 1000, None, environ={DSN_ENV: dsn}))
    from_config = Blocking(make_store("postgres", None, 10, 60, 1000, dsn, environ={DSN_ENV: DOWN}))  # config wins
    from_env.put("a", 1)
    assert from_config.get("a") == 1
    from_env.stop()
    from_config.stop()


async def test_the_postgres_store_waits_on_the_event_loop_and_the_loop_runs_on(postgres, monkeypatch):
    """No worker thread (beside a busy loop one waits seconds for the GIL: load/probe_store_wait.py), and a call
    that waits for the server (here for another client's table lock) leaves the loop free meanwhile."""
    store = ResponseStore.func_or_class(10, 60, 10_000, "postgres", None, fresh_database(postgres))
    threads = []
    to_thread = asyncio.to_thread
    monkeypatch.setattr(asyncio, "to_thread", lambda *a, **k: threads.append(a) or to_thread(*a, **k))
    assert await store.put("a", {"v": 1})
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    open_ = type("Where", (), {"dsn": store.core._dsn})()
    ticking = asyncio.create_task(ticker())
    with _WriteLock("postgres", open_):
        waiting = asyncio.create_task(store.get("a"))
        await asyncio.sleep(0.5)
        assert not waiting.done() and ticks >= 10  # a blocked loop would not have ticked at all
    assert await waiting == {"v": 1}  # the lock released: the call that waited for it answers
    ticking.cancel()
    assert await store.delete("a") and await store.get("a") is None
    assert threads == []
    await store.core.close()


async def test_the_deployment_bounds_a_call_to_a_database_that_stops_answering(postgres):
    """A server that took the connection and then never answers cannot enforce its statement_timeout (here its
    backend process is stopped, as a hung or partitioned server is): the deployment's own bound turns the call
    into StoreUnavailable, which the routes answer 503, instead of a request that hangs."""
    store = ResponseStore.func_or_class(10, 60, 10_000, "postgres", None, fresh_database(postgres), 0.5)
    assert await store.put("a", {"v": 1})
    (conn,) = store.core._idle  # the pooled connection the next call takes
    pid = conn.info.backend_pid
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(StoreUnavailable, match="did not answer within 0.5 s"):
            await asyncio.wait_for(store.get("a"), 120)  # only a safety net: unbounded, the call never returns
    finally:
        os.kill(pid, signal.SIGCONT)
    assert await store.get("a") == {"v": 1}  # the server answers again: so does the store


class ActorDiedError(Exception):  # named like Ray's: errors are classified by name
    pass


class _GoneHandle:
    """A store deployment handle whose replica is gone: each call hangs (no replica to take it) or fails."""

    def __init__(self, how: str):
        self.how, self.calls = how, 0
        self.put = self.get = self.delete = self

    def remote(self, *args):
        self.calls += 1

        async def call():
            if self.how == "hangs":
                await asyncio.sleep(3600)
            raise ActorDiedError("the actor died unexpectedly")

        return call()


@pytest.mark.parametrize("how", ["hangs", "dies"])
async def test_a_store_replica_that_is_gone_answers_503_not_a_hang(how):
    handle = _GoneHandle(how)
    app = create_app(IngressContext(settings=SETTINGS, service=StubService(), secret=b"s",
                                    response_store=StoreClient(handle, timeout_s=0.05)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as c:
        r = await asyncio.wait_for(c.get("/v1/responses/resp_1"), 30)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "store_unavailable" and "retry shortly" in err["message"]
    assert handle.calls == 1


# -- the store in the ingress's own process (`response_store_placement: ingress`) -------------------------------


def _ingress_settings(**ingress):
    from serve_app.settings import AppSettings

    return AppSettings.model_validate({"models": [{"id": "m", "source": "org/x"}], "ingress": ingress})


def test_with_the_store_in_the_ingress_there_is_no_store_deployment(tmp_path):
    from serve_app.ingress.responses.store import bind_store

    assert bind_store(_ingress_settings()) is not None  # the default: the ResponseStore deployment
    assert bind_store(_ingress_settings(response_store_placement="ingress",
                                        response_store_path=str(tmp_path / "r.db"))) is None


def test_an_in_memory_store_cannot_live_in_the_ingress():
    """Each replica would keep its own responses: a follow-up through another replica would not find its turn."""
    with pytest.raises(ValueError, match="needs a database the replicas share"):
        _ingress_settings(response_store_placement="ingress", response_store_backend="memory")


async def test_ingress_replicas_with_their_own_store_share_one_sqlite_file(tmp_path):
    """Two replicas' stores (two processes in production; two connections here) on the file of one host: a
    response stored through one is found, and deleted, through the other. A call that would wait for the other's
    write lock waits in a worker thread, never on the event loop."""
    from serve_app.ingress.responses.store import AsyncStore, open_local_store

    cfg = _ingress_settings(response_store_placement="ingress", response_store_path=str(tmp_path / "r.db")).ingress
    a, b = open_local_store(cfg), open_local_store(cfg)
    assert isinstance(a, AsyncStore) and isinstance(a.core, SqliteResponseStore) and a.core is not b.core
    loop_thread = threading.get_ident()
    seen = []
    put = a.core.put
    a.core.put = lambda *args, **kw: seen.append((threading.get_ident(), kw.get("wait", True))) or put(*args, **kw)
    client_a, client_b = StoreClient(a, cfg.response_store_timeout_s), StoreClient(b, cfg.response_store_timeout_s)
    assert await client_a.put("resp_1", {"response": {"id": "resp_1"}, "items": []})
    assert seen == [(loop_thread, False)]  # free: made on the loop, never waiting
    assert await client_b.get("resp_1") == {"response": {"id": "resp_1"}, "items": []}
    assert await client_b.delete("resp_1") and await client_a.get("resp_1") is None

    seen.clear()
    other = sqlite3.connect(cfg.response_store_path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # b's process, mid-write
    asyncio.get_running_loop().call_later(0.3, other.rollback)
    assert await client_a.put("resp_2", {"response": {"id": "resp_2"}, "items": []})
    other.close()
    assert seen[0] == (loop_thread, False) and seen[1][0] != loop_thread and seen[1][1] is True, seen
    assert await client_b.get("resp_2") == {"response": {"id": "resp_2"}, "items": []}


async def test_a_store_in_the_ingress_that_stops_answering_is_a_503_not_a_hang(tmp_path):
    """The same bound as the deployment's: a call stuck in the database past response_store_timeout_s answers 503
    store_unavailable in the API's envelope while the stuck thread finishes on its own."""
    from serve_app.ingress.responses.store import open_local_store

    cfg = _ingress_settings(response_store_placement="ingress", response_store_path=str(tmp_path / "r.db"),
                            response_store_timeout_s=0.2).ingress
    store = open_local_store(cfg)
    release, held = threading.Event(), threading.Event()

    def stuck() -> None:  # a call stuck in the database holds the store's connection
        with store.core._lock:
            held.set()
            release.wait(30)

    threading.Thread(target=stuck, daemon=True).start()
    held.wait(5)
    app = create_app(IngressContext(settings=SETTINGS, service=StubService(), secret=b"s",
                                    response_store=StoreClient(store, cfg.response_store_timeout_s)))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as c:
            r = await asyncio.wait_for(c.get("/v1/responses/resp_1"), 20)
    finally:
        release.set()
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "store_unavailable" and "did not answer within 0.2 s" in err["message"]


# -- SQLite on the event loop: made there when it would not wait, else in a worker thread -----------------------


def test_a_sqlite_call_that_would_wait_does_nothing_and_says_so(tmp_path):
    from serve_app.ingress.responses.store import WouldWait

    s = SqliteResponseStore(str(tmp_path / "r.db"), timeout_s=5.0)
    assert s.put("a", 1, wait=False) and s.get("a", wait=False) == 1
    with _WriteLock("sqlite", type("O", (), {"path": s.path})()):
        with pytest.raises(WouldWait):  # another process's write lock: at once, not after the busy timeout
            s.put("b", 2, wait=False)
        with pytest.raises(WouldWait):
            s.delete("a", wait=False)
        assert s.get("a", wait=False) == 1  # WAL: readers do not wait for the writer
    assert s.get("b") is None and s.get("a") == 1  # nothing was done, the connection still serves
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with s._lock:
            held.set()
            release.wait(5)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(5)
    with pytest.raises(WouldWait):  # the connection in use by a worker thread
        s.get("a", wait=False)
    release.set()
    t.join()
    # the busy timeout is back for calls that may wait: a write lock released within it is waited for
    other = sqlite3.connect(s.path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    threading.Timer(0.3, other.rollback).start()
    assert s.put("b", 2) and s.get("b") == 2
    other.close()
    s.close()


async def test_sqlite_puts_beside_a_busy_loop_do_not_wait_for_a_thread(tmp_path):
    """The failure this replaces: beside a loop that is never idle, a worker thread waits for the GIL (a burst of
    32 puts timed out at 5 s, load/probe_store_wait.py). Made on the loop, every put finishes."""
    from serve_app.ingress.responses.store import AsyncStore

    store = AsyncStore(1000, 3600, backend="sqlite", path=str(tmp_path / "r.db"), timeout_s=5.0)
    stop = False

    async def busy() -> None:
        while not stop:
            sum(range(20000))
            await asyncio.sleep(0)

    task = asyncio.create_task(busy())
    try:
        results = await asyncio.gather(*(store.put(f"k{i}", {"items": ["x" * 2000] * 10}) for i in range(32)))
    finally:
        stop = True
        await task
    assert results == [True] * 32
    assert [await store.get(f"k{i}") for i in (0, 31)] == [{"items": ["x" * 2000] * 10}] * 2


async def test_the_wal_checkpoint_runs_in_a_thread_once_enough_is_written(tmp_path):
    from serve_app.ingress.responses.store import AsyncStore

    store = AsyncStore(10_000, 3600, backend="sqlite", path=str(tmp_path / "r.db"))
    ran = []
    checkpoint = store.core.checkpoint
    store.core.checkpoint = lambda: ran.append(threading.get_ident()) or checkpoint()
    record = {"items": ["y" * 100_000]}
    for i in range(30):  # ~3 MB: under the 4 MB bound
        await store.put(f"k{i}", record)
    assert not ran
    for i in range(30, 45):
        await store.put(f"k{i}", record)
    await asyncio.wait_for(store._checkpoint, 10)
    assert ran and threading.get_ident() not in ran
    assert store.core.written < 4_096_000
    wal = Path(str(tmp_path / "r.db") + "-wal")
    probe = sqlite3.connect(tmp_path / "r.db", isolation_level=None)
    busy, frames, done = probe.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    probe.close()
    assert wal.exists() and busy == 0 and done == frames  # everything written so far is in the database file
    assert await store.get("k0") == record and await store.get("k44") == record


def test_sqlite_sets_its_busy_timeout_only_when_a_call_changes_it(tmp_path):
    """Inline calls (`wait=False`) come in runs: the connection's busy timeout is switched when the kind of call
    changes, not twice a call."""
    s = SqliteResponseStore(str(tmp_path / "r.db"), timeout_s=5.0)
    pragmas: list[str] = []
    s._db.set_trace_callback(lambda sql: pragmas.append(sql) if "busy_timeout" in sql else None)
    for i in range(3):
        assert s.put(f"k{i}", i, wait=False) and s.get(f"k{i}", wait=False) == i
    assert pragmas == ["PRAGMA busy_timeout=0"]
    assert s.get("k0") == 0 and s.get("k1") == 1
    assert pragmas == ["PRAGMA busy_timeout=0", "PRAGMA busy_timeout=5000"]
    assert s._db.execute("PRAGMA busy_timeout").fetchone()[0] == 5000
    s.close()
