"""The directory `mleng io` measures: refused before any work when it cannot be (virtual, missing, full), the
file system it is on, O_DIRECT support, the page cache dropped between write and read, and a workspace of its own
that is removed afterwards."""

from __future__ import annotations

import mmap
import os
import secrets
from pathlib import Path

from mleng.errors import UsageError
from mleng.measure.sizes import format_bytes


METADATA_FILE_BYTES = 4096


# O_DIRECT wants buffers, offsets and lengths aligned to the logical block size; 4 KiB covers
# every common device.
ALIGN = 4096
WORKDIR_PREFIX = ".mleng-io-"
# Nothing makes reads from these cold: their files are memory (tmpfs takes O_DIRECT since Linux 6.6).
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")


# --- where the run writes ---------------------------------------------------------------------
class Workspace:
    """A uniquely named directory of our own under PATH; only files we created are ever removed."""

    def __init__(self, parent: str | os.PathLike):
        self.parent = Path(parent)
        self.dir = self.parent / f"{WORKDIR_PREFIX}{secrets.token_hex(6)}"
        os.mkdir(self.dir, 0o700)  # fails rather than reuse an existing directory
        self.created: dict[Path, None] = {}  # ordered set of the files we made
        self.created_dirs: list[Path] = []

    def file(self, name: str) -> str:
        path = self.dir / name
        self.created[path] = None
        return str(path)

    def subdir(self, name: str) -> Path:
        path = self.dir / name
        os.mkdir(path)
        self.created_dirs.append(path)
        return path

    def cleanup(self) -> list[str]:
        """Remove what we created; return anything left behind (never someone else's file)."""
        for path in self.created:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        left = []
        for directory in list(reversed(self.created_dirs)) + [self.dir]:
            try:
                os.rmdir(directory)
            except FileNotFoundError:
                pass
            except OSError:
                left.append(str(directory))
        return left


def check_target(path: str | os.PathLike) -> Path:
    target = Path(path)
    if not target.exists():
        raise UsageError(f"PATH {target} does not exist", hint="give an existing directory on the file system to measure")
    if not target.is_dir():
        raise UsageError(f"PATH {target} is not a directory",
                         hint="give a directory; mleng io writes its files into a new subdirectory of it")
    try:
        st = os.statvfs(target)
    except OSError as exc:
        raise UsageError(f"PATH {target} cannot be inspected: {exc.strerror or exc}") from None
    if st.f_blocks == 0:
        raise UsageError(f"PATH {target} is on {filesystem_type(target)}, a virtual file system with no storage "
                         "behind it", hint="give a directory on the disk or shared file system you want to measure")
    if not os.access(target, os.W_OK | os.X_OK):
        raise UsageError(f"PATH {target} is not writable by this user", hint="choose a directory you can write to")
    return target


def space_needed(size_bytes: int, metadata_files: int) -> tuple[int, int]:
    """Bytes the run writes, and the margin kept free on top (so we never fill a disk)."""
    data = size_bytes + metadata_files * 2 * METADATA_FILE_BYTES
    margin = max(64 * 2**20, data // 10)
    return data, margin


def check_space(target: Path, size_bytes: int, metadata_files: int) -> dict[str, int]:
    st = os.statvfs(target)
    free = st.f_bavail * st.f_frsize
    data, margin = space_needed(size_bytes, metadata_files)
    if free < data + margin:
        raise UsageError(
            f"not enough free space on {target}: {format_bytes(free)} free, this run needs "
            f"{format_bytes(data + margin)} ({format_bytes(data)} of files + {format_bytes(margin)} margin)",
            hint="pass a smaller --size (or fewer --files), or free space first",
        )
    inodes_needed = metadata_files + 64
    if st.f_files > 0 and st.f_favail < inodes_needed:
        raise UsageError(
            f"not enough free inodes on {target}: {st.f_favail} free, this run creates up to {inodes_needed} files",
            hint="pass fewer --files, or free inodes first",
        )
    return {"free_bytes": free, "needed_bytes": data, "margin_bytes": margin, "free_inodes": st.f_favail}


def filesystem_type(path: Path) -> str:
    """The type of the mount holding path (ext4, xfs, nfs, lustre, tmpfs...), from /proc/mounts."""
    best, fstype = "", "unknown"
    resolved = str(path.resolve())
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                if (resolved == mount or resolved.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                    best, fstype = mount, parts[2]
    except OSError:
        pass
    return fstype


def direct_io_supported(workspace: Workspace) -> bool:
    """Whether this file system takes O_DIRECT (tmpfs and some FUSE mounts refuse it)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    path = workspace.file("direct-probe")
    buf = mmap.mmap(-1, ALIGN)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o600)
    except OSError:
        return False
    try:
        os.pwrite(fd, buf, 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)
        buf.close()


def make_cold(paths: list[str], direct_ok: bool, fstype: str) -> str:
    """Make the next reads of paths come from storage; return how (recorded with the numbers)."""
    if fstype in MEMORY_FILESYSTEMS:
        return "none: the file system lives in memory"
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass  # not root, or a container with a read-only /proc/sys: fall back
    if direct_ok:
        return "o_direct"
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise_dontneed (advisory; some pages may stay cached)"
