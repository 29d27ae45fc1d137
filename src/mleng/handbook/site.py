"""The handbook as a static, self-contained HTML site: one page per entry, an index, client-side search."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

from mleng import __version__
from mleng.handbook.model import CATEGORIES

CATEGORY_TITLES = {
    "nccl-hang": "NCCL and collective hangs, timeouts", "nccl-network": "NCCL network errors and bandwidth",
    "network-config": "Network configuration: interfaces, HCAs, plugins", "pcie-p2p": "PCIe peer-to-peer, ACS, IOMMU",
    "cuda-error": "CUDA errors", "gpu-memory": "GPU memory", "gpu-hardware": "GPU hardware faults, Xid",
    "launch": "Launch and rendezvous", "slurm": "SLURM", "storage": "Storage and checkpoints",
    "numerics": "Numerical instability", "dataloader": "Data loaders", "performance": "Performance",
}

STYLE = """
:root { --fg:#1d2330; --muted:#5b6475; --line:#dde2ea; --bg:#f7f8fb; --accent:#1f5fbf; --code:#eef1f6; }
* { box-sizing: border-box; }
body { margin:0; font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;
       color:var(--fg); background:var(--bg); }
header { background:#16213a; color:#fff; padding:14px 24px; display:flex; gap:18px; align-items:center; flex-wrap:wrap; }
header a { color:#fff; text-decoration:none; font-weight:600; font-size:18px; }
header .sub { color:#b8c2d8; font-size:13px; }
main { max-width:980px; margin:0 auto; padding:20px 24px 48px; }
input[type=search] { width:100%; font-size:16px; padding:10px 12px; border:1px solid #b9c2d0; border-radius:8px;
                     background:#fff; }
input[type=search]:focus { outline:2px solid var(--accent); border-color:var(--accent); }
.hint { color:var(--muted); font-size:13px; margin:6px 2px 16px; }
#results { list-style:none; padding:0; margin:0 0 24px; }
#results li { background:#fff; border:1px solid var(--line); border-radius:8px; padding:10px 14px; margin:8px 0; }
#results li a { font-weight:600; color:var(--accent); text-decoration:none; }
#results .why { color:var(--muted); font-size:13.5px; margin-top:3px; }
.badge { display:inline-block; font-size:11.5px; color:#33415c; background:#e6ebf3; border-radius:10px;
         padding:1px 8px; margin-left:6px; vertical-align:1px; }
section.cat { background:#fff; border:1px solid var(--line); border-radius:8px; padding:6px 16px 10px; margin:14px 0; }
section.cat h2 { font-size:16px; margin:10px 0 6px; }
section.cat ul { margin:0; padding-left:18px; columns:2; column-gap:28px; }
section.cat li { break-inside:avoid; margin:2px 0; font-size:14px; }
section.cat a { color:var(--fg); text-decoration:none; }
section.cat a:hover, #results a:hover { text-decoration:underline; }
article { background:#fff; border:1px solid var(--line); border-radius:8px; padding:6px 22px 18px; }
article h1 { font-size:22px; line-height:1.3; margin:14px 0 4px; }
article h2 { font-size:16px; margin:20px 0 6px; border-bottom:1px solid var(--line); padding-bottom:3px; }
.meta { color:var(--muted); font-size:13px; }
code, pre { font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace; font-size:13px; background:var(--code);
            border-radius:4px; }
code { padding:1px 4px; }
pre { padding:8px 10px; overflow-x:auto; white-space:pre-wrap; word-break:break-word; }
ul.symptoms { padding-left:18px; }
ul.symptoms li { margin:4px 0; }
ul.symptoms li code { display:block; padding:4px 8px; white-space:pre-wrap; word-break:break-word; }
footer { color:var(--muted); font-size:12px; text-align:center; padding:16px; }
@media (max-width:700px) { section.cat ul { columns:1; } }
"""

# Client-side search: weighted word matching over the embedded index, plus a bonus when a whole
# symptom phrase appears in the query (a pasted error line). Runs on input and on ?q= at load.
SCRIPT = r"""
(function () {
  var data = JSON.parse(document.getElementById('index-data').textContent);
  var STOP = new Set('a an and are as at be by for from has have in is it of on or that the this to was were with when not no'.split(' '));
  function words(text) {
    return (text.toLowerCase().match(/[a-z0-9]+/g) || []).filter(function (w) {
      return w.length > 1 && !STOP.has(w) && !/^\d+$/.test(w) && !/^0x/.test(w);
    });
  }
  data.forEach(function (e) {
    e._fields = [[words(e.title), 4], [words(e.symptoms.join(' ')), 4], [words(e.tags.join(' ') + ' ' + e.id + ' ' + e.category), 3],
                 [words(e.cause), 1.5], [words(e.fix.join(' ') + ' ' + e.confirm.join(' ')), 0.7]];
    e._sets = e._fields.map(function (f) { return new Set(f[0]); });
    e._phrases = e.symptoms.map(function (s) { return s.toLowerCase().replace(/[0-9]+/g, '#'); });
  });
  var df = {};
  data.forEach(function (e) {
    var seen = new Set(); e._sets.forEach(function (s) { s.forEach(function (w) { seen.add(w); }); });
    seen.forEach(function (w) { df[w] = (df[w] || 0) + 1; });
  });
  function prefixMatch(set, w) {
    if (set.has(w)) return 1;
    if (w.length < 4) return 0;
    for (var x of set) { if (x.length > w.length && x.indexOf(w) === 0) return 0.6; }
    return 0;
  }
  function search(q) {
    var qw = Array.from(new Set(words(q))).slice(0, 200);
    var qn = q.toLowerCase().replace(/[0-9]+/g, '#');
    var scored = [];
    data.forEach(function (e) {
      var s = 0;
      qw.forEach(function (w) {
        var idf = Math.log(1 + data.length / (df[w] || 0.5));
        e._fields.forEach(function (f, i) { s += f[1] * idf * prefixMatch(e._sets[i], w); });
      });
      e._phrases.forEach(function (p) {
        var core = p.length > 40 ? p.slice(0, 40) : p;
        if (core.length > 12 && qn.indexOf(core) >= 0) s += 40;
      });
      if (s > 0) scored.push([s, e]);
    });
    scored.sort(function (a, b) { return b[0] - a[0]; });
    return scored.slice(0, 12);
  }
  var box = document.getElementById('q'), list = document.getElementById('results'), hint = document.getElementById('hint');
  function show(q) {
    list.innerHTML = '';
    if (!q.trim()) { hint.textContent = data.length + ' entries. Paste an error line or describe the symptom.'; return; }
    var found = search(q);
    hint.textContent = found.length ? found.length + ' matching entries' : 'no entry matches; try the exact error line';
    found.forEach(function (pair) {
      var e = pair[1], li = document.createElement('li'), a = document.createElement('a');
      a.href = 'entries/' + e.id + '.html'; a.textContent = e.title; li.appendChild(a);
      var b = document.createElement('span'); b.className = 'badge'; b.textContent = e.category; li.appendChild(b);
      var why = document.createElement('div'); why.className = 'why'; why.textContent = e.cause; li.appendChild(why);
      li.setAttribute('data-id', e.id); list.appendChild(li);
    });
  }
  box.addEventListener('input', function () { show(box.value); });
  var params = new URLSearchParams(window.location.search);
  if (params.get('q')) { box.value = params.get('q'); }
  show(box.value);
})();
"""


def _inline(text: str) -> str:
    """Escape, then render `code` spans and bare URLs."""
    parts = re.split(r"(`[^`]+`)", text)
    out = []
    for part in parts:
        if part.startswith("`") and part.endswith("`") and len(part) > 1:
            out.append(f"<code>{html.escape(part[1:-1])}</code>")
        else:
            escaped = html.escape(part)
            out.append(re.sub(r"(https?://[^\s<)]+)", r'<a href="\1">\1</a>', escaped))
    return "".join(out)


def markdown(text: str) -> str:
    """The small Markdown subset entry bodies use: paragraphs, lists, fenced code, `code`."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    paragraph: list[str] = []

    def flush() -> None:
        if paragraph:
            out.append(f"<p>{_inline(' '.join(paragraph))}</p>")
            paragraph.clear()

    while i < len(lines):
        line = lines[i]
        if line.strip().startswith("```"):
            flush()
            block = []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith("```"):
                block.append(lines[i])
                i += 1
            out.append(f"<pre>{html.escape(chr(10).join(block))}</pre>")
        elif re.match(r"\s*[-*] ", line):
            flush()
            items = []
            while i < len(lines) and re.match(r"\s*[-*] ", lines[i]):
                items.append(re.sub(r"^\s*[-*] ", "", lines[i]))
                i += 1
            out.append("<ul>" + "".join(f"<li>{_inline(x)}</li>" for x in items) + "</ul>")
            continue
        elif not line.strip():
            flush()
        else:
            paragraph.append(line.strip())
        i += 1
    flush()
    return "\n".join(out)


def _page(title: str, body: str, root: str, extra_script: str = "") -> str:
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)}</title>
<style>{STYLE}</style></head>
<body>
<header><a href="{root}index.html">mleng handbook</a>
<span class="sub">pitfalls of large-model training on GPU clusters: symptoms, causes, checks, fixes</span></header>
<main>
{body}
</main>
<footer>generated by mleng {html.escape(__version__)} &middot; <code>mleng handbook site</code></footer>
{extra_script}
</body></html>
"""


def _list(items: list[str], css: str = "") -> str:
    cls = f' class="{css}"' if css else ""
    return f"<ul{cls}>" + "".join(f"<li>{_inline(x)}</li>" for x in items) + "</ul>"


def entry_page(entry: dict, known_ids: set[str]) -> str:
    applies = entry["applies_to"]
    parts = [f"<article><h1>{html.escape(entry['title'])}</h1>",
             f"<div class=\"meta\">id <code>{html.escape(entry['id'])}</code> &middot; "
             f"<a href=\"../index.html#{html.escape(entry['category'])}\">{html.escape(entry['category'])}</a> &middot; "
             f"applies to: {html.escape(applies.get('software', '-'))}; {html.escape(applies.get('hardware', '-'))}</div>",
             "<h2>Symptoms</h2><ul class=\"symptoms\">" +
             "".join(f"<li><code>{html.escape(s)}</code></li>" for s in entry["symptoms"]) + "</ul>",
             f"<h2>Cause</h2><p>{_inline(entry['cause'])}</p>",
             "<h2>Confirm</h2>" + "".join(f"<pre>{html.escape(c)}</pre>" for c in entry["confirm"]),
             "<h2>Fix</h2>" + _list(entry["fix"])]
    for heading, text in entry["sections"].items():
        parts.append(f"<h2>{html.escape(heading)}</h2>{markdown(text)}")
    parts.append("<h2>Sources</h2><ul>" + "".join(
        f'<li><a href="{html.escape(u)}">{html.escape(u)}</a></li>' for u in entry["sources"]) + "</ul>")
    related = [r for r in entry.get("related") or [] if r in known_ids]
    if related:
        parts.append("<h2>Related</h2><ul>" + "".join(
            f'<li><a href="{html.escape(r)}.html">{html.escape(r)}</a></li>' for r in related) + "</ul>")
    if entry.get("reproduction"):
        parts.append(f"<p class=\"meta\">Reproduced on CPU by <code>{html.escape(entry['reproduction'])}</code>.</p>")
    parts.append("</article>")
    return _page(entry["title"], "\n".join(parts), "../")


def search_index(entries: list[dict]) -> list[dict]:
    keys = ("id", "title", "category", "symptoms", "cause", "confirm", "fix", "tags")
    return [{k: e.get(k, []) for k in keys} for e in entries]


def index_page(entries: list[dict]) -> str:
    by_category: dict[str, list[dict]] = {}
    for e in sorted(entries, key=lambda e: e["title"].lower()):
        by_category.setdefault(e["category"], []).append(e)
    sections = []
    for category in [c for c in CATEGORIES if c in by_category] + sorted(set(by_category) - set(CATEGORIES)):
        items = "".join(f'<li><a href="entries/{html.escape(e["id"])}.html">{html.escape(e["title"])}</a></li>'
                        for e in by_category[category])
        title = CATEGORY_TITLES.get(category, category)
        sections.append(f'<section class="cat" id="{html.escape(category)}"><h2>{html.escape(title)} '
                        f'<span class="badge">{len(by_category[category])}</span></h2><ul>{items}</ul></section>')
    data = json.dumps(search_index(entries), ensure_ascii=False).replace("</", "<\\/")
    body = ('<input type="search" id="q" placeholder="Paste an error line or describe what you see, '
            'e.g. NCCL error: unhandled system error" autofocus>'
            '<div class="hint" id="hint"></div><ul id="results"></ul>' + "\n".join(sections))
    script = (f'<script id="index-data" type="application/json">{data}</script>\n'
              f"<script>{SCRIPT}</script>")
    return _page("mleng handbook", body, "", script)


def write_site(entries: list[dict], out: Path) -> Path:
    """Write OUT/index.html and OUT/entries/<id>.html; return the index path."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "entries").mkdir(exist_ok=True)
    known = {e["id"] for e in entries}
    for e in entries:
        (out / "entries" / f"{e['id']}.html").write_text(entry_page(e, known), encoding="utf-8")
    index = out / "index.html"
    index.write_text(index_page(entries), encoding="utf-8")
    return index
