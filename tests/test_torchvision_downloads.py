"""torchvision overlay: one download per dataset folder, atomic files, repair; all real.

Real torch / torchvision, real processes (torch.multiprocessing.spawn with gloo,
torchrun, srun -N2), and a real HTTP mirror on 127.0.0.1 serving the exact
original MNIST files from ../shared/data/mnist (never committed here).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import IN_CI, torchvision_release

from nemo_safe_tools import download_race
from nemo_safe_tools.download_race import MNIST_FILES, read_results, reference_digests

from download_harness import SCRIPT, run_spawn
from faulty_mirror import Faults, FaultyMirror
from procs import clean_env, demo_rows, torchrun_env

MNIST_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist"
HANG_GUARD = 600
#: The largest file (train images, 9.9 MB) takes this long through the throttled mirror.
DOWNLOAD_SECONDS = 2.0
#: Between DOWNLOAD_SECONDS/2 and DOWNLOAD_SECONDS: upstream breaks by construction (see download_race.compare).
SKEW = 1.5


@pytest.fixture(scope="session")
def mnist() -> dict[str, bytes]:
    """The exact original MNIST .gz files, checked against torchvision's own md5s."""
    if not all((MNIST_DIR / n).is_file() for n in MNIST_FILES):
        if IN_CI:
            pytest.fail(f"CI needs the MNIST files in {MNIST_DIR}", pytrace=False)
        pytest.skip(f"the original MNIST files are not in {MNIST_DIR}")
    from torchvision.datasets import MNIST

    files = {n: (MNIST_DIR / n).read_bytes() for n in MNIST_FILES}
    for name, md5 in MNIST.resources:
        assert hashlib.md5(files[name]).hexdigest() == md5, name
    return files


@pytest.fixture(scope="session")
def reference(mnist: dict[str, bytes]) -> dict[str, str]:
    return reference_digests(mnist)


def throttled(files: dict[str, bytes], faults: Faults | None = None, seconds: float = DOWNLOAD_SECONDS) -> FaultyMirror:
    return FaultyMirror(files, rate=download_race.rate_for(files, seconds), faults=faults)


def _assert_clean_root(root: Path, dataset: str = "MNIST") -> None:
    """Only published files are left: no lock directory, no temporaries."""
    leftovers = [p for p in root.rglob("*") if p.name.startswith((".tmp.", ".nemo_safe"))]
    assert not leftovers, leftovers


def _assert_raw_equals_original(root: Path, files: dict[str, bytes]) -> None:
    raw = root / "MNIST" / "raw"
    for name, gz in files.items():
        assert (raw / name).read_bytes() == gz, name
        assert (raw / name[:-3]).read_bytes() == gzip.decompress(gz), name[:-3]


def _assert_one_fetch_each(mirror: FaultyMirror) -> None:
    for name, s in mirror.stats().items():
        assert (s.requests, s.complete) == (1, 1), (name, s)


def _assert_all_loaded(results: dict[int, dict], ranks: range, reference: dict[str, str]) -> None:
    assert sorted(results) == list(ranks), results
    for rank, res in results.items():
        assert res["status"] == "ok", (rank, res)
        assert (res["data_sha"], res["targets_sha"]) == (reference["data_sha"], reference["targets_sha"]), rank


# -- 8 ranks of torch.multiprocessing.spawn after init_process_group (the FSDP tutorial) -------------------


def test_spawn_eight_ranks_download_once(tmp_path: Path, mnist, reference) -> None:
    with throttled(mnist) as mirror:
        out = download_race.run_spawn(
            8, tmp_path / "root", tmp_path / "res", mirror.url, disable=False, timeout=HANG_GUARD
        )
        assert out.returncode == 0, out.stderr[-3000:]
        _assert_all_loaded(read_results(tmp_path / "res"), range(8), reference)
        _assert_one_fetch_each(mirror)
    _assert_raw_equals_original(tmp_path / "root", mnist)
    _assert_clean_root(tmp_path / "root")


def test_spawn_before_init_process_group_with_start_skew(tmp_path: Path, mnist, reference) -> None:
    """mp.spawn with no init_process_group and no launcher variables: no rank is known, the leader is
    whoever creates the lock first; ranks arriving while the download runs wait for it."""
    with throttled(mnist) as mirror:
        out = run_spawn(
            8, tmp_path / "root", tmp_path / "res", mirror.url, disable=False, skew=SKEW / 4, init=False,
            timeout=HANG_GUARD,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        _assert_all_loaded(read_results(tmp_path / "res"), range(8), reference)
        _assert_one_fetch_each(mirror)
    _assert_clean_root(tmp_path / "root")


@pytest.mark.parametrize("variant", ["nemo_safe", "upstream"])
def test_a_waiting_rank_says_so_where_no_logging_is_configured(tmp_path: Path, mnist, variant: str) -> None:
    """Issue 24: two spawned ranks that configure no logging, rank 1 starting 0.5 s after rank 0, a 4 s download.
    The leader must say once that it does it; the waiter that it waits, for which process, where, whether that one
    is alive, and that it was released (before, it waited in silence while the leader's progress bars ran).
    Upstream says nothing of the kind."""
    with throttled(mnist, seconds=4.0) as mirror:
        out = download_race.run_spawn(
            2, tmp_path / "root", tmp_path / "res", mirror.url, disable=variant == "upstream", skew=0.5,
            timeout=HANG_GUARD,
        )  # fmt: skip
    lines = [line[line.index("[nemo_safe ") :] for line in re.split(r"[\r\n]", out.stderr) if "[nemo_safe " in line]
    if variant == "upstream":  # each process says that NEMO_SAFE_DISABLE is set, and nothing else
        assert len(lines) == 2 and all(
            line.endswith("NEMO_SAFE_DISABLE is set; no library is patched") for line in lines
        )
        return
    assert out.returncode == 0, out.stderr[-3000:]
    results = read_results(tmp_path / "res")
    leader = [line for line in lines if re.search(r"this process \(pid \d+\) does it; others that need it wait$", line)]
    waits = [line for line in lines if "this process waits for the one doing it; host " in line]
    released = [line for line in lines if re.search(r": it is done after [\d.]+ s$", line)]
    assert (len(leader), len(waits), len(released)) == (1, 1, 1), lines
    assert all(f"MNIST download into {tmp_path / 'root' / 'MNIST'}" in line for line in lines), lines
    pids = {res["pid"] for res in results.values()}
    assert {int(re.search(r"\(pid (\d+)\)", leader[0])[1]), int(re.search(r" pid (\d+) does it", waits[0])[1])} <= pids
    assert re.search(
        r"\(running; (beat \d+ s ago|no beat seen yet in \d+ s), its work idle \d+ s then\)", waits[0]
    ), waits
    assert "taken over after 15 s without a beat" in waits[0], waits


def test_spawn_upstream_twin_corrupts(tmp_path: Path, mnist, reference) -> None:
    """The same spawn job without nemo_safe: the race must show (proves the tests can fail)."""
    seen = []
    for trial in range(3):
        base = tmp_path / f"trial{trial}"
        with throttled(mnist) as mirror:
            download_race.run_spawn(
                8, base / "root", base / "res", mirror.url, disable=True, skew=SKEW, timeout=HANG_GUARD
            )
            fetches = sum(s.complete for s in mirror.stats().values())
        results = read_results(base / "res")
        bad = [
            r
            for r, res in results.items()
            if res["status"] != "ok" or (res["data_sha"], res["targets_sha"]) != tuple(reference.values())
        ]
        seen.append((trial, bad, fetches))
        if bad or len(results) < 8:
            assert fetches > len(mnist), "upstream downloads on every rank"
            return
    pytest.fail(f"upstream torchvision survived 3 throttled, skewed trials: {seen}")


# -- torchrun and srun ---------------------------------------------------------------------------------------


def _member_cmd(root: Path, results: Path, gate: Path, mirror: str, *extra: str) -> list[str]:
    results.mkdir(parents=True, exist_ok=True)
    gate.mkdir(parents=True, exist_ok=True)
    return [
        SCRIPT, "member", "--root", str(root), "--results", str(results),
        "--gate", str(gate), "--mirror", mirror, *extra,
    ]  # fmt: skip


def test_torchrun_four_ranks(tmp_path: Path, mnist, reference) -> None:
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    with throttled(mnist) as mirror:
        cmd = [torchrun, "--standalone", "--nproc-per-node", "4", "--no-python", sys.executable]
        cmd += _member_cmd(tmp_path / "root", tmp_path / "res", tmp_path / "gate", mirror.url)
        out = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=HANG_GUARD)
        assert out.returncode == 0, out.stderr[-3000:]
        _assert_all_loaded(read_results(tmp_path / "res"), range(4), reference)
        _assert_one_fetch_each(mirror)
    _assert_clean_root(tmp_path / "root")


@pytest.mark.parametrize("roots", ["shared root", "node-local roots"])
def test_srun_two_nodes_eight_tasks(slurm_cluster, tmp_path: Path, mnist, reference, roots: str) -> None:
    """One download per job on a shared root; one per node when each node has its own root."""
    node_local = roots == "node-local roots"
    with throttled(mnist) as mirror:
        cmd = ["srun", "-N2", "--ntasks-per-node=4", "-J", "nemo-safe-mnist", "--kill-on-bad-exit=0", sys.executable]
        cmd += _member_cmd(tmp_path / "root", tmp_path / "res", tmp_path / "gate", mirror.url)
        cmd += ["--node-local"] if node_local else []
        out = subprocess.run(cmd, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=HANG_GUARD)
        assert out.returncode == 0, out.stderr[-3000:]
        for name, s in mirror.stats().items():
            assert s.complete == (2 if node_local else 1), (name, s)
    _assert_all_loaded(read_results(tmp_path / "res"), range(8), reference)
    for root in [tmp_path / "root" / "node0", tmp_path / "root" / "node1"] if node_local else [tmp_path / "root"]:
        _assert_raw_equals_original(root, mnist)
        _assert_clean_root(root)


# -- faults --------------------------------------------------------------------------------------------------


def _local_members(world: int, root: Path, results: Path, mirror: str, *extra: str, **env: str):
    """``world`` member processes with torchrun-style variables (whichever gets there first downloads)."""
    cmd = [sys.executable, *_member_cmd(root, results, results.with_name(results.name + "-gate"), mirror, *extra)]
    run_id = f"tv-{os.getpid()}-{time.monotonic_ns()}"
    return {
        r: subprocess.Popen(
            cmd, env=clean_env(**torchrun_env(r, world, run_id), **env), text=True, stderr=subprocess.PIPE
        )
        for r in range(world)
    }


def _finish(procs: dict[int, subprocess.Popen], guard: float = HANG_GUARD) -> dict[int, int]:
    codes = {}
    deadline = time.monotonic() + guard
    for r, p in procs.items():
        try:
            p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs.values():
                q.kill()
            pytest.fail(f"rank {r} hung for {guard} s")
        codes[r] = p.returncode
    return codes


def test_connection_dropped_mid_file(tmp_path: Path, mnist, reference) -> None:
    name = "train-images-idx3-ubyte.gz"
    with throttled(mnist, Faults(drop_after={name: 3_000_000})) as mirror:
        _finish(_local_members(2, tmp_path / "root", tmp_path / "res", mirror.url))
    results = read_results(tmp_path / "res")
    assert sorted(results) == [0, 1], results
    for res in results.values():
        assert res["status"] == "error", res
        assert "retrieval incomplete: got only 3000000 out of" in res["error"], res  # ContentTooShortError
    assert not (tmp_path / "root" / "MNIST" / "raw" / name).exists(), "a partial download must never be published"
    # The mirror heals: the next start completes from the same root, fetching only what is missing.
    with throttled(mnist) as mirror:
        _finish(_local_members(2, tmp_path / "root", tmp_path / "res2", mirror.url))
        assert mirror.stats()[name].complete == 1
    _assert_all_loaded(read_results(tmp_path / "res2"), range(2), reference)
    _assert_raw_equals_original(tmp_path / "root", mnist)
    _assert_clean_root(tmp_path / "root")


def test_wrong_md5_reaches_every_rank(tmp_path: Path, mnist) -> None:
    name = "train-labels-idx1-ubyte.gz"
    with throttled(mnist, Faults(corrupt={name})) as mirror:
        _finish(_local_members(3, tmp_path / "root", tmp_path / "res", mirror.url))
        fetched = mirror.stats()[name].complete
    results = read_results(tmp_path / "res")
    assert sorted(results) == [0, 1, 2]
    for res in results.values():
        assert res["status"] == "error" and "File not found or corrupted." in res["error"], res
    waiters = [res for res in results.values() if res["error_type"] == "LeaderFailed"]
    assert waiters, "ranks that waited for the downloader get its error"
    assert fetched == 3 - len(waiters), "only the ranks that did not get LeaderFailed fetched the file"
    assert not (tmp_path / "root" / "MNIST" / "raw" / name).exists(), "bytes with a wrong md5 are never published"


def test_downloader_killed_mid_download(tmp_path: Path, mnist, reference) -> None:
    name = "train-images-idx3-ubyte.gz"
    raw = tmp_path / "root" / "MNIST" / "raw"
    with throttled(mnist, seconds=8.0) as mirror:
        procs = _local_members(3, tmp_path / "root", tmp_path / "res", mirror.url)
        deadline = time.monotonic() + 120
        victim = None
        while victim is None and time.monotonic() < deadline:
            temps = [p for p in raw.glob(f".tmp.{name}~*")] if raw.is_dir() else []
            if temps and temps[0].stat().st_size > 1_000_000:
                victim = int(temps[0].name.split("~")[2])
            time.sleep(0.05)
        assert victim is not None, "no download in progress was seen"
        os.kill(victim, signal.SIGKILL)
        codes = _finish(procs)
    killed = [r for r, p in procs.items() if p.pid == victim]
    assert killed and codes[killed[0]] == -signal.SIGKILL
    results = read_results(tmp_path / "res")
    _assert_all_loaded(results, sorted(set(range(3)) - set(killed)), reference)
    _assert_raw_equals_original(tmp_path / "root", mnist)
    _assert_clean_root(tmp_path / "root")


def _broken_raw_root(root: Path, files: dict[str, bytes]) -> None:
    """A root as a killed upstream rank leaves it: the .gz files fine, raw files empty or truncated."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name, gz in files.items():
        (raw / name).write_bytes(gz)
        (raw / name[:-3]).write_bytes(gzip.decompress(gz))
    (raw / "train-images-idx3-ubyte").write_bytes(b"")
    (raw / "train-labels-idx1-ubyte").write_bytes(gzip.decompress(files["train-labels-idx1-ubyte.gz"])[:5000])


@pytest.mark.parametrize("disable", [False, True], ids=["nemo_safe", "upstream"])
def test_leftover_empty_and_truncated_raw_files(tmp_path: Path, mnist, reference, disable: bool) -> None:
    _broken_raw_root(tmp_path / "root", mnist)
    with throttled(mnist) as mirror:
        _finish(_local_members(1, tmp_path / "root", tmp_path / "res", mirror.url, NEMO_SAFE_DISABLE=str(int(disable))))
        fetched = sum(s.complete for s in mirror.stats().values())
    (res,) = read_results(tmp_path / "res").values()
    if disable:
        assert res["status"] == "error", "upstream loads the empty raw file and crashes"
        return
    assert fetched == 0, "the .gz files were fine: repaired from them without a download"
    _assert_all_loaded({0: res}, range(1), reference)
    _assert_raw_equals_original(tmp_path / "root", mnist)


def test_read_only_root(tmp_path: Path, mnist, reference, read_only) -> None:
    empty = read_only(tmp_path / "empty")
    complete = tmp_path / "complete"
    _broken_raw_root(complete, mnist)
    raw = complete / "MNIST" / "raw"
    for name, gz in mnist.items():
        (raw / name[:-3]).write_bytes(gzip.decompress(gz))
    read_only(complete)
    with throttled(mnist) as mirror:
        _finish(_local_members(2, empty, tmp_path / "res-empty", mirror.url))
        _finish(_local_members(2, empty, tmp_path / "res-upstream", mirror.url, NEMO_SAFE_DISABLE="1"))
        _finish(_local_members(2, complete, tmp_path / "res-complete", mirror.url))
        assert sum(s.complete for s in mirror.stats().values()) == 0
    empty_results, upstream = read_results(tmp_path / "res-empty"), read_results(tmp_path / "res-upstream")
    assert sorted(empty_results) == sorted(upstream) == [0, 1], (empty_results, upstream)
    for res, theirs in zip(empty_results.values(), upstream.values(), strict=True):
        # upstream's own error (the read-only file system), not one of nemo_safe's
        assert res["status"] == theirs["status"] == "error", (res, theirs)
        assert (res["error_type"], res["error"]) == (theirs["error_type"], theirs["error"]), (res, theirs)
    _assert_all_loaded(read_results(tmp_path / "res-complete"), range(2), reference)


def test_demo_download_race() -> None:
    """``nemo-safe demo``'s download table: upstream fails by construction, nemo_safe fetches each file once."""
    rows, output = demo_rows("download", 4, HANG_GUARD)
    assert rows["with nemo_safe"][:4] == ["0 of 4", "0", "4", "1.00x"], output
    assert rows["upstream torchvision"][0] != "0 of 4", output


def _emnist_zip() -> tuple[dict[str, bytes], dict, dict[str, str]]:
    """EMNIST's layout: gzip.zip holding gzip/emnist-<split>-<train|test>-<images|labels>-idx?-ubyte.gz."""
    import zipfile

    raw = download_race.synthetic_mnist(train=600, test=100, seed=1)
    names = {
        "train-images-idx3-ubyte.gz": "emnist-digits-train-images-idx3-ubyte.gz",
        "train-labels-idx1-ubyte.gz": "emnist-digits-train-labels-idx1-ubyte.gz",
        "t10k-images-idx3-ubyte.gz": "emnist-digits-test-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz": "emnist-digits-test-labels-idx1-ubyte.gz",
    }
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for ours, theirs in names.items():
            zf.writestr(f"gzip/{theirs}", raw[ours])
    archive = buf.getvalue()
    attrs = {"url": "{mirror}gzip.zip", "md5": hashlib.md5(archive).hexdigest()}
    return {"gzip.zip": archive}, attrs, reference_digests(raw)


def test_emnist_one_download_and_no_rmtree_under_readers(tmp_path: Path) -> None:
    """EMNIST overrides download() and rmtree's raw/gzip at the end: one process does it all."""
    files, attrs, ref = _emnist_zip()
    with throttled(files) as mirror:
        procs = _local_members(
            3, tmp_path / "root", tmp_path / "res", mirror.url, "--dataset", "EMNIST",
            "--attrs", json.dumps(attrs), "--kwargs", json.dumps({"split": "digits"}),
        )  # fmt: skip
        _finish(procs)
        assert mirror.stats()["gzip.zip"].complete == 1
    _assert_all_loaded(read_results(tmp_path / "res"), range(3), ref)
    assert not (tmp_path / "root" / "EMNIST" / "raw" / "gzip").exists()
    _assert_clean_root(tmp_path / "root")


def test_every_mnist_family_class_is_patched() -> None:
    code = (
        "import nemo_safe, torchvision.datasets as d\n"
        "for c in (d.MNIST, d.FashionMNIST, d.KMNIST, d.EMNIST, d.QMNIST):\n"
        "    print(c.__name__, c.download.__qualname__, c._check_exists.__qualname__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=120)
    lines = out.stdout.split("\n")[:5]
    assert len(lines) == 5, out.stderr[-2000:]
    for line in lines:
        name, download, check = line.split()
        assert download == "single_flight_download.<locals>.download", line
        assert check == "validating_check_exists.<locals>._check_exists", line


def _idx(dims: list[int], items: bytes) -> bytes:
    return bytes([0, 0, 8, len(dims)]) + b"".join(d.to_bytes(4, "big") for d in dims) + items


@pytest.mark.parametrize(
    ("content", "complete"),
    [
        (_idx([3, 2, 2], bytes(12)), True),
        (b"", False),
        (_idx([3, 2, 2], b"")[:10], False),  # truncated inside the header
        (_idx([3, 2, 2], bytes(11)), False),
        (_idx([3, 2, 2], bytes(13)), False),
        (b"PK\x03\x04rest", False),  # not an IDX file
        (bytes([0, 0, 0x0D, 1, 0, 0, 0, 2]) + bytes(8), True),  # two float32
    ],
)
def test_idx_validation(tmp_path: Path, content: bytes, complete: bool) -> None:
    """The overlay's check is upstream's ``_is_complete_idx``, run in torchvision.datasets.mnist."""
    import torchvision.datasets.mnist

    from nemo_safe.patches.torchvision_mnist import shared_functions

    path = tmp_path / "f"
    path.write_bytes(content)
    assert shared_functions(torchvision.datasets.mnist)["_is_complete_idx"](str(path)) is complete
    assert shared_functions(torchvision.datasets.mnist)["_is_complete_idx"](str(tmp_path / "missing")) is False


UNPATCH_PROGRAM = """
import torchvision.datasets as d, torchvision.datasets.utils as u, torchvision.datasets.svhn as svhn
def state():
    return [u._urlretrieve, u._decompress, u.download_url, dict(u._ARCHIVE_EXTRACTORS), svhn.download_url,
            *(c.__dict__[m] for c in (d.MNIST, d.EMNIST, d.QMNIST) for m in ("download", "_check_exists"))]
before = state()
import nemo_safe
patched = state()
nemo_safe.unpatch()
after = state()
from nemo_safe.patches.torchvision_downloads import GATE
changed = sum(a is not b and a != b for a, b in zip(before, patched))
print(changed, len(before), after == before, GATE.verdict(u).patches)
"""


def test_unpatch_restores_every_torchvision_function() -> None:
    """torchvision imported first, then nemo_safe: every replaced name changes, and unpatch() puts
    back the very same objects (utils, the extractor table, a dataset module's own binding, MNIST). Where the
    atomic downloads' gate declines the release (torchvision 0.15-0.19), only MNIST's 6 methods change."""
    out = subprocess.run(
        [sys.executable, "-c", UNPATCH_PROGRAM], env=clean_env(), capture_output=True, text=True, timeout=120
    )
    changed, total, restored, downloads_patched = out.stdout.split()
    assert (total, restored) == ("11", "True"), out.stdout + out.stderr[-2000:]
    assert changed == ("11" if downloads_patched == "True" else "6"), out.stdout + out.stderr[-2000:]
    if torchvision_release() >= (0, 20):
        assert downloads_patched == "True", out.stdout


REPAIR_OVER_OWN_WRAPPERS = """
import functools, json, socket, sys, time
import nemo_safe, torchvision.datasets as D
original = D.QMNIST._check_exists

@functools.wraps(original)
def users_check(self):  # a user's wrapper over nemo_safe's: the patch is no longer intact
    return original(self)

D.QMNIST._check_exists = users_check
nemo_safe.patch()  # repairs it: applies again over MNIST's own, still patched, download
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]  # nothing listens there any more
D.MNIST.mirrors = [f"http://127.0.0.1:{port}/"]
started = time.monotonic()
try:
    D.MNIST(sys.argv[1], download=True)
    print(json.dumps({"type": None}))
except Exception as exc:
    print(json.dumps({"type": type(exc).__name__, "seconds": time.monotonic() - started}))
"""


@pytest.mark.parametrize("disable", ["0", "1"], ids=["nemo_safe", "upstream"])
def test_repair_over_its_own_wrappers_fails_as_upstream_instead_of_hanging(tmp_path: Path, disable: str) -> None:
    """Upstream fails at once when no mirror answers; so must a download wrapped twice by a repair
    (before the fix it waited for itself, its own heartbeat keeping the timeout from firing)."""
    out = subprocess.run(
        [sys.executable, "-c", REPAIR_OVER_OWN_WRAPPERS, str(tmp_path / "root")],
        env=clean_env(NEMO_SAFE_DISABLE=disable, NEMO_SAFE_BARRIER_TIMEOUT="6"),
        capture_output=True, text=True, timeout=HANG_GUARD,
    )  # fmt: skip
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["type"] == "RuntimeError", (res, out.stderr[-3000:])
    assert res["seconds"] < 6, "it failed at its timeout, not at once: it waited for itself"


GATE_PROGRAM = r"""
import inspect, sys, textwrap, types
import torchvision.datasets.utils as utils
from nemo_safe.patches import torchvision_downloads as patch
function, old, new, path = sys.argv[1:5]
source = textwrap.dedent(inspect.getsource(getattr(utils, function)))
assert old in source, old
with open(path, "w") as f:
    f.write("from __future__ import annotations\n" + source.replace(old, new))
edited = types.ModuleType("edited_utils")
edited.__dict__.update(vars(utils))
exec(compile(open(path).read(), path, "exec"), edited.__dict__)
verdict = patch.GATE.verdict(edited)
before = dict(vars(edited))
applied = patch.apply_utils(edited) if not verdict.patches else "not asked"
print(verdict)
print(applied, all(vars(edited)[name] is value for name, value in before.items()))
"""


@pytest.mark.parametrize(
    ("function", "old", "new", "verdict"),
    [
        # Annotations and formatting of a function the overlay replaces: still the verified release's shape.
        ("_urlretrieve", "chunk_size: int = 1024 * 32", "chunk_size = 1024 * 32", "recognised by structure"),
        # A function the overlay only wraps may print or differ otherwise (torchvision 0.18-0.20's download_url).
        ("download_url", "    fpath = ", "    print('Downloading', url)\n    fpath = ", "recognised by structure"),
        # download_url no longer calls the module global _urlretrieve: the overlay's publication would be skipped.
        ("download_url", "_urlretrieve(url, fpath)", "urlretrieve(url, fpath)", "declined: download_url"),
        # A replaced body that behaves otherwise (another progress unit, as in 0.18-0.19): declined, not run as 0.29's.
        ("_urlretrieve", 'unit="B", ', "", "declined: the code it replaces differs"),
    ],
)
def test_download_gate_by_structure(tmp_path: Path, function: str, old: str, new: str, verdict: str) -> None:
    """The gate on torchvision.datasets.utils edited in one place (upstream's module, nemo_safe disabled in that
    process); a declined module is left exactly as it is."""
    env = {**clean_env(), "NEMO_SAFE_DISABLE": "1"}
    args = [sys.executable, "-c", GATE_PROGRAM, function, old, new, str(tmp_path / "edited.py")]
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    found, applied = out.stdout.strip().splitlines()[-2:]
    assert found.startswith(verdict), found
    if not found.startswith("recognised"):
        assert applied == "None True", applied


SUBCLASS_PROGRAM = r"""
import os, sys
import numpy as np, torch
import nemo_safe, torchvision.datasets as d

class NpzDigits(d.MNIST):
    # A user's MNIST subclass whose raw file is not an IDX file: its own resources and loader.
    resources = [("https://example.invalid/digits.npz", None)]

    def _load_data(self):
        data = np.load(os.path.join(self.raw_folder, "digits.npz"))
        return torch.from_numpy(data["x"]), torch.from_numpy(data["y"])

root = sys.argv[1]
os.makedirs(os.path.join(root, "NpzDigits", "raw"))
with open(os.path.join(root, "NpzDigits", "raw", "digits"), "wb") as f:
    np.savez(f, x=np.zeros((3, 28, 28), dtype=np.uint8), y=np.arange(3))
os.rename(os.path.join(root, "NpzDigits", "raw", "digits"), os.path.join(root, "NpzDigits", "raw", "digits.npz"))
os.symlink("digits.npz", os.path.join(root, "NpzDigits", "raw", "digits"))
print(len(NpzDigits(root, download=False)))
"""


@pytest.mark.parametrize("disable", ["1", ""], ids=["upstream", "nemo_safe"])
def test_mnist_subclass_with_other_raw_files_loads(tmp_path: Path, disable: str) -> None:
    """The IDX check is for the family's own loaders: a subclass with other raw files loads as upstream."""
    env = {**clean_env(), "NEMO_SAFE_DISABLE": disable}
    out = subprocess.run(
        [sys.executable, "-c", SUBCLASS_PROGRAM, str(tmp_path / "root")], env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "3", out.stderr[-2000:]
