#!/usr/bin/env bash
# gpu_carry.sh — fills .gpucarry/ (git-ignored) with what one call on the GPU
# machine needs: the CUDA binaries built here, the GPU test programs, and the
# non-CUDA runtime libraries they link (OpenBLAS, cJSON, PCRE2, utf8proc),
# copied from this machine. tools/gpu_session.sh runs there from it.
#   tools/gpu_carry.sh [OLD_BINARY]     (after make cuda + GPU tests)
# OLD_BINARY: a centrifuge-cuda of an earlier commit, carried as
# centrifuge-cuda-old for A/B timing (gpu_session.sh bench-old). A copy of an
# earlier bench_attention put at build/cuda/tests/bench_attention_old travels
# with the tests (gpu_session.sh attn-ab), and so does a trace build's put at
# build/cuda/tests/bench_attention_trace (gpu_session.sh attn-trace).
set -euo pipefail
cd "$(dirname "$0")/.."
G=.gpucarry
# the binaries must stamp HEAD: their bench and train records name the commit they were built at
# (Makefile: COMMIT_STAMP), and a build made before the last commit would name the one before it
c=$(git rev-parse --short HEAD)
for b in centrifuge centrifuge-cuda; do
  grep -aq "$c" "$b" || { echo "gpu_carry: $b was built before HEAD ($c): run make and make cuda first" >&2; exit 1; }
done
rm -rf "$G"; mkdir -p "$G/lib"
cp centrifuge centrifuge-cuda "$G/"
for t in build/cuda/tests/*; do [ -x "$t" ] && [ -f "$t" ] && cp "$t" "$G/"; done
[ $# -ge 1 ] && cp "$1" "$G/centrifuge-cuda-old"
for lib in $(ldd centrifuge-cuda "$G"/test_gpu_* 2>/dev/null | awk '/=>/ {print $3}' | sort -u); do
  case "$lib" in
    */libopenblas*|*/libgfortran*|*/libquadmath*|*/libcjson*|*/libpcre2*|*/libutf8proc*) cp -L "$lib" "$G/lib/" ;;
  esac
done
git rev-parse HEAD > "$G/commit.txt"
git status --porcelain | grep -q . && echo "(uncommitted changes)" >> "$G/commit.txt" || true
# one compressed archive: the working tree that travels is limited to 64 MiB
(cd "$G" && strip --strip-debug centrifuge-cuda* bench_attention* test_gpu_* 2>/dev/null || true; tar cf - . | xz -9 -T2 > ../carry.tar.xz && rm -rf ./* && mv ../carry.tar.xz .)
du -sh "$G"
