"""Running one mleng command across ranks: launch detection, local spawning, fail-fast joining, results to rank 0.

The same command runs three ways, told apart by the environment (mleng.distributed.launch.detect):

- plainly: no RANK/WORLD_SIZE and no srun step -> detect() is None and the command spawns `--nproc`
  local ranks of itself (mleng.distributed.spawn), each with RANK, WORLD_SIZE, LOCAL_RANK,
  MASTER_ADDR=127.0.0.1 and a free MASTER_PORT, and MLENG_SPAWNED=1;
- under torchrun (or any launcher that sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT):
  those variables are used as they are; torchrun's agent store is reused when it offers one;
- under srun: SLURM_PROCID, SLURM_STEP_NUM_TASKS/SLURM_NTASKS, SLURM_LOCALID give the ranks;
  MASTER_ADDR is the first host of SLURM_STEP_NODELIST/SLURM_JOB_NODELIST (`scontrol show hostnames`,
  else our parser of the compact form) unless MASTER_ADDR is exported; MASTER_PORT, unless exported,
  is 20000 + SLURM_JOB_ID % 10000, the same on every task without any exchange. Only a task of an
  srun step (SLURM_STEP_ID set) counts: the batch script itself also carries SLURM_PROCID=0. An srun
  step of one task counts as a plain run (it spawns local ranks). With block distribution
  (SLURM_STEP_TASKS_PER_NODE, e.g. "4(x2)"), rank 0 knows the host each rank should run on and names
  it when a rank never joins. `srun torchrun ...` is a torchrun launch (RANK/WORLD_SIZE win).

Then mleng.distributed.group.join rendezvouses every rank within --timeout (naming the ranks that
did not come), starts the process group with the same timeout, and gather_to_rank0 brings results
to rank 0, which alone prints and stores.
"""
