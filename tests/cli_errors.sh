#!/usr/bin/env bash
# cli_errors.sh — bad input at the command line (DESIGN §5): every case must
# exit non-zero with exactly one line on stderr that says "error:" and names
# the problem, and must leave no output file behind.
# Usage: tests/cli_errors.sh ./centrifuge
set -u
BIN=$(realpath "${1:-./centrifuge}")
T=$(mktemp -d /tmp/cf_cli_XXXXXX)
trap 'rm -rf "$T"' EXIT
fails=0; n=0

# expect_error NAME PATTERN -- ARGS...: non-zero exit, one stderr line matching PATTERN
expect_error() {
  local name=$1 pat=$2; shift 3
  n=$((n+1))
  "$BIN" "$@" >"$T/out" 2>"$T/err"; local rc=$?; rc_last=$rc
  local lines; lines=$(wc -l <"$T/err")
  if [ $rc -eq 0 ] || [ "$lines" -ne 1 ] || ! grep -q "error: .*$pat" "$T/err"; then
    echo "  FAIL $name (rc=$rc, $lines stderr lines):"; sed 's/^/      /' "$T/err" | head -5
    fails=$((fails+1))
  else
    echo "  ok   $name: $(cat "$T/err")"
  fi
}

# expect_status CODE NAME PATTERN -- ARGS...: expect_error, and the exit status
# is CODE (2: a usage error, 1: a run-time one)
expect_status() {
  local code=$1 name=$2; shift
  local before=$fails
  expect_error "$@"
  if [ $fails -eq $before ] && [ "$rc_last" -ne "$code" ]; then
    echo "  FAIL $name: exit $rc_last, expected $code"; fails=$((fails+1))
  fi
}

# valid inputs to corrupt
"$BIN" gen-data --source clean --tokens 20000 --seed 3 --out "$T/good.bin" >/dev/null || { echo "gen-data failed"; exit 1; }
"$BIN" train --config tiny --data "$T/good.bin" --steps 1 --batch 2 --seq 32 --out "$T/ckpt" --quiet || { echo "train failed"; exit 1; }
MODEL="$T/ckpt/step_00000001"

# token shards
head -c 4096 /dev/zero | tr '\0' 'x' >"$T/badmagic.bin"
head -c 600 "$T/good.bin" >"$T/truncated.bin"
python_free_poke() { # poke FILE OFFSET BYTE(octal): overwrite one byte in place
  printf "\\$3" | dd of="$1" bs=1 seek="$2" conv=notrunc status=none
}
cp "$T/good.bin" "$T/bigid.bin"; python_free_poke "$T/bigid.bin" 1100 377; python_free_poke "$T/bigid.bin" 1101 377
cp "$T/good.bin" "$T/badversion.bin"; python_free_poke "$T/badversion.bin" 4 011

# a config.json with an unknown model_type
mkdir -p "$T/badtype"; sed 's/"model_type": *"llama"/"model_type": "gpt2"/' "$MODEL/config.json" >"$T/badtype/config.json"
cp "$MODEL/model.safetensors" "$T/badtype/"
# eos_token_id as a list (Llama 3) with an item beyond the vocabulary (320)
mkdir -p "$T/eoslist"; sed 's/"eos_token_id": *\([0-9]*\)/"eos_token_id": [\1, 999]/' "$MODEL/config.json" >"$T/eoslist/config.json"
cp "$MODEL/model.safetensors" "$T/eoslist/"
for g in genjson genbig; do mkdir -p "$T/$g"; cp "$MODEL/config.json" "$MODEL/model.safetensors" "$T/$g/"; done
printf '{"eos_token_id": [257, \n' >"$T/genjson/generation_config.json"
printf '{"eos_token_id": [257, 320]}\n' >"$T/genbig/generation_config.json"
# a truncated safetensors
mkdir -p "$T/trunc"; cp "$MODEL/config.json" "$T/trunc/"; head -c 5000 "$MODEL/model.safetensors" >"$T/trunc/model.safetensors"
# header length beyond the file
mkdir -p "$T/hdr"; cp "$MODEL/config.json" "$T/hdr/"; cp "$MODEL/model.safetensors" "$T/hdr/"
python_free_poke "$T/hdr/model.safetensors" 5 177

# a ref-loss shard of another token shard
"$BIN" gen-data --source clean --tokens 20000 --seed 4 --out "$T/other.bin" >/dev/null
"$BIN" score --model "$MODEL" --data "$T/other.bin" --out "$T/other.ref.bin" --seq 64 >/dev/null 2>&1

echo "== flags"
expect_error "unknown command" "unknown command" -- frobnicate
expect_error "unknown flag" "unknown option '--frob'" -- train --frob 1
expect_error "keep zero" "keep" -- train --keep 0 --steps 1
expect_error "keep above one" "keep" -- train --keep 1.5 --steps 1
expect_error "keep not a number" "keep" -- train --keep half
expect_error "batch zero" "batch" -- train --batch 0
expect_error "seq not an integer" "seq" -- train --seq 12x
# strtol/strtod skip leading white space: " 5" was read as 5
expect_status 2 "steps with a leading space" "steps: ' 5' is not an integer" -- train --steps " 5"
expect_status 2 "lr with a trailing space" "lr: '1e-3 ' is not a finite number" -- train --lr "1e-3 " --steps 1
expect_status 2 "prompt-ids item with a space" "prompt-ids: ' 6' is not an integer" -- generate --model "$MODEL" --prompt-ids "5, 6" --max-new 1
expect_error "missing value" "needs a value" -- train --steps
expect_error "flag twice" "twice" -- train --steps 1 --steps 2
expect_error "unknown mode" "unknown mode 'fast'" -- train --mode fast
expect_error "unknown select" "unknown selection" -- train --select best
expect_error "keep and drop-rate" "not both" -- train --keep 0.5 --drop-rate 0.5
expect_error "select ref without ref" "needs --ref" -- train --mode centrifuge --select ref
expect_error "resume without out" "needs --out" -- train --resume
expect_error "unknown config name" "tiny" -- train --config no-such-model --steps 1
expect_error "unknown device" "unknown device" -- train --device tpu
expect_error "eval without data" "required" -- eval --model "$MODEL"
expect_error "score without data" "required" -- score --model "$MODEL"
expect_error "gen-data zero tokens" "tokens" -- gen-data --source clean --tokens 0 --out "$T/x.bin"
expect_error "gen-data bad source" "source" -- gen-data --source dirty --tokens 10 --out "$T/x.bin"
expect_error "bench bad keep list" "keep" -- bench --keep 0.5,2 --steps 1
# a prompt longer than the model's positions (tiny: 1024) is refused, not cut
# short: generating from a cut prompt answers another prompt
LONG_IDS=$(printf '5,%.0s' $(seq 1100))5
expect_error "generate --prompt-ids beyond the positions" "prompt-ids: 1101 tokens, more than the 1024 positions" -- generate --model "$MODEL" --prompt-ids "$LONG_IDS" --max-new 1 --ids
expect_error "generate --prompt beyond the positions" "prompt: 1201 tokens, more than the 1024 positions" -- generate --model "$MODEL" --prompt "$(printf 'a%.0s' $(seq 1200))" --max-new 1
# an empty item in --prompt-ids is refused, not skipped (5,,6 is not the prompt 5,6)
for ids in "5,,6" ",5" "5,"; do
  expect_status 2 "generate --prompt-ids '$ids'" "prompt-ids: '$ids' has an empty item" -- generate --model "$MODEL" --prompt-ids "$ids" --max-new 1
done

# usage errors exit 2 in every command, whatever the model or device flag;
# a file that is missing or cannot be written exits 1
for c in "train --steps 1" "eval --model $MODEL --data $T/good.bin" "score --model $MODEL --data $T/good.bin --out $T/u.ref.bin" \
         "generate --model $MODEL --prompt-ids 1" "math-eval --model $MODEL" "bench --steps 1"; do
  expect_status 2 "${c%% *} --device tpu exits 2" "unknown device 'tpu'" -- $c --device tpu
done
expect_status 2 "train --config and --model exit 2" "not both" -- train --config tiny --model "$MODEL" --steps 1
expect_status 2 "eval --config and --model exit 2" "not both" -- eval --config tiny --model "$MODEL" --data "$T/good.bin"
expect_status 2 "bench --config and --model: refused, not one of them ignored" "not both" -- bench --config tiny --model "$MODEL" --steps 1
# usage errors found before the model opens (they exited 1 when the model refused them)
expect_status 2 "bench --layers with --model exits 2" "--layers cuts a --config's layers" -- bench --model "$MODEL" --layers 1 --steps 1
expect_status 2 "bench --lora-targets without --lora-rank" "LoRA options need --lora-rank" -- bench --config tiny --lora-targets q,v --steps 1
expect_status 2 "bench --lora-alpha without --lora-rank" "LoRA options need --lora-rank" -- bench --config tiny --lora-alpha 4 --steps 1
expect_status 2 "generate --prompt-ids item not an integer exits 2" "prompt-ids: 'x' is not an integer" -- generate --model "$MODEL" --prompt-ids 5,x --max-new 1
expect_status 2 "generate --prompt-ids item negative exits 2" "prompt-ids: -1 is outside" -- generate --model "$MODEL" --prompt-ids 5,-1 --max-new 1
expect_status 2 "bench --seq with more values than it runs" "more than 16 values" -- bench --seq 1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17 --steps 1
expect_status 2 "train --lora-targets naming no module" "',' has an empty item" -- train --lora-rank 2 --lora-targets , --steps 1
expect_status 2 "train --lora-targets with an empty item" "'q,,v' has an empty item" -- train --lora-rank 2 --lora-targets q,,v --steps 1
expect_status 2 "bench --modes with an empty item" "modes: 'regular,,centrifuge' has an empty item" -- bench --config tiny --modes regular,,centrifuge --steps 1
expect_status 2 "bench --keep with an empty item" "keep: '0.5,' has an empty item" -- bench --config tiny --keep 0.5, --steps 1
expect_status 2 "train --freeze with an empty item" "freeze: 'embed_tokens,' has an empty item" -- train --freeze embed_tokens, --steps 1
expect_status 1 "train --data list with an empty item" "an empty item in the list of files" -- train --config tiny --data "$T/good.bin,,$T/good.bin" --steps 1 --batch 1 --seq 16
expect_status 1 "eval --data list ending in a comma" "an empty item in the list of files" -- eval --model "$T/ckpt" --data "$T/good.bin," --seq 16
expect_status 1 "math-eval --json a directory exits 1" "is a directory" -- math-eval --model "$MODEL" --problems 4 --json "$T"
expect_status 1 "score --data a pattern that matches nothing exits 1" "no file matches" -- score --model "$MODEL" --data "$T/nomatch_*.bin"
[ -e "$T/u.ref.bin" ] && { echo "  FAIL score with a bad --device wrote its --out"; fails=$((fails+1)); }

echo "== files"
expect_error "missing data file" "missing.bin" -- train --data "$T/missing.bin" --steps 1
expect_error "token shard bad magic" "badmagic.bin" -- train --data "$T/badmagic.bin" --steps 1
expect_error "token shard truncated" "truncated.bin" -- train --data "$T/truncated.bin" --steps 1
expect_error "token shard bad version" "badversion.bin" -- train --data "$T/badversion.bin" --steps 1
expect_error "token id beyond vocab" "bigid.bin" -- train --data "$T/bigid.bin" --steps 1
expect_error "ref shard of another shard" "does not belong" -- train --data "$T/good.bin" --ref "$T/other.ref.bin" --mode centrifuge --steps 1
expect_error "config unknown model_type" "gpt2" -- eval --model "$T/badtype" --data "$T/good.bin"
expect_status 1 "generation_config.json that is not JSON" "generation_config.json: not valid JSON" -- generate --model "$T/genjson" --prompt-ids 5,6
expect_status 1 "generation_config.json eos id beyond the vocabulary" "generation_config.json: eos_token_id\[1\] = 320 is outside the vocabulary (0..319)" -- generate --model "$T/genbig" --prompt-ids 5,6
expect_status 1 "config eos_token_id list with an item beyond the vocabulary" "eos_token_id\[1\] = 999 is outside the vocabulary (0..319)" -- eval --model "$T/eoslist" --data "$T/good.bin"
expect_error "safetensors truncated" "model.safetensors" -- eval --model "$T/trunc" --data "$T/good.bin"
expect_error "safetensors header beyond file" "model.safetensors" -- eval --model "$T/hdr" --data "$T/good.bin"
expect_error "model dir missing" "config.json" -- eval --model "$T/nowhere" --data "$T/good.bin"

# tensor parallelism: launch mistakes (checked before any GPU is touched)
expect_status 2 "--tp without a launcher" "needs 2 processes" -- train --config tiny --tp 2 --steps 1
# flags that do nothing without another are refused, not ignored
expect_status 2 "--save-every without --out" "--save-every needs --out" -- train --config tiny --data "$T/good.bin" --save-every 2 --steps 1
expect_status 2 "--keep-checkpoints without --out" "--keep-checkpoints needs --out" -- train --config tiny --data "$T/good.bin" --keep-checkpoints 3 --steps 1
expect_status 2 "--eval-every without --val" "--eval-every needs --val" -- train --config tiny --data "$T/good.bin" --eval-every 2 --steps 1
expect_status 2 "--eval-batches without --val" "--eval-batches needs --val" -- train --config tiny --data "$T/good.bin" --eval-batches 2 --steps 1
expect_status 2 "--data-seed without --shuffle" "--data-seed needs --shuffle" -- train --config tiny --data "$T/good.bin" --data-seed 7 --steps 1
expect_status 2 "generate --top-k when greedy" "--top-k samples, and --temperature 0 (the default) is greedy" -- generate --model "$MODEL" --prompt-ids 5,6 --top-k 5
expect_status 2 "generate --seed when greedy" "--seed samples" -- generate --model "$MODEL" --prompt-ids 5,6 --seed 3 --temperature 0
expect_status 2 "--tp with --lora-rank" "--tp with LoRA adapters is not supported" -- train --config tiny --tp 2 --lora-rank 2 --steps 1
expect_error "--dp-grad-dtype fp16" "--dp-grad-dtype: fp32 or bf16, got 'fp16'" -- train --config tiny --dp-grad-dtype fp16 --steps 1
n=$((n+1))
if "$BIN" train --config tiny --dp-grad-dtype bf16 --steps 1 --batch 2 --seq 32 >/dev/null 2>"$T/err" &&
   grep -q "no effect in a single process" "$T/err"; then echo "  ok   --dp-grad-dtype bf16 in one process: a note, and it trains"
else echo "  FAIL --dp-grad-dtype bf16 in one process"; fails=$((fails+1)); fi
expect_error "--tp 0" "tp" -- train --config tiny --tp 0 --steps 1
n=$((n+1))
WORLD_SIZE=3 RANK=0 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29555 "$BIN" train --config tiny --tp 2 --steps 1 >"$T/out" 2>"$T/err"; rc=$?
if [ $rc -eq 2 ] && [ "$(wc -l <"$T/err")" -eq 1 ] && grep -q "error: --tp 2 does not divide the 3 ranks" "$T/err"; then
  echo "  ok   --tp not dividing the world: $(cat "$T/err")"
else
  echo "  FAIL --tp not dividing the world (rc=$rc)"; sed 's/^/      /' "$T/err" | head -3; fails=$((fails+1))
fi

echo "== launchers: every command but train runs in one process"
# launch VAR=value...: export these for the cases that follow (launch: none)
L_VARS=()
launch() {
  local v; for v in ${L_VARS[@]+"${L_VARS[@]}"}; do unset "$v"; done; L_VARS=()
  for v in "$@"; do export "$v"; L_VARS+=("${v%%=*}"); done
}
TORCHRUN2=(RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500)
echo "one document" >"$T/l.txt"
launch "${TORCHRUN2[@]}"
expect_status 2 "eval under torchrun with 2 processes" "started as rank 1 of 2 by torchrun (WORLD_SIZE=2); eval runs in one process: start it without a launcher, or with one process" -- eval --model "$MODEL" --data "$T/good.bin" --seq 32
expect_status 2 "bench under torchrun with 2 processes" "rank 1 of 2 by torchrun (WORLD_SIZE=2); bench runs in one process" -- bench --config tiny --steps 1 --warmup 0 --seq 32 --modes regular
for c in "score --model $MODEL --data $T/good.bin --out $T/l.ref.bin" "generate --model $MODEL --prompt-ids 1 --max-new 1" \
         "gen-data --source clean --tokens 100 --out $T/l.bin" "convert --model $MODEL --out $T/l.conv" \
         "tokenize --tokenizer $(dirname "$0")/data/tokenizer/bytelevel.json --input $T/l.txt --out $T/l.tok" \
         "math-eval --model $MODEL --problems 4" \
         "demo --out $T/l.demo --steps 1"; do
  expect_status 2 "${c%% *} under torchrun with 2 processes" "${c%% *} runs in one process" -- $c
done
n=$((n+1))
if ls -d "$T"/l.ref.bin "$T"/l.bin "$T"/l.conv "$T"/l.tok* "$T"/l.demo 2>/dev/null | grep -q .; then
  echo "  FAIL a refused launch left an output"; fails=$((fails+1))
else echo "  ok   a refused launch leaves no output"; fi
launch OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_SIZE=4 OMPI_COMM_WORLD_LOCAL_RANK=0 OMPI_COMM_WORLD_LOCAL_SIZE=4
expect_status 2 "eval under mpirun -np 4" "rank 0 of 4 by mpirun (OMPI_COMM_WORLD_SIZE=4); eval runs in one process" -- eval --model "$MODEL" --data "$T/good.bin" --seq 32
expect_status 2 "bench under mpirun -np 4" "rank 0 of 4 by mpirun (OMPI_COMM_WORLD_SIZE=4); bench runs in one process" -- bench --config tiny --steps 1 --warmup 0 --seq 32 --modes regular
# several hosts without a local rank: still the one-process line (placement does not matter to it)
launch SLURM_PROCID=3 SLURM_STEP_NUM_TASKS=4 SLURM_NODEID=1 SLURM_STEP_TASKS_PER_NODE='2(x2)'
expect_status 2 "eval under srun -n 4" "rank 3 of 4 by srun (SLURM_STEP_NUM_TASKS=4); eval runs in one process" -- eval --model "$MODEL" --data "$T/good.bin" --seq 32
expect_status 2 "bench under srun -n 4" "rank 3 of 4 by srun (SLURM_STEP_NUM_TASKS=4); bench runs in one process" -- bench --config tiny --steps 1 --warmup 0 --seq 32 --modes regular
launch WORLD_SIZE=2
expect_status 2 "eval with WORLD_SIZE but no RANK" "WORLD_SIZE is set but RANK is not" -- eval --model "$MODEL" --data "$T/good.bin" --seq 32
# one process under a launcher (torchrun --nproc_per_node 1), a Slurm batch
# script (not a step) and a stray MASTER_PORT: these run
for e in "RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500" \
         "SLURM_PROCID=0 SLURM_NTASKS=4 SLURM_JOB_ID=7" "MASTER_PORT=not-a-port"; do
  launch $e
  n=$((n+1))
  if "$BIN" eval --model "$MODEL" --data "$T/good.bin" --seq 32 >"$T/out" 2>"$T/err" && grep -q "eval: " "$T/out" &&
     "$BIN" bench --config tiny --steps 1 --warmup 0 --seq 32 --modes regular >"$T/out" 2>"$T/err"; then
    echo "  ok   eval and bench run in one process with $e"
  else echo "  FAIL eval or bench with $e:"; sed 's/^/      /' "$T/err" | head -3; fails=$((fails+1)); fi
done
launch

echo "== no partial output"
n=$((n+1))
"$BIN" train --data "$T/bigid.bin" --steps 1 --out "$T/never" >/dev/null 2>&1
if [ -e "$T/never" ]; then echo "  FAIL failed run created its --out directory"; fails=$((fails+1)); else echo "  ok   failed run leaves no --out directory"; fi
n=$((n+1))
"$BIN" gen-data --source noisy --tokens 0 --out "$T/none.bin" >/dev/null 2>&1
if [ -e "$T/none.bin" ]; then echo "  FAIL gen-data error left a file"; fails=$((fails+1)); else echo "  ok   gen-data error leaves no file"; fi
n=$((n+1))
if ls "$T"/*.tmp.* >/dev/null 2>&1 || ls "$T"/ckpt/*/*.tmp.* >/dev/null 2>&1; then echo "  FAIL temp files left behind"; fails=$((fails+1)); else echo "  ok   no temp files left behind"; fi

echo "$n cases, $fails failed"
[ $fails -eq 0 ]
