#!/usr/bin/env bash
# call 3: determinism after the tuning fix, tests, benches
set -u
RET=${OUT:-/tmp/out}; OUT=/tmp/w; mkdir -p "$OUT" "$RET"
C=$(cd "$(dirname "$0")" && pwd); G=/tmp/g; mkdir -p $G
for t in "$C"/*.tar.xz; do tar xJf "$t" -C $G; done
export LD_LIBRARY_PATH="$G/lib:${LD_LIBRARY_PATH:-}" OMP_NUM_THREADS=16
L=$OUT/log.txt
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a $L
cat $G/commit.txt | tee -a $L
NEW=$G/centrifuge-cuda; BASE=$G/centrifuge-cuda-base
echo "=== tests $(date +%T)" | tee -a $L
timeout 150 $G/test_gpu_ops > $OUT/test_gpu_ops.log 2>&1; echo "test_gpu_ops rc=$?: $(tail -1 $OUT/test_gpu_ops.log)" | tee -a $L
timeout 200 $G/test_gpu_model > $OUT/test_gpu_model.log 2>&1; echo "test_gpu_model rc=$?: $(tail -1 $OUT/test_gpu_model.log)" | tee -a $L
echo "=== determinism $(date +%T)" | tee -a $L
A="train --device cuda --config qwen2.5-1.5b --seq 1024 --batch 2 --steps 5 --warmup 1 --lr 3e-4 --select self --keep 0.5 --builtin-tokens 1M --quiet --seed 7"
cmp() { python3 $C/det_compare.py "$@" | tee -a $L; }
run() { local f=$1; shift; "$@" --log-file $OUT/$f.jsonl > /dev/null 2>>$OUT/d_err.txt || echo "run $f failed" | tee -a $L; }
for m in centrifuge regular; do
  run ${m}_1 env CF_GEMM_TUNE=2 $NEW $A --mode $m; run ${m}_2 env CF_GEMM_TUNE=2 $NEW $A --mode $m
  cmp $OUT/${m}_1.jsonl $OUT/${m}_2.jsonl "qwen $m: new run 1 vs run 2" exact
done
run acc_nofuse env CF_FUSE_GATE_UP=0 $NEW $A --mode centrifuge --grad-accum 2
run acc_base $BASE $A --mode centrifuge --grad-accum 2
cmp $OUT/acc_nofuse.jsonl $OUT/acc_base.jsonl "qwen centrifuge accum 2: new without gate/up fusion vs base" exact
run acc_base2 $BASE $A --mode centrifuge --grad-accum 2
cmp $OUT/acc_base2.jsonl $OUT/acc_base.jsonl "qwen centrifuge accum 2: base run 1 vs run 2" exact
run acc_notune env CF_FUSE_GATE_UP=0 CF_GEMM_TUNE=0 $NEW $A --mode centrifuge --grad-accum 2
cmp $OUT/acc_notune.jsonl $OUT/acc_base.jsonl "qwen centrifuge accum 2: new, no fusion, no tuning vs base" exact
echo "=== bench $(date +%T)" | tee -a $L
bench() { local tag=$1 bin=$2 cfg=$3; shift 3
  echo "--- $tag $cfg $(date +%T)" | tee -a $L
  env $ENVS "$bin" bench --device cuda --config $cfg --seq 2048 --modes regular,centrifuge --keep 0.5 --steps 8 --warmup 2 --json $OUT/b_${tag}_${cfg}.jsonl "$@" 2>$OUT/err_${tag}_${cfg}.txt | tee -a $L | grep -E "^ +2048|profile"; }
ENVS= bench base $BASE qwen2.5-1.5b
ENVS=CF_GEMM_TUNE=2 bench new $NEW qwen2.5-1.5b --profile
ENVS= bench base $BASE llama3.2-3b
ENVS=CF_GEMM_TUNE=2 bench new $NEW llama3.2-3b --profile
echo "=== done $(date +%T)" | tee -a $L
cat $OUT/err_new_*.txt $OUT/d_err.txt | grep "gemm tune" | sort | uniq -c | sort -rn > $OUT/tune_choices.txt
grep -c "chosen #[1-9]" $OUT/tune_choices.txt
cp $L $OUT/tune_choices.txt $RET/; tar czf $RET/all.tgz -C $OUT .
