#!/usr/bin/env bash
# gpu_session.sh — what one call on the lent GPU machine runs: binaries built
# here (make cuda + the GPU tests), copied with their runtime libraries into
# .gpucarry/ by tools/gpu_carry.sh, then tests and benchmarks.
# Usage on the GPU machine: tools/gpu_session.sh PART...  (logs under $OUT)
#   parts: tests sanitize sanitize-attn bench-main bench-old bench-sweeps bench-3b pytorch
#          parity parity-cuda attn-timing peft-parity dp-check dp-bench dp-ctas tp-check tp-bench rows-x4 rows-x8
#          rows-x8-dry bench-accum profile dp-bf16 ab-profile ab-fused ab-head attn-shapes attn-ab attn-parts dp-prio
#          bench-pair pair-ab norm-blocks cf-side ab-old grad-keep side-ab ncu-step norm-ab side-prio pair-rows
#          pair-full side-attn gemm-survey attn-hpb side-sms pair-head
#          lmhead-cluster ncu-lmhead sanitize-lmhead parity-bigvocab ab-old-accum pingpong pingpong-model ncu-attn-src ncu-attn-kernels cf-pp64 ncu-ops hpb-model
#          adamw-ab attn-in-model ncu-lmhead-logits lmhead-logits ncu-attn-pipes fwd-wg ncu-attn-modes attn-trace
#          ncu-cf cf-plan env-ab attn-env sdpa cpubench utility train-smoke lora-bench kv-bench ddp-baseline dp-8b
set -u
# every part named must exist before any runs (a typo would otherwise cost a call's device time)
known=$(grep -oE '^    [a-z0-9-]+\)' "$0" | tr -d ' )')
for part in "$@"; do
  grep -qx -- "$part" <<<"$known" || { echo "gpu_session: unknown part '$part' (see the list at the top)" >&2; exit 2; }
done
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
G=$PWD/.gpucarry
[ -f "$G/carry.tar.xz" ] && [ ! -f "$G/centrifuge-cuda" ] && tar xJf "$G/carry.tar.xz" -C "$G"
export LD_LIBRARY_PATH="$G/lib:${LD_LIBRARY_PATH:-}"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-16}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
cat "$G/commit.txt" 2>/dev/null | tee "$OUT/commit.txt"
CF="$G/centrifuge-cuda"
# peft, from a carried wheel where the machine has none (pip download peft --no-deps -d .gpucarry-whl)
# need_peft: peft (and what it imports that the machine may lack, e.g. accelerate) from the wheels carried in
# .gpucarry-whl (pip download --no-deps -d .gpucarry-whl peft accelerate): the machine has no network
need_peft() { python3 -c 'import peft' 2>/dev/null || pip install -q --no-index --no-deps .gpucarry-whl/*.whl 2>&1 | tail -1; }
# the commit of the carried binaries, for tools/bench_pytorch.py's records (this copy has no .git)
CF_COMMIT=$(head -c 7 "$G/commit.txt" 2>/dev/null); export CF_COMMIT
# smi_start FILE: samples the SM clock, power and throttle reasons every 50 ms into FILE in the
# background (tools/clock_summary.py reads it); prints the sampler's pid for kill
smi_start() {
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv,noheader -lms 50 >"$1" 2>/dev/null & echo $!
}
# env_ab VAR "VALUES" MODES TAG [DEFAULT_MODEL]: one environment switch A/B, alternated twice per model
# in ACCUM_MODELS (default DEFAULT_MODEL) at 1 x 8, the bench rows of MODES; records
# $OUT/TAG<value>_<model>_r<rep>.jsonl (.txt), lines prefixed "VAR=value rep N"
env_ab() {
  local var=$1 values=$2 modes=$3 tag=$4 cs c sq rep v
  for cs in ${ACCUM_MODELS:-${5:-qwen2.5-1.5b:2048}}; do c=${cs%%:*}; sq=${cs##*:}
    for rep in 1 2; do for v in $values; do
      env "$var=$v" "$CF" bench --device cuda --config $c --seq $sq --batch 1 --grad-accum 8 --modes $modes \
        --keep 0.5 --steps ${ACCUM_STEPS:-6} --warmup 2 --json "$OUT/$tag${v}_${c}_r$rep.jsonl" 2>&1 |
        tee "$OUT/$tag${v}_${c}_r$rep.txt" | grep -E "  0\.50" | sed "s/^/$var=$v rep $rep /"
    done; done
  done
}
# ncu_bench_attn OUTBASE BIN "S H Hkv D" [NCU_ARGS...]: bench_attention BIN (Hopper path) under ncu, the time and
# DRAM bytes of every kernel launch (or those NCU_ARGS select) into OUTBASE.csv, ncu's messages into OUTBASE.err
ncu_bench_attn() {
  local j=$1 b=$2 sh=$3; shift 3
  BENCH_ATTN_PATHS=auto timeout 240 ncu --clock-control none --csv --print-units base "$@" \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum "$b" $sh >"$j.csv" 2>"$j.err"
}
# a part named again in one invocation writes under $OUT/PART_N/ (N = 2, 3, ...), so its
# result files do not overwrite the first run's
OUT0=$OUT
declare -A part_runs=()
for part in "$@"; do
  part_runs[$part]=$(( ${part_runs[$part]:-0} + 1 ))
  OUT=$OUT0 again=""
  if [ "${part_runs[$part]}" -gt 1 ]; then
    OUT="$OUT0/${part}_${part_runs[$part]}"; mkdir -p "$OUT"; again=" (again: files under ${part}_${part_runs[$part]}/)"
  fi
  echo "=== $part $(date +%T)$again"
  case $part in
    attn-trace)
      # issue 17: where the attention backward's SM time goes, block by block (attention/trace.cuh; a trace
      # build's bench_attention carried as bench_attention_trace, gpu_carry.sh): the last of each mode's 23
      # calls at the four shapes, summarised by tools/attn_timeline.py; the normal build's times beside
      for sh in "4096 32 4 64" "4096 32 8 128" "2048 12 2 128" "2048 24 8 128"; do
        f="$OUT/attn_trace_${sh// /_}.txt"; rm -f "$f"
        echo "S H Hkv D = $sh"
        CF_ATTN_TRACE_FILE="$f" CF_ATTN_TRACE_EVERY=23 BENCH_ATTN_PATHS=auto "$G/bench_attention_trace" $sh 2>&1 |
          grep -E "backward (full|centrifuge)" | sed "s/^/trace build: /"
        BENCH_ATTN_PATHS=auto "$G/bench_attention" $sh 2>&1 | grep -E "backward (full|centrifuge)" | sed "s/^/normal build: /"
        python3 tools/attn_timeline.py "$f" > "${f%.txt}_summary.txt" 2>&1; cat "${f%.txt}_summary.txt"
        for c in 22 45; do python3 tools/attn_timeline.py "$f" --call $c --plot "${f%.txt}_call$c.png" >/dev/null 2>&1; done
        gzip -f "$f"
      done 2>&1 | tee "$OUT/attn_trace.txt" ;;
    tests)
      "$G/test_gpu_ops" >"$OUT/test_gpu_ops.log" 2>&1; echo "test_gpu_ops rc=$?"; tail -1 "$OUT/test_gpu_ops.log"
      "$G/test_gpu_model" >"$OUT/test_gpu_model.log" 2>&1; echo "test_gpu_model rc=$?"; grep -E "FAIL|err|tests,|:[0-9]+:" "$OUT/test_gpu_model.log" | head -40 ;;
    sanitize)
      timeout 300 compute-sanitizer --tool memcheck --print-limit 5 "$G/test_gpu_model" >"$OUT/sanitizer.log" 2>&1; echo "memcheck rc=$?"; tail -3 "$OUT/sanitizer.log" ;;
    sanitize-attn)
      # the attention tests of test_gpu_ops (every backward mode, both paths, forced heads per block and parts)
      CF_TEST_ONLY=attention timeout 400 compute-sanitizer --tool memcheck --print-limit 5 "$G/test_gpu_ops" \
        >"$OUT/sanitizer_attn.log" 2>&1; echo "memcheck (attention) rc=$?"; tail -3 "$OUT/sanitizer_attn.log" ;;
    sanitize-lmhead)
      # the LM head's tests of test_gpu_ops (the cluster kernel at five vocabularies, the one-block kernel)
      # under memcheck; the 2-/4-block cluster test under racecheck, every hazard listed (over the large
      # vocabularies racecheck runs past any limit, and with a kernel filter it failed in cuBLASLt: run 21)
      for t in memcheck:lmhead racecheck:rows_of_two; do
        CF_TEST_ONLY=${t#*:} timeout 300 compute-sanitizer --tool ${t%%:*} --print-limit 200 "$G/test_gpu_ops" \
          >"$OUT/sanitizer_lmhead_${t%%:*}.log" 2>&1; echo "$t rc=$?"; tail -3 "$OUT/sanitizer_lmhead_${t%%:*}.log"
      done ;;
    bench-main)
      "$CF" bench --device cuda --config tinyllama-1.1b --seq 4096 --modes regular,loss-only,centrifuge,strawman --keep 0.5 --steps 10 --warmup 2 --profile --json "$OUT/bench_tinyllama_4096.jsonl" 2>&1 | tee "$OUT/bench_tinyllama_4096.txt"
      "$CF" bench --device cuda --config qwen2.5-1.5b --seq 2048 --modes regular,loss-only,centrifuge,strawman --keep 0.5 --steps 10 --warmup 2 --profile --json "$OUT/bench_qwen_2048.jsonl" 2>&1 | tee "$OUT/bench_qwen_2048.txt" ;;
    ab-old-accum)
      # this build against the carried earlier one (centrifuge-cuda-old), alternated twice per model in
      # ACCUM_MODELS at 1 x 8, the bench rows of AB_MODES (default centrifuge); records ab<old|new>_<model>_r<rep>
      for cs in ${ACCUM_MODELS:-llama3.2-3b:2048}; do c=${cs%%:*}; sq=${cs##*:}
        for rep in 1 2; do for v in old new; do
          b="$CF"; [ $v = old ] && b="$G/centrifuge-cuda-old"
          "$b" bench --device cuda --config $c --seq $sq --batch 1 --grad-accum 8 --modes ${AB_MODES:-centrifuge} \
            --keep 0.5 --steps ${ACCUM_STEPS:-6} --warmup 2 --json "$OUT/ab${v}_${c}_r$rep.jsonl" 2>&1 |
            tee "$OUT/ab${v}_${c}_r$rep.txt" | grep -E "  0\.50" | sed "s/^/$v rep $rep /"
        done; done
      done ;;
    bench-old)
      # this build and the carried build of an earlier commit (centrifuge-cuda-old), alternating
      for r in 1 2; do for v in old new; do
        b="$CF"; [ $v = old ] && b="$G/centrifuge-cuda-old"
        "$b" bench --device cuda --config tinyllama-1.1b --seq 4096 --modes regular,loss-only,centrifuge --keep 0.5 --steps 10 --warmup 2 --json "$OUT/ab_${v}_$r.jsonl" 2>&1 | tee "$OUT/ab_${v}_$r.txt" | tail -3
      done; done ;;
    dp-check)
      bash tests/gpu/dp_check.sh "$CF" "$OUT/dp_check" 2>&1 | tee "$OUT/dp_check.txt" ;;
    dp-8b)
      # Llama3.1-8B full fine-tuning: one H200 (expected: out of memory), then ZeRO-1 on two
      CUDA_VISIBLE_DEVICES=0 timeout 120 "$CF" train --device cuda --config llama3.1-8b --seq 2048 --batch 1 --steps 2 --quiet 2>&1 | tail -2
      for mode in regular centrifuge; do
        timeout 240 torchrun --nproc_per_node 2 --master_port $((29800 + RANDOM % 100)) --no-python "$CF" train --device cuda \
          --config llama3.1-8b --seq 2048 --batch 1 --grad-accum 4 --steps 6 --warmup 1 --lr 1e-5 --select self --keep 0.5 \
          --mode $mode --builtin-tokens 2M --log-file "$OUT/dp8b_$mode.jsonl" 2>&1 | grep -E "^train|step +[0-9]+\/|error" | tail -5
        nvidia-smi --query-gpu=memory.used --format=csv,noheader | head -2
      done ;;
    lora-bench)
      # paper Table 2's LoRA row: Llama3.2-3B, rank 64 on q,k,v,o, keep 0.5, then all seven targets;
      # PyTorch + transformers + PEFT on the same shapes after each
      need_peft
      for tg in q,k,v,o all; do
        j="$OUT/bench_lora3b_2048_$(echo $tg | tr -d ,)"
        "$CF" bench --device cuda --config llama3.2-3b --seq 2048 --modes regular,loss-only,centrifuge --keep 0.5 \
          --lora-rank 64 --lora-alpha 128 --lora-targets $tg --steps 10 --warmup 2 --json "$j.jsonl" 2>&1 | tee "$j.txt"
        python3 tools/bench_pytorch.py --config llama3.2-3b --seq 2048 --lora-rank 64 --lora-alpha 128 --lora-targets $tg \
          --modes regular,loss-only --keep 0.5 --steps 10 --warmup 2 --json "${j}_pt.jsonl" --centrifuge-json "$j.jsonl" 2>&1 \
          | tee "${j}_pt.txt" | grep -v -i warn | tail -9
      done ;;
    kv-bench)
      # issue 18: what centrifuge-kv costs against centrifuge (TinyLlama @4096)
      "$CF" bench --device cuda --config tinyllama-1.1b --seq 4096 --modes regular,centrifuge,centrifuge-kv --keep 0.5 \
        --steps 10 --warmup 2 --json "$OUT/bench_kv_tinyllama.jsonl" 2>&1 | tee "$OUT/bench_kv_tinyllama.txt" ;;
    ddp-baseline)
      # PyTorch's own data parallel (DDP + ZeroRedundancyOptimizer), the same shapes as dp-bench
      for cs in tinyllama-1.1b:4096 qwen2.5-1.5b:2048; do for w in 1 2; do
        timeout 200 torchrun --nproc_per_node $w --master_port $((29900 + w)) tools/bench_pytorch.py --ddp \
          --config ${cs%%:*} --seq ${cs##*:} --batch 1 --grad-accum 4 --modes regular,loss-only --keep 0.5 \
          --steps 5 --warmup 2 2>&1 | grep -E "^ddp|Error|error" | tail -4
      done; done 2>&1 | tee "$OUT/ddp_baseline.txt" ;;
    tp-check)
      bash tests/gpu/tp_check.sh "$CF" "$OUT/tp_check" 2>&1 | tee "$OUT/tp_check.txt" ;;
    tp-bench)
      bash tools/tp_bench.sh "$CF" "$OUT/tp_bench" 2>&1 | tee "$OUT/tp_bench.txt" ;;
    bench-accum)
      # issue 17: training-sized steps, ours then PyTorch's, same session, per model and per
      # micro-batch x grad-accum in ACCUM_SHAPES (default 1:8; "1:8 2:4" adds two sequences per micro-batch)
      for cs in ${ACCUM_MODELS:-tinyllama-1.1b:4096}; do for ba in ${ACCUM_SHAPES:-1:8}; do
        c=${cs%%:*}; sq=${cs##*:}; bb=${ba%%:*}; aa=${ba##*:}; j="$OUT/bench_accum${aa}_${c}_$sq"
        [ "$bb" != 1 ] && j="$OUT/bench_b${bb}_accum${aa}_${c}_$sq"
        # the SM clock and power of each side's run (nvidia-smi every 50 ms; tools/clock_summary.py)
        p=$(smi_start "${j}_clocks.csv")
        "$CF" bench --device cuda --config $c --seq $sq --batch $bb --grad-accum $aa \
          --modes regular,loss-only,centrifuge --keep 0.5 --steps ${ACCUM_STEPS:-10} --warmup 2 --json "$j.jsonl" 2>&1 | tee "$j.txt"
        kill $p; python3 tools/clock_summary.py "${j}_clocks.csv" "ours $c" | tee -a "$OUT/clocks.txt"
        p=$(smi_start "${j}_pt_clocks.csv")
        python3 tools/bench_pytorch.py --config $c --seq $sq --batch $bb --grad-accum $aa \
          --modes regular,loss-only --keep 0.5 --steps ${ACCUM_STEPS:-10} --warmup 2 --json "${j}_pt.jsonl" \
          --centrifuge-json "$j.jsonl" 2>&1 | tee "${j}_pt.txt" | tail -12
        kill $p; python3 tools/clock_summary.py "${j}_pt_clocks.csv" "PyTorch $c" | tee -a "$OUT/clocks.txt"
      done; done ;;
    ab-fused)
      # issue 17 part 2: the per-op profile of the carried earlier build (old), this build with the fused
      # projections off (CF_FUSED_PROJ=0: the residual epilogue only) and this build, alternating, grad-accum 8
      for cs in ${ACCUM_MODELS:-tinyllama-1.1b:4096}; do for v in old unfused new; do
        b="$CF"; [ $v = old ] && b="$G/centrifuge-cuda-old"
        CF_FUSED_PROJ=$([ $v = unfused ] && echo 0 || echo 1) "$b" bench --device cuda --config ${cs%%:*} \
          --seq ${cs##*:} --batch 1 --grad-accum 8 --modes regular,centrifuge --keep 0.5 --steps ${ACCUM_STEPS:-4} --warmup 2 \
          --profile --json "$OUT/abfused_${v}_${cs%%:*}.jsonl" 2>&1 | tee "$OUT/abfused_${v}_${cs%%:*}.txt" \
          | grep -E "profile|  0\.50" | sed "s/^/$v /"
      done; done ;;
    rows-x4)
      # issue 19 on nvidia-h200-x4: DP=1,2,4 scaling (grad-accum 4) and TP=4 Qwen2.5-7B, then PyTorch DDP
      MODES="regular loss-only centrifuge" ACCUM=4 bash tools/tp_bench.sh "$CF" "$OUT/rows_x4" \
        "tinyllama-1.1b:4096:dp1 tinyllama-1.1b:4096:dp2 tinyllama-1.1b:4096:dp4 qwen2.5-1.5b:2048:dp1 qwen2.5-1.5b:2048:dp2 qwen2.5-1.5b:2048:dp4" 2>&1 | tee "$OUT/rows_x4.txt"
      bash tools/tp_bench.sh "$CF" "$OUT/rows_x4_tp" "qwen2.5-7b:2048:tp4" 2>&1 | tee -a "$OUT/rows_x4.txt"
      for cfg in tinyllama-1.1b:4096 qwen2.5-1.5b:2048; do
        timeout 300 torchrun --nproc_per_node 4 --master_port 29910 tools/bench_pytorch.py --ddp --config ${cfg%%:*} \
          --seq ${cfg##*:} --batch 1 --grad-accum 4 --modes regular,loss-only --keep 0.5 --steps 5 --warmup 2 2>&1 | grep -E "^ddp|rror" | tail -4
      done 2>&1 | tee -a "$OUT/rows_x4.txt" ;;
    rows-x8)
      # issue 20 on nvidia-h200-x8: TP=8 rows of the paper's Table 2
      RUN_TIMEOUT=400 bash tools/tp_bench.sh "$CF" "$OUT/rows_x8" \
        "llama3.1-8b:2048:tp8 qwen3-14b:2048:tp8 qwen3-32b:4096:tp8 alia-40b:4096:tp8" 2>&1 | tee "$OUT/rows_x8.txt" ;;
    profile)
      # issue 17: where the regular step's time goes (per op category, CUDA events), grad-accum 8
      for cs in ${ACCUM_MODELS:-tinyllama-1.1b:4096}; do
        "$CF" bench --device cuda --config ${cs%%:*} --seq ${cs##*:} --batch 1 --grad-accum 8 --modes regular,centrifuge \
          --keep 0.5 --steps 4 --warmup 2 --profile 2>&1 | tee "$OUT/profile_${cs%%:*}.txt" | tail -30
      done ;;
    ab-profile)
      # issue 17: the per-op profile of this build against the carried earlier one (centrifuge-cuda-old), alternating
      for cs in ${ACCUM_MODELS:-qwen2.5-1.5b:2048}; do for v in old new; do
        b="$CF"; [ $v = old ] && b="$G/centrifuge-cuda-old"
        "$b" bench --device cuda --config ${cs%%:*} --seq ${cs##*:} --batch 1 --grad-accum 8 --modes regular,centrifuge \
          --keep 0.5 --steps 4 --warmup 2 --profile 2>&1 | tee "$OUT/abprof_${v}_${cs%%:*}.txt" | grep -E "profile|  0\.50" | sed "s/^/$v /"
      done; done ;;
    pair-ab)
      # issue 17: the MLP's weight gradients of two micro-batches in one GEMM (engine/dwpair.c) off and on,
      # alternated twice per model in ACCUM_MODELS at 1 x 8, regular and centrifuge; then one profile with pairs
      for cs in ${ACCUM_MODELS:-qwen2.5-1.5b:2048}; do c=${cs%%:*}; sq=${cs##*:}
        for rep in 1 2; do for v in 0 1; do
          CF_DW_PAIR=$v "$CF" bench --device cuda --config $c --seq $sq --batch 1 --grad-accum 8 --modes regular,centrifuge \
            --keep 0.5 --steps ${ACCUM_STEPS:-6} --warmup 2 --json "$OUT/pair${v}_${c}_r$rep.jsonl" 2>&1 |
            tee "$OUT/pair${v}_${c}_r$rep.txt" | grep -E "  0\.50" | sed "s/^/pair=$v rep $rep /"
        done; done
        "$CF" bench --device cuda --config $c --seq $sq --batch 1 --grad-accum 8 --modes centrifuge --keep 0.5 \
          --steps 4 --warmup 2 --profile 2>&1 | tee "$OUT/pairprof_${c}.txt" | grep -E "profile|  0\.50" | sed "s/^/pair=1 /"
      done ;;
    ab-old)
      # this build against the carried earlier one (centrifuge-cuda-old), alternated twice per model in
      # ACCUM_MODELS at 1 x 8, regular and centrifuge (medians of ACCUM_STEPS steps)
      for cs in ${ACCUM_MODELS:-qwen2.5-1.5b:2048}; do c=${cs%%:*}; sq=${cs##*:}
        for rep in 1 2; do for v in old new; do
          b="$CF"; [ $v = old ] && b="$G/centrifuge-cuda-old"
          "$b" bench --device cuda --config $c --seq $sq --batch 1 --grad-accum 8 --modes regular,centrifuge \
            --keep 0.5 --steps ${ACCUM_STEPS:-6} --warmup 2 --json "$OUT/ab_${v}_${c}_r$rep.jsonl" 2>&1 |
            tee "$OUT/ab_${v}_${c}_r$rep.txt" | grep -E "  0\.50" | sed "s/^/$v rep $rep /"
        done; done
      done ;;
    ncu-step)
      # per-kernel time and DRAM traffic (ncu) of a short run per model in ACCUM_MODELS and mode: its first
      # NCU_LAYERS layers (default 4), grad-accum 2, one warm-up and one timed step (the second step's
      # backwards pair); GEMM tuning off (the heuristic's first algorithms); tools/ncu_kernels.py sums them
      for cs in ${ACCUM_MODELS:-llama3.2-3b:2048}; do c=${cs%%:*}; sq=${cs##*:}
        for md in regular centrifuge; do j="$OUT/ncu_${c}_$md"
          CF_GEMM_TUNE=0 timeout 240 ncu --clock-control none --csv --print-units base \
            --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum "$CF" bench --device cuda \
            --config $c --layers ${NCU_LAYERS:-4} --seq $sq --batch 1 --grad-accum 2 --modes $md --keep 0.5 \
            --steps 1 --warmup 1 >"$j.csv" 2>"$j.err"
          echo "ncu $c $md rc=$?"; python3 tools/ncu_kernels.py "$j.csv" --top 32 | tee "$j.txt"
        done
      done ;;
    ncu-ops)
      # per-kernel time and DRAM traffic (ncu) of the kernels whose names match NCU_KERNELS (a regex), in a
      # short run per model in ACCUM_MODELS (NCU_LAYERS layers, default 4; grad-accum 2; NCU_MODES, default
      # regular; one warm-up and one timed step), for each of NCU_VARIANTS: old (the carried
      # centrifuge-cuda-old), new, or VAR=value (this build with that switch); tools/ncu_kernels.py sums them
      for cs in ${ACCUM_MODELS:-tinyllama-1.1b:4096}; do c=${cs%%:*}; sq=${cs##*:}
        for va in ${NCU_VARIANTS:-old new}; do
          b="$CF"; e=""; case $va in old) b="$G/centrifuge-cuda-old" ;; new) ;; *) e=$va ;; esac
          j="$OUT/ncuops_${c}_${va//=/_}"
          env $e CF_GEMM_TUNE=0 timeout 200 ncu --clock-control none --csv --print-units base \
            --kernel-name "regex:${NCU_KERNELS:-.}" --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
            "$b" bench --device cuda --config $c --layers ${NCU_LAYERS:-4} --seq $sq --batch 1 --grad-accum 2 \
            --modes ${NCU_MODES:-regular} --keep 0.5 --steps 1 --warmup 1 >"$j.csv" 2>"$j.err"
          echo "ncu $c $va rc=$?"; python3 tools/ncu_kernels.py "$j.csv" --top 24 | tee "$j.txt"
        done
      done ;;
    norm-ab)
      # the early gradient norm (default) against the step's whole-buffer pass (CF_NORM_EARLY=0)
      env_ab CF_NORM_EARLY "0 1" regular,centrifuge norm llama3.2-3b:2048 ;;
    side-prio)
      # side sections' variants alternated twice per model in ACCUM_MODELS at 1 x 8, regular and centrifuge:
      # noearly (CF_NORM_EARLY=0), early (the default: early norm, side stream at low priority) and
      # level (CF_SIDE_PRIORITY=normal: every stream at one priority)
      for cs in ${ACCUM_MODELS:-llama3.2-3b:2048}; do c=${cs%%:*}; sq=${cs##*:}
        for rep in 1 2; do for v in noearly early level; do
          ne=1; pr=low; [ $v = noearly ] && ne=0; [ $v = level ] && pr=normal
          CF_NORM_EARLY=$ne CF_SIDE_PRIORITY=$pr "$CF" bench --device cuda --config $c --seq $sq --batch 1 \
            --grad-accum 8 --modes regular,centrifuge --keep 0.5 --steps ${ACCUM_STEPS:-5} --warmup 2 \
            --json "$OUT/prio_${v}_${c}_r$rep.jsonl" 2>&1 |
            tee "$OUT/prio_${v}_${c}_r$rep.txt" | grep -E "  0\.50" | sed "s/^/$v rep $rep /"
        done; done
      done ;;
    pair-rows)
      # pairs up to CF_DWPAIR_MAX_ROWS=4096 (TinyLlama @4096's 2048 kept rows pair) against 2048, centrifuge only
      env_ab CF_DWPAIR_MAX_ROWS "2048 4096" centrifuge rows tinyllama-1.1b:4096 ;;
    pair-full)
      # the full backwards' MLP weight gradients paired too (default; a stash of 2 micro-batches) against the
      # compact modes only (CF_DW_PAIR_FULL=0); regular (loss-only runs the same backward; TinyLlama @4096 pairs only with
      # CF_DWPAIR_MAX_ROWS above 4096 in the environment)
      env_ab CF_DW_PAIR_FULL "0 1" regular full llama3.2-3b:2048 ;;
    gemm-survey)
      # every cuBLASLt heuristic result of each GEMM shape of a short run (CF_GEMM_TUNE=3: the bit-identical
      # ones and those that differ, timed), per model in ACCUM_MODELS, centrifuge then regular; the lines of
      # results at least 10% faster than the heuristic's first
      for cs in ${ACCUM_MODELS:-qwen2.5-1.5b:2048}; do c=${cs%%:*}; sq=${cs##*:}
        CF_GEMM_TUNE=3 "$CF" bench --device cuda --config $c --seq $sq --batch 1 --grad-accum 2 --modes centrifuge,regular \
          --keep 0.5 --steps 1 --warmup 1 >"$OUT/survey_$c.txt" 2>"$OUT/survey_$c.err"
        echo "survey $c rc=$? $(grep -c 'gemm survey' "$OUT/survey_$c.err") results"
        sed -n 's/^gemm survey: \(.*(\([0-9.]*\)x the first)\)$/\2 \1/p' "$OUT/survey_$c.err" |
          awk '$1 > 0 && $1 < 0.9' | cut -d' ' -f2- | head -40
      done ;;
    attn-hpb)
      # attention alone at the two default shapes (or HPB_SHAPES, "S H Hkv D [B]" separated by '|'): every
      # forced heads-per-block (HPB_LIST, default 1 2 4; a count that does not divide the group falls to the
      # next lower divisor) x query parts (1 2), full and centrifuge backward (the rules' choice first)
      IFS='|' read -ra shs <<<"${HPB_SHAPES:-4096 32 4 64|4096 32 8 128}"
      for sh in "${shs[@]}"; do
        echo "auto, S H Hkv D = $sh"; BENCH_ATTN_PATHS=auto "$G/bench_attention" $sh 2>&1 | grep -E "backward (full|centrifuge)"
        for hpb in ${HPB_LIST:-1 2 4}; do for sp in 1 2; do
          echo "hpb $hpb split $sp, S H Hkv D = $sh"
          CF_ATTN_SM90_BWD_HPB=$hpb CF_ATTN_SM90_BWD_SPLIT=$sp BENCH_ATTN_PATHS=auto "$G/bench_attention" $sh 2>&1 |
            grep -E "backward (full|centrifuge)"
        done; done
      done 2>&1 | tee "$OUT/attn_hpb.txt" ;;
    side-sms)
      # side-section GEMMs planned for n SMs (CF_SIDE_SMS=n; the default leaves 32 to the compute stream),
      # against every SM (0), regular and centrifuge (SIDE_SMS_VALUES: the n to alternate)
      env_ab CF_SIDE_SMS "${SIDE_SMS_VALUES:-0 100}" regular,centrifuge sms ;;
    pair-head)
      # the LM head's weight gradients of two compact backwards in one GEMM (default) against one per backward
      # (CF_DW_PAIR_HEAD=0); centrifuge only (the full backwards never pair it)
      env_ab CF_DW_PAIR_HEAD "0 1" centrifuge head ;;
    ncu-lmhead)
      # the LM head's rows kernels alone (ncu: time and DRAM bytes per launch), one-block (CF_LMHEAD_CLUSTER=0)
      # and cluster, per model in ACCUM_MODELS: a 1-layer regular run, one warm-up and one timed step
      for cs in ${ACCUM_MODELS:-qwen2.5-1.5b:2048}; do c=${cs%%:*}; sq=${cs##*:}
        for v in 0 1; do j="$OUT/ncu_lmhead_${c}_cl$v"
          CF_LMHEAD_CLUSTER=$v timeout 240 ncu --clock-control none --csv --print-units base --kernel-name regex:lmhead_rows \
            --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum "$CF" bench --device cuda \
            --config $c --layers 1 --seq $sq --batch 1 --grad-accum 1 --modes regular --steps 1 --warmup 1 \
            >"$j.csv" 2>"$j.err"
          echo "ncu-lmhead $c cluster=$v rc=$?"; python3 tools/ncu_kernels.py "$j.csv" --top 8 | tee "$j.txt"
        done
      done ;;
    ncu-lmhead-logits)
      # run 28: the LM head's kernels (its GEMM is the 1-layer model's largest nvjet) per setting of
      # NCU_LM_CONFIGS (default: fp32 logits, bf16 logits, bf16 in clusters of 8; a setting may join several
      # VAR=value by commas), per model in ACCUM_MODELS; time and DRAM bytes per launch
      for cs in ${ACCUM_MODELS:-qwen2.5-1.5b:2048}; do c=${cs%%:*}; sq=${cs##*:}
        for v in ${NCU_LM_CONFIGS:-CF_LMHEAD_LOGITS=fp32 CF_LMHEAD_LOGITS=bf16 CF_LMHEAD_CLUSTER=8}; do
          j="$OUT/ncu_lmlogits_${c}_$(echo "$v" | tr "A-Z=," "a-z__")"
          env $(echo "$v" | tr , ' ') timeout 240 ncu --clock-control none --csv --print-units base --kernel-name regex:"${NCU_LM_KERNELS:-lmhead|nvjet}" \
            --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum "$CF" bench --device cuda \
            --config $c --layers 1 --seq $sq --batch 1 --grad-accum 1 --modes regular --steps 1 --warmup 1 \
            >"$j.csv" 2>"$j.err"
          echo "ncu-lmhead-logits $c $v rc=$?"; python3 tools/ncu_kernels.py "$j.csv" --top 400 >"$j.txt"
          grep -E "lmhead" "$j.txt"
        done
      done ;;
    lmhead-logits)
      # run 28: bf16 logits (the default) against fp32 (CF_LMHEAD_LOGITS=fp32), steps of ACCUM_MODELS
      env_ab CF_LMHEAD_LOGITS "fp32 bf16" regular,centrifuge lml ;;
    lmhead-cluster)
      # the LM head's rows read once by a cluster of blocks per row (default on Hopper) against the one-block
      # kernel's two reads (CF_LMHEAD_CLUSTER=0): the forward column
      env_ab CF_LMHEAD_CLUSTER "0 1" regular,centrifuge lmc ;;
    side-attn)
      # o's and q/k/v's weight gradients beside the backward (default) against in line (CF_DW_SIDE_ATTN=0)
      env_ab CF_DW_SIDE_ATTN "0 1" regular,centrifuge sattn ;;
    env-ab)
      # one environment switch A/B: ENV_AB_VAR over ENV_AB_VALUES, the bench rows of ENV_AB_MODES (default
      # centrifuge), alternated twice per model in ACCUM_MODELS (default Qwen2.5-1.5B @2048)
      [ -n "${ENV_AB_VAR:-}" ] && [ -n "${ENV_AB_VALUES:-}" ] || { echo "env-ab: set ENV_AB_VAR and ENV_AB_VALUES"; continue; }
      env_ab "$ENV_AB_VAR" "$ENV_AB_VALUES" "${ENV_AB_MODES:-centrifuge}" "envab_${ENV_AB_VAR}_" ;;
    cf-plan)
      # issue 17, run 34: centrifuge's part-1 plan by bwd_beside_cost (default, 0) against the earlier rule's
      # choice forced (Llama3.2-3B and Qwen2.5-1.5B: one part, CF_ATTN_SM90_BWD_SPLIT=1; TinyLlama: two heads
      # per block, CF_ATTN_SM90_BWD_HPB=2), the centrifuge rows, alternated twice
      ACCUM_MODELS=llama3.2-3b:2048 env_ab CF_ATTN_SM90_BWD_SPLIT "1 0" centrifuge cfplan
      ACCUM_MODELS=qwen2.5-1.5b:2048 env_ab CF_ATTN_SM90_BWD_SPLIT "1 0" centrifuge cfplan
      ACCUM_MODELS=tinyllama-1.1b:4096 env_ab CF_ATTN_SM90_BWD_HPB "2 0" centrifuge cfplan ;;
    hpb-model)
      # the backward's heads-per-block rule (CF_ATTN_SM90_BWD_HPB=0, default) against one head per block (=1,
      # the rule's choice for groups of 3 before run 24), regular and centrifuge
      env_ab CF_ATTN_SM90_BWD_HPB "1 0" regular,centrifuge hpb llama3.2-3b:2048 ;;
    side-ab)
      # the paired MLP weight gradients on a side stream (default) against in line (CF_DW_SIDE=0),
      # centrifuge only (pairs are compact-mode only)
      env_ab CF_DW_SIDE "0 1" centrifuge side ;;
    attn-in-model)
      # why attention takes longer in the model than alone: (1) the SM clock and power, sampled every 50 ms by
      # nvidia-smi, during bench_attention at TinyLlama's shape and during TinyLlama's regular step (1 x 8);
      # (2) the attention kernels' time by ncu without cache flushes (--cache-control none), in the model (4
      # layers) and alone, so the two differ only in their inputs and neighbours
      p=$(smi_start "$OUT/clocks_attn.csv"); "$G/bench_attention" 4096 32 4 64 >"$OUT/attn_alone.txt" 2>&1; kill $p
      p=$(smi_start "$OUT/clocks_model.csv"); "$CF" bench --device cuda --config tinyllama-1.1b --seq 4096 --batch 1 --grad-accum 8 --modes regular \
        --keep 0.5 --steps 4 --warmup 1 >"$OUT/model.txt" 2>&1; kill $p
      for k in attn model; do python3 tools/clock_summary.py "$OUT/clocks_$k.csv" "$k"; done
      grep -E "bwd|fwd" "$OUT/attn_alone.txt" | head -8; grep -E "regular" "$OUT/model.txt"
      k='regex:attn_|bwd_finish|attn_bwd_prep'
      timeout 200 ncu --clock-control none --cache-control none --csv --print-units base --kernel-name "$k" \
        --metrics gpu__time_duration.sum "$CF" bench --device cuda --config tinyllama-1.1b --layers 4 --seq 4096 \
        --batch 1 --grad-accum 2 --modes regular --keep 0.5 --steps 1 --warmup 1 >"$OUT/ncu_model.csv" 2>"$OUT/ncu_model.err"
      python3 tools/ncu_kernels.py "$OUT/ncu_model.csv" --top 8 | tee "$OUT/ncu_model.txt"
      BENCH_ATTN_PATHS=auto timeout 200 ncu --clock-control none --cache-control none --csv --print-units base \
        --kernel-name "$k" --metrics gpu__time_duration.sum "$G/bench_attention" 4096 32 4 64 >"$OUT/ncu_alone.csv" \
        2>"$OUT/ncu_alone.err"
      python3 tools/ncu_kernels.py "$OUT/ncu_alone.csv" --top 8 | tee "$OUT/ncu_alone.txt" ;;
    adamw-ab)
      # AdamW as one launch over every tensor (default) against a launch per tensor (CF_ADAMW_ONE_PASS=0),
      # regular only: the optimizer column
      env_ab CF_ADAMW_ONE_PASS "0 1" regular adamw tinyllama-1.1b:4096 ;;
    grad-keep)
      # AdamW leaving the set-only gradients stale (default) against zeroing every gradient (CF_GRAD_KEEP=0),
      # regular only: the optimizer column
      env_ab CF_GRAD_KEEP "0 1" regular keep llama3.2-3b:2048 ;;
    cf-side)
      # issue 17: centrifuge's Hopper part 2 beside part 1 on a second stream (default) against after it
      # (CF_ATTN_CF_SIDE_BY_SIDE=0): bench_attention at the four shapes, then the models in ACCUM_MODELS at 1 x 8
      for sh in "4096 32 4 64" "4096 32 8 128" "2048 12 2 128" "2048 24 8 128"; do for rep in 1 2; do for v in 0 1; do
        echo "side=$v (rep $rep), S H Hkv D = $sh"
        CF_ATTN_CF_SIDE_BY_SIDE=$v BENCH_ATTN_PATHS=auto "$G/bench_attention" $sh 2>&1 | grep -E "backward (full|centrifuge)"
      done; done; done 2>&1 | tee "$OUT/cf_side_attn.txt"
      for cs in ${ACCUM_MODELS:-qwen2.5-1.5b:2048}; do c=${cs%%:*}; sq=${cs##*:}
        for rep in 1 2; do for v in 0 1; do
          CF_ATTN_CF_SIDE_BY_SIDE=$v "$CF" bench --device cuda --config $c --seq $sq --batch 1 --grad-accum 8 \
            --modes regular,centrifuge --keep 0.5 --steps ${ACCUM_STEPS:-6} --warmup 2 --json "$OUT/side${v}_${c}_r$rep.jsonl" 2>&1 |
            tee "$OUT/side${v}_${c}_r$rep.txt" | grep -E "  0\.50" | sed "s/^/side=$v rep $rep /"
        done; done
      done ;;
    norm-blocks)
      # issue 17: the RMSNorm backward's block bound (CF_RMSNORM_BWD_BLOCKS, default 256) at 256, 512, 1024, 256:
      # bench --profile of each model in ACCUM_MODELS, regular and centrifuge, the rmsnorm category per micro-batch
      for cs in ${ACCUM_MODELS:-llama3.2-3b:2048}; do for nb in 256 512 1024 256; do
        CF_RMSNORM_BWD_BLOCKS=$nb "$CF" bench --device cuda --config ${cs%%:*} --seq ${cs##*:} --batch 1 --grad-accum 8 \
          --modes regular,centrifuge --keep 0.5 --steps 4 --warmup 2 --profile 2>&1 |
          tee "$OUT/normblocks_${nb}_${cs%%:*}.txt" | grep -E "profile|  0\.50" | sed "s/^/blocks=$nb /"
      done; done ;;
    ab-head)
      # issue 17: the LM head's saved gradient (default) against recomputing its logits (CF_HEAD_SAVE=0),
      # alternating, grad-accum 8, per-op profile
      for cs in ${ACCUM_MODELS:-tinyllama-1.1b:4096}; do for r in 1 2; do for v in recompute saved; do
        CF_HEAD_SAVE=$([ $v = recompute ] && echo 0 || echo 1) "$CF" bench --device cuda --config ${cs%%:*} \
          --seq ${cs##*:} --batch 1 --grad-accum 8 --modes regular,centrifuge --keep 0.5 --steps ${ACCUM_STEPS:-4} --warmup 2 \
          --profile --json "$OUT/abhead_${v}_${r}_${cs%%:*}.jsonl" 2>&1 | tee "$OUT/abhead_${v}_${r}_${cs%%:*}.txt" \
          | grep -E "profile|  0\.50" | sed "s/^/$v /"
      done; done; done ;;
    attn-shapes)
      # attention alone at the models' shapes (TinyLlama, Qwen2.5-1.5B, Llama3.2-3B): the automatic choice of
      # query heads per backward block, then 1, 2 and 4 forced (4 becomes 3 in Qwen's and Llama3.2-3B's groups
      # of 6 and 3; at D = 64 with 64-query steps 4 was 4% faster than 2 for the full backward,
      # HOPPER_ATTENTION.md call 3, not timed since the 128-query steps)
      for sh in "4096 32 4 64" "2048 12 2 128" "2048 24 8 128"; do for hpb in auto 1 2 4; do
        if [ $hpb = auto ]; then unset CF_ATTN_SM90_BWD_HPB; else export CF_ATTN_SM90_BWD_HPB=$hpb; fi
        echo "hpb $hpb, S H Hkv D = $sh"; BENCH_ATTN_PATHS=auto "$G/bench_attention" $sh 2>&1 | grep -E "forward|backward"
      done; done 2>&1 | tee "$OUT/attn_shapes.txt"; unset CF_ATTN_SM90_BWD_HPB ;;
    pingpong)
      # issue 17: ping-pong turns of the consumer warpgroups in the Hopper forward (CF_ATTN_FWD_PINGPONG,
      # default on) and in centrifuge part 2 (CF_ATTN_CF_PINGPONG, default off): the attention tests of
      # test_gpu_ops under each combination, then bench_attention at four shapes, alternated twice
      for o in "0 0" "1 0" "0 1" "1 1"; do read -r f c <<<"$o"
        CF_ATTN_FWD_PINGPONG=$f CF_ATTN_CF_PINGPONG=$c CF_TEST_ONLY=attention "$G/test_gpu_ops" \
          >"$OUT/test_pingpong_$f$c.log" 2>&1; echo "fwd=$f cf=$c test_gpu_ops(attention) rc=$?"
        tail -1 "$OUT/test_pingpong_$f$c.log"
      done
      for sh in "4096 32 4 64" "4096 32 8 128" "2048 12 2 128" "2048 24 8 128"; do for rep in 1 2; do
        for o in "0 0" "1 1"; do read -r f c <<<"$o"
          echo "fwd=$f cf=$c (rep $rep), S H Hkv D = $sh"
          CF_ATTN_FWD_PINGPONG=$f CF_ATTN_CF_PINGPONG=$c BENCH_ATTN_PATHS=auto "$G/bench_attention" $sh 2>&1 |
            grep -E "forward|backward (full|centrifuge)"
        done; done; done 2>&1 | tee "$OUT/pingpong.txt" ;;
    pingpong-model)
      # the same two switches together in the models of ACCUM_MODELS (default TinyLlama @4096) at 1 x 8
      for cs in ${ACCUM_MODELS:-tinyllama-1.1b:4096}; do c=${cs%%:*}; sq=${cs##*:}
        for rep in 1 2; do for v in 0 1; do
          CF_ATTN_FWD_PINGPONG=$v CF_ATTN_CF_PINGPONG=$v "$CF" bench --device cuda --config $c --seq $sq --batch 1 \
            --grad-accum 8 --modes regular,centrifuge --keep 0.5 --steps ${ACCUM_STEPS:-6} --warmup 2 \
            --json "$OUT/pp${v}_${c}_r$rep.jsonl" 2>&1 | tee "$OUT/pp${v}_${c}_r$rep.txt" | grep -E "  0\.50" |
            sed "s/^/pingpong=$v rep $rep /"
        done; done
      done ;;
    ncu-attn-src)
      # issue 17: where the Hopper attention backward's main kernel stalls: ncu's warp-state sampling per SASS
      # instruction (SourceCounters) for one launch at S = 4096, D = 128 and D = 64 (bench_attention), kept as
      # reports plus the source page as CSV; tools/ncu_stalls.py sums the samples per instruction kind.
      # NCU_ATTN=fwd profiles the forward kernel instead
      k=${NCU_ATTN:-bwd}
      for sh in "4096 32 8 128" "4096 32 4 64"; do j="$OUT/ncu_${k}_src_d${sh##* }"
        timeout 240 ncu --clock-control none --kernel-name regex:attn_${k}_sm90_kernel --launch-skip 2 --launch-count 1 \
          --section SourceCounters --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
          -o "$j" "$G/bench_attention" $sh >"$j.log" 2>&1; echo "ncu-attn-src $sh rc=$?"
        ncu -i "$j.ncu-rep" --page source --csv --print-source sass >"$j.sass.csv" 2>"$j.err"
        ncu -i "$j.ncu-rep" --page details --csv >"$j.details.csv" 2>>"$j.err"
        python3 tools/ncu_stalls.py "$j.sass.csv" 2>&1 | tee "$j.txt" | head -40
      done ;;
    ncu-attn-kernels)
      # the time of each kernel of the attention forward and backwards (full, centrifuge, strawman), ncu, at the
      # four shapes: bench_attention's 23 runs of each (3 warm-up), summed per kernel by tools/ncu_kernels.py
      for sh in "4096 32 4 64" "4096 32 8 128" "2048 12 2 128" "2048 24 8 128"; do j="$OUT/ncu_attn_kernels_${sh// /_}"
        BENCH_ATTN_PATHS=auto timeout 240 ncu --clock-control none --csv --print-units base \
          --metrics gpu__time_duration.sum "$G/bench_attention" $sh >"$j.csv" 2>"$j.err"
        echo "ncu-attn-kernels $sh rc=$?"; python3 tools/ncu_kernels.py "$j.csv" --top 16 | tee "$j.txt"
      done ;;
    ncu-attn-modes)
      # issue 17: the time and DRAM bytes of each kernel of the attention backwards at S = 4096 (or NCU_SHAPES,
      # '|'-separated), one Hopper path: bench_attention runs each mode 23 times in turn, so the main backward
      # kernel's and the finish's groups [0] [1] [2] are the full, centrifuge and strawman backwards
      IFS='|' read -ra shs <<<"${NCU_SHAPES:-4096 32 4 64|4096 32 8 128}"
      for sh in "${shs[@]}"; do j="$OUT/ncu_attn_modes_${sh// /_}"
        ncu_bench_attn "$j" "$G/bench_attention" "$sh"
        echo "ncu-attn-modes $sh rc=$?"; python3 tools/ncu_kernels.py "$j.csv" --batch 23 --bw 4.8e12 | tee "$j.txt"
        gzip -f "$j.csv"
      done ;;
    ncu-attn-pipes)
      # issue 17: pipe utilisation (tensor, special-function, FMA, ALU) and stall reasons of the Hopper attention
      # kernels at S = 4096, D = 64 and 128 (bench_attention): the forward, the full backward's main kernel,
      # centrifuge part 1 (the main kernel's 27th launch: 23 full ones come first) and part 2; ncu's raw page as
      # CSV, summed by tools/ncu_pipes.py. NCU_PIPES_ENV: an environment setting for every run (e.g. a switch)
      for sh in "4096 32 4 64" "4096 32 8 128"; do d=${sh##* }
        for kk in fwd:attn_fwd_sm90_kernel:3 full:attn_bwd_sm90_kernel:3 part1:attn_bwd_sm90_kernel:26 \
                  part2:attn_bwd_dq_sm90_kernel:3; do
          IFS=: read -r tag kn skip <<<"$kk"; j="$OUT/ncu_pipes_${tag}_d$d"
          env ${NCU_PIPES_ENV:-CF_NONE=1} BENCH_ATTN_PATHS=auto timeout 200 ncu --clock-control none \
            --kernel-name "regex:$kn" --launch-skip $skip --launch-count 1 --section SpeedOfLight \
            --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --page raw --csv \
            "$G/bench_attention" $sh >"$j.csv" 2>"$j.err"
          echo "ncu-attn-pipes $tag d$d rc=$?"; python3 tools/ncu_pipes.py "$j.csv" | tee "$j.txt"
        done
      done ;;
    fwd-wg)
      # issue 17: the forward at head dim 64 with 3 consumer warpgroups (192 queries per block, CF_ATTN_FWD_WG=3)
      # against 2, bench_attention at D = 64 shapes (or AB_SHAPES), alternated three times
      IFS='|' read -ra shs <<<"${AB_SHAPES:-4096 32 4 64|2048 32 4 64|8192 32 4 64|4096 16 16 64}"
      for sh in "${shs[@]}"; do for rep in 1 2 3; do for v in 2 3; do
        echo "wg=$v (rep $rep), S H Hkv D = $sh"
        CF_ATTN_FWD_WG=$v BENCH_ATTN_PATHS=auto "$G/bench_attention" $sh 2>&1 | grep -E "forward"
      done; done; done 2>&1 | tee "$OUT/fwd_wg.txt" ;;
    cf-pp64)
      # centrifuge part 2's ping-pong turns at D = 64 (off by default there), alternated twice
      for rep in 1 2; do for v in 0 1; do echo "cf pingpong=$v (rep $rep), S H Hkv D = 4096 32 4 64"
        CF_ATTN_CF_PINGPONG=$v BENCH_ATTN_PATHS=auto "$G/bench_attention" 4096 32 4 64 2>&1 | grep -E "backward (full|centrifuge)"
      done; done 2>&1 | tee "$OUT/cf_pp64.txt" ;;
    attn-ab)
      # attention alone: the carried bench_attention_old (an earlier build, see gpu_carry.sh) against this
      # build's, alternated twice per shape (default shapes, then Qwen2.5-1.5B's and Llama3.2-3B's; or AB_SHAPES,
      # "S H Hkv D [B]" separated by '|')
      IFS='|' read -ra shs <<<"${AB_SHAPES:-4096 32 4 64|4096 32 8 128|2048 12 2 128|2048 24 8 128}"
      for sh in "${shs[@]}"; do for rep in 1 2; do
        for v in old new; do
          b="$G/bench_attention"; [ $v = old ] && b="$G/bench_attention_old"
          [ -x "$b" ] || continue
          echo "$v (rep $rep), S H Hkv D = $sh"; BENCH_ATTN_PATHS=auto "$b" $sh 2>&1 | grep -E "^B=|forward|backward"
        done; done; done 2>&1 | tee "$OUT/attn_ab.txt" ;;
    attn-env)
      # attention alone: one environment switch (ATTN_ENV_VAR over ATTN_ENV_VALUES), alternated twice per shape
      # (AB_SHAPES as attn-ab's), the plans' choice and each forced plan of ATTN_ENV_PLANS ("hpb:parts ...")
      [ -n "${ATTN_ENV_VAR:-}" ] && [ -n "${ATTN_ENV_VALUES:-}" ] || { echo "attn-env: set ATTN_ENV_VAR and ATTN_ENV_VALUES"; continue; }
      IFS='|' read -ra shs <<<"${AB_SHAPES:-4096 32 4 64|4096 32 8 128|2048 12 2 128|2048 24 8 128}"
      for sh in "${shs[@]}"; do for pl in auto ${ATTN_ENV_PLANS:-}; do for rep in 1 2; do for v in $ATTN_ENV_VALUES; do
        hp=0; sp=0; [ "$pl" != auto ] && { hp=${pl%%:*}; sp=${pl##*:}; }
        echo "$ATTN_ENV_VAR=$v plan $pl (rep $rep), S H Hkv D = $sh"
        env "$ATTN_ENV_VAR=$v" CF_ATTN_SM90_BWD_HPB=$hp CF_ATTN_SM90_BWD_SPLIT=$sp BENCH_ATTN_PATHS=auto \
          "$G/bench_attention" $sh 2>&1 | grep -E "backward (full|centrifuge)"
      done; done; done; done 2>&1 | tee "$OUT/attn_env_$ATTN_ENV_VAR.txt" ;;
    ncu-cf)
      # issue 17 (run 33): centrifuge's own kernels (the prep and part 2) alone under ncu (it runs them one at a
      # time): the carried bench_attention_old (an earlier build) against this build, and this build at each
      # setting of FLOW_ENVS ('|' between settings of environment switches, if given), S = 4096 at both head
      # dims (or NCU_SHAPES); times per launch summed by tools/ncu_kernels.py
      IFS='|' read -ra shs <<<"${NCU_SHAPES:-4096 32 4 64|4096 32 8 128}"
      IFS='|' read -ra envs <<<"${FLOW_ENVS:-}"
      for sh in "${shs[@]}"; do
        for e in old new "${envs[@]}"; do
          b="$G/bench_attention"; [ "$e" = old ] && { b="$G/bench_attention_old"; [ -x "$b" ] || continue; }
          j="$OUT/ncu_cf_${sh// /_}_$(echo "$e" | tr -c 'A-Za-z0-9' _)"
          ( case $e in old|new) ;; *) export $e ;; esac
            ncu_bench_attn "$j" "$b" "$sh" --kernel-name regex:"attn_bwd_dq_sm90|cf_prep" )
          echo "ncu-cf $sh [$e] rc=$?"; python3 tools/ncu_kernels.py "$j.csv" --bw 4.8e12 | tee "$j.txt"
          gzip -f "$j.csv"
        done
      done ;;
    attn-parts)
      # attention alone: the carried bench_attention_old (an earlier build), this build with one part per key
      # tile (CF_ATTN_SM90_BWD_SPLIT=1) and with the planned parts (bwd_plan), alternated twice per shape
      for sh in "4096 32 4 64" "4096 32 8 128" "2048 12 2 128" "2048 24 8 128"; do for rep in 1 2; do
        for v in old one auto; do
          b="$G/bench_attention"; [ $v = old ] && b="$G/bench_attention_old"
          [ -x "$b" ] || continue
          sp=; [ $v = one ] && sp=1
          echo "$v (rep $rep), S H Hkv D = $sh"
          CF_ATTN_SM90_BWD_SPLIT=$sp BENCH_ATTN_PATHS=auto "$b" $sh 2>&1 | grep -E "forward|backward"
        done; done; done 2>&1 | tee "$OUT/attn_parts.txt" ;;
    dp-prio)
      # issue 14: the communication stream at the device's highest priority (CF_COMM_PRIORITY=high), then normal, DP=2
      for p in high normal; do
        CF_COMM_PRIORITY=$p DPS=2 MODES="regular centrifuge" STEPS=${STEPS:-6} bash tools/dp_bench.sh "$CF" "$OUT/dp_prio_$p" \
          "${PRIO_MODELS:-tinyllama-1.1b:4096}" 2>&1 | tee "$OUT/dp_prio_$p.txt"
      done ;;
    bench-pair)
      # issue 17: the same 8 sequences per step as micro-batch 1 x grad-accum 8 and as micro-batch 2 x grad-accum 4:
      # does doubling the rows of the weight-gradient GEMMs (M = kept rows) take the centrifuge backward toward 0.5?
      for cs in ${ACCUM_MODELS:-qwen2.5-1.5b:2048}; do for ba in 1:8 2:4; do
        "$CF" bench --device cuda --config ${cs%%:*} --seq ${cs##*:} --batch ${ba%%:*} --grad-accum ${ba##*:} \
          --modes regular,centrifuge --keep 0.5 --steps ${ACCUM_STEPS:-6} --warmup 2 --profile \
          --json "$OUT/pair_${cs%%:*}_b${ba%%:*}.jsonl" 2>&1 | tee "$OUT/pair_${cs%%:*}_b${ba%%:*}.txt" | grep -E "profile|  0\.50"
      done; done ;;
    dp-ctas)
      # issue 14: does capping NCCL's CTAs (SMs taken from the backward) help the centrifuge DP=2 step ratio?
      for ctas in default 16 8 4; do
        if [ $ctas = default ]; then unset NCCL_MAX_CTAS; else export NCCL_MAX_CTAS=$ctas; fi
        MODES="regular centrifuge" bash tools/dp_bench.sh "$CF" "$OUT/dp_ctas_$ctas" "qwen2.5-1.5b:2048" 2>&1 | tee "$OUT/dp_ctas_$ctas.txt"
      done; unset NCCL_MAX_CTAS ;;
    rows-x8-dry)
      # issue 20's dry run on nvidia-h200-x2: the TP=8 models' shapes at TP=2 with their first 8 layers
      # (every kernel, split and collective of the real run; memory and time per layer, not per model)
      EXTRA="--layers 8" RUN_TIMEOUT=300 bash tools/tp_bench.sh "$CF" "$OUT/rows_x8_dry" \
        "llama3.1-8b:2048:tp2 qwen3-14b:2048:tp2 qwen3-32b:4096:tp2 alia-40b:4096:tp2" 2>&1 | tee "$OUT/rows_x8_dry.txt" ;;
    dp-bf16)
      # issue 14: bf16 gradients on the wire (train --dp-grad-dtype bf16): DP=2 = one GPU, then the scaling
      DP_EXTRA="--dp-grad-dtype bf16" bash tests/gpu/dp_check.sh "$CF" "$OUT/dp_check_bf16" 2>&1 | tee "$OUT/dp_check_bf16.txt"
      EXTRA="--dp-grad-dtype bf16" bash tools/dp_bench.sh "$CF" "$OUT/dp_bench_bf16" 2>&1 | tee "$OUT/dp_bench_bf16.txt" ;;
    dp-bench)
      bash tools/dp_bench.sh "$CF" "$OUT/dp_bench" 2>&1 | tee "$OUT/dp_bench.txt" ;;
    bench-sweeps)
      "$CF" bench --device cuda --config tinyllama-1.1b --seq 1024,2048,3072,4096 --modes regular,loss-only,centrifuge --keep 0.5 --steps 10 --warmup 2 --json "$OUT/sweep_seq.jsonl" 2>&1 | tee "$OUT/sweep_seq.txt"
      "$CF" bench --device cuda --config tinyllama-1.1b --seq 4096 --modes regular,loss-only,centrifuge --keep 0.8,0.7,0.6,0.5,0.4 --steps 10 --warmup 2 --json "$OUT/sweep_keep.jsonl" 2>&1 | tee "$OUT/sweep_keep.txt" ;;
    bench-3b)
      "$CF" bench --device cuda --config llama3.2-3b --seq 2048 --modes regular,loss-only,centrifuge --keep 0.5 --steps 10 --warmup 2 --json "$OUT/bench_llama3b_2048.jsonl" 2>&1 | tee "$OUT/bench_llama3b_2048.txt" ;;
    pytorch)
      python3 tools/bench_pytorch.py --config tinyllama-1.1b --seq 4096 --json "$OUT/pt_tinyllama_4096.jsonl" --centrifuge-json "$OUT/bench_tinyllama_4096.jsonl" 2>&1 | tee "$OUT/pt_tinyllama_4096.txt" | tail -15
      python3 tools/bench_pytorch.py --config qwen2.5-1.5b --seq 2048 --json "$OUT/pt_qwen_2048.jsonl" --centrifuge-json "$OUT/bench_qwen_2048.jsonl" 2>&1 | tee "$OUT/pt_qwen_2048.txt" | tail -15 ;;
    sdpa)
      # SDPA's flash and cuDNN back ends (issue 17 names both), then ours in both paths
      for be in flash cudnn; do
        python3 tools/bench_pytorch.py --sdpa-attention --sdpa-backend $be --heads 32 --kv-heads 4 --head-dim 64 --seq 4096 2>&1 | tee "$OUT/sdpa_${be}_d64.txt" | tail -3
        python3 tools/bench_pytorch.py --sdpa-attention --sdpa-backend $be --heads 32 --kv-heads 8 --head-dim 128 --seq 4096 2>&1 | tee "$OUT/sdpa_${be}_d128.txt" | tail -3
      done
      "$G/bench_attention" 2>&1 | tee "$OUT/bench_attention.txt" | tail -20 ;;
    utility)
      W=/tmp/utility; rm -rf "$W"
      CF="$CF" DEVICE=cuda timeout "${UTILITY_TIMEOUT:-520}" bash tools/utility.sh "$W" 2>&1 | tee "$OUT/utility.log" | grep -v "^score:"
      mkdir -p "$OUT/utility"; cp "$W"/*.jsonl "$W"/times.txt "$OUT/utility/" 2>/dev/null
      python3 tools/plot_utility.py "$W" --png "$OUT/utility/utility_curves.png" | tee "$OUT/utility/summary.md" ;;
    train-smoke)
      # the train loop on the GPU with device selection (select self), centrifuge mode
      "$CF" gen-data --source noisy --tokens 2M --out /tmp/smoke.bin >/dev/null
      "$CF" train --device cuda --config math-25m --data /tmp/smoke.bin --mode centrifuge --select self --keep 0.5 \
        --steps 60 --batch 8 --seq 512 --lr 1e-3 --log "$OUT/train_smoke.jsonl" 2>&1 | tee "$OUT/train_smoke.txt" | awk 'NR<=2 || NR%20==0' ;;
    cpubench)
      OMP_NUM_THREADS=2 "$G/centrifuge" bench --config cpu-20m --seq 512 --modes regular,loss-only,centrifuge --keep 0.8,0.6,0.5,0.4,0.2 --steps 5 --warmup 1 --json "$OUT/cpu_bench_keep.jsonl" 2>&1 | tee "$OUT/cpu_bench_keep.txt" ;;
    peft-parity)
      # issue 15: PEFT loads centrifuge-cuda's adapters (and the reverse) with per-token losses within bf16 tolerance
      need_peft
      python3 tools/peft_parity.py --bin "$CF" --device cuda --tol 2e-2 2>&1 | grep -v -i warn | tee "$OUT/peft_parity.txt" | tail -20 ;;
    parity)
      python3 tools/hf_parity.py --bin .gpucarry/centrifuge 2>&1 | tee "$OUT/hf_parity.txt" | tail -20 ;;
    attn-timing)
      # the attention alone timed both ways, alternated: queued (every run enqueued without waiting: GPU time
      # only, as in a training step) and sync (the device idle before each run: its launch latency timed too);
      # ours (bench_attention, BENCH_ATTN_TIMING) and SDPA's cuDNN and flash back ends (bench_pytorch --timing)
      for rep in 1 2; do
        for t in queued sync; do
          BENCH_ATTN_PATHS=auto BENCH_ATTN_TIMING=$t "$G/bench_attention" 2>&1 | tee "$OUT/bench_attention_${t}_$rep.txt" | grep -E "B=|backward|forward"
        done
      done
      for t in queued sync; do
        for be in cudnn flash; do
          python3 tools/bench_pytorch.py --sdpa-attention --sdpa-backend $be --heads 32 --kv-heads 4 --head-dim 64 --seq 4096 --timing $t 2>&1 | tee "$OUT/sdpa_${be}_d64_$t.txt" | tail -1
          python3 tools/bench_pytorch.py --sdpa-attention --sdpa-backend $be --heads 32 --kv-heads 8 --head-dim 128 --seq 4096 --timing $t 2>&1 | tee "$OUT/sdpa_${be}_d128_$t.txt" | tail -1
        done
      done ;;
    parity-cuda)
      # the GPU binary (bf16) against transformers: losses, greedy tokens (ties within bf16's error accepted) and stops
      python3 tools/hf_parity.py --bin "$CF" --device cuda --tol 5e-2 --gen-tie 5e-2 2>&1 | tee "$OUT/hf_parity_cuda.txt" | tail -20 ;;
    parity-bigvocab)
      # the GPU binary against transformers with real vocabularies (Qwen2.5's 151936, Llama 3's 128256) on
      # the tiny layers: the LM head's cluster rows kernel in training and in eval
      for v in 151936 128256; do
        python3 tools/hf_parity.py --bin "$CF" --device cuda --tol 5e-2 --gen-tie 5e-2 --types qwen2,llama \
          --train-args "--vocab-size $v" 2>&1 | tee "$OUT/hf_parity_v$v.txt" | tail -6
      done ;;
  esac
done
OUT=$OUT0
echo "=== done $(date +%T)"
# everything in one file: the tool brings back at most 8 files
# (named by the parts, and numbered when the same parts ran before in this call, so every
# invocation keeps its archive)
stem="results_$(echo "$*" | tr -c 'A-Za-z0-9_\n-' '_' | tr ' ' '_')"
name="$stem.tgz"; k=2
while [ -e "$OUT/$name" ]; do name="${stem}_$k.tgz"; k=$((k + 1)); done
(cd "$OUT" && tar czf "/tmp/$name" --exclude 'results_*.tgz' . && mv "/tmp/$name" "$OUT/$name" &&
  find . -type f ! -name 'results_*.tgz' ! -name gpu.txt -delete)
