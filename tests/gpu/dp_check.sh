#!/usr/bin/env bash
# dp_check.sh — data parallel (ZeRO-1, 2 GPUs) against one GPU on the same
# global batch, in every mode, and resume after a SIGKILL of the job.
#
#   tests/gpu/dp_check.sh ./centrifuge-cuda OUTDIR
#
# One GPU with --grad-accum 2 reads micro-batches 0,1 of every step; two ranks
# with --grad-accum 1 read micro-batch r of each group of two: the same
# tokens, so per-step losses must agree up to bf16 summation order.
set -u
BIN=$(readlink -f "$1"); OUT=$2; mkdir -p "$OUT"
STEPS=${STEPS:-30}
# DP_EXTRA: more arguments for every run (e.g. "--dp-grad-dtype bf16")
BASE="train --device cuda --config math-25m --builtin-tokens 2M --batch 4 --seq 256 --lr 2e-3 --warmup 3 --seed 7 --select self --keep 0.5 --quiet ${DP_EXTRA:-}"
COMMON="$BASE --steps $STEPS"
fail=0
compare() {  # compare two --log files: per-step loss within rel tolerance
  python3 - "$1" "$2" "$3" <<'EOF'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
tol = float(sys.argv[3])
if len(a) != len(b) or not a:
    print(f"    steps differ: {len(a)} vs {len(b)}"); sys.exit(1)
worst = max(abs(x["loss"] - y["loss"]) / max(1e-6, abs(y["loss"])) for x, y in zip(a, b))
kept = all(x["kept"] == y["kept"] and x["tokens"] == y["tokens"] for x, y in zip(a, b))
print(f"    {len(a)} steps: loss {a[0]['loss']:.4f} -> {a[-1]['loss']:.4f} (1 GPU {b[0]['loss']:.4f} -> {b[-1]['loss']:.4f}), "
      f"worst relative difference {worst:.2e}, kept/tokens equal: {kept}")
sys.exit(0 if worst <= tol and kept else 1)
EOF
}
for mode in regular loss-only centrifuge strawman; do
  echo "== $mode: DP=2 vs 1 GPU, $STEPS steps"
  CUDA_VISIBLE_DEVICES=0 "$BIN" $COMMON --mode $mode --grad-accum 2 --log-file "$OUT/one_$mode.jsonl" 2>"$OUT/one_$mode.err" || { echo "    1 GPU failed"; tail -3 "$OUT/one_$mode.err"; fail=1; continue; }
  torchrun --nproc_per_node 2 --master_port 29640 --no-python "$BIN" $COMMON --mode $mode --grad-accum 1 --log-file "$OUT/dp_$mode.jsonl" >"$OUT/dp_$mode.err" 2>&1 || { echo "    DP=2 failed"; tail -5 "$OUT/dp_$mode.err"; fail=1; continue; }
  compare "$OUT/dp_$mode.jsonl" "$OUT/one_$mode.jsonl" 2e-2 || { echo "    FAIL"; fail=1; }
done

echo "== LoRA (rank 8, q,k,v,o) with ZeRO-1 and filtering: DP=2 vs 1 GPU, centrifuge"
LORA="--lora-rank 8 --lora-targets q,k,v,o --mode centrifuge"
CUDA_VISIBLE_DEVICES=0 "$BIN" $COMMON $LORA --grad-accum 2 --log-file "$OUT/one_lora.jsonl" 2>"$OUT/one_lora.err" || { echo "    1 GPU failed"; tail -3 "$OUT/one_lora.err"; fail=1; }
torchrun --nproc_per_node 2 --master_port 29645 --no-python "$BIN" $COMMON $LORA --grad-accum 1 --log-file "$OUT/dp_lora.jsonl" >"$OUT/dp_lora.err" 2>&1 || { echo "    DP=2 failed"; tail -5 "$OUT/dp_lora.err"; fail=1; }
[ -s "$OUT/dp_lora.jsonl" ] && { compare "$OUT/dp_lora.jsonl" "$OUT/one_lora.jsonl" 2e-2 || { echo "    FAIL"; fail=1; }; }

echo "== the embedding rows gathered in many chunks (CF_DP_GATHER_BYTES=65536: 32 rows a chunk), centrifuge"
CUDA_VISIBLE_DEVICES=0 "$BIN" $COMMON --mode centrifuge --grad-accum 2 --log-file "$OUT/one_chunks.jsonl" 2>"$OUT/one_chunks.err" || { echo "    1 GPU failed"; fail=1; }
CF_DP_GATHER_BYTES=65536 torchrun --nproc_per_node 2 --master_port 29646 --no-python "$BIN" $COMMON --mode centrifuge --grad-accum 1 --log-file "$OUT/dp_chunks.jsonl" >"$OUT/dp_chunks.err" 2>&1 || { echo "    DP=2 failed"; tail -5 "$OUT/dp_chunks.err"; fail=1; }
[ -s "$OUT/dp_chunks.jsonl" ] && { compare "$OUT/dp_chunks.jsonl" "$OUT/one_chunks.jsonl" 2e-2 || { echo "    FAIL"; fail=1; }; }

echo "== untied embeddings (tiny-llama, vocab 320): DP=2 vs 1 GPU, centrifuge, accumulation 2 per rank"
UNTIED="train --device cuda --config tiny-llama --vocab-size 320 --builtin-tokens 2M --batch 4 --seq 256 --lr 2e-3 --warmup 3 --seed 7 --select self --keep 0.5 --quiet --steps $STEPS --mode centrifuge ${DP_EXTRA:-}"
CUDA_VISIBLE_DEVICES=0 "$BIN" $UNTIED --grad-accum 4 --log-file "$OUT/one_untied.jsonl" 2>"$OUT/one_untied.err" || { echo "    1 GPU failed"; tail -3 "$OUT/one_untied.err"; fail=1; }
torchrun --nproc_per_node 2 --master_port 29647 --no-python "$BIN" $UNTIED --grad-accum 2 --log-file "$OUT/dp_untied.jsonl" >"$OUT/dp_untied.err" 2>&1 || { echo "    DP=2 failed"; tail -5 "$OUT/dp_untied.err"; fail=1; }
[ -s "$OUT/dp_untied.jsonl" ] && { compare "$OUT/dp_untied.jsonl" "$OUT/one_untied.jsonl" 2e-2 || { echo "    FAIL"; fail=1; }; }

echo "== resume after SIGKILL of the DP=2 job (centrifuge)"
R=$OUT/resume; rm -rf "$R"; mkdir -p "$R"
torchrun --nproc_per_node 2 --master_port 29650 --no-python "$BIN" $BASE --steps 200 --mode centrifuge --out "$R/run" --save-every 50 --log-file "$R/full.jsonl" >/dev/null 2>&1 || { echo "    uninterrupted run failed"; fail=1; }
rm -rf "$R/run"
( torchrun --nproc_per_node 2 --master_port 29660 --no-python "$BIN" $BASE --steps 200 --mode centrifuge --out "$R/run" --save-every 50 --log-file "$R/part.jsonl" >"$R/part.err" 2>&1 & echo $! >"$R/pid"; wait ) &
# kill the whole job once the step-20 checkpoint exists
for i in $(seq 1 600); do [ -f "$R/run/step_00000100/optim-rank-00001-of-00002.bin" ] && break; sleep 0.05; done
pkill -KILL -f "centrifuge-cuda train" ; pkill -KILL -f torchrun; wait 2>/dev/null
echo "    killed; latest = $(cat "$R/run/latest" 2>/dev/null)"
torchrun --nproc_per_node 2 --master_port 29670 --no-python "$BIN" $BASE --steps 200 --mode centrifuge --out "$R/run" --save-every 50 --resume --log-file "$R/resumed.jsonl" >"$R/resume.err" 2>&1 || { echo "    resume failed"; tail -5 "$R/resume.err"; fail=1; }
python3 - "$R/full.jsonl" "$R/resumed.jsonl" <<'EOF' || fail=1
import json, sys
full = {r["step"]: r["loss"] for r in map(json.loads, open(sys.argv[1]))}
res = {r["step"]: r["loss"] for r in map(json.loads, open(sys.argv[2]))}
common = sorted(set(full) & set(res))
if not common: print("    no common steps"); sys.exit(1)
worst = max(abs(full[s] - res[s]) / full[s] for s in common)
print(f"    resumed steps {common[0]}..{common[-1]}: worst relative difference to the uninterrupted run {worst:.2e}")
sys.exit(0 if worst <= 2e-2 else 1)
EOF

echo "== launchers: mpirun and a bad environment"
mpirun --allow-run-as-root -np 2 -x MASTER_PORT=29680 "$BIN" $BASE --steps 3 --mode centrifuge >"$OUT/mpirun.err" 2>&1 && echo "    mpirun: ok" || { echo "    mpirun failed"; tail -5 "$OUT/mpirun.err"; fail=1; }
WORLD_SIZE=2 "$BIN" $BASE --steps 3 >"$OUT/badenv.err" 2>&1; rc=$?
echo "    WORLD_SIZE without RANK: rc=$rc: $(tail -1 "$OUT/badenv.err")"; [ $rc -ne 0 ] || fail=1
RANK=3 WORLD_SIZE=4 LOCAL_RANK=3 LOCAL_WORLD_SIZE=4 timeout 60 "$BIN" $BASE --steps 3 >"$OUT/toomany.err" 2>&1; rc=$?
echo "    more ranks than GPUs: rc=$rc: $(tail -1 "$OUT/toomany.err")"; [ $rc -ne 0 ] && [ $rc -ne 124 ] || fail=1

echo "== a rank that dies during the step's all-gathers (after the norm's all-reduce of step 3)"
# started by hand: torchrun and mpirun would kill the survivor themselves
for r in 0 1; do
  RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29690 CF_TEST_DIE_AFTER_NORM=3 \
    timeout 180 "$BIN" $BASE --steps 10 --mode centrifuge --dist-timeout 15 >"$OUT/die_$r.err" 2>&1 &
  eval "pid$r=\$!"
done
t0=$(date +%s); wait $pid0; rc0=$?; t1=$(date +%s); wait $pid1; rc1=$?
echo "    rank 1: rc=$rc1 ($(grep -o 'CF_TEST_DIE_AFTER_NORM=[0-9]*: exiting' "$OUT/die_1.err" | head -1))"
echo "    rank 0: rc=$rc0 after $((t1 - t0)) s: $(tail -1 "$OUT/die_0.err")"
[ $rc1 -eq 3 ] && [ $rc0 -ne 0 ] && [ $rc0 -ne 124 ] && grep -qE "did not finish within|NCCL error" "$OUT/die_0.err" || { echo "    FAIL"; fail=1; }

rm -rf "$R/run"   # checkpoints: too large to bring back
echo "== dp_check: $([ $fail -eq 0 ] && echo PASS || echo FAIL)"
exit $fail
