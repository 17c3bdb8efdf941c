#!/usr/bin/env bash
# cli_files.sh — issue 12, "nothing lost, nothing overwritten, no hang": the
# files around a run (docs/ROBUSTNESS.md §6).
#   - an output that is also an input (by any name) fails before any work
#     and leaves the input as it was;
#   - special files: an input that is a FIFO, socket or directory fails at
#     once (no hang in open()); an output that is a symbolic link, FIFO,
#     device or directory is refused and left alone;
#   - a full disk: the log, or an output, that cannot be written fails the
#     run with one line, and never deletes or truncates an existing target;
#   - silent acceptance: a NUL inside a JSON string is refused; no "nan" or
#     "inf" is ever written into JSON.
# Each case: non-zero exit, exactly one "error:" line on stderr naming the
# problem, the files involved unchanged. Usage: tests/cli_files.sh ./centrifuge
CLI_TIMEOUT=60
. "$(dirname "$0")/lib_cli.sh" files "$@"
same() { cmp -s "$1" "$2" && ok "$3" || fail "$3"; }

"$BIN" gen-data --source clean --tokens 20000 --seed 3 --out "$T/d.bin" >/dev/null || { echo "gen-data failed"; exit 1; }
cp "$T/d.bin" "$T/d.orig"
"$BIN" train --config tiny --data "$T/d.bin" --steps 1 --batch 2 --seq 32 --out "$T/run" --quiet ||
  { echo "train failed"; exit 1; }
M="$T/run/step_00000001"
TRAIN=(train --config tiny --batch 2 --seq 32 --quiet)

echo "== an output that is also an input"
expect_error "train --log = --data" "d.bin: is also an input" -- "${TRAIN[@]}" --data "$T/d.bin" --log "$T/d.bin"
same "$T/d.bin" "$T/d.orig" "the data is untouched"
ln "$T/d.bin" "$T/hardlink.bin"
expect_error "train --log = a hard link of --data" "same file as the input" -- "${TRAIN[@]}" --data "$T/d.bin" --log "$T/hardlink.bin"
cp "$T/d.bin" "$T/d2.bin"
expect_error "train --log = a shard of a --data glob" "d2.bin: is also an input" -- "${TRAIN[@]}" --data "$T/d*.bin" --log "$T/d2.bin"
ln -s d.bin "$T/symlink.bin"
expect_error "train --log = a symlink to --data" "symbolic link" -- "${TRAIN[@]}" --data "$T/d.bin" --log "$T/symlink.bin"
expect_error "train --log = --val" "also an input" -- "${TRAIN[@]}" --data "$T/d.bin" --val "$T/d.orig" --log "$T/d.orig"
expect_error "score --out = --data" "also an input" -- score --model "$M" --data "$T/d.bin" --out "$T/d.bin" --seq 32
expect_error "math-eval --json = a symlink" "symbolic link" -- math-eval --model "$M" --problems 4 --json "$T/symlink.bin"
same "$T/d.bin" "$T/d.orig" "the data is untouched after score"
expect_error "eval --losses-out = --data" "also an input" -- eval --model "$M" --data "$T/d.bin" --losses-out "$T/d.bin"
expect_error "eval --losses-out = the model" "also an input" -- eval --model "$M" --data "$T/d.bin" --losses-out "$M/model.safetensors"
# an in-place convert is allowed, and leaves a model that loads
cp -r "$M" "$T/conv"
if "$BIN" convert --model "$T/conv" --out "$T/conv" --dtype bfloat16 >/dev/null 2>&1 &&
   "$BIN" convert --model "$T/conv" --out "$T/conv" --dtype bfloat16 --max-shard-mb 1 >/dev/null 2>&1 &&
   "$BIN" convert --model "$T/conv" --out "$T/conv" --dtype float32 --max-shard-mb 1 >/dev/null 2>&1 &&
   "$BIN" eval --model "$T/conv" --data "$T/d.bin" --seq 16 --batch 1 --max-batches 1 >/dev/null 2>&1; then
  ok "convert --model D --out D (single, sharded, re-sharded in place) leaves a model that loads"
else fail "in-place convert: $(tail -1 "$T/err")"; fi
# the summary line says whether shards were written: a model under one shard is one file, no index
"$BIN" convert --model "$M" --out "$T/conv1" --dtype float32 --max-shard-mb 1024 >"$T/out" 2>&1
if grep -q "one file: the model fits in one shard" "$T/out" && [ ! -e "$T/conv1/model.safetensors.index.json" ]; then
  ok "convert --max-shard-mb larger than the model says one file was written"
else fail "convert --max-shard-mb 1024: $(cat "$T/out")"; fi

echo "== special files"
mkfifo "$T/fifo.bin"
expect_error "--data is a FIFO (no hang)" "fifo.bin: is a FIFO, not a regular file" -- "${TRAIN[@]}" --data "$T/fifo.bin"
expect_error "--ref is a FIFO" "FIFO" -- "${TRAIN[@]}" --data "$T/d.bin" --ref "$T/fifo.bin" --mode centrifuge
mkdir -p "$T/fifomodel" && mkfifo "$T/fifomodel/config.json"
expect_error "config.json is a FIFO" "config.json: is a FIFO" -- eval --model "$T/fifomodel" --data "$T/d.bin"
mkdir -p "$T/fifomodel2" && cp "$M/config.json" "$T/fifomodel2/" && mkfifo "$T/fifomodel2/model.safetensors"
expect_error "model.safetensors is a FIFO" "model.safetensors: is a FIFO" -- eval --model "$T/fifomodel2" --data "$T/d.bin"
mkdir -p "$T/adir"
expect_error "--data is a directory" "is a directory" -- "${TRAIN[@]}" --data "$T/adir"
expect_error "--log is a FIFO" "fifo.bin: is a FIFO; refusing to replace it" -- "${TRAIN[@]}" --data "$T/d.bin" --log "$T/fifo.bin"
[ -p "$T/fifo.bin" ] && ok "the FIFO is still a FIFO" || fail "the FIFO was replaced"
expect_error "--log is a directory" "adir: is a directory" -- "${TRAIN[@]}" --data "$T/d.bin" --log "$T/adir"
echo precious >"$T/victim.txt"; ln -s victim.txt "$T/link.ref.bin"
expect_error "score --out is a symbolic link" "symbolic link" -- score --model "$M" --data "$T/d.bin" --out "$T/link.ref.bin" --seq 32
[ "$(cat "$T/victim.txt")" = precious ] && [ -L "$T/link.ref.bin" ] && ok "the link and its target are untouched" ||
  fail "the link or its target changed"
if [ "$(id -u)" -eq 0 ] && mknod "$T/null" c 1 3 2>/dev/null; then
  expect_error "--losses-out is a device node" "character device" -- eval --model "$M" --data "$T/d.bin" --losses-out "$T/null"
  [ -c "$T/null" ] && ok "the device node is still a device node" || fail "the device node was replaced"
fi

echo "== a full disk (ulimit -f: writes past 8 KiB fail with EFBIG)"
limited() { (trap '' XFSZ; ulimit -f 8; exec "$BIN" "$@"); }
limited "${TRAIN[@]}" --data "$T/d.bin" --steps 200 --log "$T/full.jsonl" >"$T/out" 2>"$T/err"; rc=$?
if [ $rc -ne 0 ] && [ "$(grep -c 'error:' "$T/err")" -eq 1 ] && grep -q 'error: .*full.jsonl: write failed' "$T/err"; then
  ok "a log the disk cannot take fails the run: $(grep error: "$T/err")"
else fail "full log: rc=$rc: $(tail -2 "$T/err" | tr '\n' ' ')"; fi
echo "old ref shard" >"$T/old.ref.bin"; cp "$T/old.ref.bin" "$T/old.ref.orig"
limited score --model "$M" --data "$T/d.bin" --out "$T/old.ref.bin" --seq 32 >"$T/out" 2>"$T/err"; rc=$?
if [ $rc -ne 0 ] && grep -q 'error: .*old.ref.bin' "$T/err"; then ok "an output the disk cannot take fails: $(grep error: "$T/err")"
else fail "full output: rc=$rc: $(tail -1 "$T/err")"; fi
same "$T/old.ref.bin" "$T/old.ref.orig" "the existing target is untouched"
left=$(find "$T" -name '*.tmp.*' | wc -l)
[ "$left" -eq 0 ] && ok "no temp files left" || fail "$left temp files left"
limited "${TRAIN[@]}" --data "$T/d.bin" --out "$T/fullrun" >"$T/out" 2>"$T/err"; rc=$?
if [ $rc -ne 0 ] && grep -q 'error: .*write failed' "$T/err" && [ ! -e "$T/fullrun" ]; then
  ok "a checkpoint the disk cannot take fails the run, and leaves no --out"
else fail "full checkpoint: rc=$rc, $(ls "$T/fullrun" 2>&1 | tr '\n' ' '): $(tail -1 "$T/err")"; fi

echo "== tokenize: a failed run loses nothing and leaves nothing"
TK="$(dirname "$0")/data/tokenizer/bytelevel.json"
for i in 1 2 3 4 5 6; do echo "doc $i hello world"; done >"$T/docs.txt"
(for i in 1 2 3 4 5 6 7 8; do echo "{\"text\": \"doc $i hello world more\"}"; done; echo '{"text": 5}') >"$T/late_bad.jsonl"
"$BIN" tokenize --tokenizer "$TK" --input "$T/docs.txt" --text-split line --shard-tokens 10 --out "$T/tok/web" --quiet ||
  fail "tokenize of good text failed"
(cd "$T/tok" && md5sum * >"$T/tok.md5")
# the failing line comes after shards of the new run were written over the old names
expect_error "tokenize --overwrite with a bad line" "late_bad.jsonl:9" -- tokenize --tokenizer "$TK" \
  --input "$T/late_bad.jsonl" --shard-tokens 10 --out "$T/tok/web" --overwrite --quiet
(cd "$T/tok" && md5sum --quiet -c "$T/tok.md5" >/dev/null 2>&1) && [ "$(ls "$T/tok" | wc -l)" -eq "$(wc -l <"$T/tok.md5")" ] &&
  ok "the earlier run's shards and manifest are back, unchanged, and nothing else is there" ||
  fail "tokenize --overwrite that failed changed the earlier shards: $(ls "$T/tok" | tr '\n' ' ')"
expect_error "tokenize into new directories with a bad line" "late_bad.jsonl:9" -- tokenize --tokenizer "$TK" \
  --input "$T/late_bad.jsonl" --out "$T/newtok/a/web" --quiet
[ ! -e "$T/newtok" ] && ok "the directories a failed tokenize created are gone" || fail "a failed tokenize left $T/newtok"

echo "== silent acceptance"
mkdir -p "$T/nulcfg" && cp "$M/model.safetensors" "$T/nulcfg/"
sed 's/"model_type": *"llama"/"model_type": "llama\\u0000gpt2"/' "$M/config.json" >"$T/nulcfg/config.json"
expect_error "config.json model_type with \\u0000" "NUL" -- eval --model "$T/nulcfg" --data "$T/d.bin"
# a tensor name with \u0000 in the safetensors header (same length: the
# header stays valid JSON of the same size)
mkdir -p "$T/nulst" && cp "$M/config.json" "$T/nulst/"
LC_ALL=C sed 's/"model.norm.weight"/"model.no\\u0000ght"/' "$M/model.safetensors" >"$T/nulst/model.safetensors"
expect_error "tensor name with \\u0000" "NUL" -- eval --model "$T/nulst" --data "$T/d.bin"
# non-finite values in the log are null, never nan/inf: a NaN in the final
# norm makes every loss NaN
mkdir -p "$T/nan" && cp "$M/config.json" "$M/model.safetensors" "$T/nan/"
hlen=$(od -An -t u8 -N 8 "$T/nan/model.safetensors" | tr -d ' ')
begin=$(head -c $((8 + hlen)) "$T/nan/model.safetensors" | tail -c +9 | grep -o '"model.norm.weight":{[^}]*}' |
        sed 's/.*"data_offsets":\[\([0-9]*\),.*/\1/')
printf '\x00\x00\xc0\x7f' | dd of="$T/nan/model.safetensors" bs=1 seek=$((8 + hlen + begin)) conv=notrunc status=none
"$BIN" train --model "$T/nan" --data "$T/d.bin" --batch 2 --seq 32 --steps 2 --max-bad-steps 5 --log "$T/nan.jsonl" \
  --quiet >/dev/null 2>&1
if grep -q '"loss":null' "$T/nan.jsonl" && ! grep -qiE 'nan|inf' "$T/nan.jsonl"; then
  ok "non-finite values are logged as null: $(head -c 60 "$T/nan.jsonl")..."
else fail "log of non-finite steps: $(head -1 "$T/nan.jsonl")"; fi

cli_summary
