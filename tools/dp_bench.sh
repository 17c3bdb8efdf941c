#!/usr/bin/env bash
# dp_bench.sh — data-parallel scaling of the training step: the same per-rank
# work (micro-batch 1 x S, --grad-accum 4) at DP=1 and DP=2 in regular,
# loss-only and centrifuge (keep 0.5), for each model below; tokens/s is the
# median over the steps after two warm-up steps, from train --log.
#   tools/dp_bench.sh ./centrifuge-cuda OUTDIR [MODELS]
# MODELS: "config:seq ..." (default "tinyllama-1.1b:4096 qwen2.5-1.5b:2048"); env MODES, DPS (default "1 2"), STEPS, EXTRA (more train arguments)
set -u
BIN=$(readlink -f "$1"); OUT=$2; mkdir -p "$OUT"
MODELS=${3:-"tinyllama-1.1b:4096 qwen2.5-1.5b:2048"}
STEPS=${STEPS:-8}
printf "%-16s %5s %-11s %4s %12s %10s %10s %10s %10s\n" model seq mode DP "tokens/s" "step ms" "fwd ms" "bwd ms" "opt ms" | tee "$OUT/table.txt"
for ms in $MODELS; do
  cfg=${ms%%:*}; seq=${ms##*:}
  for mode in ${MODES:-regular loss-only centrifuge}; do
    for dp in ${DPS:-1 2}; do
      log="$OUT/${cfg}_${seq}_${mode}_dp$dp.jsonl"
      args="train --device cuda --config $cfg --seq $seq --batch 1 --grad-accum 4 --steps $STEPS --warmup 1 --lr 1e-5 --select self --keep 0.5 --mode $mode --builtin-tokens 4M --quiet --log-file $log ${EXTRA:-}"
      if [ $dp -eq 1 ]; then CUDA_VISIBLE_DEVICES=0 timeout 300 "$BIN" $args >"$log.err" 2>&1
      else timeout 300 torchrun --nproc_per_node 2 --master_port $((29700 + RANDOM % 200)) --no-python "$BIN" $args >"$log.err" 2>&1; fi
      rc=$?
      if [ $rc -ne 0 ]; then echo "$cfg $seq $mode DP=$dp failed (rc $rc): $(tail -2 "$log.err" | tr '\n' ' ')" | tee -a "$OUT/table.txt"; continue; fi
      python3 - "$log" "$cfg" "$seq" "$mode" "$dp" <<'PY' | tee -a "$OUT/table.txt"
import json, statistics, sys
r = [json.loads(l) for l in open(sys.argv[1])][2:]
med = lambda k: statistics.median(x[k] for x in r)
print(f"{sys.argv[2]:<16} {sys.argv[3]:>5} {sys.argv[4]:<11} {sys.argv[5]:>4} {med('tokens_per_s'):12.0f} {med('step_s')*1e3:10.1f} "
      f"{med('forward_s')*1e3:10.1f} {med('backward_s')*1e3:10.1f} {med('optimizer_s')*1e3:10.1f}")
PY
    done
  done
done
# summary: scaling (DP=2 tokens/s over 2 x DP=1) and each mode's step over regular's, at DP=1 and DP=2
python3 - "$OUT/table.txt" <<'PY' | tee "$OUT/summary.txt"
import sys
rows = {}
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) == 9 and f[3].isdigit():
        rows[(f[0], f[1], f[2], int(f[3]))] = (float(f[4]), float(f[5]))
for (cfg, seq) in sorted({(k[0], k[1]) for k in rows}):
    for mode in sorted({k[2] for k in rows if k[:2] == (cfg, seq)}):
        one, two = rows.get((cfg, seq, mode, 1)), rows.get((cfg, seq, mode, 2))
        reg1, reg2 = rows.get((cfg, seq, "regular", 1)), rows.get((cfg, seq, "regular", 2))
        sc = f"{two[0] / (2 * one[0]):.3f}" if one and two else "-"
        r1 = f"{one[1] / reg1[1]:.4f}" if one and reg1 else "-"
        r2 = f"{two[1] / reg2[1]:.4f}" if two and reg2 else "-"
        print(f"{cfg} @{seq} {mode:<11} scaling {sc}  step/regular DP=1 {r1}  DP=2 {r2}")
PY
