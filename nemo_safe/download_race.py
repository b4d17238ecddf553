"""The torchvision download race, upstream vs nemo_safe: the member processes and the side-by-side run.

Every member builds ``MNIST(root, download=True)`` against a throttled
:class:`~nemo_safe.loopback_mirror.LoopbackMirror` at the same moment, as the
PyTorch FSDP tutorial does on every rank. ``spawn`` starts the members with
``torch.multiprocessing.spawn`` and releases them together through a gloo
``init_process_group`` + ``barrier`` (no launcher variables at all); ``member``
is one rank under srun / torchrun / local launcher variables, released by a
file gate. Each member writes ``<results>/<rank>.json``: status, error, and the
sha256 of the loaded tensors, which the caller compares with the reference.

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
from collections.abc import Iterable
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


def build(
    dataset: str,
    root: str,
    mirror: str,
    resources: list[tuple[str, str]] | None,
    attrs: dict[str, Any] | None = None,
    kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Build the dataset with download=True from ``mirror``; digests of what was loaded.
    ``attrs`` overrides class attributes (a test's own files and md5s, e.g. CIFAR10's lists; ``{mirror}``
    in a string, also inside lists and dicts, becomes the mirror's URL); ``kwargs`` go to the
    constructor (EMNIST's ``split``). ``train=True`` is passed where the class takes it."""
    import inspect

    import numpy as np
    import torchvision.datasets as datasets

    cls = getattr(datasets, dataset)
    if hasattr(cls, "mirrors"):
        cls.mirrors = [mirror]
    if resources is not None:
        cls.resources = [tuple(r) for r in resources]
    for name, value in (attrs or {}).items():
        setattr(cls, name, _with_mirror(value, mirror))
    kwargs = dict(kwargs or {})
    if "train" in inspect.signature(cls.__init__).parameters:
        kwargs.setdefault("train", True)
    ds = cls(root, download=True, **kwargs)
    if hasattr(ds, "data") and hasattr(ds, "targets"):  # the MNIST family, CIFAR
        data = np.ascontiguousarray(np.asarray(ds.data))
        targets = np.asarray(ds.targets).astype(np.uint8)
        return {
            "data_sha": hashlib.sha256(data.tobytes()).hexdigest(),
            "targets_sha": hashlib.sha256(targets.tobytes()).hexdigest(),
            "items": len(ds),
        }
    return item_digests(ds)


def item_digests(ds: Any) -> dict[str, Any]:
    """For datasets without ``.data``: :func:`digests_of_items` over every (image, target) it loads."""
    return {**digests_of_items(ds[index] for index in range(len(ds))), "items": len(ds)}


def digests_of_items(items: Iterable[tuple[Any, Any]]) -> dict[str, str]:
    """sha256 over every item's (image pixels, target), in any order (the order of some datasets follows
    a directory listing), and over the targets alone; a test computes the reference from its own arrays."""
    import numpy as np

    per_item, targets = [], []
    for image, target in items:
        pixels = np.ascontiguousarray(np.asarray(image)).tobytes()
        per_item.append(hashlib.sha256(pixels + b"|" + repr(target).encode()).hexdigest())
        targets.append(repr(target))
    return {
        "data_sha": hashlib.sha256("".join(sorted(per_item)).encode()).hexdigest(),
        "targets_sha": hashlib.sha256("\n".join(sorted(targets)).encode()).hexdigest(),
    }


def _with_mirror(value: Any, mirror: str) -> Any:
    if isinstance(value, str):
        return value.replace("{mirror}", mirror)
    if isinstance(value, list):
        return [_with_mirror(v, mirror) for v in value]
    if isinstance(value, dict):
        return {k: _with_mirror(v, mirror) for k, v in value.items()}
    return value


def _attempt(rank: int, args: argparse.Namespace) -> None:
    import nemo_safe  # noqa: F401  (patches torchvision unless NEMO_SAFE_DISABLE=1)

    resources = json.loads(args.resources) if args.resources else None
    result: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "status": "ok", "started": time.time()}
    started = time.monotonic()
    try:
        attrs = json.loads(args.attrs) if args.attrs else None
        kwargs = json.loads(args.kwargs) if args.kwargs else None
        result.update(build(args.dataset, args.root, args.mirror, resources, attrs, kwargs))
    except Exception as exc:
        result.update(status="error", error_type=type(exc).__name__, error=str(exc)[:2000])
    result["seconds"] = time.monotonic() - started
    Path(args.results, f"{rank}.json").write_text(json.dumps(result))


def _spawned(index: int, args: argparse.Namespace) -> None:
    # nemo_safe before torchvision here (members import it after): both import orders run.
    importlib.import_module("nemo_safe")  # a no-op with NEMO_SAFE_DISABLE=1
    import torch.distributed as dist
    import torchvision.datasets  # noqa: F401  (before the release, so the start skew is exactly the one asked for)

    if not args.init:
        # mp.spawn before init_process_group: no rank is known anywhere (no variables, no process group).
        time.sleep(index * args.skew)
        _attempt(index, args)
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=index, world_size=args.nprocs)
    try:
        # --then: further datasets, each a fresh race (its own root, results and mirror) after the same barrier,
        # so that one spawn (whose start-up dominates a test) serves several.
        for job in [{}, *json.loads(args.then or "[]")]:
            dist.barrier()  # released together, like the ranks of the FSDP tutorial
            time.sleep(index * args.skew)
            _attempt(index, argparse.Namespace(**{**vars(args), **job}))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_results(results: Path) -> dict[int, dict[str, Any]]:
    out = {}
    for path in results.glob("*.json"):
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
    init: bool = True,
    resources: Any = None,
    dataset: str = "MNIST",
    attrs: dict[str, Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    then: list[dict[str, Any]] | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """``python -m nemo_safe.download_race spawn``: ``nprocs`` ranks by torch.multiprocessing.spawn.
    ``then``: further races in the same processes, each a dict of ``root``, ``results``, ``mirror``,
    ``dataset``, ``attrs`` and ``kwargs`` (see ``--then``)."""
    from nemo_safe.cluster_identity import without_launchers

    results.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "nemo_safe.download_race", "spawn",
        "--nprocs", str(nprocs), "--root", str(root), "--results", str(results), "--mirror", mirror,
        "--port", str(free_port()), "--skew", str(skew), "--dataset", dataset,
    ]  # fmt: skip
    if attrs is not None:
        cmd += ["--attrs", json.dumps(attrs)]
    if kwargs is not None:
        cmd += ["--kwargs", json.dumps(kwargs)]
    if resources is not None:
        cmd += ["--resources", json.dumps(resources)]
    if then:
        if not init:
            raise ValueError("then= needs init=True: the races are lined up by the process group's barrier")
        jobs = [{k: json.dumps(v) if k in ("attrs", "kwargs") and not isinstance(v, str) else v
                 for k, v in job.items()} for job in then]  # fmt: skip
        for job in jobs:
            Path(job["results"]).mkdir(parents=True, exist_ok=True)
        cmd += ["--then", json.dumps(jobs)]
    if not init:
        cmd.append("--no-init")
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
    from nemo_safe.loopback_mirror import LoopbackMirror

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nemo_safe.download_race")
    p.add_argument("mode", choices=["spawn", "member"])
    p.add_argument("--root", required=True)
    p.add_argument("--results", required=True)
    p.add_argument("--mirror", required=True)
    p.add_argument("--dataset", default="MNIST")
    p.add_argument("--resources", help="JSON list of [file, md5] replacing the dataset's resources")
    p.add_argument("--attrs", help="JSON object of class attributes to set ({mirror} is replaced by --mirror)")
    p.add_argument("--kwargs", help="JSON object of extra constructor arguments")
    p.add_argument("--nprocs", type=int, default=8)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--skew", type=float, default=0.0, help="rank i starts i*skew seconds after the others")
    p.add_argument("--no-init", dest="init", action="store_false", help="spawn: no init_process_group at all")
    p.add_argument("--node-local", action="store_true", help="member: use <root>/node<node rank> as the root")
    p.add_argument("--gate", help="member: a shared directory where all ranks line up first")
    p.add_argument("--then", help="spawn: JSON list of further races (objects overriding --root, --results, ...)")
    args = p.parse_args(argv)
    if args.mode == "spawn":
        import torch.multiprocessing as mp

        mp.spawn(_spawned, args=(args,), nprocs=args.nprocs, join=True)
        return 0
    from nemo_safe import cluster_identity

    ident = cluster_identity.detect()
    if args.gate:
        import torchvision.datasets  # noqa: F401  (line up after the slow imports)

        from nemo_safe.demo import start_gate

        start_gate(Path(args.gate), ident.rank, ident.world_size, "imported")
    time.sleep(ident.rank * args.skew)
    if args.node_local:
        args.root = os.path.join(args.root, f"node{ident.node_rank}")
    _attempt(ident.rank, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
