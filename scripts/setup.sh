#!/usr/bin/env bash
# Idempotent environment setup, shared by scripts/demo.sh and scripts/test.sh.
#
#   bash scripts/setup.sh          # .venv with torch + requirements.txt
#   bash scripts/setup.sh --dev    # ... plus requirements-dev.txt (pytest, transformers)
#
# Creates .venv when it is missing, installs torch when the venv has none, then the requirements.
# A stamp per requirements set (.venv/.requirements*.sha) holds the hash of the files last installed,
# so a rerun with unchanged files skips pip. PYTHON picks the interpreter that creates the venv.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

DEV=0
for arg in "$@"; do
    case "$arg" in
        --dev) DEV=1 ;;
        -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
        *) echo "[setup] unknown argument: $arg (expected --dev)" >&2; exit 2 ;;
    esac
done

log() { echo "[setup] $*"; }
die() { echo "[setup] error: $*" >&2; exit 1; }

VENV="$ROOT/.venv"
PY="$VENV/bin/python"
PYTHON="${PYTHON:-python3}"

# 1. The virtual environment.
if [ ! -x "$PY" ]; then
    command -v "$PYTHON" >/dev/null 2>&1 \
        || die "'$PYTHON' not found; install Python >= 3.10 (or set PYTHON=/path/to/python3)"
    log "creating virtual environment .venv ($("$PYTHON" -V 2>&1))"
    "$PYTHON" -m venv "$VENV" || die "'$PYTHON -m venv' failed (on Debian/Ubuntu: apt-get install python3-venv)"
fi
"$PY" -c '' >/dev/null 2>&1 || die "$PY does not run (was the Python it was made from removed?); delete .venv and rerun"

# -qq: errors only (-q still prints warnings).
pip_install() { "$PY" -m pip install -qq --disable-pip-version-check "$@"; }

# 2. torch, before the requirements, so that their loose 'torch>=...' is already met and pip never
# picks a build on its own. A '+cpu' wheel in pip's find-links wins over PyPI's build of the same
# version; elsewhere PyPI's default (CUDA) build is installed. For another build, install it into
# .venv first: this step runs only when torch is missing (find_spec: no slow 'import torch').
if ! "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)'; then
    log "installing torch==2.13.0 (one-time, may take a few minutes)"
    pip_install torch==2.13.0
fi

# 3. The requirements, skipped when the stamp says these exact files are installed.
req_hash() {  # the hash of the given files' contents (in Python: portable, no sha256sum needed)
    "$PY" -c 'import hashlib, sys
print(hashlib.sha256(b"\0".join(open(path, "rb").read() for path in sys.argv[1:])).hexdigest())' "$@"
}

# Install FILE... unless STAMP records their hash. Never call it as an 'if' condition: bash ignores
# 'set -e' inside it there, and a failed pip would be stamped.
installed=0
install_reqs() {  # install_reqs STAMP FILE...
    local stamp="$VENV/$1"; shift
    local want; want="$(req_hash "$@")"
    [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && return 0  # already installed
    log "installing $* (quiet; may take a few minutes)"
    local args=() f
    for f in "$@"; do args+=(-r "$f"); done
    pip_install "${args[@]}"
    echo "$want" > "$stamp"
    installed=1
}

if [ "$DEV" = 1 ]; then
    install_reqs .requirements-dev.sha requirements.txt requirements-dev.txt
    # requirements-dev.txt includes requirements.txt, so the base set is installed as well.
    req_hash requirements.txt > "$VENV/.requirements.sha"
else
    install_reqs .requirements.sha requirements.txt
fi

if [ "$installed" = 1 ]; then
    log "done: .venv ready ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
else
    log ".venv up to date (requirements unchanged; delete .venv/.requirements*.sha to force a reinstall)"
fi
