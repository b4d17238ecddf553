"""One rank of a NeMo exp_manager job, run for real under srun (or with launcher variables).

Modes:
  race   exp_manager on a log_dir full of old files; rank 0 enters late. Non-zero
         ranks then watch log_dir (listdir + stat) until rank 0 is done, and report
         the old files they saw and the entries that vanished under them.
  train  exp_manager + a real two-step-per-epoch Lightning fit on CPU (gloo DDP),
         resuming from the last checkpoint when there is one.

``import nemo_safe`` happens first unless NEMO_SAFE_DISABLE=1 makes it a no-op
(the upstream twin). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import nemo_safe


def _gate(side: Path, rank: int, world: int, name: str) -> None:
    """Line all ranks up after their slow imports, so that the start skew is exactly what the test sets."""
    (side / f"{name}.{rank}").write_text("x")
    deadline = time.monotonic() + 600
    while len([p for p in side.iterdir() if p.name.startswith(name + ".")]) < world:
        if time.monotonic() > deadline:
            raise SystemExit(f"gate {name}: not all {world} ranks arrived")
        time.sleep(0.05)


def _watch(log_dir: Path, done: Path) -> tuple[int, int]:
    """List and stat log_dir until rank 0 is done: (old files seen, entries that vanished)."""
    old_seen, vanished = 0, 0
    final = False
    while True:
        finished = done.exists()
        names = os.listdir(log_dir)
        old_seen = max(old_seen, sum(1 for n in names if n.startswith("old_")))
        for n in names:
            try:
                os.stat(log_dir / n)
            except FileNotFoundError:
                vanished += 1
        if final:
            return old_seen, vanished
        final = finished
        time.sleep(0.02)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["race", "train"])
    p.add_argument("--log-dir", required=True)
    p.add_argument("--side", required=True, help="a shared directory outside log_dir for test bookkeeping")
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--rank0-delay", type=float, default=0.0)
    p.add_argument("--max-steps", type=int, default=2)
    p.add_argument("--die-rank", type=int, help="this rank exits before exp_manager (a task that died)")
    args = p.parse_args()

    import lightning.pytorch as pl
    import torch
    from nemo.utils.exp_manager import exp_manager

    ident = nemo_safe.detect_identity()
    rank = ident.rank
    side, log_dir = Path(args.side), Path(args.log_dir)
    result: dict = {"rank": rank, "status": "ok"}
    trainer_kwargs = dict(
        devices=args.devices,
        num_nodes=args.nodes,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    cfg: dict = {
        "explicit_log_dir": str(log_dir),
        "resume_if_exists": True,
        "resume_ignore_no_checkpoint": True,
        "create_tensorboard_logger": False,
    }
    if args.mode == "race":
        trainer = pl.Trainer(**trainer_kwargs)
        cfg["create_checkpoint_callback"] = False
    else:
        trainer = pl.Trainer(strategy="ddp", max_steps=args.max_steps, **trainer_kwargs)
        cfg["checkpoint_callback_params"] = {
            "monitor": "step",
            "mode": "max",
            "save_top_k": 1,
            "save_last": True,
            "save_nemo_on_train_end": False,
            "always_save_nemo": False,
        }
    _gate(side, rank, ident.world_size, "imported")
    if args.die_rank == rank:
        os._exit(17)
    if rank == 0:
        time.sleep(args.rank0_delay)
    started = time.monotonic()
    try:
        exp_manager(trainer, cfg)
    except Exception as exc:
        import traceback

        traceback.print_exc()
        result.update(status="error", error_type=type(exc).__name__, error=str(exc)[:2000])
        print(json.dumps(result), flush=True)
        return 3
    result["exp_manager_seconds"] = time.monotonic() - started
    result["ckpt_path"] = str(trainer.ckpt_path) if trainer.ckpt_path else None
    if args.mode == "race":
        if rank == 0:
            (side / "rank0_done").write_text("x")
        else:
            result["old_seen"], result["vanished"] = _watch(log_dir, side / "rank0_done")
    else:

        class Tiny(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.layer = torch.nn.Linear(4, 1)

            def training_step(self, batch, batch_idx):
                return self.layer(batch[0]).pow(2).mean()

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.01)

        torch.manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(64, 4))
        trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
        result["global_step"] = trainer.global_step
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
