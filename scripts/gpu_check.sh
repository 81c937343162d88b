#!/usr/bin/env bash
# Every GPU path of the project in one command, on a bare GPU machine (its own python3 with torch
# and triton, nothing installable, no network), within TOTAL_S seconds. Running it on a lent machine
# and reading its results: docs/gpu_check.md.
#
#   bash scripts/gpu_check.sh OUT_DIR            the check; everything it writes goes under OUT_DIR
#   bash scripts/gpu_check.sh --dry_run OUT_DIR  every stage's command only checks its arguments (no GPU)
#   bash scripts/gpu_check.sh --split [GGUF]     here, before: cut the SmolLM2 GGUF into parts for the trip
#   bash scripts/gpu_check.sh --join             there: join the parts (the check does this itself)
#   bash scripts/gpu_check.sh --checkpoint       there: print SmolLM2's model.pth, joined and converted if needed
#
# The stages (pytest -k cuda; random 7B/8B weights; SmolLM2 on MT-bench), the three files OUT_DIR ends up
# with, and how the SmolLM2 GGUF travels in parts: docs/gpu_check.md.
# Settings (environment): PYTHON (python3), STAGE1_S 120, STAGE2_S 90, STAGE3_S 350, TOTAL_S 570,
# GPU_CHECK_PARTS (downloads/parts), GPU_CHECK_PART_SIZE (25M, so that one part and the working tree fit a
# 64 MiB device call), SMOLLM2_CHECKPOINT (a converted model.pth instead of the parts), MT_BENCH_QUESTIONS
# (the question file), EAGLE3_HEAD (heads/SmolLM2-135M-Instruct-eagle3; eagle3 runs when it exists).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PY="${PYTHON:-python3}"
PARTS="${GPU_CHECK_PARTS:-downloads/parts}"
DOWNLOADS="$(dirname "$PARTS")"
GGUF_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
PART_SIZE="${GPU_CHECK_PART_SIZE:-25M}"
STAGE1_S="${STAGE1_S:-120}"
STAGE2_S="${STAGE2_S:-90}"
STAGE3_S="${STAGE3_S:-350}"
TOTAL_S="${TOTAL_S:-570}"
EAGLE3_HEAD="${EAGLE3_HEAD:-heads/SmolLM2-135M-Instruct-eagle3}"

usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "[gpu_check] error: $*" >&2; exit 2; }
first_file() {  # first_file PATH...: prints the first PATH that is a file (fails if none is)
    local f
    for f in "$@"; do [ -n "$f" ] && [ -f "$f" ] && { echo "$f"; return 0; }; done
    return 1
}

# ---- The GGUF's trip: --split here, --join there ------------------------------------------
split_gguf() {  # split_gguf [FILE]
    local file="${1:-checkpoints/.downloads/$GGUF_NAME}" name pkg q
    [ -f "$file" ] || die "no file to split: $file (run bash scripts/prepare.sh SmolLM2-135M-Instruct first)"
    name="$(basename "$file")"
    mkdir -p "$PARTS/python"
    rm -f "$PARTS/$name".part-*
    split -b "$PART_SIZE" -d -a 2 "$file" "$PARTS/$name.part-" || die "split failed"
    (cd "$(dirname "$file")" && sha256sum "$name") > "$PARTS/$name.sha256"
    # the converter's GGUF reader, pure Python, for a machine that has numpy, pyyaml and tqdm but not it
    pkg="$("${SPLIT_PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo "$PY")}" \
        -c 'import gguf, os; print(os.path.dirname(gguf.__file__))' 2>/dev/null)" \
        || die "the 'gguf' package is not installed here (pip install gguf)"
    rm -rf "$PARTS/python/gguf"
    cp -R "$pkg" "$PARTS/python/gguf"
    rm -rf "$PARTS/python/gguf/__pycache__" "$PARTS/python/gguf/scripts"
    # the MT-bench questions, for a checkout whose shared/ folder stays behind
    q="$(first_file ../shared/data/mt_bench/question.jsonl shared/data/mt_bench/question.jsonl)" \
        && cp "$q" "$PARTS/question.jsonl"
    echo "[gpu_check] wrote $(ls "$PARTS/$name".part-* | wc -l) parts of $PART_SIZE, $name.sha256 and python/gguf to $PARTS/:"
    ls -l "$PARTS" | sed 's/^/    /'
    echo "[gpu_check] carry them in separate device calls, the last one running the check: docs/gpu_check.md"
}

join_gguf() {  # join_gguf: $PARTS/NAME.part-* -> $DOWNLOADS/NAME, checked against NAME.sha256
    local out="$DOWNLOADS/$GGUF_NAME" parts=("$PARTS/$GGUF_NAME".part-*)
    [ -e "${parts[0]}" ] || { echo "[gpu_check] no parts $PARTS/$GGUF_NAME.part-* to join" >&2; return 1; }
    cat "${parts[@]}" > "$out.tmp" || return 1
    if [ ! -f "$PARTS/$GGUF_NAME.sha256" ]; then
        echo "[gpu_check] warning: no $GGUF_NAME.sha256 beside the parts: the joined file is not checked" >&2
    elif [ "$(sha256sum < "$out.tmp" | cut -d' ' -f1)" != "$(cut -d' ' -f1 "$PARTS/$GGUF_NAME.sha256")" ]; then
        rm -f "$out.tmp"
        echo "[gpu_check] the ${#parts[@]} parts do not join into $GGUF_NAME (checksum differs): a part is missing or cut short" >&2
        return 1
    fi
    mv "$out.tmp" "$out"
    echo "[gpu_check] joined ${#parts[@]} parts into $out"
}

smollm2_checkpoint() {  # prints the path of a converted SmolLM2 model.pth, converting it if needed
    local dir="$DOWNLOADS/SmolLM2-135M-Instruct" gguf
    first_file "${SMOLLM2_CHECKPOINT:-}" checkpoints/SmolLM2-135M-Instruct/model.pth "$dir/model.pth" && return 0
    if ! gguf="$(first_file "$DOWNLOADS/$GGUF_NAME" "checkpoints/.downloads/$GGUF_NAME")"; then
        join_gguf >&2 || return 1
        gguf="$DOWNLOADS/$GGUF_NAME"
    fi
    "$PY" convert_hf_checkpoint.py --gguf "$gguf" --checkpoint_dir "$dir" >&2 || return 1
    echo "$dir/model.pth"
}

use_carried_python() {  # the gguf package that travelled with the parts, for the conversion (--split copies it)
    [ ! -d "$PARTS/python" ] || export PYTHONPATH="$(cd "$PARTS/python" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
}

# ---- Arguments ----------------------------------------------------------------------------
DRY=0
DRYFLAG=()  # benchmark.py's, in a dry run
case "${1:-}" in
    -h|--help) usage; exit 0 ;;
    --split) shift; [ $# -le 1 ] || die "--split takes one file at most"; split_gguf "$@"; exit ;;
    --join) shift; [ $# -eq 0 ] || die "--join takes no argument"; join_gguf; exit ;;
    --checkpoint) shift; [ $# -eq 0 ] || die "--checkpoint takes no argument"; use_carried_python; smollm2_checkpoint; exit ;;
    --dry_run) DRY=1; DRYFLAG=(--dry_run); shift ;;
esac
case "${1:-}" in -*) die "unknown option $1 (see --help)" ;; esac
[ $# -eq 1 ] || { usage >&2; exit 2; }
OUT="$1"
mkdir -p "$OUT/details" || die "cannot create $OUT"
LOG="$OUT/gpu_check.log"
: > "$LOG"
export PYTHONUNBUFFERED=1
use_carried_python

log() { echo "[gpu_check $(printf '%3d' "$SECONDS") s] $*" | tee -a "$LOG"; }

bundle() {  # OUT_DIR keeps three files: the log, the tables, and a tarball of the details
    local md
    {
        printf '# GPU check, %s\n\n```\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
        cat "$LOG"
        echo '```'
        for md in "$OUT"/details/*.md; do [ -f "$md" ] && { echo; cat "$md"; }; done
        [ -f "$OUT/details/stage1-pytest.log" ] && { echo; echo '## pytest (last lines)'; echo '```'; tail -n 25 "$OUT/details/stage1-pytest.log"; echo '```'; }
    } > "$OUT/summary.md"
    tar -czf "$OUT/details.tar.gz" -C "$OUT" details && rm -rf "$OUT/details"
}
trap bundle EXIT

left() { echo $(( TOTAL_S - SECONDS )); }
min() { [ "$1" -lt "$2" ] && echo "$1" || echo "$2"; }

run() {  # run NAME SECONDS CMD...: CMD with a hard time limit, its output in details/NAME.log
    local name="$1" limit="$2" t0=$SECONDS rc
    shift 2
    [ "$limit" -lt 10 ] && { log "$name: skipped (no time left)"; return 1; }
    [ "$DRY" = 1 ] && limit=300
    log "$name: $* (limit ${limit} s)"
    timeout --kill-after=10 "$limit" "$@" > "$OUT/details/$name.log" 2>&1
    rc=$?
    case $rc in
        0) log "$name: done in $(( SECONDS - t0 )) s" ;;
        124|137) log "$name: stopped at its limit of $limit s (what it wrote so far is kept)" ;;
        *) log "$name: FAILED (exit $rc) after $(( SECONDS - t0 )) s; last lines:"; tail -n 15 "$OUT/details/$name.log" | sed 's/^/    /' | tee -a "$LOG" ;;
    esac
    return $rc
}

# bench NAME SHARE_PERCENT ARGS...: scripts/benchmark.py with SHARE_PERCENT of the stage's budget $STAGE_S (at
# most what is left before $STAGE_END), its --time_budget $SLACK s shorter so that it writes its files in time
bench() {
    local name="$1" budget
    budget=$(min $(( STAGE_S * $2 / 100 )) $(( STAGE_END - SECONDS )))
    shift 2
    run "$name" "$budget" "$PY" scripts/benchmark.py --device cuda --out "$OUT/details/$name" \
        --time_budget $(( budget > 40 ? budget - SLACK : budget / 2 )) "${DRYFLAG[@]}" "$@"
}

[ "$DRY" = 1 ] || "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
    || die "no CUDA device visible to $PY (for a check without one: --dry_run)"
"$PY" -c 'import torch, triton, platform; print(f"python {platform.python_version()}, torch {torch.__version__}, triton {triton.__version__}, " + (torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"))' 2>&1 | while read -r line; do log "$line"; done
# the device's per-block shared-memory limit next to the table of gpu_kernels/tree_attention.py
[ "$DRY" = 0 ] && "$PY" -c 'import torch; from gpu_kernels import tree_attention as ta; p = torch.cuda.get_device_properties(0); optin = getattr(p, "shared_memory_per_block_optin", None); d = torch.device("cuda", 0); print(f"shared memory per block: {optin} bytes (opt-in); launches choose by {ta.shared_memory_limit(d)}; the table for sm_{p.major}{p.minor}: {ta.SHARED_MEMORY_PER_BLOCK.get((p.major, p.minor))}")' 2>&1 | while read -r line; do log "$line"; done

# SmolLM2 is joined and converted in the background while stage 1 runs (CPU work, no timing there).
CKPT_FILE="$OUT/details/smollm2-checkpoint.txt"
if [ "$DRY" = 1 ]; then
    first_file "${SMOLLM2_CHECKPOINT:-}" checkpoints/SmolLM2-135M-Instruct/model.pth > "$CKPT_FILE"
else
    # the GGUF joined now (a second), so that stage 1's SmolLM2 tests find it; converted meanwhile
    if [ -z "${SMOLLM2_GGUF:-}" ] && [ ! -f "checkpoints/.downloads/$GGUF_NAME" ]; then
        [ -f "$DOWNLOADS/$GGUF_NAME" ] || join_gguf >> "$OUT/details/prepare-smollm2.log" 2>&1
        [ -f "$DOWNLOADS/$GGUF_NAME" ] && export SMOLLM2_GGUF="$(cd "$DOWNLOADS" && pwd)/$GGUF_NAME"
    fi
    smollm2_checkpoint > "$CKPT_FILE" 2>> "$OUT/details/prepare-smollm2.log" &
    PREP_PID=$!
fi

# ---- Stage 1: every CUDA test (ids with "cuda"; their CPU twins skip or take seconds) --------
log "stage 1: pytest of the CUDA tests (budget $STAGE1_S s)"
PYTEST_ARGS=(-rs --junitxml="$OUT/details/stage1-pytest.xml")
[ "$DRY" = 1 ] && PYTEST_ARGS=(--collect-only)
run stage1-pytest "$(min "$STAGE1_S" "$(left)")" "$PY" -m pytest tests -q -k cuda -p no:cacheprovider \
    --continue-on-collection-errors "${PYTEST_ARGS[@]}"
grep -E "passed|failed|error|no tests ran|collected" "$OUT/details/stage1-pytest.log" | tail -n 1 | while read -r line; do log "stage 1: $line"; done

# ---- Stage 2: random weights ----------------------------------------------------------------
# The plain step and every round as CUDA-graph replays of the eager code: compiling a 7B step and
# round takes longer than the budget. Each run gets a share of it and stops at its --time_budget.
STAGE_S=$STAGE2_S
STAGE_END=$(( SECONDS + $(min "$STAGE2_S" $(( $(left) - STAGE3_S ))) ))  # stage 3's budget stays reserved
SLACK=25
log "stage 2: random weights (budget $(( STAGE_END - SECONDS )) s)"
RANDOM_WEIGHTS=(--random_weights --tree_sizes 16 32 60 128 --steps 50)
bench random-llama-2-7b-bf16 35 "${RANDOM_WEIGHTS[@]}" --model_name llama-2-7b
bench random-llama-3.1-8b-bf16 25 "${RANDOM_WEIGHTS[@]}" --model_name llama-3.1-8b
bench random-llama-2-7b-int8 20 "${RANDOM_WEIGHTS[@]}" --model_name llama-2-7b --quantize int8
bench random-llama-2-7b-int4-g32 20 "${RANDOM_WEIGHTS[@]}" --model_name llama-2-7b --quantize int4 --groupsize 32

# ---- Stage 3: SmolLM2-135M-Instruct on MT-bench ---------------------------------------------
log "stage 3: SmolLM2-135M-Instruct on MT-bench (budget $(min "$STAGE3_S" "$(left)") s)"
[ -n "${PREP_PID:-}" ] && { wait "$PREP_PID" || log "stage 3: preparing SmolLM2 failed: $(tail -n 3 "$OUT/details/prepare-smollm2.log" | tr '\n' ' ')"; }
CKPT="$(cat "$CKPT_FILE" 2>/dev/null)"
if [ -z "$CKPT" ]; then
    log "stage 3: skipped, no SmolLM2 checkpoint (parts in $PARTS/? see --split)"
else
    log "stage 3: checkpoint $CKPT"
    STAGE_S=$STAGE3_S
    STAGE_END=$(( SECONDS + $(min "$STAGE3_S" "$(left)") ))
    SLACK=20
    QUESTIONS=()  # $MT_BENCH_QUESTIONS, else shared/'s (benchmark.py's default), else the parts'
    q="$(first_file "${MT_BENCH_QUESTIONS:-}" ../shared/data/mt_bench/question.jsonl \
        shared/data/mt_bench/question.jsonl "$PARTS/question.jsonl")" && QUESTIONS=(--question_file "$q")
    EAGLE3=()  # the methods of the EAGLE-3 head
    [ -f "$EAGLE3_HEAD/draft_config.json" ] && EAGLE3=(eagle3) \
        || log "stage 3: no EAGLE-3 head at $EAGLE3_HEAD: eagle3 left out"
    SMOLLM2=(--checkpoint_path "$CKPT" "${QUESTIONS[@]}" --draft_checkpoint_path heads/SmolLM2-135M-Instruct
             --draft3_checkpoint_path "$EAGLE3_HEAD" --num_questions 8 --max_new_tokens 128)
    # bf16 compiled in batch-invariant mode: every answer should equal vanilla's, and the row without the mode
    # prices it in the same run. Only eagle2 and eagle3: each method's round is one more graph to compile.
    bench mt_bench-smollm2-bf16-invariant 100 "${SMOLLM2[@]}" --dtype bfloat16 --compile --batch_invariant \
        --temperatures 0 --methods eagle2 "${EAGLE3[@]}"
    # float32 eager equality, if time is left (stage 1's SmolLM2 tests check it too)
    bench mt_bench-smollm2-fp32-eager 100 "${SMOLLM2[@]}" --dtype float32 --temperatures 0 \
        --methods chain eagle eagle2 "${EAGLE3[@]}"
fi
log "total $SECONDS s; OUT_DIR: gpu_check.log, summary.md, details.tar.gz"
