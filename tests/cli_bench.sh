#!/usr/bin/env bash
# cli_bench.sh — `centrifuge bench` on the CPU (issue 17): a step of
# --grad-accum micro-batches of --batch sequences, the JSON fields of the
# realistic-batch benchmark (grad_accum, tokens_per_step, flops_per_token,
# model_tflops, peak_tflops, mfu_kind), MFU only with --peak-tflops on the
# CPU, and one clear error line for a bad value.
# Usage: tests/cli_bench.sh ./centrifuge
. "$(dirname "$0")/lib_cli.sh" bench "$@"

# tiny @64, 2 micro-batches of 2 sequences: 256 tokens per step, the
# centrifuge step keeps half; tiny's FLOPs per token at 64 are 5,167,872
# (tests/test_flops.c)
if timeout 300 "$BIN" bench --config tiny --seq 64 --steps 2 --warmup 1 --grad-accum 2 --batch 2 \
     --modes regular,centrifuge --json "$T/b.jsonl" >"$T/out" 2>"$T/err"; then
  ok "bench --grad-accum 2 --batch 2 runs"
else fail "bench --grad-accum 2 --batch 2: $(tail -1 "$T/err")"; fi
rows=$(wc -l <"$T/b.jsonl" 2>/dev/null || echo 0)
[ "$rows" -eq 2 ] && ok "two JSON rows" || fail "JSON rows: $rows"
missing=
for f in '"grad_accum":2,' '"tokens_per_step":256,' '"flops_per_token":5.16787e+06,' '"model_tflops":[0-9.]*,' \
         '"peak_tflops":0.0,' '"mfu":0.0000,' '"batch":2,' '"tokens_per_s":[0-9.]*,' '"step_s":[0-9.]*,'; do
  [ "$(grep -c "$f" "$T/b.jsonl")" -eq 2 ] || missing="$missing $f"
done
[ -z "$missing" ] && ok "new fields in every row (grad_accum, tokens_per_step, flops_per_token, model_tflops, peak_tflops)" ||
  fail "JSON lacks:$missing"
grep -q '"mode":"regular","kept":256,.*"mfu_kind":"dense"}' "$T/b.jsonl" &&
  grep -q '"mode":"centrifuge","kept":128,.*"mfu_kind":"dense-equivalent"}' "$T/b.jsonl" &&
  ok "kept counts the whole step (256 / 128), mfu_kind dense / dense-equivalent" ||
  fail "kept or mfu_kind: $(cut -c1-200 "$T/b.jsonl")"
grep -q "grad-accum 2" "$T/out" && ! grep -q "MFU" "$T/out" && ok "table: grad-accum named, no MFU on the CPU by default" ||
  fail "table: $(cat "$T/out")"

# --peak-tflops on the CPU: MFU in the table for every mode, in the JSON too
if timeout 300 "$BIN" bench --config tiny --seq 64 --steps 1 --warmup 0 --modes regular,centrifuge \
     --peak-tflops 0.5 --json "$T/p.jsonl" >"$T/out" 2>"$T/err" &&
   [ "$(grep -c ' MFU [0-9.]*%' "$T/out")" -eq 2 ] && grep -q "dense-equivalent" "$T/out" &&
   [ "$(grep -c '"peak_tflops":0.5,' "$T/p.jsonl")" -eq 2 ] && ! grep -q '"mfu":0.0000,' "$T/p.jsonl"; then
  ok "--peak-tflops 0.5: MFU for every mode, dense-equivalent named"
else fail "--peak-tflops: $(cat "$T/out" "$T/err" | tail -5)"; fi

expect_error "--grad-accum 0" "grad-accum" -- bench --config tiny --seq 64 --steps 1 --grad-accum 0
expect_error "--grad-accum not a number" "grad-accum" -- bench --config tiny --seq 64 --steps 1 --grad-accum two
expect_error "--batch 0" "batch" -- bench --config tiny --seq 64 --steps 1 --batch 0
expect_error "--peak-tflops negative" "peak-tflops" -- bench --config tiny --seq 64 --steps 1 --peak-tflops -1

# the PyTorch baseline, where torch and transformers are installed: the same
# options, fields and FLOPs per token on the same shape (CPU smoke run)
PT=$(dirname "$0")/../tools/bench_pytorch.py
if python3 -c 'import torch, transformers' 2>/dev/null; then
  if timeout 300 python3 "$PT" --device cpu --config tiny --seq 64 --steps 1 --warmup 0 --grad-accum 2 --batch 2 \
       --json "$T/pt.jsonl" >"$T/out" 2>"$T/err" &&
     [ "$(grep -c '"grad_accum": 2, "tokens_per_step": 256, "flops_per_token": 5167872.0,' "$T/pt.jsonl")" -eq 2 ] &&
     grep -q '"mode": "regular", "kept": 256,' "$T/pt.jsonl" && grep -q '"mode": "loss-only", "kept": 128,' "$T/pt.jsonl"
  then ok "bench_pytorch.py --grad-accum 2 --batch 2: same tokens per step and FLOPs per token"
  else fail "bench_pytorch.py: $(tail -3 "$T/err") $(head -c 600 "$T/pt.jsonl" 2>/dev/null)"; fi
  python3 "$PT" --device cpu --config tiny --grad-accum 0 >/dev/null 2>"$T/err"; rc=$?
  [ $rc -ne 0 ] && grep -q "error: --grad-accum must be >= 1" "$T/err" && ok "bench_pytorch.py --grad-accum 0: rc $rc" ||
    fail "bench_pytorch.py --grad-accum 0: rc $rc, $(tail -1 "$T/err")"
else echo "  (torch or transformers not installed: bench_pytorch.py not run)"; fi

cli_summary
