#!/usr/bin/env bash
# Installs the Debian packages Centrifuge builds against, if missing.
# Usage: tools/install_deps.sh [--with-fuzz]
set -euo pipefail
need=()
[ -f /usr/include/cjson/cJSON.h ] || need+=(libcjson-dev)
# the tokenizer: PCRE2 for the split regexes, utf8proc for Unicode normalization
[ -f /usr/include/pcre2.h ] || need+=(libpcre2-dev)
[ -f /usr/include/utf8proc.h ] || need+=(libutf8proc-dev)
# OpenBLAS in its OpenMP build (see the Makefile)
ls /usr/lib/*-linux-gnu/openblas-openmp/libopenblas.so >/dev/null 2>&1 || need+=(libopenblas-openmp-dev)
command -v gcc >/dev/null || need+=(gcc)
command -v make >/dev/null || need+=(make)
command -v pkg-config >/dev/null || need+=(pkg-config)   # make test-example
if [ "${1:-}" = "--with-fuzz" ]; then
  command -v clang >/dev/null || need+=(clang)
  dpkg -s libclang-rt-14-dev >/dev/null 2>&1 || need+=(libclang-rt-14-dev)
fi
[ ${#need[@]} -eq 0 ] && exit 0
echo "install_deps: installing ${need[*]}" >&2
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq "${need[@]}" >/dev/null
