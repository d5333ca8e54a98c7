"""load.plots: the figures draw exactly the numbers in the result files, and name the file, commit and host."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from load import plots

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _host() -> dict:
    return {"hostname": "box-7", "cpus": 4, "cpu_model": "Test CPU", "memory_gib": 8.0, "python": "3.11.7"}


def _capacity(commit: str, scale: float) -> dict:
    def side(c: int, k: float) -> dict:
        return {"tokens_per_s": 100.0 * c * k, "ttft_p50_ms": 10.0 + c * k, "itl_p99_ms": 5.0 + c / k,
                "serving_path_cpu_s_per_1k_tokens": 1.0 / (c * k)}

    # Levels as strings, deliberately out of order: the figure sorts them numerically.
    return {"command": "python -m load.bench_capacity --rounds 1", "commit": commit, "host": _host(),
            "date": "2026-12-01 10:00:00 UTC", "model": "tiny (2 layers)", "tokens_per_request": 64,
            "levels": {str(c): {"ours": side(c, scale), "vllm": side(c, 1.5), "ratio": {}} for c in (32, 1, 8)}}


def _overhead(commit: str) -> dict:
    def level(c: int) -> dict:
        ours = {"ttft_p50_ms": 100.0 * c, "ttft_p95_ms": 200.0 * c, "tokens_per_s": 10.0 + c}
        vllm = {"ttft_p50_ms": 50.0 * c, "ttft_p95_ms": 150.0 * c, "tokens_per_s": 12.0 + c}
        return {"ours": ours, "vllm": vllm, "ratio": {"ttft_p50": 2.0, "ttft_p95": 200 / 150, "tokens_per_s": 0.9}}

    return {"command": "python -m load.bench_overhead", "commit": commit, "host": _host(), "date": "2026-12-01",
            "tokens_per_request": 32, "results": {"concurrency_8": level(8), "concurrency_1": level(1)}}


def _router(traces: list[str], dirty: bool) -> dict:
    results = []
    for t, trace in enumerate(traces):
        for speedup in (1.0, 2.0):
            for blocks in (8192, 2048):
                for p, policy in enumerate(("round_robin", "session", "ttft", "kv")):
                    mean = 1.0 + t + p + speedup + blocks / 8192
                    results.append({"trace": trace, "policy": policy, "speedup": speedup, "cache_blocks": blocks,
                                    "ttft_mean_s": mean, "ttft_p99_s": 10 * mean, "hit_rate": 0.5})
    return {"command": "python -m load.sim_router --compare", "git_commit": "2bcf57fc1a73b2e7533d06314cfa83271d8c8a48",
            "git_dirty_routing": dirty, "host": "simhost", "cpus": 2, "date": "2026-12-01T15:35:20+00:00",
            "results": results}


def _router_bench(replicas: int) -> dict:
    overload = [{"offered_x_capacity": x, "decision_p99_ms": 10 * x * replicas, "fallback_share": max(0.0, x - 1)}
                for x in (2.0, 0.5, 1.1)]
    return {"command": "python -m load.bench_router", "git_commit": "9e849abb39135f20ce76e3bdb73f674e57184e0f",
            "host": "vm", "cpus": 2, "date": "2026-12-01",
            "results": [{"policy": "ttft", "replicas": replicas, "block_size": b, "overload": overload}
                        for b in (16, 128)]}


def _prefix_families() -> dict:
    rows = []

    def session(family: str, replay: str, thinking: bool, fractions: dict[str, tuple[float, ...]]) -> None:
        for api, values in fractions.items():
            for turn, fraction in zip(("1->2", "2->3", "3->4"), values):
                rows.append({"family": family, "replay": replay, "thinking": thinking, "api": api, "turn": turn,
                             "reused": 1, "cached": 1, "fraction": fraction, "dropped_blocks": 0, "ok": True})

    every_api = ("anthropic", "responses", "chat")
    session("alpha", "keeps_all", True, {api: (1.0, 1.0, 1.0) for api in every_api})
    session("beta", "drops", False, {api: (1.0, 1.0, 1.0) for api in every_api})
    session("gamma", "last_turn", True, {api: (1.0, 0.6, 1.0) for api in every_api})
    session("delta", "last_turn", True, {"anthropic": (1.0, 0.5, 1.0), "responses": (1.0, 0.7, 1.0),
                                         "chat": (1.0, 0.5, 1.0)})
    return {"command": "python -m load.prefix_families", "git_commit": "720eb17d93fa3d763dad255cc94fefd7f3a5dcad",
            "git_dirty": False, "host": "vm", "cpus": 2, "date": "2026-12-01T18:38:26+00:00", "rows": rows}


def _write(folder: Path, docs: dict[str, dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, doc in docs.items():
        (folder / name).write_text(json.dumps(doc))
    return folder


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory.mktemp("results"), {
        "capacity.json": _capacity("f8c781d4a088e7b006b39eea501bd81a0b5ee1df", 1.0),
        "capacity_ab95609.json": _capacity("ab95609b25e3b6c3db9ea2c64aecb834eab101a8", 0.5),
        "overhead.json": _overhead("e78e8cb08ed9124118c198b8c27563673b5e588d"),
        "overhead_66efbe5.json": _overhead("66efbe52b511c51657a4555e66a02298d090bbc7+dirty (docs only)"),
        "router_compare.json": _router(["conversation", "agentic"], dirty=False),
        "router_unseen.json": _router(["agentic_unseen"], dirty=True),
        "router_compare_no_events.json": _router(["mooncake_fast25_conversation_trace", "spec:agentic"], dirty=True),
        "router_bench.json": _router_bench(8),
        "router_bench_64.json": _router_bench(64),
        "prefix_families.json": _prefix_families(),
    })


@pytest.fixture(scope="module")
def built(results: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """All figures drawn once for the module (drawing is most of this file's run time)."""
    out = tmp_path_factory.mktemp("figures")
    return out, plots.build(results, out)


def test_every_figure_is_written_as_a_small_png(built: tuple[Path, dict]):
    out, done = built
    assert set(done) == set(plots.INPUTS)
    for figure, info in done.items():
        data = info["path"].read_bytes()
        assert info["path"] == out / f"{figure}.png"
        assert data.startswith(PNG_MAGIC)
        assert len(data) < 150 * 1024, (figure, len(data))


def test_capacity_series_are_the_levels_in_numeric_order(results: Path):
    doc = json.loads((results / "capacity.json").read_text())
    s = plots.capacity_series(doc)
    assert s["concurrency"] == [1, 8, 32]
    for side in ("ours", "vllm"):
        for key, _, _ in plots.CAPACITY_METRICS:
            assert s[side][key] == [doc["levels"][str(c)][side][key] for c in (1, 8, 32)]


def test_overhead_series_carry_each_side_and_the_recorded_ratio(results: Path):
    doc = json.loads((results / "overhead.json").read_text())
    s = plots.overhead_series(doc)
    assert s["concurrency"] == [1, 8]
    assert s["ours"]["ttft_p50_ms"] == [100.0, 800.0]
    assert s["vllm"]["tokens_per_s"] == [13.0, 20.0]
    assert s["ratio"]["ttft_p95_ms"] == [200 / 150, 200 / 150]


def test_router_series_are_per_trace_config_and_table_policy(results: Path, built: tuple[Path, dict]):
    compare = json.loads((results / "router_compare.json").read_text())
    s = plots.router_series(compare)
    assert list(s) == ["conversation", "agentic"]
    assert s["agentic"]["configs"] == ["1x, 8192 blocks", "1x, 2048 blocks", "2x, 8192 blocks", "2x, 2048 blocks"]
    assert "session" not in s["agentic"]  # not a column of the README's tables
    for policy in ("round_robin", "ttft", "kv"):
        expect = [(r["ttft_mean_s"], r["ttft_p99_s"]) for r in compare["results"]
                  if r["trace"] == "agentic" and r["policy"] == policy]
        assert list(zip(s["agentic"][policy]["mean"], s["agentic"][policy]["p99"])) == expect
    # The figure draws the held-out trace from its own file beside the compared ones.
    done = built[1]
    assert list(done["router_ttft"]["series"]) == ["conversation", "agentic", "agentic_unseen"]
    # Trace names given as file names or specs are shortened to the trace's name.
    assert list(done["router_ttft_no_events"]["series"]) == ["conversation", "agentic"]


def test_router_overload_series_sort_by_offered_load(results: Path):
    docs = [json.loads((results / f).read_text()) for f in ("router_bench.json", "router_bench_64.json")]
    s = plots.router_overload_series(docs)
    assert list(s) == ["8 replicas, block size 16", "8 replicas, block size 128",
                       "64 replicas, block size 16", "64 replicas, block size 128"]
    assert s["64 replicas, block size 16"]["offered"] == [0.5, 1.1, 2.0]
    assert s["64 replicas, block size 16"]["p99_ms"] == pytest.approx([320.0, 704.0, 1280.0])
    assert s["8 replicas, block size 128"]["fallback"] == pytest.approx([0.0, 0.1, 1.0])


def test_cached_fraction_merges_equal_sessions_and_splits_apis_that_differ(results: Path):
    s = plots.cached_fraction_series(json.loads((results / "prefix_families.json").read_text()))
    assert s["turns"] == ["1->2", "2->3", "3->4"]
    assert s["series"] == {
        "alpha (keeps_all), thinking on; beta (drops), thinking off": [1.0, 1.0, 1.0],
        "gamma (last_turn), thinking on": [1.0, 0.6, 1.0],
        "delta (last_turn), thinking on, anthropic; delta (last_turn), thinking on, chat": [1.0, 0.5, 1.0],
        "delta (last_turn), thinking on, responses": [1.0, 0.7, 1.0],
    }


def test_provenance_names_file_commit_host_date_and_command(results: Path):
    doc = json.loads((results / "overhead_66efbe5.json").read_text())
    line = plots.provenance(doc, "load/results/overhead_66efbe5.json")
    assert line == ("load/results/overhead_66efbe5.json: commit 66efbe5+dirty, host box-7, 4 CPUs, Test CPU, "
                    "2026-12-01; `python -m load.bench_overhead`")
    router = json.loads((results / "router_unseen.json").read_text())
    assert "commit 2bcf57f+dirty, host simhost, 2 CPUs, 2026-12-01" in plots.provenance(router, "x")


def test_missing_inputs_skip_their_figures_only(tmp_path: Path):
    folder = _write(tmp_path / "partial", {"overhead.json": _overhead("e78e8cb")})
    done = plots.build(folder, tmp_path / "figures")
    assert list(done) == ["overhead"]
    assert sorted(p.name for p in (tmp_path / "figures").iterdir()) == ["overhead.png"]


def test_cli_writes_figures_and_fails_on_an_empty_folder(results: Path, tmp_path: Path):
    assert plots.main(["--results", str(results), "--out", str(tmp_path / "cli")]) == 0
    assert len(list((tmp_path / "cli").glob("*.png"))) == len(plots.INPUTS)
    assert plots.main(["--results", str(tmp_path / "empty"), "--out", str(tmp_path / "none")]) == 1


def test_plots_import_no_part_of_the_service():
    # The figures are drawn with matplotlib alone (a plotting venv, CI), never by importing the serving stack.
    code = "import sys, load.plots; print(sorted({m.split('.')[0] for m in sys.modules}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}).stdout
    loaded = set(json.loads(out.replace("'", '"')))
    assert not loaded & {"serve_app", "ray", "vllm", "torch", "transformers", "fastapi"}
