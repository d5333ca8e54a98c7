"""The abstract fixture table: every format is checked against each case that its grammar can express."""

from __future__ import annotations

from parser_cases.wire import FORMATS, Fmt, expected, render_case

_LINE = 'if a < b and c > d:\n    print("héllo\\tworld \\\\ 世界 🎉", {"k": [1, 2]})  # it\'s <ok>\n'
BIG = (_LINE * (20_000 // len(_LINE) + 1))[:20_000].rstrip("\n") + "END"

WEATHER = ("get_weather", {"city": "Paris", "days": 3})
TIME = ("get_time", {"tz": "Europe/Paris", "utc": True})

CASES: dict[str, list] = {
    "no_call": [("text", "Hello, world. Note that a < b, c > d and [1, 2] are not markup.")],
    "single": [("calls", [WEATHER])],
    "parallel": [("calls", [WEATHER, TIME, ("list_files", {"dir": "/tmp"})])],
    "text_before": [("text", "Let me check the weather. "), ("calls", [WEATHER])],
    "text_after": [("calls", [WEATHER]), ("text", " I asked for the weather.")],
    "text_before_after": [("text", "Checking. "), ("calls", [WEATHER]), ("text", " Done.")],
    "empty_args": [("calls", [("list_files", {})])],
    "nested": [("calls", [("search", {"filter": {"tags": ["a", "b"], "range": {"lo": 1, "hi": 2.5}},
                                      "flags": [True, False, None], "limit": 10})])],
    "unicode_escapes": [("calls", [("write", {"text": 'héllo 世界 "quoted" back\\slash\ttab\nnewline 🎉 </b>',
                                              "path": "C:\\tmp\\a.txt"})])],
    "big_string": [("calls", [("write_file", {"path": "src/big.py", "content": BIG})])],
    "reasoning_only": [("reasoning", "The user wants the weather; a < b holds.")],
    "reasoning_then_text": [("reasoning", "Think first."), ("text", "Answer: 42.")],
    "interleaved": [("reasoning", "I need the weather. "), ("calls", [WEATHER]), ("reasoning", "Now the time."),
                    ("calls", [TIME]), ("text", "Both fetched.")],
}


def applies(fmt: Fmt, name: str, segs: list) -> bool:
    kinds = [s[0] for s in segs]
    has_reasoning = "reasoning" in kinds
    if has_reasoning and fmt.reasoning is None:
        return False
    if "calls" in kinds:
        first_call = kinds.index("calls")
        last_call = len(kinds) - 1 - kinds[::-1].index("calls")
        if "text" in kinds[:first_call] and not fmt.text_before_calls:
            return False
        if "text" in kinds[last_call + 1:] and not fmt.text_after_calls:
            return False
        if fmt.text_before_calls is False and first_call != 0:
            return False
    if name == "nested" and not fmt.nested:
        return False
    if fmt.tools == "pythonic" and name == "no_call":
        return False  # "[1, 2]" opening a pythonic text is checked in its own case
    return True


def all_fixtures():
    """(id, fmt, wire text, expected fold, schemas-needed) for the table."""
    out = []
    for fmt in FORMATS:
        for name, segs in CASES.items():
            if applies(fmt, name, segs):
                out.append((f"{fmt.tools}-{name}", fmt, render_case(fmt, segs), expected(segs), segs))
    return out
