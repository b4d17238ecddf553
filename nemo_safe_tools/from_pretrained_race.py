"""NeMo's ``from_pretrained`` race of ``nemo-safe demo`` and ``benchmarks/download_time.py``, upstream vs nemo_safe.

Every rank of a job builds its model, and ``ModelPT.from_pretrained`` of an NGC model downloads the ``.nemo``
(``nemo.utils.cloud.maybe_download_from_cloud``): upstream, every process downloads into the final file name, and a
process that starts while another downloads re-uses the partial file and fails restoring a truncated archive.
nemo_safe downloads it once (:mod:`nemo_safe.patches.nemo_downloads`).

Why a module of its own: the race needs a real ``ModelPT`` that NeMo can restore, and NeMo restores a ``.nemo``
by the class path in its config (``_target_``), which NeMo 3 instantiates only under
``nemo.core.classes.common.ALLOWED_TARGET_PREFIXES``. :func:`tiny_model_class` defines that class here, under
this importable name, and admits this module's prefix the way a user admits their own model class. The demo, the
benchmark and the tests' worker (``tests/nemo_download_worker.py``) share it.

One race: make the tiny ``.nemo`` once (:func:`make_tiny_nemo`), serve it from a throttled
:class:`~nemo_safe_tools.loopback_mirror.LoopbackMirror`, start N local processes with torchrun-style variables
and no ``torch.distributed`` (:func:`run_ranks`); each imports NeMo, waits for the others, starts ``rank x
skew`` s later and calls ``TinyModel.from_pretrained`` with ``NEMO_CACHE_DIR`` in a fresh folder. Each rank
writes ``result.<rank>.json`` (status, error, sha256 of the restored weights, seconds in ``from_pretrained``).

    python -m nemo_safe_tools.from_pretrained_race make-nemo OUT [--width N]   # a small real .nemo
    python -m nemo_safe_tools.from_pretrained_race member --url URL --side DIR [--skew S]   # one rank

This module imports only the standard library at import time (no NeMo, not even ``nemo_safe``): the tests'
worker imports it before choosing when ``nemo_safe`` comes in.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The model's name in ``list_available_models`` and the file the mirror serves.
MODEL_NAME = "tiny_test_model"
FILE_NAME = f"{MODEL_NAME}.nemo"
#: The model's NGC location (the mirror's URL of :data:`FILE_NAME`); unset, a closed port.
URL_ENV = "TINY_MODEL_URL"
#: One linear layer of width x width float32: 512 is 1 MB.
DEFAULT_WIDTH = 512
#: This module's name also when it runs as ``python -m``: NeMo looks the class up by it.
MODULE = "nemo_safe_tools.from_pretrained_race"


def tiny_model_class() -> type:
    """``TinyModel(ModelPT)``: one ``width`` x ``width`` linear layer (config key ``width``, default 512),
    registered as the NGC pretrained model :data:`MODEL_NAME` at ``$TINY_MODEL_URL``; made once per process.
    Imports NeMo."""
    made = globals().get("TinyModel")
    if made is not None:
        return made
    import torch
    from nemo.core.classes import ModelPT
    from nemo.core.classes.common import PretrainedModelInfo

    class TinyModel(ModelPT):
        def __init__(self, cfg: Any, trainer: Any = None) -> None:
            super().__init__(cfg=cfg, trainer=trainer)
            width = int(cfg.get("width", DEFAULT_WIDTH))
            self.layer = torch.nn.Linear(width, width)

        @classmethod
        def list_available_models(cls) -> list[PretrainedModelInfo]:
            url = os.environ.get(URL_ENV, f"http://127.0.0.1:9/{FILE_NAME}")
            return [PretrainedModelInfo(MODEL_NAME, "a tiny test model", url, class_=cls)]

        def setup_training_data(self, cfg: Any) -> None:
            pass

        def setup_validation_data(self, cfg: Any) -> None:
            pass

    TinyModel.__module__ = MODULE
    TinyModel.__qualname__ = "TinyModel"
    globals()["TinyModel"] = TinyModel  # restore_from finds the class by its config's target
    import nemo.core.classes.common as common

    # NeMo 3 instantiates only targets under approved prefixes; a user's own model class is added the same way.
    allowed = getattr(common, "ALLOWED_TARGET_PREFIXES", None)
    if allowed is not None and f"{MODULE}." not in allowed:
        allowed.append(f"{MODULE}.")
    return TinyModel


def __getattr__(name: str) -> Any:
    """``TinyModel`` resolves also before :func:`tiny_model_class` ran here (a config's target imported first)."""
    if name == "TinyModel":
        return tiny_model_class()
    raise AttributeError(f"module {MODULE!r} has no attribute {name!r}")


def weights_digest(model: Any) -> str:
    """sha256 of the layer's weights: every rank must restore the same."""
    return hashlib.sha256(model.layer.weight.detach().numpy().tobytes()).hexdigest()


@dataclass
class TinyNemo:
    """A ``.nemo`` made by :func:`make_tiny_nemo`: its bytes and the digest of the weights it holds."""

    data: bytes
    weights: str


def make_tiny_nemo(workdir: Path, width: int = DEFAULT_WIDTH, timeout: float = 600) -> TinyNemo:
    """Save a fresh ``TinyModel`` with NeMo's ``save_to`` in a child process (this one need not import NeMo)."""
    from nemo_safe.errors import NemoSafeError

    out = workdir / FILE_NAME
    cmd = [sys.executable, "-m", MODULE, "make-nemo", str(out), "--width", str(width)]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines or not out.is_file():
        tail = done.stderr[-2000:]
        raise NemoSafeError(f"from_pretrained race: making {FILE_NAME} failed (exit {done.returncode}):\n{tail}")
    return TinyNemo(out.read_bytes(), json.loads(lines[-1])["weights"])


def _env() -> dict[str, str]:
    from nemo_safe.cluster_identity import without_launchers

    return {**without_launchers(os.environ), "PYTHONUNBUFFERED": "1"}


def run_member(url: str, side: Path, skew: float) -> dict[str, Any]:
    """One rank: import NeMo, wait for every rank in ``side``, sleep ``rank x skew`` s, then
    ``TinyModel.from_pretrained(MODEL_NAME)`` timed; nemo_safe is imported first (a no-op with NEMO_SAFE_DISABLE=1)."""
    import nemo_safe
    from nemo_safe import cluster_identity
    from nemo_safe_tools.demo import start_gate

    ident = cluster_identity.detect()
    os.environ[URL_ENV] = url
    cls = tiny_model_class()
    start_gate(side, ident.rank, ident.world_size, "imported")
    time.sleep(ident.rank * skew)
    result: dict[str, Any] = {"rank": ident.rank, "pid": os.getpid(), "status": "ok"}
    started = time.monotonic()
    try:
        result["weights"] = weights_digest(cls.from_pretrained(MODEL_NAME))
    except Exception as exc:
        result.update(status="error", error_type=type(exc).__name__, error=str(exc)[:2000])
    result["seconds"] = time.monotonic() - started
    result["nemo_safe"] = nemo_safe.active()
    return result


def run_ranks(
    ranks: int, url: str, cache: Path, side: Path, *, disable: bool, skew: float = 0.0, timeout: float = 900
) -> dict[int, dict[str, Any]]:
    """``ranks`` local processes with torchrun-style variables, each a :func:`run_member` with
    ``NEMO_CACHE_DIR=cache``; their results by rank. Each rank's output goes to ``side/rank.<r>.log`` (NeMo logs a
    lot: pipes read one after the other could fill and stall a downloader the others wait for)."""
    from nemo_safe.errors import NemoSafeError
    from nemo_safe_tools import demo, local_ranks

    side.mkdir(parents=True, exist_ok=True)
    env = local_ranks.job_env(
        ranks, {"NEMO_SAFE_DISABLE": "1" if disable else "0", "NEMO_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}
    )
    cmd = [sys.executable, "-m", MODULE, "member", "--url", url, "--side", str(side), "--skew", str(skew)]
    procs = []
    for rank in range(ranks):
        with open(side / f"rank.{rank}.log", "wb") as log:
            procs.append(subprocess.Popen(cmd, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                          stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = demo.read_results(side)
    missing = sorted(set(range(ranks)) - set(results))
    if missing:
        tail = (side / f"rank.{missing[0]}.log").read_text(errors="replace").strip().splitlines()[-8:]
        raise NemoSafeError(
            f"from_pretrained race: ranks {missing} of {ranks} wrote no result; rank {missing[0]}'s last lines:\n"
            + "\n".join(tail)
        )
    return results


@dataclass
class Outcome:
    """One variant's run: the results by rank and what the mirror served."""

    name: str
    results: dict[int, dict[str, Any]]
    expected: int
    weights: str
    downloads: int
    body_bytes: int
    model_bytes: int

    @property
    def failed(self) -> list[int]:
        return sorted(r for r, res in self.results.items() if res["status"] != "ok")

    @property
    def other_weights(self) -> list[int]:
        return sorted(r for r, res in self.results.items() if res["status"] == "ok" and res["weights"] != self.weights)

    def row(self) -> str:
        kinds = collections.Counter(self.results[r]["error_type"] for r in self.failed)
        why = ", ".join(f"{kind} x{count}" for kind, count in kinds.most_common())
        slowest = max((res["seconds"] for res in self.results.values()), default=float("nan"))
        return (
            f"| {self.name} | {len(self.failed)} of {self.expected}{f' ({why})' if why else ''} | "
            f"{len(self.other_weights)} | {self.downloads} | {self.body_bytes / self.model_bytes:.2f}x | "
            f"{slowest:.1f} |"
        )


def compare(workdir: Path, ranks: int, download_seconds: float, skew: float) -> list[Outcome]:
    """Upstream vs nemo_safe: the tiny ``.nemo`` made once, then each variant with a fresh ``NEMO_CACHE_DIR``
    against a fresh mirror throttled so that one download takes ``download_seconds``."""
    from nemo_safe_tools.loopback_mirror import LoopbackMirror

    model = make_tiny_nemo(workdir)
    outcomes = []
    for name, disable in (("upstream NeMo", True), ("with nemo_safe", False)):
        base = workdir / ("upstream" if disable else "nemo_safe")
        with LoopbackMirror({FILE_NAME: model.data}, rate=len(model.data) / download_seconds) as mirror:
            results = run_ranks(
                ranks, mirror.url + FILE_NAME, base / "cache", base / "side", disable=disable, skew=skew
            )
            stats = mirror.stats()[FILE_NAME]
        outcomes.append(Outcome(name, results, ranks, model.weights, stats.requests, stats.body_bytes, len(model.data)))
    return outcomes


def format_table(outcomes: list[Outcome], ranks: int, download_seconds: float, skew: float) -> str:
    size = outcomes[0].model_bytes / 1e6 if outcomes else 0.0
    return "\n".join(
        [
            f'nemo-safe demo: TinyModel.from_pretrained("{MODEL_NAME}") (a {size:.1f} MB .nemo registered as an NGC '
            f"model) on {ranks} local processes with torchrun-style variables and no torch.distributed, released "
            f"together after importing NeMo, rank i starting i x {skew:g} s later; loopback mirror throttled so one "
            f"download takes {download_seconds:g} s; a fresh NEMO_CACHE_DIR per variant.",
            "",
            "| variant | ranks that failed | ranks that restored other weights | downloads served "
            "| bytes served / .nemo | slowest rank in from_pretrained, s |",
            "|---|---|---|---|---|---|",
            *(o.row() for o in outcomes),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    sub = p.add_subparsers(dest="mode", required=True)
    make = sub.add_parser("make-nemo", help="save a fresh TinyModel as OUT and print its weights' digest")
    make.add_argument("out")
    make.add_argument("--width", type=int, default=DEFAULT_WIDTH)
    member = sub.add_parser("member", help="one rank of the race (torchrun-style variables)")
    member.add_argument("--url", required=True, help="the .nemo's URL on the mirror")
    member.add_argument("--side", required=True, help="the run's folder for the gate and the results")
    member.add_argument("--skew", type=float, default=0.0, help="rank i starts i x skew s after the others")
    args = p.parse_args(argv)
    if args.mode == "make-nemo":
        from omegaconf import OmegaConf

        model = tiny_model_class()(OmegaConf.create({"width": args.width}))
        model.save_to(args.out)
        print(json.dumps({"weights": weights_digest(model)}), flush=True)
        return 0
    from nemo_safe_tools.demo import write_result

    result = run_member(args.url, Path(args.side), args.skew)
    write_result(Path(args.side), result)
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    # Run as the module of that name, not as __main__: NeMo finds TinyModel by its module's name.
    from nemo_safe_tools.from_pretrained_race import main as _main

    sys.exit(_main())
