#!/bin/bash
# How the GPU-host numbers in docs/results/comm_* were produced: one call on a 1x H200 machine (16 cores).
# Only one GPU was lent, so NCCL runs at world size 1 (code path, CUDA graphs, --check) and the
# multi-rank runs there use gloo on its 16 CPU cores.
set -u
export PYTHONPATH=src MLENG_HOME=${OUT:-/tmp}/mleng-home NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
o=${OUT:-/tmp}
run() { echo; echo "\$ mleng $*"; timeout 300 python3 -m mleng "$@"; echo "rc=$?"; }
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0))'
nproc; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
{
run comm --op all --check -b 1M -e 1G -f 4
run comm --op all_reduce,all_gather --blocking -b 1M -e 256M -f 4
run comm --op all_reduce --no-cuda-graph -b 1M -e 1G -f 4 --plot $o/comm_h200_1gpu.png
run check --alloc-gib 16
run comm --backend gloo --nproc 4 --op all --check -b 1M -e 16M -f 4
run check --backend gloo --nproc 4 --pairs --pair-bytes 16M
} 2>&1 | tee $o/comm_device_run.txt
python3 bench/comm_overhead.py --rounds 11 --out $o/comm_overhead_h200host.json 2>&1 | tee $o/comm_overhead_h200host.txt
