#!/usr/bin/env bash
# cli_defaults.sh — a user's path (issue 13): safe defaults of train, several
# shards with their ref shards, shuffled and resumable reading, run
# directories as --model, vocabulary advice, tokenizer files that travel,
# progress and colour.
# Usage: tests/cli_defaults.sh ./centrifuge
set -u
BIN=$(realpath "${1:-./centrifuge}")
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TOK="$ROOT/tests/data/tokenizer/bytelevel.json"
T=$(mktemp -d /tmp/cf_defaults_XXXXXX)
trap 'rm -rf "$T"' EXIT
cd "$T"
fails=0; n=0
ok() { n=$((n+1)); echo "  ok   $1"; }
bad() { n=$((n+1)); fails=$((fails+1)); echo "  FAIL $1"; [ -f err ] && sed 's/^/      /' err | head -5; }
check() { local name=$1; shift; if "$@"; then ok "$name"; else bad "$name"; fi; }
S=(--batch 2 --seq 32)

"$BIN" gen-data --source noisy --tokens 20k --seed 1 --out data/web_000000.bin >/dev/null &&
"$BIN" gen-data --source noisy --tokens 20k --seed 2 --out data/web_000001.bin >/dev/null &&
"$BIN" gen-data --source clean --tokens 5k --seed 3 --out data/val_000000.bin >/dev/null || { echo "gen-data failed"; exit 1; }

echo "== defaults of train"
"$BIN" train --config tiny --data data/web_000000.bin --keep 0.5 --steps 2 "${S[@]}" >out 2>err
check "a filtering flag without --mode means centrifuge, and says so" grep -q "mode centrifuge, implied by --keep" err
check "without --out, train says nothing will be saved" grep -q "nothing will be saved" err
"$BIN" train --config tiny --data data/web_000000.bin --mode regular --keep 0.5 --steps 1 "${S[@]}" >out 2>err
check "next to --mode regular, a filtering flag gets a note" grep -q "note: --mode regular trains on every token; --keep has no effect" err
"$BIN" train --config tiny --data data/web_000000.bin --val 'data/val_*.bin' --steps 20 "${S[@]}" --log v.jsonl >out 2>err
check "--val evaluates every steps/10 steps without --eval-every" [ "$(grep -c val_loss v.jsonl)" = 10 ]
"$BIN" train --config tiny --data data/web_000000.bin --steps 10 --print-every 5 "${S[@]}" >out 2>err
check "--print-every 5 prints steps 1, 5 and 10" [ "$(grep -c '^step ' err)" = 3 ]

echo "== several shards, ref shards beside them, shuffled and resumable"
"$BIN" train --config tiny --data 'data/web_*.bin' --steps 3 "${S[@]}" --out runs/ref --quiet 2>err
check "a run directory" [ -f runs/ref/latest ]
"$BIN" score --model runs/ref --data 'data/web_*.bin' --seq 64 --quiet >out 2>err
check "score --data LIST writes X.ref.bin beside each X.bin (--model = run directory)" \
  test -f data/web_000000.ref.bin -a -f data/web_000001.ref.bin
A=(--config tiny --data 'data/web_*.bin' --ref auto --shuffle "${S[@]}" --warmup 0 --lr 1e-3 --min-lr 1e-3 --quiet)
"$BIN" train "${A[@]}" --steps 12 --out runs/a --log a.jsonl 2>err &&
"$BIN" train "${A[@]}" --steps 5 --out runs/b --log b.jsonl 2>>err &&
"$BIN" train "${A[@]}" --steps 12 --out runs/b --resume --log b.jsonl 2>>err
check "shuffled reading of two shards resumes exactly (same last loss)" \
  [ "$(tail -1 a.jsonl | cut -d, -f2)" = "$(tail -1 b.jsonl | cut -d, -f2)" ]
"$BIN" train "${A[@]}" --steps 4 --data-seed 99 --log c.jsonl 2>err
check "another --data-seed reads other rows" [ "$(sed -n 1p a.jsonl | cut -d, -f2)" != "$(sed -n 1p c.jsonl | cut -d, -f2)" ]
"$BIN" train --config tiny --data data/web_000000.bin data/web_000001.bin --steps 1 >out 2>err
check "an unquoted glob the shell expanded is recognised" grep -q "quote it" err

echo "== vocabulary"
python3 - <<'PY'
import struct
n = 3000
toks = [(i * 7919) % 1000 for i in range(n)]
open("big.bin", "wb").write(struct.pack("<256i", *([20240520, 1, n] + [0] * 253)) + struct.pack("<%dH" % n, *toks))
PY
"$BIN" train --config tiny --data big.bin --steps 1 "${S[@]}" >out 2>err
check "ids beyond the config's vocabulary: the error names the fix" grep -q "add --vocab-from-data (vocab_size 1000)" err
"$BIN" train --config tiny --data big.bin --vocab-from-data --steps 1 "${S[@]}" --out runs/v --quiet 2>err
check "--vocab-from-data sizes the config to the data" grep -q '"vocab_size": 1000' runs/v/step_00000001/config.json

echo "== tokenizer files travel; text in and out"
"$BIN" train --config tiny --vocab-size 330 --tokenizer "$TOK" --steps 2 "${S[@]}" --out runs/t --quiet 2>err
check "train --tokenizer copies tokenizer.json into the checkpoint" [ -f runs/t/step_00000002/tokenizer.json ]
"$BIN" convert --model runs/t --out export >out 2>err
check "convert copies it too (and takes a run directory)" [ -f export/tokenizer.json ]
"$BIN" generate --model export --prompt 'Hello world' --max-new 4 >gen.txt 2>err
check "generate with the model's tokenizer prints text starting with the prompt" grep -q '^Hello world' gen.txt
check "generate into a pipe writes no ANSI codes" bash -c "! grep -q $'\033' gen.txt"
"$BIN" generate --model export --prompt-ids 5,6,7 --max-new 3 --ids >gen.txt 2>err
check "generate --ids prints ids" grep -Eq '^[0-9]+(,[0-9]+)*$' gen.txt
# eos_token_id as a list (Llama 3): generation stops at any of its ids, not
# only the first (transformers does the same)
g1=$(cut -d, -f1 gen.txt)
cp -r export eoslist && sed -i "s/\"eos_token_id\": 1,/\"eos_token_id\": [1, $g1],/" eoslist/config.json
"$BIN" generate --model eoslist --prompt-ids 5,6,7 --max-new 3 --ids >gen2.txt 2>err
check "generate stops at a later id of an eos_token_id list ([1, $g1]: $(cat gen2.txt), not $(cat gen.txt))" \
  [ "$g1" != 1 -a "$(cat gen.txt)" != "$g1" -a "$(cat gen2.txt)" = "$g1" ]
# generation_config.json's eos ids, where it names any, are the ones
# (transformers' generate reads them there): an instruct model's end of turn
# is often named only in that file
cp -r export genconf && printf '{"bos_token_id": 0, "eos_token_id": [1, %s]}\n' "$g1" >genconf/generation_config.json
"$BIN" generate --model genconf --prompt-ids 5,6,7 --max-new 3 --ids >gen3.txt 2>err
check "generate stops at an eos id named only by generation_config.json ($(cat gen3.txt))" [ "$(cat gen3.txt)" = "$g1" ]
printf '{"eos_token_id": 1}\n' >genconf/generation_config.json
cp eoslist/config.json genconf/config.json
"$BIN" generate --model genconf --prompt-ids 5,6,7 --max-new 3 --ids >gen4.txt 2>err
check "generation_config.json's ids replace config.json's ([1] there, [1, $g1] in config.json: $(cat gen4.txt))" \
  [ "$(cat gen4.txt)" = "$(cat gen.txt)" ]

echo "== progress"
"$BIN" eval --model runs/ref --data 'data/web_*.bin' --seq 32 >out 2>err
check "eval takes shard lists and run directories" grep -q "eval: " out

[ $fails -eq 0 ] && echo "$n cases, 0 failed" || echo "$n cases, $fails failed"
exit $((fails > 0))
