#!/usr/bin/env bash
# cli_nonfinite.sh — non-finite steps (issue: "a non-finite loss or gradient
# norm skips the step and says so; after a set number of consecutive ones
# the run stops with a clear message").
#
# NaNs are planted where we control them: a NaN in the final norm's weight
# makes every step non-finite; a NaN in one row of the (untied) input
# embedding makes exactly the steps whose batch holds that token non-finite
# (the token, id 300, is unused by the corpus and written into the data at
# chosen places). --lr alone cannot do it: it is capped at 10, and AdamW's
# update is bounded by lr, so losses stay finite. Runs that save checkpoints
# freeze the poisoned embedding (--freeze embed_tokens): non-finite *trained*
# weights never become a checkpoint (tests/cli_checkpoints.sh); frozen ones
# are the model's as given.
# Usage: tests/cli_nonfinite.sh ./centrifuge
set -u
BIN=$(realpath "${1:-./centrifuge}")
T=$(mktemp -d /tmp/cf_nonfinite_XXXXXX)
trap 'rm -rf "$T"' EXIT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
fails=0; n=0
ok() { n=$((n + 1)); echo "  ok   $*"; }
fail() { n=$((n + 1)); fails=$((fails + 1)); echo "  FAIL $*"; }

bytes() { local f=""; for b in "$@"; do f+=$(printf '\\x%02x' $((b & 255))); done; printf "$f"; }
poke() { local f=$1 off=$2; shift 2; bytes "$@" | dd of="$f" bs=1 seek="$off" conv=notrunc status=none; }
NAN=(0 0 192 127)   # quiet NaN, little-endian fp32
# tensor_offset FILE NAME: byte offset of a tensor's data in a safetensors file
tensor_offset() {
  local hlen begin
  hlen=$(od -An -t u8 -N 8 "$1" | tr -d ' ')
  begin=$(head -c $((8 + hlen)) "$1" | tail -c +9 | grep -o "\"$2\":{[^}]*}" |
          sed 's/.*"data_offsets":\[\([0-9]*\),.*/\1/')
  echo $((8 + hlen + begin))
}

# A small llama with an untied embedding, one step trained, as the start.
cat >"$T/untied.json" <<'EOF'
{"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
 "max_position_embeddings": 256, "rms_norm_eps": 1e-05, "tie_word_embeddings": false,
 "bos_token_id": 256, "eos_token_id": 257}
EOF
"$BIN" gen-data --source clean --tokens 20000 --seed 3 --out "$T/data.bin" >/dev/null || { echo "gen-data failed"; exit 1; }
"$BIN" train --config "$T/untied.json" --data "$T/data.bin" --steps 1 --batch 2 --seq 32 --out "$T/base" --quiet ||
  { echo "base model training failed"; exit 1; }
BASE="$T/base/step_00000001"
# every step non-finite: NaN in model.norm.weight
mkdir -p "$T/nan_norm" && cp "$BASE"/config.json "$BASE"/model.safetensors "$T/nan_norm/"
poke "$T/nan_norm/model.safetensors" "$(tensor_offset "$T/nan_norm/model.safetensors" model.norm.weight)" "${NAN[@]}"
# only steps whose batch holds token 300: NaN in row 300 of the embedding
mkdir -p "$T/nan_row" && cp "$BASE"/config.json "$BASE"/model.safetensors "$T/nan_row/"
emb=$(tensor_offset "$T/nan_row/model.safetensors" model.embed_tokens.weight)
poke "$T/nan_row/model.safetensors" $((emb + 300 * 64 * 4)) "${NAN[@]}"
# token 300 in the inputs of steps 4, 7 and 8 (batch 2 x seq 32: step k reads
# tokens [64(k-1), 64k]); uint16 300 = 0x012c
cp "$T/data.bin" "$T/poisoned.bin"
for k in 4 7 8; do poke "$T/poisoned.bin" $((1024 + 2 * (64 * (k - 1) + 10))) 0x2c 0x01; done
# and in steps 1 and 2 (every step of a 2-step run)
cp "$T/data.bin" "$T/poisoned12.bin"
for k in 1 2; do poke "$T/poisoned12.bin" $((1024 + 2 * (64 * (k - 1) + 10))) 0x2c 0x01; done

COMMON=(--data "$T/poisoned.bin" --batch 2 --seq 32 --warmup 0)

echo "== every step non-finite: the run stops after --max-bad-steps"
"$BIN" train --model "$T/nan_norm" "${COMMON[@]}" --steps 20 --max-bad-steps 3 --out "$T/stopped" \
  >"$T/out" 2>"$T/err"; rc=$?
skips=$(grep -c 'non-finite .*step skipped' "$T/err")
errs=$(grep -c 'error:' "$T/err")
[ $rc -ne 0 ] && ok "non-zero exit ($rc)" || fail "exit status 0"
[ "$skips" -eq 3 ] && ok "3 skipped steps reported: $(grep -m1 'skipped' "$T/err")" || fail "$skips skip messages (want 3)"
if [ "$errs" -eq 1 ] && grep -q 'error: 3 consecutive non-finite steps; stopping' "$T/err"; then
  ok "one clear error line: $(grep 'error:' "$T/err")"
else fail "error line missing or repeated:"; sed 's/^/      /' "$T/err" | tail -3; fi
grep -q 'step 4' "$T/err" && fail "a 4th step ran after the stop" || ok "no step after the stop"
[ -e "$T/stopped" ] && fail "the stopped run left an --out directory" || ok "the stopped run leaves no --out directory"

echo "== a skipped step changes nothing"
"$BIN" train --model "$T/nan_row" --data "$T/poisoned12.bin" --batch 2 --seq 32 --warmup 0 --steps 2 --max-bad-steps 5 \
  --out "$T/skipped" --freeze embed_tokens \
  >"$T/out" 2>"$T/err"; rc=$?
[ $rc -eq 0 ] && ok "2 non-finite steps under --max-bad-steps 5: the run completes" || fail "exit $rc: $(tail -1 "$T/err")"
if cmp -s "$T/nan_row/model.safetensors" "$T/skipped/step_00000002/model.safetensors"; then
  ok "weights after two skipped steps are byte-identical to the start (no update, no weight decay)"
else fail "skipped steps changed the weights"; fi
st="$T/skipped/step_00000002/state.bin"
if [ -f "$st" ] && [ "$(tail -c +65 "$st" | tr -d '\000' | wc -c)" -eq 0 ]; then
  ok "Adam moments after two skipped steps are all zero"
else fail "skipped steps changed the Adam moments"; fi

echo "== isolated non-finite steps are skipped and the run goes on"
"$BIN" train --model "$T/nan_row" "${COMMON[@]}" --steps 12 --max-bad-steps 3 --log "$T/iso.log" \
  >"$T/out" 2>"$T/err"; rc=$?
[ $rc -eq 0 ] && ok "completes (exit 0)" || fail "exit $rc: $(tail -1 "$T/err")"
got=$(grep -o 'step [0-9]*: non-finite [a-z ]*([^)]*); step skipped ([0-9]* in a row)' "$T/err" | tr '\n' ';')
want="step 4: non-finite loss (nan); step skipped (1 in a row);step 7: non-finite loss (nan); step skipped (1 in a row);step 8: non-finite loss (nan); step skipped (2 in a row);"
[ "$got" = "$want" ] && ok "steps 4, 7, 8 skipped, each said so" || fail "skip messages: '$got'"
logged=$(sed -n 's/^{"step":\([0-9]*\),.*"skipped":1.*/\1/p' "$T/iso.log" | tr '\n' ' ')
[ "$logged" = "4 7 8 " ] && ok "--log marks steps 4 7 8 \"skipped\":1" || fail "--log skipped steps: '$logged'"

echo "== resume after skipped steps is exact"
# Constant learning rate (min-lr = lr, no warmup) so that a 6-step run and a
# 12-step run share their first 6 steps. The checkpoint at step 6 follows one
# skipped step: 6 training steps but 5 optimizer steps (Adam's bias
# correction counts the latter).
CONST=(--lr 1e-3 --min-lr 1e-3 --freeze embed_tokens)
"$BIN" train --model "$T/nan_row" "${COMMON[@]}" "${CONST[@]}" --steps 12 --log "$T/full.log" --quiet 2>/dev/null ||
  fail "uninterrupted run failed"
"$BIN" train --model "$T/nan_row" "${COMMON[@]}" "${CONST[@]}" --steps 6 --out "$T/res" --quiet 2>/dev/null ||
  fail "first half failed"
"$BIN" train --model "$T/nan_row" "${COMMON[@]}" "${CONST[@]}" --steps 12 --out "$T/res" --resume --log "$T/res.log" \
  --quiet 2>/dev/null || fail "resumed half failed"
losses() { sed -n 's/^{"step":\([0-9]*\),"loss":\([^,]*\),.*/\1 \2/p' "$1"; }
diff=$(join <(losses "$T/full.log" | sort) <(losses "$T/res.log" | sort) | awk '$2 != $3 { printf "step %d: %s vs %s; ", $1, $3, $2 }')
nres=$(losses "$T/res.log" | wc -l)
if [ "$nres" -eq 6 ] && [ -z "$diff" ]; then ok "steps 7-12 after resuming at step 6 have the uninterrupted run's losses"
else fail "resumed losses differ ($nres steps logged): $diff"; fi

echo "$n cases, $fails failed"
[ $fails -eq 0 ]
