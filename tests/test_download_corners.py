"""Download corners where nemo_safe once failed or cost more where upstream completes; each next to its twin.

All in real processes against real torchvision and a loopback mirror:

* QMNIST's subsets are separate downloads (``what="train"`` fetches only the train files), so a process
  building the test subset neither waits for nor fails with another process's train download.
* A complete dataset root costs no integrity pass upstream would not make.
* A file (not a folder) named like nemo_safe's lock folder in a complete root: loaded at once, as upstream.
* Malformed ``NEMO_SAFE_*`` seconds never fail a complete root (one warning each, the default used).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from dataset_files import cifar10
from test_torchvision_downloads import HANG_GUARD, _member_cmd

from nemo_safe_tools.download_race import rate_for, read_results
from nemo_safe_tools.loopback_mirror import LoopbackMirror

from faulty_mirror import Faults, FaultyMirror
from procs import clean_env

# -- QMNIST: one flight per subset ---------------------------------------------------------------------------

#: Seconds the train images take to arrive (they break off at 90 %): long enough for the test-subset process,
#: started once the train download is under way, to reach its own download while the train one still runs.
TRAIN_SECONDS = 15.0


def _idx(array: np.ndarray, code: int, dtype: str) -> bytes:
    header = bytes([0, 0, code, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + array.astype(dtype).tobytes()


def _qmnist_files() -> tuple[dict[str, bytes], dict]:
    """QMNIST's layout: per subset, images (IDX uint8, n x 28 x 28) and labels (IDX int32, n x 8), gzipped."""
    rng = np.random.default_rng(7)
    files, resources = {}, {}
    for subset, n in (("train", 3000), ("test", 40)):
        images = _idx(rng.integers(0, 256, (n, 28, 28)), 0x08, ">u1")
        labels = _idx(rng.integers(0, 10, (n, 8)), 0x0C, ">i4")
        names = (f"qmnist-{subset}-images-idx3-ubyte.gz", f"qmnist-{subset}-labels-idx2-int.gz")
        for name, body in zip(names, (images, labels), strict=True):
            files[name] = gzip.compress(body, compresslevel=1, mtime=0)
        resources[subset] = [["{mirror}" + name, hashlib.md5(files[name]).hexdigest()] for name in names]
    resources["nist"] = resources["test"]
    return files, {"resources": resources}


def _qmnist_member(root: Path, results: Path, mirror: str, attrs: dict, what: str, disable: bool):
    cmd = _member_cmd(root, results, results.with_name(results.name + "-gate"), mirror, "--dataset", "QMNIST",
                      "--attrs", json.dumps(attrs), "--kwargs", json.dumps({"what": what}))  # fmt: skip
    env = clean_env(**({"NEMO_SAFE_DISABLE": "1"} if disable else {}))
    return subprocess.Popen([sys.executable, *cmd], env=env, text=True, stderr=subprocess.PIPE)


def test_qmnist_test_subset_neither_waits_for_nor_fails_with_the_train_download(tmp_path: Path) -> None:
    """A builds QMNIST(what="train"), whose images break off after TRAIN_SECONDS; B builds what="test" in the
    same root once A's download is under way. Upstream: B loads, A fails. nemo_safe once made B wait for A
    and then raise A's failure (one lock per root); now both end as upstream's, each in its own time."""
    files, attrs = _qmnist_files()
    train_images = "qmnist-train-images-idx3-ubyte.gz"
    faults = Faults(drop_after={train_images: len(files[train_images]) * 9 // 10})
    outcomes = {}
    with FaultyMirror(files, rate=rate_for(files, TRAIN_SECONDS), faults=faults) as mirror:
        procs = {}
        for label, disable in (("nemo_safe", False), ("upstream", True)):
            base = tmp_path / label
            procs[label, "A"] = _qmnist_member(base / "root", base / "res-A", mirror.url, attrs, "train", disable)
        deadline = time.monotonic() + HANG_GUARD
        while mirror.stats().get(train_images) is None or mirror.stats()[train_images].requests < 2:
            assert time.monotonic() < deadline, "the train downloads never started"
            time.sleep(0.05)
        started = time.monotonic()
        for label, disable in (("nemo_safe", False), ("upstream", True)):
            base = tmp_path / label
            procs[label, "B"] = _qmnist_member(base / "root", base / "res-B", mirror.url, attrs, "test", disable)
        for (label, who), proc in procs.items():
            _, err = proc.communicate(timeout=HANG_GUARD)
            assert proc.returncode == 0, err[-3000:]
            outcomes[label, who] = read_results(tmp_path / label / f"res-{who}")[0]
        b_seconds = time.monotonic() - started
    for label in ("nemo_safe", "upstream"):
        assert outcomes[label, "A"]["status"] == "error", (label, outcomes[label, "A"])
        assert outcomes[label, "B"]["status"] == "ok", (label, outcomes[label, "B"])
    assert outcomes["nemo_safe", "B"]["data_sha"] == outcomes["upstream", "B"]["data_sha"]
    # B did not wait for A's train download (TRAIN_SECONDS, which was still running when B started).
    assert outcomes["nemo_safe", "B"]["seconds"] < TRAIN_SECONDS - 2, (outcomes, b_seconds)


# -- complete roots ------------------------------------------------------------------------------------------

LOAD = """
import json, os, sys, time
if os.environ.get("NEMO_SAFE_DISABLE") != "1":
    import nemo_safe  # noqa: F401
import torchvision.datasets as D
import torchvision.datasets.cifar as cifar

root, mirror, attrs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
for name, value in attrs.items():
    setattr(D.CIFAR10, name, value.replace("{mirror}", mirror) if isinstance(value, str) else value)
passes = []
check = cifar.check_integrity
def counting(*args, **kwargs):
    passes.append(args[0])
    return check(*args, **kwargs)
cifar.check_integrity = counting
started = time.monotonic()
try:
    items = len(D.CIFAR10(root, train=True, download=True))
    print(json.dumps({"status": "ok", "items": items, "passes": len(passes), "seconds": time.monotonic() - started}))
except Exception as exc:
    print(json.dumps({"status": "error", "error": f"{type(exc).__name__}: {exc}"}))
"""


def _load(root: Path, mirror: str, attrs: dict, disable: bool, **env: str) -> tuple[dict, str]:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(LOAD), str(root), mirror, json.dumps(attrs)],
        env=clean_env(**({"NEMO_SAFE_DISABLE": "1"} if disable else {}), **env),
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no result (exit {out.returncode}):\n{out.stderr[-3000:]}"
    return json.loads(lines[-1]), out.stderr


@pytest.fixture(scope="module")
def complete_root(tmp_path_factory: pytest.TempPathFactory):
    """A CIFAR10 root downloaded once (upstream), the mirror it came from still serving."""
    spec = cifar10(images_per_batch=50)
    root = tmp_path_factory.mktemp("cifar") / "root"
    with LoopbackMirror(spec.files) as mirror:
        res, err = _load(root, mirror.url, spec.attrs, disable=True)
        assert res["status"] == "ok", (res, err[-3000:])
        yield root, mirror, spec.attrs


def test_complete_root_costs_no_extra_integrity_pass(complete_root) -> None:
    root, mirror, attrs = complete_root
    ours, _ = _load(root, mirror.url, attrs, disable=False)
    theirs, _ = _load(root, mirror.url, attrs, disable=True)
    assert ours["status"] == theirs["status"] == "ok", (ours, theirs)
    assert ours["passes"] == theirs["passes"], (ours, theirs)
    assert all(s.requests == 1 for s in mirror.stats().values()), mirror.stats()  # only the fixture's fill


def test_a_file_named_like_the_lock_folder_loads_at_once(complete_root, tmp_path: Path) -> None:
    """Once: WaitTimeout after the whole timeout (``.nemo_safe`` listed as a folder until the deadline)."""
    root, mirror, attrs = complete_root
    blocked = (root / ".nemo_safe").exists()
    (root / ".nemo_safe").write_text("not a folder")
    try:
        env = {"NEMO_SAFE_BARRIER_TIMEOUT": "60"}
        ours, err = _load(root, mirror.url, attrs, disable=False, **env)
        theirs, _ = _load(root, mirror.url, attrs, disable=True, **env)
    finally:
        (root / ".nemo_safe").unlink()
    assert not blocked
    assert ours["status"] == theirs["status"] == "ok", (ours, theirs)
    assert ours["passes"] == theirs["passes"], (ours, theirs)
    assert ours["seconds"] < 30, ours  # the hang guard: the old behaviour waited the whole 60 s timeout


@pytest.mark.parametrize(
    "setting",
    [
        {"NEMO_SAFE_BARRIER_TIMEOUT": "30m"},
        {"NEMO_SAFE_POLL_MAX": "0"},
        {"NEMO_SAFE_STALE_AFTER": "inf"},
    ],
    ids=lambda setting: "=".join(next(iter(setting.items()))),
)
def test_a_malformed_setting_never_fails_a_complete_root(complete_root, setting: dict[str, str]) -> None:
    root, mirror, attrs = complete_root
    ours, err = _load(root, mirror.url, attrs, disable=False, **setting)
    theirs, _ = _load(root, mirror.url, attrs, disable=True, **setting)
    assert ours["status"] == theirs["status"] == "ok", (ours, theirs)
    ((name, value),) = setting.items()
    assert err.count(f"{name}={value!r} is not a finite, positive number of seconds") == 1, err
