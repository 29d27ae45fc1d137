"""Handbook entries: parse a Markdown file with YAML front matter into an Entry."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path

from mleng.handbook import default_entries_dir
from mleng.handbook.terms import parse_regex

REQUIRED_KEYS = ("id", "title", "category", "symptoms", "signatures", "applies_to",
                 "cause", "confirm", "fix", "sources")
OPTIONAL_KEYS = ("related", "reproduction", "error_codes", "tags", "verified")
CATEGORIES = ("nccl-hang", "nccl-network", "network-config", "pcie-p2p", "cuda-error", "gpu-memory",
              "gpu-hardware", "launch", "slurm", "kubernetes", "host-cpu", "storage", "checkpoint",
              "numerics", "amp", "dataloader", "performance", "compile", "attention", "hf-accelerate",
              "deepspeed", "fsdp", "lightning")
# What a `verified` item records: the claim checked, the source or docs (with version) it was checked
# against, and the day.
VERIFIED_KEYS = ("claim", "against", "date")
SECTIONS = ("What you see", "Why", "Confirm", "Fix")
LIST_KEYS = ("symptoms", "signatures", "confirm", "fix", "sources", "related", "error_codes", "tags")

_SECTION_RE = re.compile(r"^##[ \t]+(.+?)[ \t]*$", re.MULTILINE)


class EntryError(Exception):
    """An entry file that cannot be used: names the file, the field and what to do."""

    def __init__(self, file: str, field_name: str, message: str):
        super().__init__(f"{file}: {field_name}: {message}")
        self.file = file
        self.field = field_name
        self.message = message

    def __reduce__(self):
        # An index rebuild's helper process sends its unusable files back to the parent.
        return EntryError, (self.file, self.field, self.message)


@dataclass
class Entry:
    id: str
    title: str
    category: str
    symptoms: list[str]
    signatures: list[str]
    applies_to: dict
    cause: str
    confirm: list[str]
    fix: list[str]
    sources: list[str]
    related: list[str] = field(default_factory=list)
    reproduction: str | None = None
    error_codes: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)
    verified: list[dict] = field(default_factory=list)
    sections: dict[str, str] = field(default_factory=dict)
    path: str = ""

    def to_dict(self) -> dict:
        # dataclasses.asdict, generic and deep, took a third of an index rebuild; the values are plain.
        return {name: _plain_copy(getattr(self, name)) for name in _ENTRY_FIELDS}


_ENTRY_FIELDS = tuple(f.name for f in fields(Entry))


def _plain_copy(value):
    if isinstance(value, list):
        return [_plain_copy(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain_copy(v) for k, v in value.items()}
    return value


def thread_url(url: str) -> str:
    """One thread's URL however it is written: no #fragment, no trailing slash (sources, dev sets, labels)."""
    return url.split("#")[0].rstrip("/")


def entry_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("*.md") if p.is_file())


def _yaml_load(text: str):
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(text, Loader=loader)  # noqa: S506 - a safe loader, C speed when present


def split_front_matter(text: str, file: str, verified: bool = True) -> tuple[dict, str]:
    """The YAML mapping between the leading `---` lines, and the Markdown body after them. With
    verified=False the top-level `verified:` block is left out unparsed (about half of an entry's YAML)."""
    import yaml

    lines = text.splitlines(keepends=True)
    if not lines or lines[0].strip() != "---":
        raise EntryError(file, "front matter", "the file must start with a line '---' opening the YAML front matter")
    for end in range(1, len(lines)):
        if lines[end].strip() == "---":
            break
    else:
        raise EntryError(file, "front matter", "no closing '---' line after the YAML front matter")
    front = lines[1:end]
    if not verified:
        front = _without_key(front, "verified")
    try:
        meta = _yaml_load("".join(front))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at front-matter line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise EntryError(file, "front matter",
                         f"YAML does not parse{where}: {problem}; quote strings containing ': ' or '#' "
                         "(regexes in single quotes)") from None
    if not isinstance(meta, dict):
        raise EntryError(file, "front matter", "the front matter must be a YAML mapping of keys to values")
    return meta, "".join(lines[end + 1:])


def _without_key(lines: list[str], key: str) -> list[str]:
    """YAML lines without the top-level `key:` and the indented lines under it."""
    start = next((i for i, line in enumerate(lines) if line.startswith(key + ":")), None)
    if start is None:
        return lines
    stop = start + 1
    while stop < len(lines) and (lines[stop][:1] in (" ", "\t", "-", "#", "\n", "\r")):
        stop += 1
    return lines[:start] + lines[stop:]


def text_before_sections(body: str) -> str:
    """What a body holds before its first `## Heading` (split_sections drops it)."""
    first = _SECTION_RE.search(body)
    return body[:first.start()] if first else body


def split_sections(body: str) -> dict[str, str]:
    """`## Heading` -> the text under it, in file order."""
    sections: dict[str, str] = {}
    matches = list(_SECTION_RE.finditer(body))
    for i, match in enumerate(matches):
        stop = matches[i + 1].start() if i + 1 < len(matches) else len(body)
        sections[match.group(1)] = body[match.end():stop].strip()
    return sections


def _string_list(meta: dict, key: str, file: str) -> list[str]:
    value = meta.get(key)
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise EntryError(file, key, "must be a list of strings (one '- \"...\"' line per item)")
    return value


def _verified(meta: dict, file: str) -> list[dict]:
    value = meta.get("verified") or []
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise EntryError(file, "verified", "must be a list of mappings with " + ", ".join(VERIFIED_KEYS))
    return [{k: str(item.get(k, "")) for k in VERIFIED_KEYS} for item in value]


def entry_from_meta(meta: dict, body: str, file: str) -> Entry:
    """An Entry from parsed front matter, checking only what search and triage rely on."""
    missing = [k for k in REQUIRED_KEYS if k not in meta]
    if missing:
        raise EntryError(file, missing[0], f"required key missing (required: {', '.join(REQUIRED_KEYS)})")
    for key in ("id", "title", "category", "cause"):
        if not isinstance(meta[key], str) or not meta[key].strip():
            raise EntryError(file, key, "must be a non-empty string")
    applies_to = meta["applies_to"]
    if not isinstance(applies_to, dict):
        raise EntryError(file, "applies_to", "must be a mapping with 'software' and 'hardware' strings")
    lists = {key: _string_list(meta, key, file) for key in LIST_KEYS}
    for pattern in lists["signatures"]:
        try:
            parse_regex(pattern)
            if "(?<=" in pattern or "(?<!" in pattern:
                re.compile(pattern)  # a look-behind's width is checked when compiled, not when parsed
        except re.error as exc:
            raise EntryError(file, "signatures", f"regex {pattern!r} does not compile: {exc}") from None
    reproduction = meta.get("reproduction")
    if reproduction is not None and not isinstance(reproduction, str):
        raise EntryError(file, "reproduction", "must be a string 'tests/FILE.py::test_name'")
    return Entry(
        id=meta["id"].strip(), title=meta["title"].strip(), category=meta["category"].strip(),
        symptoms=lists["symptoms"], signatures=lists["signatures"],
        applies_to={str(k): str(v) for k, v in applies_to.items()},
        cause=meta["cause"].strip(), confirm=lists["confirm"], fix=lists["fix"], sources=lists["sources"],
        related=lists["related"], reproduction=reproduction, error_codes=lists["error_codes"],
        tags=lists["tags"], verified=_verified(meta, file), sections=split_sections(body), path=file,
    )


def parse_entry(path: Path, verified: bool = True) -> Entry:
    """The entry in the file; with verified=False its `verified` list is left empty, unparsed (what search
    needs, read faster)."""
    file = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise EntryError(file, "file", f"cannot be read as UTF-8 text: {exc}") from None
    meta, body = split_front_matter(text, file, verified)
    return entry_from_meta(meta, body, file)


def first_of_each_id(results: Iterable) -> tuple[list, list[EntryError]]:
    """Per entry file in name order, an EntryError or (file, id, value): the values of the first file with each
    id, and the files skipped with why (unusable, or a later file reusing an id)."""
    kept: list = []
    skipped: list[EntryError] = []
    seen: set[str] = set()
    for result in results:
        if isinstance(result, EntryError):
            skipped.append(result)
            continue
        file, entry_id, value = result
        if entry_id in seen:
            skipped.append(EntryError(file, "id", f"id {entry_id!r} is used by another entry; ids must be unique"))
            continue
        seen.add(entry_id)
        kept.append(value)
    return kept, skipped


def load_entries(directory: Path | None = None) -> tuple[list[Entry], list[EntryError]]:
    """Every usable entry in the directory, and the files that were skipped with why."""
    directory = Path(directory) if directory is not None else default_entries_dir()
    return first_of_each_id(_parsed(path) for path in entry_files(directory))


def _parsed(path: Path):
    try:
        entry = parse_entry(path)
    except EntryError as exc:
        return exc
    return str(path), entry.id, entry
