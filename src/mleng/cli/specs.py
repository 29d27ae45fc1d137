"""`mleng specs`: list, show and compare the reference specs of accelerators and links."""

from __future__ import annotations

import argparse

from mleng.cli.main import json_parent
from mleng.cli.render import print_json, table
from mleng.errors import UsageError

ACCELERATOR_LEGEND = ("dense TFLOPS (no sparsity); memory as the vendor labels it (GB); bandwidth TB/s and "
                      "GB/s base 10, GB/s links unidirectional per accelerator; * = announced, not available")
LINK_LEGEND = "GB/s base 10 (10^9 bytes/s); Gb/s = line rate in bits; * = announced, not available"

# (row label, unit, attribute or tflops dtype) for `compare`
COMPARE_ROWS = [
    *[(f"{dtype} dense", "TFLOPS", f"tflops.{dtype}") for dtype in
      ("fp64", "fp32", "tf32", "fp16", "bf16", "fp8", "fp6", "fp4", "nvfp4")],
    ("int8 dense", "TOPS", "int8_tops"),
    ("memory", "GB", "memory_gib"),
    ("memory bandwidth", "TB/s", "memory_bandwidth_tbps"),
    ("power", "W", "tdp_w"),
    ("intra-node link", "GB/s", "intra_node_gbps"),
    ("inter-node (ref. platform)", "GB/s", "inter_node_gbps"),
    ("host link", "GB/s", "host_link_gbps"),
    ("SMs / CUs / units", "", "sm_count"),
    ("max clock", "MHz", "max_clock_mhz"),
    ("L2 cache", "MB", "l2_cache_mib"),
]


COMPARE_LINK_ROWS = [
    ("unidirectional", "GB/s", "unidirectional_gbps"),
    ("duplex", "GB/s", "duplex_gbps"),
    ("line rate", "Gb/s", "line_rate_gbit"),
    ("per lane", "GB/s", "per_lane_gbps"),
    ("lanes", "", "lanes"),
    ("links", "", "links"),
    ("per link", "GB/s", "per_link_gbps"),
    ("adapters per node", "", "adapters_per_node"),
    ("per node", "GB/s", "node_gbps"),
    ("generation", "", "generation"),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = sub.add_parser("list", parents=[json_parent()], help="all accelerators (or links) in the data")
    listing.add_argument("--kind", choices=["accelerators", "links"], default="accelerators")
    listing.add_argument("--vendor", help="only this vendor's accelerators (NVIDIA, AMD, Intel, Google, AWS)")
    listing.add_argument("--family", help="only this link family (pcie, nvlink, infiniband, ethernet, efa, ...)")
    show = sub.add_parser("show", parents=[json_parent()],
                          help="one accelerator or link, with sources and notes")
    show.add_argument("name", nargs="+", help="a key, product name, alias or NVML name ('NVIDIA H200')")
    compare = sub.add_parser("compare", parents=[json_parent()],
                             help="accelerators (or links) side by side, with ratios to the first")
    compare.add_argument("names", nargs="+", metavar="NAME",
                         help="two or more accelerators, or two or more links (quote names with spaces)")


def run(args: argparse.Namespace) -> int:
    if args.action == "list":
        return _list(args)
    if args.action == "show":
        return _show(args)
    return _compare(args)


def _clean(value):
    """Whole floats as ints, so the table prints 989 rather than 989.0."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _selected(args: argparse.Namespace) -> list:
    """The accelerators (or links) `specs list` shows, after --vendor / --family."""
    from mleng.specs import load_accelerators, load_links

    if args.kind == "links":
        if args.vendor:
            raise UsageError("--vendor filters accelerators; for links use --family")
        links = list(load_links().values())
        if args.family:
            families = sorted({link.family for link in links})
            links = [link for link in links if link.family == args.family.lower()]
            if not links:
                raise UsageError(f"no link family '{args.family}'; known: {', '.join(families)}")
        return links
    if args.family:
        raise UsageError("--family filters links; use it with --kind links")
    accelerators = list(load_accelerators().values())
    if args.vendor:
        vendors = sorted({a.vendor for a in accelerators})
        accelerators = [a for a in accelerators if a.vendor.lower() == args.vendor.lower()]
        if not accelerators:
            raise UsageError(f"no vendor '{args.vendor}'; known: {', '.join(vendors)}")
    return accelerators


def list_result(args: argparse.Namespace) -> dict:
    """What `mleng specs list --json` prints: {"kind", "units", "accelerators" or "links"}."""
    from mleng.specs.catalog import units

    return {"kind": args.kind, "units": units(args.kind), args.kind: [e.to_dict() for e in _selected(args)]}


def _list(args: argparse.Namespace) -> int:
    if args.json:
        print_json(list_result(args))
        return 0
    if args.kind == "links":
        links = _selected(args)
        rows = [{"key": l.key + ("*" if l.availability == "announced" else ""), "name": l.name,
                 "family": l.family, "uni": _clean(l.unidirectional_gbps), "duplex": _clean(l.duplex_gbps),
                 "lane": _clean(l.per_lane_gbps), "gbit": _clean(l.line_rate_gbit), "scope": l.scope}
                for l in links]
        print(table(rows, ["key", "name", "family", "uni", "duplex", "lane", "gbit", "scope"],
                    ["key", "name", "family", "GB/s uni", "GB/s duplex", "GB/s lane", "Gb/s", "scope"]))
        print(f"\n{len(rows)} links; {LINK_LEGEND}")
        return 0

    accelerators = _selected(args)
    rows = [{"key": a.key + ("*" if a.availability == "announced" else ""), "name": a.name,
             "fp16": _clean(a.tflops.get("fp16")), "bf16": _clean(a.tflops.get("bf16")), "fp8": _clean(a.tflops.get("fp8")),
             "fp4": _clean(a.tflops.get("fp4")), "memory": _clean(a.memory_gib),
             "tbps": _clean(a.memory_bandwidth_tbps), "tdp": _clean(a.tdp_w),
             "link": a.intra_node_link, "link_gbps": _clean(a.intra_node_gbps)}
            for a in accelerators]
    print(table(rows, ["key", "name", "fp16", "bf16", "fp8", "fp4", "memory", "tbps", "tdp", "link", "link_gbps"],
                ["key", "name", "fp16", "bf16", "fp8", "fp4", "mem GB", "TB/s", "power W", "intra-node", "GB/s"]))
    print(f"\n{len(rows)} accelerators; {ACCELERATOR_LEGEND}")
    return 0


def _show(args: argparse.Namespace) -> int:
    from mleng.specs import Accelerator, lookup

    if args.json:
        print_json(show_result(args))
        return 0
    entry = lookup(" ".join(args.name))
    print(render_accelerator(entry) if isinstance(entry, Accelerator) else render_link(entry))
    return 0


def show_result(args: argparse.Namespace) -> dict:
    """What `mleng specs show NAME --json` prints: {"kind": "accelerator" or "link", ...the entry}."""
    from mleng.specs import Accelerator, lookup

    entry = lookup(" ".join(args.name))
    return {"kind": "accelerator" if isinstance(entry, Accelerator) else "link", **entry.to_dict()}


def _fmt(value) -> str:
    value = _clean(value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def _footer(entry) -> list[str]:
    lines = []
    if entry.choices:
        lines.append("where sources disagree:")
        for c in entry.choices:
            rejected = ", ".join(str(r) for r in c.rejected)
            lines.append(f"  {c.field}: {c.chosen} (not {rejected}): {c.note}")
    if entry.notes:
        lines.append("notes:")
        lines.extend(f"  - {note}" for note in entry.notes)
    lines.append("sources:")
    lines.extend(f"  - {s.title} (read {s.read_on})" for s in entry.sources)
    return lines


def render_accelerator(a) -> str:
    from mleng.specs.formulas import peak_tflops

    def field(label: str, text: str | None) -> None:
        if text:
            lines.append(f"  {label:<15} {text}")

    lines = [f"{a.key}: {a.name}"]
    field("vendor", f"{a.vendor}" + (f" {a.architecture}" if a.architecture else "")
          + f", {a.form_factor}, {a.availability}")
    if a.aliases:
        field("also known as", ", ".join(a.aliases))
    field("dense TFLOPS", "  ".join(f"{d} {_fmt(v)}" for d, v in a.tflops.items()) or "not published")
    if a.int8_tops:
        field("int8 TOPS", _fmt(a.int8_tops))
    if a.memory_gib:
        memory = f"{_fmt(a.memory_gib)} GB {a.memory_type or ''}".rstrip()
        if a.memory_bandwidth_tbps:
            memory += f", {_fmt(a.memory_bandwidth_tbps)} TB/s"
        if a.memory_bus_width_bits:
            memory += f" ({a.memory_bus_width_bits}-bit bus"
            memory += f", {_fmt(a.memory_clock_mhz)} MHz)" if a.memory_clock_mhz else ")"
        field("memory", memory)
    field("power", f"{_fmt(a.tdp_w)} W ({a.power_term})" if a.tdp_w else "not published")
    if a.intra_node_link:
        gbps = f", {_fmt(a.intra_node_gbps)} GB/s per direction" if a.intra_node_gbps else ""
        field("intra-node", f"{a.intra_node_link}{gbps}")
    if a.inter_node_link:
        field("inter-node", f"{a.inter_node_link}, {_fmt(a.inter_node_gbps)} GB/s per accelerator"
              + (f" ({a.inter_node_platform})" if a.inter_node_platform else ""))
    if a.host_link:
        field("host link", f"{a.host_link}, {_fmt(a.host_link_gbps)} GB/s per direction")
    compute = []
    if a.sm_count:
        compute.append(f"{a.sm_count} {a.unit_name or 'units'}")
    if a.matrix_units:
        per_clock = f" x {a.fmas_per_clock_per_unit} FMA/clock" if a.fmas_per_clock_per_unit else ""
        compute.append(f"{a.matrix_units} {a.matrix_unit_name or 'matrix units'}{per_clock}")
    if a.max_clock_mhz:
        compute.append(f"{_fmt(a.max_clock_mhz)} MHz")
    field("compute", ", ".join(compute))
    if a.max_clock_mhz and a.matrix_units and a.fmas_per_clock_per_unit:
        formula = peak_tflops(a.max_clock_mhz, a.fmas_per_clock_per_unit, a.matrix_units)
        field("formula peak", f"{a.max_clock_mhz:g} MHz x {a.fmas_per_clock_per_unit} x 2 x {a.matrix_units}"
              f" = {formula:.1f} TFLOPS (16-bit)")
    caches = []
    if a.l2_cache_mib:
        caches.append(f"L2 {_fmt(a.l2_cache_mib)} MB")
    if a.last_level_cache_mib:
        caches.append(f"last level {_fmt(a.last_level_cache_mib)} MB")
    field("cache", ", ".join(caches))
    if a.devices_per_package > 1:
        field("devices", f"{a.devices_per_package} per package; software sees each as its own device")
    return "\n".join(lines + _footer(a))


def render_link(link) -> str:
    lines = [f"{link.key}: {link.name}",
             f"  {'family':<15} {link.family}" + (f" gen {link.generation}" if link.generation else "")
             + f", {link.availability}"]
    pairs = [("scope", link.scope),
             ("unidirectional", link.unidirectional_gbps and f"{_fmt(link.unidirectional_gbps)} GB/s"),
             ("duplex", link.duplex_gbps and f"{_fmt(link.duplex_gbps)} GB/s"),
             ("per lane", link.per_lane_gbps and f"{_fmt(link.per_lane_gbps)} GB/s x {link.lanes} lanes"),
             ("per link", link.per_link_gbps and f"{_fmt(link.per_link_gbps)} GB/s"
              + (f" x {link.links} links" if link.links else "")),
             ("line rate", link.line_rate_gbit and f"{_fmt(link.line_rate_gbit)} Gb/s"),
             ("signalling", link.transfer_rate_gts and f"{_fmt(link.transfer_rate_gts)} GT/s, {link.encoding}"),
             ("per node", link.node_gbps and f"{_fmt(link.node_gbps)} GB/s with {link.adapters_per_node} adapters"),
             ("platform", link.platform)]
    if link.aliases:
        pairs.insert(0, ("also known as", ", ".join(link.aliases)))
    lines.extend(f"  {label:<15} {text}" for label, text in pairs if text)
    return "\n".join(lines + _footer(link))


def comparison(names: list[str]) -> dict:
    """Rows of specs for several accelerators (or several links), each with its ratio to the first."""
    from mleng.specs import lookup
    from mleng.specs.catalog import Link

    entries = [lookup(name) for name in names]
    links = [isinstance(e, Link) for e in entries]
    if any(links) and not all(links):
        mixed = ", ".join(f"{n} ({'link' if is_link else 'accelerator'})" for n, is_link in zip(names, links))
        raise UsageError(f"cannot compare accelerators with links: {mixed}",
                         hint="compare accelerators with accelerators, or links with links")
    keys = [e.key for e in entries]
    if len(set(keys)) < len(keys):
        raise UsageError(f"the names given resolve to the same entry more than once: {', '.join(keys)}")
    if all(links):
        return _rows(entries, keys, COMPARE_LINK_ROWS, "links", {})
    return _rows(entries, keys, COMPARE_ROWS, "accelerators", {a.key: a.power_term for a in entries})


def _rows(accelerators, keys, spec_rows, kind: str, power_terms: dict) -> dict:
    rows = []
    for label, unit, attribute in spec_rows:
        if attribute.startswith("tflops."):
            values = [a.tflops.get(attribute.split(".", 1)[1]) for a in accelerators]
        else:
            values = [getattr(a, attribute) for a in accelerators]
        if all(v is None for v in values):
            continue
        first = values[0]
        ratios = {a.key: (v / first if v is not None and first else None) for a, v in zip(accelerators, values)}
        rows.append({"spec": label, "unit": unit, "field": attribute,
                     "values": dict(zip(keys, values)), "ratio_to_first": ratios})
    return {"kind": kind, kind: keys, "names": {a.key: a.name for a in accelerators},
            "first": keys[0], "rows": rows, "power_terms": power_terms}


def compare_result(args: argparse.Namespace) -> dict:
    """What `mleng specs compare A B ... --json` prints: comparison() of the names."""
    if len(args.names) < 2:
        raise UsageError("compare needs at least two accelerators (or links), e.g. `mleng specs compare h100 h200`")
    return comparison(args.names)


def _compare(args: argparse.Namespace) -> int:
    result = compare_result(args)
    if args.json:
        print_json(result)
        return 0
    keys, first = result[result["kind"]], result["first"]
    columns, headers = ["spec"], ["spec"]
    for key in keys:
        columns.append(key)
        headers.append(key)
        if key != first:
            columns.append(f"{key}/ratio")
            headers.append(f"{key}/{first}")
    rows = []
    for row in result["rows"]:
        cells = {"spec": f"{row['spec']} ({row['unit']})" if row["unit"] else row["spec"]}
        for key in keys:
            cells[key] = _clean(row["values"][key])
            ratio = row["ratio_to_first"][key]
            cells[f"{key}/ratio"] = round(ratio, 2) if ratio is not None else None
        rows.append(cells)
    print(table(rows, columns, headers))
    terms = {result["power_terms"].get(k) for k in keys}
    if result["kind"] == "links":
        print("\n" + LINK_LEGEND + "; ratios to " + first)
        return 0
    if len(terms) > 1:
        print("\npower is each vendor's own figure: " + "; ".join(
            f"{k} {result['power_terms'][k] or 'not published'}" for k in keys))
    print("\ndense TFLOPS (no sparsity); bandwidth base 10, links unidirectional; "
          "ratios to " + first)
    return 0
