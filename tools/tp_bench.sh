#!/usr/bin/env bash
# tp_bench.sh — tensor parallelism and ZeRO-1 data parallelism, regular vs
# centrifuge (keep 0.5): per-stage times, tokens/s and the TP all-reduce
# traffic (payload bytes per rank and time on the communication stream),
# medians over the steps after two warm-up steps of train --log.
#   tools/tp_bench.sh ./centrifuge-cuda OUTDIR [RUNS]
# RUNS: "config:seq:parallel ..." with parallel dpN, tpN or tpNdpM (N x M
#   processes, one per GPU; dp1 is one process)
#   (default: qwen2.5-7b and llama3.1-8b @2048 and tinyllama-1.1b @4096, each tp2 and dp2)
# Environment: STEPS (6), ACCUM (2, micro-batches per step per DP rank),
#   MODES ("regular centrifuge"), EXTRA (more train arguments, e.g. "--layers 8"
#   for a dry run of a large model's shapes on fewer GPUs).
set -u
BIN=$(readlink -f "$1"); OUT=$2; mkdir -p "$OUT"
RUNS=${3:-"qwen2.5-7b:2048:tp2 qwen2.5-7b:2048:dp2 llama3.1-8b:2048:tp2 llama3.1-8b:2048:dp2 tinyllama-1.1b:4096:tp2 tinyllama-1.1b:4096:dp2"}
STEPS=${STEPS:-6}; ACCUM=${ACCUM:-2}; MODES=${MODES:-"regular centrifuge"}
printf "%-15s %5s %6s %-11s %9s %8s %7s %6s %7s %7s %11s %9s %9s %8s\n" model seq par mode "tokens/s" "step ms" "fwd ms" "filt" "bwd ms" "opt ms" "bwd AR MB" "bwd AR ms" "fwd AR ms" "peak GiB" | tee "$OUT/table.txt"
for run in $RUNS; do
  IFS=: read -r cfg seq par <<<"$run"
  for mode in $MODES; do
    log="$OUT/${cfg}_${seq}_${par}_${mode}.jsonl"
    args="train --device cuda --config $cfg --seq $seq --batch 1 --grad-accum $ACCUM --steps $STEPS --warmup 1 --lr 1e-5 --select self --keep 0.5 --mode $mode --builtin-tokens 2M --quiet --log-file $log ${EXTRA:-}"
    tp=1; dp=1
    case $par in
      tp*dp*) tp=${par#tp}; tp=${tp%dp*}; dp=${par#*dp} ;;
      tp*) tp=${par#tp} ;;
      dp*) dp=${par#dp} ;;
    esac
    nproc=$((tp * dp))
    [ "$tp" -gt 1 ] && args="$args --tp $tp"
    # the previous run's processes may still be releasing their GPU memory
    for i in $(seq 1 60); do
      used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | sort -n | tail -1)
      [ "${used:-0}" -lt 2000 ] && break; sleep 1
    done
    timeout ${RUN_TIMEOUT:-240} torchrun --nproc_per_node $nproc --master_port $((29600 + RANDOM % 200)) --no-python "$BIN" $args >"$log.err" 2>&1
    rc=$?
    if [ $rc -ne 0 ]; then echo "$cfg $seq $par $mode failed (rc $rc): $(grep -m2 -i error "$log.err" | tr '\n' ' ')" | tee -a "$OUT/table.txt"; continue; fi
    python3 - "$log" "$cfg" "$seq" "$par" "$mode" <<'PY' | tee -a "$OUT/table.txt"
import json, statistics, sys
r = [json.loads(l) for l in open(sys.argv[1])][2:]
med = lambda k: statistics.median(x.get(k, 0) for x in r)
print(f"{sys.argv[2]:<15} {sys.argv[3]:>5} {sys.argv[4]:>6} {sys.argv[5]:<11} {med('tokens_per_s'):9.0f} {med('step_s')*1e3:8.1f} "
      f"{med('forward_s')*1e3:7.1f} {med('filter_s')*1e3:6.2f} {med('backward_s')*1e3:7.1f} {med('optimizer_s')*1e3:7.1f} "
      f"{med('tp_bwd_bytes')/1e6:11.1f} {med('tp_bwd_comm_s')*1e3:9.1f} {med('tp_fwd_comm_s')*1e3:9.1f} "
      f"{max(x.get('peak_mem_bytes', 0) for x in r)/2**30:8.1f}")
PY
  done
done
