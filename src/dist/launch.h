/*
 * launch.h — the launch environment of a data-parallel job: which launcher
 * started this process, its rank, the world size, its rank on this host, and
 * the rendezvous address for NCCL's bootstrap.
 *
 * One process per GPU, started by any of
 *
 *   torchrun --nproc_per_node N --no-python ./centrifuge-cuda train ...
 *       RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
 *   srun -n N ./centrifuge-cuda train ...
 *       SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID; tasks on this node
 *       from SLURM_STEP_TASKS_PER_NODE or SLURM_TASKS_PER_NODE ("2(x3),1"
 *       lists indexed by SLURM_NODEID), else SLURM_NTASKS_PER_NODE. Only srun
 *       sets SLURM_STEP_NUM_TASKS: inside a batch script or salloc shell,
 *       SLURM_PROCID=0 and SLURM_NTASKS describe the allocation, not this
 *       process, which then runs alone (start it with srun for several).
 *   mpirun -np N ./centrifuge-cuda train ...
 *       OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK,
 *       OMPI_COMM_WORLD_LOCAL_SIZE
 *
 * Precedence: torchrun > mpirun > srun. The innermost launcher wins: Slurm's
 * variables are inherited by everything started inside an allocation (the batch
 * script sets SLURM_PROCID=0 and SLURM_NTASKS; Open MPI's mpirun starts its
 * daemons with srun), so a process that also sees RANK or OMPI_COMM_WORLD_RANK
 * was started by torchrun or mpirun, whose numbering is the true one.
 * No variables at all: a single process (world size 1).
 *
 * Rendezvous. MASTER_ADDR:MASTER_PORT when set (every launcher). A job on one
 * host (local world size == world size) without them uses 127.0.0.1 and port
 * CF_DIST_DEFAULT_PORT (29500, torchrun's default); MASTER_ADDR alone takes
 * port 29500. A job on several hosts needs MASTER_ADDR: the address of the
 * host of rank 0, reachable from every host (not a name that resolves to
 * 127.0.1.1); every host must see the same MASTER_ADDR and MASTER_PORT.
 *
 * NCCL bootstrap (see comm.c for how it is used): NCCL_COMM_ID =
 * "MASTER_ADDR:(MASTER_PORT+1)" — MASTER_PORT itself is taken by torchrun's
 * store. An NCCL_COMM_ID already in the environment is used as it is (and then
 * MASTER_ADDR is not required on several hosts).
 */
#ifndef CF_DIST_LAUNCH_H
#define CF_DIST_LAUNCH_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CF_DIST_DEFAULT_ADDR "127.0.0.1"
#define CF_DIST_DEFAULT_PORT 29500
#define CF_DIST_MAX_WORLD 65536      /* more ranks than this is a broken environment */

typedef enum {
    CF_LAUNCH_NONE = 0,   /* no launcher variables: a single process */
    CF_LAUNCH_TORCHRUN,
    CF_LAUNCH_SLURM,
    CF_LAUNCH_MPI,
} cf_launcher;

typedef struct {
    cf_launcher launcher;
    int rank, world_size;
    int local_rank;
    int local_world_size;     /* processes on this host; 0 = unknown */
    int single_host;          /* local_world_size == world_size */
    char master_addr[256];    /* as given, or CF_DIST_DEFAULT_ADDR */
    int master_port;
    int addr_defaulted;       /* 1: MASTER_ADDR was not set (single host) */
    char nccl_comm_id[300];   /* "host:port" for NCCL_COMM_ID ("[v6]:port" for IPv6) */
    int nccl_comm_id_from_env;/* 1: NCCL_COMM_ID was already set; used as is */
    char cuda_visible[256];   /* CUDA_VISIBLE_DEVICES, "" when unset (for messages) */
    int cuda_visible_set;
} cf_dist_env;

/* "none", "torchrun", "slurm", "mpirun". */
const char *cf_launcher_name(cf_launcher l);

/* Reads the launch environment through getenv_fn (NULL = getenv; tests inject
 * their own). On a bad environment: -1 and one cf_last_error() line naming the
 * variable (e.g. "WORLD_SIZE is set but RANK is not ..."). */
int cf_dist_env_parse(cf_dist_env *out, const char *(*getenv_fn)(const char *name));

/* Only which launcher started this process, its rank and the world size (the
 * precedence above; no launcher: CF_LAUNCH_NONE, rank 0 of 1), for commands
 * that run in one process: neither the local placement nor the rendezvous
 * variables are read, so only a contradictory or malformed rank/size pair
 * fails (-1, the same line as cf_dist_env_parse gives). */
int cf_dist_env_world(const char *(*getenv_fn)(const char *name), cf_launcher *launcher, int *rank, int *world_size);

/* --tp against the launch: a world of one holds no tensor-parallel group
 * ("--tp 2 needs 2 processes, one per GPU: start them with ..."), and tp
 * must divide the world ("--tp 2 does not divide the 3 ranks torchrun
 * started ..."). 0, or -1 with that line. */
int cf_dist_check_tp(int tp, int world_size, cf_launcher launcher);

/* The CUDA device of this rank: its local rank. Fails with a line such as
 * "rank 3 needs GPU 3 but only 2 are visible (CUDA_VISIBLE_DEVICES=0,1)". */
int cf_dist_pick_device(const cf_dist_env *env, int visible_gpus, int *device);

/* One line describing the environment, for logs:
 * "torchrun: rank 1 of 2 (local 1 of 2), rendezvous 127.0.0.1:29500, NCCL_COMM_ID 127.0.0.1:29501". */
const char *cf_dist_env_describe(const cf_dist_env *env, char *buf, int cap);

#ifdef __cplusplus
}
#endif

#endif /* CF_DIST_LAUNCH_H */
