"""Downloads on 8 ranks, upstream vs nemo_safe vs one rank alone, side by side in one run:
``MNIST(root, download=True)``, ``CIFAR10(root, download=True)``, pretrained weights
(``squeezenet1_1`` weights through ``WeightsEnum.get_state_dict`` -> ``torch.hub``) and NeMo's
``ModelPT.from_pretrained`` of an NGC model (``maybe_download_from_cloud``).

Every configuration downloads from a real HTTP mirror on 127.0.0.1 whose link is
shared by all responses and throttled (``--link-mbps``, default 5 MB/s: a site's
internet uplink, which 8 upstream ranks fetching the same files share). Ranks are
started by torch.multiprocessing.spawn and released together after
init_process_group (the FSDP tutorial); from_pretrained's are local processes with
torchrun-style variables and no process group (a model is built before torch.distributed
exists), released together once each has imported NeMo, all with one fresh ``NEMO_CACHE_DIR``
per run (:mod:`nemo_safe_tools.from_pretrained_race`, the demo's race). Measured per run:
body bytes served (without torchvision's own redirect probes) over the bytes of the file
set, and the slowest rank's seconds inside the dataset constructor / the weights load /
``from_pretrained``, from release to loaded; reported as medians over ``--rounds``
interleaved rounds, each against the median of "one rank alone, upstream" for the same
workload.

The files: the original MNIST files when ``../shared/data/mnist`` exists (else
synthetic files of MNIST's sizes); a generated CIFAR10 archive in CIFAR's exact
layout (``tests/dataset_files.py``, 1,000 images per batch, 18 MB); a
freshly initialised squeezenet1_1 state dict (``tests/hub_worker.py``, 5 MB)
under a hub-style name with its hash prefix, loaded with ``check_hash=True``; a
``.nemo`` of the demo's ``TinyModel`` widened to one 2048 x 2048 linear layer (NeMo's
own ``save_to``, 16.8 MB), registered as an NGC model at the mirror.

Run: .venv/bin/python benchmarks/download_time.py [--rounds 2] [--ranks 8]
     [--only MNIST,CIFAR10,weights,from_pretrained]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
sys.path.insert(0, str(TESTS))  # the test data generators and harnesses (dataset_files, hub_worker, download_harness)

from nemo_safe.cluster_identity import without_launchers  # noqa: E402
from nemo_safe_tools import download_race  # noqa: E402
from nemo_safe_tools.loopback_mirror import FileStats, LoopbackMirror  # noqa: E402

import download_harness  # noqa: E402

MNIST_DIR = HERE.parents[1] / "shared" / "data" / "mnist"
#: from_pretrained's model: one linear layer of this width (16.8 MB of float32), near the other workloads' sizes.
FROM_PRETRAINED_WIDTH = 2048


class SharedLinkMirror(LoopbackMirror):
    """The loopback mirror behind one link of ``link_rate`` bytes per second shared by all responses
    (a site's internet uplink)."""

    def __init__(self, files: dict[str, bytes], link_rate: float) -> None:
        self.link_rate = link_rate
        self._link_free_at = 0.0
        super().__init__(files)

    def _pace(self, nbytes: int) -> None:
        """Wait for this chunk's turn on the shared link."""
        with self._lock:
            start = max(time.monotonic(), self._link_free_at)
            self._link_free_at = start + nbytes / self.link_rate
            until = self._link_free_at
        time.sleep(max(0.0, until - time.monotonic()))

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = {name: FileStats() for name in self.files}


@dataclass
class Workload:
    """One thing every rank fetches: the files the mirror serves, and how ``ranks`` ranks fetch them."""

    name: str
    what: str
    files: dict[str, bytes]
    #: (ranks, mirror url, work folder, disable, results folder name) -> results by rank
    spawn: Callable[[int, str, Path, bool, str], dict[int, dict[str, Any]]]


def mnist() -> Workload:
    if all((MNIST_DIR / n).is_file() for n in download_race.MNIST_FILES):
        files, what = {n: (MNIST_DIR / n).read_bytes() for n in download_race.MNIST_FILES}, "original files"
    else:
        files, what = download_race.synthetic_mnist(60000, 10000), "synthetic files of MNIST's sizes"
    resources = download_race.resources_of(files)

    def spawn(ranks: int, url: str, tmp: Path, disable: bool, res: str) -> dict[int, dict[str, Any]]:
        out = download_race.run_spawn(ranks, tmp / "root", tmp / res, url, disable=disable, resources=resources)
        return _results(download_race.read_results(tmp / res), ranks, out)

    return Workload("MNIST", f"MNIST, {what}", files, spawn)


def cifar10() -> Workload:
    from dataset_files import cifar10 as make

    spec = make(images_per_batch=1000)

    def spawn(ranks: int, url: str, tmp: Path, disable: bool, res: str) -> dict[int, dict[str, Any]]:
        out = download_harness.run_spawn(
            ranks, tmp / "root", tmp / res, url, disable=disable, dataset="CIFAR10", attrs=spec.attrs
        )
        return _results(download_race.read_results(tmp / res), ranks, out)

    return Workload("CIFAR10", "CIFAR10, generated archive in CIFAR's layout", spec.files, spawn)


def weights() -> Workload:
    import torch
    from hub_worker import reference_state_dict

    buf = io.BytesIO()
    torch.save(reference_state_dict(), buf)
    data = buf.getvalue()
    name = f"squeezenet1_1-{hashlib.sha256(data).hexdigest()[:8]}.pth"

    def spawn(ranks: int, url: str, tmp: Path, disable: bool, res: str) -> dict[int, dict[str, Any]]:
        (tmp / res).mkdir(parents=True)
        cmd = [
            sys.executable, str(TESTS / "hub_worker.py"), "spawn", "--nprocs", str(ranks), "--url", url + name,
            "--results", str(tmp / res), "--port", str(download_race.free_port()),
        ]  # fmt: skip
        env = {**without_launchers(os.environ), "TORCH_HOME": str(tmp / "home"), "NEMO_SAFE_DISABLE": str(int(disable))}
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        found = {}
        for path in (tmp / res).glob("*.json"):
            res = json.loads(path.read_text())
            found[res["rank"]] = res
        return _results(found, ranks, out)

    return Workload("weights", "squeezenet1_1 weights via torch.hub", {name: data}, spawn)


def from_pretrained() -> Workload:
    from nemo_safe_tools import from_pretrained_race as race

    with tempfile.TemporaryDirectory(prefix="nemo_safe_bench_") as tmp:
        model = race.make_tiny_nemo(Path(tmp), width=FROM_PRETRAINED_WIDTH)

    def spawn(ranks: int, url: str, tmp: Path, disable: bool, res: str) -> dict[int, dict[str, Any]]:
        return race.run_ranks(ranks, url + race.FILE_NAME, tmp / "cache", tmp / res, disable=disable)

    what = f"NeMo from_pretrained (NGC) of a {FROM_PRETRAINED_WIDTH}x{FROM_PRETRAINED_WIDTH} TinyModel .nemo"
    return Workload("from_pretrained", what, {race.FILE_NAME: model.data}, spawn)


def _results(found: dict[int, dict[str, Any]], ranks: int, out: subprocess.CompletedProcess[str]) -> dict:
    if len(found) < ranks:
        raise SystemExit(f"only {len(found)} of {ranks} ranks reported:\n{out.stderr[-2000:]}")
    return found


WORKLOADS: dict[str, Callable[[], Workload]] = {
    "MNIST": mnist,
    "CIFAR10": cifar10,
    "weights": weights,
    "from_pretrained": from_pretrained,
}


def measure(
    work: Workload, ranks: int, disable: bool, link: float, on_disk: bool = False
) -> tuple[float, float, list[str]]:
    """(slowest rank's seconds, bytes served / file set, errors of failed ranks) of one run.
    ``on_disk``: one upstream rank downloads first (not measured), so only loading is timed."""
    with tempfile.TemporaryDirectory(prefix="nemo_safe_bench_") as tmp, SharedLinkMirror(work.files, link) as m:
        if on_disk:
            work.spawn(1, m.url, Path(tmp), True, "prepare")
            m.reset_stats()
        results = work.spawn(ranks, m.url, Path(tmp), disable, "res")
        served = m.total_body_bytes()
    failed = [f"{r['error_type']}: {r['error']}" for r in results.values() if r["status"] != "ok"]
    return max(r["seconds"] for r in results.values()), served / sum(map(len, work.files.values())), failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--link-mbps", type=float, default=5.0, help="shared mirror link, MB/s")
    p.add_argument("--only", default=",".join(WORKLOADS), help="comma-separated: " + ", ".join(WORKLOADS))
    args = p.parse_args(argv)
    works = [WORKLOADS[name]() for name in args.only.split(",")]
    link = args.link_mbps * 1e6
    configs = [
        ("one rank alone, upstream", 1, True, False),
        ("one rank alone, nemo_safe", 1, False, False),
        (f"{args.ranks} ranks, upstream", args.ranks, True, False),
        (f"{args.ranks} ranks, nemo_safe", args.ranks, False, False),
        ("one rank alone, files already on disk (loading only)", 1, False, True),
        (f"{args.ranks} ranks, files already on disk (loading only)", args.ranks, False, True),
        (f"{args.ranks} ranks, upstream, files already on disk (loading only)", args.ranks, True, True),
    ]
    rows: dict[tuple[str, str], list[tuple[float, float, list[str]]]] = {}
    for _ in range(args.rounds):  # interleaved, so drift hits every configuration alike
        for work in works:
            for config, ranks, disable, on_disk in configs:
                rows.setdefault((work.name, config), []).append(measure(work, ranks, disable, link, on_disk))
    launch = f"{args.ranks} ranks of torch.multiprocessing.spawn"
    local = "local processes with torchrun-style variables, no process group"
    if all(work.name == "from_pretrained" for work in works):
        launch = f"{args.ranks} {local}"
    elif any(work.name == "from_pretrained" for work in works):
        launch += f" (from_pretrained: {local})"
    print(f"Downloads on {launch}, mirror link {args.link_mbps:g} MB/s shared, {args.rounds} rounds, medians")
    print()
    print("| workload | configuration | slowest rank, s | vs one rank alone | bytes served / file set | failed ranks |")
    print("|---|---|---|---|---|---|")
    errors = []
    for work in works:
        alone = statistics.median(s for s, _, _ in rows[(work.name, "one rank alone, upstream")])
        size = sum(map(len, work.files.values())) / 1e6
        for config, ranks, *_ in configs:
            runs = rows[(work.name, config)]
            secs = statistics.median(s for s, _, _ in runs)
            served = statistics.median(b for _, b, _ in runs)
            failed = sum(len(f) for _, _, f in runs)
            errors += [(work.name, config, e) for _, _, f in runs for e in f]
            print(
                f"| {work.what} ({size:.1f} MB) | {config} | {secs:.2f} | {secs / alone:.2f}x | {served:.2f}x "
                f"| {failed} of {ranks * args.rounds} |"
            )
    if errors:
        print()
        print("Errors of failed ranks:")
        for name, config, error in errors:
            print(f"- {name}, {config}: {error.splitlines()[0][:300]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
