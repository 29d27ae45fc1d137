"""SKILL.md: teaches an AI agent to use mleng's commands and the handbook, with every entry id by category."""

from __future__ import annotations

from pathlib import Path

from mleng.handbook.model import CATEGORIES

SKILL_HEAD = """---
name: mleng
description: Diagnose and measure GPU training clusters with the mleng CLI. Use when a user pastes an error or a log from distributed PyTorch training (NCCL, CUDA, torchrun, SLURM, dataloaders, checkpoints, numerics) or asks whether their GPUs, network or storage perform as they should.
---

# mleng: look up the pitfall, measure the machine

`mleng` is a command-line toolkit. Every command prints a human summary by default and machine-readable
JSON with `--json` (put `--json` after the command name). Exit codes: 0 ok, 1 a problem was found,
2 bad usage or input (the message on stderr says what to change). Prefer `--json` when you will
parse the output.

## When the user has an error message or a symptom
1. Pass the text exactly as the user gave it (quote it; any characters are fine):
   `mleng ask "RuntimeError: DataLoader worker (pid 1234) is killed by signal: Killed." --json --limit 3`
   The answer is `{"query": ..., "confident": true|false, "results": [{"id", "title", "category", "score",
   "symptoms", "cause", "confirm", "fix", "applies_to", "sources", "matched", "confident"}, ...]}`, best
   first; exit code 0 when the top result is confident, 1 when it is not. A plain-language description
   works too: `mleng ask "training hangs at the first all_reduce on two nodes" --json`.
2. Read `cause` to explain what happened, run or propose the `confirm` commands to tell this cause
   from look-alikes, then give the `fix` steps. Cite `sources` when the user wants references.
3. Trust `confident`, not the score alone. `confident` is true when one of the entry's log signatures
   matched (`matched.signatures`), when a specific error code is shared (`matched.codes`: an Xid, a CUDA
   or NCCL error number, a source line), or when the query's GPU/training words cover the entry's
   symptoms (`matched.coverage` >= 0.25 in rare words or >= 0.6, `matched.terms`) or share two or more 3-word
   phrases with them (`matched.phrases`). When it is false, say the handbook does not know this
   problem and present the results only as possibly related. When it is true but rests on words alone
   (no `matched.signatures`, no specific `matched.codes`), present it as the best guess and check its
   cause against the log: on fresh real questions, most such answers named the wrong cause (README).
   The score is a sum: text relevance (0-1,
   relative to the best text match of this query) + up to 2 per matched signature (at most two) + error
   codes (about 0.5-3 each, less when many entries share the code) + up to 1 for shared 3-word phrases
   + on words alone, a small base rate for causes many real users reported; scores compare results of one
   query, not across queries.
4. `mleng handbook show ID --json` prints one entry in full (including the body sections
   "What you see", "Why", "Confirm", "Fix"); `mleng handbook list --json [--category C]` lists ids.

## When the user has a log file
`mleng triage LOGFILE --json` (or `... | mleng triage - --json`) streams a log of any size with
constant memory and returns `{"source", "lines", "bytes", "elapsed_s", "findings": [{"entries": [{"id",
"title", "category", "cause", "confirm", "fix"}], "first_line", "last_line", "count", "ranks", "hosts",
"labels_truncated", "example"}]}`, findings in order of first appearance. Exit code 1 means known
problems were found. The earliest finding is usually the root cause; later ones (timeouts on other
ranks, "ChildFailedError") are often consequences. `ranks`/`hosts` come from line prefixes such as
`[rank3]:`, `[default0]:`, `0:` (srun --label), `node017:` and NCCL's `host:pid:tid [gpu]`: one host
in every finding points at a bad node.

## Measuring the machine
The measurement commands store each run (SQLite under `$MLENG_HOME`) and print the headline with
the theoretical value and the ratio; `--json` gives the full record (`schema` "mleng.measurement/2",
`summary` {"value", "unit", "theoretical", "ratio"}, `rows` with units in field names).
- `mleng env --json`: versions, GPUs, links, NUMA, NICs, relevant env vars (redacted).
- `mleng doctor --json`: health checks and quick measurements; findings point at handbook ids.
- `mleng check --json`: every rank can initialize, all-reduce and barrier (short timeouts name a
  missing rank in seconds).
- `mleng mamf`, `mleng comm`, `mleng membw`, `mleng io`: matmul TFLOPS, collective bus bandwidth
  (nccl-tests conventions), memory bandwidth, storage throughput.
- `mleng specs`, `mleng results`, `mleng report`, `mleng upgrade`, `mleng slurm`, `mleng hang`:
  reference specs, stored runs, HTML report, upgrade economics, sbatch scripts, hang forensics.
Run `mleng COMMAND --help` for the options of each; a command not available in this install says so
and exits 2.

## Rules
- Do not invent handbook ids; use the ones below or from `mleng handbook list`.
- Quote the user's text verbatim to `mleng ask`; concrete numbers (pids, ports, timeouts) do not need
  to be removed, the search normalizes them.
- A check reported as "skipped" or "inconclusive" did not run; never report it as passing.

## Handbook entries by category
"""


def skill_text(entries: list[dict]) -> str:
    by_category: dict[str, list[dict]] = {}
    for e in entries:
        by_category.setdefault(e["category"], []).append(e)
    lines = [SKILL_HEAD]
    for category in [c for c in CATEGORIES if c in by_category] + sorted(set(by_category) - set(CATEGORIES)):
        lines.append(f"### {category}")
        for e in sorted(by_category[category], key=lambda e: e["id"]):
            lines.append(f"- `{e['id']}`: {e['title']}")
        lines.append("")
    return "\n".join(lines)


def write_skill(entries: list[dict], out: Path) -> Path:
    """Write SKILL.md into OUT (a directory) or to OUT itself when it ends in .md; return the path."""
    path = out if out.suffix.lower() == ".md" else out / "SKILL.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(skill_text(entries), encoding="utf-8")
    return path
