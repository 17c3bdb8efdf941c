# cuda.mk — the CUDA build, included by the Makefile.
#
#   make cuda        ./centrifuge-cuda: every C source compiled with -DCF_WITH_CUDA
#                    plus src/backend/cuda/*.cu and src/backend/cuda/attention/*.cu
#                    (bf16 kernels, cuBLASLt), objects in build/cuda/
#   make test-gpu    builds and runs tests/gpu/test_*.c (CPU backend vs CUDA backend)
#   make bench-gpu   builds and runs tests/gpu/bench_attention
#   make cuda-tests-build  builds the GPU tests, bench_attention and probe_wgmma without
#                    running them (CI: no GPU)
#   make probe-gpu   builds and runs tests/gpu/probe_wgmma (unit checks of the
#                    Hopper attention building blocks; needs an sm_90 GPU)
#   make test-cuda-host  builds (nvcc) and runs tests/gpu/host_*.cu on the CPU: the
#                    Hopper backward's dq layout maps and query parts (CI runs it)
#   make cuda-trace-objs  compiles the attention units with -DCF_ATTN_TRACE=1 (sm_90a
#                    only; CI runs it so the timing build's code keeps compiling). The
#                    trace build itself: make BUILD=build/trace CUDA_DEFS=-DCF_ATTN_TRACE=1
#                    build/trace/cuda/tests/bench_attention (attention/trace.cuh)
#
# Variables:
#   NVCC, CUDA_HOME      the toolkit (default: the nvcc on PATH)
#   CUDA_GENCODE         default: a fat binary of sm_80 SASS (runs on sm_80/86/89:
#                        A100, RTX 30xx/40xx, L4), sm_90a SASS (H100/H200) and
#                        compute_90 PTX (JIT-compiled on newer GPUs)
#   CUDA_PORTABLE=1      sm_80 SASS + compute_80 PTX only, with -DCF_CUDA_PORTABLE=1:
#                        the portable code path on every GPU (no sm_90-only code)
#   DEPS_ROOT=dir        a tree with usr/include and usr/lib/x86_64-linux-gnu holding
#                        OpenBLAS and cJSON (e.g. Debian packages unpacked with
#                        dpkg -x), for machines where they are not installed
#   CUDA_C_SRC           the C sources of the CUDA library (default: all of src/ but
#                        main.c; tests link only what they use)
#   CUDA_DEFS            extra nvcc flags, e.g. the CF_ATTN_* tuning macros of
#                        src/backend/cuda/attention/common.cuh for A/B timing builds
#                        (with BUILD=...)
# These rules never run tools/install_deps.sh.

comma        := ,
NVCC         ?= nvcc
CUDA_HOME    ?= $(patsubst %/bin/nvcc,%,$(realpath $(shell command -v $(NVCC) 2>/dev/null)))
ifeq ($(CUDA_PORTABLE),1)
CUDA_GENCODE ?= -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_80,code=compute_80
CUDA_DEFS    ?= -DCF_CUDA_PORTABLE=1
else
CUDA_GENCODE ?= -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a \
                -gencode=arch=compute_90,code=compute_90
endif
# -fPIC as in CFLAGS: the objects may go into a shared library
NVCCFLAGS    ?= -O3 -std=c++17 -lineinfo $(CUDA_GENCODE) -Xcompiler -Wall,-Wextra,-Wno-unused-parameter,-fPIC
CUDA_DEFS    ?=
NVCCFLAGS    += -Iinclude -Isrc $(CUDA_DEFS)
CUDA_INC     := -I$(CUDA_HOME)/include -I$(CUDA_HOME)/targets/x86_64-linux/include
CUDA_LIBDIR  := $(CUDA_HOME)/lib64 $(CUDA_HOME)/targets/x86_64-linux/lib
CUDA_LDLIBS  := $(addprefix -L,$(CUDA_LIBDIR)) $(addprefix -Wl$(comma)-rpath$(comma),$(CUDA_LIBDIR)) \
                -lcublasLt -lcublas -lcudart -lnccl -lstdc++

ifneq ($(DEPS_ROOT),)
DEPS_ABS := $(abspath $(DEPS_ROOT))
DEPS_BLAS := $(firstword $(wildcard $(addprefix $(DEPS_ABS)/usr/lib/x86_64-linux-gnu/openblas-,openmp pthread)))
DEPS_BLAS_INC := $(firstword $(wildcard $(addprefix $(DEPS_ABS)/usr/include/x86_64-linux-gnu/openblas-,openmp pthread)))
DEPS_LIBDIRS := $(DEPS_BLAS) $(DEPS_ABS)/usr/lib/x86_64-linux-gnu
CFLAGS  += -I$(DEPS_ABS)/usr/include $(addprefix -I,$(DEPS_BLAS_INC))
LDLIBS  := $(addprefix -L,$(DEPS_LIBDIRS)) $(addprefix -Wl$(comma)-rpath$(comma),$(DEPS_LIBDIRS)) $(LDLIBS)
endif

CUDA_BUILD   := $(BUILD)/cuda
CUDA_C_SRC   ?= $(LIB_SRC) $(filter-out src/cmd/main.c,$(CMD_SRC))
CUDA_C_OBJ   := $(patsubst src/%.c,$(CUDA_BUILD)/obj/%.o,$(CUDA_C_SRC))
CUDA_CU_SRC  := $(wildcard src/backend/cuda/*.cu src/backend/cuda/attention/*.cu)
CUDA_CU_OBJ  := $(patsubst src/%.cu,$(CUDA_BUILD)/cu/%.o,$(CUDA_CU_SRC))
CUDA_LIB     := $(CUDA_BUILD)/libcentrifuge-cuda.a
GPU_TEST_SRC := $(wildcard tests/gpu/test_*.c)
GPU_TEST_BIN := $(patsubst tests/gpu/%.c,$(CUDA_BUILD)/tests/%,$(GPU_TEST_SRC))
GPU_BENCH_BIN := $(CUDA_BUILD)/tests/bench_attention
GPU_PROBE_BIN := $(CUDA_BUILD)/tests/probe_wgmma

.PHONY: bench-gpu probe-gpu

# C sources may include backend/cuda/context.h (CUDA runtime and cuBLASLt headers)
$(CUDA_BUILD)/obj/engine/model.o: $(COMMIT_STAMP)
$(CUDA_BUILD)/obj/%.o: src/%.c $(ALL_H)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -DCF_WITH_CUDA $(CUDA_INC) -c $< -o $@

$(CUDA_BUILD)/cu/%.o: src/%.cu $(ALL_H) $(wildcard src/backend/cuda/*.cuh src/backend/cuda/attention/*.cuh)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@

$(CUDA_LIB): $(CUDA_C_OBJ) $(CUDA_CU_OBJ)
	@rm -f $@
	ar rcs $@ $^

cuda: centrifuge-cuda

# the GPU programs (tests, the attention benchmark, the wgmma probe) built, not run: CI has no
# GPU, but a change that breaks their build must not land
.PHONY: cuda-tests-build
cuda-tests-build: $(GPU_TEST_BIN) $(GPU_BENCH_BIN) $(GPU_PROBE_BIN)

centrifuge-cuda: $(CUDA_BUILD)/obj/cmd/main.o $(CUDA_LIB)
	$(CC) $(CFLAGS) $^ -o $@ $(LDLIBS) $(CUDA_LDLIBS)

$(CUDA_BUILD)/tests/%: tests/gpu/%.c $(wildcard tests/*.h) $(CUDA_LIB)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(TEST_CFLAGS) -DCF_WITH_CUDA $(CUDA_INC) -Itests $< $(CUDA_LIB) -o $@ $(LDLIBS) $(CUDA_LDLIBS)

test-gpu: $(GPU_TEST_BIN) $(BIN)
	@set -e; for t in $(GPU_TEST_BIN); do echo "== $$t"; OMP_NUM_THREADS=$${OMP_NUM_THREADS:-8} $$t; done
	@# checkpoints against HF transformers (llama and qwen2), where torch + transformers are installed
	@if python3 -c 'import torch, transformers' 2>/dev/null; then \
	  echo "== tools/hf_parity.py"; python3 tools/hf_parity.py --bin ./$(BIN) --types llama,qwen2; \
	else echo "== tools/hf_parity.py skipped: python3 has no torch/transformers"; fi

bench-gpu: $(GPU_BENCH_BIN)
	$(GPU_BENCH_BIN)

$(CUDA_BUILD)/tests/probe_wgmma.o: tests/gpu/probe_wgmma.cu $(ALL_H) $(wildcard src/backend/cuda/*.cuh src/backend/cuda/attention/*.cuh)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@

$(GPU_PROBE_BIN): $(CUDA_BUILD)/tests/probe_wgmma.o $(CUDA_LIB)
	$(CC) $(CFLAGS) $^ -o $@ $(LDLIBS) $(CUDA_LDLIBS)

probe-gpu: $(GPU_PROBE_BIN)
	$(GPU_PROBE_BIN)

# host-side checks of the CUDA code's index maps and launch plans: compiled by nvcc, run on the CPU
# (no GPU needed)
CUDA_HOST_TESTS := host_slot_layout host_bwd_parts
CUDA_HOST_TEST_BINS := $(CUDA_HOST_TESTS:%=$(CUDA_BUILD)/tests/%)
.PHONY: test-cuda-host
$(CUDA_BUILD)/tests/host_%: tests/gpu/host_%.cu tests/test.h $(wildcard src/backend/cuda/*.cuh src/backend/cuda/attention/*.cuh) $(ALL_H)
	@mkdir -p $(dir $@)
	$(NVCC) -O1 -std=c++17 -Iinclude -Isrc -Itests $< -o $@

test-cuda-host: $(CUDA_HOST_TEST_BINS)
	@for t in $(CUDA_HOST_TEST_BINS); do echo "== $$t"; $$t || exit 1; done

# the attention backward's per-block timeline (attention/trace.cuh), compiled only
TRACE_CU_SRC := $(wildcard src/backend/cuda/attention/*.cu)
TRACE_CU_OBJ := $(patsubst src/%.cu,$(CUDA_BUILD)/trace-check/%.o,$(TRACE_CU_SRC))
.PHONY: cuda-trace-objs
$(CUDA_BUILD)/trace-check/%.o: src/%.cu $(ALL_H) $(wildcard src/backend/cuda/*.cuh src/backend/cuda/attention/*.cuh)
	@mkdir -p $(dir $@)
	$(NVCC) -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Iinclude -Isrc -DCF_ATTN_TRACE=1 \
	  -Xcompiler -Wall,-Wextra,-Wno-unused-parameter -c $< -o $@
cuda-trace-objs: $(TRACE_CU_OBJ)
