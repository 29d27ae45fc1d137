"""mleng io: real files, real fio, real signals and a real tiny file system; never someone else's files."""

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time

import pytest

from mleng.measure import storage

FIELDS = {"workload", "engine", "target", "bytes", "ops", "elapsed_s", "bandwidth_gbps", "bandwidth_mibps",
          "iops", "latency_p50_us", "latency_p99_us", "jobs"}
QUICK = ["--size", "64MiB", "--jobs", "2", "--duration", "0.5", "--files", "200"]
HAVE_FIO = shutil.which("fio") is not None


@pytest.fixture
def target(tmp_path):
    """A directory that already holds someone else's files: they must survive every run."""
    directory = tmp_path / "target"
    directory.mkdir()
    (directory / "keep.txt").write_text("not yours")
    foreign = directory / ".mleng-io-someone-else"
    foreign.mkdir()
    (foreign / "shard.0").write_text("also not yours")
    return directory


def assert_untouched(directory):
    assert sorted(p.name for p in directory.iterdir()) == [".mleng-io-someone-else", "keep.txt"]
    assert (directory / "keep.txt").read_text() == "not yours"
    assert (directory / ".mleng-io-someone-else" / "shard.0").read_text() == "also not yours"


def env_for(mleng_home):
    return dict(os.environ, MLENG_HOME=str(mleng_home))


@pytest.mark.parametrize("engine", ["native", "fio"])
def test_every_workload_runs_and_cleans_up(run_mleng, target, engine):
    if engine == "fio" and not HAVE_FIO:
        pytest.skip("fio is not installed (CI installs it: apt-get install -y fio)")
    result = run_mleng("io", str(target), *QUICK, "--engine", engine, "--json")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["kind"] == "io" and record["status"] == "complete"
    workloads = [r["workload"] for r in record["rows"]]
    assert workloads == ["ckpt-save", "ckpt-load", "rand-read-4k", "rand-read-1m",
                         "metadata-create", "metadata-stat", "metadata-delete"]
    for row in record["rows"]:
        assert FIELDS <= set(row), FIELDS - set(row)
        assert row["iops"] > 0 and row["latency_p50_us"] > 0
        assert row["latency_p50_us"] <= row["latency_p99_us"]
        if row["workload"] in ("metadata-stat", "metadata-delete"):
            assert row["bandwidth_gbps"] is None  # no file data moved
        else:
            assert row["bandwidth_mibps"] == pytest.approx(row["bandwidth_gbps"] * 1e9 / 2**20)
        expected = "native" if row["workload"].startswith("metadata") else engine
        assert row["engine"] == expected
    rows = {r["workload"]: r for r in record["rows"]}
    assert rows["ckpt-save"]["bytes"] == 64 * 2**20 and rows["ckpt-save"]["fsync"] is True
    assert rows["ckpt-load"]["bytes"] == 64 * 2**20
    assert rows["ckpt-load"]["cold_method"] in ("drop_caches", "o_direct") or "fadvise" in rows["ckpt-load"]["cold_method"]
    assert rows["rand-read-4k"]["block_bytes"] == 4096 and rows["rand-read-1m"]["block_bytes"] == 2**20
    assert rows["metadata-create"]["ops"] == 200
    assert record["summary"]["value"] == pytest.approx(rows["ckpt-save"]["bandwidth_gbps"])
    assert_untouched(target)


def test_baseline_local_reports_ratios(run_mleng, target):
    result = run_mleng("io", str(target), *QUICK, "--engine", "native", "--workloads", "ckpt-save,rand-read-4k",
                       "--baseline", "local")
    assert result.returncode == 0, result.stderr
    assert "vs local" in result.stdout and "baseline" in result.stdout
    shown = json.loads(run_mleng("results", "show", "last", "--json").stdout)
    path_rows = [r for r in shown["rows"] if r["target"] == "path"]
    base_rows = [r for r in shown["rows"] if r["target"] == "baseline"]
    assert len(path_rows) == len(base_rows) == 2
    for row, base in zip(path_rows, base_rows):
        assert row["baseline_ratio"] == pytest.approx(row["bandwidth_gbps"] / base["bandwidth_gbps"])
    assert shown["summary"]["targets"]["baseline"]["left_behind"] == []
    assert_untouched(target)


@pytest.mark.parametrize("make_path, message", [
    (lambda d: d / "keep.txt", "is not a directory"),
    (lambda d: d / "missing", "does not exist"),
])
def test_path_must_be_a_directory(run_mleng, target, make_path, message):
    result = run_mleng("io", str(make_path(target)), *QUICK)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert_untouched(target)


@pytest.mark.parametrize("args, message", [
    (["--jobs", "0"], "--jobs"),
    (["--size", "1MiB", "--jobs", "4"], "shards under 1 MiB"),
    (["--op", "ckpt-save,defrag"], "unknown workload"),
    (["--duration", "0"], "--duration"),
])
def test_bad_arguments(run_mleng, target, args, message):
    result = run_mleng("io", str(target), *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert_untouched(target)


@pytest.fixture
def mount_tmpfs(tmp_path):
    """Real tmpfs mounts (we are root here; where mount is refused, e.g. an unprivileged container, skip)."""
    mounted = []

    def mount(size: str):
        mount_point = tmp_path / f"tmpfs-{size}"
        mount_point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(mount_point)
        return mount_point

    yield mount
    for mount_point in mounted:
        subprocess.run(["umount", str(mount_point)], check=True)


@pytest.fixture
def tiny_fs(mount_tmpfs):
    return mount_tmpfs("20m")


def test_refuses_a_file_system_without_room(run_mleng, tiny_fs):
    (tiny_fs / "keep.txt").write_text("not yours")
    result = run_mleng("io", str(tiny_fs), "--size", "64MiB", "--workloads", "ckpt-save")
    assert result.returncode == 2
    assert "not enough free space" in result.stderr and "20.0 MiB free" in result.stderr
    assert "needs 128 MiB (64 MiB of files + 64 MiB margin)" in result.stderr
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in tiny_fs.iterdir()) == ["keep.txt"]


def test_tmpfs_runs_warm_and_says_so(run_mleng, mount_tmpfs):
    # tmpfs has no O_DIRECT and cannot be made cold: the record must say the reads were warm.
    memory_fs = mount_tmpfs("100m")
    result = run_mleng("io", str(memory_fs), "--size", "4MiB", "--jobs", "2", "--duration", "0.3",
                       "--op", "ckpt-load,rand-read-4k", "--engine", "native", "--json")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["summary"]["targets"]["path"]["fs_type"] == "tmpfs"
    assert all(r["cold_method"].startswith("none: the file system lives in memory") for r in record["rows"])
    assert list(memory_fs.iterdir()) == []


def _limit_file_size():
    # A real resource limit: any write past 8 MiB in one file fails with EFBIG (Python ignores SIGXFSZ).
    resource.setrlimit(resource.RLIMIT_FSIZE, (8 * 2**20, 8 * 2**20))


@pytest.mark.parametrize("engine", ["native", "fio"])
def test_write_error_mid_run_fails_cleanly_and_removes_files(mleng_home, target, engine):
    if engine == "fio" and not HAVE_FIO:
        pytest.skip("fio is not installed (CI installs it: apt-get install -y fio)")
    result = subprocess.run([sys.executable, "-m", "mleng", "io", str(target), *QUICK, "--engine", engine,
                             "--op", "metadata", "--op", "ckpt-save"],
                            capture_output=True, text=True, env=env_for(mleng_home), preexec_fn=_limit_file_size,
                            timeout=120)
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "(failed)" in result.stdout
    # native: EFBIG from pwrite; fio does not ignore SIGXFSZ and is killed by it
    assert ("File too large" in result.stdout) if engine == "native" else ("File size limit exceeded" in result.stdout)
    assert "Traceback" not in result.stderr
    assert_untouched(target)
    listed = json.loads(subprocess.run([sys.executable, "-m", "mleng", "results", "show", "last", "--json"],
                                       env=env_for(mleng_home), capture_output=True, text=True).stdout)
    assert listed["status"] == "failed"
    assert [r["workload"] for r in listed["rows"]] == ["metadata-create", "metadata-stat", "metadata-delete"]


@pytest.mark.parametrize("engine", ["native", "fio"])
def test_ctrl_c_removes_files_and_keeps_what_was_measured(mleng_home, target, engine):
    if engine == "fio" and not HAVE_FIO:
        pytest.skip("fio is not installed (CI installs it: apt-get install -y fio)")
    proc = subprocess.Popen([sys.executable, "-m", "mleng", "io", str(target), "--size", "64MiB", "--jobs", "2",
                             "--duration", "60", "--engine", engine, "--workloads", "ckpt-save,rand-read-4k"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_for(mleng_home))
    try:
        while True:  # wait until the save is measured and the 60 s of random reads have begun
            line = proc.stderr.readline()
            assert line, "mleng io ended before the save was measured"
            if "ckpt-save" in line:
                break
        time.sleep(1.0)
        ours = [p for p in target.iterdir() if p.name not in ("keep.txt", ".mleng-io-someone-else")]
        assert len(ours) == 1 and any(ours[0].iterdir())  # its workspace, holding the shards
        proc.send_signal(signal.SIGINT)
        stdout, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert "(interrupted)" in stdout
    assert_untouched(target)
    assert not fio_processes_in(target)
    shown = json.loads(subprocess.run([sys.executable, "-m", "mleng", "results", "show", "last", "--json"],
                                      env=env_for(mleng_home), capture_output=True, text=True).stdout)
    assert shown["status"] == "interrupted"
    assert [r["workload"] for r in shown["rows"]] == ["ckpt-save"]


def fio_processes_in(directory):
    """Live fio processes whose command line names a job file under directory (read from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv and os.path.basename(argv[0]) == b"fio" and any(str(directory).encode() in a for a in argv):
            found.append(int(entry))
    return found


def test_workspace_cleanup_never_removes_foreign_files(tmp_path):
    workspace = storage.Workspace(tmp_path)
    with open(workspace.file("shard.0"), "w") as f:
        f.write("ours")
    (workspace.dir / "dropped-in-by-someone").write_text("theirs")
    left = workspace.cleanup()
    assert left == [str(workspace.dir)]
    assert sorted(p.name for p in workspace.dir.iterdir()) == ["dropped-in-by-someone"]


def test_space_check_numbers(tmp_path):
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(storage.UsageError) as caught:
        storage.check_space(tmp_path, free * 2, 0)
    assert "not enough free space" in caught.value.message
    data, margin = storage.space_needed(2**30, 0)
    assert data == 2**30 and margin == 2**30 // 10
