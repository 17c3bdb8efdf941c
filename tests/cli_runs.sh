#!/usr/bin/env bash
# cli_runs.sh — issue 12 for long training runs (docs/ROBUSTNESS.md §6):
#   - checkpoint housekeeping: rotation never deletes what the run did not
#     write; a fresh run never writes into another run's checkpoints and
#     `latest` never moves back; one run per --out (a lock); --resume checks
#     the run manifest; non-finite weights never become a checkpoint; a
#     state.bin with NaN moments is refused;
#   - signals: SIGTERM and SIGINT finish the step, save, exit 143 / 130;
#   - every output location is validated before the first step;
#   - limits: sizes that overflow, a memory estimate before allocating,
#     --steps / --warmup above 2^31, a resumed data position out of range.
# Usage: tests/cli_runs.sh ./centrifuge
. "$(dirname "$0")/lib_cli.sh" runs "$@"
# wait_lines FILE N: until FILE has N lines (or 120 s)
wait_lines() {
  local w=0
  while [ "$(wc -l 2>/dev/null <"$1" || echo 0)" -lt "$2" ] && [ $w -lt 12000 ]; do sleep 0.01; w=$((w + 1)); done
}

"$BIN" gen-data --source clean --tokens 20000 --seed 3 --out "$T/d.bin" >/dev/null || { echo "gen-data failed"; exit 1; }
"$BIN" gen-data --source clean --tokens 20000 --seed 4 --out "$T/e.bin" >/dev/null || { echo "gen-data failed"; exit 1; }
RUN=(train --config tiny --data "$T/d.bin" --batch 2 --seq 32 --quiet)

echo "== checkpoint housekeeping"
# --out holds the user's files, a user's step_* directory and another run's
# checkpoint: rotation removes only this run's own
"$BIN" "${RUN[@]}" --steps 3 --out "$T/other" 2>/dev/null || fail "setup"
mkdir -p "$T/w/step_00000001" "$T/w/old"
echo mine >"$T/w/notes.txt"; echo mine >"$T/w/step_00000001/keep.txt"; echo mine >"$T/w/x.tmp.1234"
cp -r "$T/other/step_00000003" "$T/w/"
"$BIN" "${RUN[@]}" --steps 6 --save-every 2 --keep-checkpoints 1 --out "$T/w" 2>"$T/err" || fail "run into a shared --out: $(tail -1 "$T/err")"
kept=$(cd "$T/w" && ls -d step_* | tr '\n' ' ')
if [ -f "$T/w/notes.txt" ] && [ -f "$T/w/step_00000001/keep.txt" ] && [ -f "$T/w/x.tmp.1234" ] && [ -d "$T/w/old" ] &&
   [ -f "$T/w/step_00000003/model.safetensors" ] && [ "$kept" = "step_00000001 step_00000003 step_00000006 " ]; then
  ok "rotation removed only the run's own checkpoints (left: $kept+ the user's files)"
else fail "rotation: left $kept; $(ls -A "$T/w" | tr '\n' ' ')"; fi
# a fresh run into a directory with another run's checkpoints is refused
cp "$T/w/latest" "$T/latest.before"
expect_error "fresh run into an old run's --out" "already holds checkpoints.*--resume" -- "${RUN[@]}" --steps 2 --out "$T/w"
cmp -s "$T/w/latest" "$T/latest.before" && [ -f "$T/w/step_00000006/model.safetensors" ] &&
  ok "the old run's latest and checkpoints are untouched" || fail "the old run's checkpoints changed"
# --resume checks the manifest: one line naming the field
expect_error "--resume with another --seq" "with --seq '32'; this command has '16'" -- \
  train --config tiny --data "$T/d.bin" --batch 2 --seq 16 --quiet --steps 8 --out "$T/w" --resume
expect_error "--resume with another --config" "with --config/--model 'config:tiny'" -- \
  train --config tiny-qwen3 --data "$T/d.bin" --batch 2 --seq 32 --quiet --steps 8 --out "$T/w" --resume
expect_error "--resume with another --mode" "with --mode 'regular'" -- "${RUN[@]}" --steps 8 --out "$T/w" --resume --mode centrifuge
expect_error "--resume with other --data" "with --data" -- \
  train --config tiny --data "$T/e.bin" --batch 2 --seq 32 --quiet --steps 8 --out "$T/w" --resume
"$BIN" "${RUN[@]}" --steps 8 --save-every 1 --keep-checkpoints 1 --out "$T/w" --resume 2>"$T/err" &&
  [ "$(cat "$T/w/latest")" = step_00000008 ] && ok "--resume with the same arguments continues (latest -> step 8)" ||
  fail "resume: $(tail -1 "$T/err")"

# one run per --out: a second one fails at once, naming the holder
"$BIN" "${RUN[@]}" --steps 100000 --save-every 1000 --out "$T/busy" --log "$T/busy.log" 2>"$T/busy.err" &
bg=$!
wait_lines "$T/busy.log" 2
t0=$(date +%s%N)
expect_error "a second run on the same --out" "busy: in use by another run (pid $bg" -- "${RUN[@]}" --steps 2 --out "$T/busy"
[ $(( ($(date +%s%N) - t0) / 1000000 )) -lt 10000 ] && ok "... and it failed at once" || fail "the second run waited"

echo "== signals"
kill -TERM $bg; wait $bg; rc=$?; bg=
last=$(tail -1 "$T/busy.log" | sed 's/^{"step":\([0-9]*\),.*/\1/')
[ $rc -eq 143 ] && ok "SIGTERM: exit 143 after $last steps" || fail "SIGTERM: exit $rc: $(tail -1 "$T/busy.err")"
[ "$(cat "$T/busy/latest" 2>/dev/null)" = "$(printf 'step_%08d' "$last")" ] &&
  ok "SIGTERM: the last finished step was saved ($(cat "$T/busy/latest"))" || fail "SIGTERM: latest is $(cat "$T/busy/latest" 2>&1), last step $last"
grep -q 'SIGTERM after step' "$T/busy.err" && ok "SIGTERM: said so: $(grep 'SIGTERM after' "$T/busy.err")" || fail "SIGTERM: no message"
"$BIN" "${RUN[@]}" --steps 100000 --save-every 1000 --out "$T/busy" --resume --log "$T/busy.log" 2>"$T/busy.err" &
bg=$!
wait_lines "$T/busy.log" $((last + 2))
kill -INT $bg; wait $bg; rc=$?; bg=
last2=$(tail -1 "$T/busy.log" | sed 's/^{"step":\([0-9]*\),.*/\1/')
[ $rc -eq 130 ] && [ "$(cat "$T/busy/latest")" = "$(printf 'step_%08d' "$last2")" ] &&
  ok "SIGINT after resuming: exit 130, step $last2 saved" || fail "SIGINT: exit $rc, latest $(cat "$T/busy/latest")"

# a second signal exits at once: a slow step (about a second) is abandoned
"$BIN" train --config cpu-20m --data "$T/d.bin" --batch 8 --seq 512 --steps 100 --out "$T/twice" --log "$T/twice.log" \
  --quiet 2>"$T/twice.err" &
bg=$!
wait_lines "$T/twice.log" 1
kill -TERM $bg; sleep 0.05; t0=$(date +%s%N); kill -TERM $bg; wait $bg; rc=$?; bg=
ms=$(( ($(date +%s%N) - t0) / 1000000 ))
[ $rc -eq 143 ] && [ $ms -lt 1000 ] && ok "a second SIGTERM exits at once (${ms} ms, exit 143, the step in flight abandoned)" ||
  fail "second SIGTERM: exit $rc after ${ms} ms"

echo "== non-finite state"
# a resumed run whose weights turned NaN: no checkpoint of them, the last
# good one stays
mkdir -p "$T/nan"
"$BIN" "${RUN[@]}" --steps 2 --out "$T/nan" 2>/dev/null || fail "nan setup"
ST="$T/nan/step_00000002"
hlen=$(od -An -t u8 -N 8 "$ST/model.safetensors" | tr -d ' ')
begin=$(head -c $((8 + hlen)) "$ST/model.safetensors" | tail -c +9 | grep -o '"model.norm.weight":{[^}]*}' |
        sed 's/.*"data_offsets":\[\([0-9]*\),.*/\1/')
printf '\x00\x00\xc0\x7f' | dd of="$ST/model.safetensors" bs=1 seek=$((8 + hlen + begin)) conv=notrunc status=none
"$BIN" "${RUN[@]}" --steps 4 --save-every 1 --keep-checkpoints 1 --max-bad-steps 10 --out "$T/nan" --resume 2>"$T/err"; rc=$?
if [ $rc -ne 0 ] && [ "$(grep -c error: "$T/err")" -eq 1 ] &&
   grep -q 'error: step 3: checkpoint refused: weight of model.norm.weight\[0\] is nan' "$T/err"; then
  ok "non-finite weights are not checkpointed: $(grep error: "$T/err")"
else fail "non-finite weights: rc=$rc: $(tail -1 "$T/err")"; fi
[ "$(cat "$T/nan/latest")" = step_00000002 ] && [ -f "$ST/state.bin" ] && [ ! -e "$T/nan/step_00000003" ] &&
  ok "latest still names the last good checkpoint, which stays" || fail "after the refusal: latest $(cat "$T/nan/latest")"
# a state.bin with a NaN moment is refused on resume
"$BIN" "${RUN[@]}" --steps 2 --out "$T/nanstate" 2>/dev/null || fail "nanstate setup"
printf '\x00\x00\xc0\x7f' | dd of="$T/nanstate/step_00000002/state.bin" bs=1 seek=40 conv=notrunc status=none
expect_error "a state.bin with NaN moments" "state.bin: AdamW m of .* is nan; the checkpoint is damaged" -- \
  "${RUN[@]}" --steps 4 --out "$T/nanstate" --resume
# a resumed data position beyond the data (2^62)
"$BIN" "${RUN[@]}" --steps 2 --out "$T/pos" 2>/dev/null || fail "pos setup"
printf '\x00\x00\x00\x00\x00\x00\x00\x40' | dd of="$T/pos/step_00000002/state.bin" bs=1 seek=24 conv=notrunc status=none
expect_error "a resumed data position of 2^62" "position 4611686018427387904 is beyond" -- "${RUN[@]}" --steps 4 --out "$T/pos" --resume
"$BIN" "${RUN[@]}" --steps 2 --shuffle --out "$T/pos2" 2>/dev/null || fail "pos2 setup"
printf '\xff\xff\xff\xff\xff\xff\xff\x7f' | dd of="$T/pos2/step_00000002/state.bin" bs=1 seek=24 conv=notrunc status=none
expect_error "a resumed shuffled position of 2^63 - 1" "out of range" -- "${RUN[@]}" --steps 4 --shuffle --out "$T/pos2" --resume

echo "== every output validated before the first step"
echo file >"$T/afile"
expect_error "--out is a file" "afile: exists and is a regular file, not a directory" -- "${RUN[@]}" --steps 2 --out "$T/afile" --log "$T/v1.log"
long=$(printf 'n%.0s' $(seq 300))
expect_error "--out name too long" "too long" -- "${RUN[@]}" --steps 2 --out "$T/$long" --log "$T/v2.log"
if [ "$(id -u)" -ne 0 ]; then
  mkdir -p "$T/ro" && chmod 555 "$T/ro"
  expect_error "--out read-only" "cannot write in" -- "${RUN[@]}" --steps 2 --out "$T/ro/run" --log "$T/v3.log"
else
  expect_error "--out not writable (/proc)" "cannot" -- "${RUN[@]}" --steps 2 --out "/proc/cf_test_run" --log "$T/v3.log"
fi
expect_error "--log in a missing directory" "nowhere" -- "${RUN[@]}" --steps 2 --out "$T/v4" --log "$T/nowhere/x.log"
"$BIN" gen-data --source clean --tokens 40 --seed 5 --out "$T/tiny_val.bin" >/dev/null
expect_error "--val too small for one batch" "tiny_val.bin" -- "${RUN[@]}" --steps 2 --out "$T/v5" --val "$T/tiny_val.bin" --log "$T/v5.log"
ls "$T"/v*.log "$T"/v4 "$T"/v5 >/dev/null 2>&1 && fail "a refused run left output: $(ls -d "$T"/v* | tr '\n' ' ')" ||
  ok "none of them left a log or an --out directory"

echo "== limits"
expect_error "--batch x --seq above 2^28" "more than the supported 2\^28" -- train --batch 65536 --seq 1048576 --steps 1
expect_error "a model too large for the memory" "memory: this run needs about .* GiB is free" -- \
  train --config llama3.1-8b --batch 64 --seq 8192 --steps 1
expect_error "bench: a model too large for the memory" "memory: this run needs" -- \
  bench --config llama3.1-8b --batch 64 --seq 8192 --steps 1
# --steps and --warmup above 2^31 are not truncated: the first step's
# learning rate is lr / warmup
"$BIN" "${RUN[@]}" --steps 4294967297 --warmup 4294967296 --lr 1e-3 --log "$T/big.log" 2>"$T/big.err" &
bg=$!
wait_lines "$T/big.log" 1
kill -TERM $bg; wait $bg; rc=$?; bg=
lr=$(head -1 "$T/big.log" | sed 's/.*"lr":\([^,]*\),.*/\1/')
[ $rc -eq 143 ] && [ "$lr" = "2.32831e-13" ] && ok "--steps 2^32+1 --warmup 2^32: first lr $lr (= 1e-3 / 2^32), SIGTERM 143" ||
  fail "big --steps: exit $rc, first lr '$lr'"

echo "== LoRA on a built-in config: resume = uninterrupted run; another --lora-dropout is refused"
L="train --config tiny --lora-rank 4 --lora-dropout 0.2 --seed 11 --batch 2 --seq 32 --quiet --lr 1e-2 --steps 6"
"$BIN" $L --save-every 3 --out "$T/lfull" >/dev/null 2>&1
# the same run cut after its step-3 checkpoint, then resumed
cp -r "$T/lfull" "$T/lpart"; rm -rf "$T/lpart/step_00000006" "$T/lpart/.lock"; printf 'step_00000003' >"$T/lpart/latest"
"$BIN" $L --save-every 3 --out "$T/lpart" --resume >/dev/null 2>&1
if [ -f "$T/lpart/step_00000006/adapter_model.safetensors" ] &&
   cmp -s "$T/lfull/step_00000006/adapter_model.safetensors" "$T/lpart/step_00000006/adapter_model.safetensors"; then
  ok "LoRA (dropout 0.2) resumed at step 3 of 6: adapters bitwise equal to the uninterrupted run"
else fail "LoRA resume differs from the uninterrupted run"; fi
expect_error "resume with another --lora-dropout" "lora" -- train --config tiny --lora-rank 4 --lora-dropout 0.1 --seed 11 \
  --batch 2 --seq 32 --quiet --lr 1e-2 --steps 8 --out "$T/lpart" --resume

echo "== --layers: the first N layers of a --config, resumable, recorded in the manifest"
Y="train --config tiny --seed 5 --batch 2 --seq 32 --quiet --lr 1e-2 --save-every 2"
"$BIN" $Y --layers 2 --steps 2 --out "$T/y" >/dev/null 2>&1
if grep -q '"num_hidden_layers": 2,' "$T/y/step_00000002/config.json" 2>/dev/null &&
   grep -q 'layers 2' "$T/y/run.json"; then ok "--layers 2: the checkpoint has 2 layers, run.json says so"
else fail "--layers 2: checkpoint config or manifest wrong"; fi
if "$BIN" $Y --layers 2 --steps 4 --out "$T/y" --resume >/dev/null 2>&1 &&
   grep -q '"num_hidden_layers": 2,' "$T/y/step_00000004/config.json" 2>/dev/null; then ok "--layers 2 resumes to step 4"
else fail "--layers 2 did not resume"; fi
expect_error "resume with another --layers" "with --config/--model 'config:tiny, layers 2'; this command has 'config:tiny, layers 3'" -- \
  $Y --layers 3 --steps 6 --out "$T/y" --resume
expect_error "--layers beyond the config" "--layers 9: tiny has 4 layers" -- $Y --layers 9 --steps 2 --out "$T/y9"
expect_error "--layers with --model" "--layers cuts a --config" -- train --model "$T/y/step_00000002" --layers 1 --steps 1
expect_error "bench --layers 0" "layers" -- bench --config tiny --layers 0

cli_summary
