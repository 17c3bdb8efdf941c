# Centrifuge — build. `make` builds ./centrifuge (CPU), `make test` runs the
# tests, `make cuda` builds ./centrifuge-cuda (needs nvcc), `make demo` runs
# the demo. Dependencies are installed on first use (tools/install_deps.sh).

CC      ?= gcc
# x86-64-v3 (AVX2, FMA) where the build machine has it: the CPU attention and
# elementwise loops run ~2x faster than with SSE only.
MARCH   ?= $(if $(shell grep -m1 -ow avx2 /proc/cpuinfo 2>/dev/null),-march=x86-64-v3,-march=x86-64-v2)
OPT     ?= -O3
CFLAGS  ?= $(OPT) -g $(MARCH)
# -fPIC: the same objects make the static and the shared library
# the commit, for benchmark and log records (stamped into engine/model.o)
GIT_COMMIT := $(or $(shell git rev-parse --short HEAD 2>/dev/null),unknown)
CFLAGS  += -DCF_GIT_COMMIT='"$(GIT_COMMIT)"'
CFLAGS  += -std=c11 -D_GNU_SOURCE -Wall -Wextra -Wno-unused-parameter -fopenmp -fPIC -Iinclude -Isrc
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
LDLIBS  += -lopenblas -lcjson -lpcre2-8 -lutf8proc -lm -fopenmp

BUILD   ?= build
BIN     ?= centrifuge
# The layers (docs/ARCHITECTURE.md): src/cmd holds the commands (main.c and
# one file per command); the library is everything below it.
LIB_DIRS := src/base src/formats src/engine src/dist src/backend/cpu src/backend/cuda
LIB_SRC := $(foreach d,$(LIB_DIRS),$(wildcard $(d)/*.c))
LIB_OBJ := $(patsubst src/%.c,$(BUILD)/obj/%.o,$(LIB_SRC))
CMD_SRC := $(wildcard src/cmd/*.c)
CMD_OBJ := $(patsubst src/%.c,$(BUILD)/obj/%.o,$(CMD_SRC))
ALL_H   := include/centrifuge.h $(wildcard src/*/*.h src/*/*/*.h)
TEST_SRC := $(wildcard tests/test_*.c)
TEST_BIN := $(patsubst tests/%.c,$(BUILD)/tests/%,$(TEST_SRC))
DEPS_STAMP := $(BUILD)/.deps-ok

.PHONY: all test test-build test-unit test-cli test-example test-tools deps clean demo cuda test-gpu test-asan fuzz install lib

all: $(BIN) lib

$(DEPS_STAMP):
	@tools/install_deps.sh
	@mkdir -p $(BUILD) && touch $@

deps: $(DEPS_STAMP)

# The commit stamped into model.c (bench and train records name their build):
# a file rewritten only when HEAD moves, so model.o is rebuilt exactly then.
COMMIT_STAMP := $(BUILD)/commit.txt
$(COMMIT_STAMP): FORCE
	@mkdir -p $(BUILD); [ "$$(cat $@ 2>/dev/null)" = "$(GIT_COMMIT)" ] || echo "$(GIT_COMMIT)" > $@
.PHONY: FORCE
$(BUILD)/obj/engine/model.o: $(COMMIT_STAMP)

$(BUILD)/obj/%.o: src/%.c $(ALL_H) | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/libcentrifuge.a: $(LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

# the shared library: soname libcentrifuge.so.$(SOVERSION)
SOVERSION := 0
$(BUILD)/libcentrifuge.so: $(LIB_OBJ)
	$(CC) -shared -Wl,-soname,libcentrifuge.so.$(SOVERSION) $(CFLAGS) $^ -o $@ $(LDLIBS)

lib: $(BUILD)/libcentrifuge.a $(BUILD)/libcentrifuge.so

$(BIN): $(CMD_OBJ) $(BUILD)/libcentrifuge.a
	$(CC) $(CFLAGS) $^ -o $@ $(LDLIBS)

# tests link the library and the commands' helpers (datagen), not main()
TEST_LINK := $(filter-out $(BUILD)/obj/cmd/main.o,$(CMD_OBJ)) $(BUILD)/libcentrifuge.a
# a TEST() that no RUN() calls is an error, not a warning: it would never run
TEST_CFLAGS := -Werror=unused-function
$(BUILD)/tests/%: tests/%.c $(wildcard tests/*.h) $(TEST_LINK)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(TEST_CFLAGS) $< $(TEST_LINK) -o $@ $(LDLIBS)

test: test-unit test-cli test-example test-tools

# everything the suite runs, built (make -j2 test-build; then make test runs
# the suites one after another, their output in order)
test-build: $(BIN) lib $(TEST_BIN)

test-unit: $(TEST_BIN)
	@set -e; for t in $(TEST_BIN); do echo "== $$t"; OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-passive} $$t; done

test-cli: $(BIN)
	@set -e; for t in tests/cli_*.sh; do [ -f "$$t" ] || continue; echo "== $$t"; bash $$t ./$(BIN); done

# the Python tools' tests (tools/test_*.py; each skips what needs a package
# that is not installed, such as matplotlib or tokenizers). The tokenizer
# parity check against Hugging Face packages is run by hand (tools/README.md).
test-tools:
	@if command -v python3 >/dev/null 2>&1; then set -e; \
	  for t in tools/test_*.py; do [ "$$t" = tools/test_tokenizer_parity.py ] && continue; echo "== $$t"; python3 $$t; done; \
	else echo "test-tools: skipped, no python3"; fi

demo: centrifuge
	./centrifuge demo

# ------------------------------------------------------------------ install
# make install PREFIX=/opt/centrifuge: the CLI, the static and shared
# library, the public headers and a pkg-config file (centrifuge.pc).
PREFIX  ?= /usr/local
LIBDIR  ?= $(PREFIX)/lib
INCDIR  ?= $(PREFIX)/include
PUBLIC_H := include/centrifuge.h $(wildcard include/centrifuge_*.h)

install: $(BIN) lib
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(LIBDIR)/pkgconfig $(DESTDIR)$(INCDIR)
	install -m 755 $(BIN) $(DESTDIR)$(PREFIX)/bin/centrifuge
	install -m 644 $(BUILD)/libcentrifuge.a $(DESTDIR)$(LIBDIR)/
	install -m 755 $(BUILD)/libcentrifuge.so $(DESTDIR)$(LIBDIR)/libcentrifuge.so.$(SOVERSION)
	ln -sf libcentrifuge.so.$(SOVERSION) $(DESTDIR)$(LIBDIR)/libcentrifuge.so
	install -m 644 $(PUBLIC_H) $(DESTDIR)$(INCDIR)/
	sed -e 's|@PREFIX@|$(PREFIX)|; s|@LIBDIR@|$(LIBDIR)|; s|@INCDIR@|$(INCDIR)|; s|@VERSION@|$(shell sed -n 's/^#define CF_VERSION "\(.*\)"/\1/p' include/centrifuge.h)|; s|@PRIVATE_LIBS@|$(strip $(LDLIBS))|' \
	    tools/centrifuge.pc.in > $(DESTDIR)$(LIBDIR)/pkgconfig/centrifuge.pc

# The example programs, built against an installed copy of the library
# (through pkg-config, public headers only) and run.
EXAMPLE_PREFIX := $(abspath $(BUILD))/prefix
test-example: $(BIN) lib
	@$(MAKE) --no-print-directory install PREFIX=$(EXAMPLE_PREFIX) >/dev/null
	@set -e; for e in examples/*.c; do \
	  b=$(BUILD)/examples/$$(basename $$e .c); mkdir -p $(BUILD)/examples; \
	  echo "== $$e (installed library, pkg-config)"; \
	  $(CC) -std=c11 -Wall -Wextra -Werror $(filter -fsanitize=% -fno-sanitize-recover=%,$(CFLAGS)) $$e -o $$b \
	    $$(PKG_CONFIG_PATH=$(EXAMPLE_PREFIX)/lib/pkgconfig pkg-config --cflags --libs centrifuge) \
	    -Wl,-rpath,$(EXAMPLE_PREFIX)/lib; \
	  OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $$b; \
	done

clean:
	rm -rf $(BUILD) centrifuge centrifuge-cuda

-include cuda.mk
-include robust.mk
