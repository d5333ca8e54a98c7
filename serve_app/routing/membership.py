"""Which engine replicas the Router routes to, reconciled from two sources that disagree for a while.

- An engine registers itself (its KV event endpoints, block size) at the end of its `__init__`, before Serve
  lists it as running.
- Serve's request router in each ingress reports the replicas Serve routes to (serve_router.py): on every change
  of the running set and as soon as a call finds a replica's actor dead (a node lost, a crash).

The running set is the truth for liveness: a replica missing from it is dropped from the core at once (its
index, load, rates and reservations, so nothing routes to it and nothing it held leaks). A registration outlives
that drop for `keep_s`: a replica that registered but is not yet listed as running reappears in the next report
and is re-registered from here, with its event feed. A dead replica's id never comes back (Serve gives a
replacement a new id), so a registration absent from the reports for `keep_s` is forgotten.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

KEEP_S = 600.0  # far longer than an engine's start, from registration to running


class Registrations:
    def __init__(self, keep_s: float = KEEP_S, clock: Callable[[], float] = time.monotonic):
        self.keep_s = keep_s
        self._clock = clock
        self._regs: dict[str, tuple] = {}  # replica id -> the register_replica arguments after the id
        self._absent_since: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._regs)

    def __contains__(self, rid: str) -> bool:
        return rid in self._regs

    def add(self, rid: str, registration: tuple) -> None:
        self._regs[rid] = registration
        self._absent_since.pop(rid, None)

    def get(self, rid: str) -> tuple | None:
        return self._regs.get(rid)

    def reconcile(self, running: Iterable[str], known: Iterable[str]) -> list[tuple[str, tuple]]:
        """Serve reports `running`; the core knew `known` before applying it. Returns the replicas to register
        again (running, registered, not known: dropped earlier while starting), and forgets registrations absent
        for longer than `keep_s`."""
        now = self._clock()
        running = set(running)
        known = set(known)
        for rid in list(self._regs):
            if rid in running:
                self._absent_since.pop(rid, None)
            elif now - self._absent_since.setdefault(rid, now) > self.keep_s:
                del self._regs[rid]
                del self._absent_since[rid]
        return [(rid, self._regs[rid]) for rid in sorted(running - known) if rid in self._regs]

    def stats(self) -> dict[str, Any]:
        return {"registered": len(self._regs), "absent": len(self._absent_since)}
