#!/usr/bin/env bash
# cli_readme.sh — runs README.md's "Using it" examples as written, at small
# sizes. Every ```sh block right after a `<!-- readme-test: NAME -->` line is
# taken from the README itself, its sizes shrunk (--steps N -> N/200, at
# least 2; --seq -> 32; --batch -> 2; --tokens -> 20k; cpu-20m -> tiny, ...),
# and run with bash -e in an empty directory holding ./centrifuge and tools/.
# The one download (huggingface-cli) is replaced by a function that writes
# a tiny HF-format model directory with a real tokenizer.json (the tiny
# config trained one step, then `centrifuge convert`). Text inputs are
# generated. A command that fails, or a file the README promises that is not
# there, fails the test.
# Usage: tests/cli_readme.sh ./centrifuge
set -u
BIN=$(realpath "${1:-./centrifuge}")
ROOT=$(cd "$(dirname "$0")/.." && pwd)
README="$ROOT/README.md"
TOK="$ROOT/tests/data/tokenizer/bytelevel.json"
T=$(mktemp -d /tmp/cf_readme_XXXXXX)
trap '[ -n "${KEEP:-}" ] || rm -rf "$T"' EXIT
fails=0

# extract NAME: the first ```sh block after the marker line
extract() {
  awk -v name="$1" '
    $0 ~ "<!-- readme-test: " name " -->" { armed = 1; next }
    armed && /^```sh/ { inblock = 1; next }
    inblock && /^```/ { exit }
    inblock { print }
  ' "$README"
}

shrink() {
  perl -pe '
    s/--steps (\d+)/"--steps " . (int($1 \/ 200) < 2 ? 2 : int($1 \/ 200))/ge;
    s/--save-every \d+/--save-every 2/g;
    s/--seq \d+/--seq 32/g;
    s/--batch \d+/--batch 2/g;
    s/--grad-accum \d+/--grad-accum 2/g;
    s/--tokens \S+/--tokens 20k/g;
    s/--problems \d+/--problems 4/g;
    s/--max-new \d+/--max-new 5/g;
    s/cpu-20m/tiny/g;
  '
}

run_block() {
  local name=$1 dir="$T/$1"
  mkdir -p "$dir"
  ln -s "$BIN" "$dir/centrifuge"
  ln -s "$ROOT/tools" "$dir/tools"
  extract "$name" | shrink >"$dir/block.sh"
  if [ ! -s "$dir/block.sh" ]; then
    echo "  FAIL $name: no block marked <!-- readme-test: $name --> in README.md"; fails=$((fails+1)); return
  fi
  if ! python3 -c 'import matplotlib' 2>/dev/null; then
    sed -i '/tools\/plot_log.py/d' "$dir/block.sh"
    echo "  (matplotlib not installed: the plot_log.py line is skipped)"
  fi
  # the prelude: the stand-in for the download, and the text inputs
  cat >"$dir/prelude.sh" <<EOF
set -eo pipefail
huggingface-cli() {
  local out=""
  while [ \$# -gt 0 ]; do [ "\$1" = --local-dir ] && out=\$2; shift; done
  ./centrifuge train --config tiny --vocab-size 330 --tokenizer "$TOK" --steps 1 --batch 2 --seq 32 \\
      --out standin_run --quiet
  ./centrifuge convert --model standin_run --out "\$out" --dtype bfloat16 >/dev/null
}
python3 - <<'PY'
import json, random
random.seed(1)
words = "the a model trains on tokens with filtering and keeps what matters most for clean text".split()
def doc(i): return " ".join(random.choice(words) for _ in range(12 + i % 9)) + "."
for name, n in (("web.jsonl", 300), ("clean.jsonl", 120), ("val.jsonl", 40)):
    with open(name, "w") as f:
        for i in range(n): f.write(json.dumps({"text": doc(i)}) + "\n")
PY
EOF
  local t0=$SECONDS
  if (cd "$dir" && { cat prelude.sh; echo "PS4='+ [\${SECONDS}s] '; set -x"; cat block.sh; } >script.sh &&
      bash script.sh) >"$dir/log" 2>&1; then
    echo "  ok   README block '$name' ($((SECONDS - t0)) s, $(grep -c . "$dir/block.sh") lines)"
  else
    echo "  FAIL README block '$name':"; tail -15 "$dir/log" | sed 's/^/      /'
    fails=$((fails+1))
  fi
}

expect_file() { # NAME PATH...: files the README says the commands write
  local name=$1; shift
  for f in "$@"; do
    if ! ls "$T/$name/"$f >/dev/null 2>&1; then echo "  FAIL $name: no $f"; fails=$((fails+1)); fi
  done
}

echo "== README example 1: fine-tune a Hugging Face model"
run_block hf
expect_file hf models/tinyllama/tokenizer.json 'data/web_000000.bin' 'data/web_000000.ref.bin' runs/cf/latest \
  'runs/cf/step_*/tokenizer.json' runs/cf.jsonl export/tinyllama-cf/model.safetensors export/tinyllama-cf/tokenizer.json
grep -q '"val_loss"' "$T/hf/runs/cf.jsonl" 2>/dev/null || { echo "  FAIL hf: no validation loss in runs/cf.jsonl"; fails=$((fails+1)); }
grep -q 'mode centrifuge' "$T/hf/log" || { echo "  FAIL hf: train did not say it trains in centrifuge mode"; fails=$((fails+1)); }

echo "== README example 2: the synthetic math world"
run_block synthetic
expect_file synthetic data/math_noisy.ref.bin runs/math_cf/latest runs/math_cf.jsonl

[ $fails -eq 0 ] && echo "README examples ran as written" || echo "$fails README check(s) failed"
exit $((fails > 0))
