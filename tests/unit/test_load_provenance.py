"""load.provenance: every result file records the command, the commit, the host and the date the same way, and the
load scripts take those fields from it rather than each writing its own."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from load import plots, provenance

ROOT = Path(__file__).resolve().parents[2]


def test_header_names_the_command_as_it_is_run_the_commit_and_the_host():
    as_module = provenance.header("load.bench_idle", ["--json", "out.json"])
    assert as_module["command"] == "python -m load.bench_idle --json out.json"
    assert provenance.header("load/bench_parsers.py", ["--quick"])["command"] == "python load/bench_parsers.py --quick"
    assert provenance.header("locust", ["-f", "load/locustfile.py"])["command"] == "locust -f load/locustfile.py"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert re.fullmatch(re.escape(head.strip()) + r"(\+dirty)?", as_module["commit"])
    assert as_module["host"]["cpus"] >= 1 and as_module["host"]["hostname"]
    assert set(as_module["host"]["cpu_features"]) <= set(provenance.CPU_FEATURES)  # the kernels' features, if any
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \S+", as_module["date"])


def test_write_creates_the_folder_and_the_plots_caption_reads_it_back(tmp_path):
    path = tmp_path / "new" / "result.json"
    doc = {**provenance.header("load.bench_capacity", ["--rounds", "1"]), "levels": {}}
    provenance.write(path, doc, indent=1)
    text = path.read_text()
    assert text.endswith("}\n") and json.loads(text) == doc
    caption = plots.provenance(json.loads(text), "load/results/x.json")
    assert doc["commit"][:7] in caption and doc["host"]["hostname"] in caption
    assert "`python -m load.bench_capacity --rounds 1`" in caption


def test_no_load_script_builds_its_own_provenance():
    """A script that wrote `"commit": ...` itself would drift from the others (as the router scripts' `git_commit`
    and the benches' `commit` once did)."""
    own = [p.name for p in (ROOT / "load").glob("*.py")
           if p.name not in ("provenance.py", "plots.py") and re.search(r"[\"'](git_)?commit[\"']\s*:", p.read_text())]
    assert own == []
