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

# Client-side search: search.py's search() ported to JavaScript over the data search_data() embeds:
# the same terms, Porter stems (stem.py), BM25, signature, code and phrase scores and `confident` rule.
SCRIPT = r"""
(function () {
  var D = JSON.parse(document.getElementById('index-data').textContent);
  var C = D.config, Q = D.query;
  var GPUNUM = new Set(Q.gpu_model_numbers);
  var STOP = new Set(Q.stopwords), CANON = new Map(Q.canonical), DOMAIN = new Set(Q.domain);
  var BRIT = new RegExp(Q.british), PHRASES = Q.phrases.map(function (p) { return [new RegExp(p[0], 'g'), p[1]]; }), CJK = new RegExp(Q.cjk, 'g');
  var TOKEN = /[\p{L}\p{N}\p{M}]+/gu, HEX = new RegExp('^(?:' + Q.hex + ')$'), LD = new RegExp('^(?:' + Q.letters_digits + ')$');
  var SYSPATH = new RegExp(Q.system_path, 'g'), PATH = new RegExp(Q.path, 'g');
  var FRAME = new RegExp(Q.frame), CARET = new RegExp(Q.caret), CLAUSE = new RegExp(Q.clause, 'i'), ASIDE = new RegExp(Q.aside, 'i'), PASTED = new RegExp(Q.pasted_error);
  var CODES = Q.codes.map(function (c) { return [new RegExp(c[0], 'g' + c[1]), c[2]]; });
  var SIGWORD = new RegExp(Q.signal_word_re, 'gi'), SIGNAMES = new Map(Q.signal_names), SIGWORDS = new Map(Q.signal_words);
  var FW = new Map(Q.framework.map(function (f) { return [f[0], new Set(f[1])]; }));
  var CW = new Map(Q.code_weights);
  var ENTRIES = D.entries.map(function (e) {
    return {rowid: e[0], id: e[1], title: e[2], category: e[3], tags: e[4],
            sigs: e[5].map(function (s) { return {re: new RegExp(s[0], s[1]), lit: s[2], anchor: s[3], src: s[4]}; }),
            codes: e[6], shingles: new Set(e[7]), reports: e[8]};
  });
  // Where a query's score can come from, by entry: an entry reached by none of these (and no BM25 term) scores 0.
  var CODE_DF = new Map(), BY_CODE = new Map(), BY_ANCHOR = new Map(), BY_SHINGLE = new Map(), ALWAYS = [];
  function file(map, key, e) { if (!map.has(key)) map.set(key, []); map.get(key).push(e); }
  ENTRIES.forEach(function (e) {
    e.codes.forEach(function (c) { CODE_DF.set(c, (CODE_DF.get(c) || 0) + 1); file(BY_CODE, c, e); });
    e.shingles.forEach(function (sh) { file(BY_SHINGLE, sh, e); });
    var always = false;
    e.sigs.forEach(function (sg) { if (!sg.anchor) always = true; else sg.anchor.forEach(function (a) { file(BY_ANCHOR, a, e); }); });
    if (always) ALWAYS.push(e);
  });
  var LENGTHS = D.lengths, AVG = 0, NROWS = 0;
  Object.keys(LENGTHS).forEach(function (k) { AVG += LENGTHS[k]; NROWS += 1; });
  AVG = AVG / Math.max(1, NROWS);
  var POST = D.postings;
  // --- Porter (1980), as stem.py ---
  function cons(w, i) { var c = w[i]; if ('aeiou'.indexOf(c) >= 0) return false; if (c === 'y') return i === 0 || !cons(w, i - 1); return true; }
  function measure(w) { var n = 0, i = 0, L = w.length; while (i < L && cons(w, i)) i++;
    while (i < L) { while (i < L && !cons(w, i)) i++; if (i >= L) break; n++; while (i < L && cons(w, i)) i++; } return n; }
  function hasVowel(w) { for (var i = 0; i < w.length; i++) if (!cons(w, i)) return true; return false; }
  function dbl(w) { return w.length >= 2 && w[w.length - 1] === w[w.length - 2] && cons(w, w.length - 1); }
  function cvc(w) { var L = w.length; return L >= 3 && cons(w, L - 3) && !cons(w, L - 2) && cons(w, L - 1) && 'wxy'.indexOf(w[L - 1]) < 0; }
  function ends(w, s) { return w.length >= s.length && w.slice(w.length - s.length) === s; }
  var S2 = [['ational','ate'],['tional','tion'],['enci','ence'],['anci','ance'],['izer','ize'],['abli','able'],['alli','al'],
    ['entli','ent'],['eli','e'],['ousli','ous'],['ization','ize'],['ation','ate'],['ator','ate'],['alism','al'],['iveness','ive'],
    ['fulness','ful'],['ousness','ous'],['aliti','al'],['iviti','ive'],['biliti','ble']];
  var S3 = [['icate','ic'],['ative',''],['alize','al'],['iciti','ic'],['ical','ic'],['ful',''],['ness','']];
  var S4 = ['al','ance','ence','er','ic','able','ible','ant','ement','ment','ent','ion','ou','ism','ate','iti','ous','ive','ize'];
  function repl(w, rules) { for (var i = 0; i < rules.length; i++) { var s = rules[i][0];
    if (ends(w, s)) { var st = w.slice(0, w.length - s.length); return measure(st) > 0 ? st + rules[i][1] : w; } } return w; }
  var stemCache = new Map();
  function stem(word) {
    if (word.length <= 2 || !/^[a-z]+$/.test(word)) return word;
    var hit = stemCache.get(word); if (hit !== undefined) return hit;
    var w = word;
    if (ends(w, 'sses') || ends(w, 'ies')) w = w.slice(0, -2); else if (ends(w, 'ss')) {} else if (ends(w, 's')) w = w.slice(0, -1);
    var again = false;
    if (ends(w, 'eed')) { if (measure(w.slice(0, -3)) > 0) w = w.slice(0, -1); }
    else if (ends(w, 'ed') && hasVowel(w.slice(0, -2))) { w = w.slice(0, -2); again = true; }
    else if (ends(w, 'ing') && hasVowel(w.slice(0, -3))) { w = w.slice(0, -3); again = true; }
    if (again) {
      if (ends(w, 'at') || ends(w, 'bl') || ends(w, 'iz')) w += 'e';
      else if (dbl(w) && 'lsz'.indexOf(w[w.length - 1]) < 0) w = w.slice(0, -1);
      else if (measure(w) === 1 && cvc(w)) w += 'e';
    }
    if (ends(w, 'y') && hasVowel(w.slice(0, -1))) w = w.slice(0, -1) + 'i';
    w = repl(w, S2); w = repl(w, S3);
    for (var i = 0; i < S4.length; i++) { var s = S4[i];
      if (ends(w, s)) { var st = w.slice(0, w.length - s.length);
        if (measure(st) > 1 && (s !== 'ion' || ends(st, 's') || ends(st, 't'))) w = st; break; } }
    if (ends(w, 'e')) { var m = measure(w.slice(0, -1)); if (m > 1 || (m === 1 && !cvc(w.slice(0, -1)))) w = w.slice(0, -1); }
    if (measure(w) > 1 && dbl(w) && ends(w, 'l')) w = w.slice(0, -1);
    stemCache.set(word, w); return w;
  }
  // --- terms.py ---
  function isDigits(t) { return /^[0-9]+$/.test(t); }
  function tokenTerms(token) {
    if (GPUNUM.has(token)) return [token];
    if (token.length < 2 || isDigits(token) || STOP.has(token)) return [];
    if (/^[0-9]/.test(token) && (token.match(/\p{L}/gu) || []).length < 2) return [];
    if (token.indexOf('0x') === 0 || (token.length >= 6 && HEX.test(token))) return [];
    var b = BRIT.exec(token); if (b) token = b[1] + 'iz' + b[2];
    var c = CANON.get(token); if (c) return [token, c];
    var m = LD.exec(token);
    if (m && !STOP.has(m[1])) { var n = token.slice(m[1].length); return GPUNUM.has(n) ? [token, m[1], n] : [token, m[1]]; }
    return [token];
  }
  function terms(text) {
    text = text.toLowerCase().replace(SYSPATH, function (m) { return m.split('/').join(' ') + ' ' + m.split('/').slice(1, 3).join(''); }).replace(PATH, ' ');
    if (/[^\x00-\x7f]/.test(text)) {
      Q.chinese.forEach(function (p) { text = text.split(p[0]).join(' ' + p[1] + ' '); });
      text = text.replace(CJK, ' ');
    }
    PHRASES.forEach(function (p) { text = text.replace(p[0], p[1]); });
    var out = []; (text.match(TOKEN) || []).forEach(function (t) { tokenTerms(t).forEach(function (x) { out.push(x); }); });
    return out;
  }
  function shingles(words, n) { var s = new Set(); for (var i = 0; i + n <= words.length; i++) s.add(words.slice(i, i + n).join(' ')); return s; }
  function errorCodes(text) {
    var codes = new Set();
    CODES.forEach(function (c) {
      c[0].lastIndex = 0; var m;
      while ((m = c[0].exec(text)) !== null) {
        if (m[0] === '') c[0].lastIndex++;
        var g = m.slice(1).filter(function (x) { return x !== undefined; });
        if (!g.length) continue;
        var code = c[1].replace(/\{(\d)\}/g, function (_, i) { return g[+i].toLowerCase(); });
        codes.add(code);
        if (c[1] === 'exitcode {0}' && g[0][0] === '-') addSignal(codes, parseInt(g[0].slice(1), 10));
        else if (c[1] === 'exit {0}') addSignal(codes, parseInt(g[0], 10) - 128);
        else if (c[1] === 'signal {0}') addSignal(codes, parseInt(g[0], 10));
      }
    });
    var low = text.toLowerCase();
    Q.strerror.forEach(function (s) { if (low.indexOf(s[0]) >= 0) codes.add(s[1]); });
    Q.cuda.forEach(function (s) { if (low.indexOf(s[0]) >= 0) codes.add('cuda error ' + s[1]); });
    if (low.indexOf('nccl') >= 0) Q.nccl.forEach(function (s) { if (low.indexOf(s[0]) >= 0) codes.add('nccl error ' + s[1]); });
    SIGWORD.lastIndex = 0; var m2;
    while ((m2 = SIGWORD.exec(text)) !== null) {
      var w = m2.slice(1).filter(function (x) { return x !== undefined; })[0].toLowerCase(); codes.add(SIGWORDS.get(w));
    }
    return codes;
  }
  function addSignal(codes, n) { var name = SIGNAMES.get(n); if (name) codes.add(name); }
  function codeWeight(code) {
    var kind = code.split(' ')[0];
    if (code.indexOf('source ') === 0 && code.indexOf(':') < 0) return 0.4;
    return CW.has(kind) ? CW.get(kind) : 1.5;
  }
  function domainWords(words) { var s = new Set(); words.forEach(function (w) {
    if (DOMAIN.has(w) || Q.prefixes.some(function (p) { return w.indexOf(p) === 0; })) s.add(w); }); return s; }
  // --- search.py ---
  var SPLIT = /\r\n|[\n\r\v\f\x1c-\x1e\x85\u2028\u2029]/;
  function splitlines(q) { var ls = q.split(SPLIT); if (ls.length && ls[ls.length - 1] === '') ls.pop(); return ls; }
  function queryWeights(query) {
    var weights = new Map(), after = false, lines = splitlines(query); if (!lines.length) lines = [query];
    lines.forEach(function (line) {
      if (CARET.test(line)) return;
      var weight;
      if (FRAME.test(line)) { weight = C.frame_weight; after = true; }
      else if (after && /^\s/.test(line)) { weight = C.frame_weight; after = false; }
      else { weight = 1.0; after = false; }
      line.split(CLAUSE).forEach(function (clause) {
        var cw = ASIDE.test(clause) ? weight * C.aside_weight : weight;
        terms(clause).forEach(function (w) { weights.set(w, Math.max(weights.has(w) ? weights.get(w) : 0, cw)); });
      });
    });
    return weights;
  }
  function idf(qt, s) { var n = qt.df.get(s) || 0; return Math.log(1 + (qt.entries - n + 0.5) / (n + 0.5)); }
  function search(query, limit) {
    limit = limit || 5;
    query = query.slice(0, C.max_query_chars);
    var words = terms(query), weighted = queryWeights(query), columns = new Map();
    var qt = {weight: new Map(), word: new Map(), df: new Map(), entries: NROWS};
    Array.from(weighted.keys()).slice(0, C.max_query_terms).forEach(function (w) {
      var s = stem(w);
      if (weighted.get(w) > (qt.weight.has(s) ? qt.weight.get(s) : 0)) { qt.weight.set(s, weighted.get(w)); qt.word.set(s, w); }
    });
    var bm25 = new Map();
    qt.weight.forEach(function (wt, term) {
      var rows = Object.prototype.hasOwnProperty.call(POST, term) ? POST[term] : null; if (!rows) return;
      var per = new Map();
      rows.forEach(function (p) {
        per.set(p[0], (per.get(p[0]) || 0) + C.column_weights[p[1]] * p[2]);
        if (!columns.has(p[0])) columns.set(p[0], new Map());
        var cm = columns.get(p[0]); if (!cm.has(term)) cm.set(term, new Set()); cm.get(term).add(p[1]);
      });
      qt.df.set(term, per.size);
      var i = idf(qt, term);
      per.forEach(function (f, row) {
        var norm = C.k1 * (1 - C.b + C.b * LENGTHS[row] / AVG);
        bm25.set(row, (bm25.get(row) || 0) + wt * i * f * (C.k1 + 1) / (f + norm));
      });
    });
    var best = 0; bm25.forEach(function (v) { if (v > best) best = v; });
    var lines = splitlines(query).filter(function (l) { return l.trim(); }); if (!lines.length) lines = [query];
    var lowered = query.toLowerCase(), qcodes = errorCodes(query), qsh = shingles(words, 3), qpairs = shingles(words, 2);
    var short = qt.weight.size <= C.short_query_terms, domain = Array.from(domainWords(words)).sort(), wordSet = new Set(words);
    var pasted = PASTED.test(query);
    var reach = new Set(bm25.keys());
    function add(list) { if (list) list.forEach(function (e) { reach.add(e.rowid); }); }
    ALWAYS.forEach(function (e) { reach.add(e.rowid); });
    BY_ANCHOR.forEach(function (list, a) { if (lowered.indexOf(a) >= 0) add(list); });
    qcodes.forEach(function (c) { add(BY_CODE.get(c)); });
    qsh.forEach(function (sh) { add(BY_SHINGLE.get(sh)); });
    qpairs.forEach(function (sh) { add(BY_SHINGLE.get(sh)); });
    var scored = [];
    ENTRIES.forEach(function (e) {
      if (!reach.has(e.rowid)) return;
      var text = best > 0 ? (bm25.get(e.rowid) || 0) / best : 0;
      var found = [], hits = [];
      e.sigs.forEach(function (s) {
        if (s.anchor && !s.anchor.some(function (a) { return lowered.indexOf(a) >= 0; })) return;
        for (var i = 0; i < lines.length; i++) { var m = s.re.exec(lines[i]);
          if (m) { found.push(0.5 + 0.5 * Math.min(1, s.lit / Math.max(1, m[0].length))); hits.push(s.src); break; } }
      });
      found.sort(function (a, b) { return b - a; });
      var sig = C.signature_weight * found.slice(0, C.max_signature_hits).reduce(function (a, b) { return a + b; }, 0);
      var shared = e.codes.filter(function (c) { return qcodes.has(c); }).sort();
      var code = shared.reduce(function (a, c) { return a + codeWeight(c) / Math.sqrt(CODE_DF.get(c)); }, 0);
      var nph = 0, whole = 0; qsh.forEach(function (s) { if (e.shingles.has(s)) nph++; });
      qpairs.forEach(function (s) { if (e.shingles.has(s)) whole++; }); nph += whole;
      var phrase = C.phrase_weight * Math.min(nph, C.phrase_saturation) / C.phrase_saturation;
      var fw = FW.get(e.category);
      if (fw && !sig && !whole && !Array.from(fw).some(function (w) { return wordSet.has(w); })) { text *= C.other_framework_factor; phrase *= C.other_framework_factor; }
      var general = short && e.tags.indexOf('general') >= 0 ? C.general_weight * text : 0;
      var baseRate = short || sig || code ? 0 : C.report_weight * text * Math.log1p(e.reports);
      var score = text + sig + code + phrase + general + baseRate;
      if (score > 0) scored.push([score, e, hits, shared, nph]);
    });
    scored.sort(function (a, b) { return b[0] - a[0] || (a[1].id < b[1].id ? -1 : a[1].id > b[1].id ? 1 : 0); });
    var results = scored.slice(0, limit).map(function (s) {
      var e = s[1], cols = columns.get(e.rowid) || new Map(), strong = [], total = 0, strongMass = 0, strongIdf = 0;
      qt.weight.forEach(function (w, t) { total += w * idf(qt, t); });
      cols.forEach(function (cs, t) { if (Array.from(cs).some(function (c) { return C.strong_columns.indexOf(c) >= 0; })) strong.push(t); });
      strong.forEach(function (t) { strongMass += qt.weight.get(t) * idf(qt, t); strongIdf += idf(qt, t); });
      var match = {signatures: s[2], codes: s[3], phrases: s[4], coverage: strongMass / (total || 1), strong_idf: strongIdf,
                   domain: domain, general: short && e.tags.indexOf('general') >= 0, pasted_error: pasted};
      return {id: e.id, title: e.title, category: e.category, score: Math.round(s[0] * 1e4) / 1e4, confident: confident(match)};
    });
    return {confident: results.length > 0 && results[0].confident, results: results};
  }
  function confident(m) {
    if (m.codes.some(function (c) { return C.specific_codes.some(function (k) { return c.indexOf(k) === 0; }) || (c.indexOf('source ') === 0 && c.indexOf(':') >= 0); })) return true;
    if (m.signatures.length && (m.domain.length || (m.coverage >= C.near_verbatim_coverage && m.phrases >= C.near_verbatim_phrases))) return true;
    if (!m.domain.length) return false;
    if (m.general && m.coverage >= C.near_verbatim_coverage) return true;
    if (m.pasted_error && !m.phrases) return false;
    return (m.coverage >= C.min_coverage && m.strong_idf >= C.min_strong_idf) ||
      (m.coverage >= C.high_coverage && m.strong_idf >= C.high_coverage_idf) || m.phrases >= C.min_shared_phrases;
  }
  window.mlengSearch = search;
  var box = document.getElementById('q'), list = document.getElementById('results'), hint = document.getElementById('hint');
  function show(q) {
    list.innerHTML = '';
    if (!q.trim()) { hint.textContent = ENTRIES.length + ' entries. Paste an error line or describe the symptom.'; return; }
    var found = search(q, 5);
    hint.textContent = !found.results.length ? 'no entry matches; try the exact error line'
      : found.confident ? found.results.length + ' matching entries' : 'no confident match; the closest entries:';
    list.setAttribute('data-confident', found.confident ? 'true' : 'false');
    found.results.forEach(function (r) {
      var li = document.createElement('li'), a = document.createElement('a');
      a.href = 'entries/' + r.id + '.html'; a.textContent = r.title; li.appendChild(a);
      var b = document.createElement('span'); b.className = 'badge'; b.textContent = r.category; li.appendChild(b);
      var sc = document.createElement('span'); sc.className = 'badge'; sc.textContent = 'score ' + r.score.toFixed(2); li.appendChild(sc);
      li.setAttribute('data-id', r.id); list.appendChild(li);
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


def js_regex(pattern: str) -> tuple[str, str] | None:
    """(source, flags) of a JavaScript RegExp that matches as the Python regex does, or None when the
    pattern uses what JavaScript lacks (atomic groups, possessive repeats, \\Z inside, verbose mode)."""
    flags = ""
    lead = re.match(r"\(\?([aiLmsux]+)\)", pattern)
    if lead:
        if set(lead.group(1)) - set("ims"):
            return None
        flags = "".join(sorted(set(lead.group(1))))
        pattern = pattern[lead.end():]
    if re.search(r"\(\?[aiLmsux]+[:)]|\(\?>|[*+?}]\+|\(\?\(|\\[AZ]", pattern.replace("\\\\", "")):
        if not re.search(r"\(\?[aiLmsux]+[:)]|\(\?>|[*+?}]\+|\(\?\(", pattern.replace("\\\\", "")):
            pattern = re.sub(r"(?<!\\)\\A", "^", re.sub(r"(?<!\\)\\Z", "$", pattern))
        else:
            return None
    pattern = re.sub(r"\(\?P<(\w+)>", r"(?<\1>", pattern)
    pattern = re.sub(r"\(\?P=(\w+)\)", r"\\k<\1>", pattern)
    return pattern, flags


def search_data(entries: list[dict]) -> dict:
    """What the page's search needs, compact: entries, postings, lengths, weights and the query-side rules."""
    from mleng.handbook import search as S
    from mleng.handbook import terms as T
    from mleng.handbook.index import (FTS_COLUMNS, entry_codes, entry_columns, report_counts, symptom_terms,
                                      term_rows)

    rows, postings, lengths, skipped = [], {}, {}, []
    reports = report_counts()
    for rowid, e in enumerate(entries, start=1):
        lines = symptom_terms(e)
        columns = entry_columns(e, lines)
        lengths[rowid] = sum(len(words) for words in columns)
        for term, *counts, _ in term_rows(columns):
            postings.setdefault(term, []).extend([rowid, col, tf] for col, tf in enumerate(counts) if tf)
        shingle_set = T.entry_shingles(columns[FTS_COLUMNS.index("title")], lines)
        sigs = []
        for pattern in e["signatures"]:
            converted = js_regex(pattern)
            if converted is None:
                skipped.append([e["id"], pattern])
                continue
            sigs.append([converted[0], converted[1], T.literal_length(pattern), T.regex_anchor(pattern), pattern])
        rows.append([rowid, e["id"], e["title"], e["category"], e["tags"], sigs, sorted(entry_codes(e)),
                     sorted(shingle_set), reports.get(e["id"], 0)])
    config = {"column_weights": [S.COLUMN_WEIGHTS[c] for c in FTS_COLUMNS], "k1": S.BM25_K1, "b": S.BM25_B,
              "signature_weight": S.SIGNATURE_WEIGHT, "max_signature_hits": S.MAX_SIGNATURE_HITS,
              "phrase_weight": S.PHRASE_WEIGHT, "phrase_saturation": S.PHRASE_SATURATION,
              "max_query_terms": S.MAX_QUERY_TERMS, "max_query_chars": S.MAX_QUERY_CHARS,
              "frame_weight": S.FRAME_WEIGHT, "aside_weight": S.ASIDE_WEIGHT,
              "short_query_terms": S.SHORT_QUERY_TERMS, "other_framework_factor": S.OTHER_FRAMEWORK_FACTOR,
              "general_weight": S.GENERAL_WEIGHT, "report_weight": S.REPORT_WEIGHT,
              "specific_codes": list(S.SPECIFIC_CODE_KINDS),
              "min_coverage": S.MIN_COVERAGE, "min_strong_idf": S.MIN_STRONG_IDF,
              "min_shared_phrases": S.MIN_SHARED_PHRASES, "high_coverage": S.HIGH_COVERAGE,
              "high_coverage_idf": S.HIGH_COVERAGE_IDF,
              "near_verbatim_coverage": S.NEAR_VERBATIM_COVERAGE, "near_verbatim_phrases": S.NEAR_VERBATIM_PHRASES,
              "strong_columns": sorted(S.STRONG_COLUMNS)}
    codes = []
    for pattern, template, _ in T._CODE_PATTERNS:
        source, flags = js_regex(pattern.pattern)
        codes.append([source, flags + ("i" if pattern.flags & re.I else ""), template])
    query = {"stopwords": sorted(T.STOPWORDS), "gpu_model_numbers": sorted(T.GPU_MODEL_NUMBERS), "canonical": sorted(T._CANONICAL.items()),
             "british": T._BRITISH_RE.pattern, "phrases": [[p.pattern, r] for p, _, r in T._PHRASES], "cjk": T._CJK_RE.pattern,
             "chinese": [list(pair) for pair in T.CHINESE_WORDS],
             "hex": T._HEX_RE.pattern, "letters_digits": T._LETTERS_DIGITS_RE.pattern,
             "system_path": T._SYSTEM_PATH_RE.pattern, "path": T._PATH_RE.pattern,
             "frame": S._FRAME_RE.pattern, "caret": S._CARET_RE.pattern, "clause": S._CLAUSE_RE.pattern,
             "aside": S._ASIDE_RE.pattern, "pasted_error": S._PASTED_ERROR_RE.pattern, "codes": codes, "strerror": T._STRERROR,
             "cuda": sorted(T._CUDA_MESSAGES.items()), "nccl": sorted(T._NCCL_RESULTS.items()),
             "signal_words": sorted(T._SIGNAL_WORDS.items()), "signal_word_re": T._SIGNAL_WORD_RE.pattern,
             "signal_names": sorted(T._SIGNAL_NAMES.items()), "domain": sorted(T.DOMAIN_WORDS),
             "prefixes": list(T._DOMAIN_PREFIXES),
             "framework": [[k, sorted(v)] for k, v in T.FRAMEWORK_WORDS.items()],
             "code_weights": [[k, T.code_weight(k + " 1:1")] for k in
                              ("xid", "cuda", "nccl", "source", "errno", "vendor", "error", "status", "signal", "exit", "exitcode")]}
    return {"entries": rows, "postings": postings, "lengths": lengths, "config": config, "query": query,
            "skipped_signatures": skipped}


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
    data = json.dumps(search_data(entries), ensure_ascii=False, separators=(",", ":")).replace("</", "<\\/")
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
