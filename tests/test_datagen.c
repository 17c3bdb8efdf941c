/*
 * test_datagen.c — the synthetic math world: tokenizer, clean and noisy
 * sources, evaluation problems, answer parsing.
 *
 * Documents are checked by re-deriving their arithmetic from the text alone:
 * a problem document is "Q: <question>?\nA: <steps> The answer is N.\n", each
 * step "x op y = z.", the intermediate result of a two-step problem is the
 * left operand of step 2, and the numbers in the question are exactly the
 * leaf operands of the steps. The true answer is computed from the leaf
 * operands; a document is right iff its stated answer equals the true one.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/common.h"
#include "cmd/datagen.h"
#include "test.h"

/* ------------------------------------------------------------- helpers */

static uint32_t *gen(cf_data_source src, uint64_t seed, int64_t n) {
    uint32_t *t = malloc((size_t)n * sizeof *t);
    if (!t) { printf("out of memory\n"); exit(1); }
    if (cf_datagen_tokens(src, seed, n, t) != 0) {
        printf("cf_datagen_tokens failed: %s\n", cf_last_error());
        exit(1);
    }
    return t;
}

/* Calls fn(text, ctx) for every complete document (BOS ... EOS) in tokens,
 * text without the specials; returns the number of complete documents and
 * counts format violations (a special inside a document, text outside one,
 * an id >= CF_TOK_VOCAB) in *bad. */
typedef void (*doc_fn)(const char *text, void *ctx);
static int for_each_doc(const uint32_t *t, int64_t n, doc_fn fn, void *ctx, int *bad) {
    static char doc[8192];
    int ndocs = 0, len = -1;   /* -1: outside a document */
    *bad = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t id = t[i];
        if (id == CF_TOK_BOS) {
            if (len != -1) (*bad)++;          /* BOS inside a document */
            len = 0;
        } else if (id == CF_TOK_EOS) {
            if (len <= 0) { (*bad)++; len = -1; continue; }
            doc[len] = 0;
            if (fn) fn(doc, ctx);
            ndocs++;
            len = -1;
        } else if (id >= 256 || id == 0 || len < 0 || len >= (int)sizeof doc - 1) {
            (*bad)++;
        } else {
            doc[len++] = (char)id;
        }
    }
    return ndocs;
}

/* Reads an optionally negative integer at *s. */
static int eat_long(const char **s, long *v) {
    char *end;
    if (!(**s == '-' || (**s >= '0' && **s <= '9'))) return -1;
    *v = strtol(*s, &end, 10);
    if (end == *s) return -1;
    *s = end;
    return 0;
}

static int eat(const char **s, const char *lit) {
    size_t n = strlen(lit);
    if (strncmp(*s, lit, n) != 0) return -1;
    *s += n;
    return 0;
}

static long apply(char op, long x, long y) {
    return op == '+' ? x + y : op == '-' ? x - y : x * y;
}

static int cmp_long(const void *a, const void *b) {
    long x = *(const long *)a, y = *(const long *)b;
    return (x > y) - (x < y);
}

typedef struct {
    int nsteps;
    char op[2];
    long x[2], y[2], z[2];
    long stated;         /* N of "The answer is N."                      */
    long truth;          /* the answer computed from the leaf operands    */
    int steps_right;     /* every step as written is correct              */
    int numbers_match;   /* numbers in the question == leaf operands      */
    int family;
    int question_len;    /* bytes of "Q: ...?\n"                          */
} parsed;

/* Parses a problem document; 0 if it is well formed. */
static int parse_problem(const char *doc, parsed *p) {
    memset(p, 0, sizeof *p);
    if (strncmp(doc, "Q: ", 3) != 0) return -1;
    const char *a = strstr(doc, "\nA: ");
    if (!a || a == doc + 3 || a[-1] != '?') return -1;
    p->question_len = (int)(a - doc) + 1;
    const char *s = a + 4;
    for (;;) {
        if (p->nsteps == 2) return -1;
        int i = p->nsteps++;
        if (eat_long(&s, &p->x[i]) || *s++ != ' ') return -1;
        p->op[i] = *s++;
        if (!(p->op[i] == '+' || p->op[i] == '-' || p->op[i] == '*')) return -1;
        if (*s++ != ' ' || eat_long(&s, &p->y[i]) || eat(&s, " = ") || eat_long(&s, &p->z[i]) ||
            eat(&s, ". "))
            return -1;
        if (eat(&s, "The answer is ") == 0) break;
    }
    if (eat_long(&s, &p->stated) || strcmp(s, ".\n") != 0) return -1;
    if (p->stated != p->z[p->nsteps - 1]) return -1;
    if (p->nsteps == 2 && p->x[1] != p->z[0]) return -1;

    p->steps_right = 1;
    for (int i = 0; i < p->nsteps; i++)
        if (apply(p->op[i], p->x[i], p->y[i]) != p->z[i]) p->steps_right = 0;
    p->truth = apply(p->op[0], p->x[0], p->y[0]);
    if (p->nsteps == 2) p->truth = apply(p->op[1], p->truth, p->y[1]);
    p->family = p->nsteps == 2 ? CF_FAM_TWOSTEP
              : p->op[0] == '+' ? CF_FAM_ADD : p->op[0] == '-' ? CF_FAM_SUB : CF_FAM_MUL;

    long qn[16], leaf[3] = {p->x[0], p->y[0], p->y[1]};
    int nq = 0, nleaf = p->nsteps + 1;
    for (const char *q = doc; q < a; q++) {
        if (*q >= '0' && *q <= '9' && (q == doc || q[-1] < '0' || q[-1] > '9')) {
            if (nq == 16) return -1;
            qn[nq++] = strtol(q, NULL, 10);
        }
    }
    qsort(qn, (size_t)nq, sizeof qn[0], cmp_long);
    qsort(leaf, (size_t)nleaf, sizeof leaf[0], cmp_long);
    p->numbers_match = nq == nleaf && memcmp(qn, leaf, (size_t)nq * sizeof qn[0]) == 0;
    return 0;
}

/* Noisy-source categories, told apart by markers. */
enum { K_RIGHT, K_WRONG, K_SPAM, K_DIGITS, K_UNRELATED, K_MALFORMED, K_COUNT };
static const char *const K_NAMES[K_COUNT] = {"right", "wrong", "spam", "digits", "unrelated", "malformed"};

static int classify(const char *doc) {
    size_t len = strlen(doc);
    if (len == 0 || doc[len - 1] != '\n' || strchr(doc, '{') || strchr(doc, '}')) return K_MALFORMED;
    if (strncmp(doc, "Q: ", 3) == 0) {
        parsed p;
        if (parse_problem(doc, &p) != 0 || !p.numbers_match) return K_MALFORMED;
        if (p.stated == p.truth) return p.steps_right ? K_RIGHT : K_MALFORMED;
        return K_WRONG;
    }
    if (strspn(doc, "0123456789 \n") == len) return K_DIGITS;
    if (strstr(doc, "!!!") || strstr(doc, "cookie") || strstr(doc, " | ")) return K_SPAM;
    if (strstr(doc, "Q:") || strstr(doc, "The answer is")) return K_MALFORMED;
    return K_UNRELATED;
}

/* --------------------------------------------------------------- tokenizer */

TEST(tokenizer_round_trips_every_byte_and_decode_skips_bos_eos) {
    char text[256];
    for (int i = 0; i < 255; i++) text[i] = (char)(i + 1);   /* bytes 1..255 */
    text[255] = 0;
    uint32_t ids[300];
    int n = cf_tok_encode(text, ids, 300);
    CHECK(n == 255);
    for (int i = 0; i < n; i++) CHECK(ids[i] == (uint32_t)(i + 1));

    uint32_t framed[260];
    framed[0] = CF_TOK_BOS;
    memcpy(framed + 1, ids, 255 * sizeof ids[0]);
    framed[256] = CF_TOK_EOS;
    char back[300];
    CHECK(cf_tok_decode(framed, 257, back, (int)sizeof back) == 255);
    CHECK(memcmp(back, text, 256) == 0);   /* including the NUL */

    const char *utf8 = "Zoë has 3 crêpes → 3.\n";
    n = cf_tok_encode(utf8, ids, 300);
    CHECK(n == (int)strlen(utf8));
    CHECK(cf_tok_decode(ids, n, back, (int)sizeof back) == n && strcmp(back, utf8) == 0);
    CHECK(CF_TOK_VOCAB == 258 && CF_TOK_BOS == 256 && CF_TOK_EOS == 257);
}

TEST(tokenizer_respects_caps_and_always_nul_terminates) {
    uint32_t ids[4];
    CHECK(cf_tok_encode("abcdef", ids, 4) == 4 && ids[3] == 'd');
    CHECK(cf_tok_encode("abc", ids, 0) == 0);
    CHECK(cf_tok_encode("", ids, 4) == 0);
    uint32_t src[5] = {'h', CF_TOK_EOS, 'e', 'y', 'o'};
    char out[4] = {'x', 'x', 'x', 'x'};
    CHECK(cf_tok_decode(src, 5, out, 4) == 3 && strcmp(out, "hey") == 0);
    char one[1] = {'x'};
    CHECK(cf_tok_decode(src, 5, one, 1) == 0 && one[0] == 0);
    CHECK(cf_tok_decode(src, 0, out, 4) == 0 && out[0] == 0);
}

/* ------------------------------------------------------------- determinism */

TEST(same_seed_gives_identical_tokens_and_different_seed_differs) {
    const int64_t n = 200000;
    for (int src = 0; src < 2; src++) {
        uint32_t *a = gen((cf_data_source)src, 7, n), *b = gen((cf_data_source)src, 7, n);
        uint32_t *c = gen((cf_data_source)src, 8, n);
        CHECK(memcmp(a, b, (size_t)n * sizeof *a) == 0);
        int64_t differ = 0;
        for (int64_t i = 0; i < n; i++) differ += a[i] != c[i];
        CHECK_MSG(differ > n / 2, "source %d: seeds 7 and 8 differ at only %lld of %lld positions",
                  src, (long long)differ, (long long)n);
        free(a); free(b); free(c);
    }
    /* Clean and noisy are independent streams even for the same seed. */
    uint32_t *cl = gen(CF_DATA_CLEAN, 7, 1000), *no = gen(CF_DATA_NOISY, 7, 1000);
    CHECK(memcmp(cl, no, 1000 * sizeof *cl) != 0);
    free(cl); free(no);
}

TEST(shorter_request_is_a_prefix_of_a_longer_one) {
    uint32_t *big = gen(CF_DATA_NOISY, 3, 100000);
    const int64_t cuts[] = {1, 2, 17, 999, 54321};
    for (int k = 0; k < 5; k++) {
        uint32_t *small = gen(CF_DATA_NOISY, 3, cuts[k]);
        CHECK(memcmp(small, big, (size_t)cuts[k] * sizeof *small) == 0);
        free(small);
    }
    free(big);
}

/* ----------------------------------------------------------------- format */

TEST(documents_are_bos_text_eos_back_to_back_and_the_last_is_cut_at_n) {
    for (int src = 0; src < 2; src++) {
        const int64_t n = 300001;
        uint32_t *t = gen((cf_data_source)src, 11, n);
        CHECK(t[0] == CF_TOK_BOS);
        int bad;
        int ndocs = for_each_doc(t, n, NULL, NULL, &bad);
        CHECK_MSG(bad == 0, "source %d: %d format violations", src, bad);
        CHECK(ndocs > 1000);
        /* Back to back: every EOS is followed by BOS. */
        int64_t eos = 0, eos_then_bos = 0, bos = 0;
        for (int64_t i = 0; i < n; i++) {
            if (t[i] == CF_TOK_EOS) eos++;
            if (t[i] == CF_TOK_EOS && i + 1 < n) eos_then_bos += t[i + 1] == CF_TOK_BOS;
            bos += t[i] == CF_TOK_BOS;
        }
        CHECK(eos == ndocs);
        CHECK(eos_then_bos == eos - (t[n - 1] == CF_TOK_EOS));
        /* Exactly n tokens: the tail after the last EOS is one cut document. */
        CHECK(t[n - 1] == CF_TOK_EOS ? bos == ndocs : bos == ndocs + 1);
        free(t);
    }
    CHECK(cf_datagen_tokens(CF_DATA_CLEAN, 1, 0, NULL) == 0);
    uint32_t one;
    CHECK(cf_datagen_tokens(CF_DATA_CLEAN, 1, 1, &one) == 0 && one == CF_TOK_BOS);
}

TEST(bad_arguments_fail_with_a_message) {
    uint32_t t[4];
    CHECK(cf_datagen_tokens(CF_DATA_CLEAN, 1, -1, t) == -1 && strstr(cf_last_error(), "negative"));
    CHECK(cf_datagen_tokens((cf_data_source)5, 1, 4, t) == -1 && strstr(cf_last_error(), "source"));
    CHECK(cf_datagen_tokens(CF_DATA_CLEAN, 1, 4, NULL) == -1);
}

/* ----------------------------------------------------------- clean source */

typedef struct {
    int docs, malformed, wrong, bad_numbers, negative;
    int family[CF_NUM_FAMILIES];
    int max_len;
    char first[3][512];
} clean_stats;

static void clean_visit(const char *doc, void *ctx) {
    clean_stats *st = ctx;
    parsed p;
    if (st->docs < 3) snprintf(st->first[st->docs], sizeof st->first[0], "%s", doc);
    st->docs++;
    int len = (int)strlen(doc);
    if (len > st->max_len) st->max_len = len;
    if (parse_problem(doc, &p) != 0) { st->malformed++; return; }
    if (!p.steps_right || p.stated != p.truth) st->wrong++;
    if (!p.numbers_match) st->bad_numbers++;
    if (p.stated < 0) st->negative++;
    st->family[p.family]++;
}

TEST(every_clean_document_has_correct_arithmetic_and_ends_in_the_answer) {
    const int64_t n = 1000000;
    uint32_t *t = gen(CF_DATA_CLEAN, 1, n);
    clean_stats st;
    memset(&st, 0, sizeof st);
    int bad;
    for_each_doc(t, n, clean_visit, &st, &bad);
    CHECK(bad == 0);
    CHECK(st.docs > 5000);
    CHECK_MSG(st.malformed == 0, "%d of %d clean documents are not well-formed problems", st.malformed, st.docs);
    CHECK_MSG(st.wrong == 0, "%d clean documents have wrong arithmetic", st.wrong);
    CHECK_MSG(st.bad_numbers == 0, "%d clean documents: question numbers != operands", st.bad_numbers);
    CHECK(st.negative == 0);
    CHECK(st.max_len < 300);
    printf("    clean samples:\n");
    for (int i = 0; i < 3; i++) printf("      %s", st.first[i]);
    free(t);
}

typedef struct {
    int family[CF_NUM_FAMILIES];
    /* distinct question skeletons (digits removed), per family */
    uint64_t skel[CF_NUM_FAMILIES][4096];
    int nskel[CF_NUM_FAMILIES];
    long max_operand, max_answer;
} variety;

static void variety_visit(const char *doc, void *ctx) {
    variety *v = ctx;
    parsed p;
    if (parse_problem(doc, &p) != 0) return;
    v->family[p.family]++;
    long leaf[3] = {p.x[0], p.y[0], p.nsteps == 2 ? p.y[1] : 0};
    for (int i = 0; i < 3; i++) if (leaf[i] > v->max_operand) v->max_operand = leaf[i];
    if (p.stated > v->max_answer) v->max_answer = p.stated;
    uint64_t h = CF_FNV_INIT;
    for (int i = 0; i < p.question_len; i++)
        if (doc[i] < '0' || doc[i] > '9') h = cf_fnv1a(h, doc + i, 1);
    int f = p.family;
    for (int i = 0; i < v->nskel[f]; i++) if (v->skel[f][i] == h) return;
    if (v->nskel[f] < 4096) v->skel[f][v->nskel[f]++] = h;
}

TEST(clean_stream_covers_all_families_evenly_with_many_surface_forms_and_small_numbers) {
    const int64_t n = 500000;
    uint32_t *t = gen(CF_DATA_CLEAN, 5, n);
    static variety v;
    memset(&v, 0, sizeof v);
    int bad;
    int ndocs = for_each_doc(t, n, variety_visit, &v, &bad);
    for (int f = 0; f < CF_NUM_FAMILIES; f++) {
        double share = (double)v.family[f] / ndocs;
        CHECK_MSG(share > 0.20 && share < 0.30, "family %s has share %.3f", cf_family_name(f), share);
        /* names x objects x wordings: far more than a handful of skeletons */
        CHECK_MSG(v.nskel[f] > 500, "family %s has only %d question skeletons", cf_family_name(f), v.nskel[f]);
    }
    CHECK(v.max_operand <= 99);
    CHECK(v.max_answer <= 198);
    free(t);
}

/* ----------------------------------------------------------- noisy source */

typedef struct {
    int count[K_COUNT];
    char sample[K_COUNT][600];
    int wrong_too_far, wrong_negative;
} noisy_stats;

static void noisy_visit(const char *doc, void *ctx) {
    noisy_stats *st = ctx;
    int k = classify(doc);
    if (st->count[k] == 0) snprintf(st->sample[k], sizeof st->sample[k], "%s", doc);
    st->count[k]++;
    if (k == K_WRONG) {
        parsed p;
        parse_problem(doc, &p);
        if (p.stated < 0) st->wrong_negative++;
        /* a miscomputed step is off by at most 10, times the multiplier of a
         * later "* c" step (c <= 5) */
        if (labs(p.stated - p.truth) > 50) st->wrong_too_far++;
    }
}

TEST(noisy_stream_mixes_categories_at_the_stated_rates) {
    const int64_t n = 2000000;
    uint32_t *t = gen(CF_DATA_NOISY, 1, n);
    noisy_stats st;
    memset(&st, 0, sizeof st);
    int bad;
    int ndocs = for_each_doc(t, n, noisy_visit, &st, &bad);
    CHECK(bad == 0);
    CHECK(ndocs > 8000);
    const double want[K_COUNT] = {0.35, 0.20, 0.15, 0.15, 0.15, 0.0};
    printf("    noisy mix over %d documents:", ndocs);
    for (int k = 0; k < K_COUNT; k++) {
        double share = (double)st.count[k] / ndocs;
        printf(" %s %.3f", K_NAMES[k], share);
        CHECK_MSG(fabs(share - want[k]) < 0.02, "%s: share %.3f, want %.2f", K_NAMES[k], share, want[k]);
    }
    printf("\n");
    CHECK(st.count[K_MALFORMED] == 0);
    if (st.count[K_MALFORMED]) printf("    malformed: %s", st.sample[K_MALFORMED]);
    printf("    noisy samples:\n");
    for (int k = 0; k < K_MALFORMED; k++) printf("      [%s] %s", K_NAMES[k], st.sample[k]);
    free(t);
}

TEST(noisy_wrong_problems_state_a_wrong_but_plausible_answer) {
    /* classify() calls a problem wrong iff its stated answer differs from the
     * one computed from the question's own numbers; the share test above
     * shows about 20% are. Here: they look like real problems otherwise. */
    const int64_t n = 1000000;
    uint32_t *t = gen(CF_DATA_NOISY, 2, n);
    noisy_stats st;
    memset(&st, 0, sizeof st);
    int bad;
    int ndocs = for_each_doc(t, n, noisy_visit, &st, &bad);
    CHECK(st.count[K_WRONG] > ndocs / 8);
    CHECK(st.wrong_negative == 0);
    CHECK(st.wrong_too_far == 0);
    CHECK(st.count[K_MALFORMED] == 0);
    free(t);
}

/* ------------------------------------------------------------- evaluation */

TEST(eval_problems_are_clean_documents_whose_solution_parses_to_the_answer) {
    enum { N = 400 };
    static cf_problem ps[N];
    cf_datagen_eval_problems(1, N, ps);
    char doc[600];
    for (int i = 0; i < N; i++) {
        const cf_problem *p = &ps[i];
        size_t pl = strlen(p->prompt), sl = strlen(p->solution);
        CHECK(strncmp(p->prompt, "Q: ", 3) == 0);
        CHECK(pl >= 4 && pl < sizeof p->prompt - 1 && strcmp(p->prompt + pl - 4, "?\nA:") == 0);
        CHECK(sl > 2 && sl < sizeof p->solution - 1 && p->solution[0] == ' ');
        snprintf(doc, sizeof doc, "%s%s", p->prompt, p->solution);
        parsed q;
        CHECK_MSG(parse_problem(doc, &q) == 0, "eval problem %d does not parse: %s", i, doc);
        CHECK(q.steps_right && q.numbers_match);
        CHECK(q.stated == p->answer && q.truth == p->answer);
        CHECK(q.family == p->family);
        long ans = -12345;
        CHECK(cf_parse_answer(p->solution, &ans) == 0 && ans == p->answer);
        CHECK(cf_parse_answer(doc, &ans) == 0 && ans == p->answer);
    }
    printf("    eval samples:\n");
    for (int i = 0; i < 4; i++) printf("      [%s] %s|%s", cf_family_name(ps[i].family), ps[i].prompt, ps[i].solution);
}

TEST(eval_problems_are_deterministic_distinct_and_round_robin_over_families) {
    enum { N = 1000 };
    static cf_problem a[N], b[N], c[N];
    cf_datagen_eval_problems(3, N, a);
    cf_datagen_eval_problems(3, N, b);
    cf_datagen_eval_problems(4, N, c);
    CHECK(memcmp(a, b, sizeof a) == 0);
    int same = 0;
    for (int i = 0; i < N; i++) same += strcmp(a[i].prompt, c[i].prompt) == 0;
    CHECK(same < N / 20);
    for (int i = 0; i < N; i++) CHECK(a[i].family == i % CF_NUM_FAMILIES);
    int dups = 0;
    for (int i = 0; i < N; i++)
        for (int j = i + 1; j < N; j++) dups += strcmp(a[i].prompt, a[j].prompt) == 0;
    CHECK_MSG(dups == 0, "%d duplicate eval prompts", dups);
    /* A prefix of a longer request is the shorter request. */
    static cf_problem d[10];
    cf_datagen_eval_problems(3, 10, d);
    CHECK(memcmp(d, a, sizeof d) == 0);
}

/* Disjointness means: no evaluation question ("Q: ...?\n", which fixes the
 * whole clean document) occurs in any training stream, for any seed, clean or
 * noisy, right or wrong — while the arithmetic facts of evaluation problems
 * do occur in training (the split is by wording, not by arithmetic). The
 * streams are large enough that, without the split, questions of the small
 * mul family would collide (checked by temporarily disabling the split). */
typedef struct { uint64_t *h; int n, cap; } hash_list;

static void hl_add(hash_list *l, const char *s, size_t len) {
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 4096;
        l->h = realloc(l->h, (size_t)l->cap * sizeof *l->h);
        if (!l->h) { printf("out of memory\n"); exit(1); }
    }
    l->h[l->n++] = cf_fnv1a(CF_FNV_INIT, s, len);
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

static int hl_has(const hash_list *l, const char *s, size_t len) {
    uint64_t h = cf_fnv1a(CF_FNV_INIT, s, len);
    return bsearch(&h, l->h, (size_t)l->n, sizeof h, cmp_u64) != NULL;
}

typedef struct { hash_list questions, first_steps; } training_index;

/* Indexes the question ("Q: ...?\n") and first step ("23 + 19 = 42.") of
 * every problem document. */
static void index_visit(const char *doc, void *ctx) {
    training_index *ix = ctx;
    const char *a = strncmp(doc, "Q: ", 3) == 0 ? strstr(doc, "\nA: ") : NULL;
    if (!a) return;
    hl_add(&ix->questions, doc, (size_t)(a - doc) + 1);
    const char *step = a + 4, *dot = strchr(step, '.');
    if (dot) hl_add(&ix->first_steps, step, (size_t)(dot - step) + 1);
}

TEST(eval_questions_never_appear_in_training_streams_of_any_seed) {
    enum { N = 400 };
    static cf_problem ps[N];
    cf_datagen_eval_problems(1, N, ps);
    struct { cf_data_source src; uint64_t seed; int64_t n; } streams[] = {
        {CF_DATA_CLEAN, 2, 10000000}, {CF_DATA_CLEAN, 1, 1000000}, {CF_DATA_NOISY, 1, 2000000},
    };
    for (int s = 0; s < 3; s++) {
        uint32_t *t = gen(streams[s].src, streams[s].seed, streams[s].n);
        training_index ix;
        memset(&ix, 0, sizeof ix);
        int bad;
        for_each_doc(t, streams[s].n, index_visit, &ix, &bad);
        free(t);
        qsort(ix.questions.h, (size_t)ix.questions.n, sizeof(uint64_t), cmp_u64);
        qsort(ix.first_steps.h, (size_t)ix.first_steps.n, sizeof(uint64_t), cmp_u64);
        int found = 0, facts = 0;
        for (int i = 0; i < N; i++) {
            found += hl_has(&ix.questions, ps[i].prompt, strlen(ps[i].prompt) - 2);   /* drop "A:" */
            const char *step = ps[i].solution + 1, *dot = strchr(step, '.');
            facts += hl_has(&ix.first_steps, step, (size_t)(dot - step) + 1);
        }
        CHECK_MSG(found == 0, "stream %d: %d of %d eval questions occur verbatim", s, found, N);
        /* Not vacuous: the training stream covers the same problem space. */
        if (s == 0) CHECK_MSG(facts > N / 2, "only %d of %d eval first steps occur in training", facts, N);
        free(ix.questions.h);
        free(ix.first_steps.h);
    }
}

/* ----------------------------------------------------------- answer parse */

TEST(parse_answer_takes_the_first_well_formed_integer_answer) {
    long v = 0;
    CHECK(cf_parse_answer("A: 23 + 19 = 42. The answer is 42.\n", &v) == 0 && v == 42);
    CHECK(cf_parse_answer("The answer is -7. The answer is 3.", &v) == 0 && v == -7);
    CHECK(cf_parse_answer("The answer is 0.", &v) == 0 && v == 0);
    CHECK(cf_parse_answer("The answer is x. The answer is 5.", &v) == 0 && v == 5);
    CHECK(cf_parse_answer("The answer is 4.5. The answer is 6.", &v) == 0 && v == 6);
    v = 99;
    CHECK(cf_parse_answer("The answer is 42", &v) == -1 && v == 99);
    CHECK(cf_parse_answer("The answer is -.", &v) == -1);
    CHECK(cf_parse_answer("The answer is  42.", &v) == -1);
    CHECK(cf_parse_answer("the answer is 42.", &v) == -1);
    CHECK(cf_parse_answer("The answer is 1234567890123456789012.", &v) == -1);
    CHECK(cf_parse_answer("", &v) == -1);
    CHECK(cf_parse_answer(NULL, &v) == -1);
}

TEST(data_source_parse_and_family_names) {
    cf_data_source s = CF_DATA_NOISY;
    CHECK(cf_data_source_parse("clean", &s) == 0 && s == CF_DATA_CLEAN);
    CHECK(cf_data_source_parse("noisy", &s) == 0 && s == CF_DATA_NOISY);
    CHECK(cf_data_source_parse("Clean", &s) == -1 && strstr(cf_last_error(), "Clean"));
    CHECK(cf_data_source_parse("", &s) == -1);
    CHECK(strcmp(cf_family_name(CF_FAM_ADD), "add") == 0);
    CHECK(strcmp(cf_family_name(CF_FAM_SUB), "sub") == 0);
    CHECK(strcmp(cf_family_name(CF_FAM_MUL), "mul") == 0);
    CHECK(strcmp(cf_family_name(CF_FAM_TWOSTEP), "twostep") == 0);
    CHECK(strcmp(cf_family_name(-1), "unknown") == 0 && strcmp(cf_family_name(4), "unknown") == 0);
}

/* The demo's small world: the same format and checks, one-digit operands,
 * short questions; setting it back restores the standard world exactly. */
typedef struct { int docs, bad, wrong, big, family[CF_NUM_FAMILIES], max_q; } small_stats;
static void small_visit(const char *doc, void *ctx) {
    small_stats *st = ctx;
    parsed p;
    st->docs++;
    if (parse_problem(doc, &p) != 0 || !p.numbers_match) { st->bad++; return; }
    if (!p.steps_right) st->wrong++;
    if (p.x[0] > 6 || p.y[0] > 6 || (p.nsteps == 2 && p.y[1] > 5)) st->big++;
    if (p.question_len > st->max_q) st->max_q = p.question_len;
    st->family[p.family]++;
}

TEST(small_world_has_one_digit_operands_short_questions_and_leaves_the_standard_world_alone) {
    const int64_t n = 200000;
    uint32_t *std0 = gen(CF_DATA_NOISY, 5, n);
    CHECK(cf_datagen_world() == CF_WORLD_STANDARD);
    cf_datagen_set_world(CF_WORLD_SMALL);
    uint32_t *t = gen(CF_DATA_CLEAN, 1, n);
    small_stats st;
    memset(&st, 0, sizeof st);
    int bad;
    for_each_doc(t, n, small_visit, &st, &bad);
    CHECK(bad == 0 && st.bad == 0 && st.wrong == 0 && st.big == 0);
    CHECK(st.docs > 2500);
    CHECK(st.max_q < 80);
    for (int f = 0; f < CF_NUM_FAMILIES; f++) CHECK(st.family[f] > st.docs / 6);
    cf_problem ps[16];
    cf_datagen_eval_problems(1, 16, ps);
    for (int i = 0; i < 16; i++) CHECK(ps[i].answer >= 0 && ps[i].answer <= 64 && strlen(ps[i].prompt) < 80);
    free(t);
    cf_datagen_set_world(CF_WORLD_STANDARD);
    uint32_t *std1 = gen(CF_DATA_NOISY, 5, n);
    CHECK(memcmp(std0, std1, (size_t)n * sizeof *std0) == 0);
    free(std0);
    free(std1);
    cf_world w;
    CHECK(cf_world_parse("small", &w) == 0 && w == CF_WORLD_SMALL);
    CHECK(cf_world_parse("big", &w) == -1 && strstr(cf_last_error(), "world"));
}

int main(void) {
    RUN(tokenizer_round_trips_every_byte_and_decode_skips_bos_eos);
    RUN(tokenizer_respects_caps_and_always_nul_terminates);
    RUN(same_seed_gives_identical_tokens_and_different_seed_differs);
    RUN(shorter_request_is_a_prefix_of_a_longer_one);
    RUN(documents_are_bos_text_eos_back_to_back_and_the_last_is_cut_at_n);
    RUN(bad_arguments_fail_with_a_message);
    RUN(every_clean_document_has_correct_arithmetic_and_ends_in_the_answer);
    RUN(clean_stream_covers_all_families_evenly_with_many_surface_forms_and_small_numbers);
    RUN(noisy_stream_mixes_categories_at_the_stated_rates);
    RUN(noisy_wrong_problems_state_a_wrong_but_plausible_answer);
    RUN(eval_problems_are_clean_documents_whose_solution_parses_to_the_answer);
    RUN(eval_problems_are_deterministic_distinct_and_round_robin_over_families);
    RUN(eval_questions_never_appear_in_training_streams_of_any_seed);
    RUN(parse_answer_takes_the_first_well_formed_integer_answer);
    RUN(data_source_parse_and_family_names);
    RUN(small_world_has_one_digit_operands_short_questions_and_leaves_the_standard_world_alone);
    return test_summary();
}
