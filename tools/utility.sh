#!/usr/bin/env bash
# utility.sh — the utility experiment (paper Fig. 4 / Table 1) on the synthetic
# math world: a reference model trained on clean problems scores a noisy-web
# corpus; the same target model is then trained on that corpus in each mode
# with identical seeds, token budget and schedule (keep 0.5 where filtered),
# and evaluated on held-out clean text (loss) and held-out problems (answer
# accuracy by greedy decoding, per template family).
#
# Usage: tools/utility.sh [WORKDIR]       (environment overrides below)
#   CF=./centrifuge-cuda DEVICE=cuda  MODEL=math-25m  BATCH=16 SEQ=512
#   REF_STEPS=2000 STEPS=6200 (6200 x 16 x 512 = 50.8M tokens per mode)
#   MODES="regular loss-only centrifuge strawman"  PROBLEMS=400
# Takes about 10 minutes on one H200; writes WORKDIR/summary.md and plots.
set -u
W=${1:-runs/utility}
CF=${CF:-./centrifuge-cuda}; DEVICE=${DEVICE:-cuda}; MODEL=${MODEL:-math-25m}
BATCH=${BATCH:-16}; SEQ=${SEQ:-512}; REF_STEPS=${REF_STEPS:-2000}; STEPS=${STEPS:-6200}
MODES=${MODES:-"regular loss-only centrifuge strawman"}; PROBLEMS=${PROBLEMS:-400}; LR=${LR:-1e-3}
NOISY_TOKENS=$(( STEPS * BATCH * SEQ + 1000000 ))
mkdir -p "$W"
log() { echo "[utility $(date +%T)] $*"; }
log "data: clean (reference), noisy web ($NOISY_TOKENS tokens), held-out clean"
"$CF" gen-data --source clean --tokens "${CLEAN_TOKENS:-20M}" --seed 1 --out "$W/clean.bin" || exit 1
"$CF" gen-data --source noisy --tokens "$NOISY_TOKENS" --seed 2 --out "$W/noisy.bin" || exit 1
"$CF" gen-data --source clean --tokens "${VAL_TOKENS:-1M}" --seed 3 --out "$W/val.bin" || exit 1
log "reference: $MODEL, $REF_STEPS steps on clean"
t0=$(date +%s.%N)
"$CF" train --device "$DEVICE" --config "$MODEL" --data "$W/clean.bin" --steps "$REF_STEPS" --batch "$BATCH" \
  --seq "$SEQ" --lr "$LR" --seed 11 --out "$W/ref" --log "$W/ref.jsonl" --quiet || exit 1
REF=$(printf "%s/ref/step_%08d" "$W" "$REF_STEPS")
log "score: reference losses of every noisy token"
"$CF" score --device "$DEVICE" --model "$REF" --data "$W/noisy.bin" --out "$W/noisy.ref.bin" --batch 32 --seq "$SEQ" || exit 1
: >"$W/times.txt"; : >"$W/eval.jsonl"
"$CF" math-eval --device "$DEVICE" --model "$REF" --val "$W/val.bin" --problems "$PROBLEMS" --json "$W/eval.jsonl" --label reference
for mode in $MODES; do
  log "target: $mode, $STEPS steps"
  t0=$(date +%s.%N)
  "$CF" train --device "$DEVICE" --config "$MODEL" --data "$W/noisy.bin" --ref "$W/noisy.ref.bin" --mode "$mode" \
    --keep 0.5 --steps "$STEPS" --batch "$BATCH" --seq "$SEQ" --lr "$LR" --seed 7 --val "$W/val.bin" \
    --eval-every 250 --eval-batches 16 --save-every 1000 --keep-checkpoints 1 --out "$W/$mode" \
    --log "$W/$mode.jsonl" --quiet
  rc=$?
  t1=$(date +%s.%N)
  echo "$mode $(awk "BEGIN{printf \"%.1f\", $t1 - $t0}") rc=$rc" >>"$W/times.txt"
  last=$(cat "$W/$mode/latest" 2>/dev/null)
  [ -n "$last" ] && "$CF" math-eval --device "$DEVICE" --model "$W/$mode/$last" --val "$W/val.bin" \
    --problems "$PROBLEMS" --json "$W/eval.jsonl" --label "$mode"
done
log "done"; cat "$W/times.txt"
