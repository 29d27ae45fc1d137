"""The kernel log of this machine: /dev/kmsg, else `journalctl -k`, else `dmesg`, as (seconds since boot, text).

Nothing here judges a line; mleng.doctor.kernel_log does. A source that cannot be read says why, and the
caller reports that instead of a clean log: a health check that could not read the log has not passed.
Saved logs (a `dmesg` or `journalctl -k` text copied from another node) are read by `read_saved_log`.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import shutil
import subprocess
import time
from typing import Any

KMSG = "/dev/kmsg"
COMMAND_TIMEOUT_S = 20.0

# "[   12.345678] text" (dmesg, journalctl -o short-monotonic after its prefix)
_BRACKET_SECONDS = re.compile(r"^\[\s*(\d+\.\d+)\]\s?")
# "[Wed Jul 30 14:25:12 2026] text" (dmesg -T)
_BRACKET_DATE = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]\s?")
# "Oct 30 09:49:36 host kernel: text", "2026-10-30T09:49:36.123456+00:00 host kernel: text" (syslog, journalctl)
_SYSLOG = re.compile(r"^(?:\w{3} +\d+ \d\d:\d\d:\d\d|\d{4}-\d\d-\d\dT[\d:.]+(?:[+-]\d\d:?\d\d|Z)?) \S+ kernel: ")
# "6,1234,5678901,-;text" (a raw /dev/kmsg record)
_KMSG_RECORD = re.compile(r"^(\d+),(\d+),(\d+),[^;]*;")


def unavailable(reason: str, tried: list[str] | None = None) -> dict[str, Any]:
    return {"available": False, "reason": reason, "tried": tried or []}


def uptime_s() -> float:
    """Seconds since boot on the clock the kernel stamps its log with (CLOCK_MONOTONIC: suspend excluded)."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def parse_kmsg_record(record: str) -> tuple[float | None, str, int | None] | None:
    """One /dev/kmsg record -> (seconds since boot, message, sequence number); continuation lines dropped."""
    head, sep, rest = record.partition(";")
    if not sep:
        return None
    fields = head.split(",")
    try:
        seq = int(fields[1])
        usec = int(fields[2])
    except (IndexError, ValueError):
        return None
    message = rest.split("\n", 1)[0]
    # the kernel escapes non-printable bytes as \xNN; a tab is the one worth restoring for readers
    return usec / 1e6, message.replace("\\x09", "\t"), seq


def read_kmsg(path: str = KMSG) -> dict[str, Any]:
    """Every record /dev/kmsg still holds, read without blocking (the ring buffer, oldest first)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        return unavailable(f"{path}: {exc.strerror or exc}")
    lines: list[tuple[float | None, str]] = []
    first_seq = None
    lost = 0
    try:
        while True:
            try:
                chunk = os.read(fd, 65536)  # one record per read; records are at most a few KiB
            except BlockingIOError:
                break  # the end of what is buffered
            except BrokenPipeError:
                lost += 1  # records were overwritten while we read: the next read resumes after them
                continue
            except OSError as exc:
                if not lines:
                    return unavailable(f"{path}: {exc.strerror or exc}")
                break
            if not chunk:
                break
            parsed = parse_kmsg_record(chunk.decode("utf-8", "replace"))
            if parsed is None:
                continue
            seconds, message, seq = parsed
            if first_seq is None:
                first_seq = seq
            lines.append((seconds, message))
    finally:
        os.close(fd)
    return {"available": True, "source": path, "lines": lines,
            # the ring buffer no longer starts at record 0: messages from early in this boot are gone
            "wrapped": bool(first_seq) or lost > 0, "first_seq": first_seq}


def _run(argv: list[str]) -> tuple[int | None, str, str]:
    if shutil.which(argv[0]) is None:
        return None, "", f"{argv[0]} is not installed"
    try:
        done = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, "", f"did not answer within {COMMAND_TIMEOUT_S:.0f} s"
    except OSError as exc:
        return None, "", str(exc)
    return done.returncode, done.stdout, done.stderr.strip()


def read_journal() -> dict[str, Any]:
    """`journalctl -k -b -o short-monotonic`: this boot's kernel messages with their seconds since boot."""
    code, out, err = _run(["journalctl", "-k", "-b", "-o", "short-monotonic", "--no-pager", "-q"])
    if code is None:
        return unavailable(f"journalctl -k: {err}")
    if code != 0:
        return unavailable(f"journalctl -k: exit {code}: {(err.splitlines() or ['no message'])[-1]}")
    lines = [parse_text_line(line) for line in out.splitlines() if line.strip()]
    if not lines:
        # "No journal files were found" exits 0 with nothing: a journal that keeps no kernel messages
        return unavailable(f"journalctl -k: no kernel messages in the journal ({err or 'empty'})")
    return {"available": True, "source": "journalctl -k -b", "lines": lines, "wrapped": False}


def read_dmesg() -> dict[str, Any]:
    code, out, err = _run(["dmesg"])
    if code is None:
        return unavailable(f"dmesg: {err}")
    if code != 0:
        hint = " (kernel.dmesg_restrict=1: needs root or CAP_SYSLOG)" if "not permitted" in err.lower() else ""
        return unavailable(f"dmesg: exit {code}: {(err.splitlines() or ['no message'])[-1]}{hint}")
    return {"available": True, "source": "dmesg", "lines": [parse_text_line(line) for line in out.splitlines()],
            "wrapped": False}


def parse_text_line(line: str, boot_epoch: float | None = None) -> tuple[float | None, str]:
    """One line of dmesg / journalctl / syslog / raw kmsg text -> (seconds since boot or None, message)."""
    line = line.rstrip("\n")
    record = _KMSG_RECORD.match(line)
    if record:
        return int(record.group(3)) / 1e6, line[record.end():]
    match = _SYSLOG.match(line)
    if match:
        line = line[match.end():]
    match = _BRACKET_SECONDS.match(line)
    if match:
        return float(match.group(1)), line[match.end():]
    match = _BRACKET_DATE.match(line)
    if match:
        seconds = None
        if boot_epoch is not None:
            try:
                seconds = _dt.datetime.strptime(match.group(1), "%a %b %d %H:%M:%S %Y").timestamp() - boot_epoch
            except ValueError:
                pass
        return seconds, line[match.end():]
    # journalctl -o short-monotonic puts the stamp first: "[ 12.3] host kernel: text"
    return None, line


def _strip_journal_host(message: str) -> str:
    match = re.match(r"^\S+ kernel: ", message)
    return message[match.end():] if match else message


def read_kernel_log() -> dict[str, Any]:
    """This boot's kernel log from the first source that can be read, and what was tried before it.

    {"available", "source", "lines": [(seconds since boot | None, message)], "wrapped", "uptime_s",
     "tried": ["/dev/kmsg: Permission denied", ...]} or {"available": False, "reason", "tried"}.
    """
    tried: list[str] = []
    chosen = None
    for reader in (read_kmsg, read_journal, read_dmesg):
        result = reader()
        if not result["available"]:
            tried.append(result["reason"])
            continue
        if reader is read_kmsg and result["wrapped"]:
            # The ring buffer lost this boot's oldest messages; the journal may still have them.
            journal = read_journal()
            if journal["available"]:
                tried.append(f"{KMSG}: its ring buffer no longer holds the start of this boot; using the journal")
                result = journal
        chosen = result
        break
    if chosen is None:
        return unavailable("no kernel log could be read: " + "; ".join(tried), tried)
    if chosen["source"].startswith("journalctl"):
        chosen["lines"] = [(t, _strip_journal_host(text)) for t, text in chosen["lines"]]
    chosen["tried"] = tried
    chosen["uptime_s"] = uptime_s()
    return chosen


def read_saved_log(path: str, boot_epoch: float | None = None) -> dict[str, Any]:
    """A kernel log saved to a file (dmesg, dmesg -T, journalctl -k, syslog or raw /dev/kmsg records)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        return unavailable(f"{path}: {exc.strerror or exc}")
    if b"\x00" in data[:8192]:
        return unavailable(f"{path}: a binary file, not a kernel log text")
    text = data.decode("utf-8", "replace")
    lines = [parse_text_line(line, boot_epoch) for line in text.splitlines() if line.strip()]
    lines = [(t, _strip_journal_host(message)) for t, message in lines]
    return {"available": True, "source": path, "lines": lines, "wrapped": False, "tried": [], "uptime_s": None,
            "saved": True}


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|hour|d|day)s?$", re.I)
_UNIT_S = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hour": 3600, "d": 86400, "day": 86400}


def parse_since(text: str | None, now_epoch: float | None = None, uptime: float | None = None) -> dict[str, Any]:
    """--since: 'boot' (the default), a duration back from now ('30m', '2h', '1d'), or a local date-time
    ('2026-12-01 10:00', ISO 8601). -> {"label", "since_boot_s" (None for 'boot')}; ValueError if unreadable."""
    if text is None or text.strip().lower() in ("", "boot"):
        return {"label": "since boot", "since_boot_s": None, "kind": "boot"}
    now_epoch = time.time() if now_epoch is None else now_epoch
    uptime = uptime_s() if uptime is None else uptime
    value = text.strip()
    match = _DURATION.match(value)
    if match:
        back = float(match.group(1)) * _UNIT_S[match.group(2).lower()]
        return {"label": f"the last {value}", "since_boot_s": max(0.0, uptime - back), "kind": "duration"}
    try:
        when = _dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{text!r} is neither 'boot', a duration (30m, 2h, 1d) nor a date-time "
                         "(2026-12-01T10:00)") from None
    epoch = when.timestamp()
    if epoch > now_epoch:
        raise ValueError(f"{text!r} is in the future")
    boot_epoch = now_epoch - uptime
    return {"label": f"since {value}", "since_boot_s": max(0.0, epoch - boot_epoch), "kind": "datetime"}
