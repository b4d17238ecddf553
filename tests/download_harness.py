"""The tests' download race: :mod:`nemo_safe_tools.download_race` (the demo's) plus what only tests use.

Any torchvision dataset with the test's own files and md5s (``--attrs``: class attributes, ``{mirror}``
in a string, also inside lists and dicts, becomes the mirror's URL) and constructor arguments
(``--kwargs``: EMNIST's ``split``), digests of datasets without ``.data`` (over every item), and:

- ``spawn``: ranks by torch.multiprocessing.spawn, released by a gloo process group's barrier, or
  with ``--no-init`` before any process group (no rank known anywhere); ``--then``: further races
  in the same processes;
- ``member``: one rank under srun / torchrun / local launcher variables, lined up with the others in
  ``--gate`` after its imports; ``--node-local``: ``<root>/node<node rank>`` as its root.

Run as ``python tests/download_harness.py {spawn,member} ...``; :func:`run_spawn` does it for spawn.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from nemo_safe_tools import download_race

HERE = Path(__file__).resolve().parent
SCRIPT = str(HERE / "download_harness.py")


def build(
    dataset: str,
    root: str,
    mirror: str,
    resources: list[tuple[str, str]] | None,
    attrs: dict[str, Any] | None = None,
    kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Build the dataset with download=True from ``mirror``, with ``attrs`` set on its class first and
    ``kwargs`` for its constructor; digests of what was loaded."""
    import torchvision.datasets as datasets

    cls = getattr(datasets, dataset)
    for name, value in (attrs or {}).items():
        setattr(cls, name, _with_mirror(value, mirror))
    ds = download_race.load(dataset, root, mirror, resources, **(kwargs or {}))
    if hasattr(ds, "data") and hasattr(ds, "targets"):  # the MNIST family, CIFAR
        return download_race.data_digests(ds)
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


def _build(args: argparse.Namespace) -> dict[str, Any]:
    def parsed(text: str | None) -> Any:
        return json.loads(text) if text else None

    return build(args.dataset, args.root, args.mirror, parsed(args.resources), parsed(args.attrs), parsed(args.kwargs))


def _spawned(index: int, args: argparse.Namespace) -> None:
    if args.init:
        download_race.spawned(index, args, json.loads(args.then or "[]"), _build)
        return
    # mp.spawn before init_process_group: no rank is known anywhere (no variables, no process group).
    download_race.import_first()
    time.sleep(index * args.skew)
    download_race.attempt(index, args, _build)


def run_spawn(
    *race: Any,
    init: bool = True,
    attrs: dict[str, Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    then: list[dict[str, Any]] | None = None,
    **options: Any,
) -> Any:
    """:func:`nemo_safe_tools.download_race.run_spawn` (``race``: nprocs, root, results, mirror; ``options``:
    ``disable``, ``skew``, ``resources``, ``dataset``, ``timeout``) through this harness. ``then``: further
    races in the same processes, each a dict of ``root``, ``results``, ``mirror``, ``dataset``, ``attrs`` and
    ``kwargs`` (see ``--then``)."""
    extra = ["spawn"]
    if attrs is not None:
        extra += ["--attrs", json.dumps(attrs)]
    if kwargs is not None:
        extra += ["--kwargs", json.dumps(kwargs)]
    if then:
        if not init:
            raise ValueError("then= needs init=True: the races are lined up by the process group's barrier")
        jobs = [{k: json.dumps(v) if k in ("attrs", "kwargs") and not isinstance(v, str) else v
                 for k, v in job.items()} for job in then]  # fmt: skip
        for job in jobs:
            Path(job["results"]).mkdir(parents=True, exist_ok=True)
        extra += ["--then", json.dumps(jobs)]
    if not init:
        extra.append("--no-init")
    return download_race.run_spawn(*race, extra=extra, program=[SCRIPT], **options)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="download_harness.py", parents=[download_race.arguments()])
    p.add_argument("mode", choices=["spawn", "member"])
    p.add_argument("--attrs", help="JSON object of class attributes to set ({mirror} is replaced by --mirror)")
    p.add_argument("--kwargs", help="JSON object of extra constructor arguments")
    p.add_argument("--no-init", dest="init", action="store_false", help="spawn: no init_process_group at all")
    p.add_argument("--then", help="spawn: JSON list of further races (objects overriding --root, --results, ...)")
    p.add_argument("--node-local", action="store_true", help="member: use <root>/node<node rank> as the root")
    p.add_argument("--gate", help="member: a shared directory where all ranks line up first")
    args = p.parse_args(argv)
    if args.mode == "spawn":
        import torch.multiprocessing as mp

        mp.spawn(_spawned, args=(args,), nprocs=args.nprocs, join=True)
        return 0
    from nemo_safe import cluster_identity

    ident = cluster_identity.detect()
    if args.gate:
        import torchvision.datasets  # noqa: F401  (line up after the slow imports)

        from nemo_safe_tools.demo import start_gate

        start_gate(Path(args.gate), ident.rank, ident.world_size, "imported")
    time.sleep(ident.rank * args.skew)
    if args.node_local:
        args.root = os.path.join(args.root, f"node{ident.node_rank}")
    download_race.attempt(ident.rank, args, _build)
    return 0


if __name__ == "__main__":
    sys.exit(main())
