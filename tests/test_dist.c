/* test_dist.c — data-parallel pieces that run on the CPU: the launch
 * environment, the ZeRO-1 shard and bucket plan, the optimizer shard files,
 * and the NCCL wrapper's stub in CPU builds. */
#include "test.h"
#include "base/common.h"
#include "dist/comm.h"
#include "dist/launch.h"
#include "dist/plan.h"
#include "dist/shardfile.h"

#include <dirent.h>
#include <ftw.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char g_dir[64];

static int err_has(const char *s) { return strstr(cf_last_error(), s) != NULL; }
static int err_one_line(void) { return strchr(cf_last_error(), '\n') == NULL && cf_last_error()[0] != 0; }

/* ============================================================ environment */

/* A fake environment: "NAME=value" strings. */
static const char *g_env[32];

static const char *fake_getenv(const char *name) {
    size_t n = strlen(name);
    for (int i = 0; g_env[i]; i++)
        if (strncmp(g_env[i], name, n) == 0 && g_env[i][n] == '=') return g_env[i] + n + 1;
    return NULL;
}

static void env_load(const char **vars) {
    int i = 0;
    for (; vars[i] && i < 31; i++) g_env[i] = vars[i];
    g_env[i] = NULL;
}

#define PARSE_OK(e_, ...) do { \
    env_load((const char *[]){__VA_ARGS__, NULL}); \
    int rc_ = cf_dist_env_parse(&(e_), fake_getenv); \
    CHECK_MSG(rc_ == 0, "parse failed: %s", cf_last_error()); \
} while (0)

/* Parsing fails with one line holding every fragment. */
#define PARSE_FAILS(frags_, ...) do { \
    cf_dist_env e_; \
    env_load((const char *[]){__VA_ARGS__, NULL}); \
    int rc_ = cf_dist_env_parse(&e_, fake_getenv); \
    CHECK_MSG(rc_ == -1, "parse of {%s} succeeded", #__VA_ARGS__); \
    CHECK_MSG(err_one_line(), "not one line: %s", cf_last_error()); \
    const char *f_[] = frags_; \
    for (size_t k_ = 0; k_ < sizeof f_ / sizeof f_[0]; k_++) \
        CHECK_MSG(err_has(f_[k_]), "message lacks '%s': %s", f_[k_], cf_last_error()); \
} while (0)
#define FR(...) {__VA_ARGS__}

TEST(env_without_launcher_variables_is_one_process_on_the_default_rendezvous) {
    cf_dist_env e;
    PARSE_OK(e, "HOME=/root", "PATH=/bin");
    CHECK(e.launcher == CF_LAUNCH_NONE && e.rank == 0 && e.world_size == 1);
    CHECK(e.local_rank == 0 && e.local_world_size == 1 && e.single_host);
    CHECK(strcmp(e.master_addr, "127.0.0.1") == 0 && e.master_port == 29500 && e.addr_defaulted);
    CHECK(strcmp(e.nccl_comm_id, "127.0.0.1:29501") == 0 && !e.nccl_comm_id_from_env);
    CHECK(strcmp(cf_launcher_name(e.launcher), "none") == 0);
}

TEST(env_torchrun_reads_all_six_variables_and_uses_master_port_plus_one_for_nccl) {
    cf_dist_env e;
    PARSE_OK(e, "RANK=5", "WORLD_SIZE=8", "LOCAL_RANK=1", "LOCAL_WORLD_SIZE=4", "MASTER_ADDR=10.0.0.5",
             "MASTER_PORT=12345");
    CHECK(e.launcher == CF_LAUNCH_TORCHRUN && e.rank == 5 && e.world_size == 8);
    CHECK(e.local_rank == 1 && e.local_world_size == 4 && !e.single_host);
    CHECK(strcmp(e.master_addr, "10.0.0.5") == 0 && e.master_port == 12345 && !e.addr_defaulted);
    CHECK(strcmp(e.nccl_comm_id, "10.0.0.5:12346") == 0);
    char buf[256];
    CHECK(strstr(cf_dist_env_describe(&e, buf, sizeof buf), "torchrun: rank 5 of 8 (local 1 of 4)") != NULL);
}

TEST(env_torchrun_on_one_host_without_master_addr_defaults_to_localhost) {
    cf_dist_env e;
    PARSE_OK(e, "RANK=1", "WORLD_SIZE=2", "LOCAL_RANK=1", "LOCAL_WORLD_SIZE=2");
    CHECK(e.single_host && e.addr_defaulted && strcmp(e.nccl_comm_id, "127.0.0.1:29501") == 0);
    /* RANK and WORLD_SIZE alone: every rank on this host */
    PARSE_OK(e, "RANK=2", "WORLD_SIZE=3");
    CHECK(e.local_rank == 2 && e.local_world_size == 3 && e.single_host);
    /* a port without an address */
    PARSE_OK(e, "RANK=0", "WORLD_SIZE=2", "MASTER_PORT=40000");
    CHECK(strcmp(e.nccl_comm_id, "127.0.0.1:40001") == 0);
    /* an address without a port takes the default port */
    PARSE_OK(e, "RANK=0", "WORLD_SIZE=2", "MASTER_ADDR=node7");
    CHECK(strcmp(e.nccl_comm_id, "node7:29501") == 0);
}

TEST(env_slurm_srun_step_reads_procid_step_tasks_localid_and_tasks_per_node) {
    cf_dist_env e;
    PARSE_OK(e, "SLURM_JOB_ID=77", "SLURM_PROCID=3", "SLURM_NTASKS=4", "SLURM_STEP_NUM_TASKS=4", "SLURM_LOCALID=1",
             "SLURM_NODEID=1", "SLURM_STEP_TASKS_PER_NODE=2(x2)", "MASTER_ADDR=gpu-node-1");
    CHECK(e.launcher == CF_LAUNCH_SLURM && e.rank == 3 && e.world_size == 4);
    CHECK(e.local_rank == 1 && e.local_world_size == 2 && !e.single_host);
    CHECK(strcmp(e.nccl_comm_id, "gpu-node-1:29501") == 0);
    /* one node: no MASTER_ADDR needed */
    PARSE_OK(e, "SLURM_JOB_ID=77", "SLURM_PROCID=2", "SLURM_NTASKS=4", "SLURM_STEP_NUM_TASKS=4", "SLURM_LOCALID=2",
             "SLURM_NODEID=0", "SLURM_STEP_TASKS_PER_NODE=4");
    CHECK(e.single_host && e.local_world_size == 4 && e.addr_defaulted);
    /* srun --preserve-env keeps the allocation's SLURM_NTASKS: the step's count wins */
    PARSE_OK(e, "SLURM_JOB_ID=77", "SLURM_PROCID=1", "SLURM_NTASKS=16", "SLURM_STEP_NUM_TASKS=2", "SLURM_LOCALID=1",
             "SLURM_STEP_TASKS_PER_NODE=2");
    CHECK(e.world_size == 2 && e.single_host);
}

TEST(env_slurm_uneven_tasks_per_node_lists_give_this_nodes_count) {
    cf_dist_env e;
    PARSE_OK(e, "SLURM_PROCID=3", "SLURM_STEP_NUM_TASKS=4", "SLURM_LOCALID=0", "SLURM_NODEID=1",
             "SLURM_STEP_TASKS_PER_NODE=3,1", "MASTER_ADDR=a");
    CHECK(e.local_world_size == 1);
    PARSE_OK(e, "SLURM_PROCID=7", "SLURM_STEP_NUM_TASKS=8", "SLURM_LOCALID=0", "SLURM_NODEID=3",
             "SLURM_STEP_TASKS_PER_NODE=2(x3),1,1", "MASTER_ADDR=a");
    CHECK(e.local_world_size == 1);
    PARSE_OK(e, "SLURM_PROCID=5", "SLURM_STEP_NUM_TASKS=8", "SLURM_LOCALID=1", "SLURM_NODEID=2",
             "SLURM_STEP_TASKS_PER_NODE=2(x3),1,1", "MASTER_ADDR=a");
    CHECK(e.local_world_size == 2);
    /* SLURM_TASKS_PER_NODE and SLURM_NTASKS_PER_NODE are fallbacks */
    PARSE_OK(e, "SLURM_PROCID=1", "SLURM_STEP_NUM_TASKS=4", "SLURM_LOCALID=1", "SLURM_NODEID=0",
             "SLURM_TASKS_PER_NODE=2(x2)", "MASTER_ADDR=a");
    CHECK(e.local_world_size == 2);
    PARSE_OK(e, "SLURM_PROCID=1", "SLURM_STEP_NUM_TASKS=4", "SLURM_LOCALID=1", "SLURM_NTASKS_PER_NODE=2",
             "MASTER_ADDR=a");
    CHECK(e.local_world_size == 2);
}

TEST(env_slurm_batch_script_without_srun_runs_as_one_process) {
    cf_dist_env e;
    /* sbatch --ntasks=8: the script itself has SLURM_PROCID=0 and the allocation's SLURM_NTASKS */
    PARSE_OK(e, "SLURM_JOB_ID=77", "SLURM_PROCID=0", "SLURM_NTASKS=8", "SLURM_LOCALID=0", "SLURM_NODEID=0",
             "SLURM_TASKS_PER_NODE=8");
    CHECK(e.launcher == CF_LAUNCH_NONE && e.world_size == 1 && e.rank == 0);
}

TEST(env_mpirun_reads_open_mpi_variables) {
    cf_dist_env e;
    PARSE_OK(e, "OMPI_COMM_WORLD_RANK=6", "OMPI_COMM_WORLD_SIZE=8", "OMPI_COMM_WORLD_LOCAL_RANK=2",
             "OMPI_COMM_WORLD_LOCAL_SIZE=4", "MASTER_ADDR=fd00::12", "MASTER_PORT=3000");
    CHECK(e.launcher == CF_LAUNCH_MPI && e.rank == 6 && e.world_size == 8);
    CHECK(e.local_rank == 2 && e.local_world_size == 4);
    /* an IPv6 literal is bracketed the way NCCL parses NCCL_COMM_ID */
    CHECK(strcmp(e.nccl_comm_id, "[fd00::12]:3001") == 0);
    PARSE_OK(e, "OMPI_COMM_WORLD_RANK=1", "OMPI_COMM_WORLD_SIZE=2", "OMPI_COMM_WORLD_LOCAL_RANK=1",
             "OMPI_COMM_WORLD_LOCAL_SIZE=2");
    CHECK(e.single_host && strcmp(e.nccl_comm_id, "127.0.0.1:29501") == 0);
}

TEST(env_precedence_is_torchrun_then_mpirun_then_srun) {
    cf_dist_env e;
    PARSE_OK(e, "RANK=1", "WORLD_SIZE=2", "OMPI_COMM_WORLD_RANK=0", "OMPI_COMM_WORLD_SIZE=4", "SLURM_PROCID=3",
             "SLURM_STEP_NUM_TASKS=4", "SLURM_LOCALID=3");
    CHECK(e.launcher == CF_LAUNCH_TORCHRUN && e.rank == 1 && e.world_size == 2);
    /* mpirun inside a Slurm allocation: its daemons were started by srun, the OMPI numbering is the real one */
    PARSE_OK(e, "OMPI_COMM_WORLD_RANK=3", "OMPI_COMM_WORLD_SIZE=4", "OMPI_COMM_WORLD_LOCAL_RANK=3",
             "OMPI_COMM_WORLD_LOCAL_SIZE=4", "SLURM_PROCID=0", "SLURM_STEP_NUM_TASKS=1", "SLURM_LOCALID=0");
    CHECK(e.launcher == CF_LAUNCH_MPI && e.rank == 3 && e.world_size == 4);
    /* torchrun inside srun */
    PARSE_OK(e, "RANK=3", "WORLD_SIZE=4", "LOCAL_RANK=3", "LOCAL_WORLD_SIZE=4", "SLURM_PROCID=0",
             "SLURM_STEP_NUM_TASKS=1", "SLURM_LOCALID=0");
    CHECK(e.launcher == CF_LAUNCH_TORCHRUN && e.rank == 3);
}

TEST(env_nccl_comm_id_already_set_is_used_as_is) {
    cf_dist_env e;
    PARSE_OK(e, "RANK=0", "WORLD_SIZE=4", "LOCAL_RANK=0", "LOCAL_WORLD_SIZE=2", "NCCL_COMM_ID=10.1.2.3:7000");
    CHECK(strcmp(e.nccl_comm_id, "10.1.2.3:7000") == 0 && e.nccl_comm_id_from_env);
    PARSE_FAILS(FR("NCCL_COMM_ID", "host:port"), "NCCL_COMM_ID=nohostport");
}

TEST(env_half_set_rank_pairs_fail_naming_the_missing_variable) {
    PARSE_FAILS(FR("WORLD_SIZE is set but RANK is not"), "WORLD_SIZE=2");
    PARSE_FAILS(FR("RANK is set but WORLD_SIZE is not"), "RANK=0");
    PARSE_FAILS(FR("LOCAL_WORLD_SIZE is set but LOCAL_RANK is not"), "RANK=0", "WORLD_SIZE=2", "LOCAL_WORLD_SIZE=2");
    PARSE_FAILS(FR("LOCAL_RANK is set but RANK and WORLD_SIZE are not"), "LOCAL_RANK=0");
    PARSE_FAILS(FR("OMPI_COMM_WORLD_SIZE is set but OMPI_COMM_WORLD_RANK is not"), "OMPI_COMM_WORLD_SIZE=2");
    PARSE_FAILS(FR("OMPI_COMM_WORLD_RANK is set but OMPI_COMM_WORLD_SIZE is not"), "OMPI_COMM_WORLD_RANK=1");
    PARSE_FAILS(FR("OMPI_COMM_WORLD_LOCAL_SIZE is set but OMPI_COMM_WORLD_LOCAL_RANK is not"),
                "OMPI_COMM_WORLD_RANK=0", "OMPI_COMM_WORLD_SIZE=2", "OMPI_COMM_WORLD_LOCAL_SIZE=2");
    PARSE_FAILS(FR("SLURM_STEP_NUM_TASKS is set but SLURM_PROCID is not"), "SLURM_STEP_NUM_TASKS=2");
    /* several hosts, and the local rank is unknown */
    PARSE_FAILS(FR("OMPI_COMM_WORLD_LOCAL_RANK is not set"), "OMPI_COMM_WORLD_RANK=0", "OMPI_COMM_WORLD_SIZE=2",
                "MASTER_ADDR=a", "OMPI_COMM_WORLD_LOCAL_RANK_X=1");
    PARSE_FAILS(FR("SLURM_LOCALID is not set"), "SLURM_PROCID=1", "SLURM_STEP_NUM_TASKS=4", "SLURM_NODEID=0",
                "SLURM_STEP_TASKS_PER_NODE=2(x2)", "MASTER_ADDR=a");
}

TEST(env_non_numeric_values_fail_naming_the_variable) {
    PARSE_FAILS(FR("RANK", "'abc' is not a non-negative integer"), "RANK=abc", "WORLD_SIZE=2");
    PARSE_FAILS(FR("WORLD_SIZE", "'4x'"), "RANK=0", "WORLD_SIZE=4x");
    PARSE_FAILS(FR("WORLD_SIZE", "'-2'"), "RANK=0", "WORLD_SIZE=-2");
    PARSE_FAILS(FR("WORLD_SIZE", "' 2'"), "RANK=0", "WORLD_SIZE= 2");
    PARSE_FAILS(FR("WORLD_SIZE is set but empty"), "RANK=0", "WORLD_SIZE=");
    PARSE_FAILS(FR("LOCAL_RANK", "'one'"), "RANK=0", "WORLD_SIZE=2", "LOCAL_RANK=one", "LOCAL_WORLD_SIZE=2");
    PARSE_FAILS(FR("LOCAL_WORLD_SIZE", "'2.0'"), "RANK=0", "WORLD_SIZE=2", "LOCAL_RANK=0", "LOCAL_WORLD_SIZE=2.0");
    PARSE_FAILS(FR("OMPI_COMM_WORLD_RANK", "'0x1'"), "OMPI_COMM_WORLD_RANK=0x1", "OMPI_COMM_WORLD_SIZE=2");
    PARSE_FAILS(FR("SLURM_PROCID", "'?'"), "SLURM_PROCID=\t", "SLURM_STEP_NUM_TASKS=2");
    PARSE_FAILS(FR("SLURM_LOCALID"), "SLURM_PROCID=0", "SLURM_STEP_NUM_TASKS=2", "SLURM_LOCALID=z");
    PARSE_FAILS(FR("SLURM_STEP_TASKS_PER_NODE", "tasks-per-node list"), "SLURM_PROCID=0", "SLURM_STEP_NUM_TASKS=2",
                "SLURM_LOCALID=0", "SLURM_NODEID=0", "SLURM_STEP_TASKS_PER_NODE=2(x");
    PARSE_FAILS(FR("SLURM_STEP_TASKS_PER_NODE", "lists 2 nodes but SLURM_NODEID=5"), "SLURM_PROCID=0",
                "SLURM_STEP_NUM_TASKS=2", "SLURM_LOCALID=0", "SLURM_NODEID=5", "SLURM_STEP_TASKS_PER_NODE=1,1",
                "MASTER_ADDR=a");
    PARSE_FAILS(FR("MASTER_PORT", "'http'"), "RANK=0", "WORLD_SIZE=2", "MASTER_PORT=http");
}

TEST(env_out_of_range_ranks_and_sizes_fail) {
    PARSE_FAILS(FR("RANK=4 but WORLD_SIZE=4", "below"), "RANK=4", "WORLD_SIZE=4");
    PARSE_FAILS(FR("WORLD_SIZE=0", "at least 1"), "RANK=0", "WORLD_SIZE=0");
    PARSE_FAILS(FR("WORLD_SIZE=100000", "out of range"), "RANK=0", "WORLD_SIZE=100000");
    PARSE_FAILS(FR("WORLD_SIZE", "out of range"), "RANK=0", "WORLD_SIZE=99999999999999999999999999");
    PARSE_FAILS(FR("LOCAL_RANK=2 but LOCAL_WORLD_SIZE=2"), "RANK=2", "WORLD_SIZE=4", "LOCAL_RANK=2",
                "LOCAL_WORLD_SIZE=2", "MASTER_ADDR=a");
    PARSE_FAILS(FR("LOCAL_WORLD_SIZE=8 is more than the 4 processes"), "RANK=0", "WORLD_SIZE=4", "LOCAL_RANK=0",
                "LOCAL_WORLD_SIZE=8");
    PARSE_FAILS(FR("LOCAL_WORLD_SIZE=0", "at least 1"), "RANK=0", "WORLD_SIZE=4", "LOCAL_RANK=0",
                "LOCAL_WORLD_SIZE=0");
    PARSE_FAILS(FR("OMPI_COMM_WORLD_LOCAL_RANK=3 but OMPI_COMM_WORLD_LOCAL_SIZE=3"), "OMPI_COMM_WORLD_RANK=3",
                "OMPI_COMM_WORLD_SIZE=6", "OMPI_COMM_WORLD_LOCAL_RANK=3", "OMPI_COMM_WORLD_LOCAL_SIZE=3",
                "MASTER_ADDR=a");
    PARSE_FAILS(FR("SLURM_PROCID=4 but SLURM_STEP_NUM_TASKS=4"), "SLURM_PROCID=4", "SLURM_STEP_NUM_TASKS=4");
    PARSE_FAILS(FR("SLURM_LOCALID=2 but SLURM_STEP_TASKS_PER_NODE=2"), "SLURM_PROCID=2", "SLURM_STEP_NUM_TASKS=4",
                "SLURM_LOCALID=2", "SLURM_NODEID=1", "SLURM_STEP_TASKS_PER_NODE=2(x2)", "MASTER_ADDR=a");
}

TEST(env_bad_master_port_and_addr_fail_naming_the_variable) {
    PARSE_FAILS(FR("MASTER_PORT=0", "[1, 65534]"), "RANK=0", "WORLD_SIZE=2", "MASTER_PORT=0");
    PARSE_FAILS(FR("MASTER_PORT=65535", "MASTER_PORT+1"), "RANK=0", "WORLD_SIZE=2", "MASTER_PORT=65535");
    PARSE_FAILS(FR("MASTER_PORT=70000"), "RANK=0", "WORLD_SIZE=2", "MASTER_PORT=70000");
    PARSE_FAILS(FR("MASTER_ADDR is set but empty"), "RANK=0", "WORLD_SIZE=2", "MASTER_ADDR=");
    PARSE_FAILS(FR("MASTER_ADDR", "'a b'"), "RANK=0", "WORLD_SIZE=2", "MASTER_ADDR=a b");
    /* the single-process case validates them too */
    PARSE_FAILS(FR("MASTER_PORT=99999"), "MASTER_PORT=99999");
}

TEST(env_several_hosts_without_master_addr_tell_the_user_to_export_it) {
    PARSE_FAILS(FR("MASTER_ADDR is not set", "export MASTER_ADDR", "4 processes on several hosts (2 on this one)"),
                "RANK=0", "WORLD_SIZE=4", "LOCAL_RANK=0", "LOCAL_WORLD_SIZE=2");
    PARSE_FAILS(FR("MASTER_ADDR is not set", "slurm"), "SLURM_PROCID=0", "SLURM_STEP_NUM_TASKS=4", "SLURM_LOCALID=0",
                "SLURM_NODEID=0", "SLURM_STEP_TASKS_PER_NODE=2(x2)");
    PARSE_FAILS(FR("MASTER_ADDR is not set", "maybe on several hosts"), "RANK=0", "WORLD_SIZE=4", "LOCAL_RANK=0");
}

/* cf_dist_env_world (the commands that run in one process): the launcher,
 * rank and world size of cf_dist_env_parse, without the local-rank and
 * rendezvous checks that only several processes need. */
#define WORLD_IS(l_, r_, w_, ...) do { \
    env_load((const char *[]){__VA_ARGS__, NULL}); \
    cf_launcher gl_; int gr_ = -7, gw_ = -7; \
    int rc_ = cf_dist_env_world(fake_getenv, &gl_, &gr_, &gw_); \
    CHECK_MSG(rc_ == 0 && gl_ == (l_) && gr_ == (r_) && gw_ == (w_), "{%s}: rc %d (%s), %s rank %d of %d", \
              #__VA_ARGS__, rc_, rc_ ? cf_last_error() : "", cf_launcher_name(gl_), gr_, gw_); \
} while (0)

TEST(env_world_alone_reads_rank_and_size_with_the_same_precedence_and_nothing_else) {
    WORLD_IS(CF_LAUNCH_NONE, 0, 1, "HOME=/root");
    WORLD_IS(CF_LAUNCH_TORCHRUN, 1, 2, "RANK=1", "WORLD_SIZE=2", "LOCAL_RANK=1", "LOCAL_WORLD_SIZE=2");
    WORLD_IS(CF_LAUNCH_TORCHRUN, 0, 1, "RANK=0", "WORLD_SIZE=1", "LOCAL_RANK=0", "LOCAL_WORLD_SIZE=1");
    WORLD_IS(CF_LAUNCH_MPI, 3, 4, "OMPI_COMM_WORLD_RANK=3", "OMPI_COMM_WORLD_SIZE=4", "SLURM_PROCID=0",
             "SLURM_STEP_NUM_TASKS=1");
    WORLD_IS(CF_LAUNCH_SLURM, 1, 2, "SLURM_PROCID=1", "SLURM_STEP_NUM_TASKS=2");
    WORLD_IS(CF_LAUNCH_NONE, 0, 1, "SLURM_PROCID=0", "SLURM_NTASKS=8");   /* a batch script */
    /* what only several processes need is not read: a missing local rank on
     * several hosts, MASTER_ADDR, a bad MASTER_PORT or NCCL_COMM_ID, a stray
     * LOCAL_RANK */
    WORLD_IS(CF_LAUNCH_MPI, 0, 2, "OMPI_COMM_WORLD_RANK=0", "OMPI_COMM_WORLD_SIZE=2", "MASTER_PORT=zz");
    WORLD_IS(CF_LAUNCH_SLURM, 1, 4, "SLURM_PROCID=1", "SLURM_STEP_NUM_TASKS=4", "SLURM_STEP_TASKS_PER_NODE=2(x2)");
    WORLD_IS(CF_LAUNCH_NONE, 0, 1, "LOCAL_RANK=0", "NCCL_COMM_ID=nohostport");
    /* a contradictory or malformed pair still fails, with the parser's line */
    cf_launcher l;
    int r, w;
    env_load((const char *[]){"WORLD_SIZE=2", NULL});
    CHECK(cf_dist_env_world(fake_getenv, &l, &r, &w) == -1 && err_has("WORLD_SIZE is set but RANK is not"));
    env_load((const char *[]){"RANK=2", "WORLD_SIZE=2", NULL});
    CHECK(cf_dist_env_world(fake_getenv, &l, &r, &w) == -1 && err_has("a rank must be below"));
    env_load((const char *[]){"OMPI_COMM_WORLD_RANK=0", "OMPI_COMM_WORLD_SIZE= 2", NULL});
    CHECK(cf_dist_env_world(fake_getenv, &l, &r, &w) == -1 && err_has("OMPI_COMM_WORLD_SIZE: ' 2'"));
    /* where the full parse succeeds, both agree */
    const char *envs[][8] = {
        {"RANK=5", "WORLD_SIZE=8", "LOCAL_RANK=1", "LOCAL_WORLD_SIZE=4", "MASTER_ADDR=a", NULL},
        {"OMPI_COMM_WORLD_RANK=6", "OMPI_COMM_WORLD_SIZE=8", "OMPI_COMM_WORLD_LOCAL_RANK=2",
         "OMPI_COMM_WORLD_LOCAL_SIZE=4", "MASTER_ADDR=a", NULL},
        {"SLURM_PROCID=3", "SLURM_STEP_NUM_TASKS=4", "SLURM_LOCALID=1", "SLURM_NODEID=1",
         "SLURM_STEP_TASKS_PER_NODE=2(x2)", "MASTER_ADDR=a", NULL},
        {"SLURM_PROCID=0", "SLURM_NTASKS=8", NULL},
    };
    for (size_t i = 0; i < sizeof envs / sizeof envs[0]; i++) {
        env_load(envs[i]);
        cf_dist_env e;
        CHECK(cf_dist_env_parse(&e, fake_getenv) == 0);
        CHECK(cf_dist_env_world(fake_getenv, &l, &r, &w) == 0);
        CHECK(l == e.launcher && r == e.rank && w == e.world_size);
    }
}

TEST(env_null_getenv_reads_the_process_environment) {
    setenv("RANK", "1", 1);
    setenv("WORLD_SIZE", "2", 1);
    setenv("MASTER_PORT", "31000", 1);
    cf_dist_env e;
    int rc = cf_dist_env_parse(&e, NULL);
    CHECK_MSG(rc == 0, "%s", cf_last_error());
    CHECK(e.launcher == CF_LAUNCH_TORCHRUN && e.rank == 1 && e.world_size == 2 && e.master_port == 31000);
    unsetenv("RANK");
    unsetenv("WORLD_SIZE");
    unsetenv("MASTER_PORT");
}

TEST(pick_device_is_the_local_rank_and_fails_when_too_few_gpus_are_visible) {
    cf_dist_env e;
    int dev = -1;
    PARSE_OK(e, "RANK=3", "WORLD_SIZE=4", "LOCAL_RANK=3", "LOCAL_WORLD_SIZE=4", "CUDA_VISIBLE_DEVICES=0,1");
    CHECK(cf_dist_pick_device(&e, 4, &dev) == 0 && dev == 3);
    dev = -1;
    CHECK(cf_dist_pick_device(&e, 2, &dev) == -1 && dev == -1);
    CHECK_MSG(err_has("rank 3 needs GPU 3 but only 2 are visible (CUDA_VISIBLE_DEVICES=0,1)"), "%s", cf_last_error());
    CHECK(err_one_line());
    PARSE_OK(e, "RANK=1", "WORLD_SIZE=2");
    CHECK(cf_dist_pick_device(&e, 1, &dev) == -1 && err_has("only 1 is visible (CUDA_VISIBLE_DEVICES=<unset>)"));
    CHECK(cf_dist_pick_device(&e, 0, &dev) == -1 && err_has("none is visible"));
}

/* ================================================================== plan */

/* Checks every property of a plan for one tensor list; returns the number of
 * failed checks (so callers can report which case failed). */
static int plan_properties_hold(const cf_zero_plan *p, const char *label) {
    int before = t_failures;
    const int W = p->world, A = p->align, n = p->num_tensors;
    const int64_t total = p->total;
    CHECK_MSG(total % ((int64_t)W * A) == 0 && p->shard_numel * W == total, "%s: total %lld", label, (long long)total);
    /* buckets: contiguous, padded to W*A, keys are runs of the tensor keys */
    int64_t at = 0;
    int t_next = 0;
    for (int b = 0; b < p->num_buckets; b++) {
        const cf_zero_bucket *k = &p->buckets[b];
        CHECK_MSG(k->start == at && k->len % ((int64_t)W * A) == 0, "%s: bucket %d at %lld len %lld", label, b,
                  (long long)k->start, (long long)k->len);
        CHECK(k->shard_len * W == k->len && k->local_start * W == k->start);
        CHECK(k->data_end <= k->start + k->len && k->start + k->len - k->data_end < (int64_t)W * A);
        CHECK(k->first_tensor == t_next && k->num_tensors >= 1);
        for (int t = k->first_tensor; t < k->first_tensor + k->num_tensors; t++) CHECK(p->key[t] == k->key && p->bucket[t] == b);
        if (b > 0) CHECK(p->buckets[b - 1].key != k->key);
        t_next += k->num_tensors;
        at += k->len;
    }
    CHECK(at == total && t_next == n);
    /* tensors: aligned, in order, inside their bucket, gaps below A */
    int64_t sum = 0;
    for (int t = 0; t < n; t++) {
        const cf_zero_bucket *k = &p->buckets[p->bucket[t]];
        CHECK_MSG(p->offset[t] % A == 0, "%s: tensor %d offset %lld", label, t, (long long)p->offset[t]);
        CHECK(p->offset[t] >= k->start && p->offset[t] + p->numel[t] <= k->data_end);
        int64_t prev_end = t == k->first_tensor ? k->start : p->offset[t - 1] + p->numel[t - 1];
        CHECK(p->offset[t] >= prev_end && p->offset[t] - prev_end < A);
        sum += p->numel[t];
    }
    CHECK(sum == p->numel_sum);
    if (total > 50 * 1000 * 1000) return t_failures - before;

    /* element-level: which tensor covers each flat element (-1 = padding), owner rank of each */
    int *tensor_of = malloc((size_t)(total ? total : 1) * sizeof(int));
    int *owner = malloc((size_t)(total ? total : 1) * sizeof(int));
    int *seen = calloc((size_t)(total ? total : 1), sizeof(int));
    for (int64_t i = 0; i < total; i++) tensor_of[i] = -1, owner[i] = -1;
    int overlap = 0, multi_owner = 0;
    for (int t = 0; t < n; t++)
        for (int64_t i = p->offset[t]; i < p->offset[t] + p->numel[t]; i++) {
            overlap += tensor_of[i] != -1;
            tensor_of[i] = t;
        }
    CHECK_MSG(overlap == 0, "%s: %d elements in two tensors", label, overlap);
    for (int r = 0; r < W; r++)
        for (int b = 0; b < p->num_buckets; b++) {
            int64_t fs, ls, len;
            cf_zero_plan_slice(p, r, b, &fs, &ls, &len);
            CHECK(fs == p->buckets[b].start + r * len && ls == p->buckets[b].local_start);
            CHECK(fs % A == 0);
            for (int64_t i = fs; i < fs + len; i++) {
                multi_owner += owner[i] != -1;
                owner[i] = r;
            }
        }
    int unowned = 0;
    for (int64_t i = 0; i < total; i++) unowned += owner[i] == -1;
    CHECK_MSG(multi_owner == 0 && unowned == 0, "%s: %d elements owned twice, %d by nobody", label, multi_owner, unowned);

    /* segments: per rank, in local order, exactly the rank's non-padding elements */
    for (int r = 0; r < W; r++) {
        cf_zero_segment *seg = NULL;
        int ns = -1;
        CHECK(cf_zero_plan_segments(p, r, &seg, &ns) == 0 && ns >= 0);
        int64_t last_local = -1, covered = 0;
        int bad = 0;
        for (int s = 0; s < ns; s++) {
            const cf_zero_segment *g = &seg[s];
            bad += g->len <= 0 || g->local_off <= last_local || g->local_off < 0 ||
                   g->local_off + g->len > p->shard_numel;
            bad += g->tensor_off != g->flat_off - p->offset[g->tensor] || g->tensor_off < 0 ||
                   g->tensor_off + g->len > p->numel[g->tensor] || g->bucket != p->bucket[g->tensor];
            /* local and flat offsets map through the bucket slice */
            int64_t fs, ls, len;
            cf_zero_plan_slice(p, r, g->bucket, &fs, &ls, &len);
            bad += g->local_off - ls != g->flat_off - fs || g->flat_off < fs || g->flat_off + g->len > fs + len;
            for (int64_t i = g->flat_off; i < g->flat_off + g->len; i++) {
                bad += tensor_of[i] != g->tensor || owner[i] != r;
                seen[i]++;
            }
            last_local = g->local_off + g->len - 1;
            covered += g->len;
        }
        int64_t mine = 0;
        for (int64_t i = 0; i < total; i++) mine += owner[i] == r && tensor_of[i] >= 0;
        CHECK_MSG(bad == 0 && covered == mine, "%s: rank %d segments: %d bad, cover %lld of %lld", label, r, bad,
                  (long long)covered, (long long)mine);
        free(seg);
    }
    int wrong = 0;
    for (int64_t i = 0; i < total; i++) wrong += seen[i] != (tensor_of[i] >= 0 ? 1 : 0);
    CHECK_MSG(wrong == 0, "%s: %d elements not covered exactly once by the segments of all ranks", label, wrong);
    free(tensor_of);
    free(owner);
    free(seen);
    return t_failures - before;
}

/* A tiny Llama's trainable tensors: embedding, L layers of 9, final norm + head. */
static int llama_like(int64_t *numel, int *key, int L, int C, int F, int V) {
    int n = 0;
    numel[n] = (int64_t)V * C; key[n++] = -1;
    for (int l = 0; l < L; l++) {
        int64_t sizes[9] = {C, (int64_t)C * C, (int64_t)C * C / 4, (int64_t)C * C / 4, (int64_t)C * C, C,
                            (int64_t)F * C, (int64_t)F * C, (int64_t)C * F};
        for (int i = 0; i < 9; i++) { numel[n] = sizes[i]; key[n++] = l; }
    }
    numel[n] = C; key[n++] = L;
    numel[n] = (int64_t)V * C; key[n++] = L;
    return n;
}

TEST(plan_properties_hold_for_several_tensor_lists_and_world_sizes) {
    int64_t numel[64];
    int key[64];
    const int worlds[] = {1, 2, 3, 4, 8}, aligns[] = {1, 8, 5};
    cf_rng rng;
    cf_rng_seed(&rng, 14);
    for (int list = 0; list < 6; list++) {
        int n;
        if (list == 0) n = llama_like(numel, key, 3, 16, 44, 67);
        else if (list == 1) { n = 1; numel[0] = 1001; key[0] = 0; }
        else if (list == 2) { n = 3; numel[0] = 1; numel[1] = 1; numel[2] = 1; key[0] = key[1] = key[2] = 7; }
        else if (list == 3) {   /* empty tensors, repeated non-adjacent keys */
            n = 6;
            int64_t s[6] = {0, 13, 0, 97, 5, 0};
            int k[6] = {-1, -1, 0, 0, -1, 1};
            memcpy(numel, s, sizeof s);
            memcpy(key, k, sizeof k);
        } else {                /* random sizes and key runs */
            n = 5 + (int)cf_rng_below(&rng, 40);
            int k = -1;
            for (int i = 0; i < n; i++) {
                if (cf_rng_below(&rng, 3) == 0) k++;
                key[i] = k;
                numel[i] = cf_rng_below(&rng, 4) == 0 ? (int64_t)cf_rng_below(&rng, 5) : (int64_t)cf_rng_below(&rng, 3000);
            }
        }
        for (size_t wi = 0; wi < sizeof worlds / sizeof worlds[0]; wi++)
            for (size_t ai = 0; ai < sizeof aligns / sizeof aligns[0]; ai++) {
                cf_zero_plan p;
                char label[64];
                snprintf(label, sizeof label, "list %d W=%d A=%d", list, worlds[wi], aligns[ai]);
                int rc = cf_zero_plan_build(&p, numel, key, n, worlds[wi], aligns[ai]);
                CHECK_MSG(rc == 0, "%s: %s", label, cf_last_error());
                if (rc == 0) plan_properties_hold(&p, label);
                cf_zero_plan_free(&p);
            }
    }
}

TEST(plan_world_1_align_1_is_the_identity_layout) {
    int64_t numel[64];
    int key[64];
    int n = llama_like(numel, key, 2, 8, 24, 33);
    cf_zero_plan p;
    CHECK(cf_zero_plan_build(&p, numel, key, n, 1, 1) == 0);
    int64_t at = 0;
    for (int t = 0; t < n; t++) {
        CHECK(p.offset[t] == at);
        at += numel[t];
    }
    CHECK(p.total == at && p.shard_numel == at && p.numel_sum == at);
    cf_zero_segment *seg;
    int ns;
    CHECK(cf_zero_plan_segments(&p, 0, &seg, &ns) == 0 && ns == n);
    for (int s = 0; s < ns; s++)
        CHECK(seg[s].tensor == s && seg[s].local_off == seg[s].flat_off && seg[s].flat_off == p.offset[s] &&
              seg[s].tensor_off == 0 && seg[s].len == numel[s]);
    free(seg);
    cf_zero_plan_free(&p);
}

TEST(plan_world_1_pads_only_to_the_alignment) {
    int64_t numel[5] = {3, 9, 16, 1, 7};
    int key[5] = {-1, 0, 0, 1, 1};
    cf_zero_plan p;
    CHECK(cf_zero_plan_build(&p, numel, key, 5, 1, 8) == 0);
    /* -1: [0,3) pad to 8; 0: 8..17, 24..40 (pad 40); 1: 40..41, 48..55 pad to 56 */
    int64_t want[5] = {0, 8, 24, 40, 48};
    for (int t = 0; t < 5; t++) CHECK(p.offset[t] == want[t]);
    CHECK(p.total == 56 && p.num_buckets == 3 && p.shard_numel == 56);
    cf_zero_plan_free(&p);
}

TEST(plan_buckets_are_runs_of_equal_keys_padded_to_world_times_align) {
    int64_t numel[6] = {10, 4, 4, 30, 2, 9};
    int key[6] = {-1, 0, 0, 1, 1, 2};
    cf_zero_plan p;
    CHECK(cf_zero_plan_build(&p, numel, key, 6, 4, 2) == 0);
    CHECK(p.num_buckets == 4);
    CHECK(p.buckets[0].key == -1 && p.buckets[0].num_tensors == 1 && p.buckets[0].len == 16);
    CHECK(p.buckets[1].key == 0 && p.buckets[1].first_tensor == 1 && p.buckets[1].num_tensors == 2 &&
          p.buckets[1].start == 16 && p.buckets[1].len == 8);
    CHECK(p.buckets[2].key == 1 && p.buckets[2].num_tensors == 2 && p.buckets[2].len == 32);
    CHECK(p.buckets[3].key == 2 && p.buckets[3].len == 16 && p.total == 72 && p.shard_numel == 18);
    /* rank 2's slice of bucket 2: flat [24 + 2*8, +8), local [6, +8) */
    int64_t fs, ls, len;
    cf_zero_plan_slice(&p, 2, 2, &fs, &ls, &len);
    CHECK(fs == 40 && ls == 6 && len == 8);
    cf_zero_plan_free(&p);
}

/* cf_zero_plan_rows is the smallest row range covering every element of the
 * rank's slice in the tensor: checked element by element, for row lengths
 * that do and do not divide the slices, and for ranks owning no row. */
TEST(plan_rows_of_a_rank_are_exactly_the_rows_its_slice_touches) {
    int64_t numel[3] = {13 * 7, 5, 3 * 64};
    int key[3] = {-1, 0, 1};
    const int64_t rowlen[3] = {7, 5, 64};
    for (int W = 1; W <= 8; W++) {
        cf_zero_plan p;
        if (cf_zero_plan_build(&p, numel, key, 3, W, 4) != 0) { CHECK(0); continue; }
        int bad = 0;
        for (int t = 0; t < 3; t++) {
            int64_t covered = 0;
            for (int r = 0; r < W; r++) {
                int64_t r0, r1, fs, ls, len;
                cf_zero_plan_rows(&p, r, t, rowlen[t], &r0, &r1);
                cf_zero_plan_slice(&p, r, p.bucket[t], &fs, &ls, &len);
                int64_t want0 = -1, want1 = -1;
                for (int64_t i = 0; i < numel[t]; i++) {
                    int64_t f = p.offset[t] + i;
                    if (f < fs || f >= fs + len) continue;
                    if (want0 < 0) want0 = i / rowlen[t];
                    want1 = i / rowlen[t] + 1;
                    covered++;
                }
                if (want0 < 0) bad += r0 != r1;
                else bad += r0 != want0 || r1 != want1;
            }
            bad += covered != numel[t];   /* the slices partition the tensor */
        }
        int64_t r0 = 1, r1 = 1;
        cf_zero_plan_rows(&p, W, 0, 7, &r0, &r1);   /* no such rank */
        bad += r0 != 0 || r1 != 0;
        CHECK_MSG(bad == 0, "W=%d: %d wrong row ranges", W, bad);
        cf_zero_plan_free(&p);
    }
}

/* The helpers of the pipelined step (zero.c): cf_zero_plan_others is the
 * bucket minus the rank's slice; cf_zero_plan_row_spill is the whole rows
 * of cf_zero_plan_rows minus the slice; cf_zero_plan_buckets_done names
 * exactly the buckets with no segment after s. All against brute force,
 * element by element. */
TEST(plan_others_row_spill_and_buckets_done_match_brute_force) {
    int64_t numel[64];
    int key[64];
    int n = llama_like(numel, key, 3, 8, 20, 29);
    numel[0] = 29 * 8;   /* the embedding as rows of 8 */
    for (int W = 1; W <= 8; W++) {
        cf_zero_plan p;
        if (cf_zero_plan_build(&p, numel, key, n, W, 4) != 0) { CHECK(0); continue; }
        char *mark = calloc((size_t)p.total, 1);
        int bad = 0;
        for (int r = 0; r < W; r++) {
            for (int b = 0; b < p.num_buckets; b++) {
                int64_t fs, ls, len, st[2] = {0, 0}, ln[2] = {0, 0};
                cf_zero_plan_slice(&p, r, b, &fs, &ls, &len);
                int c = cf_zero_plan_others(&p, r, b, st, ln);
                memset(mark, 0, (size_t)p.total);
                for (int i = 0; i < c; i++)
                    for (int64_t e = st[i]; e < st[i] + ln[i]; e++) bad += e < 0 || e >= p.total || mark[e]++;
                const cf_zero_bucket *bk = &p.buckets[b];
                for (int64_t e = 0; e < p.total; e++) {
                    int want = e >= bk->start && e < bk->start + bk->len && !(e >= fs && e < fs + len);
                    bad += mark[e] != want;
                }
            }
            /* row spill of the embedding (tensor 0) */
            int64_t r0, r1, fs, ls, len, st[2] = {0, 0}, ln[2] = {0, 0};
            cf_zero_plan_rows(&p, r, 0, 8, &r0, &r1);
            cf_zero_plan_slice(&p, r, p.bucket[0], &fs, &ls, &len);
            int c = cf_zero_plan_row_spill(&p, r, 0, 8, st, ln);
            memset(mark, 0, (size_t)p.total);
            for (int i = 0; i < c; i++)
                for (int64_t e = st[i]; e < st[i] + ln[i]; e++) bad += e < 0 || e >= p.total || mark[e]++;
            for (int64_t e = 0; e < p.total; e++) {
                int64_t o = e - p.offset[0];
                int want = r1 > r0 && o >= r0 * 8 && o < r1 * 8 && !(e >= fs && e < fs + len);
                bad += mark[e] != want;
            }
            /* buckets done after each segment */
            cf_zero_segment *seg;
            int ns;
            if (cf_zero_plan_segments(&p, r, &seg, &ns) != 0) { bad++; continue; }
            int prev = 0;
            for (int s = 0; s < ns; s++) {
                int done = cf_zero_plan_buckets_done(&p, seg, ns, s);
                /* safe: no bucket before `done` has a segment still to update */
                for (int t = s + 1; t < ns; t++) bad += seg[t].bucket < done;
                /* as early as possible: the next segment's bucket is the first not done */
                if (s + 1 < ns) bad += done != seg[s + 1].bucket;
                bad += done < prev || done > p.num_buckets;
                prev = done;
            }
            if (ns > 0) bad += cf_zero_plan_buckets_done(&p, seg, ns, ns - 1) != p.num_buckets;
            free(seg);
        }
        CHECK_MSG(bad == 0, "W=%d: %d mismatches", W, bad);
        free(mark);
        cf_zero_plan_free(&p);
    }
}

TEST(plan_sharded_allgather_and_reduce_scatter_round_trip_the_flat_buffer) {
    /* Simulates ZeRO-1 on the host: each rank's shard is cut out of the flat
     * buffer by its slices, the all-gather rebuilds the buffer, and a
     * reduce-scatter of W gradient buffers gives every rank the sums of its
     * segments. */
    int64_t numel[64];
    int key[64];
    int n = llama_like(numel, key, 2, 8, 20, 29);
    for (int W = 1; W <= 8; W++) {
        cf_zero_plan p;
        if (cf_zero_plan_build(&p, numel, key, n, W, 4) != 0) { CHECK(0); continue; }
        float *flat = calloc((size_t)p.total, sizeof(float)), *back = calloc((size_t)p.total, sizeof(float));
        float *shard = calloc((size_t)p.shard_numel * W, sizeof(float));
        for (int t = 0; t < n; t++)
            for (int64_t i = 0; i < numel[t]; i++) flat[p.offset[t] + i] = (float)(t * 1000 + i % 997);
        for (int r = 0; r < W; r++)
            for (int b = 0; b < p.num_buckets; b++) {
                int64_t fs, ls, len;
                cf_zero_plan_slice(&p, r, b, &fs, &ls, &len);
                memcpy(shard + (size_t)r * p.shard_numel + ls, flat + fs, (size_t)len * sizeof(float));
            }
        for (int b = 0; b < p.num_buckets; b++)
            for (int r = 0; r < W; r++) {
                int64_t fs, ls, len;
                cf_zero_plan_slice(&p, r, b, &fs, &ls, &len);
                memcpy(back + fs, shard + (size_t)r * p.shard_numel + ls, (size_t)len * sizeof(float));
            }
        CHECK(memcmp(flat, back, (size_t)p.total * sizeof(float)) == 0);
        /* reduce-scatter of grads g_r = (r + 1) * flat: each owned element is sum_r (r+1) * flat */
        int bad = 0;
        for (int r = 0; r < W; r++) {
            cf_zero_segment *seg;
            int ns;
            if (cf_zero_plan_segments(&p, r, &seg, &ns) != 0) { bad++; continue; }
            for (int s = 0; s < ns; s++)
                for (int64_t i = 0; i < seg[s].len; i++) {
                    float want = (float)(W * (W + 1) / 2) * (float)(seg[s].tensor * 1000 + (seg[s].tensor_off + i) % 997);
                    float got = 0;
                    for (int q = 0; q < W; q++) got += (float)(q + 1) * flat[seg[s].flat_off + i];
                    bad += got != want || shard[(size_t)r * p.shard_numel + seg[s].local_off + i] !=
                                              flat[seg[s].flat_off + i];
                }
            free(seg);
        }
        CHECK_MSG(bad == 0, "W=%d: %d wrong elements", W, bad);
        free(flat); free(back); free(shard);
        cf_zero_plan_free(&p);
    }
}

TEST(plan_llama3_8b_sizes_with_8_ranks_have_no_overflow_and_exact_totals) {
    /* 8B-parameter shapes: C=4096, F=14336, V=128256, 32 layers, GQA 8 of 32 heads. */
    int64_t numel[400];
    int key[400];
    int n = 0, C = 4096, F = 14336, V = 128256, L = 32;
    numel[n] = (int64_t)V * C; key[n++] = -1;
    for (int l = 0; l < L; l++) {
        int64_t s[9] = {C, (int64_t)C * C, (int64_t)C * 1024, (int64_t)C * 1024, (int64_t)C * C, C, (int64_t)F * C,
                        (int64_t)F * C, (int64_t)C * F};
        for (int i = 0; i < 9; i++) { numel[n] = s[i]; key[n++] = l; }
    }
    numel[n] = C; key[n++] = L;
    numel[n] = (int64_t)V * C; key[n++] = L;
    cf_zero_plan p;
    CHECK(cf_zero_plan_build(&p, numel, key, n, 8, 8) == 0);
    CHECK(p.numel_sum == 8030261248LL);           /* Llama 3.1 8B's parameter count */
    CHECK(p.num_buckets == L + 2 && p.total >= p.numel_sum && p.total - p.numel_sum < (int64_t)(L + 2) * 64);
    CHECK(p.shard_numel * 8 == p.total);
    plan_properties_hold(&p, "llama3-8b W=8");   /* structural checks; element checks skipped at this size */
    int64_t covered = 0;
    for (int r = 0; r < 8; r++) {
        cf_zero_segment *seg;
        int ns;
        CHECK(cf_zero_plan_segments(&p, r, &seg, &ns) == 0);
        for (int s = 0; s < ns; s++) covered += seg[s].len;
        free(seg);
    }
    CHECK(covered == p.numel_sum);
    cf_zero_plan_free(&p);
}

TEST(plan_hash_changes_with_world_align_sizes_keys_and_order) {
    int64_t a[3] = {10, 20, 30}, b[3] = {10, 20, 31}, c[3] = {20, 10, 30};
    int k[3] = {0, 0, 1}, k2[3] = {0, 1, 1};
    uint64_t h = cf_zero_plan_hash(a, k, 3, 2, 8);
    CHECK(h == cf_zero_plan_hash(a, k, 3, 2, 8));
    CHECK(h != cf_zero_plan_hash(a, k, 3, 4, 8));
    CHECK(h != cf_zero_plan_hash(a, k, 3, 2, 4));
    CHECK(h != cf_zero_plan_hash(b, k, 3, 2, 8));
    CHECK(h != cf_zero_plan_hash(c, k, 3, 2, 8));
    CHECK(h != cf_zero_plan_hash(a, k2, 3, 2, 8));
    CHECK(h != cf_zero_plan_hash(a, k, 2, 2, 8));
    cf_zero_plan p;
    CHECK(cf_zero_plan_build(&p, a, k, 3, 2, 8) == 0 && p.hash == h);
    cf_zero_plan_free(&p);
}

TEST(plan_rejects_bad_inputs_and_overflow_with_one_line) {
    int64_t ok[2] = {4, 4}, neg[2] = {4, -1}, huge[3] = {(int64_t)1 << 61, (int64_t)1 << 61, 7};
    int k[3] = {0, 0, 0};
    cf_zero_plan p;
    CHECK(cf_zero_plan_build(&p, ok, k, 0, 2, 8) == -1 && err_has("no trainable tensors"));
    CHECK(cf_zero_plan_build(&p, ok, k, 2, 0, 8) == -1 && err_has("world size 0"));
    CHECK(cf_zero_plan_build(&p, ok, k, 2, 2, 0) == -1 && err_has("alignment 0"));
    CHECK(cf_zero_plan_build(&p, neg, k, 2, 2, 8) == -1 && err_has("tensor 1 has -1 elements"));
    CHECK(cf_zero_plan_build(&p, huge, k, 3, 3, 8) == -1 && err_has("overflows"));
    CHECK(p.buckets == NULL && p.offset == NULL);
    cf_zero_plan_free(&p);   /* safe on a failed plan */
    CHECK(cf_zero_plan_build(&p, ok, k, 2, 2, 8) == 0);
    cf_zero_segment *seg;
    int ns;
    CHECK(cf_zero_plan_segments(&p, 2, &seg, &ns) == -1 && err_has("rank 2"));
    cf_zero_plan_free(&p);
}

/* ============================================================ shard files */

static const char *tmp_path(const char *name) {
    static char bufs[4][600];
    static int k;
    char *p = bufs[k++ % 4];
    snprintf(p, sizeof bufs[0], "%s/%s", g_dir, name);
    return p;
}

static long file_size(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 ? (long)st.st_size : -1;
}

static int count_temp_files(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d))) if (strstr(e->d_name, ".tmp.")) n++;
    if (d) closedir(d);
    return n;
}

static void fill(float *a, int64_t n, float seed) {
    for (int64_t i = 0; i < n; i++) a[i] = seed + (float)(i % 1009) * 0.001f - (float)(i % 7);
}

/* Writes the W shard files of one checkpoint into dir with deterministic data. */
static int write_set(const char *dir, int W, int64_t n, uint64_t hash, int64_t step) {
    float *a = malloc((size_t)(n ? n : 1) * 3 * sizeof(float));
    int rc = 0;
    for (int r = 0; r < W && rc == 0; r++) {
        fill(a, n, (float)r);
        fill(a + n, n, (float)r + 100);
        fill(a + 2 * n, n, (float)r + 200);
        cf_shard_meta m = {W, r, hash, n, step - 1, step, 1000 * (r + 1)};
        rc = cf_shardfile_write(dir, &m, a, a + n, a + 2 * n);
    }
    free(a);
    return rc;
}

static void flip_byte(const char *path, long off) {
    FILE *f = fopen(path, "r+b");
    if (!f) return;
    fseek(f, off, SEEK_SET);
    int c = fgetc(f);
    fseek(f, off, SEEK_SET);
    fputc(c ^ 0x20, f);
    fclose(f);
}

static void copy_file(const char *from, const char *to) {
    size_t len;
    char *buf = cf_read_file(from, &len, (size_t)1 << 30);
    if (!buf) return;
    FILE *f = fopen(to, "wb");
    if (f) { fwrite(buf, 1, len, f); fclose(f); }
    free(buf);
}

#define READ_FAILS(dir_, W_, r_, hash_, n_, ...) do { \
    cf_shard_meta x_ = {W_, r_, hash_, n_, 0, 0, 0}, got_; \
    int64_t nn_ = (n_) > 0 ? (n_) : 1; \
    float *b_ = malloc((size_t)nn_ * 3 * sizeof(float)); \
    int rc_ = cf_shardfile_read(dir_, &x_, &got_, b_, b_ + nn_, b_ + 2 * nn_); \
    free(b_); \
    CHECK(rc_ == -1); \
    CHECK_MSG(err_one_line(), "not one line: %s", cf_last_error()); \
    const char *f_[] = {__VA_ARGS__}; \
    for (size_t k_ = 0; k_ < sizeof f_ / sizeof f_[0]; k_++) \
        CHECK_MSG(err_has(f_[k_]), "message lacks '%s': %s", f_[k_], cf_last_error()); \
} while (0)

TEST(shardfile_name_is_rank_and_world_zero_padded) {
    char name[64];
    CHECK(cf_shardfile_name(name, sizeof name, 1, 4) == 0 && strcmp(name, "optim-rank-00001-of-00004.bin") == 0);
    CHECK(cf_shardfile_bytes(10) == 128 + 120 + 16);
}

TEST(shardfile_round_trips_every_rank_exactly_with_its_header) {
    const char *dir = tmp_path("ckpt_rt");
    const int W = 4;
    const int64_t n = 1237;
    CHECK(write_set(dir, W, n, 0xfeedbeefcafe1234ULL, 300) == 0);
    CHECK(count_temp_files(dir) == 0);
    float *want = malloc((size_t)n * 3 * sizeof(float)), *got = malloc((size_t)n * 3 * sizeof(float));
    for (int r = 0; r < W; r++) {
        fill(want, n, (float)r);
        fill(want + n, n, (float)r + 100);
        fill(want + 2 * n, n, (float)r + 200);
        cf_shard_meta x = {W, r, 0xfeedbeefcafe1234ULL, n, 0, 0, 0}, m;
        int rc = cf_shardfile_read(dir, &x, &m, got, got + n, got + 2 * n);
        CHECK_MSG(rc == 0, "%s", cf_last_error());
        CHECK(memcmp(want, got, (size_t)n * 3 * sizeof(float)) == 0);
        CHECK(m.world_size == W && m.rank == r && m.plan_hash == 0xfeedbeefcafe1234ULL && m.local_numel == n);
        CHECK(m.step == 300 && m.opt_steps == 299 && m.data_pos == 1000 * (r + 1));
    }
    cf_shard_meta m0;
    CHECK(cf_shardfile_check_set(dir, W, 0xfeedbeefcafe1234ULL, &m0) == 0 && m0.step == 300 && m0.rank == 0);
    CHECK(cf_shardfile_check_set(dir, W, 0, NULL) == 0);
    free(want);
    free(got);
}

TEST(shardfile_large_shard_round_trips_across_io_chunks) {
    const char *dir = tmp_path("ckpt_large");
    const int64_t n = ((int64_t)1 << 22) + 123;    /* just past one 16 MiB chunk */
    float *a = malloc((size_t)n * 3 * sizeof(float)), *b = malloc((size_t)n * 3 * sizeof(float));
    fill(a, 3 * n, 0.5f);
    cf_shard_meta m = {2, 1, 42, n, 7, 7, 0}, got;
    CHECK(cf_shardfile_write(dir, &m, a, a + n, a + 2 * n) == 0);
    CHECK(file_size(tmp_path("ckpt_large/optim-rank-00001-of-00002.bin")) == (long)cf_shardfile_bytes(n));
    CHECK(cf_shardfile_read(dir, &m, &got, b, b + n, b + 2 * n) == 0);
    CHECK(memcmp(a, b, (size_t)n * 3 * sizeof(float)) == 0);
    free(a);
    free(b);
}

TEST(shardfile_empty_shard_round_trips) {
    const char *dir = tmp_path("ckpt_empty");
    cf_shard_meta m = {1, 0, 5, 0, 0, 0, 0}, got;
    CHECK(cf_shardfile_write(dir, &m, NULL, NULL, NULL) == 0);
    CHECK(cf_shardfile_read(dir, &m, &got, NULL, NULL, NULL) == 0 && got.local_numel == 0);
}

TEST(shardfile_wrong_world_size_says_resume_with_the_same_world_size) {
    const char *dir = tmp_path("ckpt_world");
    CHECK(write_set(dir, 4, 64, 9, 10) == 0);
    /* this run has 2 ranks: no file of its name exists */
    READ_FAILS(dir, 2, 1, 9, 128, "checkpoint was written by 4 ranks, this run has 2: resume with the same world size");
    CHECK(cf_shardfile_check_set(dir, 2, 9, NULL) == -1);
    CHECK_MSG(err_has("checkpoint was written by 4 ranks, this run has 2: resume with the same world size"), "%s",
              cf_last_error());
    /* a file renamed to another world size still tells by its header */
    copy_file(tmp_path("ckpt_world/optim-rank-00000-of-00004.bin"), tmp_path("ckpt_world/optim-rank-00000-of-00002.bin"));
    READ_FAILS(dir, 2, 0, 9, 64, "checkpoint was written by 4 ranks, this run has 2");
}

TEST(shardfile_wrong_rank_plan_hash_and_size_are_rejected) {
    const char *dir = tmp_path("ckpt_mismatch");
    CHECK(write_set(dir, 2, 100, 0xabcULL, 10) == 0);
    copy_file(tmp_path("ckpt_mismatch/optim-rank-00001-of-00002.bin"),
              tmp_path("ckpt_mismatch/optim-rank-00000-of-00002.bin"));
    READ_FAILS(dir, 2, 0, 0xabcULL, 100, "optim-rank-00000-of-00002.bin", "holds the optimizer shard of rank 1, this is rank 0");
    CHECK(cf_shardfile_check_set(dir, 2, 0, NULL) == -1 && err_has("holds rank 1 of 2, but its name says rank 0 of 2"));
    CHECK(write_set(dir, 2, 100, 0xabcULL, 10) == 0);
    READ_FAILS(dir, 2, 1, 0xabdULL, 100, "different parameter layout", "0000000000000abc", "0000000000000abd");
    CHECK(cf_shardfile_check_set(dir, 2, 0xabdULL, NULL) == -1 && err_has("different parameter layout"));
    READ_FAILS(dir, 2, 1, 0xabcULL, 99, "holds 100 elements per array, this run's shard has 99");
}

TEST(shardfile_truncation_and_trailing_bytes_are_rejected) {
    const char *dir = tmp_path("ckpt_trunc");
    const char *f = tmp_path("ckpt_trunc/optim-rank-00000-of-00001.bin");
    long full = (long)cf_shardfile_bytes(50);
    const long sizes[] = {full - 1, full - 16, 200, 127, 10, 0, full + 1};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        CHECK(write_set(dir, 1, 50, 3, 1) == 0);
        if (sizes[i] > full) {
            FILE *fp = fopen(f, "ab");
            if (fp) { fputc(0, fp); fclose(fp); }
        } else {
            CHECK(truncate(f, sizes[i]) == 0);
        }
        CHECK(file_size(f) == sizes[i]);
        READ_FAILS(dir, 1, 0, 3, 50, "optim-rank-00000-of-00001.bin", "truncated");
        CHECK(cf_shardfile_check_set(dir, 1, 3, NULL) == -1 && err_has("truncated"));
    }
}

TEST(shardfile_corrupt_payload_header_magic_and_version_are_rejected) {
    const char *dir = tmp_path("ckpt_corrupt");
    const char *f = tmp_path("ckpt_corrupt/optim-rank-00000-of-00001.bin");
    const int64_t n = 300;
    /* a flipped bit in each array and in the trailer */
    const long payload_offs[] = {128, 128 + 4 * n + 5, 128 + 8 * n + 4 * n - 1, 128 + 12 * n + 9};
    for (size_t i = 0; i < sizeof payload_offs / sizeof payload_offs[0]; i++) {
        CHECK(write_set(dir, 1, n, 3, 1) == 0);
        flip_byte(f, payload_offs[i]);
        READ_FAILS(dir, 1, 0, 3, n, "optimizer shard data is corrupt (checksum mismatch)");
    }
    /* header fields (the step, the rank) are covered by the header checksum */
    const long header_offs[] = {20, 48, 64, 121};
    for (size_t i = 0; i < sizeof header_offs / sizeof header_offs[0]; i++) {
        CHECK(write_set(dir, 1, n, 3, 1) == 0);
        flip_byte(f, header_offs[i]);
        READ_FAILS(dir, 1, 0, 3, n, "header is corrupt");
        CHECK(cf_shardfile_check_set(dir, 1, 3, NULL) == -1 && err_has("header is corrupt"));
    }
    CHECK(write_set(dir, 1, n, 3, 1) == 0);
    flip_byte(f, 0);
    READ_FAILS(dir, 1, 0, 3, n, "not a centrifuge optimizer shard (bad magic)");
    CHECK(write_set(dir, 1, n, 3, 1) == 0);
    flip_byte(f, 8);
    READ_FAILS(dir, 1, 0, 3, n, "version");
}

TEST(shardfile_incomplete_or_inconsistent_set_is_not_trusted) {
    const char *dir = tmp_path("ckpt_set");
    CHECK(write_set(dir, 4, 32, 11, 50) == 0);
    CHECK(cf_shardfile_check_set(dir, 4, 11, NULL) == 0);
    CHECK(unlink(tmp_path("ckpt_set/optim-rank-00002-of-00004.bin")) == 0);
    CHECK(cf_shardfile_check_set(dir, 4, 11, NULL) == -1);
    CHECK_MSG(err_has("incomplete checkpoint: 1 of 4 optimizer shard files missing (first: optim-rank-00002-of-00004.bin)"),
              "%s", cf_last_error());
    CHECK(err_one_line());
    READ_FAILS(dir, 4, 2, 11, 32, "missing");
    /* rank 3 saved a later step than the others: a save that was cut short */
    CHECK(write_set(dir, 4, 32, 11, 50) == 0);
    float z[96] = {0};
    cf_shard_meta m = {4, 3, 11, 32, 50, 51, 0};
    CHECK(cf_shardfile_write(dir, &m, z, z + 32, z + 64) == 0);
    CHECK(cf_shardfile_check_set(dir, 4, 11, NULL) == -1);
    CHECK_MSG(err_has("inconsistent checkpoint: rank 3 is at step 51"), "%s", cf_last_error());
    /* an empty directory and a missing one */
    CHECK(cf_mkdir_p(tmp_path("ckpt_none")) == 0);
    CHECK(cf_shardfile_check_set(tmp_path("ckpt_none"), 2, 0, NULL) == -1 && err_has("2 of 2 optimizer shard files missing"));
    CHECK(cf_shardfile_check_set(tmp_path("no_such_dir"), 2, 0, NULL) == -1 && err_has("missing"));
}

TEST(shardfile_write_rejects_bad_headers_and_leaves_no_temp_files) {
    const char *dir = tmp_path("ckpt_badwrite");
    float z[4] = {0};
    cf_shard_meta bad_rank = {2, 2, 1, 1, 0, 0, 0}, bad_world = {0, 0, 1, 1, 0, 0, 0}, neg = {1, 0, 1, -1, 0, 0, 0};
    CHECK(cf_shardfile_write(dir, &bad_rank, z, z, z) == -1 && err_has("invalid header"));
    CHECK(cf_shardfile_write(dir, &bad_world, z, z, z) == -1);
    CHECK(cf_shardfile_write(dir, &neg, z, z, z) == -1);
    cf_shard_meta ok = {1, 0, 1, 4, 0, 0, 0};
    CHECK(cf_shardfile_write(dir, &ok, NULL, z, z) == -1 && err_has("missing data"));
    CHECK(cf_shardfile_write(dir, &ok, z, z, z) == 0);
    CHECK(cf_shardfile_write(dir, &ok, z, z, z) == 0);   /* overwrites atomically */
    CHECK(count_temp_files(dir) == 0);
}

TEST(shard_checksum_streaming_equals_one_shot_and_sees_one_bit) {
    unsigned char buf[1000];
    for (int i = 0; i < 1000; i++) buf[i] = (unsigned char)(i * 31 + 7);
    cf_shard_sum a, b;
    cf_shard_sum_init(&a);
    cf_shard_sum_update(&a, buf, 1000);
    cf_shard_sum_init(&b);
    cf_shard_sum_update(&b, buf, 64);
    cf_shard_sum_update(&b, buf + 64, 320);
    cf_shard_sum_update(&b, buf + 384, 616);
    CHECK(cf_shard_sum_final(&a) == cf_shard_sum_final(&b));
    uint64_t h = cf_shard_sum_final(&a);
    int same = 0;
    for (int byte = 0; byte < 1000; byte += 37)
        for (int bit = 0; bit < 8; bit++) {
            buf[byte] ^= (unsigned char)(1 << bit);
            cf_shard_sum_init(&b);
            cf_shard_sum_update(&b, buf, 1000);
            same += cf_shard_sum_final(&b) == h;
            buf[byte] ^= (unsigned char)(1 << bit);
        }
    CHECK(same == 0);
    /* two flips of the top bit in one lane do not cancel */
    buf[7] ^= 0x80;
    buf[39] ^= 0x80;
    cf_shard_sum_init(&b);
    cf_shard_sum_update(&b, buf, 1000);
    CHECK(cf_shard_sum_final(&b) != h);
}

/* ================================================================== comm */

TEST(comm_in_a_cpu_build_fails_cleanly_saying_build_with_cuda) {
#ifndef CF_WITH_CUDA
    cf_dist_env e;
    PARSE_OK(e, "HOME=/");
    cf_comm *c = (cf_comm *)1;
    CHECK(cf_comm_init(&c, &e, 0, 1.0) == -1 && c == NULL);
    CHECK(err_has("built without CUDA") && err_has("make cuda"));
    CHECK(cf_comm_all_reduce(NULL, NULL, NULL, 1, CF_COMM_F32, CF_COMM_SUM, NULL) == -1);
    CHECK(cf_comm_wait(NULL, NULL, 1.0) == -1);
    cf_comm_destroy(NULL);
#endif
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st; (void)flag; (void)ftw;
    return remove(path);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/cf_test_dist_XXXXXX");
    if (!mkdtemp(g_dir)) { perror("mkdtemp"); return 2; }

    RUN(env_without_launcher_variables_is_one_process_on_the_default_rendezvous);
    RUN(env_torchrun_reads_all_six_variables_and_uses_master_port_plus_one_for_nccl);
    RUN(env_torchrun_on_one_host_without_master_addr_defaults_to_localhost);
    RUN(env_slurm_srun_step_reads_procid_step_tasks_localid_and_tasks_per_node);
    RUN(env_slurm_uneven_tasks_per_node_lists_give_this_nodes_count);
    RUN(env_slurm_batch_script_without_srun_runs_as_one_process);
    RUN(env_mpirun_reads_open_mpi_variables);
    RUN(env_precedence_is_torchrun_then_mpirun_then_srun);
    RUN(env_nccl_comm_id_already_set_is_used_as_is);
    RUN(env_half_set_rank_pairs_fail_naming_the_missing_variable);
    RUN(env_non_numeric_values_fail_naming_the_variable);
    RUN(env_out_of_range_ranks_and_sizes_fail);
    RUN(env_bad_master_port_and_addr_fail_naming_the_variable);
    RUN(env_several_hosts_without_master_addr_tell_the_user_to_export_it);
    RUN(env_world_alone_reads_rank_and_size_with_the_same_precedence_and_nothing_else);
    RUN(env_null_getenv_reads_the_process_environment);
    RUN(pick_device_is_the_local_rank_and_fails_when_too_few_gpus_are_visible);
    RUN(plan_properties_hold_for_several_tensor_lists_and_world_sizes);
    RUN(plan_world_1_align_1_is_the_identity_layout);
    RUN(plan_world_1_pads_only_to_the_alignment);
    RUN(plan_buckets_are_runs_of_equal_keys_padded_to_world_times_align);
    RUN(plan_rows_of_a_rank_are_exactly_the_rows_its_slice_touches);
    RUN(plan_others_row_spill_and_buckets_done_match_brute_force);
    RUN(plan_sharded_allgather_and_reduce_scatter_round_trip_the_flat_buffer);
    RUN(plan_llama3_8b_sizes_with_8_ranks_have_no_overflow_and_exact_totals);
    RUN(plan_hash_changes_with_world_align_sizes_keys_and_order);
    RUN(plan_rejects_bad_inputs_and_overflow_with_one_line);
    RUN(shardfile_name_is_rank_and_world_zero_padded);
    RUN(shardfile_round_trips_every_rank_exactly_with_its_header);
    RUN(shardfile_large_shard_round_trips_across_io_chunks);
    RUN(shardfile_empty_shard_round_trips);
    RUN(shardfile_wrong_world_size_says_resume_with_the_same_world_size);
    RUN(shardfile_wrong_rank_plan_hash_and_size_are_rejected);
    RUN(shardfile_truncation_and_trailing_bytes_are_rejected);
    RUN(shardfile_corrupt_payload_header_magic_and_version_are_rejected);
    RUN(shardfile_incomplete_or_inconsistent_set_is_not_trusted);
    RUN(shardfile_write_rejects_bad_headers_and_leaves_no_temp_files);
    RUN(shard_checksum_streaming_equals_one_shot_and_sees_one_bit);
    RUN(comm_in_a_cpu_build_fails_cleanly_saying_build_with_cuda);

    nftw(g_dir, rm_entry, 8, FTW_DEPTH | FTW_PHYS);
    return test_summary();
}
