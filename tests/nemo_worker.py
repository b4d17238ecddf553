"""One rank of a NeMo exp_manager job, run for real under srun (or with launcher variables).

Modes:
  race   the member of ``nemo-safe demo``: exp_manager on a log_dir full of old
         files, rank 0 entering late; non-zero ranks then watch log_dir (listdir +
         stat) until rank 0 is done and report old files seen and entries vanished.
  train  exp_manager + a real two-step-per-epoch Lightning fit on CPU (gloo DDP),
         resuming from the last checkpoint when there is one.

``import nemo_safe`` happens first unless NEMO_SAFE_DISABLE=1 makes it a no-op
(the upstream twin). Writes its result to ``--side`` (see ``demo.write_result``) and, in train
mode, also prints it as one JSON line.
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
    p.add_argument("mode", choices=["race", "train"])
    p.add_argument("--log-dir", required=True)
    p.add_argument("--side", required=True, help="a shared directory outside log_dir for test bookkeeping")
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--rank0-delay", type=float, default=0.0)
    p.add_argument("--max-steps", type=int, default=2)
    p.add_argument("--die-rank", type=int, help="this rank exits after its imports, before exp_manager")
    args = p.parse_args()
    ident = nemo_safe.detect_identity()
    side, log_dir = Path(args.side), Path(args.log_dir)

    if args.mode == "race":
        # The same member as `nemo-safe demo`; the tests check its report and the files independently.
        from nemo_safe_tools import demo

        if args.die_rank == ident.rank:
            import nemo.utils.exp_manager  # noqa: F401  (die after the same slow imports as the others)

            demo.start_gate(side, ident.rank, ident.world_size, "imported")
            os._exit(17)
        result = demo.run_member(log_dir, side, args.devices, args.nodes, args.rank0_delay)
        demo.write_result(side, result)
        return 0 if result["status"] == "ok" else 3

    import torch
    from nemo.utils.exp_manager import exp_manager

    from nemo_safe_tools import demo

    pl = demo.nemo_lightning()

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    from nemo_safe_tools.demo import cpu_trainer_kwargs, resume_cfg, write_result

    trainer = pl.Trainer(strategy="ddp", max_steps=args.max_steps, **cpu_trainer_kwargs(args.devices, args.nodes))
    checkpointing = {
        "monitor": "step",
        "mode": "max",
        "save_top_k": 1,
        "save_last": True,
        "save_nemo_on_train_end": False,
        "always_save_nemo": False,
    }
    cfg = {**resume_cfg(log_dir), "checkpoint_callback_params": checkpointing}
    result: dict = {"rank": ident.rank, "status": "ok"}
    started = time.monotonic()
    try:
        exp_manager(trainer, cfg)
    except Exception as exc:
        result.update(status="error", error_type=type(exc).__name__, error=str(exc)[:2000])
        write_result(side, result)
        print(json.dumps(result), flush=True)
        return 3
    result["exp_manager_seconds"] = time.monotonic() - started
    result["ckpt_path"] = str(trainer.ckpt_path) if trainer.ckpt_path else None
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4))
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
    result["global_step"] = trainer.global_step
    write_result(side, result)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
