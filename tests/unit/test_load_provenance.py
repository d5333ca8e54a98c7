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


def test_ci_run_reads_pytest_s_summary_and_slowest_tests():
    """load.ci_run records what pytest printed at the end of `.ci/run`: the counts and seconds of its summary line
    and its `--durations` table, whatever else the log holds."""
    from load import ci_run

    log = "\n".join([
        "setup: done",
        "tests/unit/test_x.py ....",
        "============================= slowest 30 durations =============================",
        "129.31s call     tests/integration/test_restart.py::test_engine_core_replacement",
        "109.02s setup    tests/conformance/test_claude_code.py::test_print_mode[tool]",
        "0.50s teardown tests/unit/test_x.py::test_y",
        "=========================== short test summary info ============================",
        "FAILED tests/unit/test_x.py::test_z - AssertionError",
        "====== 1 failed, 3899 passed, 2 skipped, 5 warnings in 2248.12s (0:37:28) ======",
    ])
    got = ci_run.parse_log(log)
    assert got["counts"] == {"failed": 1, "passed": 3899, "skipped": 2, "warning": 5}
    assert got["pytest_s"] == 2248.12
    assert got["summary"] == "1 failed, 3899 passed, 2 skipped, 5 warnings in 2248.12s (0:37:28)"
    assert [(d["seconds"], d["phase"], d["test"].split("::")[-1]) for d in got["slowest"]] == [
        (129.31, "call", "test_engine_core_replacement"), (109.02, "setup", "test_print_mode[tool]"),
        (0.5, "teardown", "test_y")]
    assert got["phases"] == ["1 failed, 3899 passed, 2 skipped, 5 warnings in 2248.12s (0:37:28)"]
    assert ci_run.parse_log("no summary here")["pytest_s"] is None


def test_ci_run_adds_up_the_unit_and_served_phases():
    """scripts/test.sh runs two pytest sessions: the record's counts and seconds are their sums (each phase's
    deselected tests are the other's, so they are not counted), and each phase's own line is kept."""
    from load import ci_run

    log = "\n".join([
        "=================== 4140 passed, 187 deselected, 66 warnings in 116.53s (0:01:56) ===================",
        "============================= slowest 30 durations =============================",
        "175.71s call     tests/integration/test_engine_in_ingress.py::test_dead",
        "========== 1 error, 186 passed, 4140 deselected, 1 warning in 2900.00s (0:48:20) ==========",
    ])
    got = ci_run.parse_log(log)
    assert got["counts"] == {"passed": 4326, "warning": 67, "error": 1}
    assert got["pytest_s"] == 3016.53
    assert got["summary"] == "4326 passed, 1 error, 67 warnings in 3016.53s"
    assert len(got["phases"]) == 2 and got["phases"][1].startswith("1 error, 186 passed")
    assert [d["test"].split("::")[-1] for d in got["slowest"]] == ["test_dead"]
