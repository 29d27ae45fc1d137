"""Background NVML sampler: SM/memory clock, power, temperature and throttle reasons during a run."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

from mleng.machine.nvml import SLOWDOWN_REASONS, decode_clock_event_reasons, gpu_handle, nvml

# A run whose mean SM clock is this far under the card's max clock is reported as running below max.
BELOW_MAX_TOLERANCE = 0.02

# Reasons that mean the clock was held down by power or heat, not by an idle GPU or a setting: the
# names and the decoder are machine.nvml's, the one NVML layer the doctor uses too.
LIMITING_REASONS = SLOWDOWN_REASONS

SAMPLE_FIELDS = ("sm_clock_mhz", "mem_clock_mhz", "power_w", "temperature_c")


def decode_throttle_reasons(mask: int) -> list[str]:
    return decode_clock_event_reasons(mask) or []


class GpuMonitor:
    """Samples one NVIDIA GPU about ten times a second in a daemon thread.

    Construct, then `start()`; `stop()` ends the thread. When NVML cannot be used (no driver,
    not an NVIDIA device), `available` is False, `reason` says why, and every method is a no-op.
    """

    def __init__(self, *, index: int | None = None, uuid: str | None = None, interval_s: float = 0.1):
        self.interval_s = interval_s
        self.available = False
        self.reason: str | None = None
        self.sm_clock_max_mhz: float | None = None
        self.name: str | None = None
        self.samples: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle = None
        self._nvml = None
        self._t0 = time.monotonic()
        self._open(index, uuid)

    def _open(self, index: int | None, uuid: str | None) -> None:
        pynvml, reason = nvml()
        if pynvml is None:
            self.reason = f"NVML unavailable: {reason}"
            return
        try:
            # By UUID when the caller knows which card torch uses: under CUDA_VISIBLE_DEVICES torch's
            # index is not NVML's, so a missing UUID is an unavailable monitor, never another GPU.
            self._handle = gpu_handle(pynvml, uuid=uuid, index=index)
            name = pynvml.nvmlDeviceGetName(self._handle)
            self.name = name.decode() if isinstance(name, bytes) else name
            self.sm_clock_max_mhz = float(pynvml.nvmlDeviceGetMaxClockInfo(self._handle, pynvml.NVML_CLOCK_SM))
        except pynvml.NVMLError as exc:
            self.reason = f"NVML could not open the GPU ({'uuid ' + uuid if uuid else f'index {index}'}): {exc}"
            return
        self._nvml = pynvml
        self.available = True

    def start(self) -> "GpuMonitor":
        if self.available and self._thread is None:
            self._t0 = time.monotonic()
            self._thread = threading.Thread(target=self._loop, name="mleng-gpu-monitor", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None

    def __enter__(self) -> "GpuMonitor":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _loop(self) -> None:
        while not self._stop.is_set():
            sample = self._read()
            if sample is not None:
                with self._lock:
                    self.samples.append(sample)
            self._stop.wait(self.interval_s)

    def _read(self) -> dict[str, Any] | None:
        nvml, handle = self._nvml, self._handle
        sample: dict[str, Any] = {"t_s": round(time.monotonic() - self._t0, 3)}
        readers = {
            "sm_clock_mhz": lambda: float(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
            "mem_clock_mhz": lambda: float(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM)),
            "power_w": lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
            "temperature_c": lambda: float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
            "throttle_mask": lambda: int(_throttle_mask(nvml, handle)),
        }
        for field, read in readers.items():
            try:
                sample[field] = read()
            except Exception:  # one unsupported query must not end the sampling of the others
                sample[field] = None
        return sample

    def now_s(self) -> float:
        """Seconds on the monitor's own clock, the one sample times `t_s` use."""
        return time.monotonic() - self._t0

    def window(self, since_s: float | None = None, until_s: float | None = None) -> list[dict[str, Any]]:
        with self._lock:
            samples = list(self.samples)
        return [s for s in samples
                if (since_s is None or s["t_s"] >= since_s) and (until_s is None or s["t_s"] <= until_s)]

    def sm_clock_settled(self, window_s: float = 0.5, tolerance: float = 0.01) -> bool | None:
        """Whether the SM clock held within `tolerance` (fraction) over the last `window_s`; None without NVML."""
        if not self.available:
            return None
        clocks = [s["sm_clock_mhz"] for s in self.window(since_s=self.now_s() - window_s)
                  if s.get("sm_clock_mhz") is not None]
        if len(clocks) < max(3, int(window_s / self.interval_s * 0.6)):
            return False
        return (max(clocks) - min(clocks)) <= tolerance * max(clocks)

    def summary(self, since_s: float | None = None, until_s: float | None = None) -> dict[str, Any]:
        if not self.available:
            return {"available": False, "reason": self.reason}
        return summarize(self.window(since_s, until_s), self.sm_clock_max_mhz, name=self.name)


def _throttle_mask(nvml, handle) -> int:
    reader = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    return reader(handle)


def summarize(samples: list[dict[str, Any]], sm_clock_max_mhz: float | None,
              name: str | None = None) -> dict[str, Any]:
    """min/mean/max of each sampled field, the throttle reasons seen, and whether the clock ran below max."""
    out: dict[str, Any] = {"available": True, "name": name, "samples": len(samples),
                           "sm_clock_max_mhz": sm_clock_max_mhz}
    for field in SAMPLE_FIELDS:
        values = [s[field] for s in samples if s.get(field) is not None]
        out[field] = ({"min": min(values), "mean": round(math.fsum(values) / len(values), 1),
                       "max": max(values)} if values else None)
    counts: dict[str, int] = {}
    for s in samples:
        for reason in decode_throttle_reasons(s.get("throttle_mask") or 0):
            counts[reason] = counts.get(reason, 0) + 1
    out["throttle_reasons"] = counts
    out["limiting_reasons"] = sorted(r for r in counts if r in LIMITING_REASONS)
    mean_clock = out["sm_clock_mhz"]["mean"] if out["sm_clock_mhz"] else None
    if mean_clock is not None and sm_clock_max_mhz:
        out["sm_clock_mean_fraction_of_max"] = round(mean_clock / sm_clock_max_mhz, 4)
        out["below_max_clock"] = mean_clock < (1 - BELOW_MAX_TOLERANCE) * sm_clock_max_mhz
    else:
        out["sm_clock_mean_fraction_of_max"] = None
        out["below_max_clock"] = None
    return out


def clock_note(summary: dict[str, Any]) -> str | None:
    """One sentence for the user when the clock averaged below the card's max, else None."""
    if not summary.get("available") or not summary.get("below_max_clock"):
        return None
    clocks = summary["sm_clock_mhz"]
    reasons = ", ".join(summary.get("limiting_reasons") or []) or "no limiting reason reported"
    return (f"SM clock averaged {clocks['mean']:.0f} MHz, below the card's max of "
            f"{summary['sm_clock_max_mhz']:.0f} MHz ({summary['sm_clock_mean_fraction_of_max'] * 100:.1f}%; "
            f"throttle reasons seen: {reasons})")


def compact_samples(samples: list[dict[str, Any]], max_samples: int = 1200) -> list[dict[str, Any]]:
    """Every n-th sample, so that a long run keeps a bounded timeline in its record."""
    if len(samples) <= max_samples:
        return samples
    stride = math.ceil(len(samples) / max_samples)
    return samples[::stride]
