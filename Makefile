# Centrifuge — build. `make` builds ./centrifuge (CPU), `make test` runs the
# tests, `make cuda` builds ./centrifuge-cuda (needs nvcc), `make demo` runs
# the demo. Dependencies are installed on first use (tools/install_deps.sh).

CC      ?= gcc
# x86-64-v3 (AVX2, FMA) where the build machine has it: the CPU attention and
# elementwise loops run ~2x faster than with SSE only.
MARCH   ?= $(if $(shell grep -m1 -ow avx2 /proc/cpuinfo 2>/dev/null),-march=x86-64-v3,-march=x86-64-v2)
OPT     ?= -O3
CFLAGS  ?= $(OPT) -g $(MARCH)
CFLAGS  += -std=c11 -D_GNU_SOURCE -Wall -Wextra -Wno-unused-parameter -fopenmp -Iinclude -Isrc
# OpenBLAS built on OpenMP: its threads and ours share one pool (the pthread
# build fights OpenMP's spinning threads for the cores and runs ~2x slower).
BLAS_DIR := $(firstword $(wildcard /usr/lib/x86_64-linux-gnu/openblas-openmp /usr/lib/aarch64-linux-gnu/openblas-openmp))
BLAS_INC := $(firstword $(wildcard /usr/include/x86_64-linux-gnu/openblas-openmp /usr/include/aarch64-linux-gnu/openblas-openmp /usr/include/openblas))
ifneq ($(BLAS_INC),)
CFLAGS  += -I$(BLAS_INC)
endif
ifneq ($(BLAS_DIR),)
LDLIBS  += -L$(BLAS_DIR) -Wl,-rpath,$(BLAS_DIR)
endif
LDLIBS  += -lopenblas -lcjson -lm -fopenmp

BUILD   ?= build
BIN     ?= centrifuge
# main.c holds main(); everything else is the engine library.
LIB_SRC := $(filter-out src/main.c,$(wildcard src/*.c))
LIB_OBJ := $(patsubst src/%.c,$(BUILD)/obj/%.o,$(LIB_SRC))
TEST_SRC := $(wildcard tests/test_*.c)
TEST_BIN := $(patsubst tests/%.c,$(BUILD)/tests/%,$(TEST_SRC))
DEPS_STAMP := $(BUILD)/.deps-ok

.PHONY: all test test-unit test-cli deps clean demo cuda test-gpu test-asan fuzz

all: $(BIN)

$(DEPS_STAMP):
	@tools/install_deps.sh
	@mkdir -p $(BUILD) && touch $@

deps: $(DEPS_STAMP)

$(BUILD)/obj/%.o: src/%.c $(wildcard src/*.h) include/centrifuge.h | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/libcentrifuge.a: $(LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BIN): $(BUILD)/obj/main.o $(BUILD)/libcentrifuge.a
	$(CC) $(CFLAGS) $^ -o $@ $(LDLIBS)

$(BUILD)/tests/%: tests/%.c tests/test.h $(BUILD)/libcentrifuge.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $< $(BUILD)/libcentrifuge.a -o $@ $(LDLIBS)

test: test-unit test-cli

test-unit: $(TEST_BIN)
	@set -e; for t in $(TEST_BIN); do echo "== $$t"; OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $$t; done

test-cli: $(BIN)
	@set -e; for t in tests/cli_*.sh; do [ -f "$$t" ] || continue; echo "== $$t"; bash $$t ./$(BIN); done

demo: centrifuge
	./centrifuge demo

clean:
	rm -rf $(BUILD) centrifuge centrifuge-cuda

-include cuda.mk
-include robust.mk
