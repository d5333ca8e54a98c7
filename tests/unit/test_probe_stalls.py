"""load.probe_stalls: long gaps are placed in the admission burst or after it, and a client TTFT is split by the
request log's line into before / inside / after the app."""

from __future__ import annotations

import pytest

from load.probe_stalls import summarize, ttft_split


def _stream(first: float, gaps: list[tuple[float, float]], prompt: str = "p", sent: float = 0.0) -> dict:
    return {"prompt": prompt, "sent": sent, "first": first, "first_wall": sent + first, "gaps": gaps}


def test_a_gap_that_began_before_the_last_first_token_counts_as_admission():
    # Stream a starts at 0.1 s and stalls 0.3 s from 0.2 s (the last stream's first token is at 0.4 s); stream b
    # stalls 0.25 s from 1.0 s, after admission.
    a = _stream(0.1, [(0.2, 0.1), (0.5, 0.3), (0.55, 0.05)])
    b = _stream(0.4, [(0.45, 0.05), (1.25, 0.25)])
    row = summarize([a, b])
    assert row["admission_s"] == 0.4
    assert row["gaps_during_admission"] == 2  # 0.1-0.2 and 0.2-0.5 began before 0.4
    assert row["gaps_after_admission"] == 3
    assert row["long_gaps"] == 3  # 0.1, 0.3 and 0.25 s (0.1 is the threshold)
    assert row["long_gaps_during_admission"] == 2
    assert row["longest_gap_ms"] == 300.0
    assert row["long_gaps_by_second"] == {"0": 2, "1": 1}


def test_ttft_split_adds_up_to_the_client_ttft():
    # Sent at 100.0, first token read at 100.9; the app saw it arrive at 100.25 and took 0.5 s to its first token.
    s = _stream(0.9, [], prompt="story 7", sent=100.0)
    log = {"story 7": {"ts": 102.25, "duration_s": 2.0, "ttft_s": 0.5}}
    split = ttft_split([s, _stream(0.3, [], prompt="unlogged")], log)
    assert split["matched"] == 1
    assert split["before_app_p50_ms"] == pytest.approx(250.0)
    assert split["in_app_p50_ms"] == pytest.approx(500.0)
    assert split["after_app_p50_ms"] == pytest.approx(150.0)
