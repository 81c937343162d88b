#!/usr/bin/env bash
# Run the test suite (tests/, and research/tests/ for the research tools): set up .venv with the dev
# requirements, prepare the real test model (SmolLM2-135M-Instruct, which the real-model tests load),
# then pytest in two pytest-xdist workers (most of the suite's time is compiling, one thread each: two
# workers on a 2-core CPU take about half as long; tests/conftest.py gives each its share of the cores,
# and builds what a costly fixture builds once for both). Arguments go to pytest, e.g.
#   bash scripts/test.sh -k tree -x    (-n 0: one process, for a debugger or -x)
# The exit status is pytest's.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/setup.sh --dev
bash scripts/prepare.sh SmolLM2-135M-Instruct

echo "[test] python -m pytest tests research/tests -q -n 2 $*"
exec .venv/bin/python -m pytest tests research/tests -q -n 2 "$@"
