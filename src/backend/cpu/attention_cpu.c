/*
 * attention_cpu.c — fp32 causal grouped-query attention, forward and the
 * four backward modes (full, centrifuge, strawman, centrifuge-kv),
 * memory-efficient.
 *
 * Notation (one sequence b, one query head h, kv head g = h / (H/Hkv)):
 *   s_ij  = scale * q_i . k_j            for visible keys j of query i
 *   lse_i = log sum_j exp(s_ij)
 *   P_ij  = exp(s_ij - lse_i)
 *   o_i   = sum_j P_ij v_j
 * Key j is visible to query i iff same sequence, j <= i, and (if doc ids
 * are given) doc[j] == doc[i].
 *
 * Backward, given do_i = dL/do_i:
 *   dP_ij = do_i . v_j
 *   D_i   = sum_j P_ij dP_ij   (= do_i . o_i when P is the forward softmax)
 *   dS_ij = P_ij (dP_ij - D_i)
 *   dq_i  = scale * sum_j dS_ij k_j
 *   dk_j  = scale * sum_i dS_ij q_i     (summed over the query heads of g)
 *   dv_j  = sum_i P_ij do_i             (summed over the query heads of g)
 *
 * The modes differ only in which queries and keys take part:
 *   FULL       queries: all rows;  keys: all rows, all receive dk/dv.
 *   CENTRIFUGE queries: kept rows; keys: all rows (exact dq, with the saved
 *              full-forward lse and D_i = do_i . o_i), but only kept keys
 *              receive dk/dv — filtered K/V rows are constants.
 *   STRAWMAN   queries: kept rows; keys: kept rows only. lse and D are
 *              recomputed over the kept keys (softmax renormalised), i.e. the
 *              exact backward of attention run on the compacted sequence.
 *   CENTRIFUGE_KV  as CENTRIFUGE, but every key receives dk/dv (from the
 *              kept queries), written at its original row of [T, Hkv, D].
 * So the centrifuge backward loops over kept queries only and costs about
 * keep x the full one.
 *
 * Errors: a bad shape, bad kept rows or no memory for scratch returns -1
 * with cf_fail("attention (cpu): ..."); the backend makes it sticky.
 *
 * Parallelism: one task per (sequence b, kv head g). A task owns the dq rows
 * of its query heads and the dk/dv rows of its kv head in its sequence, so
 * tasks never write the same memory and every sum runs in a fixed order:
 * results are bitwise identical for any number of threads.
 */
#include "backend/cpu/attention_cpu.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/common.h"

/* a . b with 8 interleaved partial sums (a fixed order, so deterministic;
 * it lets the compiler use SIMD without -ffast-math). */
static float dotf(const float *a, const float *b, int n) {
    float acc[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int u = 0; u < 8; u++) acc[u] += a[i + u] * b[i + u];
    float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* y += a * x */
static void axpyf(float *y, float a, const float *x, int n) {
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

static int check_shape(const cf_attn_shape *s) {
    if (s->B < 0 || s->S < 0 || s->H <= 0 || s->Hkv <= 0 || s->D <= 0)
        return cf_fail("attention (cpu): bad shape B=%d S=%d H=%d Hkv=%d D=%d", s->B, s->S, s->H, s->Hkv,
                       s->D);
    if (s->H % s->Hkv != 0)
        return cf_fail("attention (cpu): H=%d is not a multiple of Hkv=%d", s->H, s->Hkv);
    return 0;
}

/* ----------------------------------------------------------------- forward */

/* For each (row i, head h): online softmax over the visible keys.
 *   m = running max of s_ij, l = sum_j exp(s_ij - m), acc = sum_j exp(s_ij - m) v_j
 *   when a larger score arrives, l and acc are rescaled by exp(m_old - m_new).
 *   out_i = acc / l,  lse_i = m + log(l).
 * The output row itself is the accumulator; no scratch at all. */
int cf_cpu_attention_fwd(float *out, float *lse, const float *q, const float *k, const float *v,
                         const cf_attn_shape *s) {
    if (check_shape(s) != 0) return -1;
    const int S = s->S, H = s->H, Hkv = s->Hkv, D = s->D;
    const int group = H / Hkv;
    const long T = (long)s->B * S;
    const float scale = s->scale;
    const int *doc = s->doc;

#pragma omp parallel for collapse(2) schedule(dynamic, 16)
    for (long i = 0; i < T; i++) {
        for (int h = 0; h < H; h++) {
            const int g = h / group;
            const long seq0 = (i / S) * S;
            const float *qi = q + ((size_t)i * H + h) * D;
            float *oi = out + ((size_t)i * H + h) * D;
            for (int d = 0; d < D; d++) oi[d] = 0.0f;
            float m = -INFINITY, l = 0.0f;
            for (long j = seq0; j <= i; j++) {
                if (doc && doc[j] != doc[i]) continue;
                const float *kj = k + ((size_t)j * Hkv + g) * D;
                const float *vj = v + ((size_t)j * Hkv + g) * D;
                float sc = scale * dotf(qi, kj, D);
                if (sc > m) {
                    float corr = expf(m - sc); /* 0 on the first key (m = -inf) */
                    l *= corr;
                    for (int d = 0; d < D; d++) oi[d] *= corr;
                    m = sc;
                }
                float p = expf(sc - m);
                l += p;
                axpyf(oi, p, vj, D);
            }
            /* key i itself is always visible, so l >= 1 */
            float inv = 1.0f / l;
            for (int d = 0; d < D; d++) oi[d] *= inv;
            lse[(size_t)i * H + h] = m + logf(l);
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- backward */

/* Checks that kept rows are ascending, inside their sequence's range, that
 * seq_start slices them by sequence, and that max_len bounds every slice
 * (the CUDA backend sizes its grids by it). On the CPU, backend memory is
 * host memory: rows and seq_start are read directly. */
static int check_kept(const cf_rows *kept, int B, int S) {
    if (!kept || !kept->seq_start || (kept->n > 0 && !kept->rows))
        return cf_fail("attention (cpu): a filtered backward needs the kept rows");
    const int *rows = kept->rows, *ss = kept->seq_start;
    if (kept->n < 0 || ss[0] != 0 || ss[B] != kept->n)
        return cf_fail("attention (cpu): bad kept->seq_start (seq_start[0] = %d, seq_start[B] = %d, n = %d)",
                       ss[0], ss[B], kept->n);
    for (int b = 0; b < B; b++) {
        if (ss[b + 1] < ss[b]) return cf_fail("attention (cpu): kept->seq_start is not ascending at %d", b);
        if (ss[b + 1] - ss[b] > kept->max_len)
            return cf_fail("attention (cpu): sequence %d keeps %d rows, more than kept->max_len = %d", b,
                           ss[b + 1] - ss[b], kept->max_len);
        for (int a = ss[b]; a < ss[b + 1]; a++) {
            if (rows[a] < (long)b * S || rows[a] >= (long)(b + 1) * S)
                return cf_fail("attention (cpu): kept row %d (%d) outside its sequence %d", a, rows[a], b);
            if (a > ss[b] && rows[a] <= rows[a - 1])
                return cf_fail("attention (cpu): kept rows are not ascending at %d", a);
        }
    }
    return 0;
}

/* Per-task scratch, O(S). */
typedef struct {
    int *q_src;   /* [nq] row of the query in q/out/dout/lse/dq          */
    int *q_row;   /* [nq] original row b*S+s of the query                */
    int *k_row;   /* [nk] original row of the key in k/v (ascending)     */
    int *k_dst;   /* [nk] row of the key in dk/dv, or -1: no gradient     */
    float *sc;    /* [nk] scores of the current query (-inf: invisible)   */
    float *dp;    /* [nk] dP of the current query                         */
} attn_task;

/* One (sequence b, kv head g) task of the backward. */
static void attn_bwd_task(float *dq, float *dk, float *dv, const float *dout, const float *q,
                          const float *k, const float *v, const float *out, const float *lse,
                          const cf_attn_shape *s, const cf_rows *kept, cf_attn_bwd_mode mode,
                          int b, int g, attn_task *w) {
    const int S = s->S, H = s->H, Hkv = s->Hkv, D = s->D;
    const int group = H / Hkv;
    const float scale = s->scale;
    const int *doc = s->doc;
    const int seq0 = b * S;

    /* Queries and keys of this sequence, per mode. */
    int nq = 0, nk = 0;
    if (mode == CF_ATTN_BWD_FULL) {
        for (int t = 0; t < S; t++) {
            w->q_src[nq] = w->q_row[nq] = seq0 + t;
            nq++;
            w->k_row[nk] = w->k_dst[nk] = seq0 + t;
            nk++;
        }
    } else {
        const int a0 = kept->seq_start[b], a1 = kept->seq_start[b + 1];
        for (int a = a0; a < a1; a++) {
            w->q_src[nq] = a;
            w->q_row[nq] = kept->rows[a];
            nq++;
        }
        if (mode == CF_ATTN_BWD_CENTRIFUGE_KV) {
            /* all keys, each receiving dk/dv at its original row */
            for (int t = 0; t < S; t++) {
                w->k_row[nk] = w->k_dst[nk] = seq0 + t;
                nk++;
            }
        } else if (mode == CF_ATTN_BWD_CENTRIFUGE) {
            /* all keys; walk the (ascending) kept list alongside */
            int a = a0;
            for (int t = 0; t < S; t++) {
                int row = seq0 + t;
                w->k_row[nk] = row;
                if (a < a1 && kept->rows[a] == row) w->k_dst[nk] = a++;
                else w->k_dst[nk] = -1;
                nk++;
            }
        } else { /* STRAWMAN: kept keys only */
            for (int a = a0; a < a1; a++) {
                w->k_row[nk] = kept->rows[a];
                w->k_dst[nk] = a;
                nk++;
            }
        }
    }

    for (int r = 0; r < group; r++) {
        const int h = g * group + r;
        int nvis = 0; /* keys [0, nvis) have k_row <= the current query row */
        for (int qi = 0; qi < nq; qi++) {
            const int src = w->q_src[qi], row = w->q_row[qi];
            while (nvis < nk && w->k_row[nvis] <= row) nvis++;
            const float *q_i = q + ((size_t)src * H + h) * D;
            const float *do_i = dout + ((size_t)src * H + h) * D;
            float *dq_i = dq + ((size_t)src * H + h) * D;

            /* scores s_ij of the visible keys */
            float m = -INFINITY;
            for (int j = 0; j < nvis; j++) {
                const int kr = w->k_row[j];
                if (doc && doc[kr] != doc[row]) { w->sc[j] = -INFINITY; continue; }
                w->sc[j] = scale * dotf(q_i, k + ((size_t)kr * Hkv + g) * D, D);
                if (w->sc[j] > m) m = w->sc[j];
            }

            /* softmax statistics: saved from the forward, or (strawman)
             * recomputed over the keys taking part */
            float lse_i;
            if (mode == CF_ATTN_BWD_STRAWMAN) {
                float l = 0.0f;
                for (int j = 0; j < nvis; j++)
                    if (w->sc[j] != -INFINITY) l += expf(w->sc[j] - m);
                lse_i = m + logf(l);
            } else {
                lse_i = lse[(size_t)src * H + h];
            }

            /* P_ij (stored over sc), dP_ij, and D_i */
            float Di = 0.0f;
            for (int j = 0; j < nvis; j++) {
                if (w->sc[j] == -INFINITY) { w->sc[j] = 0.0f; w->dp[j] = 0.0f; continue; }
                const int kr = w->k_row[j];
                w->sc[j] = expf(w->sc[j] - lse_i);
                w->dp[j] = dotf(do_i, v + ((size_t)kr * Hkv + g) * D, D);
                Di += w->sc[j] * w->dp[j];
            }
            if (mode != CF_ATTN_BWD_STRAWMAN)
                Di = dotf(do_i, out + ((size_t)src * H + h) * D, D);

            /* gradients */
            for (int j = 0; j < nvis; j++) {
                const float P = w->sc[j];
                if (P == 0.0f) continue; /* invisible, or underflowed: no contribution */
                const int kr = w->k_row[j], dst = w->k_dst[j];
                const float dS = P * (w->dp[j] - Di);
                axpyf(dq_i, scale * dS, k + ((size_t)kr * Hkv + g) * D, D);
                if (dst >= 0) {
                    axpyf(dk + ((size_t)dst * Hkv + g) * D, scale * dS, q_i, D);
                    axpyf(dv + ((size_t)dst * Hkv + g) * D, P, do_i, D);
                }
            }
        }
    }
}

int cf_cpu_attention_bwd(float *dq, float *dk, float *dv, const float *dout, const float *q,
                         const float *k, const float *v, const float *out, const float *lse,
                         const cf_attn_shape *s, const cf_rows *kept, cf_attn_bwd_mode mode) {
    if (check_shape(s) != 0) return -1;
    const int B = s->B, S = s->S, H = s->H, Hkv = s->Hkv, D = s->D;
    size_t rows, krows; /* rows of dq; rows of dk and dv */
    if (mode == CF_ATTN_BWD_FULL) {
        rows = krows = (size_t)B * S;
    } else if (mode == CF_ATTN_BWD_CENTRIFUGE || mode == CF_ATTN_BWD_STRAWMAN ||
               mode == CF_ATTN_BWD_CENTRIFUGE_KV) {
        if (check_kept(kept, B, S) != 0) return -1;
        rows = (size_t)kept->n;
        krows = mode == CF_ATTN_BWD_CENTRIFUGE_KV ? (size_t)B * S : rows;
    } else {
        return cf_fail("attention (cpu): unknown backward mode %d", (int)mode);
    }
    memset(dq, 0, rows * H * D * sizeof(float));
    memset(dk, 0, krows * Hkv * D * sizeof(float));
    memset(dv, 0, krows * Hkv * D * sizeof(float));
    if (rows == 0) return 0;

    int failed = 0;
#pragma omp parallel
    {
        attn_task w;
        size_t n = (size_t)(S > 0 ? S : 1);
        w.q_src = malloc(n * sizeof(int));
        w.q_row = malloc(n * sizeof(int));
        w.k_row = malloc(n * sizeof(int));
        w.k_dst = malloc(n * sizeof(int));
        w.sc = malloc(n * sizeof(float));
        w.dp = malloc(n * sizeof(float));
        int ok = w.q_src && w.q_row && w.k_row && w.k_dst && w.sc && w.dp;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int b = 0; b < B; b++)
            for (int g = 0; g < Hkv; g++)
                if (ok) attn_bwd_task(dq, dk, dv, dout, q, k, v, out, lse, s, kept, mode, b, g, &w);
        free(w.q_src); free(w.q_row); free(w.k_row); free(w.k_dst); free(w.sc); free(w.dp);
    }
    if (failed) return cf_fail("attention (cpu): out of memory for per-thread scratch (S = %d)", S);
    return 0;
}
