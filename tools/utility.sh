#!/usr/bin/env bash
# utility.sh — the utility experiment (paper Fig. 4 / Table 1) on the synthetic
# math world: a reference model trained on clean problems scores a noisy-web
# corpus; the same target model is then trained on that corpus in each mode
# with identical seeds, token budget and schedule (keep 0.5 where filtered),
# and evaluated on held-out clean text (loss) and held-out problems (answer
# accuracy by greedy decoding, per template family). docs/UTILITY.md.
#
# Usage: tools/utility.sh [WORKDIR]          (environment overrides below)
#   one seed:   SEED=0 (default): one run in WORKDIR
#   seeds:      SEEDS="0 1 2": one complete run per seed in WORKDIR/seed<s>
#               (its own data, reference, scores and targets), then
#               WORKDIR/summary.md and WORKDIR/utility_curves.png over the seeds
#               (mean and spread per mode; tools/plot_utility.py)
#   PARALLEL=1  with SEEDS: the seeds run at the same time, one process each
#               (logs WORKDIR/seed<s>.log); GPUS="0 1 2" puts the i-th seed on
#               GPU i (CUDA_VISIBLE_DEVICES), else they share the one device
# Seeds of a run with seed s (each can also be set on its own):
#   DATA_SEED=s   gen-data --seed 1000s+1 (clean), 1000s+2 (noisy web),
#                 1000s+3 (held-out clean text)
#   INIT_SEED=s   train --seed 1000s+11 (reference), 1000s+7 (targets): the
#                 initialisation (and the selection seed of --select random)
#   EVAL_SEED=s   math-eval --seed 1000s+1: the held-out problems
#   s = 0 gives the seeds of the earlier single-seed runs (1, 2, 3; 11, 7; 1).
# Other settings:
#   CF=./centrifuge-cuda DEVICE=cuda  MODEL=math-25m  BATCH=16 SEQ=512 LR=1e-3
#   REF_STEPS=2000 STEPS=6200 (6200 x 16 x 512 = 50.8M tokens per mode)
#   MODES="regular loss-only centrifuge centrifuge-kv strawman"  PROBLEMS=400
#   KEEP=0.5  CLEAN_TOKENS=20M  VAL_TOKENS=1M  EVAL_EVERY=250
#   WORLD=small: the demo's one-digit world (gen-data and math-eval --world),
#   e.g. for a small CPU run: CF=./centrifuge DEVICE=cpu MODEL=tiny BATCH=8
#   SEQ=128 REF_STEPS=150 STEPS=180 LR=3e-3 PROBLEMS=48 WORLD=small
# Restartable: every finished stage leaves a marker (WORKDIR/*.done) and is
# skipped next time; an interrupted training continues from its latest
# checkpoint (--resume). A run cut off by a time limit is completed by running
# the same command again. About 4-5 minutes per seed and 5 modes on one H200.
set -u
W=${1:-runs/utility}
CF=${CF:-./centrifuge-cuda}; DEVICE=${DEVICE:-cuda}; MODEL=${MODEL:-math-25m}
BATCH=${BATCH:-16}; SEQ=${SEQ:-512}; REF_STEPS=${REF_STEPS:-2000}; STEPS=${STEPS:-6200}
MODES=${MODES:-"regular loss-only centrifuge centrifuge-kv strawman"}; PROBLEMS=${PROBLEMS:-400}
LR=${LR:-1e-3}; KEEP=${KEEP:-0.5}
NOISY_TOKENS=$(( STEPS * BATCH * SEQ + 1000000 ))
WORLD_FLAG=(); [ -n "${WORLD:-}" ] && WORLD_FLAG=(--world "$WORLD")
HERE=$(cd "$(dirname "$0")" && pwd)

log() { echo "[utility $(date +%T)] $*"; }

# run_seed DIR DATA_SEED INIT_SEED EVAL_SEED: one complete run in DIR.
# Returns non-zero if any stage failed.
run_seed() {
  local w=$1 ds=$2 is=$3 es=$4 failed=0
  mkdir -p "$w"
  local clean_seed=$(( 1000 * ds + 1 )) noisy_seed=$(( 1000 * ds + 2 )) val_seed=$(( 1000 * ds + 3 ))
  local ref_init=$(( 1000 * is + 11 )) target_init=$(( 1000 * is + 7 )) prob_seed=$(( 1000 * es + 1 ))
  printf 'data %s (gen-data %s %s %s)\ninit %s (train %s reference, %s targets)\neval %s (math-eval %s)\n' \
    "$ds" "$clean_seed" "$noisy_seed" "$val_seed" "$is" "$ref_init" "$target_init" "$es" "$prob_seed" >"$w/seeds.txt"
  if [ ! -f "$w/data.done" ]; then
    log "data (seed $ds): clean (reference), noisy web ($NOISY_TOKENS tokens), held-out clean"
    "$CF" gen-data "${WORLD_FLAG[@]}" --source clean --tokens "${CLEAN_TOKENS:-20M}" --seed "$clean_seed" \
      --out "$w/clean.bin" &&
      "$CF" gen-data "${WORLD_FLAG[@]}" --source noisy --tokens "$NOISY_TOKENS" --seed "$noisy_seed" \
        --out "$w/noisy.bin" &&
      "$CF" gen-data "${WORLD_FLAG[@]}" --source clean --tokens "${VAL_TOKENS:-1M}" --seed "$val_seed" \
        --out "$w/val.bin" || return 1
    touch "$w/data.done"
  fi
  local ref
  ref=$(printf "%s/ref/step_%08d" "$w" "$REF_STEPS")
  if [ ! -f "$w/ref.done" ]; then
    log "reference: $MODEL, $REF_STEPS steps on clean (init seed $ref_init)"
    "$CF" train --device "$DEVICE" --config "$MODEL" --data "$w/clean.bin" --steps "$REF_STEPS" --batch "$BATCH" \
      --seq "$SEQ" --lr "$LR" --seed "$ref_init" --save-every 500 --keep-checkpoints 1 --out "$w/ref" \
      --log "$w/ref.jsonl" --resume --quiet || return 1
    [ -d "$ref" ] || { log "reference: $ref missing"; return 1; }
    touch "$w/ref.done"
  fi
  if [ ! -f "$w/score.done" ]; then
    log "score: reference losses of every noisy token"
    "$CF" score --device "$DEVICE" --model "$ref" --data "$w/noisy.bin" --out "$w/noisy.ref.bin" --batch 32 \
      --seq "$SEQ" || return 1
    touch "$w/score.done"
  fi
  touch "$w/times.txt" "$w/eval.jsonl"
  if [ ! -f "$w/eval-reference.done" ]; then
    "$CF" math-eval "${WORLD_FLAG[@]}" --device "$DEVICE" --model "$ref" --val "$w/val.bin" --problems "$PROBLEMS" \
      --seed "$prob_seed" --json "$w/eval.jsonl" --label reference --quiet && touch "$w/eval-reference.done"
  fi
  local mode t0 t1 rc last
  for mode in $MODES; do
    [ -f "$w/$mode.done" ] && continue
    log "target: $mode, $STEPS steps (init seed $target_init)"
    t0=$(date +%s.%N)
    "$CF" train --device "$DEVICE" --config "$MODEL" --data "$w/noisy.bin" --ref "$w/noisy.ref.bin" --mode "$mode" \
      --keep "$KEEP" --steps "$STEPS" --batch "$BATCH" --seq "$SEQ" --lr "$LR" --seed "$target_init" --val "$w/val.bin" \
      --eval-every "${EVAL_EVERY:-250}" --eval-batches 16 --save-every 1000 --keep-checkpoints 1 --out "$w/$mode" \
      --log "$w/$mode.jsonl" --resume --quiet
    rc=$?
    t1=$(date +%s.%N)
    # one line per attempt; the summary adds the attempts of a mode
    echo "$mode $(awk "BEGIN{printf \"%.1f\", $t1 - $t0}") rc=$rc" >>"$w/times.txt"
    last=$(cat "$w/$mode/latest" 2>/dev/null)
    if [ $rc -eq 0 ] && [ "$last" = "$(printf "step_%08d" "$STEPS")" ] &&
      "$CF" math-eval "${WORLD_FLAG[@]}" --device "$DEVICE" --model "$w/$mode/$last" --val "$w/val.bin" \
        --problems "$PROBLEMS" --seed "$prob_seed" --json "$w/eval.jsonl" --label "$mode" --quiet; then
      touch "$w/$mode.done"
    else
      log "target: $mode failed (train rc=$rc, latest '${last}')"
      failed=1
    fi
  done
  return $failed
}

rc=0
if [ -n "${SEEDS:-}" ]; then
  mkdir -p "$W"
  read -r -a gpus <<<"${GPUS:-}"
  i=0
  for s in $SEEDS; do
    if [ "${PARALLEL:-0}" = 1 ]; then
      (
        [ ${#gpus[@]} -gt 0 ] && export CUDA_VISIBLE_DEVICES=${gpus[$(( i % ${#gpus[@]} ))]}
        run_seed "$W/seed$s" "$s" "$s" "$s" 2>&1 | sed -u "s/^/[seed $s] /" >"$W/seed$s.log"
        exit "${PIPESTATUS[0]}"
      ) &
    else
      log "=== seed $s"
      run_seed "$W/seed$s" "$s" "$s" "$s" || rc=1
    fi
    i=$(( i + 1 ))
  done
  if [ "${PARALLEL:-0}" = 1 ]; then
    log "seeds $SEEDS running in parallel: logs $W/seed*.log"
    for job in $(jobs -p); do wait "$job" || rc=1; done
    cat "$W"/seed*.log
  fi
else
  s=${SEED:-0}
  run_seed "$W" "${DATA_SEED:-$s}" "${INIT_SEED:-$s}" "${EVAL_SEED:-$s}" || rc=1
fi
log "done (rc=$rc)"
if command -v python3 >/dev/null; then
  python3 "$HERE/plot_utility.py" "$W" >"$W/summary.md" && cat "$W/summary.md"
fi
exit $rc
