#!/usr/bin/env bash
# sass_access.sh — the widths of the global loads and stores in the sm_90a SASS of CUDA
# sources, per file: how run 31 found that the element-wise kernels' "16-byte" vector
# accesses were four 4-byte ones (docs/BENCHMARKS.md, run 31).
#   tools/sass_access.sh [FILE.cu ...]   (default: the element-wise kernels and the attention prep)
# Needs nvcc, and cuobjdump with nvdisasm: from the CUDA toolkit when it has them, else from the
# PyPI wheels nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm, unpacked once into
# ~/.cache/centrifuge/cuobjdump (a download; nothing is installed).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
command -v nvcc >/dev/null || { echo "sass_access: nvcc not found" >&2; exit 1; }
if ! command -v cuobjdump >/dev/null || ! command -v nvdisasm >/dev/null; then
  c="$HOME/.cache/centrifuge/cuobjdump"
  if [ ! -x "$c/bin/cuobjdump" ] || [ ! -x "$c/bin/nvdisasm" ]; then
    t=$(mktemp -d); trap 'rm -rf "$t"' EXIT
    python3 -m pip download -q --no-deps -d "$t" nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm ||
      { echo "sass_access: cannot fetch cuobjdump and nvdisasm from PyPI" >&2; exit 1; }
    mkdir -p "$c/bin"
    for w in "$t"/*.whl; do python3 -m zipfile -e "$w" "$t/x"; done
    find "$t/x" -type f \( -name cuobjdump -o -name nvdisasm \) -exec cp {} "$c/bin/" \;
    chmod +x "$c/bin/"*
  fi
  export PATH="$c/bin:$PATH"
fi
[ $# -gt 0 ] || set -- src/backend/cuda/norm.cu src/backend/cuda/swiglu.cu src/backend/cuda/rope.cu \
  src/backend/cuda/embedding.cu src/backend/cuda/dropout.cu src/backend/cuda/lmhead.cu src/backend/cuda/gemm.cu \
  src/backend/cuda/attention/bwd_centrifuge_sm90.cu src/backend/cuda/attention/bwd_sm90.cu
o=$(mktemp -d); trap 'rm -rf "$o"' EXIT
printf '%-52s %8s %8s %8s %8s %8s %8s\n' file ld4 ld8 ld16 st4 st8 st16
for f in "$@"; do
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Iinclude -Isrc -cubin -o "$o/k.cubin" "$f" 2>/dev/null ||
    { echo "sass_access: $f does not compile" >&2; exit 1; }
  cuobjdump -sass "$o/k.cubin" > "$o/k.sass"
  n() { grep -cE "$1" "$o/k.sass" || true; }
  printf '%-52s %8s %8s %8s %8s %8s %8s\n' "$f" "$(n 'LDG\.E(\.CONSTANT)? ')" "$(n 'LDG\.E\.64')" "$(n 'LDG\.E\.128')" \
    "$(n 'STG\.E ')" "$(n 'STG\.E\.64')" "$(n 'STG\.E\.128')"
done
