"""The torchvision download race of ``nemo-safe demo``, upstream vs nemo_safe, side by side.

Every rank builds ``MNIST(root, download=True)`` against a throttled
:class:`~nemo_safe_tools.loopback_mirror.LoopbackMirror` at the same moment, as the
PyTorch FSDP tutorial does on every rank: ``python -m nemo_safe_tools.download_race``
starts the ranks with ``torch.multiprocessing.spawn`` and releases them together
through a gloo ``init_process_group`` + ``barrier`` (no launcher variables at all).
Each rank writes ``<results>/<rank>.json``: status, error, and the sha256 of the
loaded tensors, which the caller compares with the reference. The tests' harness
(``tests/download_harness.py``) builds on this one: other datasets, members under
srun / torchrun, further races in one spawn.

``nemo-safe demo`` uses synthetic data in the MNIST file format (this machine
may have no internet and the real files are not ours to ship); the tests use
the exact original MNIST files.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MNIST_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)


def _idx(dims: tuple[int, ...], payload: bytes) -> bytes:
    return bytes([0, 0, 0x08, len(dims)]) + b"".join(d.to_bytes(4, "big") for d in dims) + payload


def synthetic_mnist(train: int = 12000, test: int = 2000, seed: int = 0) -> dict[str, bytes]:
    """gz files in MNIST's format and names, deterministic; images are random (so they do not compress)."""
    import random

    rng = random.Random(seed)

    def images(n: int) -> bytes:
        return _idx((n, 28, 28), rng.randbytes(n * 28 * 28))

    def labels(n: int) -> bytes:
        return _idx((n,), bytes(rng.randrange(10) for _ in range(n)))

    raw = [images(train), labels(train), images(test), labels(test)]
    return {name: gzip.compress(data, compresslevel=1, mtime=0) for name, data in zip(MNIST_FILES, raw, strict=False)}


def resources_of(files: dict[str, bytes]) -> list[tuple[str, str]]:
    return [(name, hashlib.md5(files[name], usedforsecurity=False).hexdigest()) for name in MNIST_FILES]


def reference_digests(files: dict[str, bytes], train: bool = True) -> dict[str, str]:
    """What a correct load of these files gives: sha256 of the image payload and of the labels."""
    prefix = "train" if train else "t10k"
    img = gzip.decompress(files[f"{prefix}-images-idx3-ubyte.gz"])
    lab = gzip.decompress(files[f"{prefix}-labels-idx1-ubyte.gz"])
    return {"data_sha": hashlib.sha256(img[16:]).hexdigest(), "targets_sha": hashlib.sha256(lab[8:]).hexdigest()}


def load(dataset: str, root: str, mirror: str, resources: list[tuple[str, str]] | None, **kwargs: Any) -> Any:
    """``datasets.<dataset>(root, download=True, **kwargs)`` downloading from ``mirror``; ``resources`` (if
    given) replaces the class's list of (file, md5); ``train=True`` is passed where the class takes it."""
    import inspect

    import torchvision.datasets as datasets

    cls = getattr(datasets, dataset)
    if hasattr(cls, "mirrors"):
        cls.mirrors = [mirror]
    if resources is not None:
        cls.resources = [tuple(r) for r in resources]
    if "train" in inspect.signature(cls.__init__).parameters:
        kwargs.setdefault("train", True)
    return cls(root, download=True, **kwargs)


def data_digests(ds: Any) -> dict[str, Any]:
    """sha256 of what a dataset with ``.data`` and ``.targets`` (the MNIST family, CIFAR) loaded."""
    import numpy as np

    data = np.ascontiguousarray(np.asarray(ds.data))
    targets = np.asarray(ds.targets).astype(np.uint8)
    return {
        "data_sha": hashlib.sha256(data.tobytes()).hexdigest(),
        "targets_sha": hashlib.sha256(targets.tobytes()).hexdigest(),
        "items": len(ds),
    }


def build(dataset: str, root: str, mirror: str, resources: list[tuple[str, str]] | None) -> dict[str, Any]:
    """:func:`load` the dataset; the digests of what it loaded."""
    return data_digests(load(dataset, root, mirror, resources))


def build_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """What one member loads, from its command line."""
    return build(args.dataset, args.root, args.mirror, json.loads(args.resources) if args.resources else None)


Build = Callable[[argparse.Namespace], dict[str, Any]]


def attempt(rank: int, args: argparse.Namespace, build: Build = build_from_args) -> None:
    """One member's try: ``build(args)``, timed; writes ``<results>/<rank>.json`` (status, error, digests)."""
    import nemo_safe  # noqa: F401  (patches torchvision unless NEMO_SAFE_DISABLE=1)

    result: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "status": "ok", "started": time.time()}
    started = time.monotonic()
    try:
        result.update(build(args))
    except Exception as exc:
        result.update(status="error", error_type=type(exc).__name__, error=str(exc)[:2000])
    result["seconds"] = time.monotonic() - started
    Path(args.results, f"{rank}.json").write_text(json.dumps(result))


def import_first() -> None:
    """nemo_safe before torchvision here (members import it after): both import orders run; torchvision
    before the release, so that the start skew is exactly the one asked for."""
    importlib.import_module("nemo_safe")  # a no-op with NEMO_SAFE_DISABLE=1
    importlib.import_module("torchvision.datasets")


def spawned(
    index: int, args: argparse.Namespace, jobs: Sequence[dict[str, Any]] = (), build: Build = build_from_args
) -> None:
    """One rank of ``torch.multiprocessing.spawn``: released with the others by a gloo process group's
    barrier, then ``index * skew`` s later its :func:`attempt`; ``jobs`` are further races after the same
    barrier, each overriding some of ``args``, so that one spawn (whose start-up is slow) serves several."""
    import_first()
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=index, world_size=args.nprocs)
    try:
        for job in [{}, *jobs]:
            dist.barrier()  # released together, like the ranks of the FSDP tutorial
            time.sleep(index * args.skew)
            attempt(index, argparse.Namespace(**{**vars(args), **job}), build)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_results(results: Path, pattern: str = "*.json") -> dict[int, dict[str, Any]]:
    """The results in ``results`` (files matching ``pattern``, each with its ``rank``), by rank."""
    out = {}
    for path in results.glob(pattern):
        res = json.loads(path.read_text())
        out[res["rank"]] = res
    return out


@dataclass
class Outcome:
    name: str
    results: dict[int, dict[str, Any]]
    expected: int
    reference: dict[str, str]
    body_bytes: int
    dataset_bytes: int
    complete_fetches: int

    @property
    def failed(self) -> list[int]:
        return sorted(r for r, res in self.results.items() if res["status"] != "ok")

    @property
    def wrong_data(self) -> list[int]:
        ref = self.reference
        return sorted(
            r
            for r, res in self.results.items()
            if res["status"] == "ok" and (res["data_sha"], res["targets_sha"]) != (ref["data_sha"], ref["targets_sha"])
        )

    def row(self) -> str:
        missing = self.expected - len(self.results)
        slowest = max((res["seconds"] for res in self.results.values()), default=float("nan"))
        return (
            f"| {self.name} | {len(self.failed) + missing} of {self.expected} | {len(self.wrong_data)} | "
            f"{self.complete_fetches} | {self.body_bytes / self.dataset_bytes:.2f}x | {slowest:.1f} |"
        )


def run_spawn(
    nprocs: int,
    root: Path,
    results: Path,
    mirror: str,
    *,
    disable: bool,
    skew: float = 0.0,
    resources: Any = None,
    dataset: str = "MNIST",
    extra: Sequence[str] = (),
    program: Sequence[str] = ("-m", "nemo_safe_tools.download_race"),
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """``python -m nemo_safe_tools.download_race``: ``nprocs`` ranks by torch.multiprocessing.spawn.
    ``program`` and ``extra``: another harness built on this one, and its own options."""
    from nemo_safe.cluster_identity import without_launchers

    results.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, *program,
        "--nprocs", str(nprocs), "--root", str(root), "--results", str(results), "--mirror", mirror,
        "--port", str(free_port()), "--skew", str(skew), "--dataset", dataset, *extra,
    ]  # fmt: skip
    if resources is not None:
        cmd += ["--resources", json.dumps(resources)]
    env = {**without_launchers(os.environ), "NEMO_SAFE_DISABLE": "1" if disable else "0"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def rate_for(files: dict[str, bytes], download_seconds: float) -> float:
    """The per-response throttle under which the largest file takes ``download_seconds``."""
    return max(len(b) for b in files.values()) / download_seconds


def compare(
    workdir: Path, nprocs: int, download_seconds: float, skew: float, files: dict[str, bytes] | None = None
) -> list[Outcome]:
    """Upstream vs nemo_safe, each on a fresh root against a fresh throttled mirror.

    With the largest file taking ``download_seconds`` and rank i starting ``i * skew``
    later, upstream breaks by construction when download_seconds/2 < skew < download_seconds:
    rank i+1 truncates the file while rank i downloads it, and at rank i's md5 check the
    bytes between rank i+1's progress and rank i's offset at the truncation were written by nobody.
    """
    from nemo_safe_tools.loopback_mirror import LoopbackMirror

    files = files or synthetic_mnist()
    resources = resources_of(files)
    reference = reference_digests(files)
    outcomes = []
    for name, disable in (("upstream torchvision", True), ("with nemo_safe", False)):
        base = workdir / ("upstream" if disable else "nemo_safe")
        with LoopbackMirror(files, rate=rate_for(files, download_seconds)) as mirror:
            run_spawn(
                nprocs, base / "root", base / "results", mirror.url, disable=disable, skew=skew, resources=resources
            )
            stats = mirror.stats()
        outcomes.append(
            Outcome(
                name,
                read_results(base / "results"),
                nprocs,
                reference,
                mirror.total_body_bytes(),
                sum(len(b) for b in files.values()),
                sum(s.complete for s in stats.values()),
            )
        )
    return outcomes


def format_table(outcomes: list[Outcome], nprocs: int, download_seconds: float, skew: float) -> str:
    return "\n".join(
        [
            f"nemo-safe demo: MNIST(root, download=True) on {nprocs} ranks of torch.multiprocessing.spawn after "
            f"init_process_group (FSDP tutorial style), rank i starting i x {skew:g} s after the barrier; "
            f"loopback mirror throttled so the largest file takes {download_seconds:g} s; synthetic data in "
            "MNIST's format. Bytes exclude torchvision's own redirect probes.",
            "",
            "| variant | ranks that failed | ranks that loaded wrong data | complete file fetches (4 files) "
            "| bytes served / dataset | slowest rank in MNIST(), s |",
            "|---|---|---|---|---|---|",
            *(o.row() for o in outcomes),
        ]
    )


def arguments() -> argparse.ArgumentParser:
    """The options of one race (a parent parser: a harness built on this one adds its own)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--root", required=True)
    p.add_argument("--results", required=True)
    p.add_argument("--mirror", required=True)
    p.add_argument("--dataset", default="MNIST")
    p.add_argument("--resources", help="JSON list of [file, md5] replacing the dataset's resources")
    p.add_argument("--nprocs", type=int, default=8)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--skew", type=float, default=0.0, help="rank i starts i*skew seconds after the others")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nemo_safe_tools.download_race", parents=[arguments()])
    args = parser.parse_args(argv)
    import torch.multiprocessing as mp

    mp.spawn(spawned, args=(args,), nprocs=args.nprocs, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
