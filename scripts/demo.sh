#!/usr/bin/env bash
# End-to-end demo: set up .venv, fetch and convert SmolLM2-135M-Instruct, then answer one chat
# prompt twice with `generate.py --compare`: plainly, then with EAGLE speculative decoding
# (streamed), and print both speeds, the speedup, tau and whether the two answers are identical.
#
# The head: the EAGLE-3 one (checkpoints/NAME/eagle3/), which accepts more of its guesses than the
# EAGLE-2 one and costs less a round (benchmarks/RESULTS.md, "Heads"); DEMO_SPECULATE=eagle2 (or
# eagle) picks the other. Everything else is generate.py's default for this machine (defaults.py):
# on a CPU compiled (a minute or two the first time, then loaded from the disk cache) in bfloat16.
# Where defaults.py puts the target in batch-invariant mode the two answers are identical in bfloat16
# too; elsewhere they can differ where two tokens nearly tie, which the demo says. Extra arguments go
# to generate.py and win over these, e.g.
#   bash scripts/demo.sh --prompt "Name three primes." --max_new_tokens 64
#   bash scripts/demo.sh --dtype float32       # identical answers, token for token
#   bash scripts/demo.sh --no-compile          # eager: no compile time, slower decoding
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

MODEL=SmolLM2-135M-Instruct
CKPT_DIR="checkpoints/$MODEL"
PROMPT="Explain how a refrigerator keeps food cold, step by step, for a curious ten-year-old."

bash scripts/setup.sh
bash scripts/prepare.sh "$MODEL"

SPECULATE="${DEMO_SPECULATE:-}"
if [ -z "$SPECULATE" ]; then
    if [ -d "$CKPT_DIR/eagle3" ]; then SPECULATE=eagle3; elif [ -d "$CKPT_DIR/eagle" ]; then SPECULATE=eagle2; fi
fi
case "$SPECULATE" in
    eagle3) DRAFT_DIR="$CKPT_DIR/eagle3" ;;
    eagle|eagle2) DRAFT_DIR="$CKPT_DIR/eagle" ;;
    "") echo "[demo] no EAGLE head in $CKPT_DIR (prepare.sh copies them from heads/)" >&2; exit 1 ;;
    *) echo "[demo] DEMO_SPECULATE must be eagle, eagle2 or eagle3, not '$SPECULATE'" >&2; exit 1 ;;
esac
[ -d "$DRAFT_DIR" ] || { echo "[demo] no $SPECULATE head at $DRAFT_DIR" >&2; exit 1; }

GENERATE=(.venv/bin/python generate.py
    --checkpoint_path "$CKPT_DIR/model.pth"
    --chat --prompt "$PROMPT" --max_new_tokens 200
    --speculate "$SPECULATE" --draft_checkpoint_path "$DRAFT_DIR"
    --compare)

echo "[demo] $(printf '%q ' "${GENERATE[@]}" "$@")"
exec "${GENERATE[@]}" "$@"
