"""NeMo 2.x's other start-up path, NeMoLogger + AutoResume, measured with real processes.

Three sub-commands (only ``train`` imports NeMo):

``prepare --log-dir D [--old-files N] [--old-log-ranks 1,0]``
    fills ``D`` with an earlier run's files: ``N`` plain files plus
    ``nemo_log_globalrank-R_localrank-R.txt`` (content ``OLD RUN``) for each listed rank.

``train --log-dir D --tag T --side S [--late-rank R --late-seconds X] [--explicit] [--no-resume]
[--bad-log-dir-rank B] [--no-agent-store]``
    one rank, started by ``torchrun --nproc-per-node W``. ``import nemo_safe`` comes first
    (``NEMO_SAFE_DISABLE=1`` gives upstream). A ``nemo.lightning.Trainer`` (CPU, DDP over gloo,
    ``devices=W``, 2 steps of a tiny module), ``NeMoLogger(log_dir=parent(D), name=basename(D))``
    (``explicit_log_dir=D`` with ``--explicit``) carrying NeMo's own ``ModelCheckpoint``, and
    ``AutoResume(resume_if_exists=True, resume_ignore_no_checkpoint=True)`` (``False`` with
    ``--no-resume``: rank 0 then logs into a dated version below ``D``; rank ``B`` gets an
    ``explicit_log_dir`` below a regular file, so its ``setup`` fails in NeMo's ``os.makedirs``;
    ``--no-agent-store`` hides ``TORCHELASTIC_USE_AGENT_STORE`` during ``log.setup``, so ranks meet in
    ``log_dir``'s hidden ``.nemo_safe/``, as under srun), set up as
    ``nemo.collections.llm.api._setup`` does: ``log.setup(trainer, resume_if_exists=True)`` then
    ``resume.setup(trainer, model)``, then ``trainer.fit``. Rank ``R`` sleeps ``X`` s before
    ``log.setup`` (the others do not), which orders the ranks' start-up deterministically.
    Every rank logs ``CURRENT RUN T rank r phase p`` through NeMo's logging after setup, in
    each training step and after fit, and writes ``S/rank<r>.json``: the files its setup
    listed for moving, the path its open nemo_log file has after fit (read from
    ``/proc/self/fd``, so a renamed file shows its new name), and any exception.

``inspect --log-dir D --tag T``
    prints one JSON line: the files left in ``D``, the files of each ``run_*``, and for each
    rank every file that holds its current-run lines.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path


def log_name(rank: int) -> str:
    return f"nemo_log_globalrank-{rank}_localrank-{rank}.txt"  # one node: local rank == global rank


def prepare(args: argparse.Namespace) -> None:
    d = Path(args.log_dir)
    d.mkdir(parents=True, exist_ok=True)
    for i in range(args.old_files):
        (d / f"old_{i:03d}.txt").write_text(f"OLD RUN file {i}\n")
    for r in (int(x) for x in args.old_log_ranks.split(",") if x):
        (d / log_name(r)).write_text(f"OLD RUN rank {r}\n")
    (d / "cmd-args.log").write_text("OLD RUN cmd args\n")


def inspect(args: argparse.Namespace) -> dict:
    d = Path(args.log_dir)
    marker = f"CURRENT RUN {args.tag} rank "
    top = sorted(p.name for p in d.iterdir() if p.is_file())
    runs = {p.name: sorted(f.name for f in p.iterdir()) for p in sorted(d.glob("run_*")) if p.is_dir()}
    current: dict[str, list[str]] = {}
    for f in [p for p in d.iterdir() if p.is_file()] + [f for p in d.glob("run_*") for f in p.iterdir()]:
        text = f.read_text(errors="replace")
        for line in text.splitlines():
            if marker in line:
                rank = line.split(marker, 1)[1].split()[0]
                current.setdefault(rank, [])
                rel = str(f.relative_to(d))
                if rel not in current[rank]:
                    current[rank].append(rel)
    archived_current = sorted({p for paths in current.values() for p in paths if p.startswith("run_")})
    return {"top": top, "runs": runs, "current_lines_in": current, "archived_current": archived_current}


def train(args: argparse.Namespace) -> None:
    import nemo_safe  # first, as a user would; NEMO_SAFE_DISABLE=1 leaves NeMo as upstream

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    result: dict = {"rank": rank, "nemo_safe_disabled": nemo_safe.patching.disabled_by_env(), "exception": None}
    try:
        _train(args, rank, world, result)
    except BaseException:
        result["exception"] = traceback.format_exc()
        raise
    finally:
        Path(args.side).mkdir(parents=True, exist_ok=True)
        Path(args.side, f"rank{rank}.json").write_text(json.dumps(result))


def _train(args: argparse.Namespace, rank: int, world: int, result: dict) -> None:
    import torch
    from nemo import lightning as nl
    from nemo.lightning import nemo_logger

    pl = nemo_logger.pl  # the Lightning this NeMo's nemo.lightning is written against (pytorch_lightning in 2.0)
    DDPStrategy = pl.strategies.DDPStrategy
    from nemo.lightning.pytorch.callbacks import ModelCheckpoint
    from nemo.utils import logging

    import nemo_safe

    tag = args.tag
    try:
        nemo_logger.lcp.LocalCheckpointCallback  # noqa: B018
    except Exception:
        # Without nvidia_resiliency_ext, NeMoLogger._setup_trainer_model_checkpoint fails on its
        # ``isinstance(callback, lcp.LocalCheckpointCallback)`` (an UnavailableError placeholder)
        # for any trainer holding a ModelCheckpoint. A class nothing is an instance of gives exactly
        # what NeMo does with the package installed and no local-checkpoint callback in use.
        nemo_logger.lcp = type("lcp", (), {"LocalCheckpointCallback": type("LocalCheckpointCallback", (), {})})
        result["lcp_placeholder"] = True

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            logging.info(f"CURRENT RUN {tag} rank {rank} phase step{batch_idx}")
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
            return torch.utils.data.DataLoader(data, batch_size=4)

    trainer = nl.Trainer(
        accelerator="cpu",
        devices=world,
        num_nodes=1,
        strategy=DDPStrategy(process_group_backend="gloo"),
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    ckpt = ModelCheckpoint(
        monitor=None, save_last=False, save_top_k=0, always_save_context=False, save_context_on_train_end=False
    )
    d = Path(args.log_dir)
    if rank == args.bad_log_dir_rank:  # a log dir below a regular file: NeMo's os.makedirs fails there
        (d.parent / "blocker").write_text("a file, not a directory\n")
        log = nl.NeMoLogger(explicit_log_dir=str(d.parent / "blocker" / "sub"), ckpt=ckpt)
    elif args.explicit:
        log = nl.NeMoLogger(explicit_log_dir=str(d), ckpt=ckpt)
    else:
        log = nl.NeMoLogger(log_dir=str(d.parent), name=d.name, ckpt=ckpt)
    resume = nl.AutoResume(resume_if_exists=not args.no_resume, resume_ignore_no_checkpoint=True)
    model = Tiny()

    if rank == args.late_rank:
        time.sleep(args.late_seconds)
    # As nemo.collections.llm.api._setup: NeMoLogger.setup, then AutoResume.setup.
    agent_store = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None) if args.no_agent_store else None
    result["setup_start"] = time.time()
    try:
        app_state = log.setup(trainer, resume_if_exists=resume.resume_if_exists)
    finally:
        if agent_store is not None:  # init_process_group in fit() needs it back
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = agent_store
    result["setup_done"] = time.time()
    result["log_dir"] = str(app_state.log_dir)
    result["files_to_move"] = sorted(Path(p).name for p in app_state.files_to_move)
    resume.setup(trainer, model)
    result["callbacks"] = [type(cb).__module__ + "." + type(cb).__name__ for cb in trainer.callbacks]
    logging.info(f"CURRENT RUN {tag} rank {rank} phase setup")
    trainer.fit(model)
    logging.info(f"CURRENT RUN {tag} rank {rank} phase after_fit")
    handler = logging._handlers.get("file")
    if handler is not None and handler.stream is not None:
        handler.flush()
        result["log_file_opened_as"] = handler.baseFilename
        result["log_file_now"] = os.readlink(f"/proc/self/fd/{handler.stream.fileno()}")
    result["nemo_safe_active"] = nemo_safe.active()  # after fit: exp_manager has been imported by then


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare")
    pp.add_argument("--log-dir", required=True)
    pp.add_argument("--old-files", type=int, default=50)
    pp.add_argument("--old-log-ranks", default="1", help="comma-separated ranks with an old nemo_log file")
    pt = sub.add_parser("train")
    pt.add_argument("--log-dir", required=True)
    pt.add_argument("--tag", required=True)
    pt.add_argument("--side", required=True, help="where each rank writes rank<r>.json")
    pt.add_argument("--late-rank", type=int, default=-1)
    pt.add_argument("--late-seconds", type=float, default=0.0)
    pt.add_argument("--explicit", action="store_true", help="NeMoLogger(explicit_log_dir=...)")
    pt.add_argument("--no-resume", action="store_true", help="AutoResume(resume_if_exists=False)")
    pt.add_argument("--no-agent-store", action="store_true", help="hide torchrun's agent store during setup")
    pt.add_argument("--bad-log-dir-rank", type=int, default=-1, help="this rank's log dir cannot be created")
    pi = sub.add_parser("inspect")
    pi.add_argument("--log-dir", required=True)
    pi.add_argument("--tag", required=True)
    args = p.parse_args()
    if args.cmd == "prepare":
        prepare(args)
    elif args.cmd == "train":
        train(args)
    else:
        print(json.dumps(inspect(args)))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
