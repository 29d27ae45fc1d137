"""`mleng upgrade`: does moving from one GPU to another pay for itself."""

from __future__ import annotations

import argparse

from mleng.cli.render import emit, table
from mleng.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="from_gpu", required=True, help="the GPU you have, e.g. h200")
    parser.add_argument("--to", dest="to_gpu", required=True, help="the GPU you consider, e.g. b200")
    parser.add_argument("--price-from", type=float, required=True, help="$ per GPU-hour of --from")
    parser.add_argument("--price-to", type=float, required=True, help="$ per GPU-hour of --to")
    parser.add_argument("--workload", choices=["dense", "attention"], default="dense",
                        help="dense: matmul-bound; attention: transformer training whose attention share "
                             "grows with --seq-len (default: dense)")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--model-params", type=_param_count, default=8e9,
                        help="parameter count, e.g. 8e9, 70B, 405B (default 8e9)")
    parser.add_argument("--gpus", type=int, default=8,
                        help="GPUs the model state is sharded over (ZeRO-3/FSDP) for the memory estimate (default 8)")
    parser.add_argument("--model", help="a mleng step preset or local config.json: gate 1 from `mleng memory` at "
                                        "--gpus/--zero/--recompute instead of the book's 8B fit scaled")
    parser.add_argument("--zero", type=int, help="with --model: ZeRO stage over --gpus (default 0: no sharding)")
    parser.add_argument("--recompute", default="full", help="with --model: none, selective, full (default full)")
    parser.add_argument("--micro-batch", type=int, default=1, help="with --model: sequences per GPU (default 1)")
    parser.add_argument("--hidden", type=int, help="hidden size (default: estimated from --model-params)")
    parser.add_argument("--layers", type=int, help="layer count (default: estimated from --model-params)")
    parser.add_argument("--dtype", default="bf16", help="compute dtype for the rates (default bf16)")
    parser.add_argument("--need-dtype", help="a dtype the recipe cannot do without (e.g. fp4): gate 1")
    parser.add_argument("--mfu", type=float,
                        help="model FLOPs utilization on --from, for cost per million tokens (default 0.40)")
    parser.add_argument("--from-step", metavar="ID",
                        help="stored `mleng step` run measured on --from: its MFU replaces the assumed --mfu")
    parser.add_argument("--memory-fixed-gib", type=float,
                        help="per-GPU memory independent of seq_len (default: the book's 8B ZeRO-3 config, scaled)")
    parser.add_argument("--memory-per-token-gib", type=float, help="per-GPU memory per token of seq_len")
    parser.add_argument("--from-run", help="stored `mleng mamf` run measured on --from")
    parser.add_argument("--to-run", help="stored `mleng mamf` run measured on --to")


def _param_count(text: str) -> float:
    """8e9, 70B, 405b, 1.5T, 7M -> a parameter count."""
    import argparse as _argparse

    raw = text.strip().upper()
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(raw[-1:], 1.0)
    number = raw[:-1] if raw[-1:] in "KMBGT" and raw else raw
    try:
        value = float(number) * scale
    except ValueError:
        raise _argparse.ArgumentTypeError(f"{text!r} is not a parameter count (e.g. 8e9, 70B, 405B)") from None
    return value


def _mamf_value(run_id: str | None) -> float | None:
    if not run_id:
        return None
    from mleng.results.store import Store

    with Store(create=False) as store:
        m = store.get(run_id)
    if m.kind != "mamf" or not isinstance(m.summary.get("value"), (int, float)):
        raise UsageError(f"run {m.id} is a {m.kind} run without a TFLOPS headline",
                         hint="pass the id of an `mleng mamf` run (`mleng results list --kind mamf`)")
    return float(m.summary["value"])


def _step_mfu(run_id: str, old, dtype: str) -> tuple[float, str]:
    """The measured MFU of a stored `mleng step` run on the --from GPU, and where it came from."""
    from mleng.measure.dtypes import torch_name
    from mleng.results.store import Store
    from mleng.specs import lookup_accelerator

    with Store(create=False) as store:
        m = store.get(run_id)
    hint = "pass the id of a `mleng step` run made on the --from GPU (`mleng results list --kind step`)"
    if m.kind != "step":
        raise UsageError(f"run {m.id} is a {m.kind} run, not a `mleng step` run", hint=hint)
    summary = m.summary
    mfu = summary.get("mfu")
    if not isinstance(mfu, (int, float)) or not 0 < mfu <= 1:
        raise UsageError(f"run {m.id} has no MFU ({summary.get('device_name') or 'its device'} has no sourced peak, "
                         "or it ran on a CPU)", hint=hint)
    try:
        device = lookup_accelerator(str(summary.get("device_name")))
    except UsageError:
        device = None
    if device is None or device.key != old.key:
        raise UsageError(f"run {m.id} ran on {summary.get('device_name')}, not on {old.name} (--from)", hint=hint)
    if torch_name(summary.get("dtype")) != torch_name(dtype):
        raise UsageError(f"run {m.id} measured MFU against the {summary.get('dtype')} peak; --dtype is {dtype}",
                         hint=f"pass --dtype {summary.get('dtype')} or a step run made at {dtype}")
    source = (f"mleng step run {m.id} ({summary.get('model')}, seq {summary.get('seq')}, {summary.get('parallel')}, "
              f"compile {'on' if summary.get('compile') else 'off'}, {summary.get('world_size')} rank(s) on {summary.get('device_name')}; "
              f"{summary.get('flop_convention')} FLOP convention)")
    return float(mfu), source


def run(args: argparse.Namespace) -> int:
    decision = result(args)
    emit(args, decision, render)
    return 0


def result(args: argparse.Namespace) -> dict:
    """What `mleng upgrade --json` prints: both gates, the cost, the verdict and its assumptions."""
    from mleng.decide.upgrade import Workload, decide
    from mleng.specs import lookup_accelerator

    if (args.from_run is None) != (args.to_run is None):
        raise UsageError("--from-run and --to-run go together", hint="give both stored MAMF runs, or neither")
    old = lookup_accelerator(args.from_gpu)
    mfu, mfu_source = (args.mfu if args.mfu is not None else 0.40), None
    if args.from_step:
        if args.mfu is not None:
            raise UsageError("--mfu and --from-step both give the MFU", hint="keep one: the measured run or the number")
        mfu, mfu_source = _step_mfu(args.from_step, old, args.dtype)
    workload = Workload(kind=args.workload, seq_len=args.seq_len, model_params=args.model_params,
                        hidden=args.hidden, layers=args.layers, dtype=args.dtype, need_dtype=args.need_dtype,
                        mfu=mfu, mfu_source=mfu_source, memory_fixed_gib=args.memory_fixed_gib,
                        memory_per_token_gib=args.memory_per_token_gib, gpus=args.gpus, model=args.model,
                        zero=args.zero, recompute=args.recompute, micro_batch=args.micro_batch)
    return decide(old, lookup_accelerator(args.to_gpu), args.price_from,
                  args.price_to, workload, _mamf_value(args.from_run), _mamf_value(args.to_run))


def render(result: dict) -> str:
    gate1, gate2, cost = result["gate1_capability"], result["gate2_throughput"], result["cost"]
    lines = [f"{result['from']} -> {result['to']} ({result['dtype']}, {result['workload']['kind']} workload, "
             f"seq_len {result['workload']['seq_len']})", "",
             "gate 1, capability: " + ("PASSED" if gate1["passed"] else
                                       "neither GPU fits the workload" if not (gate1["fits"]["from"] or gate1["fits"]["to"])
                                       else f"{result['to']} cannot hold the workload" if not gate1["fits"]["to"]
                                       else "nothing the old GPU cannot do")]
    lines += [f"  - {r}" for r in gate1["reasons"]]
    lines.append(f"  memory needed ~{gate1['memory_needed_gib']} GiB/GPU; usable "
                 f"{gate1['usable_memory_gib']['from']} -> {gate1['usable_memory_gib']['to']} GiB; "
                 f"longest seq_len that fits {gate1['max_seq_len']['from']} -> {gate1['max_seq_len']['to']}")
    lines += ["", "gate 2, throughput and cost:"]
    rows = [
        {"measure": "speedup from spec peak", "value": gate2["spec_speedup"]},
        {"measure": "speedup from stored MAMF runs", "value": gate2["mamf_speedup"]},
        {"measure": "memory bandwidth ratio", "value": gate2["memory_bandwidth_speedup"]},
        {"measure": "attention share of step FLOPs", "value": gate2["attention_share"]},
        {"measure": f"speedup used ({gate2['speedup_source']}, workload-aware)", "value": gate2["speedup"]},
        {"measure": "price ratio", "value": cost["price_ratio"]},
        {"measure": "$ per million tokens, from", "value": cost["cost_per_million_tokens"]["from"]},
        {"measure": "$ per million tokens, to", "value": cost["cost_per_million_tokens"]["to"]},
        {"measure": "$ per PFLOP, from", "value": cost["cost_per_pflop"]["from"]},
        {"measure": "$ per PFLOP, to", "value": cost["cost_per_pflop"]["to"]},
        {"measure": "break-even price of --to ($/GPU-hour)", "value": cost["break_even_price_to"]},
    ]
    lines.append(table(rows, ["measure", "value"]))
    lines += ["", f"verdict: {result['verdict'].upper()}"]
    lines += [f"  - {r}" for r in result["reasons"]]
    lines += ["", "assumptions (each a flag):"]
    lines += [f"  - {a}" for a in result["assumptions"]]
    return "\n".join(lines)
