/*
 * datagen.c — the synthetic "math world": a byte tokenizer, a clean source of
 * arithmetic word problems with worked solutions, a noisy "web" source, and
 * held-out evaluation problems.
 *
 * Documents
 *   problem   "Q: Mia has 23 apples and buys 19 more. How many apples does
 *              she have now?\nA: 23 + 19 = 42. The answer is 42.\n"
 *   two-step  "...\nA: 5 * 3 = 15. 15 + 4 = 19. The answer is 19.\n"
 *             (the intermediate result is always the left operand of step 2)
 *   wrong     a problem whose final answer is wrong (one step miscomputed)
 *   spam      promotions ("!!!"), cookie notices ("cookie"), SEO keyword
 *             lists and navigation footers (" | ")
 *   digits    random digit groups separated by spaces and newlines
 *   unrelated sentences about weather, sports, recipes and town news
 * Noisy mix, per document: 35% clean problems, 20% wrong problems, 15% spam,
 * 15% digits, 15% unrelated. Every document is BOS + bytes + EOS.
 *
 * Held-out split. Evaluation must measure more than recall of a training
 * document, so the problem space is split by a hash of the question text:
 * a question is "held out" iff hash(question) % CF_HOLDOUT_MOD == 0. Training
 * streams (clean and noisy, right or wrong) never emit a held-out question;
 * evaluation problems are always held-out questions. So no evaluation
 * question ever appears verbatim in any training stream, whatever the seeds.
 * (The arithmetic facts themselves, e.g. "23 + 19 = 42", do occur in training
 * with other names, objects and wordings.) On top of that the evaluation RNG
 * stream is seeded with a different constant than the training streams.
 *
 * Everything is a pure function of the seed: the same seed gives the same
 * tokens, and a shorter request is a prefix of a longer one.
 */
#include "cmd/datagen.h"
#include "base/common.h"

#include <stdlib.h>
#include <string.h>

#define DOC_CAP 2048            /* longest document text is well below this   */
#define CF_HOLDOUT_MOD 16       /* 1/16 of all questions are evaluation-only   */

/* Stream constants: training sources and evaluation draw from different
 * RNG streams even for the same user seed. */
#define SEED_CLEAN 0x636c65616e000001ULL
#define SEED_NOISY 0x6e6f697379000002ULL
#define SEED_EVAL  0x6576616c00000003ULL

/* -------------------------------------------------------------- tokenizer */

int cf_tok_encode(const char *text, uint32_t *out, int cap) {
    if (!text || !out || cap <= 0) return 0;
    int n = 0;
    for (const unsigned char *p = (const unsigned char *)text; *p && n < cap; p++)
        out[n++] = *p;
    return n;
}

int cf_tok_decode(const uint32_t *ids, int n, char *out, int cap) {
    if (!out || cap <= 0) return 0;
    int len = 0;
    for (int i = 0; ids && i < n && len < cap - 1; i++)
        if (ids[i] < 256) out[len++] = (char)ids[i];   /* BOS, EOS, others skipped */
    out[len] = 0;
    return len;
}

static cf_world g_world = CF_WORLD_STANDARD;
void cf_datagen_set_world(cf_world w) { g_world = w; }
cf_world cf_datagen_world(void) { return g_world; }
int cf_world_parse(const char *s, cf_world *out) {
    if (s && strcmp(s, "standard") == 0) { *out = CF_WORLD_STANDARD; return 0; }
    if (s && strcmp(s, "small") == 0) { *out = CF_WORLD_SMALL; return 0; }
    return cf_fail("unknown world '%s' (expected standard or small)", s ? s : "(null)");
}

int cf_data_source_parse(const char *s, cf_data_source *out) {
    if (s && strcmp(s, "clean") == 0) { *out = CF_DATA_CLEAN; return 0; }
    if (s && strcmp(s, "noisy") == 0) { *out = CF_DATA_NOISY; return 0; }
    return cf_fail("unknown data source '%s' (expected clean or noisy)", s ? s : "(null)");
}

const char *cf_family_name(int family) {
    static const char *names[CF_NUM_FAMILIES] = {"add", "sub", "mul", "twostep"};
    return (family >= 0 && family < CF_NUM_FAMILIES) ? names[family] : "unknown";
}

/* ------------------------------------------------------------ text buffer */

/* A fixed-capacity text buffer. Documents are far shorter than DOC_CAP by
 * construction; on overflow the text is cut (never written past the end). */
typedef struct {
    char *buf;
    int len, cap;
} textbuf;

static void tb_putc(textbuf *tb, char c) {
    if (tb->len < tb->cap - 1) tb->buf[tb->len++] = c;
    tb->buf[tb->len] = 0;
}

static void tb_putn(textbuf *tb, const char *s, int n) {
    for (int i = 0; i < n; i++) tb_putc(tb, s[i]);
}

static void tb_puts(textbuf *tb, const char *s) {
    while (*s) tb_putc(tb, *s++);
}

static void tb_putl(textbuf *tb, long v) {
    char tmp[24];
    int n = 0;
    unsigned long u = v < 0 ? 0UL - (unsigned long)v : (unsigned long)v;
    do { tmp[n++] = (char)('0' + u % 10); u /= 10; } while (u);
    if (v < 0) tb_putc(tb, '-');
    while (n) tb_putc(tb, tmp[--n]);
}

/* ----------------------------------------------------------- word lists */

typedef struct { const char *name; int she; } person;

static const person PEOPLE[] = {
    {"Mia", 1}, {"Leo", 0}, {"Ava", 1}, {"Noah", 0}, {"Emma", 1}, {"Liam", 0},
    {"Zoe", 1}, {"Omar", 0}, {"Lily", 1}, {"Ben", 0}, {"Sara", 1}, {"Max", 0},
    {"Nina", 1}, {"Sam", 0}, {"Ella", 1}, {"Jack", 0}, {"Ruby", 1}, {"Tom", 0},
    {"Chloe", 1}, {"Ravi", 0}, {"Maya", 1}, {"Ivan", 0}, {"Amara", 1}, {"Kenji", 0},
};
#define N_PEOPLE ((int)(sizeof PEOPLE / sizeof PEOPLE[0]))

static const char *const OBJECTS[] = {
    "apples", "pencils", "marbles", "stickers", "books", "stamps", "shells", "cards",
    "balloons", "oranges", "coins", "beads", "flowers", "eggs", "candies", "crayons",
    "buttons", "rocks", "lemons", "toy cars", "muffins", "plums", "ribbons", "keys",
};
#define N_OBJECTS ((int)(sizeof OBJECTS / sizeof OBJECTS[0]))

/* ------------------------------------------------------- template expander */

/* Values for a template's slots. */
typedef struct {
    const person *n1, *n2;   /* {N} first person, {M} second person */
    const char *obj;         /* {o}                                 */
    long a, b, c;            /* {a} {b} {c}                         */
} slots;

/* Template syntax: "{X}" with one character is a slot —
 *   N M  names,  p P  she/he She/He (of N),  h  her/him (of N),  o  object,
 *   a b c  numbers;
 * "{x|y|z}" (two or more alternatives) picks one uniformly. Everything else is
 * copied. Templates are compile-time constants and always well formed. */
static void put_slot(textbuf *tb, char key, const slots *s) {
    switch (key) {
    case 'N': tb_puts(tb, s->n1->name); break;
    case 'M': tb_puts(tb, s->n2->name); break;
    case 'p': tb_puts(tb, s->n1->she ? "she" : "he"); break;
    case 'P': tb_puts(tb, s->n1->she ? "She" : "He"); break;
    case 'h': tb_puts(tb, s->n1->she ? "her" : "him"); break;
    case 'o': tb_puts(tb, s->obj); break;
    case 'a': tb_putl(tb, s->a); break;
    case 'b': tb_putl(tb, s->b); break;
    case 'c': tb_putl(tb, s->c); break;
    default: break;
    }
}

static void expand(textbuf *tb, cf_rng *r, const char *t, const slots *s) {
    while (*t) {
        if (*t != '{') { tb_putc(tb, *t++); continue; }
        const char *open = t + 1, *close = strchr(open, '}');
        if (close - open == 1) {
            put_slot(tb, *open, s);
        } else {
            int nalt = 1;
            for (const char *q = open; q < close; q++) nalt += (*q == '|');
            int pick = (int)cf_rng_below(r, (uint32_t)nalt);
            const char *alt = open;
            for (int k = 0; k < pick; k++) alt = strchr(alt, '|') + 1;
            const char *end = alt;
            while (end < close && *end != '|') end++;
            tb_putn(tb, alt, (int)(end - alt));
        }
        t = close + 1;
    }
}

static long range(cf_rng *r, long lo, long hi) {   /* uniform in [lo, hi] */
    return lo + (long)cf_rng_below(r, (uint32_t)(hi - lo + 1));
}

/* ----------------------------------------------------------------- problems */

/* Question templates. The question ends in "?"; the numbers in it are
 * exactly the leaf operands of the solution. */
static const char *const ADD_T[] = {
    "{N} has {a} {o} and {buys|gets|finds|picks up} {b} more. How many {o} does {p} have now?",
    "{N} picked {a} {o} in the morning and {b} {o} in the afternoon. How many {o} did {p} pick in total?",
    "There are {a} {o} in a {box|basket|bag|jar}. {N} puts {b} more {o} in it. How many {o} are in it now?",
    "{N} has {a} {o}. {M} gives {h} {b} more. How many {o} does {N} have now?",
    "{N} has {a} {o} and {M} has {b} {o}. How many {o} do they have {together|altogether|in total}?",
};
static const char *const SUB_T[] = {
    "{N} has {a} {o} and gives {b} of them to {M}. How many {o} does {p} have left?",
    "There were {a} {o} on the {table|shelf|desk}. {N} took {b} of them. How many {o} are left?",
    "{N} had {a} {o}. {P} lost {b} of them. How many {o} does {p} have now?",
    "A shop had {a} {o}. It sold {b} of them. How many {o} does the shop have left?",
    "{N} has {a} {o} and {M} has {b} fewer. How many {o} does {M} have?",
};
static const char *const MUL_T[] = {
    "{N} has {a} bags with {b} {o} in each bag. How many {o} does {p} have?",
    "There are {a} rows of {o} with {b} {o} in each row. How many {o} are there?",
    "{N} buys {a} packs of {o}. Each pack has {b} {o}. How many {o} did {p} buy?",
    "Each of {a} friends brings {b} {o}. How many {o} do they bring altogether?",
    "{N} {collects|saves|finds} {b} {o} every day for {a} days. How many {o} does {p} have then?",
};

/* Two-step templates: step 1 is a op1 b, step 2 is (result) op2 c. */
typedef struct { const char *text; char op1, op2; } twostep_tpl;
static const twostep_tpl TWO_T[] = {
    {"{N} has {a} boxes with {b} {o} in each box and {c} more {o} on the shelf. How many {o} does {p} have in total?", '*', '+'},
    {"{N} {buys|gets} {a} packs of {b} {o} and then finds {c} more {o}. How many {o} does {p} have now?", '*', '+'},
    {"{N} buys {a} packs of {o} with {b} {o} in each pack. {P} gives {c} of them to {M}. How many {o} does {N} have left?", '*', '-'},
    {"A shop has {a} shelves with {b} {o} on each shelf. It sells {c} of them. How many {o} are left?", '*', '-'},
    {"{N} has {a} {o} and {buys|gets|finds} {b} more. Then {p} gives {c} of them to {M}. How many {o} does {p} have now?", '+', '-'},
    {"There are {a} {o} in a basket. {N} adds {b} more and {M} takes {c} out. How many {o} are in the basket now?", '+', '-'},
    {"{N} had {a} {o} and lost {b} of them. Then {p} {bought|found|got} {c} more. How many {o} does {p} have now?", '-', '+'},
    {"{N} buys {a} red boxes and {b} blue boxes. Each box holds {c} {o}. How many {o} did {p} buy?", '+', '*'},
};

#define N_OF(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* The small world's questions: short, so that a tiny model sees many
 * problems per token and finds the operands near the answer. */
static const char *const ADD_S[] = {
    "{N} has {a} {o} and gets {b} more. How many?",
    "{a} {o} and {b} {o}. How many?",
};
static const char *const SUB_S[] = {
    "{N} has {a} {o} and loses {b}. How many?",
    "{a} {o}, {b} taken. How many left?",
};
static const char *const MUL_S[] = {
    "{a} bags of {b} {o}. How many?",
    "{N} has {a} boxes of {b} {o}. How many?",
};
static const twostep_tpl TWO_S[] = {
    {"{a} bags of {b} {o} and {c} more. How many?", '*', '+'},
    {"{N} has {a} {o}, gets {b} and loses {c}. How many?", '+', '-'},
};

typedef struct {
    int family;
    int nsteps;              /* 1 or 2                               */
    char op[2];
    long x[2], y[2], z[2];   /* step i: x[i] op[i] y[i] = z[i]       */
    long answer;             /* the stated answer (== z[nsteps-1])    */
} solution;

static long apply(char op, long x, long y) {
    switch (op) {
    case '+': return x + y;
    case '-': return x - y;
    default:  return x * y;
    }
}

/* A one- or two-digit operand in [2, 99], one digit about a third of the time. */
static long small_or_two_digit(cf_rng *r) {
    return cf_rng_below(r, 3) == 0 ? range(r, 2, 9) : range(r, 10, 99);
}

/* Writes the question "Q: ...?\nA:" (the evaluation prompt) into tb and the
 * correct solution into sol. */
static void gen_question(cf_rng *r, int family, textbuf *tb, solution *sol) {
    slots s;
    int i1 = (int)cf_rng_below(r, N_PEOPLE);
    int i2 = (i1 + 1 + (int)cf_rng_below(r, N_PEOPLE - 1)) % N_PEOPLE;   /* != i1 */
    s.n1 = &PEOPLE[i1];
    s.n2 = &PEOPLE[i2];
    s.obj = OBJECTS[cf_rng_below(r, N_OBJECTS)];
    s.a = s.b = s.c = 0;
    memset(sol, 0, sizeof *sol);
    sol->family = family;
    sol->nsteps = 1;

    const char *text;
    int small = g_world == CF_WORLD_SMALL;
    switch (family) {
    case CF_FAM_ADD:
        text = small ? ADD_S[cf_rng_below(r, N_OF(ADD_S))] : ADD_T[cf_rng_below(r, N_OF(ADD_T))];
        s.a = small ? range(r, 1, 5) : small_or_two_digit(r);
        s.b = small ? range(r, 1, 5) : small_or_two_digit(r);
        sol->op[0] = '+';
        break;
    case CF_FAM_SUB:
        text = small ? SUB_S[cf_rng_below(r, N_OF(SUB_S))] : SUB_T[cf_rng_below(r, N_OF(SUB_T))];
        s.a = small ? range(r, 2, 6) : cf_rng_below(r, 5) == 0 ? range(r, 3, 9) : range(r, 10, 99);
        s.b = range(r, 1, s.a - 1);
        sol->op[0] = '-';
        break;
    case CF_FAM_MUL:
        text = small ? MUL_S[cf_rng_below(r, N_OF(MUL_S))] : MUL_T[cf_rng_below(r, N_OF(MUL_T))];
        s.a = small ? range(r, 2, 4) : range(r, 2, 9);
        s.b = small ? range(r, 2, 4) : cf_rng_below(r, 2) == 0 ? range(r, 2, 9) : range(r, 10, 19);
        sol->op[0] = '*';
        break;
    default: {   /* CF_FAM_TWOSTEP */
        const twostep_tpl *t = small ? &TWO_S[cf_rng_below(r, N_OF(TWO_S))] : &TWO_T[cf_rng_below(r, N_OF(TWO_T))];
        text = t->text;
        sol->nsteps = 2;
        sol->op[0] = t->op1;
        sol->op[1] = t->op2;
        if (small) {                               /* one-digit steps  */
            s.a = range(r, 2, 4);
            s.b = range(r, 2, 4);
            long z = apply(t->op1, s.a, s.b);
            s.c = t->op2 == '-' ? range(r, 1, z - 1 < 5 ? z - 1 : 5) : t->op2 == '*' ? range(r, 2, 3) : range(r, 1, 5);
        } else if (t->op1 == '*') {                /* a*b then +/- c   */
            s.a = range(r, 2, 9);
            s.b = range(r, 2, 9);
            s.c = t->op2 == '+' ? range(r, 2, 20) : range(r, 1, s.a * s.b - 1);
        } else if (t->op1 == '+' && t->op2 == '-') {
            s.a = range(r, 2, 30);
            s.b = range(r, 2, 30);
            s.c = range(r, 1, s.a + s.b - 1);
        } else if (t->op1 == '-') {                /* a-b then + c     */
            s.a = range(r, 10, 50);
            s.b = range(r, 1, s.a - 1);
            s.c = range(r, 2, 30);
        } else {                                   /* (a+b) * c        */
            s.a = range(r, 2, 9);
            s.b = range(r, 2, 9);
            s.c = range(r, 2, 5);
        }
        break;
    }
    }

    sol->x[0] = s.a;
    sol->y[0] = s.b;
    sol->z[0] = apply(sol->op[0], s.a, s.b);
    if (sol->nsteps == 2) {
        sol->x[1] = sol->z[0];
        sol->y[1] = s.c;
        sol->z[1] = apply(sol->op[1], sol->x[1], s.c);
    }
    sol->answer = sol->z[sol->nsteps - 1];

    tb_puts(tb, "Q: ");
    expand(tb, r, text, &s);
    tb_puts(tb, "\nA:");
}

/* Makes the final answer wrong: one step is miscomputed by a small amount
 * (1..9, or 10 like a dropped carry); a wrong first step propagates. The
 * result differs from the true answer and stays non-negative. */
static void corrupt(cf_rng *r, solution *sol) {
    int step = (int)cf_rng_below(r, (uint32_t)sol->nsteps);
    long delta = cf_rng_below(r, 5) == 0 ? 10 : range(r, 1, 9);
    for (int attempt = 0; attempt < 2; attempt++) {
        long d = (attempt == 0 && cf_rng_below(r, 2)) ? -delta : delta;
        solution w = *sol;
        w.z[step] += d;
        if (step == 0 && w.nsteps == 2) {
            w.x[1] = w.z[0];
            w.z[1] = apply(w.op[1], w.x[1], w.y[1]);
        }
        w.answer = w.z[w.nsteps - 1];
        if (w.z[step] >= 0 && w.answer >= 0 && w.answer != sol->answer) { *sol = w; return; }
    }
    /* Unreachable in practice: a positive delta always works. Fall back to it. */
    sol->z[sol->nsteps - 1] += delta;
    sol->answer = sol->z[sol->nsteps - 1];
}

/* " 23 + 19 = 42. The answer is 42.\n" */
static void put_solution(textbuf *tb, const solution *sol) {
    for (int i = 0; i < sol->nsteps; i++) {
        tb_putc(tb, ' ');
        tb_putl(tb, sol->x[i]);
        tb_putc(tb, ' ');
        tb_putc(tb, sol->op[i]);
        tb_putc(tb, ' ');
        tb_putl(tb, sol->y[i]);
        tb_puts(tb, " = ");
        tb_putl(tb, sol->z[i]);
        tb_putc(tb, '.');
    }
    tb_puts(tb, " The answer is ");
    tb_putl(tb, sol->answer);
    tb_puts(tb, ".\n");
}

static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static uint64_t question_hash(const char *q, int len) {
    return mix64(cf_fnv1a(CF_FNV_INIT, q, (size_t)len));
}

static int is_held_out(const char *q, int len) {
    return question_hash(q, len) % CF_HOLDOUT_MOD == 0;
}

/* A training problem (never a held-out question), appended to tb. */
static void gen_training_problem(cf_rng *r, textbuf *tb, int wrong) {
    int family = (int)cf_rng_below(r, CF_NUM_FAMILIES);
    int start = tb->len;
    solution sol;
    for (;;) {
        tb->len = start;
        gen_question(r, family, tb, &sol);
        if (!is_held_out(tb->buf + start, tb->len - start)) break;
    }
    if (wrong) corrupt(r, &sol);
    put_solution(tb, &sol);
}

/* -------------------------------------------------------------- web noise */

static const char *const PROMO_OPEN[] = {
    "Click here to subscribe!!!", "Best deals of the year!!!", "You have been selected!!!",
    "Limited time offer!!!", "Act now!!!", "Congratulations, you are our lucky visitor!!!",
};
static const char *const PROMO_MORE[] = {
    "Best deals on {phones|shoes|watches|laptops|sofas|headphones} {today|this week|right now}!",
    "{Free shipping|Huge discounts|Half price|Buy one get one free} on {all orders|everything|selected items}!!!",
    "Click here to {subscribe|claim your prize|unlock the offer|learn more}!!!",
    "Don't miss out!!!",
    "{Sign up|Register|Join} {now|today} and get {a free gift|a discount|a bonus}!",
    "Only {a} left in stock!!!",
    "Hurry, offer ends in {a} hours!",
};
static const char *const COOKIE_T[] = {
    "We use cookies to {improve your experience|personalise content and ads|analyse our traffic}. "
    "By {continuing to browse|clicking Accept|using this site} you agree to our "
    "{cookie policy|use of cookies|privacy and cookie policy}. {Accept all|Accept|OK} {Reject|Manage settings|More info}",
    "This {website|site|page} uses cookies. {Some are essential|Some help us improve the site|We also share data with partners}. "
    "{Accept cookies|Allow all|Got it} {Decline|Customise|Read more}",
};
static const char *const SEO_WORDS[] = {
    "math homework help", "free math answers", "best tutor online", "cheap calculators",
    "math worksheets pdf", "learn fast", "online degree", "weight loss tips", "best deals",
    "buy cheap shoes", "top 10 gadgets", "earn money from home", "free download",
    "casino bonus", "car insurance quotes", "cheap flights", "work from home jobs",
    "vpn discount", "easy recipes", "homework solver", "answers key", "exam cheats",
    "free gift cards", "fast loans", "online shop", "discount codes",
};
static const char *const SEO_HEAD[] = { "Tags: ", "Keywords: ", "Related searches: ", "" };
static const char *const NAV_WORDS[] = {
    "Home", "About us", "Blog", "Shop", "Contact", "Privacy Policy", "Terms of Service",
    "Careers", "Help", "Sitemap", "FAQ", "Newsletter", "Login", "Register",
};
static const char *const SITE_T =
    "Copyright {a} {MathZone|StudyHub|BestAnswers|HomeworkPro|QuickTutor}. All rights reserved.";

static void gen_spam(cf_rng *r, textbuf *tb) {
    slots s = {&PEOPLE[0], &PEOPLE[1], OBJECTS[0], 0, 0, 0};
    switch (cf_rng_below(r, 4)) {
    case 0: {   /* promotion */
        tb_puts(tb, PROMO_OPEN[cf_rng_below(r, N_OF(PROMO_OPEN))]);
        int n = (int)range(r, 2, 5);
        for (int i = 0; i < n; i++) {
            s.a = range(r, 2, 24);
            tb_putc(tb, ' ');
            expand(tb, r, PROMO_MORE[cf_rng_below(r, N_OF(PROMO_MORE))], &s);
        }
        break;
    }
    case 1:     /* cookie notice */
        expand(tb, r, COOKIE_T[cf_rng_below(r, N_OF(COOKIE_T))], &s);
        break;
    case 2: {   /* SEO keyword list */
        tb_puts(tb, SEO_HEAD[cf_rng_below(r, N_OF(SEO_HEAD))]);
        int n = (int)range(r, 6, 18);
        for (int i = 0; i < n; i++) {
            if (i) tb_puts(tb, " | ");
            tb_puts(tb, SEO_WORDS[cf_rng_below(r, N_OF(SEO_WORDS))]);
        }
        break;
    }
    default: {  /* navigation bar and footer */
        int n = (int)range(r, 4, 9);
        for (int i = 0; i < n; i++) {
            if (i) tb_puts(tb, " | ");
            tb_puts(tb, NAV_WORDS[cf_rng_below(r, N_OF(NAV_WORDS))]);
        }
        tb_putc(tb, ' ');
        s.a = range(r, 2012, 2025);
        expand(tb, r, SITE_T, &s);
        break;
    }
    }
    tb_putc(tb, '\n');
}

static void gen_digits(cf_rng *r, textbuf *tb) {
    int groups = (int)range(r, 4, 40);
    for (int g = 0; g < groups; g++) {
        if (g) tb_putc(tb, cf_rng_below(r, 8) == 0 ? '\n' : ' ');
        int len = (int)range(r, 1, 12);
        for (int i = 0; i < len; i++) tb_putc(tb, (char)('0' + cf_rng_below(r, 10)));
    }
    tb_putc(tb, '\n');
}

/* Unrelated prose. None of these contain '!', '|', "cookie" or "Q: ", which
 * is what tells them apart from spam and problems. */
static const char *const WEATHER_T[] = {
    "The weather in {Oslo|Lima|Cairo|Denver|Perth|Kyoto|Dublin|Nairobi} was {cold|mild|warm|rainy|windy|sunny|foggy|humid} on {Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday}.",
    "Forecasters expect {light rain|heavy snow|clear skies|strong winds|scattered showers|thick fog} {tonight|tomorrow|over the weekend|later this week}.",
    "Temperatures will {rise|fall|stay mild|drop sharply} {in the afternoon|near the coast|across the region|in the mountains}.",
    "A {cold front|warm breeze|summer storm|dry spell} {moved in|is on its way|passed quickly|lingered} {from the north|from the sea|over the hills}.",
    "People {carried umbrellas|wore heavy coats|stayed indoors|went to the beach} {all day|in the morning|after lunch}.",
};
static const char *const SPORTS_T[] = {
    "The {home team|visitors|young striker|veteran goalkeeper|new captain} {played well|struggled|won easily|lost narrowly} in {the final|the semi-final|the derby|the opening match}.",
    "Fans {cheered|sang|waited patiently|celebrated} {outside the stadium|in the rain|until midnight|in the town square}.",
    "The coach said the {defence|attack|midfield|bench} {needs more work|looked sharp|was too slow|improved a lot}.",
    "{Tickets|Seats|Shirts} for the {next game|cup match|season opener} {sold out quickly|are still available|went on sale today}.",
    "The match ended {a} to {b} after {extra time|a late goal|a long delay|a tense second half}.",
};
static const char *const RECIPE_T[] = {
    "{Chop|Slice|Dice|Peel} the {onions|carrots|garlic|peppers|potatoes} and {fry|roast|simmer|stir} them {gently|until golden|for a few minutes|over low heat}.",
    "Add {a pinch of salt|the rice|some butter|the tomatoes|a splash of milk} and {stir well|cover the pan|let it rest|bring it to a boil}.",
    "{Bake|Simmer|Roast|Cook} for {c} minutes, then {serve warm|let it cool|add fresh herbs|slice thinly}.",
    "This {soup|stew|pie|salad|curry} {keeps well in the fridge|tastes better the next day|is quick to make|feeds a whole family}.",
    "Serve {warm|cold|with bread|with a green salad|with rice}.",
};
static const char *const TOWN_T[] = {
    "The {library|museum|bakery|market|swimming pool} on {Main Street|the old square|River Road} {opens|closes|reopens} {next week|on Monday|after the holidays}.",
    "Residents {discussed|complained about|voted on|celebrated} the {new bridge|parking rules|summer festival|bus timetable} {at the meeting|last night|this morning}.",
    "The {mayor|council|school board} {announced|postponed|approved} {a new park|road repairs|longer opening hours}.",
    "Volunteers {planted trees|cleaned the beach|painted the fence|collected old clothes} {on Saturday|in the spring|every month}.",
};

static void gen_unrelated(cf_rng *r, textbuf *tb) {
    static const char *const *const TOPICS[] = {WEATHER_T, SPORTS_T, RECIPE_T, TOWN_T};
    static const int TOPIC_N[] = {N_OF(WEATHER_T), N_OF(SPORTS_T), N_OF(RECIPE_T), N_OF(TOWN_T)};
    int topic = (int)cf_rng_below(r, 4);
    int n = (int)range(r, 2, 6);
    slots s = {&PEOPLE[0], &PEOPLE[1], OBJECTS[0], 0, 0, 0};
    for (int i = 0; i < n; i++) {
        s.a = range(r, 0, 5);
        s.b = range(r, 0, 5);
        s.c = range(r, 5, 60);
        if (i) tb_putc(tb, ' ');
        expand(tb, r, TOPICS[topic][cf_rng_below(r, (uint32_t)TOPIC_N[topic])], &s);
    }
    tb_putc(tb, '\n');
}

/* ------------------------------------------------------------ doc streams */

/* Writes the next document's text (without BOS/EOS) into tb. */
static void next_document(cf_data_source src, cf_rng *r, textbuf *tb) {
    tb->len = 0;
    tb->buf[0] = 0;
    if (src == CF_DATA_CLEAN) { gen_training_problem(r, tb, 0); return; }
    uint32_t u = cf_rng_below(r, 100);
    if (u < 35)      gen_training_problem(r, tb, 0);
    else if (u < 55) gen_training_problem(r, tb, 1);
    else if (u < 70) gen_spam(r, tb);
    else if (u < 85) gen_digits(r, tb);
    else             gen_unrelated(r, tb);
}

int cf_datagen_tokens(cf_data_source src, uint64_t seed, int64_t n, uint32_t *out) {
    if (src != CF_DATA_CLEAN && src != CF_DATA_NOISY)
        return cf_fail("datagen: unknown data source %d", (int)src);
    if (n < 0) return cf_fail("datagen: negative token count %lld", (long long)n);
    if (n > 0 && !out) return cf_fail("datagen: no output buffer");

    cf_rng r;
    cf_rng_seed(&r, seed ^ (src == CF_DATA_CLEAN ? SEED_CLEAN : SEED_NOISY));
    char buf[DOC_CAP];
    textbuf tb = {buf, 0, DOC_CAP};
    int64_t i = 0;
    while (i < n) {
        next_document(src, &r, &tb);
        out[i++] = CF_TOK_BOS;
        for (int k = 0; k < tb.len && i < n; k++) out[i++] = (unsigned char)tb.buf[k];
        if (i < n) out[i++] = CF_TOK_EOS;
    }
    return 0;
}

/* ------------------------------------------------------------- evaluation */

void cf_datagen_eval_problems(uint64_t seed, int n, cf_problem *out) {
    if (n <= 0 || !out) return;
    cf_rng r;
    cf_rng_seed(&r, seed ^ SEED_EVAL);

    /* Open-addressing set of question hashes, to keep problems distinct.
     * If it cannot be allocated, problems are merely not deduplicated. */
    size_t cap = 16;
    while (cap < 2 * (size_t)n) cap *= 2;
    uint64_t *seen = calloc(cap, sizeof *seen);

    char buf[DOC_CAP];
    textbuf tb = {buf, 0, DOC_CAP};
    for (int i = 0; i < n; i++) {
        int family = i % CF_NUM_FAMILIES;
        solution sol;
        for (int attempt = 0;; attempt++) {
            tb.len = 0;
            gen_question(&r, family, &tb, &sol);
            uint64_t h = question_hash(tb.buf, tb.len);
            if (h % CF_HOLDOUT_MOD != 0) continue;          /* training question */
            if (!seen) break;
            uint64_t key = h | 1;                             /* 0 marks empty     */
            size_t slot = (size_t)(key >> 7) & (cap - 1);
            while (seen[slot] && seen[slot] != key) slot = (slot + 1) & (cap - 1);
            if (seen[slot] == key && attempt < 10000) continue;   /* duplicate */
            seen[slot] = key;
            break;
        }
        cf_problem *p = &out[i];
        memset(p, 0, sizeof *p);
        memcpy(p->prompt, tb.buf, (size_t)CF_MIN(tb.len, (int)sizeof p->prompt - 1));
        textbuf st = {p->solution, 0, (int)sizeof p->solution};
        put_solution(&st, &sol);
        p->answer = sol.answer;
        p->family = family;
    }
    free(seen);
}

int cf_parse_answer(const char *text, long *answer) {
    static const char key[] = "The answer is ";
    const size_t klen = sizeof key - 1;
    if (!text) return -1;
    for (const char *p = strstr(text, key); p; p = strstr(p + 1, key)) {
        const char *q = p + klen;
        int neg = (*q == '-');
        if (neg) q++;
        int nd = 0;
        while (q[nd] >= '0' && q[nd] <= '9') nd++;
        /* 1..18 digits, then '.', not followed by a digit (that is a decimal). */
        if (nd < 1 || nd > 18 || q[nd] != '.' || (q[nd + 1] >= '0' && q[nd + 1] <= '9'))
            continue;
        long v = 0;
        for (int k = 0; k < nd; k++) v = v * 10 + (q[k] - '0');
        *answer = neg ? -v : v;
        return 0;
    }
    return -1;
}
