"""Reference specs of accelerators and links: load the TOML data files, look entries up by forgiving names."""

from __future__ import annotations

import dataclasses
import functools
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mleng.errors import MlengError, UsageError

DATA_DIR = Path(__file__).parent / "data"
ACCELERATORS_FILE = DATA_DIR / "accelerators.toml"
LINKS_FILE = DATA_DIR / "links.toml"

DTYPES = ("fp64", "fp32", "tf32", "fp16", "bf16", "fp8", "fp6", "fp4", "nvfp4")
AVAILABILITY = ("available", "announced")

# Words NVML, ROCm and cloud consoles put in front of a product name; dropping them lets
# "NVIDIA H200" and "AMD Instinct MI300X" find "h200" and "mi300x".
VENDOR_WORDS = frozenset({"nvidia", "tesla", "amd", "instinct", "intel", "habana", "google", "cloud",
                          "aws", "amazon"})

# Spellings of each dtype (torch names included, so a measurement can pass its dtype as it has it).
_DTYPE_SPELLINGS = {
    "fp64": ("fp64", "float64", "double", "f64"),
    "fp32": ("fp32", "float32", "float", "f32"),
    "tf32": ("tf32", "tensorfloat32"),
    "fp16": ("fp16", "float16", "half", "f16"),
    "bf16": ("bf16", "bfloat16"),
    "fp8": ("fp8", "float8", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
            "e4m3", "e5m2", "fp8_e4m3", "fp8_e5m2"),
    "fp6": ("fp6", "float6", "mxfp6"),
    "fp4": ("fp4", "float4", "mxfp4", "float4_e2m1fn_x2"),
    "nvfp4": ("nvfp4",),
}
_DTYPE_BY_SPELLING = {spelling: dtype for dtype, spellings in _DTYPE_SPELLINGS.items() for spelling in spellings}


@dataclass(frozen=True)
class Source:
    id: str
    title: str
    read_on: str


@dataclass(frozen=True)
class Choice:
    """Where two sources disagree: the value we carry, the ones we did not, and why."""

    field: str
    chosen: Any
    rejected: tuple
    note: str


@dataclass(frozen=True)
class Accelerator:
    key: str
    name: str
    vendor: str
    form_factor: str
    availability: str
    tflops: dict[str, float]
    sources: tuple[Source, ...]
    architecture: str | None = None
    aliases: tuple[str, ...] = ()
    int8_tops: float | None = None
    memory_gib: float | None = None
    memory_type: str | None = None
    memory_bandwidth_tbps: float | None = None
    memory_bus_width_bits: int | None = None
    memory_clock_mhz: float | None = None
    tdp_w: float | None = None
    power_term: str | None = None
    intra_node_link: str | None = None
    intra_node_gbps: float | None = None
    inter_node_link: str | None = None
    inter_node_gbps: float | None = None
    inter_node_platform: str | None = None
    host_link: str | None = None
    host_link_gbps: float | None = None
    sm_count: int | None = None
    unit_name: str | None = None
    matrix_units: int | None = None
    matrix_unit_name: str | None = None
    fmas_per_clock_per_unit: int | None = None
    max_clock_mhz: float | None = None
    l2_cache_mib: float | None = None
    last_level_cache_mib: float | None = None
    devices_per_package: int = 1
    notes: tuple[str, ...] = ()
    choices: tuple[Choice, ...] = ()

    def peak_tflops(self, dtype: str) -> float | None:
        """The dense peak for this dtype, or None where the part has no published rate for it."""
        return self.tflops.get(normalize_dtype(dtype))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Link:
    key: str
    name: str
    family: str
    availability: str
    sources: tuple[Source, ...]
    unidirectional_gbps: float | None = None
    duplex_gbps: float | None = None
    per_lane_gbps: float | None = None
    lanes: int | None = None
    links: int | None = None
    per_link_gbps: float | None = None
    line_rate_gbit: float | None = None
    generation: int | None = None
    transfer_rate_gts: float | None = None
    encoding: str | None = None
    scope: str | None = None
    adapters_per_node: int | None = None
    node_gbps: float | None = None
    platform: str | None = None
    aliases: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    choices: tuple[Choice, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- loading

def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise MlengError(f"cannot read spec data {path}: {exc.strerror}",
                         "reinstall mleng; the data files ship inside the package") from None
    except tomllib.TOMLDecodeError as exc:
        raise MlengError(f"spec data {path} is not valid TOML: {exc}") from None


def _sources(path: Path, raw: dict[str, Any]) -> dict[str, Source]:
    sources = {}
    for source_id, body in raw.get("source", {}).items():
        if not body.get("title") or not body.get("read_on"):
            raise MlengError(f"{path}: source '{source_id}' needs a title and a read_on date")
        sources[source_id] = Source(source_id, body["title"], str(body["read_on"]))
    return sources


def _build(cls, path: Path, key: str, body: dict[str, Any], sources: dict[str, Source]):
    known = {f.name for f in dataclasses.fields(cls)} - {"key"}
    unknown = sorted(set(body) - known)
    if unknown:
        raise MlengError(f"{path}: entry '{key}' has unknown field(s) {', '.join(unknown)}")
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.name != "key"]
    missing = [name for name in required if name not in body]
    if missing:
        raise MlengError(f"{path}: entry '{key}' lacks {', '.join(missing)}")
    for f in dataclasses.fields(cls):
        numeric = f.type.startswith(("float", "int"))
        value = body.get(f.name)
        if numeric and value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise MlengError(f"{path}: entry '{key}' field {f.name} must be a number, got {value!r}")
    values = dict(body)
    try:
        values["sources"] = tuple(sources[s] for s in body["sources"])
    except KeyError as exc:
        raise MlengError(f"{path}: entry '{key}' names source {exc} that is not defined") from None
    if not values["sources"]:
        raise MlengError(f"{path}: entry '{key}' names no source")
    if values["availability"] not in AVAILABILITY:
        raise MlengError(f"{path}: entry '{key}' availability must be one of {', '.join(AVAILABILITY)}")
    values["aliases"] = tuple(body.get("aliases", ()))
    values["notes"] = tuple(body.get("notes", ()))
    try:
        values["choices"] = tuple(Choice(c["field"], c["chosen"], tuple(c.get("rejected", ())), c["note"])
                                  for c in body.get("choices", ()))
    except KeyError as exc:
        raise MlengError(f"{path}: a choice of entry '{key}' lacks {exc}") from None
    if "tflops" in values:
        bad = sorted(set(values["tflops"]) - set(DTYPES))
        if bad:
            raise MlengError(f"{path}: entry '{key}' has unknown dtype(s) {', '.join(bad)} in tflops")
        for dtype, rate in values["tflops"].items():
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate <= 0:
                raise MlengError(f"{path}: entry '{key}' tflops.{dtype} must be a positive number, got {rate!r}")
        values["tflops"] = {dtype: float(values["tflops"][dtype]) for dtype in DTYPES
                            if dtype in values["tflops"]}
    return cls(key=key, **values)


def read_accelerators(path: Path = ACCELERATORS_FILE) -> dict[str, Accelerator]:
    """Parse and check an accelerators data file; MlengError naming the file and entry if it is wrong."""
    raw = _read_toml(path)
    sources = _sources(path, raw)
    entries = {key: _build(Accelerator, path, key, body, sources)
               for key, body in raw.get("accelerator", {}).items()}
    build_index(entries, path)
    return entries


def read_links(path: Path = LINKS_FILE) -> dict[str, Link]:
    """Parse and check a links data file; MlengError naming the file and entry if it is wrong."""
    raw = _read_toml(path)
    sources = _sources(path, raw)
    entries = {key: _build(Link, path, key, body, sources) for key, body in raw.get("link", {}).items()}
    build_index(entries, path)
    return entries


@functools.cache
def _accelerators() -> dict[str, Accelerator]:
    return read_accelerators()


@functools.cache
def _links() -> dict[str, Link]:
    return read_links()


def load_accelerators() -> dict[str, Accelerator]:
    """Every accelerator entry by key, in file order (parsed once per process)."""
    return dict(_accelerators())


def load_links() -> dict[str, Link]:
    """Every link entry by key, in file order (parsed once per process)."""
    return dict(_links())


@functools.cache
def _units(path: Path) -> dict[str, str]:
    return dict(_read_toml(path).get("units", {}))


def units(kind: str = "accelerators") -> dict[str, str]:
    """The [units] table of a data file ("accelerators" or "links"): what each number means."""
    if kind not in ("accelerators", "links"):
        raise UsageError(f"unknown spec kind '{kind}'; known: accelerators, links")
    return dict(_units(ACCELERATORS_FILE if kind == "accelerators" else LINKS_FILE))


# ---------------------------------------------------------------- lookup

def name_forms(text: str) -> list[str]:
    """The spellings a name is matched by: all letters and digits, then the same without vendor words."""
    tokens = re.findall(r"[a-z0-9]+", str(text).lower())
    full = "".join(tokens)
    stripped = "".join(t for t in tokens if t not in VENDOR_WORDS)
    return [form for form in dict.fromkeys([full, stripped]) if form]


def build_index(entries: dict[str, Any], path: Path) -> dict[str, str]:
    """Every spelling of every entry's key, name and aliases -> the entry key; a clash is an error."""
    index: dict[str, str] = {}
    for key, entry in entries.items():
        for name in (key, entry.name, *entry.aliases):
            for form in name_forms(name):
                if index.setdefault(form, key) != key:
                    raise MlengError(f"{path}: the name '{name}' of '{key}' also names '{index[form]}'")
    return index


@functools.cache
def _accelerator_index() -> dict[str, str]:
    return build_index(_accelerators(), ACCELERATORS_FILE)


@functools.cache
def _link_index() -> dict[str, str]:
    return build_index(_links(), LINKS_FILE)


def _resolve(name: str, index: dict[str, str]) -> str | None:
    for form in name_forms(name):
        if form in index:
            return index[form]
    return None


def closest_names(name: str, index: dict[str, str], limit: int = 5) -> list[str]:
    """Entry keys whose names look most like `name`, best first."""
    import difflib

    forms = name_forms(name)
    target = forms[-1] if forms else ""
    keys: list[str] = []
    for cutoff in (0.6, 0.5):
        for form in difflib.get_close_matches(target, list(index), n=4 * limit, cutoff=cutoff):
            if index[form] not in keys:
                keys.append(index[form])
        if keys:
            break
    return keys[:limit]


def _unknown(kind: str, name: str, index: dict[str, str]) -> UsageError:
    candidates = closest_names(name, index)
    if candidates:
        return UsageError(f"unknown {kind} '{name}'; closest: {', '.join(candidates)} "
                          f"(`mleng specs list` shows all)")
    return UsageError(f"unknown {kind} '{name}'; nothing close (`mleng specs list` shows all)")


def lookup_accelerator(name: str | Accelerator) -> Accelerator:
    """The accelerator for a key, product name, alias or NVML/ROCm device name; UsageError if none."""
    if isinstance(name, Accelerator):
        return name
    if not str(name).strip():
        raise UsageError("empty accelerator name; give a name such as h100 or 'NVIDIA H200'")
    key = _resolve(name, _accelerator_index())
    if key is None:
        raise _unknown("accelerator", name, _accelerator_index())
    return _accelerators()[key]


def find_accelerator(name: str) -> tuple[Accelerator | None, str | None]:
    """For a measurement's reference rate: (the accelerator, None) or (None, why there is none); never raises."""
    try:
        return lookup_accelerator(name), None
    except MlengError as exc:
        return None, f"no spec entry for {name!r}: {exc.message}"


def lookup_link(key: str | Link) -> Link:
    """The link for a key or alias (nvlink-4, pcie gen5, ndr, 400gbe, efa v3); UsageError if none."""
    if isinstance(key, Link):
        return key
    if not str(key).strip():
        raise UsageError("empty link name; give a name such as nvlink-4 or pcie-5")
    found = _resolve(key, _link_index())
    if found is None:
        raise _unknown("link", key, _link_index())
    return _links()[found]


def lookup(name: str) -> Accelerator | Link:
    """An accelerator or, failing that, a link; the error lists the closest names of both."""
    if not str(name).strip():
        raise UsageError("empty name; give an accelerator (h100) or a link (nvlink-4)")
    key = _resolve(name, _accelerator_index())
    if key is not None:
        return _accelerators()[key]
    key = _resolve(name, _link_index())
    if key is not None:
        return _links()[key]
    raise _unknown("accelerator or link", name, {**_link_index(), **_accelerator_index()})


def normalize_dtype(dtype: str) -> str:
    """The data files' dtype key for a spelling such as 'bfloat16', 'torch.float16' or 'float8_e4m3fn'."""
    spelling = str(dtype).strip().lower().removeprefix("torch.")
    if spelling in _DTYPE_BY_SPELLING:
        return _DTYPE_BY_SPELLING[spelling]
    raise UsageError(f"unknown dtype '{dtype}'; known: {', '.join(DTYPES)}")


def pcie_link(generation: int) -> Link:
    """The PCIe link entry of a generation (1-8)."""
    for link in _links().values():
        if link.family == "pcie" and link.generation == generation:
            return link
    known = sorted(link.generation for link in _links().values() if link.family == "pcie")
    raise UsageError(f"unknown PCIe generation {generation!r}; known: {known[0]}-{known[-1]}")


def pcie_link_gbps(generation: int, width: int = 16) -> float:
    """Unidirectional GB/s of a PCIe link as detected (generation and lane count, e.g. from NVML)."""
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= 32:
        raise UsageError(f"PCIe width must be a lane count from 1 to 32, got {width!r}")
    if isinstance(generation, bool) or not isinstance(generation, int):
        raise UsageError(f"PCIe generation must be an integer, got {generation!r}")
    return pcie_link(generation).per_lane_gbps * width
