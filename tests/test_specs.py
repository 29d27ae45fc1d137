"""Reference spec data: coverage, sources, lookup by NVML names, sanity, and the recorded source conflicts."""

from __future__ import annotations

import math
import re

import pytest

from mleng.errors import MlengError, UsageError
from mleng.specs import (
    DTYPES,
    load_accelerators,
    load_links,
    lookup,
    lookup_accelerator,
    lookup_link,
    normalize_dtype,
    pcie_link_gbps,
)
from mleng.specs import catalog

ACCELERATORS = load_accelerators()
LINKS = load_links()

REQUIRED_KEYS = [
    "v100-sxm2", "v100-pcie", "a100-sxm", "a100-pcie", "l40s", "h100-sxm", "h100-pcie", "h100-nvl",
    "h200-sxm", "h200-nvl", "gh200", "b200", "b300", "gb200", "gb300",
    "mi250", "mi250x", "mi300x", "mi325x", "mi350x", "mi355x", "gaudi2", "gaudi3",
    "tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e", "tpu-v7x", "trainium2",
]

NVML_NAMES = {
    "NVIDIA H200": "h200-sxm",
    "NVIDIA H200 NVL": "h200-nvl",
    "NVIDIA H100 80GB HBM3": "h100-sxm",
    "NVIDIA H100 PCIe": "h100-pcie",
    "NVIDIA H100 NVL": "h100-nvl",
    "NVIDIA A100-SXM4-80GB": "a100-sxm",
    "NVIDIA A100-SXM4-40GB": "a100-sxm-40gb",
    "NVIDIA A100 80GB PCIe": "a100-pcie",
    "NVIDIA A100-PCIE-40GB": "a100-pcie-40gb",
    "NVIDIA B200": "b200",
    "NVIDIA GB200": "gb200",
    "NVIDIA L40S": "l40s",
    "Tesla V100-SXM2-32GB": "v100-sxm2",
    "Tesla V100-SXM2-16GB": "v100-sxm2-16gb",
    "Tesla V100-PCIE-32GB": "v100-pcie",
    "Tesla V100-PCIE-16GB": "v100-pcie-16gb",
    "AMD Instinct MI300X": "mi300x",
    "AMD Instinct MI325X": "mi325x",
    "AMD Instinct MI355X": "mi355x",
    "NVIDIA GH200 480GB": "gh200-hbm3",
    "NVIDIA GH200 144G HBM3e": "gh200",
    "HL-225": "gaudi2",
    "GAUDI3": "gaudi3",
    "TPU v5 lite": "tpu-v5e",
}


def test_at_least_25_accelerators_and_every_required_part():
    assert len(ACCELERATORS) >= 25
    missing = [key for key in REQUIRED_KEYS if key not in ACCELERATORS]
    assert not missing


def test_announced_parts_are_flagged():
    assert ACCELERATORS["rubin"].availability == "announced"
    assert ACCELERATORS["mi455x"].availability == "announced"
    assert ACCELERATORS["h200-sxm"].availability == "available"
    assert LINKS["nvlink-6"].availability == "announced"


@pytest.mark.parametrize("entry", [*ACCELERATORS.values(), *LINKS.values()], ids=lambda e: e.key)
def test_every_entry_names_a_source_and_the_date_it_was_read(entry):
    assert entry.sources
    for source in entry.sources:
        assert len(source.title) > 20
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", source.read_on)


def test_book_sources_name_the_file_in_the_book():
    h100 = lookup_accelerator("h100")
    titles = [s.title for s in h100.sources]
    assert any("compute/accelerator/README.md" in t and "TFLOPS comparison table" in t for t in titles)


def test_units_are_declared_once_per_file():
    accelerator_units = catalog.units("accelerators")
    link_units = catalog.units("links")
    assert "dense" in accelerator_units["tflops"] and "10^12" in accelerator_units["tflops"]
    assert "unidirectional" in accelerator_units["link_gbps"]
    assert "base 10" in link_units["unidirectional_gbps"]


@pytest.mark.parametrize("nvml_name,key", sorted(NVML_NAMES.items()))
def test_nvml_names_resolve(nvml_name, key):
    assert lookup_accelerator(nvml_name).key == key


@pytest.mark.parametrize("spelling,key", [
    ("h100", "h100-sxm"), ("H100", "h100-sxm"), ("h100 sxm", "h100-sxm"), ("H100_SXM", "h100-sxm"),
    ("  nvidia h200  ", "h200-sxm"), ("h200", "h200-sxm"), ("a100", "a100-sxm"), ("v100", "v100-sxm2"),
    ("MI300X", "mi300x"), ("mi-355x", "mi355x"), ("gaudi-3", "gaudi3"), ("Gaudi 2", "gaudi2"),
    ("trn2", "trainium2"), ("ironwood", "tpu-v7x"), ("gh200", "gh200"), ("B300 SXM", "b300"),
])
def test_lookup_forgives_case_spaces_dashes_and_vendor_words(spelling, key):
    assert lookup_accelerator(spelling).key == key


def test_lookup_accepts_an_accelerator_object():
    h200 = lookup_accelerator("h200")
    assert lookup_accelerator(h200) is h200


def test_unknown_name_lists_the_closest_candidates():
    with pytest.raises(UsageError) as info:
        lookup_accelerator("h300")
    message = str(info.value)
    assert "unknown accelerator 'h300'" in message
    assert "h200-sxm" in message and "h100-sxm" in message
    assert "\n" not in message


def test_unknown_name_with_nothing_close_says_so():
    with pytest.raises(UsageError, match="nothing close"):
        lookup_accelerator("qwertyuiop")


def test_empty_name_is_a_usage_error():
    with pytest.raises(UsageError):
        lookup_accelerator("  ")


def test_names_are_unambiguous_across_accelerators_and_links():
    accelerator_forms = set(catalog._accelerator_index())
    link_forms = set(catalog._link_index())
    assert not accelerator_forms & link_forms


def test_lookup_finds_links_too():
    assert lookup("nvlink 4").key == "nvlink-4"
    assert lookup("NVIDIA H200").key == "h200-sxm"
    with pytest.raises(UsageError, match="accelerator or link"):
        lookup("nvlink 9")


@pytest.mark.parametrize("spelling,key", [
    ("nvlink-4", "nvlink-4"), ("NVLink4", "nvlink-4"), ("PCIe Gen5", "pcie-5"), ("NDR", "ib-ndr"),
    ("400GbE", "ethernet-400"), ("roce 200", "ethernet-200"), ("EFA v3", "efa-v3"), ("xgmi mi355x", "xgmi-mi350x"),
])
def test_link_lookup(spelling, key):
    assert lookup_link(spelling).key == key


def test_unknown_link_lists_candidates():
    with pytest.raises(UsageError, match="closest: .*nvlink"):
        lookup_link("nvlnk-7")


# ---------------------------------------------------------------- sanity of the numbers

@pytest.mark.parametrize("acc", ACCELERATORS.values(), ids=lambda a: a.key)
def test_dense_rates_are_ordered_as_the_hardware_allows(acc):
    t = acc.tflops
    assert set(t) <= set(DTYPES)
    assert all(v > 0 for v in t.values())
    pairs = [("fp32", "tf32"), ("tf32", "bf16"), ("bf16", "fp8"), ("fp16", "fp8"), ("fp8", "fp4"),
             ("fp8", "fp6"), ("fp6", "fp4"), ("fp64", "bf16"), ("fp32", "bf16")]
    for low, high in pairs:
        if low in t and high in t:
            assert t[low] <= t[high], f"{acc.key}: {low} {t[low]} > {high} {t[high]}"


@pytest.mark.parametrize("acc", [a for a in ACCELERATORS.values()
                                 if a.vendor == "NVIDIA" and "tf32" in a.tflops and "bf16" in a.tflops],
                         ids=lambda a: a.key)
def test_nvidia_tf32_is_half_of_bf16_so_dense_and_sparse_are_not_mixed(acc):
    # NVIDIA prints sparse rates next to dense ones; a sparse tf32 beside a dense bf16 would read 1.0 here.
    assert acc.tflops["tf32"] / acc.tflops["bf16"] == pytest.approx(0.5, abs=0.01)


def test_sparse_figures_were_halved_where_the_vendor_lists_only_sparse():
    assert lookup_accelerator("h100").tflops["tf32"] == 494.5  # datasheet: 989 with sparsity
    assert lookup_accelerator("h200 nvl").tflops["bf16"] == 835.5  # datasheet: 1671 with sparsity


@pytest.mark.parametrize("acc", ACCELERATORS.values(), ids=lambda a: a.key)
def test_memory_and_power_are_in_plausible_units(acc):
    assert 8 <= acc.memory_gib <= 512
    assert 0.3 <= acc.memory_bandwidth_tbps <= 30
    if acc.tdp_w is not None:
        assert 200 <= acc.tdp_w <= 2000 and acc.power_term
    else:
        assert acc.availability == "announced" or any("power" in n for n in acc.notes)


@pytest.mark.parametrize("acc", ACCELERATORS.values(), ids=lambda a: a.key)
def test_link_references_exist_and_do_not_exceed_the_link(acc):
    for link_field, gbps_field in [("intra_node_link", "intra_node_gbps"), ("inter_node_link", "inter_node_gbps"),
                                   ("host_link", "host_link_gbps")]:
        key = getattr(acc, link_field)
        if key is None:
            assert getattr(acc, gbps_field) is None
            continue
        link = LINKS[key]
        gbps = getattr(acc, gbps_field)
        if gbps is not None and link.unidirectional_gbps is not None:
            if link_field == "inter_node_link":
                continue  # per accelerator share of the node, not one port
            assert gbps <= link.unidirectional_gbps * 1.001, f"{acc.key} {gbps_field}"
    if acc.host_link and LINKS[acc.host_link].unidirectional_gbps:
        assert acc.host_link_gbps == pytest.approx(LINKS[acc.host_link].unidirectional_gbps)


def test_every_accelerator_has_an_intra_node_link_or_says_why_not():
    for acc in ACCELERATORS.values():
        assert acc.intra_node_link or any("intra-node" in n for n in acc.notes), acc.key


def test_superchip_and_dual_die_rows_say_what_they_count():
    assert any("per GPU" in n for n in lookup_accelerator("gb200").notes)
    assert lookup_accelerator("mi250x").devices_per_package == 2


# ---------------------------------------------------------------- links

PCIE_EFFICIENCY = {"8b/10b": 8 / 10, "128b/130b": 128 / 130}


@pytest.mark.parametrize("link", [l for l in LINKS.values() if l.family == "pcie"], ids=lambda l: l.key)
def test_pcie_lane_rate_follows_from_transfer_rate_and_encoding(link):
    efficiency = PCIE_EFFICIENCY.get(link.encoding, 242 / 256)  # 256-byte FLIT carries 242 payload bytes
    if link.transfer_rate_gts is not None:
        assert link.per_lane_gbps == pytest.approx(link.transfer_rate_gts * efficiency / 8, rel=1e-3)
    assert link.per_lane_gbps * link.lanes == pytest.approx(link.unidirectional_gbps, rel=2e-3)


def test_pcie_x16_matches_the_book():
    assert lookup_link("pcie-4").unidirectional_gbps == pytest.approx(31, abs=0.6)
    assert lookup_link("pcie-5").unidirectional_gbps == pytest.approx(63, abs=0.1)
    assert lookup_link("pcie-6").unidirectional_gbps == pytest.approx(121, abs=0.1)


@pytest.mark.parametrize("link", LINKS.values(), ids=lambda l: l.key)
def test_link_numbers_agree_with_each_other(link):
    uni = link.unidirectional_gbps
    if uni is None:
        assert link.notes, "a link without a number must say why"
        return
    if link.duplex_gbps is not None:
        assert link.duplex_gbps == pytest.approx(2 * uni, rel=1e-3)
    if link.family in ("nvlink", "infiniband") and link.per_lane_gbps:
        lanes = link.lanes * (link.links or 1)
        assert link.per_lane_gbps * lanes == pytest.approx(uni)
    if link.per_link_gbps and link.links and link.family != "nvlink":
        assert link.per_link_gbps * link.links == pytest.approx(uni)
    if link.family in ("ethernet", "infiniband", "nic", "efa"):
        assert link.line_rate_gbit / 8 == pytest.approx(uni)
    if link.adapters_per_node:
        assert link.adapters_per_node * uni == pytest.approx(link.node_gbps)


def test_required_link_families_are_there():
    for key in ["pcie-3", "pcie-4", "pcie-5", "pcie-6", "nvlink-1", "nvlink-2", "nvlink-3", "nvlink-4", "nvlink-5",
                "nvlink-6", "ib-edr", "ib-hdr", "ib-ndr", "ib-xdr", "ethernet-100", "ethernet-200", "ethernet-400",
                "ethernet-800", "efa-v1", "efa-v2", "efa-v3", "efa-v4", "nvlink-c2c-grace-hopper",
                "xgmi-mi250x", "xgmi-mi300x", "xgmi-mi350x", "gaudi2-roce", "gaudi3-roce"]:
        assert key in LINKS, key
    assert [LINKS[f"nvlink-{g}"].unidirectional_gbps for g in range(1, 7)] == [80, 150, 300, 450, 900, 1800]
    assert [LINKS[k].line_rate_gbit for k in ("ib-edr", "ib-hdr", "ib-ndr", "ib-xdr")] == [100, 200, 400, 800]


@pytest.mark.parametrize("gen,width,expected", [
    (3, 16, 15.75), (4, 16, 31.5), (5, 16, 63.0), (6, 16, 121.0), (4, 8, 15.75), (5, 1, 3.94), (1, 16, 4.0),
])
def test_pcie_link_gbps_for_a_detected_link(gen, width, expected):
    assert pcie_link_gbps(gen, width) == pytest.approx(expected, rel=3e-3)


@pytest.mark.parametrize("gen,width", [(9, 16), (0, 16), (4, 0), (4, 33), (4, 2.5), ("4", 16)])
def test_pcie_link_gbps_rejects_what_no_link_can_be(gen, width):
    with pytest.raises(UsageError):
        pcie_link_gbps(gen, width)


def test_dtype_spellings():
    assert normalize_dtype("torch.bfloat16") == "bf16"
    assert normalize_dtype("float8_e4m3fn") == "fp8"
    assert normalize_dtype("half") == "fp16"
    with pytest.raises(UsageError, match="known: fp64"):
        normalize_dtype("int3")


# ---------------------------------------------------------------- the datasheet and the source conflicts

def test_h200_entry_equals_the_datasheet():
    h200 = lookup_accelerator("NVIDIA H200")
    assert h200.tflops["bf16"] == 989
    assert h200.tflops["fp8"] == 1979
    assert h200.memory_gib == 141 and h200.memory_type == "HBM3e"
    assert h200.memory_bandwidth_tbps == 4.8
    assert h200.tdp_w == 700
    assert h200.intra_node_link == "nvlink-4" and h200.intra_node_gbps == 450
    assert lookup_link(h200.intra_node_link).unidirectional_gbps == 450


def _field_value(entry, dotted: str):
    if dotted.startswith("tflops."):
        return entry.tflops.get(dotted.split(".", 1)[1], "absent")
    return getattr(entry, dotted)


@pytest.mark.parametrize("entry", [e for e in [*ACCELERATORS.values(), *LINKS.values()] if e.choices],
                         ids=lambda e: e.key)
def test_every_recorded_choice_is_the_value_carried(entry):
    for choice in entry.choices:
        assert _field_value(entry, choice.field) == choice.chosen
        assert choice.rejected and len(choice.note) > 40
        assert choice.chosen not in choice.rejected


def test_choice_mi355x_bf16_is_2500_and_2300_is_mi350x():
    from mleng.specs import peak_tflops

    mi355x, mi350x = lookup_accelerator("mi355x"), lookup_accelerator("mi350x")
    assert mi355x.tflops["bf16"] == 2500
    assert [c.rejected for c in mi355x.choices if c.field == "tflops.bf16"] == [(2300,)]
    assert peak_tflops(mi355x.max_clock_mhz, 512, 1024) == pytest.approx(2500, rel=0.01)
    # the rejected 2300 is what MI350X's clock gives on the same die
    assert peak_tflops(mi350x.max_clock_mhz, 512, 1024) == pytest.approx(2300, rel=0.005)
    assert mi350x.tflops["bf16"] == 2300


@pytest.mark.parametrize("key", ["a100-sxm", "a100-sxm-40gb", "a100-pcie", "a100-pcie-40gb"])
def test_choice_a100_has_no_fp8(key):
    a100 = lookup_accelerator(key)
    assert "fp8" not in a100.tflops
    assert a100.peak_tflops("float8_e4m3fn") is None
    assert a100.int8_tops == 624  # the figure the vendor table repeats in its FP8 row


def test_choice_a100_fp8_is_recorded():
    choice = [c for c in lookup_accelerator("a100").choices if c.field == "tflops.fp8"]
    assert choice and choice[0].chosen == "absent" and "no FP8" in choice[0].note


def test_choice_gh200_memory_is_141_not_144():
    gh200 = lookup_accelerator("gh200")
    assert gh200.memory_gib == 141 and gh200.memory_type == "HBM3e"
    assert [c.rejected for c in gh200.choices if c.field == "memory_gib"] == [(144,)]
    assert lookup_accelerator("NVIDIA GH200 480GB").memory_gib == 96


def test_choice_b300_power_is_1000_not_1300():
    b300 = lookup_accelerator("b300")
    assert b300.tdp_w == 1000 and b300.power_term == "maximum TGP"
    assert [c.rejected for c in b300.choices if c.field == "tdp_w"] == [(1300,)]


def test_choice_gaudi_intra_node_is_gbit_read_as_gbit():
    gaudi2, gaudi3 = lookup_accelerator("gaudi2"), lookup_accelerator("gaudi3")
    # 21 intra-node RoCE ports per card, 3 per peer, at 100 / 200 Gb/s
    assert gaudi2.intra_node_gbps == 21 * 100 / 8 == 262.5
    assert gaudi3.intra_node_gbps == 21 * 200 / 8 == 525
    assert lookup_link("gaudi2-roce").per_link_gbps == 3 * 100 / 8
    assert lookup_link("gaudi3-roce").per_link_gbps == 3 * 200 / 8
    assert [c.rejected for c in gaudi2.choices] == [(300,)]
    assert [c.rejected for c in gaudi3.choices] == [(600,)]
    assert [c.rejected for c in lookup_link("gaudi3-roce").choices] == [(600,)]


# ---------------------------------------------------------------- broken data files

def _write(tmp_path, text: str):
    path = tmp_path / "accelerators.toml"
    path.write_text(text)
    return path


GOOD_ENTRY = """
[accelerator.x1]
name = "X1"
vendor = "V"
form_factor = "PCIe"
availability = "available"
tflops = { bf16 = 100 }
sources = ["s1"]

[source.s1]
title = "a vendor datasheet of the X1 part"
read_on = "2026-12-02"
"""


def test_a_well_formed_file_loads(tmp_path):
    entries = catalog.read_accelerators(_write(tmp_path, GOOD_ENTRY))
    assert entries["x1"].tflops == {"bf16": 100.0}
    assert entries["x1"].sources[0].read_on == "2026-12-02"


@pytest.mark.parametrize("mangle,expected", [
    (lambda t: t.replace('sources = ["s1"]', 'sources = ["s2"]'), "source 's2'"),
    (lambda t: t.replace('sources = ["s1"]', "sources = []"), "names no source"),
    (lambda t: t.replace('read_on = "2026-12-02"', ""), "read_on"),
    (lambda t: t.replace("bf16 = 100", "bf17 = 100"), "bf17"),
    (lambda t: t.replace('vendor = "V"', 'vendr = "V"'), "vendr"),
    (lambda t: t.replace('availability = "available"', 'availability = "soon"'), "availability"),
    (lambda t: t + t.split("[source.s1]")[0].replace("[accelerator.x1]", "[accelerator.x-1]"), "also names"),
    (lambda t: t.replace("tflops = {", "tflops = {{"), "not valid TOML"),
    (lambda t: t.replace("bf16 = 100", 'bf16 = "100"'), "tflops.bf16 must be a positive number"),
    (lambda t: t.replace('vendor = "V"', 'vendor = "V"\ntdp_w = "700 W"'), "tdp_w must be a number"),
])
def test_a_broken_file_is_reported_with_the_entry(tmp_path, mangle, expected):
    with pytest.raises(MlengError, match=re.escape(expected)) as info:
        catalog.read_accelerators(_write(tmp_path, mangle(GOOD_ENTRY)))
    assert "accelerators.toml" in str(info.value)


def test_loading_is_cached():
    assert catalog._accelerators() is catalog._accelerators()
    assert load_accelerators() == load_accelerators() and load_accelerators() is not catalog._accelerators()
    assert math.isclose(load_links()["pcie-5"].unidirectional_gbps, 63.02)
