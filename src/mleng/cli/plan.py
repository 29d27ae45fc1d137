"""`mleng plan`: DDP / ZeRO-1/2/3 / FSDP for a training config on N GPUs: memory per GPU, collectives at measured
busbw against the step's compute time; communication-bound or not, by how much, and what changes it."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from mleng.errors import MlengError, UsageError

MULTIPLIERS = {"ddp": 2, "zero1": 2, "zero2": 2, "zero3": 3, "fsdp": 3}  # the book's, section 5.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "busbw comes from stored `mleng comm` runs at each collective's real payload (per bucket or per block, "
        "interpolated between stored sizes), compute time from a stored `mleng step` run or --tflops / --mfu. "
        "Examples: mleng plan 8b --gpus 8 --seq 8192 --gpu h200 --comm last --step last;  mleng plan 70b --gpus 64 "
        "--fsdp-only --busbw 40 --tflops 400;  mleng plan --params 80B --gpus 512 --seq 1024 --global-batch 3584 "
        "--recompute full --busbw 42.5 --tflops 250 --param-bytes 2 --grad-bytes 2 (the book's IDEFICS-80B check)")
    parser.add_argument("model", nargs="?", help="a preset of mleng step (tiny, 1b, 8b, 70b) or a local config.json")
    parser.add_argument("--params", metavar="N", help="no model: a parameter count (80B, 8e9): the book's formula "
                                                      "with one busbw, no per-layer payloads, no memory")
    parser.add_argument("--layers", type=int, help="cut (or grow) the model to N layers")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs in all (data parallel)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    parser.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per forward (default 1)")
    parser.add_argument("--grad-accum", type=int, help="micro-batches per step (default 1)")
    parser.add_argument("--global-batch", type=int, help="sequences per step over all GPUs; sets --grad-accum")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 (default) or float32")
    parser.add_argument("--recompute", default="none", help="none (default), selective, full")
    parser.add_argument("--optimizer", default="adamw", help="adamw (default), adamw8bit, sgd, adafactor")
    parser.add_argument("--strategy", help="comma-separated: ddp, zero1, zero2, zero3, fsdp (default: all)")
    parser.add_argument("--gpu", help="check each strategy's memory on this GPU (mleng specs name, e.g. h200)")
    comm = parser.add_argument_group("communication")
    comm.add_argument("--comm", metavar="ID", help="stored `mleng comm` run (default: the newest multi-rank one, "
                                                  "preferring the plan's rank count)")
    comm.add_argument("--busbw", type=float, metavar="GBPS", help="one busbw for every collective and size instead")
    comm.add_argument("--run-comm", action="store_true",
                      help="measure all_reduce, all_gather and reduce_scatter here first (`mleng comm`)")
    comm.add_argument("--nproc", type=int, help="--run-comm: local ranks (default: one per GPU, 2 on a CPU)")
    comm.add_argument("--param-bytes", type=int, help="bytes per parameter all-gathered (default: 2 in bf16)")
    comm.add_argument("--grad-bytes", type=int, help="bytes per gradient reduced (default 4: fp32, as mleng step)")
    comp = parser.add_argument_group("compute")
    comp.add_argument("--step", metavar="ID", help="stored `mleng step` run whose hardware TFLOPS per device is the "
                                                  "compute rate (default: the newest of the same shape and dtype)")
    comp.add_argument("--tflops", type=float, help="achieved TFLOPS per GPU without communication instead")
    comp.add_argument("--mfu", type=float, help="a fraction of the MAMF (--mamf) or of --gpu's dense peak")
    comp.add_argument("--mamf", metavar="ID", help="stored `mleng mamf` run for --mfu")
    parser.add_argument("--coefficients", metavar="FILE", help="activation coefficients file (mleng memory)")


def _param_count(text: str) -> float:
    raw = text.strip().upper()
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(raw[-1:], 1.0)
    number = raw[:-1] if raw[-1:] in ("K", "M", "B", "G", "T") else raw
    try:
        value = float(number) * scale
    except ValueError:
        raise UsageError(f"--params {text!r} is not a parameter count (e.g. 80B, 8e9)") from None
    if not value > 0 or value != value:
        raise UsageError(f"--params {text}: must be positive")
    return value


def _strategies(text: str | None) -> tuple[str, ...]:
    from mleng.plan.comm_model import STRATEGIES

    if not text:
        return STRATEGIES
    names = tuple(t.strip().lower() for t in text.split(",") if t.strip())
    bad = [n for n in names if n not in STRATEGIES]
    if bad or not names:
        raise UsageError(f"--strategy {text}: known: {', '.join(STRATEGIES)}")
    return names


def _positive(args) -> None:
    for flag, value in (("--gpus", args.gpus), ("--gpus-per-node", args.gpus_per_node), ("--seq", args.seq),
                        ("--micro-batch", args.micro_batch), ("--grad-accum", args.grad_accum),
                        ("--nproc", args.nproc), ("--param-bytes", args.param_bytes),
                        ("--grad-bytes", args.grad_bytes)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} {value}: must be at least 1")
    for flag, value in (("--busbw", args.busbw), ("--tflops", args.tflops)):
        if value is not None and not value > 0:
            raise UsageError(f"{flag} {value:g}: must be positive")
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise UsageError(f"--mfu {args.mfu:g}: a fraction of the peak, above 0 and at most 1")


def _store():
    from mleng.results.store import Store

    return Store(create=False)


def _compute(args, arch, dtype: str):
    from mleng.plan.planner import Compute

    if args.tflops:
        return Compute(args.tflops, "given with --tflops: achieved, without communication")
    if args.mfu is not None:
        if args.mamf:
            with _store() as store:
                m = store.get(args.mamf)
            if m.kind != "mamf" or not isinstance(m.summary.get("value"), (int, float)):
                raise UsageError(f"run {m.id} is not an `mleng mamf` run with a TFLOPS headline")
            return Compute(args.mfu * float(m.summary["value"]),
                           f"--mfu {args.mfu:g} x the MAMF {m.summary['value']:.1f} TFLOPS of stored run {m.id}")
        if not args.gpu:
            raise UsageError("--mfu needs --mamf ID or --gpu NAME (whose dense peak it multiplies)")
        from mleng.specs import lookup_accelerator

        acc = lookup_accelerator(args.gpu)
        peak = acc.peak_tflops("bf16" if dtype != "float32" else "tf32")
        if not peak:
            raise UsageError(f"{acc.name} has no published dense rate for {dtype}")
        return Compute(args.mfu * peak, f"--mfu {args.mfu:g} x {acc.name}'s dense peak {peak:g} TFLOPS (spec)")
    return _compute_from_step(args, arch, dtype)


def _compute_from_step(args, arch, dtype: str):
    from mleng.plan.planner import Compute

    with _store() as store:
        if not store.exists:
            raise UsageError("no compute rate: no stored `mleng step` run",
                             hint="run `mleng step` on the target GPU, or give --tflops X or --mfu F")
        if args.step:
            rec = store.get(args.step).to_dict()
            if rec["kind"] != "step":
                raise UsageError(f"run {rec['id']} is a {rec['kind']} run, not `mleng step`")
        else:
            rec = None
            for m in store.iter_records("step"):
                r = m.to_dict()
                model = (r.get("params") or {}).get("model") or {}
                same = arch is not None and all(model.get(k) == getattr(arch, k) for k in
                                                ("dim", "n_heads", "n_kv_heads", "ffn_dim"))
                if same and (r.get("params") or {}).get("dtype") == dtype and (r.get("summary") or {}).get(
                        "tokens_per_s_per_device"):
                    rec = r
                    break
            if rec is None:
                raise UsageError(f"no stored `mleng step` run of this shape in {dtype}",
                                 hint="run `mleng step --model ... --layers 2` on the target GPU, or give --step ID, "
                                      "--tflops X or --mfu F")
    s = rec.get("summary") or {}
    rate = s.get("tokens_per_s_per_device")
    fpt = ((s.get("flops_per_token") or {}).get("palm") or {}).get("hardware")
    if not rate or not fpt:
        raise UsageError(f"step run {rec['id']} has no tokens/s per device (did it time any step?)")
    tflops = rate * fpt / 1e12
    world = (rec.get("params") or {}).get("world_size") or 1
    src = (f"stored mleng step run {rec['id']} ({s.get('model')}, seq {s.get('seq')}, {s.get('device_name')}, "
           f"{world} rank(s)): {tflops:.1f} hardware TFLOPS per device")
    if world > 1:
        src += "; its step time includes its own exposed communication"
    return Compute(tflops, src)


def _curves(args, gpus: int, payloads: list[float]):
    from mleng.plan import comm_model

    if args.busbw:
        return comm_model.constant_curves(args.busbw, f"--busbw {args.busbw:g} GB/s given for every size")
    if args.run_comm:
        return comm_model.curves_from_record(_run_comm(args, payloads))
    with _store() as store:
        if not store.exists:
            raise UsageError("no measured busbw: no stored `mleng comm` run",
                             hint="run `mleng comm --op all_reduce,all_gather,reduce_scatter`, or --run-comm, "
                                  "or give --busbw GBPS")
        rec = comm_model.find_comm_record(store, gpus, args.comm)
    if rec is None:
        raise UsageError("no stored multi-rank `mleng comm` run",
                         hint="run `mleng comm --op all_reduce,all_gather,reduce_scatter`, or --run-comm, or --busbw")
    return comm_model.curves_from_record(rec)


def _run_comm(args, payloads: list[float]) -> dict:
    """`mleng comm` as a child over the payload sizes this plan sends; its stored record."""
    lo = 2 ** max(10, int(min(payloads)).bit_length() - 1)
    hi = 2 ** int(max(payloads) - 1).bit_length()
    argv = [sys.executable, "-m", "mleng", "comm", "--op", "all_reduce,all_gather,reduce_scatter",
            "-b", str(lo), "-e", str(hi), "-f", "4", "--json"]
    if args.nproc:
        argv += ["--nproc", str(args.nproc)]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        line = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise MlengError(f"--run-comm: `mleng comm` failed: {line}")
    try:
        out = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise MlengError("--run-comm: `mleng comm --json` printed no JSON") from None
    return out.get("record", out)


def result(args: argparse.Namespace) -> dict:
    from mleng.plan import comm_model

    _positive(args)
    strategies = _strategies(args.strategy)
    if args.model and args.params:
        raise UsageError("give a model or --params, not both")
    if not args.model and not args.params:
        raise UsageError("give a model (a preset or a config.json) or --params N")
    if args.params:
        return _book_form(args, strategies)
    from mleng.plan.arch import resolve
    from mleng.plan.memory import DTYPES, RECOMPUTE, load_coefficients
    from mleng.plan.planner import PlanSetup, _units, grad_accum_for, plan

    arch = resolve(args.model, args.layers)
    dtype = DTYPES.get(args.dtype.lower())
    if dtype is None:
        raise UsageError(f"--dtype {args.dtype}: bfloat16 or float32")
    if args.recompute not in RECOMPUTE:
        raise UsageError(f"--recompute {args.recompute}: known: {', '.join(RECOMPUTE)}")
    accum = grad_accum_for(args.global_batch, args.grad_accum, args.micro_batch, args.gpus)
    setup = PlanSetup(gpus=args.gpus, seq=args.seq, micro_batch=args.micro_batch, grad_accum=accum, dtype=dtype,
                      recompute=args.recompute, optimizer=args.optimizer.lower(), gpu=args.gpu,
                      gpus_per_node=args.gpus_per_node, param_bytes=args.param_bytes, grad_bytes=args.grad_bytes,
                      strategies=strategies)
    units = _units(arch)
    payloads = [u * 2 for u in units] + [comm_model.DDP_BUCKET_BYTES]
    curves = _curves(args, args.gpus, payloads)
    compute = _compute(args, arch, dtype)
    coeff = load_coefficients(__import__("pathlib").Path(args.coefficients)) if args.coefficients else None
    return plan(arch, setup, curves, compute, coeff)


def _book_form(args, strategies) -> dict:
    from mleng.plan.comm_model import book_feasibility

    params = _param_count(args.params)
    if not args.busbw:
        raise UsageError("--params uses the book's formula with one throughput: give --busbw GBPS")
    if not args.tflops:
        raise UsageError("--params needs the achieved TFLOPS per GPU without communication: give --tflops X")
    if args.global_batch is None:
        raise UsageError("--params needs --global-batch (sequences per step over all GPUs)")
    n_bytes = args.param_bytes or 2
    n_passes = 4 if args.recompute == "full" else 3
    rows = []
    for strategy in strategies:
        r = book_feasibility(MULTIPLIERS[strategy], n_bytes, params / 1e9, args.busbw, n_passes, args.seq,
                             args.global_batch, args.gpus, args.tflops)
        rows.append({"strategy": strategy, "multiplier": MULTIPLIERS[strategy],
                     **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}})
    return {"form": "book", "parameters": params, "gpus": args.gpus, "rows": rows,
            "formula": "comms = multiplier x n_bytes x params_B / busbw_GBps; compute = n_passes x n_bytes x params_B "
                       "x seqlen x global_batch / (gpus x 1e3 x tflops) (the book, section 5.5)",
            "inputs": {"n_bytes": n_bytes, "n_passes": n_passes, "busbw_gbps": args.busbw, "tflops": args.tflops,
                       "seq": args.seq, "global_batch": args.global_batch}}


def run(args: argparse.Namespace) -> int:
    from mleng.cli.render import emit

    out = result(args)
    emit(args, out, render)
    return 0


def render(out: dict) -> str:
    from mleng.cli.render import table

    if out.get("form") == "book":
        i = out["inputs"]
        lines = [f"{out['parameters'] / 1e9:g} B parameters on {out['gpus']} GPUs, the book's ZeRO feasibility check "
                 f"(busbw {i['busbw_gbps']:g} GB/s, {i['tflops']:g} TFLOPS, {i['n_bytes']} B/param, "
                 f"{i['n_passes']} passes, seq {i['seq']}, global batch {i['global_batch']}):",
                 table([{"strategy": r["strategy"], "multiplier": r["multiplier"], "comms s": r["comms_s"],
                         "compute s": r["compute_s"], "comm-bound": "yes" if r["comm_bound"] else "no",
                         "exposed s": r["exposed_s"]} for r in out["rows"]],
                       ["strategy", "multiplier", "comms s", "compute s", "comm-bound", "exposed s"]),
                 f"formula: {out['formula']}"]
        return "\n".join(lines)
    s = out["setup"]
    lines = [f"{out['model']}: {out['parameters'] / 1e9:.3g} B parameters on {out['gpus']} GPUs ({out['nodes']} "
             f"node{'s' if out['nodes'] > 1 else ''}); seq {s['seq']} x micro-batch {s['micro_batch']} x grad accum "
             f"{s['grad_accum']}, {s['dtype']}, recompute {s['recompute']}", ""]
    rows = [{"strategy": r["strategy"], "comm s": r["comm_s"], "compute s": r["compute_s"],
             "bound": "COMM" if r["comm_bound"] else "compute", "exposed s": r["exposed_s"],
             "GB sent": round(r["bytes_per_step"] / 1e9, 2), "GiB/GPU": r["memory_gib"],
             "fits": "-" if r["fits"] is None else ("yes" if r["fits"] else "NO"),
             "GPUs needed": r["gpus_needed"] if r["gpus_needed"] is not None else "-"}
            for r in out["strategies"]]
    lines.append(table(rows, ["strategy", "comm s", "compute s", "bound", "exposed s", "GB sent", "GiB/GPU", "fits",
                              "GPUs needed"]))
    lines.append("")
    lines.append("collectives per step (per GPU):")
    for r in out["strategies"]:
        for c in r["collectives"]:
            lines.append(f"  {r['strategy']:<6} {c['op']:<15} {c['size_bytes'] / 2**20:10.1f} MiB x {c['count']:<7g} "
                         f"at {c['busbw_gbps']:8.2f} GB/s busbw ({c['busbw_how']}): {c['time_s']:.4f} s  {c['what']}")
    lines.append("")
    lines.append("verdict" + (f" (best: {out['best']})" if out["best"] else "") + ":")
    lines.extend(f"  - {v}" for v in out["verdict"])
    lines.append("")
    lines.append("assumptions (each a flag):")
    lines.extend(f"  - {a}" for a in out["assumptions"])
    return "\n".join(lines)
