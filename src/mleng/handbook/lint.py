"""The handbook linter: every rule of the entry format (the keys, sections and categories of model.py), one
problem per line with what to do."""

from __future__ import annotations

import re
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlparse

from mleng.handbook import default_entries_dir
from mleng.handbook.model import (CATEGORIES, OPTIONAL_KEYS, REQUIRED_KEYS, SECTIONS, VERIFIED_KEYS, EntryError,
                                  entry_files, split_front_matter, split_sections, text_before_sections)
from mleng.handbook.terms import regex_anchor

ID_RE = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")
REPRODUCTION_RE = re.compile(r"(?P<file>[\w./-]+\.py)::(?P<function>\w+)")
MAX_TITLE = 100
MAX_CAUSE_SENTENCES = 3

# A signature that matches one of these words (inside an ordinary line) fires on every training log.
GENERIC_WORDS = ("error", "Error", "ERROR", "warning", "WARNING", "failed", "Failed", "timeout", "Timeout",
                 "timed out", "killed", "Killed", "nan", "NaN", "inf", "hang", "exception", "Exception",
                 "RuntimeError", "fatal", "abort", "slow", "cuda", "CUDA", "nccl", "NCCL", "memory")
BENIGN_LINES = (
    "Traceback (most recent call last):",
    "RuntimeError: ",
    "[rank0]: Traceback (most recent call last):",
    "step 100 | loss 2.3456 | lr 1.0e-04 | grad_norm 0.98 | 153.2 TFLOPS",
    "INFO: training started",
    "Epoch 3/10: 100%|##########| 500/500 [01:23<00:00,  6.01it/s]",
    "NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>",
    "",
)
# Abbreviations whose period does not end a sentence.
_ABBREVIATIONS = re.compile(r"\b(?:e\.g|i\.e|etc|vs|approx|cf|Fig|no)\.", re.I)
_SENTENCE_END = re.compile(r"[.!?](?:\s+(?=[A-Z(\"'`])|\s*$)")


@dataclass
class Problem:
    file: str
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}: {self.field}: {self.message}"

    def to_dict(self) -> dict:
        return asdict(self)


def find_repo_root(start: Path) -> Path | None:
    """The nearest directory above `start` (or the working directory) holding pyproject.toml and tests/."""
    for base in (start.resolve(), Path.cwd().resolve()):
        for candidate in (base, *base.parents):
            if (candidate / "pyproject.toml").is_file() and (candidate / "tests").is_dir():
                return candidate
    return None


def _is_string_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) and v.strip() for v in value)


def _count_sentences(text: str) -> int:
    text = _ABBREVIATIONS.sub("abbr", text.strip())
    return max(1, len(_SENTENCE_END.findall(text)))


def _check_signature(pattern: str, symptoms: list[str], add) -> None:
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        add("signatures", f"regex {pattern!r} does not compile ({exc}); fix the escaping (use single-quoted YAML)")
        return
    if not any(regex.search(s) for s in symptoms):
        add("signatures", f"regex {pattern!r} matches none of the entry's symptoms; add the exact log line it "
                          "is meant for to symptoms or correct the regex")
    # A generic word inside an ordinary line: a pattern that fires there fires everywhere.
    generic = [w for w in GENERIC_WORDS if regex.search(f"step 12 of the loop: {w} while loading shard 3")]
    benign = [line for line in BENIGN_LINES if regex.search(line)]
    if generic or benign:
        example = generic[0] if generic else benign[0]
        add("signatures", f"regex {pattern!r} is too broad: it matches {example!r}; anchor it on the specific "
                          "wording of the error")
    elif regex_anchor(pattern) is None:
        # `mleng triage` finds candidate lines by the literals every match must contain; a pattern without one
        # is run over each whole block of a log instead (a 256 MiB log went from about 440 to 70 MB/s).
        add("signatures", f"regex {pattern!r} has no fixed text that every match contains, so triage runs it "
                          "over every block of a log; split an alternation into one signature per wording")


def lint_file(path: Path, repo_root: Path | None) -> tuple[str | None, list[str], list[Problem]]:
    """(id, related ids, problems) for one entry file; related ids are checked once all ids are known."""
    file = str(path)
    problems: list[Problem] = []

    def add(field: str, message: str) -> None:
        problems.append(Problem(file, field, message))

    try:
        text = path.read_text(encoding="utf-8")
        meta, body = split_front_matter(text, file)
    except (OSError, UnicodeDecodeError) as exc:
        add("file", f"cannot be read as UTF-8 text ({exc})")
        return None, [], problems
    except EntryError as exc:
        add(exc.field, exc.message)
        return None, [], problems

    for key in REQUIRED_KEYS:
        if key not in meta:
            add(key, "required key is missing; add it (required: " + ", ".join(REQUIRED_KEYS) + ")")
    for key in meta:
        if key not in REQUIRED_KEYS and key not in OPTIONAL_KEYS:
            add(str(key), f"unknown key; allowed optional keys are {', '.join(OPTIONAL_KEYS)}: remove or rename it")

    entry_id = meta.get("id")
    if "id" in meta:
        if not isinstance(entry_id, str) or not ID_RE.fullmatch(entry_id):
            add("id", f"{entry_id!r} is not lowercase kebab-case ([a-z0-9]+(-[a-z0-9]+)*)")
            entry_id = None
        elif entry_id != path.stem:
            add("id", f"{entry_id!r} differs from the file name {path.name!r}; rename the file to {entry_id}.md "
                      "or fix the id")

    title = meta.get("title")
    if "title" in meta:
        if not isinstance(title, str) or not title.strip():
            add("title", "must be a non-empty string")
        elif "\n" in title.strip():
            add("title", "must be one line")
        elif len(title) > MAX_TITLE:
            add("title", f"is {len(title)} characters; shorten it to at most {MAX_TITLE}")

    if "category" in meta and meta.get("category") not in CATEGORIES:
        add("category", f"{meta.get('category')!r} is not a category; use one of: {', '.join(CATEGORIES)}")

    symptoms = meta.get("symptoms")
    if "symptoms" in meta and not (_is_string_list(symptoms) and symptoms):
        add("symptoms", "must be a list of at least one non-empty string (exact error lines users see)")
        symptoms = []
    symptoms = symptoms or []

    signatures = meta.get("signatures")
    if "signatures" in meta:
        # An empty list is allowed: an entry with no line a program prints (a silent slowdown, a wrong
        # result) has no signature, and a sentence quoted from a thread must not stand in for one.
        if not (isinstance(signatures, list) and _is_string_list(signatures)):
            add("signatures", "must be a list of regex strings (single-quoted YAML), or [] when no program "
                              "prints a line for this failure")
        else:
            for pattern in signatures:
                _check_signature(pattern, symptoms, add)

    applies_to = meta.get("applies_to")
    if "applies_to" in meta:
        if not isinstance(applies_to, dict):
            add("applies_to", "must be a mapping with 'software' and 'hardware' strings")
        else:
            for part in ("software", "hardware"):
                value = applies_to.get(part)
                if not isinstance(value, str) or not value.strip():
                    add(f"applies_to.{part}", "must be a non-empty string (versions, vendors; 'any' where true)")

    cause = meta.get("cause")
    if "cause" in meta:
        if not isinstance(cause, str) or not cause.strip():
            add("cause", "must be one non-empty string")
        elif _count_sentences(cause) > MAX_CAUSE_SENTENCES:
            add("cause", f"has {_count_sentences(cause)} sentences; keep it to 1-{MAX_CAUSE_SENTENCES} and move "
                         "detail into the '## Why' section")

    for key in ("confirm", "fix"):
        if key in meta and not (_is_string_list(meta[key]) and meta[key]):
            add(key, "must be a list of at least one non-empty string (exact commands, env vars, flags)")

    sources = meta.get("sources")
    if "sources" in meta:
        if not (_is_string_list(sources) and sources):
            add("sources", "must be a list of at least one http(s) URL")
        else:
            for url in sources:
                parsed = urlparse(url.strip())
                if parsed.scheme not in ("http", "https") or not parsed.netloc or " " in url.strip():
                    add("sources", f"{url!r} is not an http(s) URL")
                elif parsed.netloc in ("github.com", "www.github.com") and not _GITHUB_RE.fullmatch(parsed.path):
                    add("sources", f"{url!r} is not a GitHub thread, file or release page "
                                   "(owner/repo/issues/N, pull/N, discussions/N, blob/..., commit/..., releases/...)")
                elif url.rstrip() != url or url.endswith((".", ",", ")", "]")):
                    add("sources", f"{url!r} ends with punctuation; cite the bare URL")

    related = meta.get("related") or []
    if "related" in meta and not (isinstance(related, list) and all(isinstance(r, str) for r in related)):
        add("related", "must be a list of entry ids")
        related = []
    if entry_id and entry_id in related:
        add("related", "an entry must not list itself")

    for key in ("error_codes", "tags"):
        if key in meta and not _is_string_list(meta[key]):
            add(key, "must be a list of non-empty strings")

    if "verified" in meta:
        _check_verified(meta["verified"], add)

    for key in ("confirm", "fix"):
        if _is_string_list(meta.get(key)):
            for item in meta[key]:
                _check_mleng_commands(key, item, add)

    if meta.get("reproduction") is not None:
        _check_reproduction(meta["reproduction"], repo_root, add)

    sections = split_sections(body)
    lead = text_before_sections(body)
    if lead.strip():
        # Nothing reads text there; a front-matter line pasted after the closing '---' ends up in it unparsed.
        add("body", f"text before the first section: {lead.strip().splitlines()[0][:60]!r}; move it into the "
                    "front matter or under a section")
    positions = []
    for name in SECTIONS:
        if name not in sections:
            add("body", f"section '## {name}' is missing; the body needs " +
                ", ".join(f"'## {s}'" for s in SECTIONS) + " in that order")
        else:
            positions.append(list(sections).index(name))
            if not sections[name].strip():
                add("body", f"section '## {name}' is empty; write what belongs there")
    if positions != sorted(positions):
        add("body", "sections are out of order; use " + ", ".join(f"'## {s}'" for s in SECTIONS))
    return entry_id, [r for r in related if isinstance(r, str)], problems


_GITHUB_RE = re.compile(r"/[\w.-]+/[\w.-]+(?:/(?:issues|pull|discussions)/\d+(?:/[\w/-]*)?"
                        r"|/(?:blob|tree|commit|releases|wiki|compare|security)(?:/[^\s]*)?)?/?")
_DATE_RE = re.compile(r"\d{4}-\d{2}-\d{2}")
# `mleng ...` inside a confirm/fix item: up to a comment, a shell separator, a quote or a clause break.
_MLENG_RE = re.compile(r"(?<![\w./-])mleng\s+([a-z][^#;|&`'\"()]*?)(?=\s+#|[#;|&`'\"()]|,\s|\s+or\s|\.\s|\.$|$)")
_PLACEHOLDER_RE = re.compile(r"<[^<>]*>")
_NEGATION_RE = re.compile(r"\bnot\b|n't\b|\bno\b", re.I)
# Capabilities an entry may be tempted to claim but mleng does not have: (command, words, why not).
MISSING_CAPABILITIES = (
    ("doctor", re.compile(r"\bdcgm|dcgmi|field diag|memtest", re.I),
     "mleng doctor does not run DCGM diagnostics or a memory test; point at dcgmi diag instead"),
)


def _check_mleng_commands(key: str, item: str, add) -> None:
    """Every `mleng ...` command in a confirm/fix item parses with the real CLI parser.

    A command is a `mleng WORD` at the start of the item or of a shell command in it, or any whose WORD
    is a mleng command; 'mleng keeps ...' in the middle of prose is not one. Comments are not read.
    """
    from mleng.cli.main import COMMANDS

    code = item.split("#", 1)[0]
    for match in _MLENG_RE.finditer(code):
        first = match.group(1).split()[0] if match.group(1).split() else ""
        at_start = not code[:match.start()].strip() or code[:match.start()].rstrip().endswith(("$", "&&", ";", "|"))
        if first not in COMMANDS and not at_start:
            continue
        text = _PLACEHOLDER_RE.sub("1", match.group(1)).replace("...", " ").strip()
        try:
            words = shlex.split(text)
        except ValueError:
            words = text.split()
        problem = _parse_problem(words)
        if problem:
            add(key, f"'mleng {match.group(1).strip()}': {problem}; write a command that exists "
                     "(mleng COMMAND --help); in prose, quote it in backticks (`mleng io DIR`) or move the prose into "
                     "a '# comment'")
            continue
        comment = item.split("#", 1)[1] if "#" in item else item[match.end():]
        for command, words_re, why in MISSING_CAPABILITIES:
            if words and words[0] == command and words_re.search(comment) and not _NEGATION_RE.search(comment):
                add(key, f"{item[:80]!r}: {why}")
                break


_PARSERS: dict[str, object] = {}


def _parse_problem(words: list[str]) -> str | None:
    import contextlib
    import io

    from mleng.cli.main import COMMANDS, build_parser

    if not words:
        return "no command after 'mleng'"
    if words[0] not in COMMANDS:
        return f"{words[0]!r} is not a mleng command"
    parser = _PARSERS.get(words[0])
    if parser is None:
        parser = _PARSERS[words[0]] = build_parser(words[0])
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(words)
    except SystemExit as exc:
        if exc.code not in (0, None):
            message = errors.getvalue().strip().splitlines()
            return message[-1].split("error: ", 1)[-1] if message else "does not parse"
    return None


def _check_verified(value, add) -> None:
    if not isinstance(value, list) or not value:
        add("verified", "must be a list of at least one mapping (claim, against, date)")
        return
    for number, item in enumerate(value, start=1):
        if not isinstance(item, dict):
            add("verified", f"item {number} must be a mapping with {', '.join(VERIFIED_KEYS)}")
            continue
        unknown = sorted(set(map(str, item)) - set(VERIFIED_KEYS))
        if unknown:
            add("verified", f"item {number} has unknown key {unknown[0]!r}; use {', '.join(VERIFIED_KEYS)}")
        for key in ("claim", "against"):
            if not isinstance(item.get(key), str) or not item[key].strip():
                add("verified", f"item {number}: {key!r} must be a non-empty string (what was checked, and the "
                                "source file or docs page with its version)")
        if not _DATE_RE.fullmatch(str(item.get("date", ""))):
            add("verified", f"item {number}: 'date' must be the day it was checked, YYYY-MM-DD")


def _check_reproduction(value, repo_root: Path | None, add) -> None:
    if not isinstance(value, str):
        add("reproduction", "must be a string 'tests/FILE.py::test_name'")
        return
    match = REPRODUCTION_RE.fullmatch(value.strip())
    if not match:
        add("reproduction", f"{value!r} is not of the form 'tests/FILE.py::test_name'")
        return
    if repo_root is None:
        add("reproduction", "cannot check: no repository root (pyproject.toml + tests/) above the entries "
                            "directory or the working directory; run lint from the repository")
        return
    test_file = repo_root / match["file"]
    if not test_file.is_file():
        add("reproduction", f"{match['file']} does not exist under {repo_root}; write the test or fix the path")
        return
    source = test_file.read_text(encoding="utf-8", errors="replace")
    if not re.search(rf"^\s*def {re.escape(match['function'])}\s*\(", source, re.MULTILINE):
        add("reproduction", f"{match['file']} has no function {match['function']}(); write it or fix the name")


def lint(directory: Path | None = None) -> tuple[int, list[Problem]]:
    """(number of entry files, problems) for the whole entries directory."""
    directory = Path(directory) if directory is not None else default_entries_dir()
    if not directory.is_dir():
        from mleng.errors import UsageError

        raise UsageError(f"handbook entries directory {directory} does not exist",
                         hint="unset MLENG_HANDBOOK_DIR or point it at a directory of <id>.md entries")
    repo_root = find_repo_root(directory)
    files = entry_files(directory)
    problems: list[Problem] = []
    ids: dict[str, str] = {}
    related_by_file: list[tuple[str, list[str]]] = []
    for path in files:
        entry_id, related, file_problems = lint_file(path, repo_root)
        problems.extend(file_problems)
        if entry_id:
            if entry_id in ids:
                problems.append(Problem(str(path), "id", f"{entry_id!r} is already used by {ids[entry_id]}; "
                                                         "ids must be unique"))
            else:
                ids[entry_id] = str(path)
        related_by_file.append((str(path), related))
    for file, related in related_by_file:
        for other in related:
            if other not in ids:
                problems.append(Problem(file, "related", f"{other!r} is not the id of any entry; fix or remove it"))
    return len(files), problems
