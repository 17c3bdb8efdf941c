# robust.mk — robustness targets, included by the Makefile.
#
#   make fuzz          libFuzzer targets for the config.json, safetensors and
#                      shard readers, FUZZ_SECONDS (default 60) per target
#   make fuzz-smoke    the same, a few seconds per target (CI)
#   make test-asan     the whole test suite under ASan + UBSan (build/asan)
#   make test-kill     the SIGKILL crash-safety loop (tests/cli_kill_loop.sh)
#
# See docs/ROBUSTNESS.md.

.PHONY: fuzz fuzz-smoke fuzz-build test-asan test-kill

# ------------------------------------------------------------------ fuzzing
# clang with libFuzzer (Debian: clang, libclang-rt-14-dev; installed by
# tools/install_deps.sh --with-fuzz). Only the readers are linked.
FUZZ_CC      ?= clang
FUZZ_SECONDS ?= 60
FUZZ_SMOKE_SECONDS ?= 3
FUZZ_DIR     := build/fuzz
FUZZ_NAMES   := fuzz_config fuzz_safetensors fuzz_shards
FUZZ_BINS    := $(addprefix $(FUZZ_DIR)/,$(FUZZ_NAMES))
FUZZ_READERS := src/formats/config.c src/formats/safetensors.c src/formats/shards.c src/base/common.c
FUZZ_CFLAGS  := -g -O1 -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined \
                -fno-sanitize-recover=undefined -std=c11 -D_GNU_SOURCE -Wall -Wextra \
                -Wno-unused-parameter -Iinclude -Isrc

$(FUZZ_DIR)/.deps-ok:
	@tools/install_deps.sh --with-fuzz
	@mkdir -p $(FUZZ_DIR) && touch $@

$(FUZZ_BINS): $(FUZZ_DIR)/%: tests/fuzz/%.c tests/fuzz/fuzz_targets.h $(FUZZ_READERS) $(ALL_H) \
              include/centrifuge.h | $(FUZZ_DIR)/.deps-ok
	$(FUZZ_CC) $(FUZZ_CFLAGS) $< $(FUZZ_READERS) -o $@ -lcjson -lm

fuzz-build: $(FUZZ_BINS)

fuzz: $(FUZZ_BINS)
	@tests/fuzz/run.sh $(FUZZ_SECONDS) $(FUZZ_DIR) $(FUZZ_NAMES)

fuzz-smoke: $(FUZZ_BINS)
	@tests/fuzz/run.sh $(FUZZ_SMOKE_SECONDS) $(FUZZ_DIR) $(FUZZ_NAMES)

# --------------------------------------------------------------- sanitizers
# The whole suite (unit tests and every tests/cli_*.sh) against a separate
# ASan + UBSan build in build/asan. gcc: its libgomp works under ASan. Any
# UBSan report aborts (no recovery); LeakSanitizer checks every exit. No
# suppressions are needed: OpenBLAS and libgomp report no leaks here.
ASAN_BUILD  := build/asan
ASAN_CFLAGS := -O1 -g -march=x86-64-v2 -fsanitize=address,undefined -fno-omit-frame-pointer \
               -fno-sanitize-recover=undefined
ASAN_ENV    := ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:strict_string_checks=1:check_initialization_order=1 \
               UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

# The build takes make's -j (make -j2 test-asan); the suites then run one
# after another, as in make test.
test-asan:
	@CFLAGS="$(ASAN_CFLAGS)" $(MAKE) --no-print-directory BUILD=$(ASAN_BUILD) \
	    BIN=$(ASAN_BUILD)/centrifuge test-build
	@$(ASAN_ENV) CFLAGS="$(ASAN_CFLAGS)" $(MAKE) --no-print-directory -j1 BUILD=$(ASAN_BUILD) \
	    BIN=$(ASAN_BUILD)/centrifuge test
	@echo "test-asan: the whole suite passed under ASan + UBSan ($(ASAN_BUILD)/centrifuge)"

# ------------------------------------------------------------ crash safety
test-kill: $(BIN)
	bash tests/cli_kill_loop.sh ./$(BIN)
