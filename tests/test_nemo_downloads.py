"""NeMo's own start-up downloads (issue 25) with real NeMo, real processes and a throttled loopback mirror,
each next to its upstream twin (``NEMO_SAFE_DISABLE=1``): ``ModelPT.from_pretrained`` from "NGC"
(``maybe_download_from_cloud``) and Megatron's GPT-2 vocab / merges (``megatron_utils._download``, NeMo #12420).
Every process imports NeMo, then all start together (one gate), before any ``torch.distributed``."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nemo_safe_tools.loopback_mirror import LoopbackMirror

from procs import HERE, clean_env, torchrun_env, wait_for_files

pytest.importorskip("nemo")

WORKER = str(HERE / "nemo_download_worker.py")
HANG_GUARD = 300
RANKS = 8
#: The fault cases: enough ranks to have waiters, few enough NeMo imports for CI's time.
FEW = 4


def _make_nemo(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    out = tmp_path_factory.mktemp("model") / "tiny_test_model.nemo"
    subprocess.run([sys.executable, WORKER, "make-nemo", str(out)], env=clean_env(), check=True, capture_output=True,
                   timeout=HANG_GUARD)  # fmt: skip
    return out.read_bytes()


@pytest.fixture(scope="module")
def tiny_nemo(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A small real ``.nemo`` archive (a ModelPT with one linear layer), made once."""
    return _make_nemo(tmp_path_factory)


@pytest.fixture(scope="module")
def tiny_nemo_v2(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """Another one, with other (random) weights: what the mirror serves once the model was updated."""
    return _make_nemo(tmp_path_factory)


def race(
    tmp: Path,
    mode: str,
    args: list[str],
    *,
    upstream: bool,
    delays: dict[int, float] | None = None,
    gate: str = "gate",
    kill: tuple[int, float] | None = None,
    ranks: int = RANKS,
) -> list[dict]:
    """``RANKS`` workers (torchrun's variables, no process group), released together once all imported NeMo."""
    gate_dir = tmp / gate
    gate_dir.mkdir(parents=True)
    env = {"NEMO_CACHE_DIR": str(tmp / "nemo_cache"), "TORCH_HOME": str(tmp / "torch_home")}
    if upstream:
        env["NEMO_SAFE_DISABLE"] = "1"
    procs = []
    for rank in range(ranks):
        delay = (delays or {}).get(rank, 0.0)
        cmd = [
            sys.executable,
            WORKER,
            mode,
            *args,
            "--gate",
            str(gate_dir),
            "--index",
            str(rank),
            "--delay",
            str(delay),
        ]
        procs.append(subprocess.Popen(cmd, env=clean_env(**torchrun_env(rank, ranks, "dl"), **env), cwd=tmp,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))  # fmt: skip
    wait_for_files(gate_dir, [f"ready.{r}" for r in range(ranks)], HANG_GUARD)
    (gate_dir / "go").touch()
    if kill is not None:  # (rank, seconds after the start): SIGKILL, as the OOM killer or a node failure does
        threading.Timer(kill[1], procs[kill[0]].kill).start()
    results = []
    deadline = time.monotonic() + HANG_GUARD
    for proc in procs:
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        # wget's progress bar (NeMo 1.23 to 2.7.3) ends without a newline: the result may follow it on its line
        lines = [ln[ln.index('{"index"') :] for ln in out.splitlines() if '{"index"' in ln]
        results.append(json.loads(lines[-1]) if lines else {"status": "no result", "stderr": err[-2000:]})
    return results


def test_from_pretrained_downloads_once_and_every_rank_restores(tmp_path: Path, tiny_nemo: bytes) -> None:
    """8 ranks, 0.3 s apart, ``from_pretrained`` of a model the mirror serves in about 3 s: with nemo_safe one
    download and every rank restores the same weights; upstream's twin re-uses the partial file (a rank fails to
    restore) or downloads it several times."""
    skew = {rank: 0.3 * rank for rank in range(RANKS)}
    with LoopbackMirror({"tiny_test_model.nemo": tiny_nemo}, rate=len(tiny_nemo) / 3) as mirror:
        url = mirror.url + "tiny_test_model.nemo"
        ours = race(tmp_path / "ours", "ngc", ["--url", url], upstream=False, delays=skew)
        fetched = mirror.stats()["tiny_test_model.nemo"].requests
    assert [r["status"] for r in ours] == ["ok"] * RANKS, ours
    assert "nemo-cloud-single-flight" in ours[0]["nemo_safe"], ours[0]
    assert len({r["weights"] for r in ours}) == 1, ours
    assert fetched == 1, f"one download for {RANKS} ranks, not {fetched}"
    with LoopbackMirror({"tiny_test_model.nemo": tiny_nemo}, rate=len(tiny_nemo) / 3) as mirror:
        url = mirror.url + "tiny_test_model.nemo"
        twin = race(tmp_path / "upstream", "ngc", ["--url", url], upstream=True, delays=skew)
        twin_fetched = mirror.stats()["tiny_test_model.nemo"].requests
    failed = [r for r in twin if r["status"] != "ok"]
    assert failed or twin_fetched > 1, (twin_fetched, twin)


def test_megatron_vocab_and_merges_download_once_before_torch_distributed(tmp_path: Path) -> None:
    """NeMo #12420: every rank downloads into the same ``.tmp`` and moves it; ranks die with FileNotFoundError
    (the twin). With nemo_safe every rank gets both files, each fetched once."""
    megatron_utils = pytest.importorskip(
        "nemo.collections.common.tokenizers.megatron_utils",
        reason="NeMo 1.23 keeps these downloads in nemo.collections.nlp",
    )
    with_wget = "wget.download(" in inspect.getsource(megatron_utils._download)  # 2.x: no shared .tmp file
    files = {"gpt2-vocab.json": os.urandom(96 * 1024), "gpt2-merges.txt": os.urandom(64 * 1024)}
    digests = {name: __import__("hashlib").sha256(body).hexdigest() for name, body in files.items()}
    with LoopbackMirror(files, rate=48 * 1024) as mirror:
        ours = race(tmp_path / "ours", "megatron", ["--mirror", mirror.url], upstream=False)
        fetched = {name: s.requests for name, s in mirror.stats().items()}
    assert [r["status"] for r in ours] == ["ok"] * RANKS, ours
    assert {(r["vocab"], r["merges"]) for r in ours} == {(digests["gpt2-vocab.json"], digests["gpt2-merges.txt"])}
    assert fetched == {"gpt2-vocab.json": 1, "gpt2-merges.txt": 1}, fetched
    with LoopbackMirror(files, rate=48 * 1024) as mirror:
        twin = race(tmp_path / "upstream", "megatron", ["--mirror", mirror.url], upstream=True)
        twin_fetched = {name: s.requests for name, s in mirror.stats().items()}
    errors = {r.get("error_type") for r in twin if r["status"] != "ok"}
    if with_wget:  # each rank downloads into its own temporary file in the working folder, then moves it
        assert errors or min(twin_fetched.values()) > 1, (twin_fetched, twin)
    else:
        assert errors & {"FileNotFoundError"}, twin


def _cache_files(tmp: Path) -> list[Path]:
    return sorted(p for p in (tmp / "nemo_cache").rglob("*") if p.is_file() and ".nemo_safe" not in p.parts)


def test_a_broken_download_reaches_every_rank_and_leaves_no_partial_file(tmp_path: Path, tiny_nemo: bytes) -> None:
    """The mirror breaks every response off halfway: with nemo_safe one process tries (upstream's three attempts),
    the others get its failure, and no file stays behind; upstream's twin leaves a truncated .nemo that the next
    ``from_pretrained`` re-uses."""
    from faulty_mirror import Faults, FaultyMirror

    name, half = "tiny_test_model.nemo", len(tiny_nemo) // 2
    skew = {rank: 0.1 * rank for rank in range(FEW)}  # all arrive while the first one's attempts (1 s each) run
    broken = Faults(drop_after={name: half})
    with FaultyMirror({name: tiny_nemo}, faults=broken, rate=len(tiny_nemo) / 2) as mirror:
        ours = race(tmp_path / "ours", "ngc", ["--url", mirror.url + name], upstream=False, delays=skew, ranks=FEW)
        tries = mirror.stats()[name].requests
    kinds = sorted(r.get("error_type", "ok") for r in ours)
    assert kinds.count("ValueError") == 1 and kinds.count("LeaderFailed") == FEW - 1, ours
    assert all("Not able to download" in r["error"] for r in ours), ours
    assert tries == 3, f"one process tries, three times: {tries} requests"
    assert _cache_files(tmp_path / "ours") == [], "no partial file may stay"
    with FaultyMirror({name: tiny_nemo}, faults=broken, rate=len(tiny_nemo) / 2) as mirror:
        race(tmp_path / "upstream", "ngc", ["--url", mirror.url + name], upstream=True, delays=skew, ranks=FEW)
    left = _cache_files(tmp_path / "upstream")
    assert [p.stat().st_size for p in left] == [half], left


def test_refresh_cache_downloads_once_for_the_ranks_that_ask_together(
    tmp_path: Path, tiny_nemo: bytes, tiny_nemo_v2: bytes
) -> None:
    """``from_pretrained(..., refresh_cache=True)`` on every rank over an old cached copy while the mirror serves a
    new model: one download (the file replaced after a rank's call began is its refresh), every rank restores
    the new weights; upstream's twin downloads once per rank."""
    name = "tiny_test_model.nemo"
    skew = {rank: 0.4 * rank for rank in range(FEW)}
    for side, upstream in (("ours", False), ("upstream", True)):
        with LoopbackMirror({name: tiny_nemo}) as mirror:
            old = race(tmp_path / side, "ngc", ["--url", mirror.url + name], upstream=upstream, ranks=1)
        with LoopbackMirror({name: tiny_nemo_v2}, rate=len(tiny_nemo_v2) / 3) as mirror:
            new = race(tmp_path / side, "ngc", ["--url", mirror.url + name, "--refresh"], upstream=upstream,
                       delays=skew, gate="gate2", ranks=FEW)  # fmt: skip
            fetched = mirror.stats()[name].requests
        if not upstream:
            assert [r["status"] for r in new] == ["ok"] * FEW, new
            weights = {r["weights"] for r in new}
            assert len(weights) == 1 and old[0]["weights"] not in weights, (old, new)  # all the new model
            assert fetched == 1, f"one refresh for {FEW} ranks: {fetched} requests"
        else:
            assert fetched > 1, f"upstream refreshes once per rank: {fetched} requests"


def test_one_process_refreshes_what_it_downloaded_itself(tmp_path: Path) -> None:
    """One process, no ranks: download, then the cached file goes bad and ``refresh_cache=True`` must fetch it
    again, returning what upstream's function returns (the first version took any file newer than the process
    for refreshed, and returned the bad file). Next to the upstream twin: the same lines."""
    body = os.urandom(64 * 1024)
    script = (
        "import sys, pathlib\n"
        "import nemo_safe\n"
        "from nemo.utils.cloud import maybe_download_from_cloud as get\n"
        "url, cache = sys.argv[1], pathlib.Path(sys.argv[2])\n"
        "first = get(url, 'f.bin', cache_dir=cache)\n"
        "again = get(url, 'f.bin', cache_dir=cache)\n"
        "(cache / 'f.bin').write_bytes(b'bad')\n"
        "fresh = get(url, 'f.bin', cache_dir=cache, refresh_cache=True)\n"
        "import hashlib\n"
        "print('RESULT', [type(x).__name__ for x in (first, again, fresh)], "
        "hashlib.sha256((cache / 'f.bin').read_bytes()).hexdigest(), sorted(p.name for p in cache.iterdir()))\n"
    )
    outcomes = {}
    with LoopbackMirror({"f.bin": body}) as mirror:
        for side, env in (("ours", {}), ("upstream", {"NEMO_SAFE_DISABLE": "1"})):
            out = subprocess.run([sys.executable, "-c", script, mirror.url, str(tmp_path / side)],
                                 env=clean_env(**env), capture_output=True, text=True, timeout=HANG_GUARD)  # fmt: skip
            outcomes[side] = [ln[ln.index("RESULT") :] for ln in out.stdout.splitlines() if "RESULT" in ln]  # wget
        fetched = mirror.stats()["f.bin"].requests
    digest = __import__("hashlib").sha256(body).hexdigest()
    assert outcomes["ours"] == outcomes["upstream"], outcomes
    assert outcomes["ours"] == [f"RESULT ['PosixPath', 'str', 'PosixPath'] {digest} ['f.bin']"], outcomes
    assert fetched == 4, f"a download and a refresh per side: {fetched} requests"


def test_a_killed_downloader_is_taken_over_and_every_other_rank_restores(tmp_path: Path, tiny_nemo: bytes) -> None:
    """Rank 0 downloads (8 s at the mirror's pace) and is killed with SIGKILL after 3 s: another rank takes over,
    every other rank restores the model from one complete file; upstream's twin leaves ranks re-using the
    killed download's truncated file."""
    name = "tiny_test_model.nemo"
    late = {rank: 1.0 for rank in range(1, FEW)}  # rank 0 starts the download first
    with LoopbackMirror({name: tiny_nemo}, rate=len(tiny_nemo) / 8) as mirror:
        ours = race(
            tmp_path / "ours",
            "ngc",
            ["--url", mirror.url + name, "--nemo-first"],  # NeMo imported before nemo_safe: its binding is rebound
            upstream=False,
            delays=late,
            kill=(0, 3.0),
            ranks=FEW,
        )
        fetched = mirror.stats()[name].requests
    assert [r["status"] for r in ours[1:]] == ["ok"] * (FEW - 1), ours
    assert len({r["weights"] for r in ours[1:]}) == 1, ours
    assert fetched == 2, f"the killed download and one more: {fetched} requests"
    with LoopbackMirror({name: tiny_nemo}, rate=len(tiny_nemo) / 8) as mirror:
        twin = race(tmp_path / "upstream", "ngc", ["--url", mirror.url + name, "--nemo-first"], upstream=True,
                    delays=late, kill=(0, 3.0), ranks=FEW)  # fmt: skip
    assert [r for r in twin[1:] if r["status"] != "ok"], twin
