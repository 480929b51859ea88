#!/usr/bin/env bash
# The whole test suite on a fresh machine: set up (idempotent), prepare the models, run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/baton model prepare tiny
.venv/bin/baton model prepare smollm2
.venv/bin/lint-imports --no-cache  # the rooms' layering (.importlinter)
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
