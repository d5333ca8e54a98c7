"""Run CI as CI runs it — a fresh clone of HEAD, `CI=true bash .ci/run` — and record how long it took.

    python -m load.ci_run --json load/results/ci_run.json [--workdir /tmp/ci]

The clone gets the project's sibling `shared/` folder beside it, as the checkout CI uses has, and nothing installed
by hand: `.ci/run` installs everything itself (scripts/setup.sh), so the total includes the install. The result
file records the command, the clone's commit, the host and the date (load/provenance.py), the wall time of the
install and of pytest, pytest's own summary line and counts, and the slowest tests pytest listed: the README's CI
figures come from it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from load import provenance

_SUMMARY = re.compile(r"^=+ (?P<body>.*\d+ (?:passed|failed|error).*) in (?P<secs>[\d.]+)s(?: \([\d:]+\))? =+$")
_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected|warnings?)")
_DURATION = re.compile(r"^(?P<secs>[\d.]+)s (?P<phase>call|setup|teardown)\s+(?P<test>\S+)")


def parse_log(text: str) -> dict:
    """pytest's summaries (counts, seconds) and its `--durations` table from a `.ci/run` log. scripts/test.sh runs
    two pytest sessions (the unit tests over every core, then the served ones): their counts and seconds add up,
    and `phases` keeps each summary line."""
    out: dict = {"summary": None, "counts": {}, "pytest_s": None, "phases": [], "slowest": []}
    for line in text.splitlines():
        line = line.strip()
        if m := _SUMMARY.match(line):
            out["phases"].append(line.strip("= "))
            out["pytest_s"] = round((out["pytest_s"] or 0.0) + float(m["secs"]), 2)
            for n, kind in _COUNT.findall(m["body"]):
                kind = kind.rstrip("s") if kind.startswith(("error", "warning")) else kind
                if kind != "deselected":  # each phase deselects the other's tests
                    out["counts"][kind] = out["counts"].get(kind, 0) + int(n)
        elif m := _DURATION.match(line):
            out["slowest"].append({"seconds": float(m["secs"]), "phase": m["phase"], "test": m["test"]})
    if len(out["phases"]) == 1:
        out["summary"] = out["phases"][0]
    elif out["phases"]:  # one line for all, in pytest's words
        order = ("failed", "passed", "skipped", "xfailed", "xpassed", "error", "warning")
        plural = {"error": "errors", "warning": "warnings"}
        counts = ", ".join(f"{n} {plural.get(k, k) if n != 1 else k}" for k in order
                           if (n := out["counts"].get(k)) is not None)
        out["summary"] = f"{counts} in {out['pytest_s']:.2f}s"
    return out


def run(workdir: Path, log_path: Path) -> tuple[int, float, str]:
    """Clone HEAD into `workdir/main` (with `workdir/shared`), run `.ci/run` there; (exit code, seconds, commit)."""
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    shared = provenance.ROOT.parent / "shared"
    if shared.is_dir():
        shutil.copytree(shared, workdir / "shared", symlinks=True)
    clone = workdir / "main"
    subprocess.run(["git", "clone", "-q", str(provenance.ROOT), str(clone)], check=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True,
                            check=True).stdout.strip()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    env["CI"] = "true"
    started = time.monotonic()
    with open(log_path, "w") as log:
        rc = subprocess.run(["bash", ".ci/run"], cwd=clone, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    return rc, time.monotonic() - started, commit


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="the result file to write")
    ap.add_argument("--workdir", default=None, help="where to clone (default: a new temporary folder)")
    ap.add_argument("--log", default=None, help="where the run's output goes (default: <workdir>.log, beside it)")
    args = ap.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="serve-app-ci-"))
    log_path = Path(args.log) if args.log else workdir.parent / f"{workdir.name}.log"
    doc = provenance.header("load.ci_run", (argv if argv is not None else sys.argv[1:]))
    rc, total_s, commit = run(workdir, log_path)
    doc["commit"] = commit  # the clone's HEAD: what ran (the working tree here may differ)
    parsed = parse_log(log_path.read_text(errors="replace"))
    doc.update({"ci_command": "CI=true bash .ci/run", "exit_code": rc, "total_s": round(total_s, 1),
                "install_s": round(total_s - parsed["pytest_s"], 1) if parsed["pytest_s"] else None, **parsed})
    provenance.write(args.json, doc)
    print(f"{commit[:7]}: rc={rc}, {parsed['summary']}, {total_s / 60:.1f} min in all")
    return rc


if __name__ == "__main__":
    sys.exit(main())
