"""Prompt tokens reused turn over turn, per model family, API and thinking mode (no engine).

Runs the scripted agent session of tests/support/family_sessions.py on each family's real template (the test
suite's scenario: parallel calls → answer → new user query → call) and writes the table with provenance:

    python -m load.prefix_families [--json load/results/prefix_families.json] [--markdown]

Tokens are counted with SmolLM2's tokenizer given the family's marker strings as added tokens (the families'
own tokenizers are not available offline); the text-level result — all reused, or exactly the dropped think
blocks — does not depend on the tokenizer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from load import provenance  # noqa: E402


def _tokenizer_source() -> str:
    from serve_app.engine.provision import default_tokenizer_source

    return default_tokenizer_source()


def run() -> list[dict]:
    from serve_app.families import load_catalog
    from tests.support.family_sessions import APIS, family_renderer, run_session, thinking_cases

    source = _tokenizer_source()
    rows = []
    for name, fam in load_catalog().items():
        renderer = family_renderer(source, fam)
        for thinking in thinking_cases(fam):
            for api in APIS:
                for r in run_session(renderer, fam, api, thinking):
                    rows.append({"family": name, "replay": fam.thinking_replay, "thinking": thinking, "api": api,
                                 "turn": f"{r.turn}->{r.turn + 1}", "reused": r.reused, "cached": r.cached,
                                 "fraction": round(r.fraction, 4), "dropped_blocks": len(r.dropped or []),
                                 "ok": r.ok})
    return rows


def markdown(rows: list[dict]) -> str:
    """One line per family and thinking mode: reused/cached per turn (the three APIs agree, or each is shown)."""
    out = ["| family (replay policy) | thinking | 1→2 calls → results | 2→3 answer → new query | 3→4 call → result |",
           "|---|---|---|---|---|"]
    keys: dict[tuple, list[dict]] = {}
    for r in rows:
        keys.setdefault((r["family"], r["replay"], r["thinking"]), []).append(r)
    for (family, replay, thinking), rs in keys.items():
        cells = []
        for turn in ("1->2", "2->3", "3->4"):
            per_api = {(r["reused"], r["cached"], r["dropped_blocks"], r["ok"]) for r in rs if r["turn"] == turn}
            cell = []
            for reused, cached, dropped, ok in sorted(per_api):
                text = f"{reused}/{cached} ({reused / cached:.0%})"
                if dropped:
                    text += f", {dropped} think blocks dropped"
                cell.append(text if ok else text + " **FAIL**")
            cells.append("; ".join(cell))
        out.append(f"| {family} ({replay}) | {'on' if thinking else 'off'} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=str(ROOT / "load/results/prefix_families.json"), help="result file")
    ap.add_argument("--markdown", action="store_true", help="print the README table")
    args = ap.parse_args(argv)
    rows = run()
    result = {**provenance.header("load.prefix_families", argv),
              "tokenizer": "SmolLM2-135M-Instruct + the family's markers as added tokens",
              "rows": rows, "all_ok": all(r["ok"] for r in rows)}
    provenance.write(args.json, result, indent=1)
    print(markdown(rows) if args.markdown else f"{len(rows)} turns, all ok: {result['all_ok']} → {args.json}")
    return 0 if result["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
