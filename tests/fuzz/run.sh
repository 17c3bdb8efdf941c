#!/usr/bin/env bash
# run.sh — runs each libFuzzer target for a set time and reports executions
# and findings. Called by `make fuzz` / `make fuzz-smoke` (robust.mk).
# Usage: tests/fuzz/run.sh SECONDS_PER_TARGET BUILD_DIR TARGET...
#
# Each target starts from its seed corpus (tests/fuzz/corpus/<target>, read
# only) plus a working corpus in BUILD_DIR/corpus/<target> that keeps what
# earlier runs found. A finding (crash, hang > FUZZ_TIMEOUT s, leak, broken
# invariant) is written to BUILD_DIR/artifacts/<target>/ and fails the run;
# keep it as a regression input in tests/fuzz/regressions/ once fixed.
set -u
secs=$1; dir=$2; shift 2
root=$(cd "$(dirname "$0")/../.." && pwd)
timeout_s=${FUZZ_TIMEOUT:-10}
summary="$dir/summary.txt"
: >"$summary"
total=0; failed=0
for t in "$@"; do
  bin="$dir/$t"; name=${t#fuzz_}
  work="$dir/corpus/$name"; art="$dir/artifacts/$name"; log="$dir/$name.log"
  mkdir -p "$work" "$art"
  dict=()
  [ -f "$root/tests/fuzz/$name.dict" ] && dict=(-dict="$root/tests/fuzz/$name.dict")
  before=$(ls "$art" | wc -l)
  "$bin" -max_total_time="$secs" -timeout="$timeout_s" -rss_limit_mb=2048 -max_len=65536 \
    -print_final_stats=1 -artifact_prefix="$art/" "${dict[@]}" "$work" "$root/tests/fuzz/corpus/$name" \
    >"$log" 2>&1
  rc=$?
  after=$(ls "$art" | wc -l)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
  execs=${execs:-0}; total=$((total + execs))
  if [ $rc -ne 0 ] || [ "$after" -gt "$before" ]; then
    failed=$((failed + 1))
    line="$name: FINDING (exit $rc) after $execs executions; see $log and $art/"
    grep -m3 -E 'ERROR|SUMMARY|fuzz_[a-z]+: ' "$log" | sed 's/^/    /'
  else
    line="$name: $execs executions in ${secs}s (${rate:-?}/s), coverage ${cov:-?}, corpus $(ls "$work" | wc -l) files, no findings"
  fi
  echo "fuzz: $line"
  echo "$line" >>"$summary"
done
echo "fuzz: total $total executions, $failed target(s) with findings" | tee -a "$summary"
[ $failed -eq 0 ]
