"""One rank's one ``exp_manager`` call with the real NeMo, for the corner cases of issue 21.

Started with launcher variables (srun-style) by tests/test_nemo_corners.py; ``NEMO_SAFE_DISABLE=1`` makes
``import nemo_safe`` a no-op (the upstream twin). Prints one JSON line: status, error, seconds in
exp_manager, log_dir and how many of the earlier run's files it still holds. Exit status 0 when exp_manager
returned, 1 when it raised (a retry wrapper's cue).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import nemo_safe


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--exp-dir", required=True, help="exp_dir (odd ranks: --exp-dir-odd if given)")
    p.add_argument("--exp-dir-odd")
    p.add_argument("--exp-dir-zero", help="rank 0's exp_dir, if given")
    p.add_argument("--explicit-log-dir", action="store_true", help="use <exp-dir>/log as explicit_log_dir")
    p.add_argument("--resume", choices=["none", "strict", "lenient"], default="none")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--delay", type=float, default=0.0, help="seconds to sleep before exp_manager (start skew)")
    p.add_argument("--gate", help="a folder: after its imports each rank waits there for every rank's (start gate)")
    p.add_argument("--no-logging-config", action="store_true", help="configure no logging (as most scripts)")
    args = p.parse_args()
    import logging

    if not args.no_logging_config:
        logging.basicConfig(format="%(asctime)s %(process)d %(name)s %(message)s")
        logging.getLogger("nemo_safe").setLevel(logging.DEBUG)

    from nemo.utils.exp_manager import exp_manager

    from nemo_safe_tools import demo

    pl = demo.nemo_lightning()

    ident = nemo_safe.detect_identity()
    exp_dir = args.exp_dir_odd if (args.exp_dir_odd and ident.rank % 2) else args.exp_dir
    exp_dir = args.exp_dir_zero if (args.exp_dir_zero and ident.rank == 0) else exp_dir
    cfg: dict = {"create_tensorboard_logger": False, "create_checkpoint_callback": False}
    cfg.update({"explicit_log_dir": f"{exp_dir}/log"} if args.explicit_log_dir else {"exp_dir": exp_dir, "name": "exp"})
    if args.resume != "none":
        cfg.update(resume_if_exists=True, resume_ignore_no_checkpoint=args.resume == "lenient")
    trainer = pl.Trainer(**demo.cpu_trainer_kwargs(1, args.nodes))
    result: dict = {"rank": ident.rank, "pid": os.getpid(), "ppid": os.getppid(), "patched": bool(nemo_safe.active())}
    if args.gate:
        demo.start_gate(Path(args.gate), ident.rank, ident.world_size, "imported", timeout=240)
    time.sleep(args.delay)
    started = time.monotonic()
    try:
        log_dir = exp_manager(trainer, cfg)
        # The earlier run's files this rank still sees when exp_manager returns (rank 0 moves them into run_0).
        old_seen = sum(1 for name in os.listdir(log_dir) if name.startswith(demo.OLD_PREFIX))
        result.update(status="ok", log_dir=str(log_dir), old_seen=old_seen)
    except Exception as exc:
        result.update(status="error", error_type=type(exc).__name__, error=str(exc)[:1500])
    result["seconds"] = time.monotonic() - started
    print(json.dumps(result), flush=True)
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
