/* progress.c — progress lines with an ETA (progress.h). */
#include "cmd/progress.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "base/common.h"

void cf_fmt_duration(char *buf, size_t n, double s) {
    if (!(s >= 0) || s > 1e7) { snprintf(buf, n, "?"); return; }
    long t = (long)(s + 0.5);
    if (t >= 3600) snprintf(buf, n, "%ldh%02ldm", t / 3600, (t / 60) % 60);
    else if (t >= 60) snprintf(buf, n, "%ldm%02lds", t / 60, t % 60);
    else snprintf(buf, n, "%lds", t);
}

int cf_color_ok(int fd) {
    const char *nc = getenv("NO_COLOR");
    if (nc && *nc) return 0;
    return isatty(fd);
}

void cf_progress_start(cf_progress *p, const char *what, const char *unit, int64_t total, int quiet) {
    p->what = what;
    p->unit = unit;
    p->total = total;
    p->t0 = cf_now();
    p->last = p->t0;
    p->delay = 2.0;
    p->tty = isatty(2);
    p->quiet = quiet;
    p->shown = 0;
}

static void print_line(cf_progress *p, int64_t done, double now) {
    double el = now - p->t0, rate = el > 0 ? done / el : 0;
    char eta[32], ela[32];
    cf_fmt_duration(ela, sizeof ela, el);
    if (p->total > 0) {
        cf_fmt_duration(eta, sizeof eta, rate > 0 ? (double)(p->total - done) / rate : -1);
        fprintf(stderr, "%s%s: %lld/%lld %s (%.0f%%) | %.1f %s/s | %s elapsed | ETA %s%s", p->tty ? "\r" : "",
                p->what, (long long)done, (long long)p->total, p->unit, 100.0 * done / p->total, rate, p->unit, ela,
                eta, p->tty ? "\033[K" : "\n");
    } else {
        fprintf(stderr, "%s%s: %lld %s | %.1f %s/s | %s elapsed%s", p->tty ? "\r" : "", p->what, (long long)done,
                p->unit, rate, p->unit, ela, p->tty ? "\033[K" : "\n");
    }
    fflush(stderr);
    p->shown = 1;
}

void cf_progress_update(cf_progress *p, int64_t done) {
    if (p->quiet) return;
    double now = cf_now();
    if (now - p->t0 < p->delay) return;
    if (p->shown && now - p->last < (p->tty ? 0.25 : 5.0)) return;
    p->last = now;
    print_line(p, done, now);
}

void cf_progress_end(cf_progress *p) {
    if (p->quiet || !p->shown || !p->tty) return;
    fputs("\r\033[K", stderr);   /* the caller's summary line takes its place */
    fflush(stderr);
}
