#!/usr/bin/env bash
# End-to-end demo: set up .venv, fetch + convert SmolLM2-135M-Instruct, answer one chat prompt.
# With an EAGLE draft head for the model (checkpoints/SmolLM2-135M-Instruct/eagle/, copied
# there by prepare.sh from heads/), generation uses EAGLE-2 speculative decoding.
# Extra arguments are passed on to generate.py and win over the defaults below, e.g.
#   bash scripts/demo.sh --prompt "Name three primes." --max_new_tokens 64
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

MODEL=SmolLM2-135M-Instruct
CKPT_DIR="checkpoints/$MODEL"
DRAFT_DIR="$CKPT_DIR/eagle"
PROMPT="What is the capital of France? Answer in one sentence."
GENERATE=(.venv/bin/python generate.py
    --checkpoint_path "$CKPT_DIR/model.pth"
    --chat --compile
    --prompt "$PROMPT"
    --max_new_tokens 128)

bash scripts/setup.sh
bash scripts/prepare.sh "$MODEL"

# Speculative decoding with the EAGLE head when there is one (checked after prepare.sh, which
# copies it into place).
if [ -d "$DRAFT_DIR" ]; then
    GENERATE+=(--speculate eagle2 --draft_checkpoint_path "$DRAFT_DIR")
fi

echo "[demo] $(printf '%q ' "${GENERATE[@]}" "$@")"
exec "${GENERATE[@]}" "$@"
