"""The handbook: entries (Markdown + YAML front matter), linter, FTS5 index and search, log triage,
static site and agent skill export. Entries live in handbook/entries/<id>.md."""

import os
from pathlib import Path


def default_entries_dir() -> Path:
    """MLENG_HANDBOOK_DIR (tests, local drafts), else the entries shipped in the package."""
    override = os.environ.get("MLENG_HANDBOOK_DIR")
    if override:
        return Path(override).expanduser()
    return Path(__file__).resolve().parent / "entries"
