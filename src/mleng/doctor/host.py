"""Host checks read from this machine (not from a fingerprint): swap, and free space on every real file system."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mleng.doctor.findings import Finding, fail, inconclusive, ok, warn
from mleng.measure.sizes import GIB

# imbue-ai/cluster-health fails a host with any file system 95% full (health_checks.py DiskSpaceHealthCheck)
DISK_FULL_FRACTION = 0.95
# File systems that hold no files of a job: kernel interfaces, memory-backed and container plumbing.
PSEUDO_FS = frozenset({"proc", "sysfs", "devtmpfs", "devpts", "tmpfs", "cgroup", "cgroup2", "securityfs", "debugfs",
                       "tracefs", "pstore", "bpf", "configfs", "fusectl", "mqueue", "hugetlbfs", "autofs", "binfmt_misc",
                       "rpc_pipefs", "nsfs", "squashfs", "overlay", "efivarfs", "ramfs", "selinuxfs", "fuse.lxcfs"})


def parse_swaps(text: str) -> list[dict[str, Any]]:
    """/proc/swaps -> [{name, type, size_kib, used_kib}] (the header line skipped)."""
    out = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 4:
            out.append({"name": fields[0], "type": fields[1], "size_kib": int(fields[2]), "used_kib": int(fields[3])})
    return out


def check_swap(swaps_path: str = "/proc/swaps") -> list[Finding]:
    try:
        text = Path(swaps_path).read_text()
    except OSError as exc:
        return [inconclusive("swap", f"{swaps_path} unreadable: {exc.strerror or exc}")]
    swaps = parse_swaps(text)
    if not swaps:
        return [ok("swap", "swap is off", measured=[])]
    total = sum(s["size_kib"] for s in swaps) * 1024
    used = sum(s["used_kib"] for s in swaps) * 1024
    return [warn("swap", f"swap is on ({', '.join(s['name'] for s in swaps)}: {total / GIB:.1f} GiB, "
                 f"{used / GIB:.1f} GiB used): a rank that swaps stalls every other rank at the next collective",
                 measured=swaps, cause="swapoff -a, and remove the swap entry from /etc/fstab",
                 handbook=["cpu-oom-killed"])]


# Network and FUSE file systems are left out: statfs on a hung NFS or Lustre mount blocks, and the checkpoint
# check (--checkpoint-dir) measures the shared file system a job writes to.
NETWORK_FS = frozenset({"nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "beegfs", "ceph", "glusterfs", "9p",
                        "wekafs", "virtiofs"})


def real_mounts(mounts_path: str = "/proc/mounts") -> list[tuple[str, str, str]]:
    """(device, mount point, type) of the mounted file systems that hold files (pseudo file systems left out)."""
    out, seen = [], set()
    for line in Path(mounts_path).read_text().splitlines():
        fields = line.split()
        if len(fields) < 3 or fields[2] in PSEUDO_FS or fields[2] in NETWORK_FS or fields[2].startswith("fuse") \
                or fields[1] in seen:
            continue
        seen.add(fields[1])
        out.append((fields[0], fields[1].replace("\\040", " "), fields[2]))
    return out


def check_disk_space(mounts_path: str = "/proc/mounts") -> list[Finding]:
    try:
        mounts = real_mounts(mounts_path)
    except OSError as exc:
        return [inconclusive("disk_space", f"{mounts_path} unreadable: {exc.strerror or exc}")]
    findings, fine = [], []
    for device, mount, fstype in mounts:
        try:
            stat = os.statvfs(mount)
        except OSError:
            continue  # a stale network mount: the checkpoint check reports the one that matters
        if not stat.f_blocks:
            continue
        used = 1 - stat.f_bavail / stat.f_blocks
        if used >= DISK_FULL_FRACTION:
            findings.append(fail("disk_space", f"{mount} ({fstype} on {device}) is {used * 100:.0f}% full, "
                                 f"{stat.f_bavail * stat.f_frsize / GIB:.1f} GiB left: logs, caches and containers "
                                 "fail to write", subject=mount, measured={"used_fraction": round(used, 4)},
                                 handbook=["disk-full-checkpoint"]))
        else:
            fine.append(f"{mount} {used * 100:.0f}%")
    if not findings:
        findings.append(ok("disk_space", f"{len(fine)} file system(s) below {DISK_FULL_FRACTION * 100:.0f}% full: "
                           + ", ".join(fine), measured={"mounts": fine}))
    return findings
