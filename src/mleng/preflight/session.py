"""The group mleng.preflight() runs in (the job's own, or a fail-fast one of its own that is destroyed
afterwards) and the helpers every check shares."""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any

from mleng.errors import MlengError, UsageError


SLOT_ELEMENTS = 16

# ---------------------------------------------------------------------------------------------
# The group: the job's own, or one of our own that is destroyed afterwards
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Session:
    call: int
    timeout: float
    rank: int = 0
    world_size: int = 0
    backend: str | None = None
    device: str = "cpu"
    mode: str = "single process"      # "job's group", "own group", "single process"
    launch: Any = None
    store: Any = None
    ranks: list[dict] = dataclasses.field(default_factory=list)
    launch_problem: str | None = None
    _job: Any = None
    _cuda_device: int | None = None
    _rng_state: Any = None
    _subgroups: list = dataclasses.field(default_factory=list)

    def open(self, backend: str | None, params: dict) -> None:
        import torch
        import torch.distributed as dist

        from mleng.distributed.group import rendezvous
        from mleng.distributed.launch import Launch, detect
        from mleng.distributed.rankinfo import describe_rank

        self._rng_state = torch.random.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self._cuda_device = torch.cuda.current_device()
        if dist.is_available() and dist.is_initialized():
            self.mode = "job's group"
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self.backend = str(dist.get_backend())
            if self.backend == "undefined" or ":" in self.backend:
                # A group made without naming a backend holds one per device type (cpu:gloo, cuda:nccl).
                self.backend = "nccl" if torch.cuda.is_available() else "gloo"
            if "nccl" in self.backend and torch.cuda.is_available():
                self.device = f"cuda:{torch.cuda.current_device()}"
            try:
                launch = detect()
            except UsageError as exc:
                launch, self.launch_problem = None, f"the launcher's variables are inconsistent: {exc.message}"
            if launch is not None and (launch.rank, launch.world_size) != (self.rank, self.world_size):
                self.launch_problem = (f"the launcher says rank {launch.rank} of {launch.world_size} ({launch.mode}), "
                                       f"the process group says rank {self.rank} of {self.world_size}")
                launch = None
            self.launch = launch or Launch(
                mode="existing group", rank=self.rank, world_size=self.world_size,
                local_rank=_int(os.environ.get("LOCAL_RANK"), 0), local_world_size=_int(os.environ.get("LOCAL_WORLD_SIZE"), None),
                master_addr=os.environ.get("MASTER_ADDR", "?"), master_port=_int(os.environ.get("MASTER_PORT"), 0))
            self.store = dist.PrefixStore(f"mleng-preflight/{self.launch.run_id}/{self.call}/", _default_store())
            info = describe_rank(self.launch, self.device)
            info["launch_problem"] = self.launch_problem
            self.ranks = rendezvous(self.store, self.launch, self.timeout, info=info, params=params)
            return
        launch = detect()  # inconsistent launcher variables: UsageError, here, before anything starts
        if launch is None:
            self.rank, self.world_size = 0, 1
            self.device = "cuda:0" if torch.cuda.is_available() and torch.cuda.device_count() else "cpu"
            self.launch = Launch(mode="plain", rank=0, world_size=1, local_rank=0, local_world_size=1,
                                 master_addr="127.0.0.1", master_port=0)
            self.ranks = [describe_rank(self.launch, self.device)]
            return
        from mleng.distributed.group import choose_backend, join, pick_device

        self.mode = "own group"
        self.rank, self.world_size, self.launch = launch.rank, launch.world_size, launch
        self.backend, kind = choose_backend(backend)
        if kind == "cuda" and self._cuda_device is None and torch.cuda.is_initialized():
            self._cuda_device = torch.cuda.current_device()
        self.device = pick_device(launch, kind)
        # keys of this call apart from the job's own and from an earlier preflight
        ours = dataclasses.replace(launch, run_id=f"{launch.run_id}/preflight-{self.call}")
        self._job = join(ours, self.backend, self.device, self.timeout,
                         info=describe_rank(launch, self.device), params=params)
        self.store, self.ranks = self._job.store, self._job.ranks

    def new_subgroups(self, members: list[list[int]]) -> list:
        import torch.distributed as dist

        groups = [dist.new_group(ranks=m, timeout=datetime.timedelta(seconds=self.timeout)) for m in members]
        self._subgroups.extend(groups)
        return groups

    def close(self) -> None:
        """Destroy what preflight made, and only that; put the CUDA device and torch's RNG back."""
        import torch
        import torch.distributed as dist

        for group in self._subgroups:
            try:
                dist.destroy_process_group(group)
            except Exception:  # noqa: BLE001 - teardown must not hide the outcome
                pass
        self._subgroups.clear()
        if self._job is not None:
            from mleng.distributed.group import leave

            leave(self._job, self.rank)
        self._job, self.store = None, None  # rank 0's TCPStore server goes with the last reference
        if self._cuda_device is not None:
            torch.cuda.set_device(self._cuda_device)
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
        if self._rng_state is not None:
            torch.random.set_rng_state(self._rng_state)

def _int(text: str | None, default: int | None) -> int | None:
    try:
        return int(text) if text not in (None, "") else default
    except ValueError:
        return default

def _default_store():
    from torch.distributed import distributed_c10d

    try:
        return distributed_c10d._get_default_store()
    except Exception as exc:  # noqa: BLE001 - a group without a store (rare: MPI, fake)
        from mleng.errors import NotAvailableError

        raise NotAvailableError(f"the job's process group has no rendezvous store ({exc})",
                                hint="call mleng.preflight() before init_process_group instead") from None

def _collective_message(exc: BaseException, what: str, session: _Session) -> str:
    from mleng.distributed.group import collective_error

    if isinstance(exc, MlengError):
        return exc.message
    return collective_error(exc, what, session.rank, session.timeout).message

def _wait(work, timeout: float) -> None:
    if work is not None:
        work.wait(timeout=datetime.timedelta(seconds=timeout))

def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
