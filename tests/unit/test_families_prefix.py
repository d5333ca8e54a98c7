"""Prefix stability per model family, through the three APIs, on each family's real template: a scripted
agent session (tests/support/family_sessions.py: parallel calls, an answer, a new query, a call; with and without
thinking) where each turn's output is what the template itself renders for it. Turn N+1's prompt must reuse all of
turn N's cache (prompt + generated tokens), except exactly the think blocks the template drops by design — and
only where the catalog's replay policy says it drops them. `-s` prints the table (load/prefix_families.py writes
it to load/results/).
"""

from __future__ import annotations

import pytest

from serve_app.families import get_family, load_catalog
from tests.support.family_sessions import APIS, family_renderer, only_markup, run_session, thinking_cases

CASES = [pytest.param(name, thinking, id=f"{name}-{'thinking' if thinking else 'no-thinking'}")
         for name in sorted(load_catalog()) for thinking in thinking_cases(get_family(name))]
_RENDERERS: dict = {}
TABLE: list = []


@pytest.fixture(scope="module")
def tokenizer_path():
    from serve_app.engine.provision import default_tokenizer_source

    return default_tokenizer_source()


@pytest.fixture(scope="module", autouse=True)
def table():
    yield
    for r in TABLE:
        print(f"{r.family:14} {'think' if r.thinking else 'no-think':8} {r.api:10} {r.turn}→{r.turn + 1} "
              f"{r.reused:5d}/{r.cached:<5d} {r.fraction:6.3f} dropped={len(r.dropped or [])}")


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("name,thinking", CASES)
def test_next_turn_reuses_the_cache_but_what_the_template_drops(tokenizer_path, name, thinking, api):
    fam = get_family(name)
    if name not in _RENDERERS:
        _RENDERERS[name] = family_renderer(tokenizer_path, fam)
    results = run_session(_RENDERERS[name], fam, api, thinking)
    TABLE.extend(results)
    for r in results:
        assert r.dropped is not None, f"{name} {api} turn {r.turn}: the prompt diverges outside a think block"
        assert r.ok, f"{name} {api} turn {r.turn}: reused {r.reused}/{r.cached}, dropped {r.dropped}"
    # Inside a tool loop nothing is ever lost; after a new user query only templates that drop thinking lose any.
    loop = [r for r in results if r.turn != 2]
    if thinking or fam.empty_thought_replayed:
        assert all(r.fraction == 1.0 for r in loop), [(r.turn, r.reused, r.cached) for r in loop]
    else:  # thinking off, the template drops the empty think block each prompt closed (Gemma 4), nothing else
        assert all(only_markup(b, []) for r in loop for b in r.dropped), [(r.turn, r.dropped) for r in loop]
    after_query = results[1]
    if fam.thinking_replay == "keeps_all":
        assert after_query.fraction == 1.0
    elif after_query.dropped:
        assert fam.thinking_replay in ("last_turn", "drops")
