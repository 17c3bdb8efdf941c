/*
 * centrifuge_tokenizer.h — HF tokenizer.json in C: encode text to token ids
 * and decode ids to text exactly as the Hugging Face `tokenizers` package
 * does with the same file.
 *
 * Supported (everything Llama 2/3.x, TinyLlama, Mistral, Qwen2/Qwen3 and
 * GPT-2 style files use):
 *   model          BPE (merges as "a b" strings or [a, b] pairs; byte_fallback,
 *                  unk_token + fuse_unk, ignore_merges,
 *                  continuing_subword_prefix, end_of_word_suffix)
 *   added_tokens   matched in the raw text before everything else (special
 *                  or normalized: false) or in the normalized text
 *                  (normalized: true); lstrip, rstrip, single_word
 *   normalizer     Sequence, Prepend, Replace, NFC, NFD, NFKC, NFKD,
 *                  Lowercase, Strip, StripAccents
 *   pre_tokenizer  Sequence, Split (String or Regex pattern, every
 *                  behaviour, invert), ByteLevel, Metaspace, Digits
 *   post_processor Sequence, TemplateProcessing, ByteLevel, BertProcessing,
 *                  RobertaProcessing (applied when add_special is set)
 *   decoder        Sequence, ByteLevel, Replace, ByteFallback, Fuse, Strip,
 *                  Metaspace
 * Anything else (a WordPiece or Unigram model, a Precompiled normalizer,
 * truncation or padding, BPE dropout, ...) fails to load with one line
 * naming the feature: never a silently different tokenization.
 *
 * Regexes run on PCRE2 (UTF + Unicode properties, JIT when available);
 * Unicode normalization uses utf8proc. Link with -lpcre2-8 -lutf8proc -lcjson.
 *
 * Conventions as in centrifuge.h: functions return 0 / -1 (or NULL) and
 * cf_last_error() holds one line on failure. A cf_tokenizer keeps scratch
 * space and a cache, so two threads must not encode or decode with the same
 * one at once: load one per thread.
 */
#ifndef CENTRIFUGE_TOKENIZER_H
#define CENTRIFUGE_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "centrifuge.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cf_tokenizer cf_tokenizer;

/* Loads a tokenizer.json, or the tokenizer.json inside a directory. The BOS
 * and EOS tokens come from a tokenizer_config.json beside it (bos_token,
 * eos_token) when there is one, else from well-known names (<s>,
 * <|begin_of_text|>, </s>, <|end_of_text|>, <|endoftext|>, ...), as
 * tools/prepare_data.py finds them. NULL on failure. */
cf_tokenizer *cf_tokenizer_load(const char *path_or_dir);
void cf_tokenizer_free(cf_tokenizer *tok);

/* The tokenizer.json actually read (a directory argument resolved). */
const char *cf_tokenizer_path(const cf_tokenizer *tok);

/* Encodes len bytes of UTF-8 text (not NUL-terminated; invalid UTF-8 fails,
 * naming the byte offset). add_special applies the post-processor (e.g. the
 * BOS that a TemplateProcessing adds), as add_special_tokens=True does in
 * `tokenizers`. *ids is allocated with malloc (free it); *n is its length. */
int cf_tokenizer_encode(cf_tokenizer *tok, const char *text, size_t len, int add_special, uint32_t **ids,
                        size_t *n);
/* The same, appending to a caller-owned growable array: *ids (malloc'd or
 * NULL) holds *n ids in room for *cap; it is grown with realloc as needed. */
int cf_tokenizer_encode_append(cf_tokenizer *tok, const char *text, size_t len, int add_special, uint32_t **ids,
                               size_t *n, size_t *cap);

/* Decodes ids to UTF-8 text through the tokenizer's decoder (byte-level
 * tokens that do not form whole characters become U+FFFD, as in
 * `tokenizers`). skip_special drops special tokens (HF
 * skip_special_tokens). An id with no token fails. *text is malloc'd and
 * NUL-terminated; *len (optional) excludes the NUL. */
int cf_tokenizer_decode(cf_tokenizer *tok, const uint32_t *ids, size_t n, int skip_special, char **text,
                        size_t *len);

/* Vocabulary size with the added tokens, as get_vocab_size(True) in
 * `tokenizers` (the number of distinct tokens). */
int cf_tokenizer_vocab_size(const cf_tokenizer *tok);
/* One more than the largest token id (the smallest embedding table that
 * holds every id). */
int cf_tokenizer_max_id(const cf_tokenizer *tok);
/* The id of a token string (added tokens first, then the model's
 * vocabulary), or -1 if there is none (cf_last_error is not set). */
int cf_tokenizer_token_id(const cf_tokenizer *tok, const char *token);
/* The token string of an id (NUL-terminated, owned by tok), or NULL. */
const char *cf_tokenizer_id_token(const cf_tokenizer *tok, uint32_t id);
/* 1 if the id is a special added token, else 0. */
int cf_tokenizer_is_special(const cf_tokenizer *tok, uint32_t id);
/* BOS / EOS ids, -1 if unknown (see cf_tokenizer_load). */
int cf_tokenizer_bos_id(const cf_tokenizer *tok);
int cf_tokenizer_eos_id(const cf_tokenizer *tok);
/* Length of the valid UTF-8 prefix of s[0, n) (n if all of it is valid;
 * overlong forms, surrogates and code points above U+10FFFF are invalid,
 * as Python's strict decoder has them). */
size_t cf_utf8_valid_prefix(const char *s, size_t n);

#ifdef __cplusplus
}
#endif

#endif /* CENTRIFUGE_TOKENIZER_H */
