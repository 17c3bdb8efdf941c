# lib_cli.sh — what the tests/cli_*.sh scripts share; sourced, not run:
#   . "$(dirname "$0")/lib_cli.sh" NAME "$@"   (then BIN, T, ok, fail, expect_error)
# BIN: the binary under test ($1 of the script, default ./centrifuge); T: a
# temp directory removed at exit (with the job in $bg, if any); CLI_TIMEOUT:
# the seconds after which a command counts as hung (default 120).
set -u
BIN=$(realpath "${2:-./centrifuge}")
T=$(mktemp -d "/tmp/cf_$1_XXXXXX")
bg=
trap 'kill $bg 2>/dev/null; rm -rf "$T"' EXIT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
fails=0; n=0
ok() { n=$((n + 1)); echo "  ok   $*"; }
fail() { n=$((n + 1)); fails=$((fails + 1)); echo "  FAIL $*"; }

# expect_error NAME PATTERN -- ARGS...: non-zero exit within CLI_TIMEOUT s,
# exactly one stderr line, "error: ...PATTERN"
expect_error() {
  local name=$1 pat=$2; shift 3
  timeout "${CLI_TIMEOUT:-120}" "$BIN" "$@" >"$T/out" 2>"$T/err"; local rc=$?
  local lines; lines=$(wc -l <"$T/err")
  if [ $rc -eq 124 ]; then fail "$name: hung (killed after ${CLI_TIMEOUT:-120} s)"
  elif [ $rc -eq 0 ] || [ "$lines" -ne 1 ] || ! grep -q "error: .*$pat" "$T/err"; then
    fail "$name (rc=$rc, $lines stderr lines):"; sed 's/^/      /' "$T/err" | head -5
  else ok "$name: $(cat "$T/err")"; fi
}

# the script's last lines: the count, and its exit status
cli_summary() {
  echo "$n cases, $fails failed"
  [ $fails -eq 0 ]
}
