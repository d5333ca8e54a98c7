"""load.probe_stalls: long gaps are placed in the admission burst or after it, and a client TTFT is split by the
request log's line into before / inside / after the app."""

from __future__ import annotations

import pytest

from load.probe_stalls import attribute, stall_events, summarize, ttft_split


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


def test_a_stall_is_a_gap_shared_by_half_the_streams_and_is_put_on_the_process_bursting_then():
    # Four streams; all stall from 1.0 to 1.5 s, one alone from 3.0 to 3.4 s (not a shared stall).
    streams = [_stream(0.05, [(1.5 + i * 0.01, 0.5), (2.0, 0.05)] + ([(3.4, 0.4)] if i == 0 else []))
               for i in range(4)]
    events = stall_events(streams)
    assert [round(a, 2) for a, _ in events] == [1.0]
    # 100 ms samples over 5 s: the dashboard agent uses 0.6 of a core from 0.9 to 1.6 s, the ingress 0.4 always.
    t0 = 1000.0
    samples = [(t0 + k / 10, {"ingress": 0.4, "ray:agent": 0.6 if 9 <= k <= 16 else 0.0}) for k in range(50)]
    out = attribute(streams, samples, t0, 5.0, seed=1)
    assert out["stalls"] == [{"start_s": 1.0, "length_s": 0.52, "bursting": {"ray:agent": 0.6}}]  # to the median end
    assert out["stalls_with_a_bursting_process_off_the_token_path"] == 1
    assert out["calm_windows"] == 1 and out["calm_windows_with_one"] == 0


def test_the_token_paths_own_processes_do_not_count_as_bystanders():
    streams = [_stream(0.05, [(1.5, 0.5)]) for _ in range(2)]
    samples = [(k / 10, {"engine_core": 1.5 if 10 <= k <= 15 else 0.5}) for k in range(40)]
    out = attribute(streams, samples, 0.0, 4.0, seed=2)
    assert out["stalls"][0]["bursting"] == {"engine_core": 1.0}
    assert out["stalls_with_a_bursting_process_off_the_token_path"] == 0
