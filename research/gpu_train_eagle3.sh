#!/usr/bin/env bash
# The shipped EAGLE-3 head of SmolLM2 trained further on a lent GPU, inside one device call of
# under ten minutes (docs/training.md, "The GPU recipe").
#
#   bash research/gpu_train_eagle3.sh OUT_DIR [SECONDS] [-- TRAIN_EAGLE_ARGS...]
#       there; SECONDS (default 540) bounds the whole run; arguments after -- go to every train_eagle.py run
#   bash research/gpu_train_eagle3.sh --prepare OUT_DIR [SECONDS] [-- TRAIN_EAGLE_ARGS...]
#       stages 1 and 2 only (the target, the features of every shard, the probe, from a fresh head), then stop
#
# Before, here: GPU_CHECK_PART_SIZE=50M bash scripts/gpu_check.sh --split (the GGUF in parts under
# downloads/parts, with the 'gguf' package the conversion needs); the parts travel in calls of their
# own and are copied aside there. The call that brings the last part runs --prepare (the features),
# so that the training call spends its time on epochs: its own probe then reads the cached features
# (the calls: docs/training.md).
#
# In order:
#   1. the SmolLM2 GGUF joined and converted (gpu_check.sh --checkpoint: skipped when
#      $SMOLLM2_CHECKPOINT or checkpoints/SmolLM2-135M-Instruct/ holds a model.pth);
#   2. a probe run of $PROBE_STEPS steps that writes no head: it writes the teacher-forced features of
#      every shard into the cache the real run reads, and times a step on this machine;
#   3. continuation epochs over all the shards, as the CPU sessions ran them one a session: each from
#      the best head so far (--init_from), a fresh warm-up and cosine, validation every half epoch, while
#      another epoch fits in the time left (the first always runs; $MAX_EPOCHS at most). A head is
#      replaced only by a better one (validation accuracy on the same held-out conversations), as
#      train_eagle.py decides; the settings are the CPU epochs' (heads/SmolLM2-135M-Instruct-eagle3/
#      training.json);
#   4. OUT_DIR: train.log, training.json (the last epoch's record; the head's own lists its lineage),
#      and the heads as tar files cut into parts under 15 MB (a device call returns files of 16 MiB at
#      most): head.tar.part-* (the output folder, when a better head than the shipped one was found)
#      and last_epoch.tar.part-* (the head at the end of the last finished epoch, whatever it scored).
#
# Settings (environment): PYTHON (python3), N_SHARDS (180), PROBE_STEPS (60), MAX_EPOCHS (4),
# TAU_PROMPTS (12), DTYPE (float32), WORK (/tmp/eagle3-gpu), SMOLLM2_CHECKPOINT, and for the tests
# HEAD (heads/SmolLM2-135M-Instruct-eagle3), DATA_DIR (data/SmolLM2-135M-Instruct), PRESET (smollm2-cpu).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
PREPARE=0
[ "${1:-}" = --prepare ] && { PREPARE=1; shift; }
[ $# -ge 1 ] || usage
case "$1" in -*) usage ;; esac
OUT="$1"
shift
TOTAL_S=540
if [ $# -ge 1 ] && [ "$1" != "--" ]; then
    [[ "$1" =~ ^[0-9]+$ ]] || usage
    TOTAL_S="$1"
    shift
fi
[ $# -eq 0 ] || { [ "$1" = "--" ] || usage; shift; }
EXTRA=("$@")  # after --: more train_eagle.py arguments, last (they win)
PY="${PYTHON:-python3}"
N_SHARDS="${N_SHARDS:-180}"
PROBE_STEPS="${PROBE_STEPS:-60}"
MAX_EPOCHS="${MAX_EPOCHS:-4}"
TAU_PROMPTS="${TAU_PROMPTS:-12}"
DTYPE="${DTYPE:-float32}"
WORK="${WORK:-/tmp/eagle3-gpu}"
HEAD="${HEAD:-heads/SmolLM2-135M-Instruct-eagle3}"
DATA_DIR="${DATA_DIR:-data/SmolLM2-135M-Instruct}"
PRESET="${PRESET:-smollm2-cpu}"
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
mkdir -p "$OUT" "$WORK" || exit 2
LOG="$OUT/train.log"
: > "$LOG"
log() { echo "[gpu_train $(printf '%3d' "$SECONDS") s] $*" | tee -a "$LOG"; }

package() {  # whatever was reached goes back, also after a failure or a timeout
    local name dir
    for name in head last_epoch; do
        if [ "$name" = head ]; then dir="$WORK/out"; else dir="$(ls -d "$WORK"/run*.work/epoch_* 2>/dev/null | sort -V | tail -n 1)"; fi
        [ -n "$dir" ] && [ -f "$dir/draft.safetensors" ] || continue
        [ "$name" = head ] && [ "$(stat -c %Y "$dir/draft.safetensors")" -le "$(stat -c %Y "$WORK/started")" ] && continue
        tar -cf "$WORK/$name.tar" -C "$dir" . && split -b 15M -d -a 2 "$WORK/$name.tar" "$OUT/$name.tar.part-"
    done
    local last
    last="$(ls -d "$WORK"/run*.work 2>/dev/null | sort -V | tail -n 1)"
    [ -n "$last" ] && [ -f "$last/training.json" ] && cp "$last/training.json" "$OUT/training.json"
    log "OUT_DIR: $(ls "$OUT" | tr '\n' ' ')"
}
trap package EXIT

"$PY" -c 'import torch; print(f"torch {torch.__version__}, " + (torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device: the CPU"))' 2>&1 | while read -r line; do log "$line"; done

# 1. the target
CKPT="$(PYTHON="$PY" bash scripts/gpu_check.sh --checkpoint 2>> "$LOG")" \
    || { log "no SmolLM2: the GGUF parts did not join or convert"; exit 1; }
log "target $CKPT"

rm -rf "$WORK/out" "$WORK/init" "$WORK"/run*.work "$WORK/probe" "$WORK/probe.work"
# The shipped head is copied to the output folder: the run measures it first and replaces it only
# by a better head. --prepare runs in a call whose checkout leaves heads/ behind (the GGUF part
# takes the room): its probe starts from a fresh head, whose steps cost what the shipped head's do.
INIT=()
if [ "$PREPARE" = 0 ]; then
    cp -R "$HEAD" "$WORK/out" || { log "no head to continue: $HEAD"; exit 1; }
    INIT=(--init_from "$HEAD")
fi
touch "$WORK/started"
COMMON=(scripts/train_eagle.py --arch eagle3 --checkpoint_path "$CKPT" --preset "$PRESET"
        --data_dir "$DATA_DIR" --cache_dir "$WORK/features" --n_shards "$N_SHARDS"
        --lr 4e-4 --warmup_steps 30 --dtype "$DTYPE" --save_every 1000000)

# 2. the probe: features of every shard, then seconds a step
log "probe: features of $N_SHARDS shards, then $PROBE_STEPS steps"
timeout $(( TOTAL_S - SECONDS - 60 )) "$PY" "${COMMON[@]}" "${INIT[@]}" --out_dir "$WORK/probe" --work_dir "$WORK/probe.work" \
    --epochs 1 --max_steps "$PROBE_STEPS" --tau_prompts 0 "${EXTRA[@]}" >> "$LOG" 2>&1 || { log "the probe failed (exit $?)"; exit 1; }
read -r SPE SPS < <("$PY" - "$LOG" "$WORK/probe.work/training.json" <<'EOF'
import json, re, sys
spe = int(re.findall(r"(\d+) steps an epoch", open(sys.argv[1]).read())[-1])
rec = json.load(open(sys.argv[2]))
print(spe, rec["train_minutes"] * 60 / rec["steps"])
EOF
) || { log "the probe left no record"; exit 1; }
# An epoch: its steps, then ~60 s for the run's start (the target loaded, the features read from the
# cache, the head it starts from measured) and two validations; 20 s kept for packing.
log "probe: $SPE steps an epoch, $SPS s a step; $(( TOTAL_S - SECONDS )) s left"
[ "$PREPARE" = 1 ] && { log "prepared: the features are cached in $WORK/features"; exit 0; }
EPOCH_S=$("$PY" -c "import sys; print(int(float(sys.argv[1]) * float(sys.argv[2])) + 60)" "$SPE" "$SPS")

# 3. continuation epochs, each from the head the one before wrote, while another one fits and the one
# before found a better head (the first always runs, under the time limit: its mid-epoch validation
# can still write a better head)
for (( e = 1; e <= MAX_EPOCHS; e++ )); do
    left=$(( TOTAL_S - SECONDS - 20 ))
    if [ "$e" -gt 1 ] && [ "$left" -lt "$EPOCH_S" ]; then
        log "no time for epoch $e ($left s left, ~$EPOCH_S s an epoch)"
        break
    fi
    rm -rf "$WORK/init" && cp -R "$WORK/out" "$WORK/init" && touch "$WORK/epoch_started"
    log "epoch $e from $( [ "$e" = 1 ] && echo "the shipped head" || echo "the best head so far" ) (limit $left s)"
    timeout "$left" "$PY" "${COMMON[@]}" --init_from "$WORK/init" --out_dir "$WORK/out" --work_dir "$WORK/run$e.work" \
        --epochs 1 --eval_every $(( (SPE + 1) / 2 )) --tau_prompts "$TAU_PROMPTS" --force "${EXTRA[@]}" >> "$LOG" 2>&1
    rc=$?
    case $rc in
        0) log "epoch $e: done"
           # no better head: the next epoch would start from the same one and repeat this one
           [ "$WORK/out/draft.safetensors" -nt "$WORK/epoch_started" ] || { log "epoch $e: no better head; stopping"; break; } ;;
        124|137) log "epoch $e: stopped at the time limit"; break ;;
        *) log "epoch $e: FAILED (exit $rc)"; tail -n 20 "$LOG"; break ;;
    esac
done
grep -oE '\{"step".*|step [0-9]+: wrote.*' "$LOG" | while read -r line; do log "$line"; done
exit 0
