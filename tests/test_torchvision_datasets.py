"""Every other torchvision dataset with download=True: one download per root, next to the upstream twin.

Real torch / torchvision, 8 ranks of torch.multiprocessing.spawn (after a gloo
``init_process_group``, rank i starting i x SKEW later), a real throttled HTTP
mirror on 127.0.0.1 serving small generated datasets in each class's exact
layout (tests/dataset_files.py). The last rank starts (NPROCS - 1) x SKEW =
1.4 s after the first, well before the largest file's 3 s transfer can end: every
upstream rank finds it incomplete and fetches it again, N fetches by construction.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from dataset_files import BUILDERS, DatasetFiles, cifar10, svhn
from test_torchvision_downloads import HANG_GUARD, _assert_clean_root, _finish, _local_members, _member_cmd, throttled
from test_torchvision_downloads import SKEW as EXTRACTION_SKEW

from nemo_safe_tools.download_race import read_results

from download_harness import run_spawn
from faulty_mirror import Faults
from procs import clean_env, torchrun_env

NPROCS = 8
SKEW = 0.2
DOWNLOAD_SECONDS = 3.0


def _assert_loaded(results: dict[int, dict], nprocs: int, spec: DatasetFiles) -> None:
    assert sorted(results) == list(range(nprocs)), results
    for rank, res in results.items():
        assert res["status"] == "ok", (rank, res)
        assert (res["data_sha"], res["targets_sha"]) == (spec.reference["data_sha"], spec.reference["targets_sha"])


def _run_all(specs: list[DatasetFiles], base: Path, disable: bool) -> dict[str, tuple[dict, dict]]:
    """One spawn of NPROCS ranks (its start-up dominates) races each dataset in turn, each from its own
    mirror (throttled so that its largest file takes DOWNLOAD_SECONDS) into its own root, the ranks lined
    up by a barrier before each: dataset name -> (mirror stats, results)."""
    with contextlib.ExitStack() as stack:
        mirrors = [stack.enter_context(throttled(spec.files, seconds=DOWNLOAD_SECONDS)) for spec in specs]
        jobs = [
            {"dataset": spec.name, "root": str(base / spec.name / "root"), "results": str(base / spec.name / "res"),
             "mirror": mirror.url, "attrs": json.dumps(spec.attrs), "kwargs": json.dumps(spec.kwargs)}
            for spec, mirror in zip(specs, mirrors, strict=True)
        ]  # fmt: skip
        first, *rest = jobs
        out = run_spawn(
            NPROCS, Path(first["root"]), Path(first["results"]), first["mirror"], disable=disable, skew=SKEW,
            dataset=first["dataset"], attrs=specs[0].attrs, kwargs=specs[0].kwargs, then=rest, timeout=HANG_GUARD,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        stats = [mirror.stats() for mirror in mirrors]
    return {spec.name: (st, read_results(base / spec.name / "res")) for spec, st in zip(specs, stats, strict=True)}


def test_spawn_eight_ranks_one_download_per_root(tmp_path: Path) -> None:
    """CIFAR10, SVHN, Omniglot and OxfordIIITPet in turn, 8 ranks. nemo_safe: each file fetched once, every
    rank loads the same, right data, nothing left over. Upstream, in the same test: the largest file of each
    is fetched by every rank."""
    specs = [BUILDERS[name]() for name in sorted(BUILDERS)]
    ours = _run_all(specs, tmp_path / "nemo_safe", disable=False)
    theirs = _run_all(specs, tmp_path / "upstream", disable=True)
    for spec in specs:
        stats, results = ours[spec.name]
        for name in spec.files:
            assert (stats[name].requests, stats[name].complete) == (1, 1), (spec.name, name, stats[name])
        _assert_loaded(results, NPROCS, spec)
        _assert_clean_root(tmp_path / "nemo_safe" / spec.name / "root")
        stats, results = theirs[spec.name]
        largest = max(spec.files, key=lambda n: len(spec.files[n]))
        assert stats[largest].complete == NPROCS, (spec.name, largest, stats[largest], results)


def test_srun_two_nodes_cifar10_shared_root(slurm_cluster, tmp_path: Path) -> None:
    """srun -N2 --ntasks-per-node=4 with the root on the folder both nodes share: one fetch for the job."""
    spec = cifar10()
    attrs = json.dumps(spec.attrs)
    with throttled(spec.files) as mirror:
        cmd = ["srun", "-N2", "--ntasks-per-node=4", "-J", "nemo-safe-cifar", "--kill-on-bad-exit=0", sys.executable]
        cmd += _member_cmd(tmp_path / "root", tmp_path / "res", tmp_path / "gate", mirror.url)
        cmd += ["--dataset", "CIFAR10", "--attrs", attrs]
        out = subprocess.run(cmd, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=HANG_GUARD)
        assert out.returncode == 0, out.stderr[-3000:]
        assert mirror.stats()["cifar-10-python.tar.gz"].complete == 1, mirror.stats()
    _assert_loaded(read_results(tmp_path / "res"), 8, spec)
    _assert_clean_root(tmp_path / "root")


# -- faults and configurations, each next to upstream -------------------------------------------------------


def _members(
    world: int, spec: DatasetFiles, root: Path, results: Path, mirror: str, disable: bool, skew: float = 0.0
) -> dict[int, dict]:
    cmd = ["--dataset", spec.name, "--attrs", json.dumps(spec.attrs), "--kwargs", json.dumps(spec.kwargs)]
    cmd += ["--skew", str(skew)]
    _finish(_local_members(world, root, results, mirror, *cmd, NEMO_SAFE_DISABLE=str(int(disable))))
    return read_results(results)


@pytest.mark.parametrize("disable", [False, True], ids=["nemo_safe", "upstream"])
def test_wrong_md5_fails_every_rank_with_the_leaders_error(tmp_path: Path, disable: bool) -> None:
    """A corrupt archive: upstream fetches it on every rank and each fails; with nemo_safe it is fetched once,
    the leader raises upstream's error and every waiting rank raises LeaderFailed carrying it."""
    spec = cifar10(images_per_batch=100)
    with throttled(spec.files, Faults(corrupt={"cifar-10-python.tar.gz"})) as mirror:
        results = _members(3, spec, tmp_path / "root", tmp_path / "res", mirror.url, disable)
        fetched = mirror.stats()["cifar-10-python.tar.gz"].complete
    assert sorted(results) == [0, 1, 2], results
    for res in results.values():
        assert res["status"] == "error" and "File not found or corrupted." in res["error"], res
    types = sorted(res["error_type"] for res in results.values())
    published = (tmp_path / "root" / "cifar-10-python.tar.gz").exists()
    if disable:
        assert (fetched, types, published) == (3, ["RuntimeError"] * 3, True), (fetched, types)
    else:
        assert (fetched, types) == (1, ["LeaderFailed", "LeaderFailed", "RuntimeError"]), (fetched, types)
        assert not published, "bytes with a wrong md5 are never published"


@pytest.mark.parametrize("disable", [False, True], ids=["nemo_safe", "upstream"])
def test_truncated_and_empty_leftovers_are_repaired(tmp_path: Path, disable: bool) -> None:
    """A root left by an interrupted run: the archive cut in half, one batch empty, one truncated. CIFAR10's
    md5 check sees it; with nemo_safe one rank fetches the archive again and re-extracts, the others wait and
    load the right data. Upstream, in the same test: every rank fetches the archive again (start skew of
    SKEW, shorter than the 3 s transfer)."""
    spec = cifar10(images_per_batch=300)
    root = tmp_path / "root"
    batches = root / "cifar-10-batches-py"
    batches.mkdir(parents=True)
    archive = spec.files["cifar-10-python.tar.gz"]
    (root / "cifar-10-python.tar.gz").write_bytes(archive[: len(archive) // 2])
    (batches / "data_batch_1").write_bytes(b"")
    (batches / "data_batch_2").write_bytes(b"\x80\x04")
    world = 4
    with throttled(spec.files, seconds=DOWNLOAD_SECONDS) as mirror:
        results = _members(world, spec, root, tmp_path / "res", mirror.url, disable, skew=SKEW)
        fetched = mirror.stats()["cifar-10-python.tar.gz"].complete
    if disable:
        assert fetched == world, f"upstream: every rank fetches the archive again ({fetched} of {world})"
        return
    assert fetched == 1, fetched
    _assert_loaded(results, world, spec)
    assert (root / "cifar-10-python.tar.gz").read_bytes() == archive
    _assert_clean_root(root)


@pytest.mark.parametrize("disable", [False, True], ids=["nemo_safe", "upstream"])
def test_read_only_root(tmp_path: Path, read_only, disable: bool) -> None:
    """A read-only root holding the data loads as upstream does, with nothing written; a read-only empty
    root fails with upstream's own error (no lock folder can exist there, so nemo_safe steps aside)."""
    spec = cifar10(images_per_batch=100)
    complete, empty = tmp_path / "complete", tmp_path / "empty"
    with throttled(spec.files, seconds=0.2) as mirror:
        _members(1, spec, complete, tmp_path / "res-prepare", mirror.url, disable=True)
        read_only(complete)
        read_only(empty)
        loaded = _members(2, spec, complete, tmp_path / "res-complete", mirror.url, disable)
        failed = _members(2, spec, empty, tmp_path / "res-empty", mirror.url, disable)
        assert mirror.stats()["cifar-10-python.tar.gz"].complete == 1  # the preparation's
    _assert_loaded(loaded, 2, spec)
    assert sorted(failed) == [0, 1], failed
    for res in failed.values():
        assert (res["status"], res["error_type"]) == ("error", "OSError"), res
        assert "Read-only file system" in res["error"], res


def test_every_covered_class_is_patched_and_unpatch_restores() -> None:
    code = """
import nemo_safe, torchvision.datasets as D
from nemo_safe.patches import torchvision_datasets as T
import torchvision
verdicts = T.verdicts(D)
release, classes = T.recognised(D)
# Every class the release defines is patched (verified or by structure), except where the sweep found otherwise.
installed = tuple(int(p) for p in torchvision.__version__.split("+")[0].split(".")[:2])
expected_declined = {"PhotoTour"} if installed < (0, 21) else set()
declined = {name for name, verdict in verdicts.items() if not verdict.patches}
assert declined == expected_declined, {name: str(verdicts[name]) for name in declined}
assert sorted(classes) == sorted(set(verdicts) - declined), (release, sorted(classes))
if torchvision.__version__.startswith("0.29.1"):
    assert release == "torchvision 0.29.1" and sorted(classes) == sorted(T.COVERED), (release, sorted(classes))
for name in classes:
    assert hasattr(getattr(getattr(D, name), T.COVERED[name][0]), "__wrapped__"), name
assert not set(T.COVERED) & set(T.NOT_COVERED)
nemo_safe.unpatch()
for name in classes:
    assert not hasattr(getattr(getattr(D, name), T.COVERED[name][0]), "__wrapped__"), name
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


# -- ranks that build the same class with different arguments in one root ------------------------------------


def _mixed_members(
    world: int,
    spec: DatasetFiles,
    base: Path,
    mirror: str,
    kwargs_of: Callable[[int], dict],
    disable: bool,
    skew: float,
    prefix: tuple[str, ...] = (),
) -> dict[int, dict]:
    """``world`` torchrun-style members (rank i ``i * skew`` s late), rank r building ``spec``'s class with
    ``kwargs_of(r)``; ``prefix`` runs before python (``unshare ...``)."""
    run_id = f"mixed-{os.getpid()}-{time.monotonic_ns()}"
    procs = {}
    for rank in range(world):
        cmd = [*prefix, sys.executable, *_member_cmd(base / "root", base / "res", base / "gate", mirror)]
        cmd += ["--dataset", spec.name, "--attrs", json.dumps(spec.attrs), "--kwargs", json.dumps(kwargs_of(rank))]
        cmd += ["--skew", str(skew)]
        env = clean_env(**torchrun_env(rank, world, run_id), NEMO_SAFE_DISABLE=str(int(disable)))
        procs[rank] = subprocess.Popen(cmd, env=env, text=True, stderr=subprocess.PIPE)
    _finish(procs)
    return read_results(base / "res")


@pytest.mark.parametrize("disable", [False, True], ids=["nemo_safe", "upstream"])
def test_other_split_in_the_same_root_neither_waits_nor_fails(tmp_path: Path, disable: bool) -> None:
    """SVHN's train split fails its md5 on rank 0; rank 1 asks for the test split 0.2 s later, while the train
    download runs. As upstream, rank 1 downloads and loads its split, whatever the train split does: splits
    do not share a flight (they shared one named after the class alone, and rank 1 raised rank 0's error)."""
    spec, test = svhn(images=800), svhn(images=800, split="test")
    assert spec.attrs == test.attrs, "the two builds must agree on both splits' md5s"
    files = {**spec.files, **test.files}
    with throttled(files, Faults(corrupt={"train_32x32.mat"}), seconds=DOWNLOAD_SECONDS) as mirror:
        results = _mixed_members(2, spec, tmp_path, mirror.url, lambda r: {"split": ("train", "test")[r]}, disable, 0.2)
        stats = mirror.stats()
    assert (results[0]["status"], results[0]["error_type"]) == ("error", "RuntimeError"), results[0]
    assert results[1]["status"] == "ok", (results[1].get("error_type"), results[1].get("error"))
    assert (results[1]["data_sha"], results[1]["targets_sha"]) == (
        test.reference["data_sha"],
        test.reference["targets_sha"],
    )
    assert (stats["train_32x32.mat"].complete, stats["test_32x32.mat"].complete) == (1, 1), stats


@pytest.mark.parametrize("disable", [False, True], ids=["nemo_safe", "upstream"])
def test_train_and_test_ranks_extract_one_archive_atomically(tmp_path: Path, disable: bool) -> None:
    """CIFAR10 on 4 ranks, even ranks train=True and odd ones train=False: two flights (one per argument set),
    so two leaders download and extract the same archive into one folder at once, 1.5 s apart. With
    nemo_safe every file appears complete or not at all and every rank loads the right data; upstream, in
    the same test, ranks fail on half-written files."""
    spec = cifar10()
    with throttled(spec.files) as mirror:
        results = _mixed_members(
            4, spec, tmp_path, mirror.url, lambda r: {"train": r % 2 == 0}, disable, EXTRACTION_SKEW
        )
        fetched = mirror.stats()["cifar-10-python.tar.gz"].complete
    if disable:
        assert [r for r, res in results.items() if res["status"] != "ok"], f"upstream survived: {results}"
        return
    assert fetched == 2, fetched  # one per flight
    for rank, res in results.items():
        assert res["status"] == "ok", (rank, res)
    for rank in (0, 2):
        assert (results[rank]["data_sha"], results[rank]["targets_sha"]) == tuple(spec.reference.values()), rank
    assert results[1]["data_sha"] == results[3]["data_sha"] and results[1]["items"] == 500, results
    _assert_clean_root(tmp_path / "root")


@pytest.mark.parametrize(
    ("mode", "data"), [(0o755, "missing"), (0o700, "complete")], ids=["0755, data missing", "0700, data complete"]
)
@pytest.mark.parametrize("disable", [False, True], ids=["nemo_safe", "upstream"])
def test_another_users_lock_folder_in_the_root(tmp_path: Path, disable: bool, mode: int, data: str) -> None:
    """A shared root (0777) holding another user's ``.nemo_safe`` (a failure leaves its lock): nemo_safe can
    neither lock nor, at 0700, read there, so it runs upstream's download, which completes. The process runs
    in a user namespace (``unshare -U -r``), where the folder's owner (uid 12345) is nobody it may act for;
    before, it raised PermissionError (0755) or waited for 30 min (0700)."""
    spec = cifar10(images_per_batch=100)
    root = tmp_path / "root"
    root.mkdir()
    root.chmod(0o777)
    with throttled(spec.files, seconds=0.5) as mirror:
        if data == "complete":
            _members(1, spec, root, tmp_path / "res-prepare", mirror.url, disable=True)
        foreign = root / ".nemo_safe"
        foreign.mkdir()
        (foreign / "download-CIFAR10-000000000000.0").write_text("{}")
        os.chown(foreign, 12345, 12345)
        foreign.chmod(mode)
        started = time.monotonic()
        results = _mixed_members(1, spec, tmp_path, mirror.url, lambda r: {}, disable, 0.0, ("unshare", "-U", "-r"))
        seconds = time.monotonic() - started
    _assert_loaded(results, 1, spec)
    assert seconds < 120, f"{seconds:.0f} s: a rank waited on a lock folder it cannot use"


GATE_CLASSES = """
class Dataset:
    def __init__(self, root: str, download: bool = False) -> None:
        self.root = root
        if download:
            self.download()
        if not self._check_integrity():
            raise RuntimeError("Dataset not found or corrupted. You can use download=True to download it")

    def download(self) -> None:
        print("Downloading")

    def _check_integrity(self) -> bool:
        return True


class Reformatted(Dataset):
    def __init__(self, root, download=False):  # no annotations, another message, a print
        self.root = root
        print("building")
        if download: self.download()
        if not self._check_integrity(): raise RuntimeError("not found")


class ChecksFirst(Dataset):
    def __init__(self, root: str, download: bool = False) -> None:
        self.root = root
        if not self._check_integrity():
            raise RuntimeError("Dataset not found")
        if download:
            self.download()


class OtherCheck(Dataset):
    def __init__(self, root: str, download: bool = False) -> None:
        self.root = root
        if download:
            self.download()
        if not self._check_exists():
            raise RuntimeError("Dataset not found")

    def _check_exists(self) -> bool:
        return True
"""


@pytest.mark.parametrize(
    ("name", "verdict"),
    [
        ("Dataset", "recognised by structure"),
        ("Reformatted", "recognised by structure"),
        ("ChecksFirst", "declined: its __init__ does not call self.download() and then self._check_integrity()"),
        ("OtherCheck", "declined: its __init__ does not call self.download() and then self._check_integrity()"),
    ],
)
def test_class_gate_by_structure(tmp_path: Path, name: str, verdict: str) -> None:
    """A class of another release is patched where its ``__init__`` downloads with the method the wrapper wraps
    and then checks with the check the waiters use; else it keeps upstream's code (the wrapper is never made)."""
    import importlib.util

    from nemo_safe.patches import torchvision_datasets as T

    path = tmp_path / "gate_classes.py"
    path.write_text(GATE_CLASSES)
    spec = importlib.util.spec_from_file_location("gate_classes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found = T.class_verdict(getattr(module, name), "download", "_check_integrity", "CIFAR10")
    assert str(found).startswith(verdict), found
