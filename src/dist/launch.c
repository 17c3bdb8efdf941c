/* launch.c — the launch environment (torchrun, srun, mpirun); see launch.h. */
#include "dist/launch.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/common.h"

const char *cf_launcher_name(cf_launcher l) {
    switch (l) {
    case CF_LAUNCH_NONE: return "none";
    case CF_LAUNCH_TORCHRUN: return "torchrun";
    case CF_LAUNCH_SLURM: return "slurm";
    case CF_LAUNCH_MPI: return "mpirun";
    }
    return "?";
}

static const char *(*g_getenv)(const char *);

static const char *sys_getenv(const char *name) { return getenv(name); }

/* A variable's value; NULL when unset. An empty value counts as set (and is
 * then rejected as "not an integer"), so a half-exported variable is noticed. */
static const char *env(const char *name) { return g_getenv(name); }

/* Strict non-negative decimal: digits only, no sign, no spaces, at most
 * `hi`. Fails with "NAME: 'v' is not ..." naming the variable. */
static int parse_count(const char *name, const char *v, long hi, long *out) {
    char shown[64];
    if (!*v) return cf_fail("%s is set but empty: expected a non-negative integer", name);
    long x = 0;
    for (const char *p = v; *p; p++) {
        if (*p < '0' || *p > '9')
            return cf_fail("%s: '%s' is not a non-negative integer", name, cf_printable(v, shown, sizeof shown));
        if (x > hi) continue;                 /* keep scanning for bad characters */
        x = x * 10 + (*p - '0');
    }
    if (x > hi) return cf_fail("%s=%s is out of range (at most %ld)", name, cf_printable(v, shown, sizeof shown), hi);
    *out = x;
    return 0;
}

/* A (rank, size) pair of variables, both or neither. present = 0 when
 * neither is set. */
static int read_pair(const char *rank_name, const char *size_name, long max_size, int *present, long *rank,
                     long *size) {
    const char *r = env(rank_name), *s = env(size_name);
    *present = 0;
    if (!r && !s) return 0;
    if (s && !r) return cf_fail("%s is set but %s is not: set both (or neither, for a single process)", size_name, rank_name);
    if (r && !s) return cf_fail("%s is set but %s is not: set both (or neither, for a single process)", rank_name, size_name);
    if (parse_count(size_name, s, max_size, size) != 0) return -1;
    if (*size < 1) return cf_fail("%s=%ld: the number of processes must be at least 1", size_name, *size);
    if (parse_count(rank_name, r, max_size, rank) != 0) return -1;
    if (*rank >= *size)
        return cf_fail("%s=%ld but %s=%ld: a rank must be below the number of processes", rank_name, *rank, size_name, *size);
    *present = 1;
    return 0;
}

/* One entry of a Slurm tasks-per-node list ("2(x3),1": 2 tasks on each of
 * three nodes, then 1) for node `node`. */
static int slurm_tasks_on_node(const char *name, const char *list, long node, long *out) {
    char shown[128];
    const char *p = list;
    long index = 0;
    while (*p) {
        long count = 0, reps = 1;
        int digits = 0;
        while (*p >= '0' && *p <= '9' && count <= CF_DIST_MAX_WORLD) { count = count * 10 + (*p++ - '0'); digits++; }
        if (!digits || count > CF_DIST_MAX_WORLD) goto bad;
        if (*p == '(') {
            if (p[1] != 'x') goto bad;
            p += 2;
            reps = 0;
            digits = 0;
            while (*p >= '0' && *p <= '9' && reps <= CF_DIST_MAX_WORLD) { reps = reps * 10 + (*p++ - '0'); digits++; }
            if (!digits || reps < 1 || reps > CF_DIST_MAX_WORLD || *p != ')') goto bad;
            p++;
        }
        if (*p == ',') {
            p++;
            if (!*p) goto bad;
        } else if (*p) goto bad;
        if (node < index + reps) { *out = count; return 0; }
        index += reps;
    }
    return cf_fail("%s=%s lists %ld nodes but SLURM_NODEID=%ld", name, cf_printable(list, shown, sizeof shown), index, node);
bad:
    return cf_fail("%s: '%s' is not a Slurm tasks-per-node list such as '2(x3),1'", name,
                   cf_printable(list, shown, sizeof shown));
}

/* Tasks on this node under srun; 0 when no variable tells. */
static int slurm_local_size(long *out) {
    *out = 0;
    const char *names[] = {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"};
    for (int i = 0; i < 2; i++) {
        const char *list = env(names[i]);
        if (!list) continue;
        long node = 0;
        const char *nid = env("SLURM_NODEID");
        if (nid && parse_count("SLURM_NODEID", nid, CF_DIST_MAX_WORLD, &node) != 0) return -1;
        if (!nid && strchr(list, ',') == NULL && strchr(list, '(') == NULL) node = 0;   /* one node */
        else if (!nid) return cf_fail("%s is set but SLURM_NODEID is not: cannot tell this node's task count", names[i]);
        return slurm_tasks_on_node(names[i], list, node, out);
    }
    const char *per = env("SLURM_NTASKS_PER_NODE");
    if (per) return parse_count("SLURM_NTASKS_PER_NODE", per, CF_DIST_MAX_WORLD, out);
    const char *nn = env("SLURM_STEP_NUM_NODES");
    if (nn) {
        long nodes;
        if (parse_count("SLURM_STEP_NUM_NODES", nn, CF_DIST_MAX_WORLD, &nodes) != 0) return -1;
        if (nodes == 1) *out = -1;   /* all tasks on this node: the caller uses the world size */
    }
    return 0;
}

static int format_comm_id(cf_dist_env *e) {
    /* NCCL parses "[v6addr]:port" for IPv6 literals and "host:port" otherwise. */
    int v6 = strchr(e->master_addr, ':') != NULL && e->master_addr[0] != '[';
    int n = snprintf(e->nccl_comm_id, sizeof e->nccl_comm_id, v6 ? "[%s]:%d" : "%s:%d", e->master_addr, e->master_port + 1);
    if (n < 0 || (size_t)n >= sizeof e->nccl_comm_id) return cf_fail("MASTER_ADDR is too long");
    return 0;
}

/* Which launcher started this process, its rank and the world size, by the
 * precedence torchrun > mpirun > srun (launch.h); no launcher: rank 0 of 1.
 * *present = 0 then. */
static int read_world(cf_launcher *launcher, long *rank, long *size, int *present) {
    *launcher = CF_LAUNCH_NONE;
    *rank = 0;
    *size = 1;
    if (read_pair("RANK", "WORLD_SIZE", CF_DIST_MAX_WORLD, present, rank, size) != 0) return -1;
    if (*present) { *launcher = CF_LAUNCH_TORCHRUN; return 0; }
    if (read_pair("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", CF_DIST_MAX_WORLD, present, rank, size) != 0)
        return -1;
    if (*present) { *launcher = CF_LAUNCH_MPI; return 0; }
    /* srun. Only a task of a job step has SLURM_STEP_NUM_TASKS (Slurm's
     * env_array_for_step); a batch script or salloc shell has SLURM_PROCID=0
     * and the allocation's SLURM_NTASKS without being one of several
     * processes, so there SLURM_NTASKS is not read and the process runs alone.
     * SLURM_NTASKS equals SLURM_STEP_NUM_TASKS in a step, except under
     * srun --preserve-env, which keeps the allocation's: the step's is the truth. */
    if (env("SLURM_STEP_NUM_TASKS")) {
        if (read_pair("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", CF_DIST_MAX_WORLD, present, rank, size) != 0) return -1;
        *launcher = CF_LAUNCH_SLURM;
    }
    return 0;
}

int cf_dist_env_world(const char *(*getenv_fn)(const char *name), cf_launcher *launcher, int *rank, int *world_size) {
    g_getenv = getenv_fn ? getenv_fn : sys_getenv;
    long r, s;
    int present;
    if (read_world(launcher, &r, &s, &present) != 0) return -1;
    *rank = (int)r;   /* read_pair bounds both by CF_DIST_MAX_WORLD */
    *world_size = (int)s;
    return 0;
}

int cf_dist_env_parse(cf_dist_env *out, const char *(*getenv_fn)(const char *name)) {
    cf_dist_env e;
    memset(&e, 0, sizeof e);
    memset(out, 0, sizeof *out);
    g_getenv = getenv_fn ? getenv_fn : sys_getenv;

    int present = 0;
    long rank = 0, size = 1, lrank = -1, lsize = 0;
    const char *lr_name = "", *ls_name = "";

    /* a torchrun-style local rank without the global pair (when one of the
     * pair is set, read_world names the other) */
    if (!env("RANK") && !env("WORLD_SIZE") && (env("LOCAL_RANK") || env("LOCAL_WORLD_SIZE")))
        return cf_fail("%s is set but RANK and WORLD_SIZE are not: a torchrun-style launch needs all of them",
                       env("LOCAL_RANK") ? "LOCAL_RANK" : "LOCAL_WORLD_SIZE");
    if (read_world(&e.launcher, &rank, &size, &present) != 0) return -1;

    /* torchrun */
    if (e.launcher == CF_LAUNCH_TORCHRUN) {
        lr_name = "LOCAL_RANK";
        ls_name = "LOCAL_WORLD_SIZE";
        const char *lr = env("LOCAL_RANK"), *ls = env("LOCAL_WORLD_SIZE");
        if (ls && !lr) return cf_fail("LOCAL_WORLD_SIZE is set but LOCAL_RANK is not: set both");
        if (lr && parse_count("LOCAL_RANK", lr, CF_DIST_MAX_WORLD, &lrank) != 0) return -1;
        if (ls && parse_count("LOCAL_WORLD_SIZE", ls, CF_DIST_MAX_WORLD, &lsize) != 0) return -1;
        if (ls && lsize < 1) return cf_fail("LOCAL_WORLD_SIZE=%ld: the number of processes must be at least 1", lsize);
        if (!lr) { lrank = rank; lsize = size; }   /* neither: all ranks on this host */
    }

    /* mpirun (Open MPI) */
    if (e.launcher == CF_LAUNCH_MPI) {
        lr_name = "OMPI_COMM_WORLD_LOCAL_RANK";
        ls_name = "OMPI_COMM_WORLD_LOCAL_SIZE";
        int lp = 0;
        if (read_pair(lr_name, ls_name, CF_DIST_MAX_WORLD, &lp, &lrank, &lsize) != 0) return -1;
        if (!lp) { lrank = -1; lsize = 0; }
    }

    /* srun */
    if (e.launcher == CF_LAUNCH_SLURM) {
        lr_name = "SLURM_LOCALID";
        ls_name = env("SLURM_STEP_TASKS_PER_NODE") ? "SLURM_STEP_TASKS_PER_NODE"
                  : env("SLURM_TASKS_PER_NODE") ? "SLURM_TASKS_PER_NODE" : "SLURM_NTASKS_PER_NODE";
        const char *lr = env("SLURM_LOCALID");
        if (lr && parse_count("SLURM_LOCALID", lr, CF_DIST_MAX_WORLD, &lrank) != 0) return -1;
        if (slurm_local_size(&lsize) != 0) return -1;
        if (lsize < 0) lsize = size;
    }

    if (!present) {
        e.launcher = CF_LAUNCH_NONE;
        rank = 0; size = 1; lrank = 0; lsize = 1;
    }
    if (size == 1 && lsize == 0) lsize = 1;
    if (lsize > size)
        return cf_fail("%s=%ld is more than the %ld processes of the job", ls_name, lsize, size);
    if (lrank < 0 && lsize == size) lrank = rank;
    if (lrank < 0)
        return cf_fail("%s is not set: cannot tell which GPU of this host is this process's (%s, rank %ld of %ld)",
                       lr_name, cf_launcher_name(e.launcher), rank, size);
    if (lsize > 0 && lrank >= lsize)
        return cf_fail("%s=%ld but %s=%ld: the local rank must be below the number of processes on this host", lr_name,
                       lrank, ls_name, lsize);
    if (lsize == 0 && lrank >= size)
        return cf_fail("%s=%ld but the job has %ld processes", lr_name, lrank, size);
    e.rank = (int)rank;
    e.world_size = (int)size;
    e.local_rank = (int)lrank;
    e.local_world_size = (int)lsize;
    e.single_host = lsize == size;

    /* rendezvous */
    const char *addr = env("MASTER_ADDR"), *port = env("MASTER_PORT"), *cid = env("NCCL_COMM_ID");
    char shown[80];
    if (addr) {
        if (!*addr) return cf_fail("MASTER_ADDR is set but empty: set it to the address of rank 0's host");
        if (strlen(addr) >= sizeof e.master_addr) return cf_fail("MASTER_ADDR is too long (%zu bytes)", strlen(addr));
        for (const char *p = addr; *p; p++)
            if ((unsigned char)*p <= ' ' || *p == 0x7f || *p == '/')
                return cf_fail("MASTER_ADDR: '%s' is not a host name or address", cf_printable(addr, shown, sizeof shown));
        snprintf(e.master_addr, sizeof e.master_addr, "%s", addr);
    } else {
        snprintf(e.master_addr, sizeof e.master_addr, "%s", CF_DIST_DEFAULT_ADDR);
        e.addr_defaulted = 1;
    }
    e.master_port = CF_DIST_DEFAULT_PORT;
    if (port) {
        long p;
        if (parse_count("MASTER_PORT", port, 1000000000L, &p) != 0) return -1;
        if (p < 1 || p > 65534)
            return cf_fail("MASTER_PORT=%ld is outside [1, 65534] (NCCL's bootstrap listens on MASTER_PORT+1)", p);
        e.master_port = (int)p;
    }
    if (cid) {
        if (!*cid || strlen(cid) >= sizeof e.nccl_comm_id || !strchr(cid, ':'))
            return cf_fail("NCCL_COMM_ID: '%s' is not host:port", cf_printable(cid, shown, sizeof shown));
        snprintf(e.nccl_comm_id, sizeof e.nccl_comm_id, "%s", cid);
        e.nccl_comm_id_from_env = 1;
    } else {
        if (e.addr_defaulted && !e.single_host) {
            if (e.local_world_size > 0)
                return cf_fail("%s: %d processes on several hosts (%d on this one) and MASTER_ADDR is not set: export "
                               "MASTER_ADDR=<address of rank 0's host> (and MASTER_PORT) on every host",
                               cf_launcher_name(e.launcher), e.world_size, e.local_world_size);
            return cf_fail("%s: %d processes, maybe on several hosts, and MASTER_ADDR is not set: export "
                           "MASTER_ADDR=<address of rank 0's host> (and MASTER_PORT) on every host",
                           cf_launcher_name(e.launcher), e.world_size);
        }
        if (format_comm_id(&e) != 0) return -1;
    }

    const char *vis = env("CUDA_VISIBLE_DEVICES");
    if (vis) {
        cf_printable(vis, e.cuda_visible, sizeof e.cuda_visible);
        e.cuda_visible_set = 1;
    }
    *out = e;
    return 0;
}

int cf_dist_check_tp(int tp, int world_size, cf_launcher launcher) {
    if (world_size <= 1 && tp > 1)
        return cf_fail("--tp %d needs %d processes, one per GPU: start them with e.g. torchrun --nproc_per_node %d "
                       "--no-python ./centrifuge-cuda train ... (docs/DISTRIBUTED.md)", tp, tp, tp);
    if (world_size > 1 && world_size % tp != 0)
        return cf_fail("--tp %d does not divide the %d ranks %s started (world = tp x data-parallel ranks)", tp,
                       world_size, cf_launcher_name(launcher));
    return 0;
}

int cf_dist_pick_device(const cf_dist_env *e, int visible_gpus, int *device) {
    if (visible_gpus < 1)
        return cf_fail("rank %d needs a GPU but none is visible (CUDA_VISIBLE_DEVICES=%s)", e->rank,
                       e->cuda_visible_set ? e->cuda_visible : "<unset>");
    if (e->local_rank >= visible_gpus)
        return cf_fail("rank %d needs GPU %d but only %d %s visible (CUDA_VISIBLE_DEVICES=%s): start at most %d "
                       "processes per host, one per GPU",
                       e->rank, e->local_rank, visible_gpus, visible_gpus == 1 ? "is" : "are",
                       e->cuda_visible_set ? e->cuda_visible : "<unset>", visible_gpus);
    *device = e->local_rank;
    return 0;
}

const char *cf_dist_env_describe(const cf_dist_env *e, char *buf, int cap) {
    char local[48];
    if (e->local_world_size > 0) snprintf(local, sizeof local, "%d of %d", e->local_rank, e->local_world_size);
    else snprintf(local, sizeof local, "%d", e->local_rank);
    snprintf(buf, (size_t)cap, "%s: rank %d of %d (local %s), rendezvous %s:%d%s, NCCL_COMM_ID %s%s",
             cf_launcher_name(e->launcher), e->rank, e->world_size, local, e->master_addr, e->master_port,
             e->addr_defaulted ? " (default)" : "", e->nccl_comm_id, e->nccl_comm_id_from_env ? " (from the environment)" : "");
    return buf;
}
