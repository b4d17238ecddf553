"""One rank of ``exp_manager_time.py``: exp_manager upstream, then with nemo_safe, timed.

All ranks line up at a start gate before each variant (after NeMo's slow
import) and then enter ``exp_manager`` at one common wall-clock instant: every
rank writes its arrival time, and once all N arrivals are there every rank
sleeps until the same instant (latest arrival + ``LEAD`` s), computed from the
same N files. (The earlier gate released each rank at its own next 50 ms poll
of the folder, a start skew of up to 50 ms that ended up in the "other ranks"
column; it is still passed first, to measure that skew.)

Timestamps (``time.time()``, one clock on this machine) are taken on the
benchmark side only: around ``exp_manager``, around the upstream PR's
``_check_resume_first`` and ``_wait_for_rank_zero`` and the ``check_resume``
they call, and at every read and write of ``state``; the library's code is not
changed. Appends one JSON line per variant to ``<side>/times.<rank>.jsonl``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nemo_safe
from nemo_safe.patches import nemo_resume_core, nemo_resume_upstream
from nemo_safe_tools import demo

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
#: Seconds between the last rank's arrival at the gate and the common start instant.
LEAD = 0.5

#: Events of the current variant: first start / last end of each timed function, every poll, every state written.
TRACE: dict[str, Any] = {}
#: The upstream PR's functions the overlay runs, timed where they find one another (plus the check_resume they call).
TIMED = ("_check_resume_first", "_wait_for_rank_zero", "check_resume")


def instrument() -> None:
    """Timestamp the upstream PR's functions the overlay runs (this process only; the library's code is unchanged).

    They call one another by name in the namespace ``nemo_resume_core.bind`` makes, so the timed versions go
    there; rank 0's state writes go through ``nemo_resume_upstream._write_resume_state``. Call this before
    nemo.utils.exp_manager is imported (that import patches it, and so binds the core).
    """

    def timed(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*a: Any, **k: Any) -> Any:
            TRACE.setdefault(f"{name}.start", time.time())
            try:
                return original(*a, **k)
            finally:
                TRACE[f"{name}.end"] = time.time()

        return wrapped

    def read_state(path: Path, _read: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
        before = time.time()
        state = _read(path)
        TRACE.setdefault("polls", []).append([before, time.time(), state.get("phase")])
        return state

    def bind(module: Any, check_resume: Any, _bind: Any = nemo_resume_core.bind) -> Any:
        order = _bind(module, check_resume)
        names = order.__wrapped__.__globals__  # the core's namespace
        for name in TIMED:
            names[name] = timed(name, names[name])
        names["_read_resume_state"] = functools.partial(read_state, _read=names["_read_resume_state"])
        return order

    def write_state(path: Path, state: dict[str, Any], _write: Any = nemo_resume_upstream._write_resume_state) -> None:
        _write(path, state)
        TRACE.setdefault("published", []).append([state.get("phase"), time.time()])

    nemo_resume_core.bind = bind  # type: ignore[assignment]
    nemo_resume_upstream._write_resume_state = write_state  # type: ignore[assignment]


def common_start(side: Path, rank: int, world: int, name: str, timeout: float = 900) -> float:
    """Wait until all ``world`` ranks arrived, then until one instant every rank computes alike."""
    tmp = side / f".{name}.{rank}"
    tmp.write_text(repr(time.time()))
    os.replace(tmp, side / f"{name}.{rank}")
    deadline = time.monotonic() + timeout
    while True:
        found = [p for p in side.iterdir() if p.name.startswith(name + ".")]
        if len(found) >= world:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"member: not all {world} ranks reached {name} within {timeout:.0f} s")
        time.sleep(0.01)
    start = max(float(p.read_text()) for p in found) + LEAD
    time.sleep(max(0.0, start - time.time()))
    return start


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--base", required=True)
    p.add_argument("--side", required=True)
    p.add_argument("--config", choices=sorted(CONFIGS), required=True)
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--nemo-safe-first", action="store_true", help="run the nemo_safe variant first")
    args = p.parse_args()
    instrument()
    import lightning.pytorch as pl
    import nemo.utils.exp_manager as exp_manager_module

    ident = nemo_safe.detect_identity()
    side = Path(args.side)
    order = ("nemo_safe", "upstream") if args.nemo_safe_first else ("upstream", "nemo_safe")
    for variant in order:
        if variant == "upstream":
            nemo_safe.unpatch()
        else:
            nemo_safe.patch()
        os.environ.pop("NEMO_EXPM_VERSION", None)
        trainer = pl.Trainer(**demo.cpu_trainer_kwargs(args.devices, args.nodes))
        cfg = {**CONFIGS[args.config](Path(args.base) / variant), "create_checkpoint_callback": False}
        demo.start_gate(side, ident.rank, ident.world_size, f"old.{variant}")
        old_gate = time.time()  # when the earlier (50 ms poll) gate let this rank go
        planned = common_start(side, ident.rank, ident.world_size, f"go.{variant}")
        TRACE.clear()
        enter = time.time()
        started, cpu = time.monotonic(), time.process_time()
        exp_manager_module.exp_manager(trainer, cfg)  # the module's: patched or not, as the variant says
        seconds, cpu = time.monotonic() - started, time.process_time() - cpu
        end = time.time()
        record = {
            "rank": ident.rank,
            "variant": variant,
            "seconds": seconds,
            "cpu": cpu,
            "old_gate": old_gate,
            "planned": planned,
            "enter": enter,
            "end": end,
            "trace": TRACE,
        }
        with open(side / f"times.{ident.rank}.jsonl", "a") as out:
            out.write(json.dumps(record) + "\n")
    demo.start_gate(side, ident.rank, ident.world_size, "end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
