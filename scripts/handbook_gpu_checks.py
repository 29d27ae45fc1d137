"""Check handbook claims that only a CUDA GPU can settle: each check provokes the cause an entry describes in a fresh
`python3 -c` child (a CUDA error poisons the process that raised it), records what torch, triton, jax and friends
really print, whether the check's expectation held, and which of the entry's `signatures` match those lines.

Needs one NVIDIA GPU (an H100 in mind), a CUDA build of torch and, for a few checks, triton, jax, lightning;
nothing is downloaded. Without a CUDA GPU it says so and exits 2.

    python3 scripts/handbook_gpu_checks.py                       # all checks, JSON to handbook_gpu_checks.json
    python3 scripts/handbook_gpu_checks.py --out /tmp/gpu.json --timeout 90
    python3 scripts/handbook_gpu_checks.py --only cuda-device-side-assert sdpa-flash-attention-not-used
    python3 scripts/handbook_gpu_checks.py --list                # print the checks, run nothing (works on a CPU)

Each result is `held`, `failed` or `inconclusive` (timeout, a missing package or GPU: never counted as held).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENTRIES = ROOT / "src" / "mleng" / "handbook" / "entries"
sys.path.insert(0, str(ROOT / "src"))   # mleng of this checkout, installed or not (entries are read with its parser)
RUN_BUDGET_S = 450
TAIL_LINES = 40

# Every child gets these: no NVLink multicast or NVLS, whatever the check does.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "PYTHONUNBUFFERED": "1"}

# Triton needs a kernel's source file, which `python -c` does not have: checks write their kernel to a module.
TRITON_MODULE = '''
import os, sys, tempfile
def triton_module(source):
    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "kernels.py"), "w") as f:
        f.write(source)
    sys.path.insert(0, folder)
    import kernels
    return kernels
'''


def check(entry_id, claim, code, expect=(), expect_rc=None, absent=(), env=None, timeout=None, triton=False):
    code = textwrap.dedent(code).strip() + "\n"
    return {"id": entry_id, "claim": claim, "code": (TRITON_MODULE + code) if triton else code, "expect": list(expect),
            "expect_rc": expect_rc, "absent": list(absent), "env": env or {}, "timeout": timeout}


CHECKS = [
    check("cuda-device-side-assert",
          "An out-of-range embedding index on CUDA prints the srcIndex < srcSelectDimSize assertion and "
          "'device-side assert triggered'.",
          """
          import torch
          emb = torch.nn.Embedding(10, 4).cuda()
          ids = torch.tensor([1, 2, 10], device="cuda")  # 10 is one past the table
          emb(ids)
          torch.cuda.synchronize()
          """,
          expect=["device-side assert triggered", "srcIndex < srcSelectDimSize"], expect_rc="nonzero"),

    check("cuda-async-error-wrong-traceback",
          "A bad label in cross_entropy is reported with the 'asynchronously reported' hint; with "
          "CUDA_LAUNCH_BLOCKING=1 the exception is raised inside the loss call itself.",
          """
          import os, subprocess, sys
          inner = '''
          import traceback, torch, torch.nn.functional as F
          def loss_step():
              logits = torch.randn(4, 3, device="cuda")
              labels = torch.tensor([0, 1, 2, 5], device="cuda")
              return F.cross_entropy(logits, labels)
          def later_sync(loss):
              torch.cuda.synchronize()
              return loss
          try:
              later_sync(loss_step())
              print("raised_in=nothing")
          except Exception as e:
              names = [frame.name for frame in traceback.extract_tb(e.__traceback__)]
              print("raised_in=" + ("loss_step" if "loss_step" in names else "later_sync" if "later_sync" in names else "?"))
              print(e)
          '''
          for blocking in (False, True):
              env = {k: v for k, v in os.environ.items() if k != "CUDA_LAUNCH_BLOCKING"}
              if blocking:
                  env["CUDA_LAUNCH_BLOCKING"] = "1"
              r = subprocess.run([sys.executable, "-c", inner], env=env, capture_output=True, text=True, timeout=120)
              print(f"CUDA_LAUNCH_BLOCKING={int(blocking)}: " + (r.stdout + r.stderr)[-2500:])
          """,
          expect=["CUDA kernel errors might be asynchronously reported", "CUDA_LAUNCH_BLOCKING=1: raised_in=loss_step"],
          expect_rc="zero"),

    check("cuda-invalid-device-ordinal",
          "Asking for a GPU index past device_count() fails with 'invalid device ordinal'.",
          """
          import torch
          n = torch.cuda.device_count()
          print("device_count", n)
          torch.zeros(1, device=f"cuda:{n + 3}")
          """,
          expect=["invalid device ordinal"], expect_rc="nonzero"),

    check("tensors-on-different-devices",
          "A CUDA Linear fed a CPU tensor raises 'Expected all tensors to be on the same device, but ...' (either the "
          "'found at least two devices' or the 'got mat1 is on cpu' wording; a CUDA Conv2d's message is printed too).",
          """
          import torch
          try:
              torch.nn.Linear(4, 4).cuda()(torch.randn(2, 4))
          except RuntimeError as e:
              print("linear:", e)
          try:
              torch.nn.Conv2d(3, 8, 3).cuda()(torch.randn(1, 3, 8, 8))
          except RuntimeError as e:
              print("conv2d:", e)
          """,
          expect=["Expected all tensors to be on the same device, but "], expect_rc="zero"),

    check("cuda-oom-tried-to-allocate",
          "An allocation larger than the card raises torch.OutOfMemoryError 'CUDA out of memory. Tried to allocate "
          "... GiB' with the capacity/free/in-use breakdown.",
          """
          import torch
          total = torch.cuda.get_device_properties(0).total_memory
          torch.empty(2 * total, dtype=torch.uint8, device="cuda")
          """,
          expect=["CUDA out of memory. Tried to allocate", "OutOfMemoryError", "has a total capacity of"],
          expect_rc="nonzero"),

    check("cuda-oom-fragmentation",
          "With freed blocks cached, the OOM message reports memory 'reserved by PyTorch but unallocated' and "
          "suggests expandable_segments:True.",
          """
          import torch
          gib = 2**30
          blocks = [torch.empty(gib, dtype=torch.uint8, device="cuda") for _ in range(8)]
          del blocks[::2]  # 4 GiB of 1 GiB holes stay in the cache
          print(f"allocated {torch.cuda.memory_allocated() / gib:.1f} GiB, reserved {torch.cuda.memory_reserved() / gib:.1f} GiB")
          free, total = torch.cuda.mem_get_info()
          torch.empty(free + 6 * gib, dtype=torch.uint8, device="cuda")
          """,
          expect=["reserved by PyTorch but unallocated", "expandable_segments:True"], expect_rc="nonzero"),

    check("cuda-oom-in-backward",
          "A step whose forward fits under a 6 GiB cap runs out of memory inside loss.backward(); the traceback "
          "ends in the run_backward frame (the signature expects both on one line).",
          """
          import torch
          gib = 2**30
          torch.cuda.set_per_process_memory_fraction(6 * gib / torch.cuda.get_device_properties(0).total_memory)
          x = torch.randn(gib // 2, device="cuda", requires_grad=True)  # 2 GiB
          loss = torch.sin(x).sum()  # +2 GiB; backward needs cos(x) and grad * cos(x)
          print(f"forward done, allocated {torch.cuda.memory_allocated() / gib:.1f} GiB")
          loss.backward()
          """,
          expect=["forward done", "run_backward", "CUDA out of memory"], expect_rc="nonzero"),

    check("cuda-illegal-memory-access",
          "A Triton kernel reading 4 TiB past its buffer fails with 'an illegal memory access was encountered'.",
          """
          import torch
          k = triton_module('''
          import triton, triton.language as tl
          @triton.jit
          def read_far(src, dst, offset):
              tl.store(dst, tl.load(src + offset))
          ''')
          src = torch.zeros(16, device="cuda")
          dst = torch.zeros(1, device="cuda")
          k.read_far[(1,)](src, dst, 1 << 40)
          torch.cuda.synchronize()
          print(dst)
          """,
          expect=["an illegal memory access was encountered"], expect_rc="nonzero", triton=True),

    check("cuda-empty-cache-misconception",
          "After del, the caching allocator keeps the memory reserved (still used on the device) until "
          "torch.cuda.empty_cache() hands it back.",
          """
          import torch
          mib = 2**20
          def used():
              free, total = torch.cuda.mem_get_info()
              return (total - free) / mib
          torch.zeros(1, device="cuda")
          base = used()
          x = torch.empty(4 * 2**30, dtype=torch.uint8, device="cuda")
          del x
          allocated, reserved, held = torch.cuda.memory_allocated() / mib, torch.cuda.memory_reserved() / mib, used() - base
          print(f"after del: allocated {allocated:.0f} MiB, reserved {reserved:.0f} MiB, device use above start {held:.0f} MiB")
          torch.cuda.empty_cache()
          reserved2, held2 = torch.cuda.memory_reserved() / mib, used() - base
          print(f"after empty_cache: reserved {reserved2:.0f} MiB, device use above start {held2:.0f} MiB")
          assert allocated < 1 and reserved >= 4096 and held >= 4000 and reserved2 < 64 and held2 < 256
          """,
          expect_rc="zero"),

    check("cuda-context-memory-overhead",
          "Initialising CUDA with one tiny tensor already uses a few hundred MiB of device memory outside the "
          "allocator (the context); cuBLAS adds more at the first matmul.",
          """
          import torch
          mib = 2**20
          def outside_allocator():
              free, total = torch.cuda.mem_get_info()
              return (total - free - torch.cuda.memory_reserved()) / mib
          torch.zeros(1, device="cuda")
          ctx = outside_allocator()
          a = torch.randn(1024, 1024, device="cuda")
          (a @ a).sum().item()
          print(f"device memory outside the allocator: {ctx:.0f} MiB after init, {outside_allocator():.0f} MiB after a matmul")
          assert 100 < ctx < 4096
          """,
          expect_rc="zero"),

    check("cuda-reinit-forked-subprocess",
          "A fork()ed child of a process that initialised CUDA gets 'Cannot re-initialize CUDA in forked subprocess'.",
          """
          import multiprocessing as mp
          import torch
          def child(queue):
              try:
                  torch.zeros(1, device="cuda")
                  queue.put("no error")
              except Exception as e:
                  queue.put(f"{type(e).__name__}: {e}")
          if __name__ == "__main__":
              torch.zeros(1, device="cuda")
              ctx = mp.get_context("fork")
              queue = ctx.Queue()
              p = ctx.Process(target=child, args=(queue,))
              p.start()
              print("forked child:", queue.get(timeout=60))
              p.join()
          """,
          expect=["Cannot re-initialize CUDA in forked subprocess"], expect_rc="zero"),

    check("cuda-visible-devices-set-after-cuda-init",
          "Setting os.environ['CUDA_VISIBLE_DEVICES']='' after CUDA started does not take the GPU from that process "
          "(a new CUDA tensor still works; what device_count() then says is printed); a fresh process sees no GPU.",
          """
          import os, subprocess, sys
          import torch
          before = torch.cuda.device_count()
          torch.zeros(1, device="cuda")
          os.environ["CUDA_VISIBLE_DEVICES"] = ""
          after = torch.cuda.device_count()
          still = torch.zeros(1, device="cuda").device
          fresh = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                                 capture_output=True, text=True, timeout=120).stdout.strip()
          print(f"device_count: before {before}, after setting it in-process {after}, fresh process {fresh}")
          print(f"a tensor created after the assignment is on {still}")
          assert before >= 1 and still.type == "cuda" and fresh == "0"
          """,
          expect_rc="zero"),

    check("cuda-no-gpus-available",
          "With CUDA_VISIBLE_DEVICES='' on a GPU machine, the first CUDA tensor raises 'No CUDA GPUs are available'.",
          """
          import torch
          print("is_available", torch.cuda.is_available(), "device_count", torch.cuda.device_count())
          torch.zeros(1, device="cuda")
          """,
          expect=["No CUDA GPUs are available"], expect_rc="nonzero", env={"CUDA_VISIBLE_DEVICES": ""}),

    check("torch-load-cuda-checkpoint-on-cpu",
          "A checkpoint saved from CUDA fails to load where no GPU is visible ('Attempting to deserialize object on "
          "a CUDA device ...') and loads with map_location='cpu'.",
          """
          import os, subprocess, sys, tempfile
          import torch
          path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
          torch.save({"w": torch.randn(3, device="cuda")}, path)
          env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
          plain = subprocess.run([sys.executable, "-c", "import sys, torch; torch.load(sys.argv[1])", path],
                                 env=env, capture_output=True, text=True, timeout=120)
          print("torch.load:", plain.stderr[-1500:])
          mapped = subprocess.run([sys.executable, "-c",
                                   "import sys, torch; print(torch.load(sys.argv[1], map_location='cpu')['w'].device)", path],
                                  env=env, capture_output=True, text=True, timeout=120)
          print("map_location='cpu' ->", mapped.stdout.strip() or mapped.stderr[-500:])
          """,
          expect=["Attempting to deserialize object on a CUDA device but torch.cuda.is_available() is False",
                  "map_location='cpu' -> cpu"], expect_rc="zero"),

    check("cublas-workspace-config-determinism",
          "Recent torch dropped the CuBLAS workspace check: under use_deterministic_algorithms(True) a CUDA matmul "
          "runs without CUBLAS_WORKSPACE_CONFIG (and with it); an op with no deterministic kernel (histc) still raises.",
          """
          import os, subprocess, sys
          import torch
          torch.use_deterministic_algorithms(True)
          a = torch.randn(64, 64, device="cuda")
          try:
              (a @ a).sum().item()
              print("matmul: no error")
          except RuntimeError as e:
              print("matmul:", e)
          try:
              torch.histc(a, bins=10)
              print("histc: no error")
          except RuntimeError as e:
              print("histc:", e)
          inner = ("import torch; torch.use_deterministic_algorithms(True); a = torch.randn(64, 64, device='cuda'); "
                   "print('ok' if torch.isfinite(a @ a).all().item() else 'bad')")
          r = subprocess.run([sys.executable, "-c", inner], env=dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8"),
                             capture_output=True, text=True, timeout=120)
          print("with the variable set:", r.stdout.strip() or r.stderr[-800:])
          """,
          expect=["matmul: no error", "does not have a deterministic implementation", "with the variable set: ok"], expect_rc="zero",
          env={"CUBLAS_WORKSPACE_CONFIG": None}),

    check("cudnn-benchmark-variable-shapes",
          "cudnn.benchmark defaults to False; with it on, every new input shape pays an autotuning first call many "
          "times slower than the repeat.",
          """
          import time
          import torch
          print("default cudnn.benchmark:", torch.backends.cudnn.benchmark)
          default = torch.backends.cudnn.benchmark
          torch.backends.cudnn.benchmark = True
          conv = torch.nn.Conv2d(64, 64, 3, padding=1).cuda().half()
          def timed(x):
              torch.cuda.synchronize()
              start = time.perf_counter()
              conv(x)
              torch.cuda.synchronize()
              return time.perf_counter() - start
          timed(torch.randn(8, 64, 32, 32, device="cuda", dtype=torch.half))
          first, repeat = [], []
          for size in (40, 48, 56, 64, 72, 80):
              x = torch.randn(8, 64, size, size, device="cuda", dtype=torch.half)
              first.append(timed(x))
              repeat.append(min(timed(x) for _ in range(3)))
          ratio = sum(first) / sum(repeat)
          print(f"new shape: first call {1e3 * sum(first) / 6:.2f} ms, repeat {1e3 * sum(repeat) / 6:.3f} ms, ratio {ratio:.0f}")
          assert default is False and ratio > 3
          """,
          expect_rc="zero"),

    check("tf32-disabled-fp32-matmul",
          "torch's fp32 matmul precision defaults to 'highest' and torch.compile on an H100 warns 'TensorFloat32 "
          "tensor cores for float32 matrix multiplication available but not enabled'.",
          """
          import torch
          print("float32_matmul_precision:", torch.get_float32_matmul_precision())
          print("cuda.matmul.allow_tf32:", torch.backends.cuda.matmul.allow_tf32, "cudnn.allow_tf32:", torch.backends.cudnn.allow_tf32)
          a = torch.randn(256, 256, device="cuda")
          torch.compile(lambda x, y: x @ y)(a, a)
          torch.cuda.synchronize()
          """,
          expect=["TensorFloat32 tensor cores for float32 matrix multiplication available but not enabled"],
          expect_rc="zero", timeout=120),

    check("fp16-overflow-inf",
          "On CUDA fp16 values above 65504 become inf, inf - inf is NaN, and GradScaler skips the step and halves "
          "its scale.",
          """
          import torch
          x = torch.tensor([60000.0, 70000.0], device="cuda").half()
          print(x)
          a = torch.full((64, 64), 40.0, device="cuda", dtype=torch.half)
          y = a @ a  # 64 * 1600 = 102400
          print("matmul:", y[0, :3], "then y - y:", (y - y)[0, :3])
          lin = torch.nn.Linear(4096, 4).cuda()
          opt = torch.optim.SGD(lin.parameters(), lr=0.1)
          scaler = torch.amp.GradScaler("cuda")
          before = lin.weight.detach().clone()
          with torch.autocast("cuda", dtype=torch.float16):
              loss = lin(torch.full((2, 4096), 300.0, device="cuda")).sum()
          scaler.scale(loss).backward()
          scale = scaler.get_scale()
          scaler.step(opt)
          scaler.update()
          print(f"loss {loss.item()}, scale {scale} -> {scaler.get_scale()}, weights unchanged {torch.equal(before, lin.weight)}")
          assert torch.isinf(x[1]) and torch.isinf(y).all() and torch.isnan(y - y).all()
          assert scaler.get_scale() == scale / 2 and torch.equal(before, lin.weight)
          """,
          expect_rc="zero"),

    check("amp-bce-unsafe-to-autocast",
          "F.binary_cross_entropy under CUDA fp16 autocast raises 'binary_cross_entropy and torch.nn.BCELoss are "
          "unsafe to autocast'.",
          """
          import torch, torch.nn.functional as F
          p = torch.randn(8, device="cuda")
          t = torch.rand(8, device="cuda")
          with torch.autocast("cuda", dtype=torch.float16):
              F.binary_cross_entropy(p.sigmoid(), t)
          """,
          expect=["are unsafe to autocast"], expect_rc="nonzero"),

    check("amp-gradscaler-unscale-called-twice",
          "Calling scaler.unscale_(opt) twice before update() raises 'unscale_() has already been called on this "
          "optimizer since the last update()'.",
          """
          import torch
          model = torch.nn.Linear(4, 4).cuda()
          opt = torch.optim.SGD(model.parameters(), lr=0.1)
          scaler = torch.amp.GradScaler("cuda")
          with torch.autocast("cuda", dtype=torch.float16):
              loss = model(torch.randn(2, 4, device="cuda")).float().sum()
          scaler.scale(loss).backward()
          scaler.unscale_(opt)
          scaler.unscale_(opt)
          """,
          expect=["unscale_() has already been called on this optimizer since the last update()"],
          expect_rc="nonzero"),

    check("amp-api-deprecation-warnings",
          "torch.cuda.amp.autocast() and torch.cuda.amp.GradScaler() still work on CUDA and print their "
          "FutureWarnings.",
          """
          import torch
          with torch.cuda.amp.autocast():
              y = torch.randn(4, 4, device="cuda") @ torch.randn(4, 4, device="cuda")
          print("autocast dtype:", y.dtype)
          torch.cuda.amp.GradScaler()
          """,
          expect=["`torch.cuda.amp.autocast(args...)` is deprecated", "`torch.cuda.amp.GradScaler(args...)` is deprecated",
                  "autocast dtype: torch.float16"], expect_rc="zero"),

    check("sdpa-flash-attention-not-used",
          "fp32 inputs with only the flash backend allowed print 'Flash attention kernel not used because' with the "
          "reasons, then 'No available kernel. Aborting execution.'",
          """
          import torch, torch.nn.functional as F
          from torch.nn.attention import sdpa_kernel, SDPBackend
          q = torch.randn(2, 4, 64, 64, device="cuda")  # float32
          with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
              F.scaled_dot_product_attention(q, q, q)
          """,
          expect=["Flash attention kernel not used because", "No available kernel"], expect_rc="nonzero"),

    check("sdpa-cudnn-backend-issues",
          "torch 2.11 on an H100 picks the cuDNN SDPA backend by default for bf16 inputs with an explicit attn_mask "
          "(as 2026 reports say); the choices and gradient finiteness are printed.",
          """
          import torch, torch.nn.functional as F
          from torch.nn.attention import SDPBackend
          names = {int(b): n for n, b in SDPBackend.__members__.items()}
          q = torch.randn(2, 8, 512, 128, device="cuda", dtype=torch.bfloat16)
          mask = torch.ones(512, 512, device="cuda", dtype=torch.bool).tril()
          no_mask = names[torch._fused_sdp_choice(q, q, q)]
          causal = names[torch._fused_sdp_choice(q, q, q, is_causal=True)]
          with_mask = names[torch._fused_sdp_choice(q, q, q, mask)]
          print(f"default choice: no mask {no_mask}, is_causal {causal}, bool attn_mask {with_mask}")
          qq = q.clone().requires_grad_()
          F.scaled_dot_product_attention(qq, q, q, attn_mask=mask).float().sum().backward()
          print("grad_q finite with the mask:", torch.isfinite(qq.grad).all().item())
          assert with_mask == "CUDNN_ATTENTION"
          """,
          expect_rc="zero"),

    check("sdpa-attn-mask-with-is-causal",
          "On CUDA the default SDPA dispatch accepts attn_mask together with is_causal=True (the fused kernels do not "
          "check); under SDPBackend.MATH the same call raises 'Explicit attn_mask should not be set when is_causal=True'.",
          """
          import torch, torch.nn.functional as F
          from torch.nn.attention import sdpa_kernel, SDPBackend
          q = torch.randn(1, 2, 8, 16, device="cuda", dtype=torch.half)
          mask = torch.zeros(8, 8, device="cuda", dtype=torch.half)
          F.scaled_dot_product_attention(q, q, q, attn_mask=mask, is_causal=True)
          print("default dispatch: no error")
          with sdpa_kernel(SDPBackend.MATH):
              F.scaled_dot_product_attention(q, q, q, attn_mask=mask, is_causal=True)
          """,
          expect=["default dispatch: no error", "Explicit attn_mask should not be set when is_causal=True"],
          expect_rc="nonzero"),

    check("mem-efficient-attention-alignment",
          "With only the memory-efficient backend, fp16 head dim 60 is refused: 'Mem efficient attention requires "
          "last dimension of inputs to be divisible by 8'.",
          """
          import torch, torch.nn.functional as F
          from torch.nn.attention import sdpa_kernel, SDPBackend
          q = torch.randn(2, 4, 64, 60, device="cuda", dtype=torch.half)
          with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
              F.scaled_dot_product_attention(q, q, q)
          """,
          expect=["Mem efficient attention requires last dimension of inputs to be divisible by 8"],
          expect_rc="nonzero"),

    check("attention-fully-masked-row-nan",
          "A fully masked query row gives NaN with manual masked_fill(-inf) + softmax, while CUDA SDPA's MATH and "
          "memory-efficient kernels return zeros for it (the default dispatch's row is printed, not judged).",
          """
          import torch, torch.nn.functional as F
          from torch.nn.attention import sdpa_kernel, SDPBackend
          q = torch.randn(1, 2, 4, 16, device="cuda", dtype=torch.half)
          mask = torch.ones(4, 4, dtype=torch.bool, device="cuda")
          mask[1] = False  # query 1 may attend to nothing
          scores = (q @ q.transpose(-1, -2) / 4).masked_fill(~mask, float("-inf"))
          manual = scores.softmax(-1) @ q
          print("manual row:", manual[0, 0, 1, :4])
          rows = {"default": F.scaled_dot_product_attention(q, q, q, attn_mask=mask)[0, 0, 1]}
          for backend in (SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION):
              with sdpa_kernel(backend):
                  rows[backend.name] = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)[0, 0, 1]
          for name, row in rows.items():
              print(f"sdpa {name} row:", row[:4])
          assert torch.isnan(manual[0, 0, 1]).all()
          assert all((rows[b.name] == 0).all() for b in (SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION))
          """,
          expect_rc="zero"),

    check("attention-backward-nondeterministic",
          "Flash SDPA backward under use_deterministic_algorithms(True, warn_only=True) warns 'Flash Attention "
          "defaults to a non-deterministic algorithm'; whether dQ repeats bitwise is printed.",
          """
          import torch, torch.nn.functional as F
          from torch.nn.attention import sdpa_kernel, SDPBackend
          torch.use_deterministic_algorithms(True, warn_only=True)
          q, k, v = (torch.randn(4, 8, 1024, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
          q.requires_grad_()
          grads = []
          with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
              for _ in range(2):
                  q.grad = None
                  F.scaled_dot_product_attention(q, k, v).float().square().sum().backward()
                  grads.append(q.grad.clone())
          print("dQ bitwise equal across two backward passes:", torch.equal(grads[0], grads[1]))
          """,
          expect=["Flash Attention defaults to a non-deterministic algorithm"], expect_rc="zero",
          env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}),

    check("sdpa-efficient-attention-stride0-kv-wrong-output",
          "The memory-efficient SDPA kernel is wrong for expand()ed (stride-0) bf16 K/V with a mask and kv_len 33, "
          "while contiguous K/V are right (reported on torch 2.12.0; a release without the fault is inconclusive).",
          """
          import torch, torch.nn.functional as F
          from torch.nn.attention import sdpa_kernel, SDPBackend
          torch.manual_seed(0)
          q = torch.randn(8, 4, 16, 64, device="cuda", dtype=torch.bfloat16)
          k = torch.randn(1, 4, 33, 64, device="cuda", dtype=torch.bfloat16).expand(8, 4, 33, 64)
          v = torch.randn(1, 4, 33, 64, device="cuda", dtype=torch.bfloat16).expand(8, 4, 33, 64)
          mask = torch.rand(8, 4, 16, 33, device="cuda") > 0.3
          mask[..., 0] = True
          with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
              strided = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).float()
              packed = F.scaled_dot_product_attention(q, k.contiguous(), v.contiguous(), attn_mask=mask).float()
          with sdpa_kernel(SDPBackend.MATH):
              ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
          bad, good = (strided - ref).abs().max().item(), (packed - ref).abs().max().item()
          print(f"k.stride() {k.stride()}; max |diff| to fp32 math: stride-0 K/V {bad:.4f}, contiguous K/V {good:.4f}")
          if good < 0.05 and bad <= 0.05 and tuple(map(int, torch.__version__.split(".")[:2])) < (2, 12):
              print(f"INCONCLUSIVE: not reproduced on torch {torch.__version__}; the report is on 2.12.0")
          assert good < 0.05 and bad > 0.05
          """,
          expect_rc="zero"),

    check("torch-compile-recompile-limit",
          "A compiled CUDA function called with ten different string arguments recompiles until "
          "'torch._dynamo hit config.recompile_limit (8)' and then runs eagerly.",
          """
          import torch
          @torch.compile
          def f(x, mode):
              return x * 2 if mode == "double" else x + len(mode)
          x = torch.randn(8, device="cuda")
          for i in range(10):
              f(x, f"mode{i}")
          torch.cuda.synchronize()
          print("done")
          """,
          expect=["torch._dynamo hit config.recompile_limit (8)", "done"], expect_rc="zero", timeout=180),

    check("torch-compile-graph-breaks",
          "With TORCH_LOGS=graph_breaks, .item() inside a compiled CUDA function logs a graph break.",
          """
          import torch
          @torch.compile
          def f(x):
              s = x.sum().item()
              return x * s
          f(torch.randn(8, device="cuda"))
          torch.cuda.synchronize()
          """,
          expect=["Graph break"], expect_rc="zero", env={"TORCH_LOGS": "graph_breaks"}, timeout=120),

    check("pytorch-alloc-conf-renamed",
          "torch 2.11 honours expandable_segments:True from PYTORCH_CUDA_ALLOC_CONF and from PYTORCH_ALLOC_CONF, and "
          "prints no deprecation warning for the old name.",
          """
          import os, subprocess, sys
          probe = ("import torch; x = torch.empty(2**20, device='cuda'); segments = torch.cuda.memory._snapshot()['segments']; "
                   "print('INCONCLUSIVE: no is_expandable field in the snapshot' if not all('is_expandable' in s for s in segments) "
                   "else 'expandable %s' % any(s['is_expandable'] for s in segments))")
          for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
              env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
              env[name] = "expandable_segments:True"
              r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
              print(f"{name}=expandable_segments:True -> {r.stdout.strip()} {r.stderr.strip()[-800:]}")
          """,
          expect=["PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True -> expandable True",
                  "PYTORCH_ALLOC_CONF=expandable_segments:True -> expandable True"],
          absent=["is deprecated"], expect_rc="zero",
          env={"PYTORCH_CUDA_ALLOC_CONF": None, "PYTORCH_ALLOC_CONF": None}),

    check("gpu-expandable-segments-unsupported-platform",
          "On Linux with a CUDA wheel, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True gives expandable segments "
          "and no 'not supported on this platform' warning.",
          """
          import torch
          x = torch.empty(64 * 2**20, device="cuda")
          segments = torch.cuda.memory._snapshot()["segments"]
          if not all("is_expandable" in s for s in segments):
              print("INCONCLUSIVE: no is_expandable field in the snapshot")
          else:
              print("expandable", any(s["is_expandable"] for s in segments))
          """,
          expect=["expandable True"], absent=["not supported on this platform"], expect_rc="zero",
          env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": None}),

    check("cudamallocasync-backend-unsupported-feature",
          "With backend:cudaMallocAsync, torch.cuda.memory._record_memory_history() raises 'cudaMallocAsync does not "
          "yet support recordHistory'.",
          """
          import torch
          torch.zeros(1, device="cuda")
          print("allocator backend:", torch.cuda.get_allocator_backend())
          torch.cuda.memory._record_memory_history()
          """,
          expect=["allocator backend: cudaMallocAsync", "cudaMallocAsync does not yet support"], expect_rc="nonzero",
          env={"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync", "PYTORCH_ALLOC_CONF": None}),

    check("cuda-record-memory-history-host-ram-growth",
          "With the default max_entries, _record_memory_history keeps every event (the trace grows with the steps); "
          "max_entries=1000 caps it.",
          """
          import torch
          def trace_length(steps, **kwargs):
              torch.cuda.memory._record_memory_history(stacks="python", **kwargs)
              for _ in range(steps):
                  del_me = torch.empty(4096, device="cuda")
                  del del_me
              length = len(torch.cuda.memory._snapshot()["device_traces"][0])
              torch.cuda.memory._record_memory_history(enabled=None)
              return length
          small, large, capped = trace_length(1000), trace_length(4000), trace_length(4000, max_entries=1000)
          print(f"trace entries: 1000 steps {small}, 4000 steps {large}, 4000 steps with max_entries=1000 {capped}")
          assert large >= 3 * small and capped <= 1000
          """,
          expect_rc="zero"),

    check("host-device-sync-item",
          "torch.cuda.set_sync_debug_mode('warn') makes .item() on a CUDA tensor warn 'called a synchronizing CUDA "
          "operation'.",
          """
          import torch
          torch.cuda.set_sync_debug_mode("warn")
          x = torch.randn(8, device="cuda")
          print("value", x.sum().item())
          """,
          expect=["called a synchronizing CUDA operation"], expect_rc="zero"),

    check("triton-pointer-argument-cpu-tensor-wrong-device",
          "Passing a CPU tensor to a Triton kernel fails with 'Pointer argument (at 0) cannot be accessed from "
          "Triton (cpu tensor?)'.",
          """
          import torch
          k = triton_module('''
          import triton, triton.language as tl
          @triton.jit
          def copy(src, dst, n, BLOCK: tl.constexpr):
              offs = tl.arange(0, BLOCK)
              tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)
          ''')
          dst = torch.empty(16, device="cuda")
          k.copy[(1,)](torch.randn(16), dst, 16, BLOCK=16)  # src left on the CPU
          torch.cuda.synchronize()
          """,
          expect=["cannot be accessed from Triton (cpu tensor?)"], expect_rc="nonzero", timeout=90, triton=True),

    check("dataloader-generator-device-mismatch",
          "With torch.set_default_device('cuda'), a shuffling DataLoader fails with \"Expected a 'cuda' device type "
          "for generator but found 'cpu'\".",
          """
          import torch
          torch.set_default_device("cuda")
          loader = torch.utils.data.DataLoader(list(range(10)), batch_size=2, shuffle=True)
          print(next(iter(loader)))
          """,
          expect=["Expected a 'cuda' device type for generator but found 'cpu'"], expect_rc="nonzero"),

    check("cuda-graph-capture-not-permitted",
          "A .item() inside torch.cuda.graph capture fails with 'operation not permitted when stream is capturing'.",
          """
          import torch
          x = torch.randn(8, device="cuda")
          g = torch.cuda.CUDAGraph()
          with torch.cuda.graph(g):
              y = x * 2
              print(y.sum().item())
          """,
          expect=["operation not permitted when stream is capturing"], expect_rc="nonzero"),

    check("peak-memory-benchmark-other-models-still-allocated",
          "reset_peak_memory_stats() restarts the peak from the current allocation, so a case measured while "
          "another model is alive reports both.",
          """
          import torch
          gib = 2**30
          def case_peak():
              torch.cuda.reset_peak_memory_stats()
              b = torch.empty(gib, dtype=torch.uint8, device="cuda")
              del b
              return torch.cuda.max_memory_allocated() / gib
          other = torch.empty(2 * gib, dtype=torch.uint8, device="cuda")
          with_other = case_peak()
          del other
          alone = case_peak()
          print(f"peak of a 1 GiB case: {with_other:.2f} GiB with a 2 GiB model alive, {alone:.2f} GiB alone")
          assert 2.9 < with_other < 3.1 and 0.9 < alone < 1.1
          """,
          expect_rc="zero"),

    check("cuda-tensors-in-reference-cycles-freed-only-by-gc",
          "A CUDA tensor held by a reference cycle stays allocated after its last name goes, until gc.collect().",
          """
          import gc
          import torch
          gc.disable()
          class Holder:
              pass
          def step():
              h = Holder()
              h.me = h
              h.t = torch.empty(2**30, dtype=torch.uint8, device="cuda")
          step()
          before = torch.cuda.memory_allocated() / 2**20
          gc.collect()
          after = torch.cuda.memory_allocated() / 2**20
          print(f"allocated after the step returned {before:.0f} MiB, after gc.collect() {after:.0f} MiB")
          assert before >= 1024 and after < 1
          """,
          expect_rc="zero"),

    check("torch-cublas-workspace-memory-allocated-not-zero",
          "After one CUDA matmul and deleting every tensor, memory_allocated() stays above 0 (the cached cuBLAS "
          "workspace, 32 MiB on compute capability 9.0); torch._C._cuda_clearCublasWorkspaces() brings it to 0.",
          """
          import torch
          a = torch.randn(256, 256, device="cuda")
          b = a @ a
          torch.cuda.synchronize()
          del a, b
          torch.cuda.empty_cache()
          left = torch.cuda.memory_allocated()
          torch._C._cuda_clearCublasWorkspaces()
          after = torch.cuda.memory_allocated()
          print(f"memory_allocated after del and empty_cache: {left}, after clearing cuBLAS workspaces: {after}")
          assert left > 0 and after == 0
          """,
          expect_rc="zero"),

    check("cuda-launch-blocking-left-set",
          "CUDA_LAUNCH_BLOCKING=1 makes a loop of small kernels slower, at least 1.2x per kernel (each launch waits for "
          "the GPU).",
          """
          import os, subprocess, sys
          inner = ("import time, torch; x = torch.randn(1024, device='cuda'); [x.add_(1) for _ in range(500)]; "
                   "torch.cuda.synchronize(); t = time.perf_counter(); [x.add_(1) for _ in range(20000)]; "
                   "torch.cuda.synchronize(); print((time.perf_counter() - t) / 20000 * 1e6)")
          times = {}
          for blocking in ("0", "1"):
              env = {k: v for k, v in os.environ.items() if k != "CUDA_LAUNCH_BLOCKING"}
              if blocking == "1":
                  env["CUDA_LAUNCH_BLOCKING"] = "1"
              r = subprocess.run([sys.executable, "-c", inner], env=env, capture_output=True, text=True, timeout=120)
              times[blocking] = float(r.stdout.strip())
          print(f"per small kernel: {times['0']:.2f} us normally, {times['1']:.2f} us with CUDA_LAUNCH_BLOCKING=1")
          assert times["1"] > 1.2 * times["0"]
          """,
          expect_rc="zero"),

    check("lightning-requested-gpu-not-available",
          "Lightning's Trainer(accelerator='gpu', devices=[3]) on a one-GPU machine raises 'You requested gpu: [3]' "
          "/ 'But your machine only has: [0]'.",
          """
          try:
              import lightning.pytorch as pl
          except ImportError:
              import pytorch_lightning as pl
          print("lightning", pl.__version__)
          pl.Trainer(accelerator="gpu", devices=[3], logger=False, enable_checkpointing=False)
          """,
          expect=["You requested gpu: [3]", "But your machine only has: [0]"], expect_rc="nonzero", timeout=90),

    check("jax-gpu-memory-preallocation",
          "JAX takes about 75% of the GPU at its first operation; XLA_PYTHON_CLIENT_PREALLOCATE=false takes little; "
          "XLA_PYTHON_CLIENT_MEM_FRACTION=.30 about 30%.",
          """
          import os, shutil, subprocess, sys
          if not shutil.which("nvidia-smi"):
              print("INCONCLUSIVE: nvidia-smi not found")
              sys.exit(3)
          inner = '''
          import subprocess, sys
          import jax, jax.numpy as jnp
          if jax.devices()[0].platform != "gpu":
              print("INCONCLUSIVE: jax sees no GPU:", jax.devices())
              sys.exit(3)
          jnp.ones(1).block_until_ready()
          used, total = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                                       capture_output=True, text=True).stdout.split(",")
          print(float(used) / float(total))
          '''
          fractions = {}
          for label, extra in (("default", {}), ("PREALLOCATE=false", {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}),
                               ("MEM_FRACTION=.30", {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".30"})):
              env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
              env.update(extra)
              r = subprocess.run([sys.executable, "-c", inner], env=env, capture_output=True, text=True, timeout=120)
              if r.returncode:
                  print(r.stdout + r.stderr[-2000:])
                  sys.exit(r.returncode)
              fractions[label] = float(r.stdout.strip().splitlines()[-1])
              print(f"{label}: GPU memory used {fractions[label]:.2f} of total")
          assert 0.70 <= fractions["default"] <= 0.82
          assert fractions["PREALLOCATE=false"] < 0.10
          assert 0.25 <= fractions["MEM_FRACTION=.30"] <= 0.37
          """,
          expect_rc="zero", timeout=150),

    check("jax-gpu-float32-matmul-tf32-default",
          "JAX float32 matmul on an H100 defaults to TF32: its error against float64 is far larger than with "
          "precision=HIGHEST.",
          """
          import sys
          import numpy as np
          import jax, jax.numpy as jnp
          if jax.devices()[0].platform != "gpu":
              print("INCONCLUSIVE: jax sees no GPU:", jax.devices())
              sys.exit(3)
          rng = np.random.default_rng(0)
          a = rng.standard_normal((1024, 1024), dtype=np.float32)
          b = rng.standard_normal((1024, 1024), dtype=np.float32)
          ref = a.astype(np.float64) @ b.astype(np.float64)
          def rel_error(precision):
              out = np.asarray(jnp.matmul(a, b, precision=precision), dtype=np.float64)
              return np.abs(out - ref).max() / np.abs(ref).max()
          default, highest = rel_error(None), rel_error(jax.lax.Precision.HIGHEST)
          print(f"max relative error: default {default:.2e}, HIGHEST {highest:.2e}")
          assert default > 10 * highest
          """,
          expect_rc="zero", timeout=90),
]


def signatures_of(entry_id, yaml):
    """The entry's signature regexes as mleng's own parser reads them, or None when they cannot be read."""
    if yaml is None:
        return None
    from mleng.handbook.model import EntryError, parse_entry

    try:
        return parse_entry(ENTRIES / f"{entry_id}.md").signatures
    except EntryError:
        return None


def match_signatures(signatures, lines):
    matched, bad = [], []
    for pattern in signatures:
        try:
            regex = re.compile(pattern)
        except re.error as e:
            bad.append(f"{pattern}: {e}")
            continue
        if any(regex.search(line) for line in lines):
            matched.append(pattern)
    return matched, bad


def child_env(extra):
    env = dict(os.environ)
    for name, value in extra.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    env.update(SAFE_ENV)
    return env


def run_child(code, env, timeout):
    """(rc or None on timeout, combined output, seconds); the child's whole process group goes on timeout."""
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        rc = None
    return rc, out.decode(errors="replace"), time.monotonic() - start


def inconclusive_reason(rc, output):
    if rc is None:
        return "timeout"
    for line in output.splitlines():
        if line.startswith("INCONCLUSIVE:"):
            return line[len("INCONCLUSIVE:"):].strip()
        if re.match(r"(ModuleNotFoundError|ImportError): ", line):
            return line.strip()
    return None


def judge(spec, rc, output):
    missing = [s for s in spec["expect"] if s not in output]
    present = [s for s in spec["absent"] if s in output]
    rc_ok = spec["expect_rc"] is None or (rc == 0) == (spec["expect_rc"] == "zero")
    return not missing and not present and rc_ok, missing, present


def run_check(spec, timeout, yaml):
    rc, output, seconds = run_child(spec["code"], child_env(spec["env"]), spec["timeout"] or timeout)
    lines = output.splitlines()
    held, missing, present = judge(spec, rc, output)
    reason = inconclusive_reason(rc, output)
    result = {"id": spec["id"], "claim": spec["claim"], "rc": rc, "seconds": round(seconds, 2),
              "status": "inconclusive" if reason else "held" if held else "failed",
              "held": bool(held and not reason), "inconclusive_reason": reason,
              "expect": spec["expect"], "expect_rc": spec["expect_rc"], "absent": spec["absent"],
              "missing": missing, "unexpectedly_present": present, "env": spec["env"],
              "output_tail": lines[-TAIL_LINES:]}
    signatures = signatures_of(spec["id"], yaml)
    if signatures is None:
        result.update(signatures_matched=None, signatures_total=None)
    else:
        matched, bad = match_signatures(signatures, lines)
        result.update(signatures_matched=len(matched), signatures_total=len(signatures),
                      signatures_that_matched=matched, signatures_invalid=bad)
    return result


def probe(code, timeout=120):
    rc, output, _ = run_child(code, child_env({}), timeout)
    lines = output.strip().splitlines()
    return lines[-1].strip() if rc == 0 and lines else None


def header(argv):
    torch = "import torch; "
    versions = {
        "torch": probe(torch + "print(torch.__version__)"),
        "cuda": probe(torch + "print(torch.version.cuda)"),
        "cudnn": probe(torch + "print(torch.backends.cudnn.version())"),
        "triton": probe("import triton; print(triton.__version__)"),
        "transformers": probe("import transformers; print(transformers.__version__)"),
        "accelerate": probe("import accelerate; print(accelerate.__version__)"),
        "lightning": probe("import importlib.metadata as m\nfor name in ('lightning', 'pytorch-lightning'):\n"
                           "    try:\n        print(name, m.version(name)); break\n"
                           "    except m.PackageNotFoundError:\n        pass"),
        "safetensors": probe("import safetensors; print(safetensors.__version__)"),
        "jax": probe("import jax; print(jax.__version__)"),
        "numpy": probe("import numpy; print(numpy.__version__)"),
    }
    driver = None
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        driver = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else None
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.executable).name] + argv), "python": sys.version.split()[0],
            "versions": versions, "device_name": probe(torch + "print(torch.cuda.get_device_name())"),
            "driver": driver}


def print_list(checks):
    for spec in checks:
        extra = f"  env {spec['env']}" if spec["env"] else ""
        print(f"{spec['id']}: {spec['claim']}{extra}")
    print(f"{len(checks)} checks")


def print_table(results):
    width = max(len(r["id"]) for r in results)
    print(f"{'id':<{width}}  {'result':<12}  {'signatures':>10}  {'seconds':>7}")
    for r in results:
        sigs = "-" if r["signatures_total"] is None else f"{r['signatures_matched']}/{r['signatures_total']}"
        note = f"  ({r['inconclusive_reason']})" if r["inconclusive_reason"] else ""
        print(f"{r['id']:<{width}}  {r['status']:<12}  {sigs:>10}  {r['seconds']:>7.1f}{note}")
    counts = {s: sum(r["status"] == s for r in results) for s in ("held", "failed", "inconclusive")}
    print(", ".join(f"{n} {s}" for s, n in counts.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="handbook_gpu_checks.json", help="JSON results file")
    parser.add_argument("--only", nargs="+", metavar="ID", help="run only these entry ids")
    parser.add_argument("--list", action="store_true", help="print the checks and exit")
    parser.add_argument("--timeout", type=float, default=60, help="seconds per check unless the check sets its own")
    args = parser.parse_args()

    checks = CHECKS
    if args.only:
        unknown = sorted(set(args.only) - {c["id"] for c in CHECKS})
        if unknown:
            print(f"no check for: {', '.join(unknown)} (--list names the checks)", file=sys.stderr)
            return 2
        checks = [c for c in CHECKS if c["id"] in args.only]
    if args.list:
        print_list(checks)
        return 0

    try:
        import yaml
    except ImportError:
        yaml = None
        print("pyyaml is not importable (import yaml failed): entry signatures will not be matched "
              "(signatures_matched is null); pip install pyyaml to get them", file=sys.stderr)

    gpu = probe("import torch; print(torch.cuda.is_available())")
    if gpu != "True":
        why = "torch could not be imported" if gpu is None else "torch.cuda.is_available() is False"
        print(f"no CUDA GPU: {why} in a child process; these checks need one", file=sys.stderr)
        return 2

    run_header = header(sys.argv)
    print(f"{run_header['device_name']}, driver {run_header['driver']}, torch {run_header['versions']['torch']}, "
          f"CUDA {run_header['versions']['cuda']}")
    results, start = [], time.monotonic()
    for spec in checks:
        if time.monotonic() - start > RUN_BUDGET_S:
            results.append({"id": spec["id"], "claim": spec["claim"], "rc": None, "seconds": 0.0,
                            "status": "inconclusive", "held": False, "inconclusive_reason": "run budget spent",
                            "signatures_matched": None, "signatures_total": None, "output_tail": []})
            continue
        result = run_check(spec, args.timeout, yaml)
        print(f"{result['status']:<12} {result['seconds']:6.1f}s  {spec['id']}", flush=True)
        results.append(result)

    print()
    print_table(results)
    Path(args.out).write_text(json.dumps({"header": run_header, "results": results}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
