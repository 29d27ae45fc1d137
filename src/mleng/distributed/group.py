"""Joining a job fail-fast: our own rendezvous that names missing ranks, the process group, results to rank 0."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import re
import socket
import sys
import threading
import time
from typing import Any

from mleng.distributed.launch import Launch
from mleng.errors import CheckFailed, NotAvailableError, UsageError

POLL_S = 0.05


@dataclasses.dataclass
class Job:
    """This rank's handle on a joined job."""

    launch: Launch
    backend: str
    device: str                 # "cpu" or "cuda:N"
    timeout_s: float
    store: Any                  # a PrefixStore holding this run's keys
    ranks: list[dict]           # what every rank said about itself when it joined, by rank

    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def world_size(self) -> int:
        return self.launch.world_size

    @property
    def hosts(self) -> list[str]:
        """Distinct hosts in rank order of their first rank."""
        return list(dict.fromkeys(r["host"] for r in self.ranks))

    def public_ranks(self) -> list[dict]:
        """What every rank said about itself, without the arguments it was started with (kept for the record)."""
        return [{k: v for k, v in r.items() if k not in ("params", "params_digest")} for r in self.ranks]


def choose_backend(requested: str | None) -> tuple[str, str]:
    """(backend, device kind): NCCL on CUDA GPUs, gloo on CPU, unless --backend says otherwise."""
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        raise NotAvailableError("this torch build has no torch.distributed",
                                hint="install a torch wheel from pytorch.org (they all include it)")
    has_cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    backend = requested or ("nccl" if has_cuda else "gloo")
    if backend == "nccl":
        if not has_cuda:
            raise NotAvailableError("--backend nccl needs a CUDA GPU and none is visible",
                                    hint="run on a GPU node, or use --backend gloo to test on CPU")
        if not dist.is_nccl_available():
            raise NotAvailableError("this torch build has no NCCL backend",
                                    hint="install a CUDA build of torch, or use --backend gloo")
        return backend, "cuda"
    if backend == "gloo":
        if not dist.is_gloo_available():
            raise NotAvailableError("this torch build has no gloo backend", hint="use --backend nccl")
        return backend, "cpu"
    raise UsageError(f"unknown backend {backend!r}", hint="use nccl (GPUs) or gloo (CPU)")


def params_digest(params: dict) -> str:
    return hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:16]


def pick_device(launch: Launch, device_kind: str) -> str:
    """cpu, or the GPU of this local rank (set as the current device, as NCCL expects)."""
    if device_kind != "cuda":
        return "cpu"
    import torch

    device = f"cuda:{launch.local_rank % torch.cuda.device_count()}"
    torch.cuda.set_device(device)
    return device


def join(launch: Launch, backend: str, device: str, timeout_s: float,
         info: dict | None = None, params: dict | None = None) -> Job:
    """Rendezvous every rank within timeout_s, then start the process group with the same timeout.

    torch's own env:// rendezvous only knows how many ranks arrived ("1/2 clients joined"); ours
    has every rank post a key, so rank 0 can name the ranks that never came and the ranks started
    with different arguments, and tell everybody before anyone blocks in a collective.
    """
    import torch.distributed as dist

    base = connect_store(launch, timeout_s)
    store = dist.PrefixStore(f"mleng/{launch.run_id}/", base)
    ranks = rendezvous(store, launch, timeout_s, info, params)
    try:
        dist.init_process_group(backend, store=dist.PrefixStore("pg/", store), rank=launch.rank,
                                world_size=launch.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as exc:
        raise collective_error(exc, "process group initialization", launch.rank, timeout_s) from None
    return Job(launch, backend, device, timeout_s, store, ranks)


def rendezvous(store, launch: Launch, timeout_s: float, info: dict | None = None,
               params: dict | None = None) -> list[dict]:
    """Every rank posts its arrival on `store`; rank 0 names the ranks that did not come within timeout_s
    (or came with other params) and tells everybody. Returns what every rank said about itself, by rank.
    join() runs it on a store of its own; mleng.preflight also on the store of a job's existing group."""
    mine = dict(info or {}, rank=launch.rank, host=(info or {}).get("host") or socket.gethostname(),
                params_digest=params_digest(params or {}), params=params or {})
    _set(store, f"join/{launch.rank}", mine, launch, "posting this rank's arrival")
    _count(store, "join/count", launch, "posting this rank's arrival")
    if launch.rank == 0:
        return _rank0_collect_joins(store, launch, timeout_s, mine)
    return _wait_for_verdict(store, launch, timeout_s)


def connect_store(launch: Launch, timeout_s: float):
    import torch.distributed as dist

    where = f"{launch.master_addr}:{launch.master_port}"
    timeout = datetime.timedelta(seconds=timeout_s)
    if launch.rank == 0 and not launch.agent_store:
        try:
            return dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size, True,
                                 timeout=timeout, wait_for_workers=False)
        except Exception as exc:
            text = first_line(exc)
            if "in use" in text.lower():
                raise UsageError(f"rank 0 cannot listen on {where}: the port is already in use",
                                 hint="pick another MASTER_PORT (or let mleng spawn the ranks itself)") from None
            raise CheckFailed(f"rank 0 cannot start the rendezvous store on {where}: {text}") from None
    # A client retries the connection for about 1.7 times its timeout; scale it so the whole
    # attempt ends near timeout_s, then give later store operations the full timeout.
    attempt = datetime.timedelta(seconds=max(1.0, timeout_s * 0.55))
    try:
        with native_stderr_silenced():  # c10d logs each retry with a C++ stack; our one message says it all
            client = dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size, False,
                                   timeout=attempt)
    except Exception as exc:
        raise CheckFailed(
            f"rank {launch.rank} could not reach rank 0's store at {where} within {timeout_s:g} s "
            f"({first_line(exc)})",
            hint="rank 0 has not started, has died, or MASTER_ADDR/MASTER_PORT differ between ranks; "
                 "start rank 0, check the address, or raise --timeout") from None
    client.set_timeout(timeout)
    return client


@contextlib.contextmanager
def native_stderr_silenced():
    """Point file descriptor 2 at /dev/null for a while: C++ logging writes there, not to sys.stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _set(store, key: str, value: Any, launch: Launch, doing: str) -> None:
    try:
        store.set(key, json.dumps(value, default=str))
    except Exception as exc:
        raise _lost_store(exc, launch, doing) from None


def _count(store, key: str, launch: Launch, doing: str) -> None:
    try:
        store.add(key, 1)
    except Exception as exc:
        raise _lost_store(exc, launch, doing) from None


def _wait_for_count(store, key: str, n: int, timeout_s: float) -> bool:
    """Poll one counter (one request per poll, however many ranks) until it reaches n or time is up."""
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < n:
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


def _lost_store(exc: Exception, launch: Launch, doing: str) -> CheckFailed:
    return CheckFailed(f"rank {launch.rank} lost the rendezvous store at {launch.master_addr}:"
                       f"{launch.master_port} while {doing}: {first_line(exc)}",
                       hint="rank 0 (which serves the store) died or was stopped; see its output")


def _rank0_collect_joins(store, launch: Launch, timeout_s: float, mine: dict) -> list[dict]:
    n = launch.world_size
    _wait_for_count(store, "join/count", n, timeout_s)
    arrived: dict[int, dict] = {0: mine}
    for rank in range(1, n):
        if store.check([f"join/{rank}"]):
            arrived[rank] = json.loads(store.get(f"join/{rank}"))
    missing = [r for r in range(n) if r not in arrived]
    if missing:
        joined = ", ".join(f"rank {r} on {arrived[r]['host']}" for r in sorted(arrived)[:16])
        if len(arrived) > 16:
            joined += ", ..."
        where = ""
        if launch.expected_hosts:
            hosts = list(dict.fromkeys(launch.expected_hosts[r] for r in missing))
            where = f" (expected on {', '.join(hosts[:16])}{', ...' if len(hosts) > 16 else ''})"
        message = (f"{_rank_list(missing)}{where} did not join within {timeout_s:g} s "
                   f"({len(arrived)}/{n} ranks joined: {joined})")
        _abort(store, message)
        raise CheckFailed(message, hint="start the missing ranks (same MASTER_ADDR/MASTER_PORT/WORLD_SIZE), "
                                        "check that their hosts can reach rank 0, or raise --timeout")
    different = [r for r in range(1, n) if arrived[r]["params_digest"] != mine["params_digest"]]
    if different:
        first = different[0]
        diff = {k: (mine["params"].get(k), arrived[first]["params"].get(k))
                for k in sorted(set(mine["params"]) | set(arrived[first]["params"]))
                if mine["params"].get(k) != arrived[first]["params"].get(k)}
        shown = "; ".join(f"{k}: rank 0 {a!r}, rank {first} {b!r}" for k, (a, b) in diff.items())
        message = (f"{_rank_list(different)} started with different arguments than rank 0, so they would "
                   f"run different collectives ({shown})")
        _abort(store, message)
        raise UsageError(message, hint="start every rank with the same command line")
    ranks = [arrived[r] for r in range(n)]
    store.set("verdict", json.dumps({"ok": True, "ranks": ranks}, default=str))
    return ranks


def _abort(store, message: str) -> None:
    try:
        store.set("verdict", json.dumps({"ok": False, "message": message}))
    except Exception:
        pass


def _wait_for_verdict(store, launch: Launch, timeout_s: float) -> list[dict]:
    # Rank 0 may itself start up to timeout_s late and then wait timeout_s for the others.
    limit = 2 * timeout_s + 5
    try:
        with native_stderr_silenced():  # c10d logs a timed-out wait with a C++ warning; we say it better
            store.wait(["verdict"], datetime.timedelta(seconds=limit))
        verdict = json.loads(store.get("verdict"))
    except Exception as exc:
        if "timeout" not in first_line(exc).lower():
            raise _lost_store(exc, launch, "waiting for every rank to join") from None
        raise CheckFailed(f"rank {launch.rank}: rank 0 did not confirm that every rank joined within "
                          f"{limit:g} s", hint="look at rank 0's output; raise --timeout if ranks start slowly") from None
    if not verdict["ok"]:
        raise CheckFailed(f"rank 0 stopped the job: {verdict['message']}")
    return verdict["ranks"]


def _rank_list(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    shown = ", ".join(str(r) for r in ranks[:16])
    more = f" and {len(ranks) - 16} more" if len(ranks) > 16 else ""
    return f"ranks {shown}{more}"


def gather_to_rank0(job: Job, name: str, value: Any, timeout_s: float | None = None) -> list | None:
    """Every rank hands value to rank 0 through the store; rank 0 gets them in rank order, others None.

    Through the store rather than a collective, so a rank that died or hangs is named
    ("rank 1 did not report ...") instead of turning into an anonymous collective timeout.
    """
    timeout_s = job.timeout_s if timeout_s is None else timeout_s
    _set(job.store, f"{name}/{job.rank}", value, job.launch, f"reporting {name}")
    _count(job.store, f"{name}/count", job.launch, f"reporting {name}")
    if job.rank != 0:
        return None
    n = job.world_size
    _wait_for_count(job.store, f"{name}/count", n, timeout_s)
    got: dict[int, Any] = {0: value}
    for rank in range(1, n):
        if job.store.check([f"{name}/{rank}"]):
            got[rank] = json.loads(job.store.get(f"{name}/{rank}"))
    missing = [r for r in range(n) if r not in got]
    if missing:
        hosts = sorted({job.ranks[r]["host"] for r in missing})
        raise CheckFailed(f"{_rank_list(missing)} (on {', '.join(hosts)}) did not report {name} within "
                          f"{timeout_s:g} s: died, hung, or still busy",
                          hint="look at those ranks' output; raise --timeout if they are just slow")
    return [got[r] for r in range(n)]


def leave(job: Job | None = None, rank: int = 0) -> None:
    """Tear the process group down; errors here would only hide the real outcome.

    With a peer gone, NCCL's teardown can block for good, hence the watchdog: callers store
    their results before calling this.
    """
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            with Watchdog("tearing down the process group", 30.0, job.rank if job else rank):
                dist.destroy_process_group()
    except Exception:
        pass


_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")


def first_line(exc: BaseException) -> str:
    """The useful line of a torch/gloo error: no C++ source location, no stack, no jokes."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = _SOURCE_PREFIX.sub("", text)
    text = text.split(" GLHF")[0].split(" Check the logs of the remote worker")[0]
    return text.strip()


def collective_error(exc: BaseException, what: str, rank: int, timeout_s: float) -> CheckFailed:
    """Turn a failed collective into one message saying which of the usual three things happened."""
    text = first_line(exc)
    lower = text.lower()
    if "timed out" in lower or "timeout" in lower:
        return CheckFailed(
            f"{what} did not complete within {timeout_s:g} s on rank {rank}: another rank is missing, "
            f"stuck, or running a different collective ({text})",
            hint="every rank must run the same command; look at the other ranks' output")
    if "closed by peer" in lower or "connection reset" in lower or "broken pipe" in lower \
            or "connection refused" in lower:
        return CheckFailed(f"{what} failed on rank {rank}: a peer closed its connection, so that rank died "
                           f"or was killed ({text})", hint="look at the other ranks' output for why it ended")
    return CheckFailed(f"{what} failed on rank {rank}: {text}")


class Watchdog:
    """Last line of defence: if a phase outlives its deadline (a C++ call that ignores its timeout),
    say which phase and end this process, rather than hang a job for torch's default ten minutes."""

    def __init__(self, what: str, seconds: float, rank: int):
        self.what, self.seconds, self.rank = what, seconds, rank
        self._timer: threading.Timer | None = None

    def _fire(self) -> None:
        sys.stdout.flush()
        sys.stderr.write(f"mleng: error: rank {self.rank}: {self.what} did not finish within "
                         f"{self.seconds:g} s; giving up\n")
        sys.stderr.flush()
        os._exit(1)

    def __enter__(self) -> "Watchdog":
        self._timer = threading.Timer(self.seconds, self._fire)
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
