/* test_tokenizer.c — the HF tokenizer.json tokenizer (centrifuge_tokenizer.h).
 *
 * The expected ids were produced by the Python `tokenizers` package (0.23.3)
 * from the same fixture files in tests/data/tokenizer/: tiny hand-written
 * SentencePiece-style BPE files (spm.json, metaspace.json), a byte-level BPE
 * trained by `tokenizers` with the Llama 3 split regex (bytelevel.json,
 * bytelevel_strmerges.json: the same with "a b" merges) and added-token
 * features (added.json). tools/test_tokenizer_parity.py compares real Llama 3
 * and Mistral tokenizers on megabytes of text.
 *
 * Run from the repository root (the fixtures are found by relative path).
 * Driver mode, used by tools/test_tokenizer_parity.py:
 *   test_tokenizer --encode TOKENIZER DOCS.jsonl [--special]
 * reads one JSON object per line {"text": ...}, and prints per document a
 * line "[ids]\t\"decoded text\"" (decoding with skip_special = --special),
 * or "ERR message".
 */
#include "test.h"
#include "base/common.h"
#include "centrifuge_tokenizer.h"

#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define DATA "tests/data/tokenizer/"

static int err_has(const char *s) { return strstr(cf_last_error(), s) != NULL; }

/* encode(text) == want[0, nwant) */
static int enc_is(cf_tokenizer *t, const char *text, int special, const uint32_t *want, size_t nwant) {
    uint32_t *ids = NULL;
    size_t n = 0;
    if (cf_tokenizer_encode(t, text, strlen(text), special, &ids, &n) != 0) {
        printf("    encode('%s') failed: %s\n", text, cf_last_error());
        return 0;
    }
    int ok = n == nwant && (n == 0 || memcmp(ids, want, n * sizeof *ids) == 0);
    if (!ok) {
        printf("    encode('%s', %d) = [", text, special);
        for (size_t i = 0; i < n; i++) printf(i ? ", %u" : "%u", ids[i]);
        printf("], want [");
        for (size_t i = 0; i < nwant; i++) printf(i ? ", %u" : "%u", want[i]);
        printf("]\n");
    }
    free(ids);
    return ok;
}

/* decode(ids) == want */
static int dec_is(cf_tokenizer *t, const uint32_t *ids, size_t n, int skip, const char *want) {
    char *text = NULL;
    size_t len = 0;
    if (cf_tokenizer_decode(t, ids, n, skip, &text, &len) != 0) {
        printf("    decode failed: %s\n", cf_last_error());
        return 0;
    }
    int ok = len == strlen(want) && strcmp(text, want) == 0;
    if (!ok) printf("    decode = '%s', want '%s'\n", text, want);
    free(text);
    return ok;
}

#define IDS(...) ((const uint32_t[]){__VA_ARGS__}), (sizeof((const uint32_t[]){__VA_ARGS__}) / sizeof(uint32_t))
#define NOIDS ((const uint32_t *)NULL), 0

TEST(spm_byte_fallback_matches_tokenizers) {
    cf_tokenizer *t = cf_tokenizer_load(DATA "spm.json");
    CHECK_MSG(t, "load: %s", cf_last_error());
    if (!t) return;
    CHECK(enc_is(t, "hello world", 0, IDS(23, 28)));
    CHECK(enc_is(t, "hello world", 1, IDS(1, 23, 28)));
    CHECK(enc_is(t, "hello  world", 0, IDS(23, 10, 28)));
    CHECK(enc_is(t, " hello", 0, IDS(10, 23)));
    CHECK(enc_is(t, "h\xC3\xA9llo", 0, IDS(20, 4, 5, 19, 14)));        /* é by byte fallback */
    CHECK(enc_is(t, "xyz hello", 0, IDS(10, 0, 23)));                    /* fused <unk> */
    CHECK(enc_is(t, "\xF0\x9F\x98\x80\n", 0, IDS(10, 6, 7, 8, 9, 3)));  /* 😀\n */
    CHECK(enc_is(t, "<s>hello</s>", 0, IDS(1, 23, 2)));                  /* specials, Prepend per piece */
    CHECK(enc_is(t, "<s>hello</s>", 1, IDS(1, 1, 23, 2)));
    CHECK(enc_is(t, "", 0, NOIDS));
    CHECK(enc_is(t, "", 1, IDS(1)));
    CHECK(dec_is(t, IDS(1, 23, 28), 0, "<s> hello world"));
    CHECK(dec_is(t, IDS(1, 23, 28), 1, "hello world"));
    CHECK(dec_is(t, IDS(1, 10, 23), 0, "<s>  hello"));
    CHECK(dec_is(t, IDS(1, 10, 0, 23), 1, " hello"));
    CHECK(dec_is(t, IDS(1, 10, 6, 7, 8, 9, 3), 1, "\xF0\x9F\x98\x80\n"));
    CHECK(dec_is(t, IDS(6, 7), 1, "\xEF\xBF\xBD\xEF\xBF\xBD"));          /* half a character: U+FFFD per byte */
    CHECK(dec_is(t, NOIDS, 1, ""));
    CHECK(cf_tokenizer_vocab_size(t) == 30);
    CHECK(cf_tokenizer_max_id(t) == 30);
    CHECK(cf_tokenizer_bos_id(t) == 1);
    CHECK(cf_tokenizer_eos_id(t) == 2);
    CHECK(cf_tokenizer_token_id(t, "\xE2\x96\x81hello") == 23);
    CHECK(cf_tokenizer_token_id(t, "nope") == -1);
    CHECK(cf_tokenizer_id_token(t, 28) && strcmp(cf_tokenizer_id_token(t, 28), "\xE2\x96\x81world") == 0);
    CHECK(cf_tokenizer_id_token(t, 30) == NULL);
    CHECK(cf_tokenizer_is_special(t, 1) && !cf_tokenizer_is_special(t, 23));
    cf_tokenizer_free(t);
}

TEST(metaspace_pretokenizer_matches_tokenizers) {
    cf_tokenizer *t = cf_tokenizer_load(DATA "metaspace.json");
    CHECK_MSG(t, "load: %s", cf_last_error());
    if (!t) return;
    CHECK(enc_is(t, "hello world", 0, IDS(23, 28)));
    CHECK(enc_is(t, " hello", 0, IDS(23)));
    CHECK(enc_is(t, "xyz hello", 0, IDS(10, 0, 0, 0, 23)));       /* unk not fused */
    CHECK(enc_is(t, "<s>hello world", 0, IDS(1, 11, 21, 14, 28))); /* prepend_scheme first */
    CHECK(enc_is(t, "hello  world", 1, IDS(1, 23, 10, 28)));
    CHECK(dec_is(t, IDS(1, 23, 28), 0, "<s> hello world"));
    CHECK(dec_is(t, IDS(1, 1, 11, 21, 14, 28), 0, "<s><s>hello world"));
    CHECK(dec_is(t, IDS(1, 10, 0, 0, 0, 23), 1, " hello"));
    cf_tokenizer_free(t);
}

TEST(byte_level_bpe_matches_tokenizers) {
    const char *files[] = {DATA "bytelevel.json", DATA "bytelevel_strmerges.json"};
    for (int f = 0; f < 2; f++) {
        cf_tokenizer *t = cf_tokenizer_load(files[f]);
        CHECK_MSG(t, "load %s: %s", files[f], cf_last_error());
        if (!t) continue;
        CHECK(enc_is(t, "Hello world!", 0, IDS(280, 268, 318, 310, 2)));
        CHECK(enc_is(t, "Hello world!", 1, IDS(0, 280, 268, 318, 310, 2)));
        CHECK(enc_is(t, "It's 12345 na\xC3\xAFve", 0, IDS(291, 283, 222, 287, 20, 289, 222, 317, 327)));
        CHECK(enc_is(t, "<|begin_of_text|>The lazy dog<|end_of_text|>", 0, IDS(0, 292, 222, 312, 90, 279, 72, 1)));
        CHECK(enc_is(t, "  \n\n x", 0, IDS(261, 276, 222, 89)));
        CHECK(enc_is(t, "\xF0\x9F\x98\x80", 1, IDS(0, 174, 255, 248, 224)));
        CHECK(dec_is(t, IDS(0, 280, 268, 318, 310, 2), 0, "<|begin_of_text|>Hello world!"));
        CHECK(dec_is(t, IDS(0, 0, 292, 222, 312, 90, 279, 72, 1), 1, "The lazy dog"));
        CHECK(dec_is(t, IDS(0, 174, 255, 248, 224), 1, "\xF0\x9F\x98\x80"));
        CHECK(dec_is(t, IDS(174, 255), 1, "\xEF\xBF\xBD"));   /* an incomplete character: one U+FFFD */
        CHECK(cf_tokenizer_vocab_size(t) == 330);
        CHECK(cf_tokenizer_bos_id(t) == 0 && cf_tokenizer_eos_id(t) == 1);
        cf_tokenizer_free(t);
    }
}

TEST(added_tokens_strip_single_word_and_normalized) {
    cf_tokenizer *t = cf_tokenizer_load(DATA "added.json");
    CHECK_MSG(t, "load: %s", cf_last_error());
    if (!t) return;
    CHECK(enc_is(t, "Hello <mask> there", 0, IDS(333, 330, 269, 264)));   /* lstrip; HELLO normalized */
    CHECK(enc_is(t, "a [SEP]   b", 0, IDS(66, 222, 331, 67)));             /* rstrip */
    CHECK(enc_is(t, "cat concat cat.", 0, IDS(332, 222, 68, 80, 79, 68, 294, 222, 332, 15)));  /* single_word */
    CHECK(enc_is(t, "HeLLo world", 1, IDS(0, 333, 268, 318, 310)));
    CHECK(enc_is(t, "Raw raw RAW", 0, IDS(334, 222, 83, 66, 88, 222, 83, 66, 88)));  /* not normalized */
    CHECK(dec_is(t, IDS(0, 333, 330, 269, 264), 0, "<|begin_of_text|>hello<mask> there"));
    CHECK(dec_is(t, IDS(0, 333, 330, 269, 264), 1, "hello there"));
    CHECK(cf_tokenizer_vocab_size(t) == 335);
    CHECK(cf_tokenizer_token_id(t, "<mask>") == 330);
    cf_tokenizer_free(t);
}

TEST(encode_append_accumulates) {
    cf_tokenizer *t = cf_tokenizer_load(DATA "spm.json");
    if (!t) { CHECK(0); return; }
    uint32_t *ids = NULL;
    size_t n = 0, cap = 0;
    CHECK(cf_tokenizer_encode_append(t, "hello", 5, 1, &ids, &n, &cap) == 0);
    CHECK(cf_tokenizer_encode_append(t, "world", 5, 1, &ids, &n, &cap) == 0);
    /* "world" alone is "▁world" (Prepend) */
    CHECK(n == 4 && ids[0] == 1 && ids[1] == 23 && ids[2] == 1 && ids[3] == 28);
    /* many repeats: the cache gives the same ids as the first encoding */
    for (int r = 0; r < 1000 && n < 100000; r++)
        CHECK(cf_tokenizer_encode_append(t, "hello world", 11, 0, &ids, &n, &cap) == 0);
    int same = 1;
    for (size_t i = 4; i + 1 < n; i += 2) same &= ids[i] == 23 && ids[i + 1] == 28;
    CHECK(same && n == 4 + 2000);
    free(ids);
    cf_tokenizer_free(t);
}

TEST(long_words_give_the_same_ids_as_short_ones) {
    /* SentencePiece-style files make a whole text one BPE word: 20000
     * repeats of "hello world" must give the ids of one repeat, 20000 times */
    cf_tokenizer *t = cf_tokenizer_load(DATA "spm.json");
    if (!t) { CHECK(0); return; }
    size_t reps = 20000, len = reps * 12;
    char *text = malloc(len + 1);
    for (size_t i = 0; i < reps; i++) memcpy(text + 12 * i, "hello world ", 12);
    text[len - 1] = 0;   /* no trailing space */
    uint32_t *ids = NULL;
    size_t n = 0;
    CHECK(cf_tokenizer_encode(t, text, len - 1, 0, &ids, &n) == 0);
    int ok = n == 2 * reps;
    for (size_t i = 0; ok && i < n; i += 2) ok = ids[i] == 23 && ids[i + 1] == 28;
    CHECK(ok);
    char *back = NULL;
    CHECK(cf_tokenizer_decode(t, ids, n, 1, &back, NULL) == 0 && back && strcmp(back, text) == 0);
    free(back);
    free(ids);
    free(text);
    cf_tokenizer_free(t);
}

TEST(bad_input_fails_with_a_clear_line) {
    cf_tokenizer *t = cf_tokenizer_load(DATA "bytelevel.json");
    if (!t) { CHECK(0); return; }
    uint32_t *ids = NULL;
    size_t n = 0;
    CHECK(cf_tokenizer_encode(t, "ok\xC3(", 4, 0, &ids, &n) == -1);
    CHECK_MSG(err_has("not valid UTF-8 (at byte 2)"), "%s", cf_last_error());
    CHECK(cf_tokenizer_encode(t, "\xED\xA0\x80", 3, 0, &ids, &n) == -1);   /* a UTF-16 surrogate */
    char *text = NULL;
    uint32_t bad[] = {5, 100000};
    CHECK(cf_tokenizer_decode(t, bad, 2, 0, &text, NULL) == -1 && text == NULL);
    CHECK_MSG(err_has("token id 100000 (at position 1)"), "%s", cf_last_error());
    /* NUL bytes are text like any other */
    CHECK(cf_tokenizer_encode(t, "a\0b", 3, 0, &ids, &n) == 0 && n == 3);
    free(ids);
    cf_tokenizer_free(t);
}

TEST(unsupported_features_are_named) {
    struct { const char *file, *msg; } cases[] = {
        {"unsupported_model.json", "model type 'Unigram' is not supported"},
        {"unsupported_normalizer.json", "normalizer type 'Precompiled' is not supported"},
        {"unsupported_pretokenizer.json", "pre_tokenizer.pretokenizers[0]: pre-tokenizer type 'Whitespace' is not supported"},
        {"unsupported_decoder.json", "decoder type 'WordPiece' is not supported"},
        {"unsupported_truncation.json", "truncation is set"},
        {"unsupported_dropout.json", "BPE dropout"},
        {"malformed.json", "not valid JSON"},
        {"bad_merge.json", "model.merges[1]: token 'c' is not in the vocabulary"},
        {"bad_vocab.json", "model.vocab['b'] must be a token id"},
        {"missing.json", "tokenizer file not found"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char path[256];
        snprintf(path, sizeof path, DATA "%s", cases[i].file);
        cf_tokenizer *t = cf_tokenizer_load(path);
        CHECK_MSG(t == NULL, "%s loaded", cases[i].file);
        cf_tokenizer_free(t);
        CHECK_MSG(err_has(cases[i].msg) && err_has(cases[i].file), "%s: got '%s'", cases[i].file, cf_last_error());
        CHECK_MSG(!strchr(cf_last_error(), '\n'), "%s: message is not one line", cases[i].file);
    }
}

TEST(directory_and_tokenizer_config) {
    char dir[] = "/tmp/cf_tok_test_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char p[512], q[512];
    size_t len;
    char *json = cf_read_file(DATA "bytelevel.json", &len, 1 << 24);
    CHECK(json != NULL);
    snprintf(p, sizeof p, "%s/tokenizer.json", dir);
    CHECK(cf_write_file_atomic(p, json, len) == 0);
    free(json);
    cf_tokenizer *t = cf_tokenizer_load(dir);
    CHECK_MSG(t && strcmp(cf_tokenizer_path(t), p) == 0, "%s", t ? cf_tokenizer_path(t) : cf_last_error());
    CHECK(t && cf_tokenizer_eos_id(t) == 1);
    cf_tokenizer_free(t);
    /* tokenizer_config.json names the specials (string or {"content": ...}) */
    snprintf(q, sizeof q, "%s/tokenizer_config.json", dir);
    const char *cfg = "{\"eos_token\": {\"content\": \"<|begin_of_text|>\"}, \"bos_token\": \"<|end_of_text|>\"}";
    CHECK(cf_write_file_atomic(q, cfg, strlen(cfg)) == 0);
    t = cf_tokenizer_load(p);
    CHECK(t && cf_tokenizer_eos_id(t) == 0 && cf_tokenizer_bos_id(t) == 1);
    cf_tokenizer_free(t);
    unlink(q);
    unlink(p);
    /* a directory without tokenizer.json */
    t = cf_tokenizer_load(dir);
    CHECK(t == NULL && err_has("no tokenizer.json in this directory"));
    rmdir(dir);
}

/* bytelevel.json with another pre-tokenizer, written to a temp file. */
static cf_tokenizer *with_pre_tokenizer(const char *pre_json) {
    size_t len;
    char *text = cf_read_file(DATA "bytelevel.json", &len, 1 << 24);
    cJSON *root = text ? cJSON_Parse(text) : NULL;
    free(text);
    if (!root) return NULL;
    cJSON_ReplaceItemInObjectCaseSensitive(root, "pre_tokenizer", cJSON_Parse(pre_json));
    cJSON_ReplaceItemInObjectCaseSensitive(cJSON_GetObjectItemCaseSensitive(root, "model"), "ignore_merges",
                                           cJSON_CreateFalse());
    char *out = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    char path[] = "/tmp/cf_tok_pre_XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0 || !out) { free(out); return NULL; }
    ssize_t w = write(fd, out, strlen(out));
    close(fd);
    free(out);
    cf_tokenizer *t = w > 0 ? cf_tokenizer_load(path) : NULL;
    unlink(path);
    return t;
}

TEST(regex_classes_mean_what_they_mean_in_oniguruma) {
    /* tokenizers runs its regexes on Oniguruma: \w has marks and Alphabetic
     * symbols, \s has U+0085, \h is a hex digit. Removing \h|\w|\s leaves
     * only "-" and "!" of this text (ids from tokenizers 0.23.3). */
    cf_tokenizer *t = with_pre_tokenizer(
        "{\"type\": \"Sequence\", \"pretokenizers\": ["
        "{\"type\": \"Split\", \"pattern\": {\"Regex\": \"\\\\h|\\\\w|\\\\s\"}, \"behavior\": \"Removed\", \"invert\": false},"
        "{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, \"use_regex\": false}]}");
    CHECK_MSG(t, "load: %s", cf_last_error());
    if (t) CHECK(enc_is(t, "cafe\xCC\x81 x\xC2\x85y \xE2\x92\xB6-0xZ\xC2\xB2!", 0, IDS(14, 2)));
    cf_tokenizer_free(t);
    /* forms that Oniguruma reads differently and PCRE2 cannot express */
    t = with_pre_tokenizer("{\"type\": \"Split\", \"pattern\": {\"Regex\": \"\\\\pL\"}, \"behavior\": \"Isolated\"}");
    CHECK(t == NULL && err_has("without braces is not supported"));
    t = with_pre_tokenizer("{\"type\": \"Split\", \"pattern\": {\"Regex\": \"[\\\\Sa]\"}, \"behavior\": \"Isolated\"}");
    CHECK(t == NULL && err_has("\\S inside a character class is not supported"));
    t = with_pre_tokenizer("{\"type\": \"Split\", \"pattern\": {\"Regex\": \"(\"}, \"behavior\": \"Isolated\"}");
    CHECK_MSG(t == NULL && err_has("does not compile"), "%s", cf_last_error());
}

/* ------------------------------------------------------------ driver mode */

static int driver(const char *tok_path, const char *docs, int special) {
    cf_tokenizer *t = cf_tokenizer_load(tok_path);
    if (!t) { fprintf(stderr, "error: %s\n", cf_last_error()); return 1; }
    FILE *f = fopen(docs, "r");
    if (!f) { perror(docs); cf_tokenizer_free(t); return 1; }
    char *line = NULL;
    size_t cap = 0;
    ssize_t r;
    double secs = 0;
    size_t bytes = 0, tokens = 0;
    while ((r = getline(&line, &cap, f)) > 0) {
        cJSON *j = cJSON_ParseWithLength(line, (size_t)r);
        const char *s = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(j, "text"));
        if (!s) { printf("ERR bad input line\n"); cJSON_Delete(j); continue; }
        uint32_t *ids = NULL;
        size_t n = 0, len = strlen(s);
        char *out = NULL;
        double t0 = cf_now();
        int rc = cf_tokenizer_encode(t, s, len, special, &ids, &n);
        secs += cf_now() - t0;
        bytes += len;
        tokens += n;
        if (rc == 0) rc = cf_tokenizer_decode(t, ids, n, special, &out, NULL);
        if (rc != 0) {
            printf("ERR %s\n", cf_last_error());
        } else {
            putchar('[');
            for (size_t i = 0; i < n; i++) printf(i ? ",%u" : "%u", ids[i]);
            cJSON *o = cJSON_CreateString(out);
            char *js = cJSON_PrintUnformatted(o);
            printf("]\t%s\n", js);
            free(js);
            cJSON_Delete(o);
        }
        free(out);
        free(ids);
        cJSON_Delete(j);
    }
    free(line);
    fclose(f);
    cf_tokenizer_free(t);
    fprintf(stderr, "encoded %zu bytes into %zu tokens in %.3f s (%.1f MB/s)\n", bytes, tokens, secs,
            secs > 0 ? bytes / secs / 1e6 : 0.0);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 4 && !strcmp(argv[1], "--encode"))
        return driver(argv[2], argv[3], argc >= 5 && !strcmp(argv[4], "--special"));
    RUN(spm_byte_fallback_matches_tokenizers);
    RUN(metaspace_pretokenizer_matches_tokenizers);
    RUN(byte_level_bpe_matches_tokenizers);
    RUN(added_tokens_strip_single_word_and_normalized);
    RUN(encode_append_accumulates);
    RUN(long_words_give_the_same_ids_as_short_ones);
    RUN(bad_input_fails_with_a_clear_line);
    RUN(unsupported_features_are_named);
    RUN(directory_and_tokenizer_config);
    RUN(regex_classes_mean_what_they_mean_in_oniguruma);
    return test_summary();
}
