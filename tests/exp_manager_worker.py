"""One rank of the exp_manager configuration matrix, started by a real launcher (torchrun, srun).

Runs the named cases one after the other, each twice: first upstream NeMo
(``nemo_safe.unpatch()``), then with nemo_safe (``nemo_safe.patch()``), every
case in its own directory under ``--base``. All ranks line up at a start gate
(in ``--side``, outside ``--base``) before each run, so the skew is exactly the
one a case asks for. Appends one JSON line per run to ``--side/results.<round>.<rank>.jsonl``:
``{"case", "variant", "rank", "status", "log_dir", "seconds", ...}``.

A rank given ``--die-once-rank R`` exits with status 1 after the first round's
runs when it is rank R and ``--side/died`` does not exist yet (a worker failure
that makes torchrun restart the whole group); the next round runs again.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nemo_safe
from nemo_safe import detect_identity
from nemo_safe_tools import demo

OLD_FILES = 500
RANK0_LATE = 6.0  # longer than exp_manager's seconds_to_sleep (5 s): upstream then races by construction
QUIET = {"create_tensorboard_logger": False, "create_checkpoint_callback": False}


@dataclass(frozen=True)
class Case:
    cfg: dict[str, Any]  # exp_manager cfg; "{d}" stands for the case's directory
    old_run: bool = False  # log_dir holds the files of an earlier run and a last checkpoint
    rank0_late: bool = False  # rank 0 enters exp_manager RANK0_LATE s after the others
    trainer_logger: bool = False  # the Trainer comes with its own TensorBoardLogger (exp_dir and name unset)


RESUME = {"resume_if_exists": True, "resume_ignore_no_checkpoint": True, **QUIET}
RESUME_STRICT = {**RESUME, "resume_ignore_no_checkpoint": False}
CASES: dict[str, Case] = {
    "defaults": Case({"exp_dir": "{d}", "name": "exp", **QUIET}),
    "tensorboard_version_n": Case({"exp_dir": "{d}", "name": "exp", "use_datetime_version": False, **QUIET}),
    "tensorboard_and_checkpoints": Case({"exp_dir": "{d}", "name": "exp"}),
    "trainer_logger": Case(dict(QUIET), trainer_logger=True),
    "version_given": Case({"exp_dir": "{d}", "name": "exp", "version": "v1", **QUIET}),
    "resume_explicit": Case({"explicit_log_dir": "{d}/log", **RESUME}, old_run=True),
    "resume_explicit_rank0_late": Case({"explicit_log_dir": "{d}/log", **RESUME}, old_run=True, rank0_late=True),
    "resume_exp_dir_rank0_late": Case({"exp_dir": "{d}", "name": "exp", **RESUME}, old_run=True, rank0_late=True),
    "resume_no_checkpoint_strict": Case({"explicit_log_dir": "{d}/log", **RESUME_STRICT}),
    "resume_no_checkpoint_ignored": Case({"explicit_log_dir": "{d}/log", **RESUME}),
}


def case_dir(base: Path, case: str, variant: str) -> Path:
    return base / f"{case}.{variant}"


def old_files_dir(base: Path, case: str, variant: str) -> Path:
    """Where a case keeps the files of an earlier run (log_dir as the resuming job computes it)."""
    cfg = CASES[case].cfg
    d = case_dir(base, case, variant)
    return d / "log" if "explicit_log_dir" in cfg else d / "exp"


def run_case(case: str, variant: str, args: argparse.Namespace, ident: Any) -> dict[str, Any]:
    from nemo.utils.exp_manager import exp_manager

    from nemo_safe_tools.demo import nemo_lightning

    pl = nemo_lightning()
    TensorBoardLogger = pl.loggers.TensorBoardLogger

    spec = CASES[case]
    base, side = Path(args.base), Path(args.side)
    d = case_dir(base, case, variant)
    cfg = {k: v.format(d=d) if isinstance(v, str) else v for k, v in spec.cfg.items()}
    os.environ.pop("NEMO_EXPM_VERSION", None)  # rank 0's choice of an earlier case must not carry over
    logger: Any = TensorBoardLogger(save_dir=str(d), name="exp") if spec.trainer_logger else False
    trainer = pl.Trainer(**{**demo.cpu_trainer_kwargs(args.devices, args.nodes), "logger": logger})
    tag = f"{args.round}.{case}.{variant}"
    demo.start_gate(side, ident.rank, ident.world_size, tag + ".go")
    if spec.rank0_late and ident.rank == 0:
        time.sleep(RANK0_LATE)
    result: dict[str, Any] = {"case": case, "variant": variant, "rank": ident.rank, "round": args.round}
    result["restart_count"] = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    result["node"] = ident.node_rank
    started = time.monotonic()
    try:
        log_dir = exp_manager(trainer, cfg)
        result.update(status="ok", log_dir=str(log_dir))
    except Exception as exc:
        result.update(status="error", error_type=type(exc).__name__, error=str(exc)[:1500])
    result["seconds"] = time.monotonic() - started
    done = side / f"{tag}.rank0_done"
    if ident.rank == 0:
        done.write_text("x")
    elif result["status"] == "ok" and spec.old_run:
        log_dir = Path(result["log_dir"])
        (log_dir / f"current_run_rank{ident.rank}.txt").write_text("written by this run\n")
        result["old_seen"], result["vanished"] = demo.watch_log_dir(log_dir, done)
    _reset_nemo_logging()
    return result


def _reset_nemo_logging() -> None:
    """exp_manager adds file handlers to NeMo's logger; the next case must not write into this one's log_dir."""
    import logging as std_logging

    for name in ("nemo_logger", "lightning.pytorch", "pytorch_lightning"):
        logger = std_logging.getLogger(name)
        for handler in list(logger.handlers):
            if isinstance(handler, std_logging.FileHandler):
                logger.removeHandler(handler)
                handler.close()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--base", required=True)
    p.add_argument("--side", required=True)
    p.add_argument("--cases", required=True, help="comma-separated names of CASES")
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--variants", default="upstream,nemo_safe")
    p.add_argument("--die-once-rank", type=int)
    args = p.parse_args()
    ident = detect_identity()
    side = Path(args.side)
    args.round = "r2" if (side / "died").exists() else "r1"
    if args.round == "r2" and ident.rank == 0:
        # The restarted round resumes on old files again (besides the first round's own files).
        for case in args.cases.split(","):
            for variant in args.variants.split(","):
                if CASES[case].old_run:
                    demo.make_old_log_dir(old_files_dir(Path(args.base), case, variant), OLD_FILES)
    for case in args.cases.split(","):
        for variant in args.variants.split(","):
            if variant == "upstream":
                nemo_safe.unpatch()
            else:
                nemo_safe.patch()
            result = json.dumps(run_case(case, variant, args, ident))
            with open(side / f"results.{args.round}.{ident.rank}.jsonl", "a") as out:
                out.write(result + "\n")  # a file per rank: srun may split long lines of 8 tasks
    if args.die_once_rank == ident.rank and args.round == "r1":
        (side / "died").write_text(str(os.getpid()))
        return 1
    # As in a real job, no process ends while another is still starting up.
    demo.start_gate(side, ident.rank, ident.world_size, f"{args.round}.end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
