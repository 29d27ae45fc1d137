"""The handbook: entries (Markdown + YAML front matter), linter, FTS5 index and search, log triage,
static site and agent skill export. Entries live in handbook/entries/<id>.md."""
