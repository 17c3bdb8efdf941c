/*
 * progress.h — progress lines with an ETA on stderr for the commands that
 * run longer than a few seconds (eval, score, math-eval, the demo's stages).
 *
 * On a terminal one line is redrawn in place (\r) at most 4 times a second;
 * into a pipe or a file a plain line is written at most every 5 seconds, so
 * logs stay readable. Nothing is printed for the first `delay` seconds, so
 * quick runs stay silent. Colour and cursor codes only go to a terminal.
 */
#ifndef CF_PROGRESS_H
#define CF_PROGRESS_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    const char *what;     /* "eval", "score", ...                */
    const char *unit;     /* "tokens", "problems", ...           */
    int64_t total;        /* 0 = unknown (no percentage, no ETA) */
    double t0, last, delay;
    int tty, quiet, shown;
} cf_progress;

/* Starts a progress report of `total` units (quiet: prints nothing). */
void cf_progress_start(cf_progress *p, const char *what, const char *unit, int64_t total, int quiet);
/* Reports `done` units finished; prints when it is time to. */
void cf_progress_update(cf_progress *p, int64_t done);
/* Ends the report: on a terminal the line is finished (or erased if it was
 * never shown). */
void cf_progress_end(cf_progress *p);

/* "1h02m", "3m05s", "42s" ("?" for a negative or absurd value). */
void cf_fmt_duration(char *buf, size_t n, double seconds);

/* 1 when stdout (fd 1) / stderr (fd 2) is a terminal and NO_COLOR is unset:
 * the only case in which ANSI codes are written. */
int cf_color_ok(int fd);

#endif
