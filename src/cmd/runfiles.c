/* runfiles.c — run directories and tokenizer files (runfiles.h). */
#include "cmd/runfiles.h"

#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/common.h"

static int is_dir(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

const char *cf_resolve_model_dir(const char *dir, char *out, size_t cap) {
    if (!dir) return dir;
    char cfg[4096], latest[4096];
    if (cf_path_join(cfg, sizeof cfg, dir, "config.json") != 0) return NULL;
    if (cf_path_join(latest, sizeof latest, dir, "latest") != 0) return NULL;
    if (cf_path_exists(cfg) || !cf_path_exists(latest)) return dir;
    char *name = cf_read_file(latest, NULL, 4096);
    if (!name) return NULL;
    name[strcspn(name, "\r\n")] = 0;
    if (!*name || strchr(name, '/')) {
        free(name);
        cf_fail("%s: does not name a checkpoint directory", latest);
        return NULL;
    }
    int rc = cf_path_join(out, cap, dir, name);
    free(name);
    if (rc != 0) return NULL;
    if (!is_dir(out)) {
        cf_fail("%s names %s, which is not a directory", latest, out);
        return NULL;
    }
    return out;
}

static const char *const TOKENIZER_FILES[] = {
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja",
};

static int copy_file(const char *from, const char *to) {
    size_t len = 0;
    char *buf = cf_read_file(from, &len, (size_t)1 << 31);
    if (!buf) return -1;
    int rc = cf_write_file_atomic(to, buf, len);
    free(buf);
    return rc;
}

int cf_copy_tokenizer_files(const char *src, const char *dst) {
    if (!src || !dst) return 0;
    char dir[4096];
    int copied = 0;
    if (!is_dir(src)) {
        /* a tokenizer.json file: it, and the tokenizer_config.json beside it */
        char to[4096];
        if (cf_path_join(to, sizeof to, dst, "tokenizer.json") != 0 || copy_file(src, to) != 0) return -1;
        copied++;
        snprintf(dir, sizeof dir, "%s", src);
        char *slash = strrchr(dir, '/');
        if (slash) *slash = 0;
        else snprintf(dir, sizeof dir, ".");
        char from[4096];
        if (cf_path_join(from, sizeof from, dir, "tokenizer_config.json") == 0 && cf_path_exists(from)) {
            if (cf_path_join(to, sizeof to, dst, "tokenizer_config.json") != 0 || copy_file(from, to) != 0) return -1;
            copied++;
        }
        return copied;
    }
    for (size_t i = 0; i < sizeof TOKENIZER_FILES / sizeof *TOKENIZER_FILES; i++) {
        char from[4096], to[4096];
        if (cf_path_join(from, sizeof from, src, TOKENIZER_FILES[i]) != 0) return -1;
        if (!cf_path_exists(from)) continue;
        if (cf_path_join(to, sizeof to, dst, TOKENIZER_FILES[i]) != 0) return -1;
        if (strcmp(from, to) == 0) continue;
        if (copy_file(from, to) != 0) return -1;
        copied++;
    }
    return copied;
}
