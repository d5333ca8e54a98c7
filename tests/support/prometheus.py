"""Reading Prometheus text expositions and the PromQL of the Grafana dashboard, for tests (no Prometheus needed).

`selectors(expr)` finds each series selector of a query (metric name, label matchers, the labels it groups by);
`matching(samples, selector)` is what Prometheus would select from one scrape. A panel whose every selector
matches some sample after traffic returns data in Grafana (rate() of a counter or a bucket needs two scrapes of
the same series, which Prometheus has once it scrapes on).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# A metric name, then optional `{matchers}`; PromQL functions and keywords are followed by `(` instead.
_SELECTOR = re.compile(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()\s*(\{[^}]*\})?")
_MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*,?')
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset"}


@dataclass(frozen=True)
class Matcher:
    label: str
    op: str
    value: str

    def accepts(self, labels: dict[str, str]) -> bool:
        v = labels.get(self.label, "")
        if self.op == "=":
            return v == self.value
        if self.op == "!=":
            return v != self.value
        hit = re.fullmatch(self.value, v) is not None
        return hit if self.op == "=~" else not hit


@dataclass(frozen=True)
class Selector:
    name: str
    matchers: tuple[Matcher, ...]


def parse_matchers(text: str) -> tuple[Matcher, ...]:
    body = text.strip()[1:-1]
    out, pos = [], 0
    while pos < len(body):
        m = _MATCHER.match(body, pos)
        if not m:
            raise ValueError(f"cannot parse label matchers {text!r} at {body[pos:]!r}")
        out.append(Matcher(m.group(1), m.group(2), m.group(3)))
        pos = m.end()
    return tuple(out)


def selectors(expr: str) -> list[Selector]:
    # Grafana variables ($__rate_interval) and range durations are not names; strip `[...]` first.
    text = re.sub(r"\[[^\]]*\]", " ", expr)
    text = _GROUPING.sub(" ", text)
    found = []
    for m in _SELECTOR.finditer(text):
        name = m.group(1)
        if name in _KEYWORDS or re.fullmatch(r"[0-9.eE+-]+", name):
            continue
        found.append(Selector(name, parse_matchers(m.group(2)) if m.group(2) else ()))
    return found


def grouping_labels(expr: str) -> set[str]:
    return {label.strip() for group in _GROUPING.findall(expr) for label in group.split(",") if label.strip()}


def samples(exposition: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, dict(s.labels), s.value)
            for family in text_string_to_metric_families(exposition) for s in family.samples]


def matching(scraped: list[tuple[str, dict[str, str], float]], selector: Selector):
    return [s for s in scraped if s[0] == selector.name and all(m.accepts(s[1]) for m in selector.matchers)]
