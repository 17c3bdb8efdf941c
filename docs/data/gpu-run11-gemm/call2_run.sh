#!/usr/bin/env bash
# call 2: tests, A/B benches, determinism. From the repo root on the GPU machine.
set -u
RET=${OUT:-/tmp/out}; OUT=/tmp/w; mkdir -p "$OUT" "$RET"
C=$(cd "$(dirname "$0")" && pwd); G=/tmp/g; mkdir -p $G
for t in "$C"/*.tar.xz; do tar xJf "$t" -C $G; done
export LD_LIBRARY_PATH="$G/lib:${LD_LIBRARY_PATH:-}" OMP_NUM_THREADS=16
L=$OUT/log.txt
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a $L
cat $G/commit.txt | tee -a $L
NEW=$G/centrifuge-cuda; BASE=$G/centrifuge-cuda-base
bench() { # tag bin model extra...
  local tag=$1 bin=$2 cfg=$3; shift 3
  echo "--- $tag $cfg $(date +%T)" | tee -a $L
  "$bin" bench --device cuda --config $cfg --seq 2048 --modes regular,centrifuge --keep 0.5 --steps ${STEPS:-8} --warmup 2 --json $OUT/b_${tag}_${cfg}.jsonl "$@" 2>$OUT/err_${tag}_${cfg}.txt | tee -a $L | grep -E "^ +2048|profile"
}
echo "=== tests $(date +%T)" | tee -a $L
timeout 150 $G/test_gpu_ops > $OUT/test_gpu_ops.log 2>&1; echo "test_gpu_ops rc=$?: $(tail -1 $OUT/test_gpu_ops.log)" | tee -a $L
grep -E "FAIL|fail" $OUT/test_gpu_ops.log | head -5
timeout 200 $G/test_gpu_model > $OUT/test_gpu_model.log 2>&1; echo "test_gpu_model rc=$?: $(tail -1 $OUT/test_gpu_model.log)" | tee -a $L
grep -E "FAIL|fail" $OUT/test_gpu_model.log | head -5
echo "=== bench $(date +%T)" | tee -a $L
bench base $BASE qwen2.5-1.5b
CF_GEMM_TUNE=2 bench new $NEW qwen2.5-1.5b --profile
CF_GEMM_TUNE=0 CF_GRAD_SET=0 CF_FUSE_GATE_UP=0 bench off $NEW qwen2.5-1.5b --profile
bench new2 $NEW qwen2.5-1.5b
CF_GEMM_TUNE=0 bench notune $NEW qwen2.5-1.5b
bench base $BASE llama3.2-3b
CF_GEMM_TUNE=2 bench new $NEW llama3.2-3b --profile
echo "=== determinism $(date +%T)" | tee -a $L
A="train --device cuda --config qwen2.5-1.5b --seq 1024 --batch 2 --steps 5 --warmup 1 --lr 3e-4 --select self --keep 0.5 --builtin-tokens 1M --quiet --seed 7"
for m in centrifuge regular; do
  $NEW $A --mode $m --log-file $OUT/d_${m}_new1.jsonl > /dev/null 2>$OUT/d_err.txt || tail -3 $OUT/d_err.txt
  $NEW $A --mode $m --log-file $OUT/d_${m}_new2.jsonl > /dev/null 2>>$OUT/d_err.txt
  python3 $C/det_compare.py $OUT/d_${m}_new1.jsonl $OUT/d_${m}_new2.jsonl "qwen $m: new run 1 vs run 2" exact | tee -a $L
done
CF_FUSE_GATE_UP=0 $NEW $A --mode centrifuge --grad-accum 2 --log-file $OUT/d_acc_nofuse.jsonl > /dev/null 2>>$OUT/d_err.txt
$BASE $A --mode centrifuge --grad-accum 2 --log-file $OUT/d_acc_base.jsonl > /dev/null 2>>$OUT/d_err.txt
python3 $C/det_compare.py $OUT/d_acc_nofuse.jsonl $OUT/d_acc_base.jsonl "qwen centrifuge accum 2: new without gate/up fusion vs base binary" exact | tee -a $L
python3 $C/det_compare.py $OUT/d_centrifuge_new1.jsonl $OUT/d_acc_base.jsonl "(info) new fused vs base" close >/dev/null
S="train --device cuda --config math-25m --builtin-tokens 2M --batch 4 --seq 256 --lr 2e-3 --warmup 3 --seed 7 --select self --keep 0.5 --quiet --steps 30 --mode centrifuge --grad-accum 2"
for r in 1 2; do rm -rf /tmp/ck$r; $NEW $S --out /tmp/ck$r --log-file $OUT/m25_$r.jsonl >/dev/null 2>>$OUT/d_err.txt; done
h1=$(cat /tmp/ck1/step_*/model.safetensors /tmp/ck1/step_*/state.bin | md5sum); h2=$(cat /tmp/ck2/step_*/model.safetensors /tmp/ck2/step_*/state.bin | md5sum)
echo "math-25m 30 steps twice: checkpoint md5 $h1 / $h2: $([ "$h1" = "$h2" ] && echo PASS identical || echo FAIL)" | tee -a $L
echo "=== done $(date +%T)" | tee -a $L
grep -h "gemm tune" $OUT/err_new_*.txt | sort | uniq -c | sort -rn > $OUT/tune_choices.txt
grep -c "chosen #[1-9]" $OUT/tune_choices.txt
cp $L $RET/; cp $OUT/tune_choices.txt $RET/; tar czf $RET/all.tgz -C $OUT .
