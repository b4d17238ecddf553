"""One rank of ``exp_manager_time.py``: exp_manager upstream, then with nemo_safe, timed.

All ranks line up at a start gate before each variant (after NeMo's slow
import), so every rank enters ``exp_manager`` at the same instant. Appends one
JSON line per variant to ``<side>/times.<rank>.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import nemo_safe
from nemo_safe import demo

CONFIGS = {
    # NeMo's defaults (a dated version picked by rank 0), as in most recipes.
    "defaults": lambda d: {"exp_dir": str(d), "name": "exp"},
    # A resuming job whose log_dir holds the files of an earlier run.
    "resume": lambda d: {
        "explicit_log_dir": str(d / "log"),
        "resume_if_exists": True,
        "resume_ignore_no_checkpoint": True,
    },
}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--base", required=True)
    p.add_argument("--side", required=True)
    p.add_argument("--config", choices=sorted(CONFIGS), required=True)
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--nodes", type=int, required=True)
    args = p.parse_args()
    import lightning.pytorch as pl
    from nemo.utils.exp_manager import exp_manager

    ident = nemo_safe.detect_identity()
    side = Path(args.side)
    for variant in ("upstream", "nemo_safe"):
        if variant == "upstream":
            nemo_safe.unpatch()
        else:
            nemo_safe.patch()
        os.environ.pop("NEMO_EXPM_VERSION", None)
        trainer = pl.Trainer(**demo.cpu_trainer_kwargs(args.devices, args.nodes))
        cfg = {**CONFIGS[args.config](Path(args.base) / variant), "create_checkpoint_callback": False}
        demo.start_gate(side, ident.rank, ident.world_size, f"go.{variant}")
        started = time.monotonic()
        exp_manager(trainer, cfg)
        seconds = time.monotonic() - started
        with open(side / f"times.{ident.rank}.jsonl", "a") as out:
            out.write(json.dumps({"rank": ident.rank, "variant": variant, "seconds": seconds}) + "\n")
    demo.start_gate(side, ident.rank, ident.world_size, "end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
