"""The static site: self-contained pages, and a client-side search that ranks exactly as `mleng ask`."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from mleng.handbook.index import open_index
from mleng.handbook import default_entries_dir
from mleng.handbook.model import load_entries
from mleng.handbook.search import search
from mleng.handbook.site import index_page, search_data

ENTRIES = default_entries_dir()
TESTS = Path(__file__).parent
# Every labelled query of the dev sets (never the frozen ones), and the out-of-scope dev queries.
QUERY_SETS = tuple(sorted(p.name for p in TESTS.glob("handbook_devset*.yaml"))) + ("handbook_oos_dev.yaml",)


def _queries() -> list[str]:
    queries = []
    for name in QUERY_SETS:
        for case in yaml.safe_load((TESTS / name).read_text()) or []:
            queries.append(case["query"])
    return queries + ["Xid 79", "training hangs", "", "hello", "多卡训练时卡住，NCCL 超时", "微调时显存不足"]


def _chromium(*args: str, timeout: int = 60) -> subprocess.CompletedProcess:
    import tempfile

    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                               "--no-first-run", "--disable-background-networking", "--disable-component-update",
                               "--disable-sync", f"--user-data-dir={profile}", *args],
                              capture_output=True, text=True, timeout=timeout)


needs_chromium = pytest.mark.skipif(shutil.which("chromium") is None,
                                    reason="chromium is not installed (apt-get install chromium)")


def test_site_is_self_contained(tmp_path, run_mleng):
    out = tmp_path / "site"
    result = run_mleng("handbook", "site", str(out))
    assert result.returncode == 0, result.stderr
    entries = load_entries(ENTRIES)[0]
    index_html = (out / "index.html").read_text()
    pages = list((out / "entries").glob("*.html"))
    assert len(pages) == len(entries)
    for html_text in [index_html] + [p.read_text() for p in pages[:20]]:
        assert not re.search(r"<(?:script|link|img)[^>]+(?:src|href)=[\"']https?://", html_text)
    data = re.search(r'<script id="index-data" type="application/json">(.*?)</script>', index_html, re.S).group(1)
    assert len(json.loads(data)["entries"]) == len(entries)
    for category in {e.category for e in entries}:
        assert f'id="{category}"' in index_html


def test_every_shipped_signature_converts_to_javascript():
    data = search_data([e.to_dict() for e in load_entries(ENTRIES)[0]])
    assert data["skipped_signatures"] == []


@needs_chromium
def test_site_search_in_headless_chromium(tmp_path, run_mleng):
    out = tmp_path / "site"
    assert run_mleng("handbook", "site", str(out)).returncode == 0
    index_url = (out / "index.html").as_uri()
    from urllib.parse import quote

    for query, expected in (("RuntimeError: DataLoader worker (pid 4242) is killed by signal: Killed.",
                             "dataloader-worker-killed"), ("Xid 79", None)):
        dom = _chromium("--virtual-time-budget=3000", "--dump-dom", f"{index_url}?q={quote(query)}").stdout
        results = re.search(r'<ul id="results"[^>]*>(.*?)</ul>', dom, re.S).group(1)
        ids = re.findall(r'data-id="([a-z0-9-]+)"', results)
        index = open_index(ENTRIES, tmp_path / "idx.sqlite")
        try:
            want = search(index, query)["results"][0]["id"]
        finally:
            index.close()
        assert ids and ids[0] == (expected or want), (query, ids)
        if query == "Xid 79":
            assert ids[0] == "xid-79-fallen-off-bus", ids
    shot = tmp_path / "search.png"
    _chromium("--window-size=1200,900", f"--screenshot={shot}", f"{index_url}?q={quote('Xid 79')}")
    assert shot.is_file() and shot.stat().st_size > 10_000


@needs_chromium
def test_site_ranks_every_dev_query_like_ask(tmp_path, entries_snapshot, dev_search):
    """One browser launch runs every query through the page's search; top-1 and `confident` equal search()'s."""
    entries = [e.to_dict() for e in load_entries(entries_snapshot)[0]]
    queries = _queries()
    page = index_page(entries)
    runner = ("<script>(function(){var q=JSON.parse(document.getElementById('queries').textContent);"
              "var out=q.map(function(x){var r=window.mlengSearch(x,5);"
              "return [r.results.length?r.results[0].id:null,r.confident];});"
              "var pre=document.createElement('pre');pre.id='parity';pre.textContent=JSON.stringify(out);"
              "document.body.appendChild(pre);})();</script>")
    embedded = json.dumps(queries).replace("</", "<\\/")
    page = page.replace("</body>", f'<script id="queries" type="application/json">{embedded}</script>{runner}</body>')
    (tmp_path / "parity.html").write_text(page, encoding="utf-8")
    dom = _chromium("--virtual-time-budget=10000", "--dump-dom", (tmp_path / "parity.html").as_uri(),
                    timeout=120).stdout
    got = json.loads(__import__("html").unescape(re.search(r'<pre id="parity">(.*?)</pre>', dom, re.S).group(1)))
    want = []
    for q in queries:
        r = dev_search(q)
        want.append([r["results"][0]["id"] if r["results"] else None, r["confident"]])
    diffs = [(q, g, w) for q, g, w in zip(queries, got, want) if g != w]
    assert len(got) == len(queries)
    assert not diffs, f"{len(diffs)} of {len(queries)} differ: {diffs[:5]}"
    print(f"site parity: {len(queries)} queries, {len(queries) - len(diffs)} equal top-1 and confident")
