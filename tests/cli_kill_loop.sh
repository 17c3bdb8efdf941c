#!/usr/bin/env bash
# cli_kill_loop.sh — crash safety (DESIGN §4: "a crash never leaves a corrupt
# checkpoint"). Kills `centrifuge train --out D --resume` with SIGKILL at
# random moments, again and again. After every kill the checkpoint that
# D/latest names must be complete (config.json, model.safetensors,
# state.bin of the right size) and must load (`centrifuge eval --model`);
# once a checkpoint exists, `latest` must never go missing or move back.
# Each restart resumes from `latest`; the last one runs to the end. Then:
#   - every step's loss, as logged by any of the runs (steps done again after
#     a kill included), equals the loss of that step in an uninterrupted run
#     — exactly, as printed: the same weights, the same optimizer state and
#     the same data position;
#   - the final weights and training state are byte-identical to those of
#     the uninterrupted run;
#   - no temp files and no more than --keep-checkpoints checkpoints remain.
# Usage: tests/cli_kill_loop.sh ./centrifuge
# Env: CF_KILLS (default 10), CF_KILL_STEPS (default 200).
set -u
BIN=$(realpath "${1:-./centrifuge}")
T=$(mktemp -d /tmp/cf_kill_XXXXXX)
trap 'rm -rf "$T"' EXIT
KILLS=${CF_KILLS:-10}
STEPS=${CF_KILL_STEPS:-200}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
fails=0
fail() { echo "  FAIL $*"; fails=$((fails + 1)); }

"$BIN" gen-data --source clean --tokens 20000 --seed 5 --out "$T/data.bin" >/dev/null || { echo "gen-data failed"; exit 1; }
ARGS=(train --config tiny --data "$T/data.bin" --seq 32 --batch 2 --steps "$STEPS" --save-every 5 --keep-checkpoints 2 --quiet)

# The reference: one uninterrupted run.
"$BIN" "${ARGS[@]}" --out "$T/ref" --log "$T/ref.log" || { echo "reference run failed"; exit 1; }

# checkpoint_ok DIR: the checkpoint that DIR/latest names is complete and loads.
checkpoint_ok() {
  local name dir nparams size want
  name=$(cat "$1/latest") || return 1
  dir="$1/$name"
  for f in config.json model.safetensors state.bin; do
    [ -s "$dir/$f" ] || { echo "latest -> $name: $f missing or empty"; return 1; }
  done
  # eval loads config.json and every tensor of model.safetensors
  "$BIN" eval --model "$dir" --data "$T/data.bin" --batch 1 --seq 16 --max-batches 1 >"$T/eval.out" 2>&1 ||
    { echo "latest -> $name does not load: $(tail -1 "$T/eval.out")"; return 1; }
  # state.bin: a header, then Adam m and v (2 floats per parameter)
  nparams=$(od -An -t d8 -j 8 -N 8 "$dir/state.bin" | tr -d ' ')
  size=$(stat -c %s "$dir/state.bin")
  want=$((size - 8 * nparams))
  if [ "$nparams" -le 0 ] || [ $want -lt 32 ] || [ $want -gt 64 ]; then
    echo "latest -> $name: state.bin is $size bytes for $nparams parameters"; return 1
  fi
  return 0
}

echo "== $KILLS kills at random moments"
last_step=0; killed=0; finished=0
for i in $(seq 1 "$KILLS"); do
  # Kill after a random number of steps (0 to 15: 0 kills during startup),
  # counted in the log, plus a random part of a step: independent of the
  # machine's speed, and a kill right after a step that saves lands inside
  # the save. A run stuck for 5 minutes is a hang.
  target=$((RANDOM % 16)); extra_ms=$((RANDOM % 40))
  base=$( [ -f "$T/run.log" ] && wc -l <"$T/run.log" || echo 0)
  "$BIN" "${ARGS[@]}" --out "$T/ck" --resume --log "$T/run.log" 2>"$T/err" &
  pid=$!
  if [ $target -eq 0 ]; then
    sleep "0.$(printf '%03d' $((RANDOM % 150)))"
  else
    waited=0
    while kill -0 $pid 2>/dev/null && [ "$(wc -l 2>/dev/null <"$T/run.log" || echo 0)" -lt $((base + target)) ]; do
      sleep 0.01; waited=$((waited + 1))
      [ $waited -lt 30000 ] || { fail "run $i: no progress in 5 minutes"; break; }
    done
    sleep "0.$(printf '%03d' $extra_ms)"
  fi
  kill -KILL $pid 2>/dev/null
  wait $pid 2>/dev/null; rc=$?
  when="after $target steps + ${extra_ms} ms"
  [ $target -eq 0 ] && when="during startup"
  if [ $rc -eq 137 ]; then
    killed=$((killed + 1))
  elif [ $rc -eq 0 ]; then
    finished=1
  else
    fail "run $i exited with $rc before the kill: $(tail -1 "$T/err")"
    break
  fi
  if [ -e "$T/ck/latest" ]; then
    msg=$(checkpoint_ok "$T/ck") || { fail "after kill $i: $msg"; break; }
    step=$((10#$(sed 's/step_//' "$T/ck/latest")))
    [ "$step" -ge "$last_step" ] || { fail "after kill $i: latest moved back from $last_step to $step"; break; }
    last_step=$step
    echo "  ok   kill $i $when: latest -> step $step loads"
  elif [ $last_step -gt 0 ]; then
    fail "after kill $i: latest has gone missing"; break
  else
    echo "  ok   kill $i $when: no checkpoint yet"
  fi
  [ $finished -eq 1 ] && break
done
[ $killed -ge 1 ] || fail "no run was killed mid-way"

echo "== resume to the end"
"$BIN" "${ARGS[@]}" --out "$T/ck" --resume --log "$T/run.log" 2>"$T/err" || fail "final resume failed: $(tail -1 "$T/err")"

# step loss pairs, as printed in the JSON-lines logs
losses() { sed -n 's/^{"step":\([0-9]*\),"loss":\([^,]*\),.*/\1 \2/p' "$1"; }
losses "$T/ref.log" >"$T/ref.txt"
losses "$T/run.log" >"$T/run.txt"
report=$(awk -v steps="$STEPS" 'NR == FNR { ref[$1] = $2; next }
  { n++; seen[$1] = 1; if (ref[$1] != $2) { bad++; if (bad <= 5) printf "step %d: loss %s, uninterrupted %s; ", $1, $2, ref[$1] } }
  END { miss = 0; for (s = 1; s <= steps; s++) if (!(s in seen)) miss++;
        printf "%d logged steps (%d done again after kills), %d differ, %d missing", n, n - steps + miss, bad + 0, miss;
        exit (bad > 0 || miss > 0) }' "$T/ref.txt" "$T/run.txt")
if [ $? -eq 0 ]; then echo "  ok   losses equal the uninterrupted run step for step: $report"; else fail "losses: $report"; fi

final=$(printf 'step_%08d' "$STEPS")
for f in model.safetensors state.bin config.json; do
  if cmp -s "$T/ref/$final/$f" "$T/ck/$final/$f"; then echo "  ok   final $f identical to the uninterrupted run's"
  else fail "final $f differs from the uninterrupted run's"; fi
done
left=$(find "$T/ck" -name '*.tmp.*' | wc -l)
[ "$left" -eq 0 ] && echo "  ok   no temp files left" || fail "$left temp files left: $(find "$T/ck" -name '*.tmp.*' | head -3 | xargs -n1 basename | tr '\n' ' ')"
ndirs=$(find "$T/ck" -mindepth 1 -maxdepth 1 -type d | wc -l)
[ "$ndirs" -le 2 ] && echo "  ok   $ndirs checkpoints kept (--keep-checkpoints 2)" || fail "$ndirs checkpoint directories left: $(ls "$T/ck" | tr '\n' ' ')"

echo "$killed kills, $fails failed"
[ $fails -eq 0 ]
