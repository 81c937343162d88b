#!/usr/bin/env bash
# Run the test suite: set up .venv with the dev requirements, prepare the real test model
# (SmolLM2-135M-Instruct, which the real-model tests load), then pytest. Arguments go to
# pytest, e.g.  bash scripts/test.sh -k tree -x
# The exit status is pytest's.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/setup.sh --dev
bash scripts/prepare.sh SmolLM2-135M-Instruct

echo "[test] python -m pytest tests -q $*"
exec .venv/bin/python -m pytest tests -q "$@"
