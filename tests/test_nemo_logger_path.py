"""NeMo 2.x's NeMoLogger + AutoResume start-up path, upstream behaviour measured (docs/nemo.md).

One real ``torchrun --nproc-per-node 3`` job of tests/nemo_logger_worker.py (NeMo's Trainer on
CPU, DDP over gloo, NeMoLogger with NeMo's ModelCheckpoint, AutoResume(resume_if_exists=True)),
``NEMO_SAFE_DISABLE=1``, on a log_dir that holds an earlier run: 50 files, ``cmd-args.log`` and
rank 1's ``nemo_log_globalrank-1_localrank-1.txt``. Rank 0 enters ``NeMoLogger.setup`` 3 s late.

What upstream does (nemo_safe does not patch this path; the nemo_safe twin looked the same):

* rank 1 appends its current-run log to the earlier run's file (``logging.FileHandler``, mode
  ``a``), which rank 0 lists in its own ``setup`` and moves into ``run_0`` in
  ``ModelCheckpoint.on_train_start``: all of rank 1's current-run lines end in ``run_0``, whatever
  the timing;
* rank 2 (no earlier file) creates its log in its ``setup`` before rank 0 lists ``log_dir``: that
  fresh file of the current run is moved into ``run_0`` too (the race: no barrier orders the
  ranks' ``setup`` calls; here the 3 s make it deterministic);
* both ranks keep writing into the moved files; ``log_dir`` is left with no log of rank 1 or 2.

Skipped where ``nemo.lightning.NeMoLogger`` does not exist (NeMo 3.0 removed it). Run it with
the NeMo 2.x venv: ``.venv-nemo273/bin/python -m pytest tests/test_nemo_logger_path.py``.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from procs import clean_env

WORKER = str(Path(__file__).resolve().parent / "nemo_logger_worker.py")
HANG_GUARD = 180  # 3 NeMo imports on 2 cores take ~30 s; 180 s is a hang
OLD_FILES = 50
LATE = 3.0


def _nemo_logger_source() -> Path | None:
    """nemo/lightning/nemo_logger.py of the installed NeMo, found without importing NeMo (~8 s)."""
    spec = importlib.util.find_spec("nemo")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "lightning" / "nemo_logger.py"
    return path if path.is_file() else None


pytestmark = pytest.mark.skipif(
    _nemo_logger_source() is None,
    reason="nemo.lightning.NeMoLogger is not available (NeMo 3.0 removed it; it exists in NeMo 2.0-2.7)",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nemo_logger_archives_current_run_logs_upstream(tmp_path: Path) -> None:
    log_dir, side = tmp_path / "exp" / "default", tmp_path / "side"
    tag = "t1"
    prepare = [sys.executable, WORKER, "prepare", "--log-dir", str(log_dir), "--old-files", str(OLD_FILES)]
    subprocess.run([*prepare, "--old-log-ranks", "1"], check=True, timeout=60)
    port = free_port()
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "3", "--master-port", str(port)]
    cmd += [WORKER, "train", "--log-dir", str(log_dir), "--tag", tag, "--side", str(side)]
    cmd += ["--late-rank", "0", "--late-seconds", str(LATE)]
    env = clean_env(NEMO_SAFE_DISABLE="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_GUARD)
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = {r: json.loads((side / f"rank{r}.json").read_text()) for r in range(3)}
    for r, res in ranks.items():
        assert res["exception"] is None, res["exception"]
        assert res["nemo_safe_disabled"] and res["nemo_safe_active"] == [], r
        assert res["callbacks"] == ["nemo.lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint"]
        assert res["log_dir"] == str(log_dir)
    found = json.loads(
        subprocess.run(
            [sys.executable, WORKER, "inspect", "--log-dir", str(log_dir), "--tag", tag],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    )
    log1, log2 = "nemo_log_globalrank-1_localrank-1.txt", "nemo_log_globalrank-2_localrank-2.txt"

    # Rank 0 listed rank 2's fresh log (created by this run before rank 0's late setup) for moving.
    assert log2 in ranks[0]["files_to_move"]
    # Exactly one run_N: the earlier run's files plus rank 1's and rank 2's logs of this run.
    assert list(found["runs"]) == ["run_0"]
    old = sorted([f"old_{i:03d}.txt" for i in range(OLD_FILES)] + ["cmd-args.log"])
    assert found["runs"]["run_0"] == sorted([*old, log1, log2])
    assert found["archived_current"] == [f"run_0/{log1}", f"run_0/{log2}"]
    assert found["current_lines_in"] == {
        "0": ["nemo_log_globalrank-0_localrank-0.txt"],
        "1": [f"run_0/{log1}"],
        "2": [f"run_0/{log2}"],
    }
    # log_dir keeps rank 0's files of this run and no log of rank 1 or 2.
    assert log1 not in found["top"] and log2 not in found["top"]
    assert {"nemo_log_globalrank-0_localrank-0.txt", "cmd-args.log", "lightning_logs.txt"} <= set(found["top"])
    # Ranks 1 and 2 wrote into the moved files until the end (the open descriptor followed the rename).
    assert ranks[1]["log_file_now"] == str(log_dir / "run_0" / log1)
    assert ranks[2]["log_file_now"] == str(log_dir / "run_0" / log2)
    assert ranks[0]["log_file_now"] == str(log_dir / "nemo_log_globalrank-0_localrank-0.txt")
    moved1 = (log_dir / "run_0" / log1).read_text()
    assert moved1.startswith("OLD RUN rank 1\n")
    for phase in ("setup", "step0", "step1", "after_fit"):
        assert f"CURRENT RUN {tag} rank 1 phase {phase}" in moved1
        assert f"CURRENT RUN {tag} rank 2 phase {phase}" in (log_dir / "run_0" / log2).read_text()
    assert (log_dir / "cmd-args.log").read_text().startswith(str(Path(WORKER)))  # this run's, written after
