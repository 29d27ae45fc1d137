"""A gloo job that hangs: every rank but one enters an all-reduce; rank 1 never does."""

import datetime
import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("JOB_TIMEOUT_S", "120"))))
rank = dist.get_rank()
tensor = torch.ones(16)
for step in range(3):
    dist.all_reduce(tensor)
print(f"rank {rank} ready", flush=True)
if rank == 1:
    time.sleep(600)  # SKIPS_THE_ALL_REDUCE
else:
    dist.all_reduce(tensor)  # WAITS_FOR_RANK_1
