#!/bin/bash
# run.sh BIN — runs comm_check on this host's GPUs in every mode (see comm_check.c).
# Keeps NVLink multicast off (NCCL_NVLS_ENABLE=0).
BIN=${1:-./comm_check}
export NCCL_NVLS_ENABLE=0
N=$(nvidia-smi -L | wc -l)
fails=0
spawn() {   # mode port n: start n ranks by hand, wait for all
    local mode=$1 port=$2 n=$3 pids=() r
    for ((r = 0; r < n; r++)); do
        RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r LOCAL_WORLD_SIZE=$n MASTER_PORT=$port $BIN $mode 20 &
        pids+=($!)
    done
    local rc=0
    for p in "${pids[@]}"; do wait $p || rc=1; done
    return $rc
}
step() { local name=$1; shift; local t0=$(date +%s%N); "$@"; local rc=$?; local ms=$(( ($(date +%s%N) - t0) / 1000000 ));
         echo "== $name: $([ $rc = 0 ] && echo PASS || echo FAIL) ($ms ms)";
         [ $rc = 0 ] || fails=$((fails + 1)); }
dead_or_hang() {   # rank 1's exit status is not the point: rank 0's is
    local mode=$1 port=$2
    RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2 MASTER_PORT=$port $BIN $mode 10 & local p1=$!
    RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 MASTER_PORT=$port $BIN $mode 10; local rc=$?
    kill $p1 2>/dev/null; wait $p1 2>/dev/null
    return $rc
}
step "ok, $N ranks started by hand (RANK/WORLD_SIZE, default rendezvous)" spawn ok 29610 $N
if command -v torchrun >/dev/null; then
    step "ok, torchrun --nproc_per_node $N --no-python" torchrun --nproc_per_node $N --master-port 29620 --no-python $BIN ok
fi
step "ok, Open MPI style variables" bash -c 'for r in 0 1; do OMPI_COMM_WORLD_RANK=$r OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_LOCAL_RANK=$r OMPI_COMM_WORLD_LOCAL_SIZE=2 MASTER_PORT=29630 '"$BIN"' ok 20 & done; wait -n && wait -n'
step "dead peer: rank 0 fails within its 10 s timeout" dead_or_hang dead 29640
step "hung peer: rank 0 fails within its 10 s timeout" dead_or_hang hang 29650
step "rank 0 never starts: rank 1's init fails within 15 s" env RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2 MASTER_PORT=29660 $BIN init 15
step "rendezvous port taken: rank 0 says so" env RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 MASTER_PORT=29670 $BIN port 15
too_many() { local out; out=$(env RANK=$N WORLD_SIZE=$((N + 1)) LOCAL_RANK=$N LOCAL_WORLD_SIZE=$((N + 1)) $BIN ok 5 2>&1) && return 1;
             echo "$out"; echo "$out" | grep -q "needs GPU $N but only $N"; }
step "more ranks than GPUs: fails with one clear line" too_many
echo "== failures: $fails"
