"""A gloo job whose ranks fall out of step; each rank writes its flight-recorder trace on the way out."""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace

out_dir, mode = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
rank = dist.get_rank()
tensor = torch.ones(8)
for step in range(4):
    dist.all_reduce(tensor)
dist.broadcast(tensor, 0)
try:
    if mode == "skip" and rank == 1:
        time.sleep(4)  # rank 1 skips the next all-reduce
    elif mode == "mismatch" and rank == 1:
        dist.all_gather_into_tensor(torch.empty(8 * dist.get_world_size()), tensor)
    elif mode != "agree":
        dist.all_reduce(tensor)
except RuntimeError:
    pass
with open(os.path.join(out_dir, f"rank_{rank}"), "wb") as f:
    f.write(_dump_fr_trace())
os._exit(0)
