"""CPU reproductions of handbook entries: each runs the failure for real and checks the entry still says it.

When a torch upgrade changes a message, the failing assertion names the entry that went stale.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from mleng.handbook import default_entries_dir  # noqa: E402
from mleng.handbook.model import parse_entry  # noqa: E402

ENTRIES = Path(__file__).resolve().parents[1] / "src" / "mleng" / "handbook" / "entries"


def entry(entry_id: str):
    directory = ENTRIES if ENTRIES.is_dir() else default_entries_dir()
    return parse_entry(directory / f"{entry_id}.md")


def assert_reproduces(entry_id: str, output: str, expected: str) -> None:
    """The expected text appears in the output, is one of the entry's symptoms, and a signature matches."""
    e = entry(entry_id)
    tail = output[-3000:]
    where = f"handbook entry '{entry_id}' went stale with torch {torch.__version__}"
    assert any(expected in s for s in e.symptoms), \
        f"{where}: its symptoms no longer contain {expected!r}; update the entry or this test"
    assert expected in output, f"{where}: the reproduction no longer prints {expected!r}. Output:\n{tail}"
    matching = [s for s in e.signatures if any(re.search(s, line) for line in output.splitlines())]
    assert matching, f"{where}: none of its signatures {e.signatures} matches the reproduction's output:\n{tail}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_python(code: str, *args: str, env: dict | None = None, timeout: float = 40) -> str:
    """Run code in a fresh interpreter; return stdout+stderr (the failure is the point, so no rc check)."""
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                             "TORCH_DISTRIBUTED_DEBUG")}
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env)
    return proc.stdout + proc.stderr


_COLLECTIVE_MISMATCH = """
    import datetime, sys, torch, torch.distributed as dist
    rank, port = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=3))
    t = torch.ones(4)
    if rank == 0:
        dist.all_reduce(t)
    else:
        dist.all_gather([torch.zeros(4), torch.zeros(4)], t)
"""


def _two_ranks(code: str, env: dict) -> str:
    port = str(free_port())
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    base.update(env)
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(rank), port],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=base)
             for rank in (0, 1)]
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=40)[0])
        except subprocess.TimeoutExpired:
            proc.kill()
            outputs.append(proc.communicate()[0])
    return "\n".join(outputs)


def test_collective_mismatch():
    # Plain gloo: the ranks just wait until the timeout.
    plain = _two_ranks(_COLLECTIVE_MISMATCH, {})
    assert_reproduces("collective-mismatch", plain, "operation to complete")
    # With the debug wrapper the mismatch itself is reported.
    detail = _two_ranks(_COLLECTIVE_MISMATCH, {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert_reproduces("collective-mismatch", detail, "Detected mismatch between collectives on ranks")
    assert "OpType=ALLREDUCE" in detail and "OpType=ALLGATHER" in detail, detail[-2000:]


def test_rank_never_joins():
    out = run_python("""
        import datetime, sys, torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=2,
                                timeout=datetime.timedelta(seconds=2))
    """, str(free_port()))
    assert_reproduces("rank-never-joins", out, "waiting for clients")
    assert re.search(r"1/2 clients joined", out), out[-2000:]


def test_master_unreachable_client_timeout():
    port = free_port()  # nothing listens there: the client retries until its timeout
    out = run_python("""
        import datetime, sys, torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=1, world_size=2,
                                timeout=datetime.timedelta(seconds=1))
    """, str(port))
    assert_reproduces("master-unreachable-client-timeout", out, "The client socket has timed out after")
    assert f"(127.0.0.1, {port})" in out, out[-2000:]


def test_address_already_in_use():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        out = run_python("""
            import datetime, sys, torch.distributed as dist
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=2))
        """, str(port))
    assert_reproduces("address-already-in-use", out, "The server socket has failed to listen on any local network")
    assert "address already in use" in out.lower(), out[-2000:]


def test_process_group_initialized_twice():
    out = run_python("""
        import sys, torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=0, world_size=1)
    """, str(free_port()), str(free_port()))
    assert_reproduces("process-group-initialized-twice", out, "trying to initialize the default process group twice!")


def test_rendezvous_env_var_missing():
    out = run_python("""
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="env://")
    """, env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    assert_reproduces("rendezvous-env-var-missing", out, "environment variable RANK expected, but not set")


def test_nccl_not_built_cpu_torch():
    import torch.distributed as dist

    if dist.is_nccl_available():
        pytest.skip("this torch build has NCCL; the entry is about builds without it")
    out = run_python("""
        import torch.distributed as dist
        dist.init_process_group("nccl")
    """, env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1"})
    assert_reproduces("nccl-not-built-cpu-torch", out, "Distributed package doesn't have NCCL built in")


def test_torch_not_compiled_with_cuda():
    if torch.version.cuda is not None:
        pytest.skip("this torch build has CUDA; the entry is about CPU-only builds")
    with pytest.raises(AssertionError) as caught:
        torch.zeros(2, device="cuda")
    assert_reproduces("torch-not-compiled-with-cuda", str(caught.value), "Torch not compiled with CUDA enabled")


def test_fp16_overflow_inf():
    finite, overflow = torch.tensor([60000.0, 70000.0]).half()
    assert torch.finfo(torch.float16).max == 65504.0
    assert torch.isfinite(finite) and torch.isinf(overflow), "fp16-overflow-inf went stale: 70000 no longer overflows"
    printed = repr(torch.tensor([60000.0, 70000.0]).half())
    assert_reproduces("fp16-overflow-inf", printed, "tensor([60000.,    inf], dtype=torch.float16)")
    # The same magnitude through a product: 300 * 300 = 90000 > 65504.
    assert torch.isinf(torch.tensor([300.0]).half() ** 2).all()


def test_nan_detected_in_backward():
    x = torch.tensor([-1.0, 4.0], requires_grad=True)
    import warnings

    with warnings.catch_warnings(record=True) as caught_warnings:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError) as caught:
            with torch.autograd.detect_anomaly():
                torch.sqrt(x).sum().backward()
    text = str(caught.value) + "\n" + "\n".join(str(w.message) for w in caught_warnings)
    assert_reproduces("nan-detected-in-backward", text,
                      "Function 'SqrtBackward0' returned nan values in its 0th output.")
    assert "Error detected in SqrtBackward0" in text, text


def test_bf16_small_update_lost():
    one = torch.tensor(1.0, dtype=torch.bfloat16)
    updated = one + 1e-3
    assert updated.item() == 1.0, "bf16-small-update-lost went stale: 1 + 1e-3 is representable in bf16 now"
    assert torch.finfo(torch.bfloat16).eps == 2 ** -7
    assert_reproduces("bf16-small-update-lost", repr(updated), "tensor(1., dtype=torch.bfloat16)")
    # A real optimizer step on a bf16 parameter leaves it unchanged; the fp32 one moves.
    for dtype, should_move in ((torch.bfloat16, False), (torch.float32, True)):
        p = torch.nn.Parameter(torch.ones(64, dtype=dtype))
        opt = torch.optim.SGD([p], lr=1e-3)
        p.grad = torch.ones_like(p)
        opt.step()
        moved = bool((p.detach() != 1).any())
        assert moved == should_move, f"bf16-small-update-lost went stale: {dtype} parameter moved={moved}"


def test_dataloader_worker_killed():
    out = run_python("""
        import os, signal, torch.utils.data as td
        class Dies(td.Dataset):
            def __len__(self): return 8
            def __getitem__(self, i):
                os.kill(os.getpid(), signal.SIGKILL)
        for batch in td.DataLoader(Dies(), num_workers=1, batch_size=2):
            pass
    """)
    assert_reproduces("dataloader-worker-killed", out, "is killed by signal: Killed.")
    assert re.search(r"DataLoader worker \(pid\(s\) \d+\) exited unexpectedly", out), out[-2000:]


def test_truncated_checkpoint(tmp_path):
    good = tmp_path / "ckpt.pt"
    torch.save({"w": torch.randn(100_000)}, good)
    data = good.read_bytes()
    cut = tmp_path / "ckpt-truncated.pt"
    messages = []
    # Where the file ends decides which of the two errors the zip reader raises; both are in the entry.
    for fraction in (0.1, 0.3, 0.5, 0.7, 0.9, 0.99):
        cut.write_bytes(data[: int(len(data) * fraction)])
        with pytest.raises((RuntimeError, OSError)) as caught:
            torch.load(cut)
        messages.append(f"{type(caught.value).__name__}: {caught.value}")
    text = "\n".join(messages)
    assert_reproduces("truncated-checkpoint", text,
                      "PytorchStreamReader failed reading zip archive: failed finding central directory")
    known = ("failed finding central directory", "[Errno 22] Invalid argument")
    unknown = [m for m in messages if not any(k in m for k in known)]
    assert not unknown, f"handbook entry 'truncated-checkpoint' went stale: new error for a cut file: {unknown}"
    assert torch.load(good)["w"].shape == (100_000,)


def test_weights_only_load_failed(tmp_path):
    import argparse
    import pickle

    path = tmp_path / "ckpt.pt"
    torch.save({"args": argparse.Namespace(lr=1e-3), "w": torch.randn(3)}, path)
    with pytest.raises(pickle.UnpicklingError) as caught:
        torch.load(path)
    text = str(caught.value)
    assert_reproduces("weights-only-load-failed", text, "Weights only load failed.")
    assert "Unsupported global: GLOBAL argparse.Namespace" in text, text
    assert torch.load(path, weights_only=False)["args"].lr == 1e-3
