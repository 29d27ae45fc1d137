"""The file steps of a handbook release (docs/handbook_method/README.md): what a release does between the helpers'
work, so that every set is built the same way. N is the frozen set, D the dev set it becomes, WORK the release's
scratch folder (/tmp/cN, never committed).

    python scripts/handbook_release.py used-urls WORK               every URL under tests/ -> WORK/used_urls.txt
    python scripts/handbook_release.py prev-searches N WORK         searches_set<N-1>.txt -> WORK/prev_searches.txt
    python scripts/handbook_release.py round-two N WORK             round one's searches and URLs -> WORK/*_r2.txt
    python scripts/handbook_release.py searches N WORK              both rounds' searches -> searches_setN.txt
    python scripts/handbook_release.py merge-labels N WORK          label_<Q>_<L>.yaml -> WORK/pooled.yaml, judge.yaml
    python scripts/handbook_release.py finalize-labels N WORK HDR   pooled + judged -> handbook_frozenN_labels.yaml
    python scripts/handbook_release.py retire N D HDR               frozen set + labels -> tests/handbook_devsetD.yaml
    python scripts/handbook_release.py relabel-pairs D BASE WORK    uncovered dev cases an entry new since BASE cites
    python scripts/handbook_release.py relabel D PAIRS              add PAIRS' ids (and notes) to the dev set's labels
    python scripts/handbook_release.py add-symptoms TREE PAIRS      append users' lines to entries' symptoms in TREE
    python scripts/handbook_release.py compare A.json B.json [-v]   per-set change of hits between two eval runs

HDR files are the YAML comment headers the new files start with (each line starting with '#').
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from mleng.handbook.model import parse_entry, thread_url  # noqa: E402

METHOD = Path("docs/handbook_method")
ENTRIES = Path("src/mleng/handbook/entries")
URL = re.compile(r"https?://[^\s'\"<>)`]+")


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def load(path: Path) -> list:
    if not path.exists():
        fail(f"{path} does not exist")
    return yaml.safe_load(path.read_text()) or []


def dump(items: list) -> str:
    return yaml.safe_dump(items, sort_keys=False, allow_unicode=True, width=120)


def header(path: Path) -> str:
    text = Path(path).read_text()
    bad = [line for line in text.splitlines() if line and not line.startswith("#")]
    if bad:
        fail(f"{path}: header lines must start with '#': {bad[0][:60]!r}")
    return text if text.endswith("\n") else text + "\n"


def comment_header(text: str) -> str:
    out = []
    for line in text.splitlines(True):
        if not line.startswith("#"):
            break
        out.append(line)
    return "".join(out)


def collect_files(work: Path, rounds: tuple[str, ...]) -> list[Path]:
    names = []
    for prefix in rounds:
        names += [work / f"{prefix}{i}.yaml" for i in range(1, 9)]
    return [p for p in names if p.exists()]


def search_lines(paths: list[Path]) -> list[str]:
    """The comment lines (each collector's searches) of collect files, each file under its name."""
    out = []
    for path in paths:
        out.append(f"# file: {path.name}")
        out += [line for line in path.read_text().splitlines() if line.startswith("#")]
    return out


def used_urls(root: Path, work: Path) -> int:
    urls = set()
    for path in (root / "tests").rglob("*"):
        if path.is_file():
            for url in URL.findall(path.read_text(errors="replace")):
                url = thread_url(re.sub(r"[.,;:]+$", "", url.split("#")[0]))
                if url.startswith("http"):
                    urls.add(url)
    (work / "used_urls.txt").write_text("\n".join(sorted(urls)) + "\n")
    return len(urls)


def prev_searches(root: Path, n: int, work: Path) -> Path:
    src = root / METHOD / f"searches_set{n - 1}.txt"
    if not src.exists():
        fail(f"{src} not found: commit set {n - 1}'s searches first")
    (work / "prev_searches.txt").write_text(src.read_text())
    return src


def round_two(n: int, work: Path) -> tuple[int, int]:
    out = [(work / "prev_searches.txt").read_text().rstrip("\n"), f"# ---- set {n} round one ----"]
    urls = set((work / "used_urls.txt").read_text().split())
    cases = 0
    round_one = collect_files(work, ("collect_",))
    out += search_lines(round_one)
    for path in round_one:
        for item in load(path):
            urls.add(thread_url(item["source"]))
            cases += 1
    (work / "prev_searches_r2.txt").write_text("\n".join(out) + "\n")
    (work / "used_urls_r2.txt").write_text("\n".join(sorted(urls)) + "\n")
    return cases, len(urls)


def searches(root: Path, n: int, work: Path) -> Path:
    out = [f"# The searches frozen set {n}'s collectors wrote before running them (round one, then round two), "
           "by area;",
           "# the next set's collectors get them as prev_searches.txt so that every search of theirs differs."]
    out += search_lines(collect_files(work, ("collect_", "collect_r2_")))
    dest = root / METHOD / f"searches_set{n}.txt"
    dest.write_text("\n".join(out) + "\n")
    return dest


def merge_labels(root: Path, n: int, work: Path) -> dict:
    cases = load(root / "tests" / f"handbook_frozen{n}.yaml")
    labels: dict[str, dict[str, dict]] = {"A": {}, "B": {}}
    for quarter in range(1, 5):
        for letter in "AB":
            path = work / f"label_{quarter}_{letter}.yaml"
            if not path.exists():
                fail(f"{path} is missing: every quarter needs labellers A and B")
            for item in load(path):
                labels[letter][item["source"]] = item
    pooled, judge = [], []
    agree = exact = 0
    for case in cases:
        src = case["source"]
        missing = [letter for letter in "AB" if src not in labels[letter]]
        if missing:
            fail(f"labeller {missing[0]} has no label for {src}")
        a, b = labels["A"][src], labels["B"][src]
        ea, eb = list(a["expected"] or []), list(b["expected"] or [])
        kind = a["kind"] if a["kind"] == b["kind"] else f"{a['kind']}/{b['kind']}"
        if bool(ea) == bool(eb):
            agree += 1
            exact += sorted(ea) == sorted(eb)
            pooled.append({"source": src, "expected": ea + [e for e in eb if e not in ea], "kind": kind,
                           "note": a["note"]})
        else:
            judge.append({"source": src, "A": a, "B": b})
            pooled.append({"source": src, "expected": None, "kind": kind, "note": None})
    (work / "pooled.yaml").write_text(dump(pooled))
    (work / "judge.yaml").write_text(dump(judge))
    return {"cases": len(cases), "agree": agree, "exact": exact, "judge": len(judge)}


def finalize_labels(root: Path, n: int, work: Path, hdr: Path) -> tuple[int, int]:
    head = header(hdr)
    pooled = load(work / "pooled.yaml")
    judged_path = work / "judged.yaml"
    judged = {j["source"]: j for j in (load(judged_path) if judged_path.exists() else [])}
    for item in pooled:
        if item["expected"] is None:
            if item["source"] not in judged:
                fail(f"{judged_path} has no verdict for {item['source']}")
            verdict = judged[item["source"]]
            item["expected"], item["note"] = list(verdict["expected"] or []), verdict["note"]
    (root / "tests" / f"handbook_frozen{n}_labels.yaml").write_text(head + dump(pooled))
    return sum(bool(item["expected"]) for item in pooled), len(pooled)


def retire(root: Path, n: int, d: int, hdr: Path) -> Path:
    head = header(hdr)
    tests = root / "tests"
    labels = {item["source"]: item for item in load(tests / f"handbook_frozen{n}_labels.yaml")}
    out = []
    for case in load(tests / f"handbook_frozen{n}.yaml"):
        label = labels[case["source"]]
        out.append({**case, "expected": label["expected"], "kind": label["kind"], "note": label["note"]})
    dest = tests / f"handbook_devset{d}.yaml"
    dest.write_text(head + dump(out))
    return dest


def relabel_pairs(root: Path, d: int, base: str, work: Path) -> tuple[int, int]:
    status = subprocess.run(["git", "diff", "--name-status", base, "HEAD", "--", str(ENTRIES)], cwd=root,
                            capture_output=True, text=True, check=True).stdout
    changed = [(line.split()[0], line.split()[-1]) for line in status.splitlines()]
    new = {path for flag, path in changed if flag == "A"}
    cites: dict[str, list[tuple[str, bool]]] = {}
    for flag, path in changed:
        if flag not in {"A", "M"}:
            continue
        entry = parse_entry(root / path)
        for source in entry.sources:
            cites.setdefault(thread_url(source), []).append((entry.id, path in new))
    pairs = []
    for case in load(root / "tests" / f"handbook_devset{d}.yaml"):
        hit = cites.get(thread_url(case["source"]))
        if case["expected"] or not hit:
            continue
        ids = [i for i, _ in hit]
        how = "written for this case" if all(is_new for _, is_new in hit) else "given this case's thread"
        verb = "was" if len(ids) == 1 else "were"
        pairs.append({"source": case["source"], "add": ids,
                      "note_add": f"Dev work after the measurement: {', '.join(ids)} {verb} {how}."})
    (work / "relabel.yaml").write_text(yaml.safe_dump(pairs, sort_keys=False, allow_unicode=True, width=200))
    return len(new), len(pairs)


def relabel(root: Path, d: int, pairs_path: Path) -> tuple[int, int, int]:
    path = root / "tests" / f"handbook_devset{d}.yaml"
    text = path.read_text()
    cases = yaml.safe_load(text)
    by_source = {case["source"]: case for case in cases}
    added = 0
    for change in load(pairs_path):
        if change["source"] not in by_source:
            fail(f"{change['source']} is not a case of {path.name}")
        case = by_source[change["source"]]
        for entry_id in change["add"]:
            if entry_id not in case["expected"]:
                case["expected"].append(entry_id)
                added += 1
        if change.get("note_add"):
            case["note"] = (case.get("note") or "").rstrip() + " " + change["note_add"]
    path.write_text(comment_header(text) + dump(cases))
    return added, sum(bool(case["expected"]) for case in cases), len(cases)


def add_symptoms(tree: Path, pairs_path: Path) -> list[str]:
    report = []
    for pair in load(pairs_path):
        path = tree / ENTRIES / f"{pair['entry']}.md"
        if not path.exists():
            fail(f"no entry {pair['entry']} under {tree / ENTRIES}")
        lines = path.read_text().splitlines(True)
        start = next(k for k, line in enumerate(lines) if line.startswith("symptoms:"))
        end = next(k for k in range(start + 1, len(lines)) if not lines[k].startswith("  "))
        if any(pair["line"] == yaml.safe_load(line.strip()[2:]) for line in lines[start + 1:end]):
            report.append(f"already {pair['entry']}")
            continue
        lines.insert(end, "  - " + json.dumps(pair["line"], ensure_ascii=False) + "\n")
        path.write_text("".join(lines))
        report.append(f"added {pair['entry']}")
    return report


def compare(a_path: Path, b_path: Path, verbose: bool) -> list[str]:
    def first(row: dict) -> int:
        return int(row["position"] == 1)

    def top3(row: dict) -> int:
        return int(row["position"] is not None and row["position"] <= 3)

    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    out, total1, total3 = [], 0, 0
    for name, result in b["sets"].items():
        if name not in a["sets"]:
            out.append(f"new {name}")
            continue
        before = {(r["query"], r["source"]): r for r in a["sets"][name]["rows"]}
        d1 = d3 = 0
        for row in result["rows"]:
            old = before.get((row["query"], row["source"]))
            if old is None:
                continue
            x1, x3 = first(row) - first(old), top3(row) - top3(old)
            d1, d3 = d1 + x1, d3 + x3
            if verbose and (x1 or x3):
                out.append(f"   {name} {x1:+d} {x3:+d} pos {old['position']}->{row['position']} {row['source']} "
                           f"expected {row['expected']} got {row['got'][:3]}")
        total1, total3 = total1 + d1, total3 + d3
        if d1 or d3:
            now = result["all"]
            out.append(f"{name:30} {d1:+d} {d3:+d}   now {now['hit_at_1']:.3f}/{now['hit_at_3']:.3f}")
    oos = [v["confident"] for v in b.get("oos", {}).values()]
    out.append(f"total {total1:+d} {total3:+d} | oos confident {oos} | entries {a['entries']} -> {b['entries']}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to work on (default: this one)")
    sub = parser.add_subparsers(dest="step", required=True)
    sub.add_parser("used-urls").add_argument("work", type=Path)
    for name in ("prev-searches", "round-two", "searches", "merge-labels"):
        p = sub.add_parser(name)
        p.add_argument("n", type=int)
        p.add_argument("work", type=Path)
    p = sub.add_parser("finalize-labels")
    p.add_argument("n", type=int)
    p.add_argument("work", type=Path)
    p.add_argument("header", type=Path)
    p = sub.add_parser("retire")
    p.add_argument("n", type=int)
    p.add_argument("d", type=int)
    p.add_argument("header", type=Path)
    p = sub.add_parser("relabel-pairs")
    p.add_argument("d", type=int)
    p.add_argument("base")
    p.add_argument("work", type=Path)
    p = sub.add_parser("relabel")
    p.add_argument("d", type=int)
    p.add_argument("pairs", type=Path)
    p = sub.add_parser("add-symptoms")
    p.add_argument("tree", type=Path)
    p.add_argument("pairs", type=Path)
    p = sub.add_parser("compare")
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    for name in ("work", "header", "pairs", "a", "b", "tree"):
        path = getattr(args, name, None)
        if path is not None and not path.exists():
            fail(f"{path} does not exist")
    step = args.step
    if step == "used-urls":
        print(used_urls(root, args.work), "urls ->", args.work / "used_urls.txt")
    elif step == "prev-searches":
        print(prev_searches(root, args.n, args.work), "->", args.work / "prev_searches.txt")
    elif step == "round-two":
        cases, urls = round_two(args.n, args.work)
        print(cases, "round-one cases;", urls, "urls")
    elif step == "searches":
        print("->", searches(root, args.n, args.work))
    elif step == "merge-labels":
        r = merge_labels(root, args.n, args.work)
        print(f"{r['cases']} cases; agree covered-or-not {r['agree']}; exact {r['exact']}; judge {r['judge']}")
    elif step == "finalize-labels":
        covered, total = finalize_labels(root, args.n, args.work, args.header)
        print(covered, "covered of", total)
    elif step == "retire":
        print("->", retire(root, args.n, args.d, args.header))
    elif step == "relabel-pairs":
        new, pairs = relabel_pairs(root, args.d, args.base, args.work)
        print(new, "new entries;", pairs, "uncovered cases get an entry")
    elif step == "relabel":
        added, covered, total = relabel(root, args.d, args.pairs)
        print("added", added, "; covered", covered, "of", total)
    elif step == "add-symptoms":
        print("\n".join(add_symptoms(args.tree, args.pairs)))
    elif step == "compare":
        print("\n".join(compare(args.a, args.b, args.verbose)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
