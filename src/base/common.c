/* common.c — errors, allocation, RNG, timing, file safety (inputs, atomic
 * outputs, locks, run manifests), parsing. */
#include "base/common.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------ errors */

static _Thread_local char g_err[1024];

const char *cf_last_error(void) { return g_err; }

int cf_fail(const char *fmt, ...) {
    char tmp[sizeof g_err];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tmp, sizeof tmp, fmt, ap);   /* fmt may reference g_err itself */
    va_end(ap);
    /* one line, whatever text of the user's it quotes: a newline or an
     * escape sequence in a flag's value or a file name becomes '?' */
    for (char *p = tmp; *p; p++)
        if ((unsigned char)*p < 0x20 || *p == 0x7f) *p = '?';
    memcpy(g_err, tmp, sizeof g_err);
    return -1;
}

void *cf_malloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) cf_fail("out of memory allocating %zu bytes", bytes);
    return p;
}

void *cf_calloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) cf_fail("out of memory allocating %zu x %zu bytes", n, size);
    return p;
}

/* --------------------------------------------------------------------- rng */

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

void cf_rng_seed(cf_rng *r, uint64_t seed) {
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&x);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t cf_rng_u64(cf_rng *r) {
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0]; s[3] ^= s[1]; s[1] ^= s[2]; s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

uint32_t cf_rng_below(cf_rng *r, uint32_t n) {
    if (n <= 1) return 0;
    /* Lemire's multiply-shift; the bias is below 2^-32 and irrelevant here. */
    return (uint32_t)(((cf_rng_u64(r) >> 32) * (uint64_t)n) >> 32);
}

float cf_rng_uniform(cf_rng *r) { return (float)(cf_rng_u64(r) >> 40) * (1.0f / 16777216.0f); }

float cf_rng_normal(cf_rng *r) {
    /* Box-Muller; u1 in (0,1] so log is finite. */
    double u1 = ((cf_rng_u64(r) >> 11) + 1.0) * (1.0 / 9007199254740992.0);
    double u2 = (cf_rng_u64(r) >> 11) * (1.0 / 9007199254740992.0);
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

double cf_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

uint64_t cf_fnv1a(uint64_t h, const void *data, size_t n) {
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++) { h ^= p[i]; h *= 0x100000001b3ULL; }
    return h;
}

/* ------------------------------------------------------------- randomness */

uint64_t cf_random_u64(void) {
    uint64_t v = 0;
    if (getrandom(&v, sizeof v, GRND_NONBLOCK) == (ssize_t)sizeof v) return v;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        ssize_t r = read(fd, &v, sizeof v);
        close(fd);
        if (r == (ssize_t)sizeof v) return v;
    }
    /* last resort: clock, pid and a counter through splitmix64 */
    static uint64_t counter;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t x = (uint64_t)ts.tv_sec * 1000000007ULL ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 32) ^
                 __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED) * 0x9e3779b97f4a7c15ULL;
    return splitmix64(&x);
}

/* ----------------------------------------------------- registry of inputs */

typedef struct {
    dev_t dev;
    ino_t ino;
    char *path;
    int holds;     /* opens not yet released */
    int pinned;    /* registered for the whole run */
} input_entry;

static pthread_mutex_t g_in_lock = PTHREAD_MUTEX_INITIALIZER;
static input_entry *g_in;
static int g_nin, g_capin, g_run_mode;

static void input_add(const struct stat *st, const char *path, int pinned) {
    pthread_mutex_lock(&g_in_lock);
    for (int i = 0; i < g_nin; i++)
        if (g_in[i].dev == st->st_dev && g_in[i].ino == st->st_ino && strcmp(g_in[i].path, path) == 0) {
            if (pinned || g_run_mode) g_in[i].pinned = 1;
            else g_in[i].holds++;
            pthread_mutex_unlock(&g_in_lock);
            return;
        }
    if (g_nin == g_capin) {
        int cap = g_capin ? 2 * g_capin : 16;
        input_entry *n = realloc(g_in, (size_t)cap * sizeof *n);
        if (!n) { pthread_mutex_unlock(&g_in_lock); return; }   /* best effort */
        g_in = n;
        g_capin = cap;
    }
    char *p = strdup(path);
    if (p) {
        g_in[g_nin++] = (input_entry){st->st_dev, st->st_ino, p, pinned || g_run_mode ? 0 : 1,
                                      pinned || g_run_mode};
    }
    pthread_mutex_unlock(&g_in_lock);
}

void cf_input_release(const char *path) {
    if (!path) return;
    pthread_mutex_lock(&g_in_lock);
    for (int i = 0; i < g_nin; i++) {
        if (strcmp(g_in[i].path, path) != 0 || g_in[i].holds == 0) continue;
        if (--g_in[i].holds == 0 && !g_in[i].pinned) {
            free(g_in[i].path);
            g_in[i] = g_in[--g_nin];
        }
        break;
    }
    pthread_mutex_unlock(&g_in_lock);
}

int cf_input_register(const char *path) {
    struct stat st;
    if (!path || stat(path, &st) != 0) return 0;   /* nothing there to protect */
    input_add(&st, path, 1);
    return 0;
}

static void inputs_clear(int run_mode) {
    pthread_mutex_lock(&g_in_lock);
    for (int i = 0; i < g_nin; i++) free(g_in[i].path);
    free(g_in);
    g_in = NULL;
    g_nin = g_capin = 0;
    g_run_mode = run_mode;
    pthread_mutex_unlock(&g_in_lock);
}

void cf_inputs_begin_run(void) { inputs_clear(1); }
void cf_inputs_end_run(void) { inputs_clear(0); }

/* The registered input with this device and inode (a thread-local copy of
 * its path), or NULL. An input counts only while its path still names that
 * file: once it is deleted (e.g. a rotated-out checkpoint) the file system
 * may give its inode number to a new file, which is not that input. */
static const char *input_by_id(dev_t dev, ino_t ino) {
    static _Thread_local char found[1024];
    const char *r = NULL;
    pthread_mutex_lock(&g_in_lock);
    for (int i = 0; i < g_nin && !r; i++) {
        struct stat now;
        if (g_in[i].dev == dev && g_in[i].ino == ino && stat(g_in[i].path, &now) == 0 && now.st_dev == dev &&
            now.st_ino == ino) {
            snprintf(found, sizeof found, "%s", g_in[i].path);
            r = found;
        }
    }
    pthread_mutex_unlock(&g_in_lock);
    return r;
}

const char *cf_input_same_file(const char *path) {
    struct stat st;
    if (!path || stat(path, &st) != 0) return NULL;
    return input_by_id(st.st_dev, st.st_ino);
}

static const char *kind_of(mode_t m) {
    if (S_ISDIR(m)) return "a directory";
    if (S_ISFIFO(m)) return "a FIFO";
    if (S_ISSOCK(m)) return "a socket";
    if (S_ISCHR(m)) return "a character device";
    if (S_ISBLK(m)) return "a block device";
    if (S_ISLNK(m)) return "a symbolic link";
    if (S_ISREG(m)) return "a regular file";
    return "not a regular file";
}

int cf_open_input(const char *path, int64_t *size) {
    if (!path) return cf_fail("NULL input path");
    /* O_NONBLOCK: opening a FIFO with no writer returns at once instead
     * of waiting forever; the fstat below then refuses it. */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    if (fd < 0) return cf_fail("%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return cf_fail("%s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return cf_fail("%s: is %s, not a regular file", path, kind_of(st.st_mode));
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0) fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    input_add(&st, path, 0);
    if (size) *size = (int64_t)st.st_size;
    return fd;
}

/* ---------------------------------------------------------------- outputs */

/* The directory part of path ("." if none) into out. */
static int dir_of(const char *path, char *out, size_t cap) {
    const char *slash = strrchr(path, '/');
    int n;
    if (!slash) n = snprintf(out, cap, ".");
    else if (slash == path) n = snprintf(out, cap, "/");
    else n = snprintf(out, cap, "%.*s", (int)(slash - path), path);
    if (n < 0 || (size_t)n >= cap) return cf_fail("%s: path too long", path);
    return 0;
}

static const char *base_of(const char *path) {
    const char *slash = strrchr(path, '/');
    return slash ? slash + 1 : path;
}

static long name_max(const char *dir) {
    long v = pathconf(dir, _PC_NAME_MAX);
    return v > 0 ? v : 255;
}

#define TMP_SUFFIX_LEN 21   /* ".tmp." + 16 hex digits */

/* The temp name for path into out: "<path>.tmp.<16 hex>", or
 * "<dir>/.tmp.<16 hex>" where the base name leaves no room. */
static int temp_name(const char *path, const char *dir, char *out, size_t cap) {
    unsigned long long r = (unsigned long long)cf_random_u64();
    int n;
    if ((long)(strlen(base_of(path)) + TMP_SUFFIX_LEN) <= name_max(dir))
        n = snprintf(out, cap, "%s.tmp.%016llx", path, r);
    else
        n = snprintf(out, cap, "%s/.tmp.%016llx", dir, r);
    if (n < 0 || (size_t)n >= cap) return cf_fail("%s: path too long", path);
    return 0;
}

int cf_is_temp_name(const char *name) {
    const char *t = strstr(name, ".tmp.");
    if (!t) return 0;
    for (const char *next; (next = strstr(t + 1, ".tmp.")); ) t = next;
    const char *h = t + 5;
    size_t n = strlen(h);
    if (n != 16) return 0;
    for (size_t i = 0; i < n; i++)
        if (!((h[i] >= '0' && h[i] <= '9') || (h[i] >= 'a' && h[i] <= 'f'))) return 0;
    return 1;
}

/* The checks on an existing target (lstat): a regular file that is not an
 * input of this run, or nothing. */
static int check_target(const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0) {
        if (errno == ENOENT) return 0;
        return cf_fail("%s: cannot write there: %s", path, strerror(errno));
    }
    if (S_ISLNK(st.st_mode))
        return cf_fail("%s: is a symbolic link; refusing to replace it (give the real path)", path);
    if (!S_ISREG(st.st_mode))
        return cf_fail("%s: is %s; refusing to replace it with a file", path, kind_of(st.st_mode));
    const char *in = input_by_id(st.st_dev, st.st_ino);
    if (in) {
        if (strcmp(in, path) == 0)
            return cf_fail("%s: is also an input of this run; writing it would destroy that input", path);
        return cf_fail("%s: is the same file as the input %s; writing it would destroy that input", path, in);
    }
    return 0;
}

/* Creates and removes a temp file in dir: the directory really takes new
 * files (permissions, read-only file systems, full inode tables). */
static int probe_dir(const char *dir, const char *for_path) {
    char tmp[4096 + 64];
    int n = snprintf(tmp, sizeof tmp, "%s/.tmp.%016llx", dir, (unsigned long long)cf_random_u64());
    if (n < 0 || (size_t)n >= sizeof tmp) return cf_fail("%s: path too long", for_path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) {
        if (errno == EACCES || errno == EPERM || errno == EROFS)
            return cf_fail("%s: cannot write in %s: %s", for_path, dir, strerror(errno));
        return cf_fail("%s: cannot create files in %s: %s", for_path, dir, strerror(errno));
    }
    close(fd);
    unlink(tmp);
    return 0;
}

int cf_output_check(const char *path) {
    if (!path || !*path) return cf_fail("empty output path");
    if (strlen(path) + TMP_SUFFIX_LEN >= 4096) return cf_fail("%.200s...: path too long", path);
    char dir[4096];
    if (dir_of(path, dir, sizeof dir) != 0) return -1;
    const char *base = base_of(path);
    if (!*base || strcmp(base, ".") == 0 || strcmp(base, "..") == 0)
        return cf_fail("%s: names a directory, not a file", path);
    struct stat st;
    if (stat(dir, &st) != 0)
        return cf_fail("%s: directory %s: %s", path, dir, strerror(errno));
    if (!S_ISDIR(st.st_mode)) return cf_fail("%s: %s is not a directory", path, dir);
    if ((long)strlen(base) > name_max(dir))
        return cf_fail("%s: file name is %zu bytes, longer than the file system allows (%ld)", path, strlen(base),
                       name_max(dir));
    if (check_target(path) != 0) return -1;
    return probe_dir(dir, path);
}

int cf_output_dir_check(const char *dir, size_t extra) {
    if (!dir || !*dir) return cf_fail("empty output directory");
    size_t len = strlen(dir);
    if (len + extra >= 4096)
        return cf_fail("%.200s...: path too long (%zu bytes, and names up to %zu bytes go below it)", dir, len, extra);
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", dir);
    while (len > 1 && buf[len - 1] == '/') buf[--len] = 0;   /* "runs/" */
    struct stat st;
    if (stat(buf, &st) == 0) {
        if (!S_ISDIR(st.st_mode)) return cf_fail("%s: exists and is %s, not a directory", dir, kind_of(st.st_mode));
        return probe_dir(buf, dir);
    }
    if (errno != ENOENT) return cf_fail("%s: %s", dir, strerror(errno));
    /* walk up to the nearest existing ancestor; every missing name must fit */
    for (;;) {
        char *slash = strrchr(buf, '/');
        const char *name = slash ? slash + 1 : buf;
        char parent[4096];
        if (!slash) snprintf(parent, sizeof parent, ".");
        else if (slash == buf) snprintf(parent, sizeof parent, "/");
        else snprintf(parent, sizeof parent, "%.*s", (int)(slash - buf), buf);
        if (stat(parent, &st) == 0) {
            if (!S_ISDIR(st.st_mode)) return cf_fail("%s: %s is not a directory", dir, parent);
            if ((long)strlen(name) > name_max(parent))
                return cf_fail("%s: the name '%.40s...' is %zu bytes, longer than the file system allows (%ld)", dir,
                               name, strlen(name), name_max(parent));
            return probe_dir(parent, dir);
        }
        if (errno != ENOENT) return cf_fail("%s: %s: %s", dir, parent, strerror(errno));
        if ((long)strlen(name) > 255)
            return cf_fail("%s: the name '%.40s...' is %zu bytes, longer than file systems allow (255)", dir, name,
                           strlen(name));
        if (!slash || slash == buf) return cf_fail("%s: cannot be created", dir);
        *slash = 0;
    }
}

/* ------------------------------------------------------------ atomic files */

int cf_atomic_open(cf_atomic_file *af, const char *path) {
    memset(af, 0, sizeof *af);
    if (!path || !*path) return cf_fail("empty output path");
    if (strlen(path) + TMP_SUFFIX_LEN >= 4096) return cf_fail("%.200s...: path too long", path);
    if (check_target(path) != 0) return -1;
    char dir[4096], tmp[4096 + 64];
    if (dir_of(path, dir, sizeof dir) != 0) return -1;
    int fd = -1;
    for (int tries = 0; fd < 0 && tries < 16; tries++) {
        if (temp_name(path, dir, tmp, sizeof tmp) != 0) return -1;
        fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
        if (fd < 0 && errno != EEXIST) break;
    }
    if (fd < 0) return cf_fail("%s: cannot create: %s", path, strerror(errno));
    af->path = strdup(path);
    af->tmp = strdup(tmp);
    af->f = af->path && af->tmp ? fdopen(fd, "wb") : NULL;
    if (!af->f) {
        close(fd);
        unlink(tmp);
        free(af->path); free(af->tmp);
        memset(af, 0, sizeof *af);
        return cf_fail("out of memory opening %s", path);
    }
    return 0;
}

int cf_atomic_write(cf_atomic_file *af, const void *data, size_t n) {
    if (!af->f) return cf_fail("%s: write after close", af->path ? af->path : "(atomic file)");
    if (n && fwrite(data, 1, n, af->f) != n)
        return cf_fail("%s: write failed: %s", af->path, strerror(errno ? errno : EIO));
    return 0;
}

static void fsync_dir(const char *dir) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) { fsync(fd); close(fd); }
}

static void fsync_parent_dir(const char *path) {
    char dir[4096];
    if (dir_of(path, dir, sizeof dir) == 0) fsync_dir(dir);
}

int cf_atomic_commit(cf_atomic_file *af) {
    int rc = 0;
    errno = 0;
    if (fflush(af->f) != 0 || ferror(af->f) || fsync(fileno(af->f)) != 0)
        rc = cf_fail("%s: write failed: %s", af->path, strerror(errno ? errno : EIO));
    if (fclose(af->f) != 0 && rc == 0) rc = cf_fail("%s: close failed: %s", af->path, strerror(errno));
    af->f = NULL;
    /* the target may have changed since the open: check it again */
    if (rc == 0) rc = check_target(af->path);
    if (rc == 0 && rename(af->tmp, af->path) != 0)
        rc = cf_fail("%s: rename failed: %s", af->path, strerror(errno));
    if (rc != 0) unlink(af->tmp);   /* the temp file only: never the target */
    else fsync_parent_dir(af->path);
    free(af->path); free(af->tmp);
    af->path = af->tmp = NULL;
    return rc;
}

void cf_atomic_abort(cf_atomic_file *af) {
    if (af->f) fclose(af->f);
    if (af->tmp) unlink(af->tmp);
    free(af->path); free(af->tmp);
    memset(af, 0, sizeof *af);
}

int cf_write_file_atomic(const char *path, const void *data, size_t n) {
    cf_atomic_file af;
    if (cf_atomic_open(&af, path) != 0) return -1;
    if (cf_atomic_write(&af, data, n) != 0) { cf_atomic_abort(&af); return -1; }
    return cf_atomic_commit(&af);
}

FILE *cf_output_stream(const char *path, int append) {
    if (append) {
        if (check_target(path) != 0) return NULL;
        int fd = open(path, O_WRONLY | O_APPEND | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
        if (fd < 0 && errno != ENOENT) { cf_fail("%s: cannot open for appending: %s", path, strerror(errno)); return NULL; }
        if (fd >= 0) {
            struct stat st;
            if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || input_by_id(st.st_dev, st.st_ino)) {
                close(fd);
                if (check_target(path) == 0) cf_fail("%s: not a regular file", path);   /* else it said why */
                return NULL;
            }
            int fl = fcntl(fd, F_GETFL);
            if (fl >= 0) fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
            FILE *f = fdopen(fd, "a");
            if (!f) { close(fd); cf_fail("%s: cannot open: %s", path, strerror(errno)); }
            return f;
        }
        /* missing: create it like a fresh one */
    }
    cf_atomic_file af;
    if (cf_atomic_open(&af, path) != 0) return NULL;
    /* the empty file replaces the target at once; later writes go to it */
    int fd = dup(fileno(af.f));
    if (fd < 0) { cf_atomic_abort(&af); cf_fail("%s: cannot create: %s", path, strerror(errno)); return NULL; }
    if (cf_atomic_commit(&af) != 0) { close(fd); return NULL; }
    FILE *f = fdopen(fd, "a");
    if (!f) { close(fd); cf_fail("%s: cannot open: %s", path, strerror(errno)); }
    return f;
}

int cf_stream_check(FILE *f, const char *path) {
    errno = 0;
    if (fflush(f) != 0 || ferror(f))
        return cf_fail("%s: write failed: %s", path, strerror(errno ? errno : EIO));
    return 0;
}

int cf_stream_close(FILE *f, const char *path) {
    if (!f) return 0;
    int rc = cf_stream_check(f, path);
    if (rc == 0 && fsync(fileno(f)) != 0 && errno != EINVAL)
        rc = cf_fail("%s: write failed: %s", path, strerror(errno));
    if (fclose(f) != 0 && rc == 0) rc = cf_fail("%s: close failed: %s", path, strerror(errno));
    return rc;
}

static char *read_file(const char *path, size_t *len, size_t limit, int input) {
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    if (fd < 0) { cf_fail("%s: cannot open: %s", path, strerror(errno)); return NULL; }
    struct stat st;
    if (fstat(fd, &st) != 0) { close(fd); cf_fail("%s: cannot stat: %s", path, strerror(errno)); return NULL; }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        cf_fail("%s: is %s, not a regular file", path, kind_of(st.st_mode));
        return NULL;
    }
    if (input) {
        input_add(&st, path, 0);
        cf_input_release(path);   /* read whole now; a run keeps it registered */
    }
    if ((uint64_t)st.st_size > (uint64_t)limit) {
        close(fd);
        cf_fail("%s: file is %lld bytes, more than the limit of %zu", path, (long long)st.st_size, limit);
        return NULL;
    }
    size_t sz = (size_t)st.st_size;
    char *buf = cf_malloc(sz + 1);
    if (!buf) { close(fd); return NULL; }
    size_t got = 0;
    while (got < sz) {
        ssize_t r = read(fd, buf + got, sz - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        got += (size_t)r;
    }
    close(fd);
    if (got != sz) { free(buf); cf_fail("%s: read failed (the file changed while reading?)", path); return NULL; }
    buf[sz] = 0;
    if (len) *len = sz;
    return buf;
}

char *cf_read_file(const char *path, size_t *len, size_t limit) { return read_file(path, len, limit, 0); }
char *cf_read_input(const char *path, size_t *len, size_t limit) { return read_file(path, len, limit, 1); }

int cf_mkdir_p(const char *dir) {
    char buf[4096];
    if (snprintf(buf, sizeof buf, "%s", dir) >= (int)sizeof buf)
        return cf_fail("%s: path too long", dir);
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(buf, 0755) != 0 && errno != EEXIST)
            return cf_fail("%s: cannot create directory: %s", buf, strerror(errno));
        *p = '/';
    }
    if (mkdir(buf, 0755) != 0 && errno != EEXIST)
        return cf_fail("%s: cannot create directory: %s", buf, strerror(errno));
    struct stat st;
    if (stat(buf, &st) != 0 || !S_ISDIR(st.st_mode))
        return cf_fail("%s: exists and is not a directory", buf);
    return 0;
}

int cf_list_has_empty_item(const char *s) {
    size_t n = s ? strlen(s) : 0;
    return n > 0 && (s[0] == ',' || s[n - 1] == ',' || strstr(s, ",,") != NULL);
}

int cf_list_check(const char *what, const char *s) {
    if (!cf_list_has_empty_item(s)) return 0;
    return cf_fail("%s: '%s' has an empty item (two commas, or one at an end)", what, s);
}

int cf_path_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}

int cf_path_join(char *out, size_t cap, const char *dir, const char *name) {
    int n = snprintf(out, cap, "%s/%s", dir, name);
    if (n < 0 || (size_t)n >= cap) return cf_fail("%s/%s: path too long", dir, name);
    return 0;
}

/* ------------------------------------------------------------ directories */

int cf_dir_lock(const char *dir, int *created) {
    if (created) *created = 0;
    struct stat st;
    if (stat(dir, &st) != 0) {
        if (cf_mkdir_p(dir) != 0) return -1;
        if (created) *created = 1;
    } else if (!S_ISDIR(st.st_mode)) {
        return cf_fail("%s: exists and is %s, not a directory", dir, kind_of(st.st_mode));
    }
    char path[4096];
    if (cf_path_join(path, sizeof path, dir, ".lock") != 0) return -1;
    int fd = open(path, O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
    if (fd < 0) return cf_fail("%s: cannot create the lock file: %s", path, strerror(errno));
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return cf_fail("%s: is not a regular file", path);
    }
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        int e = errno;
        char pid[32] = "";
        ssize_t r = pread(fd, pid, sizeof pid - 1, 0);
        close(fd);
        if (e == EWOULDBLOCK) {
            pid[r > 0 ? r : 0] = 0;
            pid[strcspn(pid, "\r\n")] = 0;
            return cf_fail("%s: in use by another run (%s%s holds %s); wait for it to finish or choose another --out",
                           dir, *pid ? "pid " : "a process", pid, path);
        }
        return cf_fail("%s: cannot lock: %s", path, strerror(e));
    }
    char line[32];
    int n = snprintf(line, sizeof line, "%ld\n", (long)getpid());
    if (ftruncate(fd, 0) == 0 && pwrite(fd, line, (size_t)n, 0) == n) { /* informational only */ }
    return fd;
}

/* Removes every entry of dir (one more level for subdirectories) and dir. */
static int remove_tree(const char *dir, int depth) {
    DIR *d = opendir(dir);
    if (!d) return -1;
    struct dirent *e;
    char p[4096 + 256];
    while ((e = readdir(d))) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        if (cf_path_join(p, sizeof p, dir, e->d_name) != 0) continue;
        struct stat st;
        if (lstat(p, &st) != 0) continue;
        if (S_ISDIR(st.st_mode)) { if (depth > 0) remove_tree(p, depth - 1); }
        else unlink(p);
    }
    closedir(d);
    return rmdir(dir);
}

int cf_remove_created_dir(const char *dir) { return remove_tree(dir, 1); }

int cf_remove_run_dir(const char *dir) {
    struct stat st;
    if (stat(dir, &st) != 0) return errno == ENOENT ? 0 : cf_fail("%s: %s", dir, strerror(errno));
    char p[4096 + 256], q[4096 + 512];
    if (cf_path_join(p, sizeof p, dir, "run.json") != 0) return -1;
    cf_manifest run;
    int r = cf_manifest_read(p, &run);
    if (r < 0) return -1;
    const char *id = r == 0 ? cf_manifest_get(&run, "run_id") : NULL;
    if (!id || !*id) return 0;   /* not a run directory: nothing of ours */
    int created = 0, fd = cf_dir_lock(dir, &created);
    if (fd < 0) return -1;
    DIR *d = opendir(dir);
    struct dirent *e;
    while (d && (e = readdir(d))) {
        if (strncmp(e->d_name, "step_", 5) != 0 || cf_path_join(p, sizeof p, dir, e->d_name) != 0) continue;
        if (lstat(p, &st) != 0 || !S_ISDIR(st.st_mode) || cf_path_join(q, sizeof q, p, "centrifuge_checkpoint.json") != 0)
            continue;
        cf_manifest mk;
        const char *mid = cf_manifest_read(q, &mk) == 0 ? cf_manifest_get(&mk, "run_id") : NULL;
        if (mid && strcmp(mid, id) == 0) remove_tree(p, 0);
    }
    if (d) closedir(d);
    static const char *const OWN[] = {"latest", "run.json"};
    for (size_t i = 0; i < sizeof OWN / sizeof *OWN; i++)
        if (cf_path_join(p, sizeof p, dir, OWN[i]) == 0) unlink(p);
    if (cf_path_join(p, sizeof p, dir, ".tokenizer") == 0) remove_tree(p, 0);
    if (cf_path_join(p, sizeof p, dir, ".lock") == 0) unlink(p);
    close(fd);
    rmdir(dir);   /* only if nothing else is there */
    return 0;
}

/* --------------------------------------------------------------- manifest */

void cf_manifest_set(cf_manifest *m, const char *key, const char *fmt, ...) {
    int i = 0;
    while (i < m->n && strcmp(m->kv[i].key, key) != 0) i++;
    if (i == m->n) {
        if (m->n >= CF_MANIFEST_MAX) return;
        m->n++;
        snprintf(m->kv[i].key, sizeof m->kv[i].key, "%s", key);
    }
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m->kv[i].val, sizeof m->kv[i].val, fmt, ap);
    va_end(ap);
}

const char *cf_manifest_get(const cf_manifest *m, const char *key) {
    for (int i = 0; i < m->n; i++)
        if (strcmp(m->kv[i].key, key) == 0) return m->kv[i].val;
    return NULL;
}

int cf_manifest_read(const char *path, cf_manifest *m) {
    memset(m, 0, sizeof *m);
    struct stat st;
    if (lstat(path, &st) != 0 && errno == ENOENT) return 1;
    size_t len = 0;
    char *buf = cf_read_file(path, &len, 1 << 20);
    if (!buf) return -1;
    int rc = cf_json_check_nul(path, "run manifest", buf, len);
    cJSON *root = rc == 0 ? cJSON_ParseWithLength(buf, len) : NULL;
    if (rc == 0 && !cJSON_IsObject(root)) rc = cf_fail("%s: not a run manifest (a JSON object)", path);
    for (const cJSON *e = root ? root->child : NULL; rc == 0 && e; e = e->next) {
        if (!e->string || !cJSON_IsString(e)) continue;   /* ours are all strings */
        cf_manifest_set(m, e->string, "%s", e->valuestring);
    }
    cJSON_Delete(root);
    free(buf);
    return rc;
}

static void sb_json_str(cf_sbuf *b, const char *s) {
    cf_sb_printf(b, "\"");
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') cf_sb_printf(b, "\\%c", *p);
        else if (*p < 0x20 || *p == 0x7f) cf_sb_printf(b, "\\u%04x", *p);
        else cf_sb_printf(b, "%c", *p);
    }
    cf_sb_printf(b, "\"");
}

int cf_manifest_write(const char *path, const cf_manifest *m) {
    cf_sbuf b = {0};
    cf_sb_printf(&b, "{\n");
    for (int i = 0; i < m->n; i++) {
        cf_sb_printf(&b, "  ");
        sb_json_str(&b, m->kv[i].key);
        cf_sb_printf(&b, ": ");
        sb_json_str(&b, m->kv[i].val);
        cf_sb_printf(&b, "%s\n", i + 1 < m->n ? "," : "");
    }
    cf_sb_printf(&b, "}\n");
    int rc = b.failed ? cf_fail("%s: out of memory", path) : cf_write_file_atomic(path, b.s, b.len);
    free(b.s);
    return rc;
}

/* ------------------------------------------------------------------- JSON */

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

int cf_json_check_nul(const char *path, const char *what, const char *buf, size_t len) {
    int in_str = 0;
    for (size_t i = 0; i < len; i++) {
        char c = buf[i];
        if (!in_str) {
            if (c == '"') in_str = 1;
            continue;
        }
        if (c == '"') { in_str = 0; continue; }
        if (c == 0)
            return cf_fail("%s: a string in the %s holds a NUL byte (at byte %zu); names with NUL are not "
                           "supported", path, what, i);
        if (c != '\\') continue;
        if (i + 1 < len && buf[i + 1] == 'u' && i + 5 < len && hexval(buf[i + 2]) == 0 && hexval(buf[i + 3]) == 0 &&
            hexval(buf[i + 4]) == 0 && hexval(buf[i + 5]) == 0)
            return cf_fail("%s: a string in the %s holds the escape \\u0000 (at byte %zu); names with NUL are not "
                           "supported", path, what, i);
        i++;   /* skip the escaped character */
    }
    return 0;
}

const char *cf_json_num(char *buf, size_t cap, const char *fmt, double v) {
    if (!isfinite(v)) snprintf(buf, cap, "null");
    else snprintf(buf, cap, fmt, v);
    return buf;
}

/* --------------------------------------------------------------- strings */

void cf_sb_printf(cf_sbuf *b, const char *fmt, ...) {
    if (b->failed) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->s ? b->s + b->len : NULL, b->s ? b->cap - b->len : 0, fmt, ap);
        va_end(ap);
        if (n < 0) { b->failed = 1; return; }
        if (b->s && b->len + (size_t)n < b->cap) { b->len += (size_t)n; return; }
        size_t cap = (b->cap ? b->cap * 2 : 4096) + (size_t)n;
        char *s = realloc(b->s, cap);
        if (!s) { b->failed = 1; return; }
        b->s = s;
        b->cap = cap;
    }
}

const char *cf_printable(const char *s, char *buf, size_t cap) {
    size_t i = 0;
    for (; s[i] && i + 1 < cap; i++) buf[i] = (unsigned char)s[i] < 0x20 || s[i] == 0x7f ? '?' : s[i];
    buf[i] = 0;
    return buf;
}

/* ---------------------------------------------------------------- parsing */

/* strtol and strtod skip leading white space (and stop at trailing): " 5"
 * and "5\n" are not what a user meant to give as a number. */
static int edge_space(const char *s) {
    size_t n = strlen(s);
    unsigned char a = (unsigned char)s[0], z = (unsigned char)s[n - 1];
    return a == ' ' || (a >= '\t' && a <= '\r') || z == ' ' || (z >= '\t' && z <= '\r');
}

int cf_parse_int(const char *s, long lo, long hi, const char *what, long *out) {
    if (!s || !*s) return cf_fail("%s: expected an integer, got an empty value", what);
    char *end, shown[64];
    errno = 0;
    long v = strtol(s, &end, 10);
    if (*end || errno || edge_space(s))
        return cf_fail("%s: '%s' is not an integer", what, cf_printable(s, shown, sizeof shown));
    if (v < lo || v > hi) return cf_fail("%s: %ld is outside [%ld, %ld]", what, v, lo, hi);
    *out = v;
    return 0;
}

int cf_parse_float(const char *s, double lo, double hi, const char *what, double *out) {
    if (!s || !*s) return cf_fail("%s: expected a number, got an empty value", what);
    char *end, shown[64];
    errno = 0;
    double v = strtod(s, &end);
    /* strtod also reads hexadecimal floats ("0x1p-3"): not a number anyone
     * means on a command line or in a text field */
    if (*end || errno || !isfinite(v) || edge_space(s) || strpbrk(s, "xX"))
        return cf_fail("%s: '%s' is not a finite number", what, cf_printable(s, shown, sizeof shown));
    if (v < lo || v > hi) return cf_fail("%s: %g is outside [%g, %g]", what, v, lo, hi);
    *out = v;
    return 0;
}
