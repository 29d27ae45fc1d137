"""Running mleng across the nodes of a SLURM allocation: sbatch scripts, submit and follow, per-node merging.

- script.py writes the sbatch script: one srun task per node; for check and comm that task runs
  torchrun with a c10d rendezvous on the first node (one torch world across the allocation), for
  every other command it runs the command once per node and keeps that node's JSON.
- job.py submits with sbatch, follows with squeue (every ~0.5 s; `sbatch --wait` adds ~10 s) and
  reads the job's end state.
- merge.py turns a job's results folder (or any stored record) into one Measurement with a row per
  node, names the straggler and prints the `scontrol update ... state=drain` line for it.
- allocation.py lets `mleng check` / `mleng comm` started inside salloc/sbatch re-run themselves
  with srun on every node of the allocation.

Node lists ("n[1-3,5],gpu-a[01-02]") are expanded by mleng.distributed.launch.slurm_hostnames
(`scontrol show hostnames` when present, else its pure-Python parser expand_nodelist).
"""
