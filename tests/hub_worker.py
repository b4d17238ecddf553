"""Processes for tests/test_torch_hub.py: pretrained weights through torch.hub, as every rank loads them.

Modes:

* ``spawn``: ``--nprocs`` ranks of ``torch.multiprocessing.spawn``; each joins a gloo process group
  (released together by a barrier, as the FSDP tutorial's ranks), sleeps ``rank * --skew`` and loads.
* ``member``: one task of an ``srun`` step (rank from SLURM's variables), lined up with the others
  after the slow imports in ``--gate``, then loads.
* ``direct``: one call of ``torch.hub.download_url_to_file(--url, --dst, --hash-prefix)``, prints
  its outcome as JSON (with ``--after-partial``: once another process's download has started).

Loading is ``squeezenet1_1(weights=None).load_state_dict(w.get_state_dict(progress=False,
check_hash=True))`` with ``w`` a ``torchvision.models.WeightsEnum`` entry naming ``--url``, into the
hub folder of ``$TORCH_HOME``. Each rank writes ``<results>/<rank>.json``: status, error type and
message, the sha256 of the model's tensors after loading.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def tensors_sha(state_dict: dict[str, Any]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def reference_state_dict(seed: int = 0) -> dict[str, Any]:
    """A freshly initialised squeezenet1_1 (fixed seed): what the mirror serves."""
    import torch
    from torchvision.models import squeezenet1_1

    torch.manual_seed(seed)
    return squeezenet1_1(weights=None).state_dict()


def load(url: str) -> dict[str, Any]:
    """Load the weights at ``url`` as a torchvision model builder does; the sha256 of what was loaded."""
    import torch.hub
    from torchvision.models import Weights, WeightsEnum, squeezenet1_1
    from torchvision.transforms._presets import ImageClassification

    weights_enum = WeightsEnum(
        "SqueezeNet1_1_MirrorWeights",
        [("MIRROR", Weights(url=url, transforms=ImageClassification, meta={"categories": None}))],
    )
    model = squeezenet1_1(weights=None)
    model.load_state_dict(weights_enum.MIRROR.get_state_dict(progress=False, check_hash=True))
    return {
        "sha": tensors_sha(model.state_dict()),
        "patched": hasattr(torch.hub.download_url_to_file, "__wrapped__"),
    }


def attempt(rank: int, url: str, results: str) -> None:
    """:func:`load`, timed, as one rank of the download race: ``<results>/<rank>.json``."""
    from nemo_safe_tools.download_race import attempt as race_attempt

    race_attempt(rank, argparse.Namespace(results=results), lambda _: load(url))


def _spawned(index: int, args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import torchvision.models  # noqa: F401  (before the release: the start skew is exactly the one asked for)

    import nemo_safe  # noqa: F401  (a no-op with NEMO_SAFE_DISABLE=1)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=index, world_size=args.nprocs)
    try:
        dist.barrier()
        time.sleep(index * args.skew)
        attempt(index, args.url, args.results)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["spawn", "member", "direct"])
    p.add_argument("--url", required=True)
    p.add_argument("--results", help="spawn, member: the folder of the <rank>.json results")
    p.add_argument("--nprocs", type=int, default=8)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--skew", type=float, default=0.0, help="rank i starts i*skew seconds after the others")
    p.add_argument("--gate", help="member: a shared folder where all tasks line up after their imports")
    p.add_argument("--dst", help="direct: the destination file")
    p.add_argument("--hash-prefix", default=None)
    p.add_argument("--after-partial", action="store_true", help="direct: call once a .partial file is next to --dst")
    args = p.parse_args(argv)
    if args.mode == "spawn":
        import torch.multiprocessing as mp

        mp.spawn(_spawned, args=(args,), nprocs=args.nprocs, join=True)
        return 0
    import nemo_safe
    from nemo_safe_tools.demo import start_gate

    if args.mode == "member":
        import torchvision.models  # noqa: F401

        ident = nemo_safe.detect_identity()
        start_gate(Path(args.gate), ident.rank, ident.world_size, "imported")
        time.sleep(ident.rank * args.skew)
        attempt(ident.rank, args.url, args.results)
        return 0
    import torch.hub

    if args.after_partial:  # another process's download of --dst is under way
        folder, deadline = Path(args.dst).parent, time.monotonic() + 300
        while not any(p.name.endswith(".partial") for p in folder.iterdir()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no download into {folder} started")
            time.sleep(0.01)
    result: dict[str, Any] = {"status": "ok", "patched": hasattr(torch.hub.download_url_to_file, "__wrapped__")}
    try:
        torch.hub.download_url_to_file(args.url, args.dst, args.hash_prefix, progress=False)
    except Exception as exc:
        result.update(status="error", error_type=type(exc).__name__, error=str(exc)[:2000])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
