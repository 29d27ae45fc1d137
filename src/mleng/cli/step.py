"""`mleng step`: a real training step of a built-in Llama-style model, measured: tokens/s, MFU, MAMFU, memory,
where the time goes. One process, or every rank of a plain (spawned), torchrun or srun launch."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mleng.errors import MlengError, UsageError
from mleng.measure.sizes import format_bytes

DEFAULT_TIMEOUT_S = 300.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "Random weights and synthetic tokens unless --tokens: nothing is downloaded. MFU is measured against "
        "the sourced dense peak of the dtype (inconclusive on a CPU or an unknown GPU), MAMFU against the stored "
        "`mleng mamf` run of the same GPU. FLOPs per token: 6*N_matmul + 12*L*H*Q*T (PaLM/torchtitan); the "
        "book's 6N is printed beside it when they differ. Examples: mleng step;  mleng step --model 8b --layers 4 "
        "--seq 8192 --parallel fsdp;  mleng step --nproc 2 --parallel ddp;  torchrun --nproc_per_node 8 -m mleng "
        "step --model 8b --parallel fsdp")
    model = parser.add_argument_group("model")
    model.add_argument("--model", help="preset: tiny (default), 1b, 8b, 70b (Llama-3 shapes, random weights)")
    model.add_argument("--config", metavar="FILE", help="a local Hugging Face config.json of a Llama model instead")
    model.add_argument("--layers", type=int, help="cut (or grow) the model to N layers, keeping its width")
    run = parser.add_argument_group("the run")
    run.add_argument("--seq", type=int, help="sequence length in tokens (default 2048 on GPUs, 128 on CPU)")
    run.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per forward pass (default 1)")
    run.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step (default 1)")
    run.add_argument("--global-batch", type=int, metavar="N",
                     help="sequences per optimizer step over all ranks; sets --grad-accum (must divide evenly)")
    run.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    run.add_argument("--warmup", type=int, default=3, help="untimed steps first, compile included (default 3)")
    run.add_argument("--profile-steps", type=int, default=2,
                     help="steps under torch.profiler after the timed ones, for the breakdown (default 2; 0: none)")
    run.add_argument("--dtype", help="bfloat16 (default on GPUs: mixed precision, fp32 master weights) or float32 "
                                     "(default on CPU)")
    run.add_argument("--parallel", choices=["none", "ddp", "fsdp"],
                     help="none (default at 1 rank), ddp (default at more), fsdp (FSDP2 fully_shard per block)")
    run.add_argument("--compile", choices=["on", "off"], help="torch.compile each block (default on for CUDA, "
                                                               "off on CPU)")
    run.add_argument("--activation-checkpointing", action="store_true",
                     help="recompute every block's activations in the backward pass (HFU is reported)")
    run.add_argument("--tokens", metavar="FILE", help="token ids from a local file (.npy, or raw ids of "
                                                       "--tokens-dtype) instead of the synthetic pattern")
    run.add_argument("--tokens-dtype", default="uint16", help="ids in a raw --tokens file: uint16 (nanoGPT's .bin, "
                                                               "default), uint32, int32, int64")
    run.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (default 3e-4)")
    run.add_argument("--seed", type=int, default=0, help="weights and synthetic data seed (default 0)")
    run.add_argument("--device", choices=["cpu"], help="cpu: run on the CPU even where GPUs are visible")
    ceilings = parser.add_argument_group("ceilings")
    ceilings.add_argument("--mamf", action="store_true",
                          help="measure the MAMF first when no `mleng mamf` run of this GPU (dtype) is stored")
    ceilings.add_argument("--mamf-seconds", type=float, help="budget of that MAMF run (default 30; CPU 8)")
    ranks = parser.add_argument_group("ranks")
    ranks.add_argument("--nproc", type=int, help="local ranks to spawn when not under torchrun/srun (default 1)")
    ranks.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                       help=f"seconds for joining and for any one collective (default {DEFAULT_TIMEOUT_S:g})")
    output = parser.add_argument_group("output")
    output.add_argument("--out", metavar="DIR", help="write the record (step-ID.json) and rank 0's profiler trace "
                                                      "(step-ID-trace.json, chrome://tracing) into this folder")
    output.add_argument("--no-store", action="store_true", help="do not save the result in the results store")


def options_from(args: argparse.Namespace, world_size: int):
    from mleng.step.config import resolve
    from mleng.step.options import StepOptions, validate

    cfg = resolve(args.model, args.config, args.layers)
    grad_accum = args.grad_accum if args.grad_accum is not None else 1
    if args.global_batch is not None:
        per_step = args.micro_batch * world_size
        if args.global_batch < 1 or args.micro_batch < 1 or args.global_batch % per_step:
            raise UsageError(f"--global-batch {args.global_batch} is not a multiple of --micro-batch "
                             f"{args.micro_batch} x {world_size} rank{'s' if world_size > 1 else ''} = {per_step}",
                             hint=f"use a multiple of {max(per_step, 1)}, or change --micro-batch")
        implied = args.global_batch // per_step
        if args.grad_accum is not None and args.grad_accum != implied:
            raise UsageError(f"--global-batch {args.global_batch} means --grad-accum {implied} at {world_size} "
                             f"rank(s), not {args.grad_accum}", hint="give one of the two")
        grad_accum = implied
    options = StepOptions(cfg=cfg, seq=args.seq, micro_batch=args.micro_batch, grad_accum=grad_accum,
                          steps=args.steps, warmup=args.warmup, dtype=args.dtype.lower() if args.dtype else None,
                          parallel=args.parallel, compile=None if args.compile is None else args.compile == "on",
                          checkpointing=args.activation_checkpointing, lr=args.lr, seed=args.seed,
                          tokens=args.tokens, tokens_dtype=args.tokens_dtype, profile_steps=args.profile_steps,
                          mamf=args.mamf, mamf_seconds=args.mamf_seconds, store=not args.no_store,
                          timeout_s=args.timeout, device=args.device)
    validate(options)
    if options.parallel == "none" and world_size > 1:
        raise UsageError(f"--parallel none runs one process, not {world_size} ranks",
                         hint="use --parallel ddp or fsdp with more ranks")
    return options


def run(args: argparse.Namespace) -> int:
    from mleng.distributed.launch import detect

    launch = detect()
    if args.nproc is not None and args.nproc < 1:
        raise UsageError(f"--nproc {args.nproc}: give at least 1 rank")
    world = launch.world_size if launch else (args.nproc or 1)
    try:
        from mleng.step.options import precheck

        options = options_from(args, world)
        out_dir = _check_out_dir(args.out)
        local = (launch.local_world_size or world) if launch else world
        precheck(options, world, local)
        from mleng.cli.common import preflight_store

        preflight_store(args)
    except MlengError:
        if launch is not None and launch.rank != 0:
            return 2  # rank 0 says it, once for the job
        raise
    from mleng.slurm.allocation import allocation_nodes

    # Inside a multi-node salloc/sbatch, as comm and check do: srun over every node (run_as_ranks relaunches).
    if launch is None and world == 1 and allocation_nodes() < 2:
        from mleng.distributed.launch import Launch, free_port

        single = Launch(mode="single", rank=0, world_size=1, local_rank=0, local_world_size=1,
                        master_addr="127.0.0.1", master_port=free_port())
        return _rank(args, options, single, out_dir)
    from mleng.distributed.runner import run_as_ranks

    return run_as_ranks("step", args._argv, args.nproc, args.timeout,
                        lambda rank_launch: _rank(args, options, rank_launch, out_dir))


def _check_out_dir(path: str | None) -> Path | None:
    if path is None:
        return None
    target = Path(path).expanduser()
    if not target.exists():
        raise UsageError(f"--out {path}: the folder does not exist",
                         hint="create it first (mleng does not create folders)")
    if not target.is_dir():
        raise UsageError(f"--out {path} is not a folder", hint="give a folder for the files")
    return target


def _rank(args: argparse.Namespace, options, launch, out_dir: Path | None) -> int:
    from mleng.cli.common import exit_code_for
    from mleng.step.run import run_rank

    holder: dict = {}

    def finish(record, mamf_records) -> None:
        holder["record"] = record
        _finish(record, mamf_records, args, out_dir)

    header = launch.rank == 0  # on stderr, also under --json: stdout stays the record alone
    progress = _Progress(options.steps + options.warmup) if launch.rank == 0 else None
    if header:
        print(_header(options, launch), file=sys.stderr, flush=True)
    if out_dir is not None:  # renamed after the record's id once it is known (_finish)
        options.trace_path = str(out_dir / f".step-trace-{launch.run_id}.json")
    try:
        run_rank(options, launch, finish, progress=progress)
    finally:
        if progress is not None:
            progress.close()
    record = holder.get("record")
    return exit_code_for(record) if record is not None else 0


def _finish(record, mamf_records, args: argparse.Namespace, out_dir: Path | None) -> None:
    from mleng.cli.common import store_or_warn
    from mleng.cli.render import print_json
    from mleng.results.record import Measurement

    if record.status == "failed" and not record.summary.get("steps"):
        return  # refused before any step (a file, a fit): the error alone says it, nothing to keep
    stored = None
    for data in mamf_records:  # the MAMF runs --mamf made, so that the next step run finds them
        store_or_warn(Measurement.from_dict(data), args, "MAMF run")
    if record.status != "failed" or record.rows:
        stored = store_or_warn(record, args, "measurement")
    written = []
    if out_dir is not None:
        trace = record.summary.get("trace")
        if trace:
            final = out_dir / f"{record.id}-trace.json"
            Path(trace).replace(final)
            record.summary["trace"] = str(final)
            written.append(str(final))
        path = out_dir / f"{record.id}.json"
        path.write_text(json.dumps(record.to_dict(), indent=2, default=str) + "\n")
        written.insert(0, str(path))
    if args.json:
        print_json(record.to_dict())
    else:
        print(render(record))
        for path in written:
            print(f"written: {path}")
        if stored:
            print(f"stored as {stored} (mleng results show {stored})")
    sys.stdout.flush()


def _header(options, launch) -> str:
    from mleng.step.config import param_count

    cfg = options.cfg
    world = launch.world_size
    total = param_count(cfg).total
    size = f"{total / 1e9:.2f} B" if total >= 1e9 else f"{total / 1e6:,.1f} M"
    return (f"mleng step: {cfg.name}, {size} parameters, {world} rank"
            f"{'s' if world > 1 else ''} ({launch.mode}), {options.warmup} warm-up + {options.steps} timed steps"
            + (f" + {options.profile_steps} profiled" if options.profile_steps else ""))


class _Progress:
    """A progress bar on a terminal; elsewhere (a pipe, a log file) a log line for the first step of each phase
    and then at most one every LOG_EVERY_S seconds."""

    LOG_EVERY_S = 10.0

    def __init__(self, total: int):
        from mleng.cli.render import Progress

        self.bar = Progress(total, label="step")
        self.phase = None
        self.logged = 0.0

    def __call__(self, phase: str, index: int, total: int, entry: dict) -> None:
        import time

        note = f"{index + 1}/{total} {phase} {entry['time_s']:.3g} s loss {entry['loss']:.4g}"
        if self.bar.enabled:
            self.bar.update(index + 1, note)
            return
        now = time.monotonic()
        if phase != self.phase or now - self.logged >= self.LOG_EVERY_S:
            self.phase, self.logged = phase, now
            print(f"step {note}", file=sys.stderr, flush=True)

    def close(self) -> None:
        self.bar.close()


# ------------------------------------------------------------------------------------------ rendering

def _si(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}".rstrip()


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def render(record) -> str:
    from mleng.cli.render import table

    s, p = record.summary, record.params
    lines = []
    if record.status == "interrupted":
        lines.append(f"interrupted: {s.get('steps_timed', 0)} timed step(s) kept")
    elif record.status == "failed":
        lines.append(f"failed: {record.error}")
    per = "GPU" if s.get("device_kind") == "cuda" else "CPU host"
    model = p["model"]
    fields = [
        ("model", f"{s['model']}: {s['parameters']['total'] / 1e6:,.1f} M parameters, dim {model['dim']}, "
                  f"{model['n_layers']} layers, {model['n_heads']} heads ({model['n_kv_heads']} kv), "
                  f"ffn {model['ffn_dim']}, vocab {model['vocab_size']}"),
        ("run", f"seq {s['seq']}, micro-batch {p['micro_batch']} x grad-accum {p['grad_accum']} x "
                f"{s['world_size']} rank(s) = {s['global_batch']} sequence{'s' if s['global_batch'] > 1 else ''} "
                f"({s['tokens_per_step']:,} tokens) "
                f"per step; {s['dtype']}, parallel {s['parallel']}, compile {'on' if s['compile'] else 'off'}, "
                f"activation checkpointing {'on' if s['activation_checkpointing'] else 'off'}"),
        ("device", f"{s.get('device_name')} x {s['devices']}" + (" (CPU: no MFU)" if per != "GPU" else "")),
    ]
    step = s.get("step_time_s")
    if step:
        fields.append(("step time", f"median {step['median_s']:.4g} s (p90 {step['p90_s']:.4g}, min "
                                    f"{step['min_s']:.4g}, max {step['max_s']:.4g}; {step['iters']} steps after "
                                    f"{s['steps_warmup']} warm-up)"))
        fields.append(("tokens/s", f"{s['tokens_per_s']:,.0f} total, {s['tokens_per_s_per_device']:,.0f} per {per}"))
    flops = s["flops_per_token"]
    main, book = flops["palm"], flops["book"]
    text = f"{_si(main['model'], 'FLOP')} (palm: 6N_matmul {_si(main['dense'])} + attention {_si(main['attention'])})"
    if s.get("conventions_differ"):
        text += f"; book 6N: {_si(book['model'], 'FLOP')} ({(book['model'] / main['model'] - 1) * 100:+.1f}%)"
    fields.append(("FLOPs/token", text))
    if step:
        achieved = s["tflops_per_device"]
        fields.append(("achieved", f"{achieved['palm']:.4g} TFLOPS per {per}"
                       + (f" (book: {achieved['book']:.4g})" if s.get("conventions_differ") else "")))
        if s.get("mfu") is not None:
            fields.append(("MFU", f"{_pct(s['mfu'])} of {s['peak_tflops']:g} TFLOPS ({s['theoretical_source']})"
                           + (f"; book: {_pct(s['mfu_book'])}" if s.get("conventions_differ") else "")))
        else:
            fields.append(("MFU", f"inconclusive: {s.get('theoretical_source')}"))
        mamf = s.get("mamf")
        if mamf:
            fields.append(("MAMFU", f"{_pct(s['mamfu'])} of MAMF {mamf['tflops']:.4g} TFLOPS ({mamf['id']}, "
                                    f"{mamf['match']}"
                                    + (f"; {s['mamf_note']}" if s.get("mamf_note") else "") + ")"
                           + (f"; book: {_pct(s['mamfu_book'])}" if s.get("conventions_differ") else "")))
        else:
            fields.append(("MAMFU", f"none: {s.get('mamf_note')}"))
        if s.get("hfu") is not None:
            fields.append(("HFU", f"{_pct(s['hfu'])} (recomputation counted: {_si(main['hardware'], 'FLOP')}/token)"
                           + (f"; book 8N: {_pct(s['hfu_book'])}" if s.get("conventions_differ") else "")))
        elif s.get("activation_checkpointing"):
            fields.append(("HFU", f"inconclusive (no peak); hardware FLOPs {_si(main['hardware'], 'FLOP')}/token"))
    memory = s.get("memory") or {}
    if "peak_allocated_bytes" in memory:
        text = (f"peak allocated {format_bytes(memory['peak_allocated_bytes'])}, reserved "
                f"{format_bytes(memory['peak_reserved_bytes'])} of "
                f"{format_bytes(memory.get('device_total_bytes'))}")
        if memory.get("nvml_used_bytes") is not None:
            text += f"; NVML used {format_bytes(memory['nvml_used_bytes'])}"
        fields.append(("memory", text))
    elif memory:
        fields.append(("memory", f"host peak RSS {format_bytes(memory.get('host_peak_rss_bytes'))} (this process)"))
    loss = s.get("loss") or {}
    if loss.get("first") is not None:
        data = s.get("data") or {}
        what = data.get("pattern") or data.get("path") or ""
        fields.append(("loss", f"{loss['first']:.4g} -> {loss['last']:.4g} over {len(s.get('steps') or [])} steps"
                               + (f" ({what})" if what else "")))
    gpu = s.get("gpu_monitor") or {}
    if gpu.get("available") and gpu.get("sm_clock_mhz"):
        fields.append(("while timed", f"SM clock mean {gpu['sm_clock_mhz']['mean']:.0f} MHz (card max "
                                      f"{gpu.get('sm_clock_max_mhz') or 0:.0f}), power mean "
                                      f"{(gpu.get('power_w') or {}).get('mean') or 0:.0f} W"))
    width = max(len(k) for k, _ in fields)
    lines.extend(f"{k.ljust(width)}  {v}" for k, v in fields)
    b = s.get("breakdown")
    if b:
        lines.append("")
        lines.append(f"where the time goes ({b['steps']} profiled steps, {b['window_s']:.4g} s; {b['source']}):")
        labels = {"gemm": "GEMM", "attention": "attention", "elementwise_other": "elementwise/other",
                  "communication_exposed": "communication, not overlapped", "idle": "idle"}
        shown = [{"what": labels[k], "seconds": b["seconds"][k], "share": _pct(b["shares"][k])} for k in labels]
        lines.append(table(shown, ["what", "seconds", "share"]))
        extras = [f"communication in total {b['seconds']['communication_total']:.4g} s"
                  f" ({_pct(b['shares']['communication_total'])})", f"host data loading {b['data_host_s']:.4g} s"]
        lines.append("; ".join(extras) + f"; idle: {b['meaning']['idle']}")
    elif s.get("breakdown_error"):
        lines.append(f"breakdown: none ({s['breakdown_error']})")
    for note in model.get("notes") or []:
        lines.append(f"note: {note}")
    return "\n".join(lines)
