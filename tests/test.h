/*
 * test.h — a minimal test harness. Each tests/test_*.c is one program:
 *
 *   TEST(name_that_says_what_it_proves) { CHECK(cond); CHECK_CLOSE(a, b, tol); }
 *   int main(void) { RUN(name_that_says_what_it_proves); return test_summary(); }
 */
#ifndef CF_TEST_H
#define CF_TEST_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int t_failures = 0, t_checks = 0, t_tests = 0, t_failed_tests = 0;
static const char *t_current = "";

#define TEST(name) static void name(void)
#define RUN(name) do { \
    int before_ = t_failures; t_current = #name; t_tests++; \
    name(); \
    if (t_failures != before_) { t_failed_tests++; printf("  FAIL %s\n", #name); } \
    else printf("  ok   %s\n", #name); \
    fflush(stdout); \
} while (0)

#define CHECK(cond) do { t_checks++; if (!(cond)) { t_failures++; \
    printf("    %s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond); } } while (0)

#define CHECK_MSG(cond, ...) do { t_checks++; if (!(cond)) { t_failures++; \
    printf("    %s:%d: ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); } } while (0)

/* |a-b| <= tol * max(1, |b|) */
#define CHECK_CLOSE(a, b, tol) do { double a_ = (a), b_ = (b); t_checks++; \
    if (!(fabs(a_ - b_) <= (tol) * fmax(1.0, fabs(b_))) || isnan(a_) || isnan(b_)) { t_failures++; \
    printf("    %s:%d: %s = %.9g vs %s = %.9g (tol %g)\n", __FILE__, __LINE__, #a, a_, #b, b_, (double)(tol)); } } while (0)

static inline int test_summary(void) {
    printf("%d tests, %d checks, %d failed tests\n", t_tests, t_checks, t_failed_tests);
    /* no test run at all (a CF_TEST_ONLY that matches nothing) is not a pass */
    if (t_tests == 0) printf("no test ran\n");
    return t_failed_tests || t_tests == 0 ? 1 : 0;
}

/* max |a-b| / max(max|b|, tiny) over n elements */
static inline double rel_err(const float *a, const float *b, size_t n) {
    double num = 0, den = 1e-30;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (isnan(a[i]) || isnan(b[i])) return INFINITY;
        if (d > num) num = d;
        if (fabs(b[i]) > den) den = fabs(b[i]);
    }
    return num / den;
}

/* ||a-b||_2 / ||b||_2 (INFINITY on NaN; ||b|| == 0 counts as 1e-30, so an
 * all-zero reference never passes against a non-zero result and vice versa
 * only if both are exactly zero). */
static inline double rel_l2(const float *a, const float *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(a[i]) || isnan(b[i])) return INFINITY;
        double d = (double)a[i] - b[i];
        num += d * d;
        den += (double)b[i] * b[i];
    }
    if (den == 0) return num == 0 ? 0.0 : INFINITY;
    return sqrt(num / den);
}

#endif /* CF_TEST_H */
