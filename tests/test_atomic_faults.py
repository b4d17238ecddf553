"""Atomic extraction and temporaries under faults; all real (processes, files, pid namespaces, users).

- Extracted directories keep the archive's modes, like upstream's in-place extraction; nemo_safe's
  own folders follow the umask and a setgid parent, so two users of one group share a root.
- Temporaries of live writers in another pid namespace of this host (containers sharing the
  hostname) survive a sweep; an extraction whose staging folder lost files raises.
- Archives never write outside their destination through absolute, ``..`` or link members (what
  Python 3.14's tarfile refuses); a symlink the user put there before (a subfolder on another disk)
  is written through, as upstream does, with one warning.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import IN_CI

import nemo_safe  # noqa: F401  (patches torchvision in this process)
from nemo_safe.atomic_files import owned_temp_name, pid_alive, sweep_stale_temps
from nemo_safe_tools import download_race
from nemo_safe_tools.loopback_mirror import LoopbackMirror

from faulty_mirror import Faults, FaultyMirror
from procs import clean_env

WORKER = str(Path(__file__).resolve().parent / "atomic_faults_worker.py")
HANG_GUARD = 300
#: Numeric ids without passwd entries: a group shared by two users, each with a primary group of its own.
GROUP, USER_A, USER_B = 47001, (47011, 47011), (47012, 47012)


def _start(action: str, *args: str | Path, unshare: bool = False, env: dict[str, str] | None = None, **opts):
    """A worker process; ``opts`` become ``--name value`` options."""
    cmd = [sys.executable, WORKER, action, *map(str, args)]
    for key, value in opts.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    if unshare:
        cmd = ["unshare", "-pf", "--mount-proc", *cmd]
    return subprocess.Popen(
        cmd, env=clean_env(**(env or {})), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def _result(proc: subprocess.Popen, timeout: float = HANG_GUARD) -> dict:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"worker hung: {err[-2000:]}")
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"worker exit {proc.returncode}: {err[-3000:]}"
    return json.loads(lines[-1])


def _run(action: str, *args: str | Path, **kw) -> dict:
    return _result(_start(action, *args, **kw))


def _ok(res: dict) -> dict:
    assert res["status"] == "ok", res
    return res


def _wait_until(check, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.005)
    pytest.fail(f"{what} did not happen within {timeout} s")


def _temps(directory: Path, prefix: str) -> list[str]:
    try:
        return [n for n in os.listdir(directory) if n.startswith(f".tmp.{prefix}~")]
    except FileNotFoundError:
        return []


def _tree(root: Path) -> dict[str, tuple]:
    """Every path under ``root``: kind, mode, owner, group and (files) content digest."""
    out = {}
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(top, name)
            st = path.lstat()
            digest = hashlib.md5(path.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else None
            out[str(path.relative_to(root))] = (stat.S_IFMT(st.st_mode), oct(stat.S_IMODE(st.st_mode)), st.st_uid,
                                                st.st_gid, digest)  # fmt: skip
    return out


def _listing(root: Path) -> set[str]:
    return {str(Path(top, n).relative_to(root)) for top, dirs, files in os.walk(root) for n in dirs + files}


def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _member(name: str, kind: bytes = tarfile.REGTYPE, mode: int = 0o644, link: str = "", owner: int = 4321):
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.linkname, info.uid, info.gid, info.mtime = kind, mode, link, owner, owner, 1_600_000_000
    return info


def _zip(path: Path, members: list[tuple[str, bytes | None, int]]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data, mode in members:
            info = zipfile.ZipInfo(name, date_time=(2020, 9, 13, 12, 26, 40))
            info.external_attr = ((stat.S_IFDIR if data is None else stat.S_IFREG) | mode) << 16
            zf.writestr(info, b"" if data is None else data)
    return path


def _require(what: str, cmd: list[str]) -> None:
    ok = os.geteuid() == 0 and shutil.which(cmd[0]) is not None
    if ok:
        ok = subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0
    if not ok:
        if IN_CI:
            pytest.fail(f"CI must run this test but {what} is not possible here", pytrace=False)
        pytest.skip(f"{what} is not possible here (needs root)")


@pytest.fixture(scope="session")
def pid_namespaces() -> None:
    _require("a fresh pid namespace (unshare -pf --mount-proc)", ["unshare", "-pf", "--mount-proc", "true"])


@pytest.fixture()
def group_dir() -> Iterator[Path]:
    """``/tmp/<x>/shared``: setgid, group-writable (0o2775), owned by root and the shared group."""
    _require("switching users", ["true"])
    base = Path(tempfile.mkdtemp(prefix="nemo_safe-group-", dir="/tmp"))
    try:
        base.chmod(0o755)
        shared = base / "shared"
        shared.mkdir()
        os.chown(shared, 0, GROUP)
        shared.chmod(0o2775)
        yield shared
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _as(user: tuple[int, int]) -> dict[str, str]:
    return {"user": f"{user[0]}:{user[1]}:{user[1]},{GROUP}", "umask": "002"}


def _dead_pid() -> int:
    """A pid nothing in this namespace has (the kernel hands out pids upwards; these are the last ones)."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    return next(p for p in range(pid_max - 100, 300, -1) if not pid_alive(p))


# -- (3) modes: like upstream's in-place extraction; nemo_safe's own folders like os.makedirs ------------------


def _mode_archive(tmp_path: Path, kind: str) -> Path:
    dirs = [("private", 0o700), ("private/inner", 0o750), ("group", 0o2775), ("open", 0o777)]
    files = [("private/inner/key", b"secret", 0o600), ("group/shared.txt", b"ours", 0o664), ("open/x", b"x", 0o755)]
    if kind == "zip":
        return _zip(tmp_path / "modes.zip", [(f"{n}/", None, m) for n, m in dirs] + files)
    members = [(_member(n, tarfile.DIRTYPE, m), None) for n, m in dirs]
    return _tar(tmp_path / "modes.tar", members + [(_member(n, mode=m), d) for n, d, m in files])


@pytest.mark.parametrize("kind", ["tar", "zip"])
def test_new_directories_get_the_modes_of_upstream_extraction(tmp_path: Path, kind: str) -> None:
    """A 0700 directory in a tar stays 0700 (not 0o777 & ~umask), with its owner, exactly as
    torchvision's own extractor leaves it in place (run with NEMO_SAFE_DISABLE=1 next to it)."""
    archive = _mode_archive(tmp_path, kind)
    ours = _start("extract", archive, tmp_path / "ours", umask="022")
    upstream = _start("extract", archive, tmp_path / "upstream", umask="022", env={"NEMO_SAFE_DISABLE": "1"})
    _ok(_result(ours)), _ok(_result(upstream))
    theirs = _tree(tmp_path / "upstream")
    assert _tree(tmp_path / "ours") == theirs
    if kind == "tar":
        assert theirs["private"][1] == "0o700" and theirs["private"][2] == 4321, theirs


def test_existing_directories_keep_their_mode(tmp_path: Path) -> None:
    from torchvision.datasets.utils import extract_archive

    archive = _mode_archive(tmp_path, "tar")
    dest = tmp_path / "dest"
    (dest / "private").mkdir(parents=True)
    (dest / "private").chmod(0o2771)
    extract_archive(str(archive), str(dest))
    assert stat.S_IMODE((dest / "private").stat().st_mode) == 0o2771
    assert (dest / "private" / "inner" / "key").read_bytes() == b"secret"
    assert stat.S_IMODE((dest / "private" / "inner").stat().st_mode) == 0o750


def test_group_shared_root_serves_two_users(group_dir: Path) -> None:
    """A setgid group folder (0o2775, umask 002): user A's failed MNIST download leaves its lock
    folder and raw files, then user B of the same group downloads into them; both users' barrier
    jobs meet in one folder at once; both extract into one destination. Every folder nemo_safe
    made is 0o2775 in the shared group, as os.makedirs makes it there."""
    raw = download_race.synthetic_mnist(train=600, test=100, seed=3)
    resources = json.dumps(download_race.resources_of(raw))
    with FaultyMirror(raw, faults=Faults(corrupt={"t10k-labels-idx1-ubyte.gz"})) as bad:
        failed = _run("mnist", group_dir, bad.url, resources=resources, **_as(USER_A))
    assert failed["status"] == "error", failed
    mnist = group_dir / "MNIST"
    for folder in (mnist, mnist / "raw", mnist / ".nemo_safe"):
        st = folder.stat()
        assert (oct(stat.S_IMODE(st.st_mode)), st.st_gid) == ("0o2775", GROUP), folder
    assert any(p.stat().st_uid == USER_A[0] for p in (mnist / ".nemo_safe").iterdir())
    with LoopbackMirror(raw) as good:
        loaded = _ok(_run("mnist", group_dir, good.url, resources=resources, **_as(USER_B)))
    assert (loaded["data_sha"], loaded["targets_sha"]) == tuple(download_race.reference_digests(raw).values())
    assert not [p for p in mnist.rglob("*") if p.name.startswith((".tmp.", ".nemo_safe"))]

    exp = group_dir / "exp"
    exp.mkdir()
    exp.chmod(0o2775)  # the job's folder, shared like the root
    jobs = []
    job_b_done = group_dir / "job B done"  # job A's rank 0 works until then: job B runs while A's folder is there
    for name, user, port, hold in (("jobA", USER_A, "29611", {"hold": job_b_done}), ("jobB", USER_B, "29612", {})):
        for rank in (0, 1):
            env = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "TORCHELASTIC_RUN_ID": name,
                   "TORCHELASTIC_RESTART_COUNT": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}  # fmt: skip
            jobs.append(_start("barrier", exp, name, work=1, env=env, **hold, **_as(user)))
        if name == "jobA":
            _wait_until(lambda: list((exp / ".nemo_safe").glob("*")), "job A's barrier folder")
    job_b = [_ok(_result(p)) for p in jobs[2:]]
    job_b_done.touch()
    results = [_ok(_result(p)) for p in jobs[:2]] + job_b
    seen = {d: v for r in results for d, v in r.get("barrier_dirs", {}).items()}
    assert len(seen) == 3, seen  # the shared parent and each job's own folder
    assert any("jobA" in d for d in results[2]["barrier_dirs"]), "job B did not run while job A's folder was there"
    assert all(v == [0o2775, GROUP] for v in seen.values()), seen

    common = (_member("common", tarfile.DIRTYPE, 0o775), None)
    for name, user in (("a", USER_A), ("b", USER_B)):
        archive = _tar(group_dir.parent / f"{name}.tar", [common, (_member(f"common/{name}"), name.encode())])
        _ok(_run("extract", archive, group_dir / "data", **_as(user)))
    assert sorted(os.listdir(group_dir / "data" / "common")) == ["a", "b"]
    assert oct(stat.S_IMODE((group_dir / "data").stat().st_mode)) == "0o2775"


def test_read_only_directories_extract_as_a_user_like_upstream(group_dir: Path) -> None:
    """A 0555 directory in an archive, extracted by a user who is not root (root may write anywhere):
    published with its mode and content, as upstream leaves it in place."""
    ro = [(_member("ro", tarfile.DIRTYPE, 0o555), None), (_member("ro/sub", tarfile.DIRTYPE, 0o555), None)]
    archive = _tar(group_dir.parent / "ro.tar", [*ro, (_member("ro/sub/f", mode=0o444), b"f"), (_member("ro/g"), b"g")])
    ours = _start("extract", archive, group_dir / "ours", **_as(USER_A))
    upstream = _start("extract", archive, group_dir / "upstream", env={"NEMO_SAFE_DISABLE": "1"}, **_as(USER_A))
    _ok(_result(ours)), _ok(_result(upstream))
    theirs = _tree(group_dir / "upstream")
    assert theirs["ro"][1] == "0o555", theirs
    assert _tree(group_dir / "ours") == theirs


@pytest.mark.parametrize("twin", ["upstream", "nemo_safe"])
def test_sticky_folder_with_another_users_writable_file(group_dir: Path, twin: str) -> None:
    """A sticky shared folder (1777) holds user A's world-writable file with stale bytes; user B
    downloads it again. Upstream rewrites it in place; renaming over another user's file is refused
    there, so nemo_safe rewrites it in place too (with a warning) instead of failing."""
    sticky = group_dir / "scratch"
    sticky.mkdir()
    sticky.chmod(0o1777)
    stale = sticky / "blob.bin"
    stale.write_bytes(b"stale bytes\n")
    os.chown(stale, *USER_A)
    stale.chmod(0o666)
    fresh = os.urandom(200_000)
    env = {"NEMO_SAFE_DISABLE": "1" if twin == "upstream" else "0"}
    with LoopbackMirror({"blob.bin": fresh}) as mirror:
        res = _run("download", mirror.url + "blob.bin", sticky, md5=hashlib.md5(fresh).hexdigest(), env=env,
                   **_as(USER_B))  # fmt: skip
    _ok(res)
    assert stale.read_bytes() == fresh
    assert not [p for p in sticky.iterdir() if p.name.startswith(".tmp.")]


# -- (4) temporaries of live writers in another pid namespace; a staging folder that lost files ---------------


def test_live_download_in_another_pid_namespace_survives_a_sweep(tmp_path: Path, pid_namespaces) -> None:
    """A container sharing this hostname downloads (its pid is dead here) while a process here
    downloads into the same folder, which sweeps it: the live temporary stays, both succeed."""
    big, small = os.urandom(3 << 20), b"small file\n"
    files = {"big.bin": big, "small.bin": small}
    directory, go = tmp_path / "data", tmp_path / "go"
    directory.mkdir()
    pid = _dead_pid()
    with LoopbackMirror(files, rate=len(big) / 8) as mirror:
        here = _start("download", mirror.url + "small.bin", directory, md5=hashlib.md5(small).hexdigest(), go=go)
        there = _start("download", mirror.url + "big.bin", directory, md5=hashlib.md5(big).hexdigest(), as_pid=pid,
                       unshare=True)  # fmt: skip
        temp = _wait_until(lambda: _temps(directory, "big.bin"), "the other namespace's temporary")[0]
        assert not pid_alive(pid)
        go.touch()
        _ok(_result(here))
        assert there.poll() is None, "the download in the other namespace ended before the sweep: test too fast"
        assert (directory / temp).exists(), f"{temp} of a live writer was swept"
        res = _result(there)
    assert f"~{pid}~" in temp, f"{temp} must carry the writer's pid, dead in this namespace, to test the sweep"
    _ok(res)
    assert (directory / "big.bin").read_bytes() == big and (directory / "small.bin").read_bytes() == small
    assert not _temps(directory, "")


def _big_tar(tmp_path: Path, count: int = 30000) -> tuple[Path, set[str]]:
    members = [(_member(f"big/d{i % 50:02d}/f{i:06d}.bin"), b"%08d" % i * 64) for i in range(count)]
    return _tar(tmp_path / "big.tar", members), {f"big/d{i % 50:02d}/f{i:06d}.bin" for i in range(count)}


def test_live_extraction_in_another_pid_namespace_survives_a_sweep(tmp_path: Path, pid_namespaces) -> None:
    """A long extraction in another pid namespace (same hostname) while a process here extracts
    into the same destination: its staging folder is not swept, every file is published."""
    archive, names = _big_tar(tmp_path)
    small = _tar(tmp_path / "small.tar", [(_member("small.txt"), b"small")])
    dest, go = tmp_path / "dest", tmp_path / "go"
    dest.mkdir()
    pid = _dead_pid()
    here = _start("extract", small, dest, go=go)
    there = _start("extract", archive, dest, as_pid=pid, unshare=True)
    # The staging folder is next to the destination, named after it (never listed among its classes).
    temp = _wait_until(lambda: _temps(dest.parent, "dest"), "the other namespace's extraction folder")[0]
    assert not pid_alive(pid)
    go.touch()
    _ok(_result(here))
    assert there.poll() is None, "the extraction in the other namespace ended before the sweep: test too fast"
    assert (dest.parent / temp).is_dir(), f"{temp} of a live extraction was swept"
    res = _result(there)
    assert f"~{pid}~" in temp, f"{temp} must carry the writer's pid, dead in this namespace, to test the sweep"
    _ok(res)
    published = {str(p.relative_to(dest)) for p in (dest / "big").rglob("*.bin")}
    assert published == names, f"{len(names - published)} files missing after a normal return"
    assert (dest / "small.txt").read_bytes() == b"small"


def test_extraction_that_lost_files_raises(tmp_path: Path) -> None:
    """Another process removes the staging folder while the extraction runs (an old cleaner, a
    stray rm -rf): the extraction raises FileNotFoundError instead of returning with files missing."""
    archive, _ = _big_tar(tmp_path)
    dest = tmp_path / "dest"
    dest.mkdir()
    deleter = _start("delete-staging", dest.parent, after=2000)  # the staging folder is next to dest
    time.sleep(0.5)  # the deleter is watching (its imports are done long before the extraction folder fills)
    res = _run("extract", archive, dest)
    removed = _ok(_result(deleter))
    assert removed["began"] < res["ended"], (removed, res)  # the removal overlapped the extraction
    assert res["status"] == "error", f"extraction returned normally after {removed['removed']} was removed"
    assert res["oserror"], res  # ours (FileNotFoundError) or tarfile's own, never a normal return


def _file_count(folder: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(folder))


def test_killed_extraction_adds_no_class_to_the_destination(tmp_path: Path, pid_namespaces) -> None:
    """An extraction killed halfway in another pid namespace (a container sharing this hostname: its leftover
    is judged by age, so it stays for a day) leaves its staging folder next to the destination, not inside:
    once a second extraction completed, ImageFolder finds the archive's classes only, as upstream's does
    after the same kill. (A staging folder inside the destination would be listed first, as class 0.)"""
    from torchvision.datasets.folder import find_classes

    archive, _ = _big_tar(tmp_path)
    classes = {}
    for label, env in (("nemo_safe", {}), ("upstream", {"NEMO_SAFE_DISABLE": "1"})):
        dest = tmp_path / label / "train"
        dest.mkdir(parents=True)
        killed = _start("extract", archive, dest, as_pid=_dead_pid(), unshare=True, env=env)
        _wait_until(lambda d=dest: _file_count(d.parent) >= 3000, f"{label}: a tenth of the extraction")
        # The namespace's first process: killing it kills every process in the namespace.
        for child in Path(f"/proc/{killed.pid}/task/{killed.pid}/children").read_text().split():
            os.kill(int(child), signal.SIGKILL)
        killed.communicate(timeout=HANG_GUARD)
        assert _file_count(dest.parent) < 30000, f"{label}: the extraction finished before it was killed: test too slow"
        _ok(_run("extract", archive, dest, env=env))
        classes[label] = find_classes(str(dest))[0]
    assert classes["nemo_safe"] == classes["upstream"] == ["big"], classes


def test_old_names_and_other_namespaces_are_judged_by_age(tmp_path: Path) -> None:
    """Same host, dead pid: removed only when the name says this boot and pid namespace; old names
    (``~<host>~<pid>~``, no namespace) and other namespaces wait for the age limit."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mine = owned_temp_name("f")
    owner = mine.split("~")[1]
    host, _, pidns = owner.partition("@")
    other = f"{host}@{pidns[:16]}-1"
    names = {
        "this namespace": f".tmp.f~{owner}~{dead.pid}~aa",
        "old name": f".tmp.f~{host}~{dead.pid}~bb",
        "other namespace": f".tmp.f~{other}~{dead.pid}~cc",
        "old name, 25 h": f".tmp.f~{host}~{dead.pid}~dd",
        "other namespace, 25 h": f".tmp.f~{other}~{dead.pid}~ee",
        "live": mine,
    }
    for label, name in names.items():
        (tmp_path / name).write_bytes(b"x")
        if "25 h" in label:
            old = time.time() - 25 * 3600
            os.utime(tmp_path / name, (old, old))
    assert not pid_alive(dead.pid)
    removed = set(sweep_stale_temps(str(tmp_path)))
    assert removed == {names["this namespace"], names["old name, 25 h"], names["other namespace, 25 h"]}


def test_a_killed_writer_not_yet_reaped_is_dead(tmp_path: Path) -> None:
    """A killed process whose parent has not waited for it yet (a launcher reaping its children in rank
    order) keeps its pid as a zombie: ``kill(pid, 0)`` still succeeds. It can never write again, so its
    temporaries are swept and a lock it held is taken over after a few beats, not after the stale limit."""
    import signal

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        head, owner, _, token = owned_temp_name("f").rsplit("~", 3)
        temp = tmp_path / "~".join((head, owner, str(child.pid), token))  # as the child would have named it
        temp.write_bytes(b"x")
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while b") Z " not in Path(f"/proc/{child.pid}/stat").read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(child.pid, 0)  # the naive check: the pid still exists
        assert not pid_alive(child.pid)
        assert sweep_stale_temps(str(tmp_path)) == [temp.name]
    finally:
        child.kill()
        child.wait()


# -- (9) nothing written outside the destination -------------------------------------------------------------


def _extract_here(archive: Path, dest: Path) -> OSError | None:
    """Extract with nemo_safe in this process; the OSError raised, if any."""
    from torchvision.datasets.utils import extract_archive

    try:
        extract_archive(str(archive), str(dest))
    except OSError as exc:
        return exc
    return None


def _extract_upstream(archive: Path, dest: Path) -> dict:
    return _run("extract", archive, dest, env={"NEMO_SAFE_DISABLE": "1"})


@pytest.mark.parametrize("where", ["same disk", "another disk", "another disk, nested"])
@pytest.mark.parametrize("kind", ["tar", "zip"])
def test_symlink_in_destination_leading_outside_is_followed_like_upstream(
    tmp_path: Path, kind: str, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A dataset subfolder the user linked to another folder or disk (``root/cifar-10-batches-py`` ->
    ``/scratch/...``): checked members never create such a link, so it was there before, and the
    extraction goes through it as upstream's does, with one warning, instead of failing after the whole
    download. To another filesystem nothing can be renamed: the archive is extracted in place by
    upstream's extractor (found up front for the destination's own entries, on the first failed rename
    for a deeper link)."""
    if kind == "tar":
        archive = _tar(tmp_path / "a.tar", [(_member("sub/file"), b"payload"), (_member("sub/deeper/f"), b"d")])
    else:
        archive = _zip(tmp_path / "a.zip", [("sub/file", b"payload", 0o644), ("sub/deeper/f", b"d", 0o644)])
    elsewhere = tmp_path if where == "same disk" else Path(tempfile.mkdtemp(dir="/dev/shm"))
    linked = "sub/deeper" if where.endswith("nested") else "sub"
    try:
        for label in ("ours", "upstream"):
            (elsewhere / f"outside-{label}").mkdir()
            (tmp_path / f"dest-{label}" / linked).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / f"dest-{label}" / linked).symlink_to(elsewhere / f"outside-{label}")
        _ok(_extract_upstream(archive, tmp_path / "dest-upstream"))
        with caplog.at_level(logging.WARNING, logger="nemo_safe"):
            assert _extract_here(archive, tmp_path / "dest-ours") is None
        assert _tree(elsewhere / "outside-ours") == _tree(elsewhere / "outside-upstream")
        assert _tree(tmp_path / "dest-ours") == _tree(tmp_path / "dest-upstream")
        inside = "deeper/f" if linked == "sub" else "f"
        assert (elsewhere / "outside-ours" / inside).read_bytes() == b"d"
        expected = "extracting through it" if where == "same disk" else "leads to another filesystem"
        assert sum(expected in r.getMessage() for r in caplog.records) == 1, caplog.text
        for folder in (tmp_path / "dest-ours", elsewhere / "outside-ours"):
            assert not [n for n in os.listdir(folder) if n.startswith(".tmp.")], os.listdir(folder)
    finally:
        if elsewhere != tmp_path:
            shutil.rmtree(elsewhere, ignore_errors=True)


def test_symlink_in_destination_leading_inside_is_followed_like_upstream(tmp_path: Path) -> None:
    from torchvision.datasets.utils import extract_archive

    archive = _tar(tmp_path / "a.tar", [(_member("alias/file"), b"payload")])
    for label in ("ours", "upstream"):
        (tmp_path / label / "real").mkdir(parents=True)
        (tmp_path / label / "alias").symlink_to("real")
    _ok(_extract_upstream(archive, tmp_path / "upstream"))
    extract_archive(str(archive), str(tmp_path / "ours"))
    assert _tree(tmp_path / "ours") == _tree(tmp_path / "upstream")
    assert (tmp_path / "ours" / "real" / "file").read_bytes() == b"payload"


def _escaping_tar(tmp_path: Path, case: str) -> Path:
    """Members that lead to ``tmp_path/outside`` from a destination 3 levels below ``tmp_path``
    (nemo_safe's staging folder inside ``tmp_path/our/dest``, upstream's ``tmp_path/up/x/dest``)."""
    up = "../../../outside"
    members = {
        "absolute": [(_member(str(tmp_path / "outside" / "abs.txt")), b"pwned")],
        "dotdot": [(_member("ok.txt"), b"ok"), (_member(f"{up}/up.txt"), b"pwned")],
        "symlink": [(_member("link", tarfile.SYMTYPE, link=up), None), (_member("link/via.txt"), b"pwned")],
        # Each link target stays inside when read as text; resolved, d/u is two levels above the root.
        "symlink chain": [
            (_member("d", tarfile.DIRTYPE, 0o755), None),
            (_member("d/s", tarfile.SYMTYPE, link=".."), None),
            (_member("d/t", tarfile.SYMTYPE, link="s/.."), None),
            (_member("d/u", tarfile.SYMTYPE, link="t/.."), None),
            (_member("d/u/chain.txt"), b"pwned"),
        ],
        "hard link": [(_member("hl", tarfile.LNKTYPE, link=f"{up}/victim.txt"), None), (_member("hl"), b"pwned")],
    }[case]
    return _tar(tmp_path / "evil.tar", members)


def _outside_of(tmp_path: Path, dest: Path) -> dict[str, tuple]:
    return {p: v for p, v in _tree(tmp_path).items() if not (tmp_path / p).is_relative_to(dest)}


@pytest.mark.parametrize("case", ["absolute", "dotdot", "symlink", "symlink chain", "hard link"])
def test_tar_members_leaving_the_destination_are_refused(tmp_path: Path, case: str) -> None:
    """What tarfile before 3.14 extracts as it is (the upstream twin on this Python writes outside its
    destination), nemo_safe refuses before writing anything, on every Python."""

    archive = _escaping_tar(tmp_path, case)
    upstream, ours = tmp_path / "up" / "x" / "dest", tmp_path / "our" / "dest"
    for dest in (upstream, ours):
        dest.mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "victim.txt").write_bytes(b"victim")
    before = _outside_of(tmp_path, upstream)
    res = _extract_upstream(archive, upstream)
    if sys.version_info < (3, 14):
        assert _outside_of(tmp_path, upstream) != before, f"the upstream twin wrote nothing outside: {res}"
    shutil.rmtree(tmp_path / "up")
    shutil.rmtree(tmp_path / "outside")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "victim.txt").write_bytes(b"victim")
    before = _outside_of(tmp_path, ours)
    error = _extract_here(archive, ours)
    assert _outside_of(tmp_path, ours) == before, "written outside the destination"
    assert isinstance(error, OSError) and str(archive) in str(error), error
    assert "outside the destination" in str(error) or "absolute" in str(error), error
    assert not os.listdir(ours)


def test_zip_names_leaving_the_destination_stay_inside_like_upstream(tmp_path: Path) -> None:
    from torchvision.datasets.utils import extract_archive

    archive = _zip(
        tmp_path / "z.zip", [("../../up.txt", b"u", 0o644), ("/abs/x.txt", b"a", 0o644), ("ok/y", b"y", 0o644)]
    )
    for label in ("ours", "upstream"):
        (tmp_path / label / "dest").mkdir(parents=True)
    _ok(_extract_upstream(archive, tmp_path / "upstream" / "dest"))
    extract_archive(str(archive), str(tmp_path / "ours" / "dest"))
    assert _listing(tmp_path / "ours") == _listing(tmp_path / "upstream")
    assert _listing(tmp_path / "ours") == {"dest", "dest/up.txt", "dest/abs", "dest/abs/x.txt", "dest/ok", "dest/ok/y"}
