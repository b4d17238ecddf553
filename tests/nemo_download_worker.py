"""One process of a NeMo download race: real NeMo, a loopback mirror, no torch.distributed (model construction).

    python tests/nemo_download_worker.py make-nemo OUT        # a small real .nemo file (TinyModel)
    python tests/nemo_download_worker.py ngc --url URL --gate DIR [--refresh] [--nemo-first]
    python tests/nemo_download_worker.py megatron --mirror URL --gate DIR [--nemo-first]

``ngc``: ``TinyModel.from_pretrained("tiny_test_model")``, registered as an NGC model at ``--url``
(``ModelPT.from_pretrained`` -> ``maybe_download_from_cloud``), then a digest of its weights.
``megatron``: ``get_megatron_vocab_file`` / ``get_megatron_merges_file`` of megatron-gpt-345m with the
URL map pointed at the mirror (the test's change, not the code under test's). Every process imports
NeMo first and then waits in ``--gate`` (all start together; ``--delay`` skews one). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

from nemo_safe_tools.from_pretrained_race import MODEL_NAME, tiny_model_class  # TinyModel: the demo's, the benchmark's


def _gate(directory: str, index: int, delay: float) -> None:
    Path(directory, f"ready.{index}").touch()
    while not Path(directory, "go").exists():
        time.sleep(0.01)
    time.sleep(delay)


def _digest(path: str | None) -> str | None:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path and os.path.isfile(path) else None


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["make-nemo", "ngc", "megatron"])
    p.add_argument("out", nargs="?")
    p.add_argument("--url", help="ngc: the model's URL")
    p.add_argument("--mirror", help="megatron: the mirror's base URL")
    p.add_argument("--gate")
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--refresh", action="store_true")
    p.add_argument("--nemo-first", action="store_true", help="import NeMo's modules before nemo_safe")
    args = p.parse_args()
    if args.nemo_first:  # a user's script that imports NeMo, then nemo_safe: the bound names are rebound
        import nemo.collections.common.tokenizers.megatron_utils
        import nemo.core.classes.common  # noqa: F401
    import nemo_safe

    if args.mode == "make-nemo":
        from omegaconf import OmegaConf

        tiny_model_class()(OmegaConf.create({})).save_to(args.out)
        return 0
    result: dict = {"index": args.index, "pid": os.getpid(), "status": "ok"}
    if args.mode == "ngc":
        os.environ["TINY_MODEL_URL"] = args.url
        cls = tiny_model_class()
        _gate(args.gate, args.index, args.delay)
        try:
            model = cls.from_pretrained(MODEL_NAME, refresh_cache=args.refresh)
            weights = model.layer.weight.detach().numpy().tobytes()
            result["weights"] = hashlib.sha256(weights).hexdigest()
        except Exception as exc:
            result.update(status="error", error_type=type(exc).__name__, error=str(exc)[:500])
    else:
        from nemo.collections.common.tokenizers import megatron_utils

        entry = megatron_utils.MEGATRON_CONFIG_MAP["megatron-gpt-345m"]
        entry["vocab"], entry["merges_file"] = args.mirror + "gpt2-vocab.json", args.mirror + "gpt2-merges.txt"
        _gate(args.gate, args.index, args.delay)
        try:
            vocab = megatron_utils.get_megatron_vocab_file("megatron-gpt-345m")
            merges = megatron_utils.get_megatron_merges_file("megatron-gpt-345m")
            result.update(vocab=_digest(vocab), merges=_digest(merges))
        except Exception as exc:
            result.update(status="error", error_type=type(exc).__name__, error=str(exc)[:500])
    result["nemo_safe"] = nemo_safe.active()
    print(json.dumps(result), flush=True)
    return 0 if result["status"] == "ok" else 4


if __name__ == "__main__":
    sys.exit(main())
