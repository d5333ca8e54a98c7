"""The queries the two database stores share (sqlite_store.py, postgres_store.py), written once and filled in per
database: its table names, its parameter style and where a record's text is kept. Both lay out conversations alike
(store.py): a row per record with `parent` (the record it continues), `root` (its conversation's first record; NULL
for that one, whose `seq` and `expires` are the conversation's) and `deleted` (hidden, kept while a later record's
chain needs it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True, slots=True)
class StoreQueries:
    # `key`'s chain: (k, id, parent, expires, deleted, text) per id walked, k = 0 for `key` itself, the columns
    # after k NULL where an id is not stored; the walk stops at `limit` steps (a chain never holds more records
    # than the item cap). Rows come in any order (chain_records sorts them): in SQLite an ORDER BY sorts the texts
    # in a temporary b-tree, which past the page cache spills to disk (a 200-record chain of 8 KB records read in
    # 5.0 ms with it, 1.9 ms without; load/probe_store_chain.py).
    chain: str
    # A record's text and the id it continues, where it is visible: not deleted, in a conversation that has not
    # expired (`key`, `now`).
    get: str
    # Whether it is visible, without reading its text (delete's check).
    visible: str
    # Deleting visible `key` (the caller checked), run in order in one transaction: where another record continues
    # it, it is kept, hidden, for that one's chain; else its row goes, with each hidden record above it that it was
    # the last to continue (no chain needs them now), up to the first that is visible or continued by another.
    delete: tuple[str, str]
    # What a put decides on, in one round trip: is `k` continued by another record, the size of `k`'s row where it
    # is stored, the conversation `p` belongs to (NULL where `p` is not stored), what that conversation holds
    # besides `k` (records, bytes), and the totals the caps are checked against.
    put_state: str


def store_queries(table: str, totals: str, param: Callable[[str], str], text: str = "r.record",
                  text_join: str = "") -> StoreQueries:
    """`param(name)`: the database's placeholder for a named parameter; `text`: the expression of a record's text
    over the row `r`, with `text_join` the join it needs (SQLite keeps texts in a table of their own)."""
    key, limit, now, k, p = (param(n) for n in ("key", "limit", "now", "k", "p"))
    visible_rows = f"FROM {table} r JOIN {table} c ON c.id = COALESCE(r.root, r.id)"
    visible_where = f"WHERE r.id = {key} AND NOT r.deleted AND c.expires > {now}"
    conversation = f"{table} t, c WHERE (t.id = c.r OR t.root = c.r) AND t.id <> {k}"
    return StoreQueries(
        chain=f"""
WITH RECURSIVE up(k, id) AS (
    SELECT 0, CAST({key} AS TEXT)
    UNION ALL
    SELECT up.k + 1, r.parent FROM up JOIN {table} r ON r.id = up.id WHERE r.parent IS NOT NULL AND up.k < {limit}
)
SELECT up.k, r.id, r.parent, r.expires, r.deleted, {text} FROM up LEFT JOIN {table} r ON r.id = up.id {text_join}
""",
        get=f"SELECT {text}, r.parent {visible_rows} {text_join} {visible_where}",
        visible=f"SELECT 1 {visible_rows} {visible_where}",
        delete=(f"UPDATE {table} SET deleted = TRUE WHERE id = {key} AND EXISTS (SELECT 1 FROM {table} x "
                f"WHERE x.parent = {key})",
                f"""
WITH RECURSIVE gone(id, parent) AS (
    SELECT id, parent FROM {table} WHERE id = {key} AND NOT EXISTS (SELECT 1 FROM {table} x WHERE x.parent = {key})
    UNION ALL
    SELECT r.id, r.parent FROM gone JOIN {table} r ON r.id = gone.parent
    WHERE r.deleted AND (SELECT COUNT(*) FROM {table} x WHERE x.parent = r.id) = 1
)
DELETE FROM {table} WHERE id IN (SELECT id FROM gone)
"""),
        put_state=f"""
WITH c AS (SELECT COALESCE(root, id) AS r FROM {table} WHERE id = {p})
SELECT EXISTS (SELECT 1 FROM {table} WHERE parent = {k}),
       (SELECT size FROM {table} WHERE id = {k}),
       (SELECT r FROM c),
       (SELECT COUNT(*) FROM {conversation}),
       (SELECT COALESCE(SUM(t.size), 0) FROM {conversation}),
       items, bytes
FROM {totals}
""",
    )
