"""The two ceilings a training step is compared with: the sourced dense peak of the dtype (MFU) and the
stored MAMF of the same GPU (MAMFU), matched by UUID, else by model; a CPU by host and CPU model."""

from __future__ import annotations

from typing import Any

from mleng.errors import MlengError


def device_identity(device) -> dict[str, Any]:
    """What a stored MAMF run is matched against: type, name, UUID (GPU), host."""
    import socket

    from mleng.measure.matmul import device_name

    identity = {"type": device.type, "name": device_name(device), "uuid": None, "host": socket.gethostname()}
    if device.type == "cuda":
        import torch

        uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
        if uuid is not None:
            identity["uuid"] = str(uuid) if str(uuid).startswith("GPU-") else f"GPU-{uuid}"
    return identity


def dense_peak(device, identity: dict[str, Any], dtype: str) -> tuple[float | None, str]:
    """The datasheet dense TFLOPS of this card in this dtype (mleng.specs), or None with the reason.
    Never a guessed number: an unknown device makes MFU inconclusive."""
    from mleng.measure.matmul import theoretical_tflops

    value, note = theoretical_tflops(device, identity["name"], dtype, False)
    return value, note or ""


def _names_match(a: str | None, b: str | None) -> bool:
    from mleng.specs.catalog import name_forms

    return bool(a and b) and name_forms(a)[0] == name_forms(b)[0]


def mamf_record_uuid(record) -> str | None:
    """The UUID of the GPU a stored `mleng mamf` run measured: from its summary when it says, else its
    torch index mapped through the recorded CUDA_VISIBLE_DEVICES to the recorded NVML devices."""
    summary = record.summary
    if summary.get("gpu_uuid"):
        return summary["gpu_uuid"]
    device = str(summary.get("device") or "")
    if not device.startswith("cuda"):
        return None
    index = int(device.split(":")[1]) if ":" in device else 0
    machine = record.machine or {}
    visible = (machine.get("env") or {}).get("CUDA_VISIBLE_DEVICES")
    nvml_index: int | None = index
    if visible:
        entries = [e.strip() for e in str(visible).split(",") if e.strip()]
        if index >= len(entries):
            return None
        entry = entries[index]
        if entry.startswith("GPU-"):
            return entry
        nvml_index = int(entry) if entry.isdigit() else None
    for gpu in (machine.get("gpus") or {}).get("devices") or []:
        if gpu.get("index") == nvml_index and gpu.get("uuid"):
            return gpu["uuid"]
    return None


def find_stored_mamf(identity: dict[str, Any], dtype: str, store_path=None) -> tuple[dict[str, Any] | None, str]:
    """The newest stored single-device MAMF run of this device in this dtype: (match, note).

    A GPU is matched by UUID first (the same card), else by model name (another card of the model, which
    can differ by a few percent); a CPU by host and CPU model. Only complete runs count."""
    from mleng.results.store import Store

    try:
        with Store(store_path, create=False) as store:
            if not store.exists:
                return None, "no results store yet"
            candidates = [row for row in store.list(kind="mamf")
                          if row["status"] == "complete" and (row["summary"] or {}).get("dtype") == dtype
                          and isinstance((row["summary"] or {}).get("value"), (int, float))
                          and (row["summary"] or {}).get("per_device") is None
                          and not (row["summary"] or {}).get("spec_key") == "tf32"]
            by_model = None
            for row in candidates:  # newest first
                summary = row["summary"]
                same_type = str(summary.get("device", "")).split(":")[0] == identity["type"]
                if not same_type or not _names_match(summary.get("device_name"), identity["name"]):
                    continue
                if identity["type"] == "cpu":
                    if row["host"] == identity["host"]:
                        return _match(row, "host and CPU model", store.get(row["id"])), ""
                    continue
                if identity.get("uuid"):
                    record = store.get(row["id"])
                    if mamf_record_uuid(record) == identity["uuid"]:
                        return _match(row, "GPU UUID", record), ""
                if by_model is None:
                    by_model = row
            if by_model is not None:
                return _match(by_model, "GPU model (no stored run of this very card)", store.get(by_model["id"])), ""
            return None, f"no stored {dtype} `mleng mamf` run of {identity['name']}"
    except MlengError as exc:
        return None, f"the results store could not be read: {exc.message}"


def _match(row: dict[str, Any], how: str, record=None) -> dict[str, Any]:
    summary = row["summary"]
    out = {"id": row["id"], "tflops": float(summary["value"]), "match": how, "started_at": row["started_at"],
           "host": row["host"], "best_shape": summary.get("best_shape"), "stop_reason": summary.get("stop_reason")}
    if record is not None:
        out["torch"] = ((record.machine or {}).get("software") or {}).get("torch")
    return out


def ratio(value: float | None, ceiling: float | None) -> float | None:
    return round(value / ceiling, 4) if value is not None and ceiling else None
