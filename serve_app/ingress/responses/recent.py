"""The records a StoreClient stored or read lately, to read a follow-up's `previous_response_id` chain from memory.

A session's next turn comes back to the replica that stored its last one: the front door routes it to the replica
holding its prefix, and a service of one replica has no other. Its chain is then all here: the records this
replica stored, each with the id it continues. Reading them from the store instead costs a query over every turn
and decoding each record (SQLite: 3.6 ms at 100 turns of ~1 KB; PostgreSQL: ~30 ms at 200 turns of ~8 KB,
README "A long previous_response_id conversation"). StoreClient still asks the store whether the continued response
is visible, so a delete through another replica, expiry and eviction answer as before; this client's own deletes
are forgotten here at once.

Records read from the store are kept too. The front door's Router stores nothing but reads every continuation's
chain, and a replica the session's last turn did not go through lacks only that turn: holding the rest, either
reads just the continued record (`head`: it is visible, and the id it continues), and a chain it held none of
(a session it sees for the first time) is read whole once.

Records are kept by reference and must not be changed by their readers (the in-memory store hands out its records
the same way). Bounded by the records' encoded sizes, least recently used first out; a chain missing any record
but the continued one (evicted here, or never seen) is read from the store whole.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any


class RecentRecords:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._records: OrderedDict[str, tuple[str | None, Any, int]] = OrderedDict()  # id -> (parent, record, size)
        self.bytes = 0
        self.served = 0  # chains read from here (the store only asked whether the last one is visible)
        self.extended = 0  # chains read from here but for their last record (read from the store)

    def __len__(self) -> int:
        return len(self._records)

    def remember(self, key: str, record: Any, parent: str | None) -> None:
        size = len(json.dumps(record, separators=(",", ":")))
        if size > self.max_bytes:
            self.forget(key)
            return
        self.forget(key)
        self._records[key] = (parent, record, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, _, gone) = self._records.popitem(last=False)
            self.bytes -= gone

    def forget(self, key: str) -> None:
        entry = self._records.pop(key, None)
        if entry is not None:
            self.bytes -= entry[2]

    def chain(self, key: str) -> list[Any] | None:
        """`key`'s chain, its first record first, when every record of it is here; else None."""
        out, walked = [], []
        at: str | None = key
        records = self._records
        while at is not None:
            entry = records.get(at)
            if entry is None or len(walked) > len(records):  # a record not here (a cycle cannot be: ids are new)
                return None
            walked.append(at)
            out.append(entry[1])
            at = entry[0]
        for k in walked:  # the whole chain is in use again
            records.move_to_end(k)
        out.reverse()
        return out
