"""`mleng ask`: the handbook entries that best explain a pasted error line or a described symptom."""

from __future__ import annotations

import argparse
import sys

from mleng.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("text", nargs="*", help="the error line or symptom; '-' or nothing reads stdin")
    parser.add_argument("--limit", type=int, default=5, help="how many entries to show (default 5)")


def read_query(words: list[str]) -> str:
    if not words or words == ["-"]:
        if sys.stdin.isatty():
            raise UsageError("no text to look up",
                             hint='pass the error line: mleng ask "NCCL error: unhandled system error", or pipe it in')
        from mleng.handbook.search import MAX_QUERY_CHARS

        text = sys.stdin.read(MAX_QUERY_CHARS + 1)
        if len(text) > MAX_QUERY_CHARS:
            print(f"mleng ask: note: only the first {MAX_QUERY_CHARS} characters are used; "
                  "to scan a whole log use `mleng triage FILE`", file=sys.stderr)
        return text[:MAX_QUERY_CHARS]
    return " ".join(words)


def warn_skipped(skipped: list[dict], command: str) -> None:
    for item in skipped:
        print(f"mleng {command}: warning: skipped malformed entry {item['file']}: {item['field']}: "
              f"{item['message']} (run `mleng handbook lint`)", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    answer = result(args)
    # Like grep: 0 when the handbook has a confident answer, 1 when it does not.
    code = 0 if answer["confident"] else 1
    from mleng.cli.render import emit

    emit(args, answer, render_answer)
    return code


def result(args: argparse.Namespace, index=None) -> dict:
    """What `mleng ask --json` prints: {"query", "confident", "results"}; `index`: an open handbook index
    to search instead of opening one (a long-lived caller such as `mleng mcp` keeps it open)."""
    from mleng.handbook.search import ask, search

    if args.limit < 1:
        raise UsageError(f"--limit must be at least 1, got {args.limit}")
    query = read_query(args.text)
    if not query.strip():
        raise UsageError("the text to look up is empty", hint='pass the error line: mleng ask "..."')
    if index is None:
        answer, skipped = ask(query, limit=args.limit)
    else:
        answer, skipped = search(index, query, limit=args.limit), index.skipped
    warn_skipped(skipped, "ask")
    return {"query": query, "confident": answer["confident"], "results": answer["results"]}


def render_answer(answer: dict) -> str:
    results = answer["results"]
    if not results:
        return ("no confident match: no handbook entry shares a word with this; try the exact error line, "
                "or fewer, more specific words")
    if answer["confident"]:
        from mleng.handbook.search import words_only

        if not words_only(results[0]["matched"]):
            return render_results(results)
        # README: on fresh real questions most confident answers resting on words alone were wrong.
        return ("best guess from words alone (no log signature or error code matched): check each cause "
                "against your log, and paste the exact error line if there is one\n\n" + render_results(results))
    lines = ["no confident match: the handbook does not seem to know this problem.",
             "possibly related (the words overlap, but no signature, error code or symptom matched well):"]
    for r in results:
        lines.append(f"  - {r['id']}: {r['title']}  (mleng handbook show {r['id']})")
    lines.append("paste the exact error line (the last lines of the traceback, or the first NCCL WARN) for a "
                 "better answer")
    return "\n".join(lines)


def _matched(result: dict) -> str:
    m = result["matched"]
    parts = []
    if m["signatures"]:
        parts.append(f"{len(m['signatures'])} log signature{'s' if len(m['signatures']) > 1 else ''}")
    if m["codes"]:
        parts.append("codes " + ", ".join(m["codes"]))
    if m["terms"]:
        shown = m["terms"][:6]
        parts.append("words " + ", ".join(shown) + (" ..." if len(m["terms"]) > len(shown) else ""))
    return "; ".join(parts) or "explanation text only"


def render_results(results: list[dict]) -> str:
    blocks = []
    for rank, r in enumerate(results, start=1):
        lines = [f"{rank}. {r['title']}  [{r['category']}]  score {r['score']:.2f}"
                 + ("" if r["confident"] else "  (weak match)"),
                 f"   matched: {_matched(r)}",
                 f"   why: {r['cause']}"]
        lines.append("   confirm:")
        lines.extend(f"     - {c}" for c in r["confirm"])
        lines.append("   fix:")
        lines.extend(f"     - {f}" for f in r["fix"])
        lines.append("   sources: " + " ".join(r["sources"]))
        lines.append(f"   id: {r['id']}   (mleng handbook show {r['id']})")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
