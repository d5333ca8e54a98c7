"""Marker search with bounded hold-back, the one primitive every parser engine scans with.

`Matcher.scan(text, i)` finds the earliest complete marker at or after `i`; when there is none it reports where the
shortest suffix that could still grow into a marker begins, so the caller emits everything before it and holds only
that suffix (at most `max_len - 1` characters). Work is proportional to `len(text) - i` plus the marker length,
never to what came before.
"""

from __future__ import annotations

import re
from collections.abc import Iterable


class Matcher:
    __slots__ = ("markers", "_find", "_first", "_prefixes", "_window")

    def __init__(self, markers: Iterable[str]):
        ms = sorted({m for m in markers if m}, key=len, reverse=True)  # longest first: alternation picks it
        self.markers = tuple(ms)
        self._find = re.compile("|".join(re.escape(m) for m in ms)) if ms else None
        firsts = {m[0] for m in ms}
        self._first = re.compile("[" + "".join(re.escape(c) for c in sorted(firsts)) + "]") if ms else None
        self._prefixes = frozenset(m[:k] for m in ms for k in range(1, len(m)))
        self._window = max((len(m) for m in ms), default=1) - 1

    def search(self, text: str, i: int = 0) -> tuple[int, str | None]:
        """Earliest complete marker at or after `i`: (position, marker), or (-1, None)."""
        if self._find is None:
            return -1, None
        m = self._find.search(text, i)
        if m is None:
            return -1, None
        return m.start(), m.group()

    def hold_start(self, text: str, i: int = 0) -> int:
        """Index where the held-back suffix of `text[i:]` begins (len(text) when nothing must be held).

        Only the last `max_len - 1` characters can hold a partial marker, so only they are looked at."""
        n = len(text)
        if self._first is None or not self._window:
            return n
        start = max(i, n - self._window)
        first = self._first
        prefixes = self._prefixes
        pos = start
        while True:
            m = first.search(text, pos)
            if m is None:
                return n
            p = m.start()
            if text[p:] in prefixes:
                return p
            pos = p + 1
