"""`mleng doctor`: fingerprint, health checks, quick measurements against the specs, findings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Callable

from mleng.doctor import checks, measured
from mleng.doctor.findings import SEVERITY_RANK, Finding, inconclusive, worst
from mleng.results.record import Measurement

def _measurement_plan(tier: str, has_gpu: bool, checkpoint_dir: str) -> list[tuple[str, list[str], float]]:
    """(name, mleng argv, timeout_s) per quick measurement, named after the command it runs (its finding and its
    key in summary["measurements"] too); sizes grow with the tier."""
    # On a GPU the budget counts CUDA start-up too: below ~20 s the search barely leaves its coarse sweep.
    mamf_seconds = {"quick": 15 if has_gpu else 8, "default": 30 if has_gpu else 20, "full": 60}[tier]
    mamf = ["mamf", "--max-seconds", str(mamf_seconds)]
    if not has_gpu:
        mamf += ["--device", "cpu", "--max-dim", "1024" if tier != "full" else "2048"]
    comm_max = {"quick": "16M", "default": "64M", "full": "4G"}[tier] if has_gpu else \
        {"quick": "4M", "default": "16M", "full": "64M"}[tier]
    comm = ["comm", "--op", "all_reduce" if tier != "full" else "all", "-b", "1M", "-e", comm_max,
            "--iters", "10" if tier != "full" else "20", "--timeout", "60"]
    membw = ["membw"] + (["--size", "256M"] if not has_gpu and tier != "full" else [])
    plan = [("mamf", mamf, mamf_seconds + 120), ("comm", comm, 240), ("membw", membw, 180)]
    if tier != "quick":
        io_size = {"default": "256MiB", "full": "2GiB"}[tier]
        plan.append(("io", ["io", checkpoint_dir, "--size", io_size, "--jobs", "2", "--duration", "3"], 240))
    return plan


def run_mleng_json(argv: list[str], timeout_s: float) -> dict[str, Any]:
    """Run one mleng command in its own process, so a crash or hang there cannot take the doctor down."""
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "mleng", *argv, "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"error": f"did not finish within {timeout_s:.0f} s", "elapsed_s": time.monotonic() - started}
    except KeyboardInterrupt:
        # Stopped (Ctrl-C, SIGTERM): pass it on as SIGTERM, so the measurement ends the way it does when
        # run alone (its ranks stopped, its rows kept and stored), instead of being killed mid-write.
        import signal

        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    elapsed = time.monotonic() - started
    try:
        record = json.loads(done.stdout)
    except ValueError:
        message = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return {"error": message, "exit_code": done.returncode, "elapsed_s": elapsed}
    return {"record": record, "exit_code": done.returncode, "elapsed_s": elapsed,
            "stderr_tail": done.stderr.strip().splitlines()[-1:]}


def _load_samples(record: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Per-GPU clock under load, from the NVML monitor of a mamf run (the timed phases, not warm-up)."""
    summary = record.get("summary") or {}
    monitor = summary.get("gpu_monitor_measuring") or summary.get("gpu_monitor") or {}
    if not monitor.get("available") or not monitor.get("sm_clock_mhz"):
        return {}
    device = str(summary.get("device") or "cuda:0")
    index = int(device.rsplit(":", 1)[-1]) if device.rsplit(":", 1)[-1].isdigit() else 0
    return {index: {"sm_clock_mhz_mean": monitor["sm_clock_mhz"]["mean"],
                    "sm_clock_max_mhz": monitor.get("sm_clock_max_mhz"),
                    "throttle_reasons": sorted(monitor.get("throttle_reasons") or {})}}


def _vendor(fp: dict[str, Any]) -> str | None:
    devices = checks.gpu_devices(fp)
    if not devices:
        return None
    name = str(devices[0].get("name", "")).lower()
    return "amd" if "amd" in name or "instinct" in name else ("intel" if "gaudi" in name else "nvidia")


def judge_measurement(name: str, outcome: dict[str, Any], fp: dict[str, Any], checkpoint_dir: str) -> list[Finding]:
    if "record" not in outcome:
        return [inconclusive(name, f"{name} measurement could not run: {outcome.get('error')}")]
    record = outcome["record"]
    summary = dict(record.get("summary") or {})
    if record.get("status") == "failed" or summary.get("value") is None and name != "io":
        row_error = next((r.get("error") for r in record.get("rows") or [] if r.get("error")), None)
        return [inconclusive(name, f"{name} measurement failed: {record.get('error') or row_error or 'no result'}")]
    if name == "mamf":
        summary.setdefault("dtype", (record.get("params") or {}).get("dtype"))
        return [measured.check_matmul(summary, _vendor(fp))]
    if name == "comm":
        if (record.get("params") or {}).get("world_size") == 1:
            return [inconclusive("comm", "one rank only: a collective crosses no link (one GPU on this node)",
                                 measured=summary.get("value"))]
        return [measured.check_busbw(summary)]
    if name == "membw":
        return [measured.check_membw(summary)]
    if name == "io":
        return [measured.check_storage(summary.get("ckpt_save_gbps"), checkpoint_dir)]
    return []


def kernel_log_findings(fp: dict[str, Any], local: bool, since: str | None,
                        kernel_log_path: str | None) -> list[Finding]:
    """The kernel-log checks on this machine's log, or on a saved one (--kernel-log FILE)."""
    from mleng.doctor.kernel_log import check_kernel_log
    from mleng.machine import kernel_log

    if kernel_log_path:
        log = kernel_log.read_saved_log(kernel_log_path)
    elif local:
        log = kernel_log.read_kernel_log()
    else:
        host = (fp.get("host") or {}).get("hostname") or "the fingerprint's host"
        return [checks.skipped("kernel_log", f"not read: the kernel log is read on the machine itself, not from "
                               f"{host}'s fingerprint; run the doctor there, or pass its log with --kernel-log FILE "
                               "(sudo dmesg > FILE)")]
    window = kernel_log.parse_since(since) if since else None
    if window and log.get("saved") and window["kind"] != "boot":
        # A saved log ends when it was saved: a duration counts back from its last line; its boot's date is unknown.
        stamps = [t for t, _text in log.get("lines") or [] if t is not None]
        if window["kind"] == "duration" and stamps:
            window = kernel_log.parse_since(since, uptime=max(stamps))
            window["label"] += " of the saved log"
        else:
            window = {"label": f"{window['label']} not applied: the saved log does not say when it was booted",
                      "since_boot_s": None, "kind": "boot"}
    return check_kernel_log(log, fp, window)


def run_burn_subprocess(seconds: float, env_fault: str | None = None) -> dict[str, Any]:
    """The burn-in in its own process (python -m mleng.doctor.burn): a GPU that hangs or faults cannot take
    the doctor, and the kernel-log check after it, down with it."""
    from mleng.doctor.burn import FAULT_ENV

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUBLAS_WORKSPACE_CONFIG":
           os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8")}
    if env_fault:
        env[FAULT_ENV] = env_fault
    timeout_s = seconds * 1.5 + 180  # start-up, the host copies and the reference tile come on top
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "mleng.doctor.burn", "--seconds", str(seconds)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"error": f"the burn-in did not finish within {timeout_s:.0f} s: a device hung (see the kernel log)"}
    except KeyboardInterrupt:
        proc.kill()
        proc.communicate()
        raise
    try:
        result = json.loads(stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = (stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return {"error": f"the burn-in failed: {tail}", "exit_code": proc.returncode}
    result["wall_s"] = round(time.monotonic() - started, 2)
    return result


def run_doctor(tier: str = "default", expect_gpus: int | None = None, checkpoint_dir: str | None = None,
               measure: bool = True, fingerprint: dict[str, Any] | None = None,
               on_step: Callable[[str], None] | None = None, local: bool | None = None,
               cpus: str | None = None, since: str | None = None,
               kernel_log_path: str | None = None, history: bool = True,
               burn_s: float | None = None) -> Measurement:
    """Everything `mleng doctor` does, as one Measurement of kind "doctor" whose rows are findings."""
    # local: the fingerprint is this machine's, so checks that read the machine itself (its disk) apply
    local = fingerprint is None if local is None else local
    checkpoint_dir = checkpoint_dir or os.getcwd()
    step = on_step or (lambda _text: None)
    step("fingerprint")
    if fingerprint is None:
        from mleng.machine.fingerprint import collect

        fingerprint = collect()
    record = Measurement.start("doctor", params={"tier": tier, "expect_gpus": expect_gpus,
                                                 "checkpoint_dir": checkpoint_dir, "measure": measure,
                                                 "cpus": cpus, "local": local, "since": since or "boot",
                                                 "kernel_log": kernel_log_path, "burn_s": burn_s},
                               machine=fingerprint)
    findings: list[Finding] = []
    measurements: dict[str, str] = {}
    load_samples: dict[int, dict[str, Any]] = {}
    burn_result: dict[str, Any] | None = None
    has_gpu = bool(checks.gpu_devices(fingerprint))
    interrupted = False
    try:
        if measure:
            gpu_count = len(checks.gpu_devices(fingerprint))
            for name, argv, timeout_s in _measurement_plan(tier, has_gpu, checkpoint_dir):
                if name == "comm" and gpu_count == 1:
                    # One rank's all-reduce moves no data: there is no rate to judge (comm says so too).
                    findings.append(checks.skipped("comm", "one GPU: no link between GPUs to measure; "
                                                   "run the doctor on a node with several GPUs, or `mleng check`"))
                    continue
                step(f"measure {name}: mleng {' '.join(argv)}")
                outcome = run_mleng_json(argv, timeout_s)
                if "record" in outcome:
                    measurements[name] = outcome["record"].get("id")
                    if name == "mamf":
                        load_samples = _load_samples(outcome["record"])
                findings += judge_measurement(name, outcome, fingerprint, checkpoint_dir)
        if burn_s and local:
            from mleng.doctor.burn import burn_findings

            step(f"burn-in: {burn_s:.0f} s of bf16 matmuls on every GPU, results checked")
            burn = run_burn_subprocess(burn_s)
            if "error" in burn:
                findings.append(inconclusive("burn_correctness", burn["error"]))
            else:
                burn_result = burn
                findings += burn_findings(burn)
        elif burn_s:
            findings.append(checks.skipped("burn_correctness", "the burn-in runs on the machine itself, not on "
                                           "another node's fingerprint"))
    except KeyboardInterrupt:
        interrupted = True
    step("checks")
    findings += checks.check_gpu_count(fingerprint, expect_gpus)
    findings += checks.check_clocks(fingerprint, load_samples)
    findings += checks.check_numa_affinity(fingerprint, cpus)
    for name in ("ecc", "pcie_link", "nvlink", "nccl_env", "dev_shm", "memlock"):
        findings += checks.FINGERPRINT_CHECKS[name](fingerprint)
    from mleng.doctor.config import CONFIG_CHECKS
    from mleng.doctor.counters import COUNTER_CHECKS

    from mleng.doctor.consistency import check_firmware_within_node

    for check in (*COUNTER_CHECKS.values(), *CONFIG_CHECKS.values(), check_firmware_within_node):
        findings += check(fingerprint)
    if local:
        from mleng.doctor.host import check_disk_space, check_swap

        findings += checks.check_disk(checkpoint_dir)
        findings += check_swap() + check_disk_space()
    else:
        host = (fingerprint.get("host") or {}).get("hostname") or "the fingerprint's host"
        findings.append(checks.skipped("checkpoint_disk", f"not checked: the disk is read from this machine, "
                                       f"not from {host}; run the doctor there"))
    step("kernel log")
    findings += kernel_log_findings(fingerprint, local, since, kernel_log_path)
    from mleng.doctor.history import attach_gpu_uuids, history_findings

    attach_gpu_uuids(findings, fingerprint)
    if history:
        step("GPU history")
        findings += history_findings(findings, fingerprint, current_id=record.id)
    findings.sort(key=lambda f: SEVERITY_RANK[f.severity])
    record.rows = [f.to_row() for f in findings]
    counts = {s: sum(f.severity == s for f in findings) for s in ("fail", "warn", "ok", "inconclusive", "skipped")}
    record.summary = {"verdict": worst(findings), "value": None, "unit": "", "counts": counts,
                      "measurements": measurements,
                      "handbook": sorted({h for f in findings if f.severity in ("fail", "warn") for h in f.handbook})}
    if burn_result is not None:
        record.summary["burn"] = burn_result
    if interrupted:
        from mleng import signals

        return record.finish("interrupted", f"interrupted by {signals.describe()}: the measurements not yet run "
                                            "are missing; the checks ran")
    return record.finish("complete")
