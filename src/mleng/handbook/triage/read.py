"""Triage's input: binary detection, and compressed logs (gzip, xz, bzip2, zstd) read as they are stored."""

from __future__ import annotations

from typing import BinaryIO


class NotText(ValueError):
    """The input is binary data, not a log: what it looks like, for the message."""


def check_text(head: bytes) -> None:
    """Raise NotText when the first bytes of an input are binary (NUL bytes or mostly non-text)."""
    sample = head[:8192]
    if not sample:
        return
    if b"\x00" in sample:
        raise NotText("it contains NUL bytes")
    text_bytes = sum(1 for b in sample if b >= 32 or b in (9, 10, 13, 27))
    if text_bytes / len(sample) < 0.9:
        raise NotText(f"{100 - 100 * text_bytes // len(sample)}% of its first bytes are control bytes")
    try:
        sample.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(sample) - 4 and sum(1 for b in sample if b >= 128) / len(sample) > 0.3:
            raise NotText("it is not UTF-8 text") from None


# Compressed logs are read as they are stored: the first bytes say the format.
_MAGIC = ((b"\x1f\x8b", "gzip"), (b"\xfd7zXZ\x00", "xz"), (b"BZh", "bzip2"), (b"\x28\xb5\x2f\xfd", "zstd"))


def compression(head: bytes) -> str | None:
    return next((name for magic, name in _MAGIC if head.startswith(magic)), None)


def open_log(stream: BinaryIO) -> tuple[BinaryIO, str | None]:
    """The decompressed stream of a log (gzip, xz, bzip2, zstd or plain) and the format's name.

    Raises NotText when zstd is needed and neither Python's zstd support nor the zstd tool exists.
    """
    import io

    buffered = stream if hasattr(stream, "peek") else io.BufferedReader(stream)
    kind = compression(buffered.peek(8)[:8])
    if kind == "gzip":
        import gzip

        return gzip.GzipFile(fileobj=buffered, mode="rb"), kind
    if kind == "xz":
        import lzma

        return lzma.LZMAFile(buffered, mode="rb"), kind
    if kind == "bzip2":
        import bz2

        return bz2.BZ2File(buffered, mode="rb"), kind
    if kind == "zstd":
        return _zstd_reader(buffered), kind
    return buffered, None


def _zstd_reader(stream: BinaryIO) -> BinaryIO:
    try:
        from compression import zstd  # Python 3.14+

        return zstd.ZstdFile(stream, mode="rb")
    except ImportError:
        pass
    try:
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(stream, read_across_frames=True)
    except ImportError:
        pass
    import shutil
    import subprocess
    import threading

    tool = shutil.which("zstd")
    if tool is None:
        raise NotText("it is zstd-compressed and this machine has neither the zstd tool nor the zstandard "
                      "package (pip install zstandard, or decompress it first: zstd -d LOG.zst)")
    process = subprocess.Popen([tool, "-dcq"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL)

    def feed() -> None:
        try:
            while True:
                data = stream.read(1 << 20)
                if not data:
                    break
                process.stdin.write(data)
        except (BrokenPipeError, OSError):
            pass
        finally:
            try:
                process.stdin.close()
            except OSError:
                pass

    threading.Thread(target=feed, daemon=True).start()
    return _ProcessOutput(process)


class _ProcessOutput:
    """A decompressing tool's output; its failure at the end (damaged input) raises EOFError."""

    def __init__(self, process):
        self.process = process

    def read(self, size: int) -> bytes:
        data = self.process.stdout.read(size)
        if not data and self.process.wait() != 0:
            raise EOFError(f"zstd -d exited with status {self.process.returncode}")
        return data


def zstd_errors() -> tuple[type, ...]:
    try:
        import zstandard
    except ImportError:
        return ()
    return (zstandard.ZstdError,)
