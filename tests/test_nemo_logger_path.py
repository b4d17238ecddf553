"""NeMo 2.x's NeMoLogger + AutoResume start-up path, upstream behaviour measured (docs/nemo.md).

One real ``torchrun --nproc-per-node 3`` job of tests/nemo_logger_worker.py (NeMo's Trainer on
CPU, DDP over gloo, NeMoLogger with NeMo's ModelCheckpoint, AutoResume(resume_if_exists=True)),
``NEMO_SAFE_DISABLE=1``, on a log_dir that holds an earlier run: 50 files, ``cmd-args.log`` and
rank 1's ``nemo_log_globalrank-1_localrank-1.txt``. Rank 0 enters ``NeMoLogger.setup`` 3 s late.

What upstream does (``NEMO_SAFE_DISABLE=1``; before nemo_safe patched this path, its twin looked the same):

* rank 1 appends its current-run log to the earlier run's file (``logging.FileHandler``, mode
  ``a``), which rank 0 lists in its own ``setup`` and moves into ``run_0`` in
  ``ModelCheckpoint.on_train_start``: all of rank 1's current-run lines end in ``run_0``, whatever
  the timing;
* rank 2 (no earlier file) creates its log in its ``setup`` before rank 0 lists ``log_dir``: that
  fresh file of the current run is moved into ``run_0`` too (the race: no barrier orders the
  ranks' ``setup`` calls; here the 3 s make it deterministic);
* both ranks keep writing into the moved files; ``log_dir`` is left with no log of rank 1 or 2.

With nemo_safe (``nemo_safe/patches/nemo_logger_order.py``) the same job archives no current-run
file: rank 0 moves the earlier run's files into ``run_0`` in its ``setup``, right after listing
``log_dir``, and the other ranks run their ``setup`` after it; also a 2-rank job, a job without
``resume_if_exists`` (left to upstream, no wait), and the patch's gate.

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


def _import_error() -> str:
    """Why ``nemo.lightning.nemo_logger`` does not import in this environment ("" where it does), asked in a
    child process (it imports megatron.core and, from NeMo 2.3, nvidia_resiliency_ext)."""
    code = "import nemo.lightning.nemo_logger"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD)
    return "" if out.returncode == 0 else (out.stderr.strip().splitlines() or ["?"])[-1]


_SOURCE = _nemo_logger_source()
_UNIMPORTABLE = _import_error() if _SOURCE is not None else ""
pytestmark = [
    pytest.mark.skipif(
        _SOURCE is None,
        reason="nemo.lightning.NeMoLogger is not available (NeMo 3.0 removed it; it exists in NeMo 2.0-2.7)",
    ),
    pytest.mark.skipif(
        bool(_UNIMPORTABLE),
        reason=f"nemo.lightning does not import in this environment ({_UNIMPORTABLE}); the release sweep's "
        "environment lacks what it needs",
    ),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_name(rank: int) -> str:
    return f"nemo_log_globalrank-{rank}_localrank-{rank}.txt"


def run_job(
    tmp_path: Path,
    world: int,
    old_log_ranks: str,
    late_rank: int,
    *,
    disabled: bool,
    tag: str = "t1",
    no_resume: bool = False,
    no_agent_store: bool = False,
) -> tuple[Path, dict[int, dict], dict]:
    """One torchrun job of the worker on a log_dir holding an earlier run: each rank's result, and
    what ``inspect`` found in log_dir afterwards."""
    log_dir, side = tmp_path / "exp" / "default", tmp_path / "side"
    prepare = [sys.executable, WORKER, "prepare", "--log-dir", str(log_dir), "--old-files", str(OLD_FILES)]
    subprocess.run([*prepare, "--old-log-ranks", old_log_ranks], check=True, timeout=60)
    port = free_port()
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", str(world), "--master-port", str(port)]
    cmd += [WORKER, "train", "--log-dir", str(log_dir), "--tag", tag, "--side", str(side)]
    cmd += ["--late-rank", str(late_rank), "--late-seconds", str(LATE)] + (["--no-resume"] if no_resume else [])
    cmd += ["--no-agent-store"] if no_agent_store else []
    extra = {"NEMO_SAFE_DISABLE": "1"} if disabled else {}
    env = clean_env(PYTHONPATH=str(Path(__file__).resolve().parents[1]), **extra)
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_GUARD)
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = {r: json.loads((side / f"rank{r}.json").read_text()) for r in range(world)}
    for r, res in ranks.items():
        assert res["exception"] is None, res["exception"]
        assert res["nemo_safe_disabled"] == disabled, r
        if disabled:
            assert res["nemo_safe_active"] == [], r
        else:
            assert "nemo-logger-resume-order" in res["nemo_safe_active"], r
        assert res["callbacks"] == ["nemo.lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint"]
        if not no_resume:
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
    return log_dir, ranks, found


OLD = sorted([f"old_{i:03d}.txt" for i in range(OLD_FILES)] + ["cmd-args.log"])


def test_nemo_logger_archives_current_run_logs_upstream(tmp_path: Path) -> None:
    log_dir, ranks, found = run_job(tmp_path, 3, "1", 0, disabled=True)
    tag = "t1"
    log1, log2 = "nemo_log_globalrank-1_localrank-1.txt", "nemo_log_globalrank-2_localrank-2.txt"

    # Rank 0 listed rank 2's fresh log (created by this run before rank 0's late setup) for moving.
    assert log2 in ranks[0]["files_to_move"]
    # Exactly one run_N: the earlier run's files plus rank 1's and rank 2's logs of this run.
    assert list(found["runs"]) == ["run_0"]
    assert found["runs"]["run_0"] == sorted([*OLD, log1, log2])
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


def assert_current_logs_kept(log_dir: Path, ranks: dict[int, dict], found: dict, old_log_ranks: list[int]) -> None:
    """What nemo_safe promises: run_0 holds the earlier run's files (its nemo_log files with their old
    line only); every rank's current log is in log_dir, open there until the end, with this run's
    lines only; rank 0 moved what it listed in its setup, leaving on_train_start nothing to move."""
    tag, world = "t1", len(ranks)
    assert list(found["runs"]) == ["run_0"]
    assert found["runs"]["run_0"] == sorted([*OLD, *(log_name(r) for r in old_log_ranks)])
    assert found["archived_current"] == []
    assert found["current_lines_in"] == {str(r): [log_name(r)] for r in range(world)}
    assert ranks[0]["files_to_move"] == []
    for r in old_log_ranks:
        assert (log_dir / "run_0" / log_name(r)).read_text() == f"OLD RUN rank {r}\n"
    for r in range(world):
        assert ranks[r]["log_file_now"] == str(log_dir / log_name(r))
        text = (log_dir / log_name(r)).read_text()
        assert "OLD RUN" not in text, r
        for phase in ("setup", "step0", "step1", "after_fit"):
            assert f"CURRENT RUN {tag} rank {r} phase {phase}" in text
    assert {"cmd-args.log", "lightning_logs.txt"} <= set(found["top"])
    assert (log_dir / "cmd-args.log").read_text().startswith(str(Path(WORKER)))  # this run's


def test_nemo_logger_keeps_current_run_logs_with_nemo_safe(tmp_path: Path) -> None:
    """The upstream test's job with nemo_safe: 3 ranks, an old rank-1 log, rank 0 enters setup 3 s late."""
    log_dir, ranks, found = run_job(tmp_path, 3, "1", 0, disabled=False)
    assert_current_logs_kept(log_dir, ranks, found, [1])
    # The others waited for rank 0's setup (it publishes its outcome just before it returns, so compare with
    # when it started, 3 s after them): their listing saw the moved state.
    assert all(ranks[r]["setup_done"] > ranks[0]["setup_start"] for r in (1, 2))


def test_nemo_logger_two_ranks_old_logs_of_both_with_nemo_safe(tmp_path: Path) -> None:
    """2 ranks, old logs of both ranks (a resumed 2-rank job), rank 0 3 s late: with two ranks no
    other rank vouches for rank 0, so rank 1 relies on the grace (longer than the 3 s)."""
    log_dir, ranks, found = run_job(tmp_path, 2, "0,1", 0, disabled=False)
    assert_current_logs_kept(log_dir, ranks, found, [0, 1])


def test_nemo_logger_ranks_meeting_in_log_dir_with_nemo_safe(tmp_path: Path) -> None:
    """The 3-rank job with the ranks meeting in log_dir's hidden .nemo_safe/ (as under srun, where no
    agent store exists): the same outcome, and the barrier's folder is no file rank 0 lists or moves."""
    log_dir, ranks, found = run_job(tmp_path, 3, "1", 0, disabled=False, no_agent_store=True)
    assert_current_logs_kept(log_dir, ranks, found, [1])
    assert (log_dir / ".nemo_safe").is_dir() and not (log_dir / "run_0" / ".nemo_safe").exists()
    assert all(ranks[r]["setup_done"] > ranks[0]["setup_start"] for r in (1, 2))


def test_nemo_logger_without_resume_is_left_to_upstream(tmp_path: Path) -> None:
    """``resume_if_exists=False``: rank 0 alone logs into a fresh dated version, which it lists empty;
    nothing needs ordering, so nemo_safe leaves upstream's setup as it is: rank 1 does not wait for the
    late rank 0, and appends to its old log in log_dir (which nobody moves), exactly as upstream."""
    log_dir, ranks, found = run_job(tmp_path, 2, "1", 0, disabled=False, no_resume=True)
    assert Path(ranks[0]["log_dir"]).parent == log_dir and ranks[1]["log_dir"] == str(log_dir)
    assert ranks[0]["files_to_move"] == [] and ranks[1]["files_to_move"] == sorted([*OLD, log_name(1)])
    assert ranks[1]["setup_done"] < ranks[0]["setup_start"]  # no wait for rank 0 (it started 3 s after rank 1)
    assert found["runs"] == {} and found["archived_current"] == []
    assert found["current_lines_in"] == {"1": [log_name(1)]}  # rank 0's log is in its dated version
    assert (log_dir / log_name(1)).read_text().startswith("OLD RUN rank 1\n")


# -- the gate, in process (imports NeMo: ~10 s) -------------------------------------------------


def test_gate_on_the_installed_nemo_logger() -> None:
    nemo_logger = pytest.importorskip("nemo.lightning.nemo_logger")
    from nemo_safe.patches import nemo_logger_order

    verdict = nemo_logger_order.GATE.verdict(nemo_logger)
    assert verdict.status in ("verified", "structure"), verdict
    for fact in nemo_logger_order.FACTS:
        assert fact.holds(nemo_logger), fact.says
    # apply() wraps, undo() restores upstream's functions (what nemo_safe.unpatch() does).
    cls = nemo_logger.NeMoLogger
    setup, listing = vars(cls)["setup"], vars(cls)["_setup_files_to_move"]
    changes = nemo_logger_order.apply(nemo_logger)
    assert changes is not None
    try:
        assert vars(cls)["setup"] is not setup and vars(cls)["setup"].__wrapped__ is setup
        assert vars(cls)["_setup_files_to_move"].__wrapped__ is listing
        assert nemo_logger_order.GATE.verdict(nemo_logger) == verdict  # judged through the wrappers
    finally:
        changes.undo()
    assert vars(cls)["setup"] is setup and vars(cls)["_setup_files_to_move"] is listing


def test_gate_declines_setup_that_opens_its_log_before_listing(tmp_path: Path) -> None:
    """An edited copy of the installed nemo_logger.py whose setup opens the log file before listing
    log_dir: nothing to order there, the patch declines and names the fact."""
    pytest.importorskip("nemo.lightning.nemo_logger")
    import importlib.util as util

    from nemo_safe.patches import nemo_logger_order

    source = _nemo_logger_source()
    assert source is not None
    text = source.read_text()
    listing = "        self._setup_files_to_move(log_dir, app_state)\n"
    opening = "        self._setup_file_logging(log_dir)\n"
    assert listing + opening in text
    edited = tmp_path / "nemo_logger_edited.py"
    edited.write_text(text.replace(listing + opening, opening + listing, 1))
    spec = util.spec_from_file_location("nemo_logger_edited", edited)
    assert spec is not None and spec.loader is not None
    module = util.module_from_spec(spec)
    spec.loader.exec_module(module)
    verdict = nemo_logger_order.GATE.verdict(module)
    assert verdict.status == "declined", verdict
    assert "calls self._setup_files_to_move, then self._setup_file_logging" in verdict.detail
    setup = vars(module.NeMoLogger)["setup"]
    assert nemo_logger_order.apply(module) is None
    assert vars(module.NeMoLogger)["setup"] is setup


def test_rank_zero_setup_failure_reaches_the_other_ranks(tmp_path: Path) -> None:
    """Rank 0's setup raises (its log dir cannot be created): the others, which waited for it, run their
    own setup and then raise RankZeroFailed with rank 0's error, instead of training without rank 0."""
    log_dir, side = tmp_path / "exp" / "default", tmp_path / "side"
    prepare = [sys.executable, WORKER, "prepare", "--log-dir", str(log_dir), "--old-files", "5"]
    subprocess.run([*prepare, "--old-log-ranks", "1"], check=True, timeout=60)
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "3", "--master-port", str(free_port())]
    cmd += [WORKER, "train", "--log-dir", str(log_dir), "--tag", "t1", "--side", str(side), "--bad-log-dir-rank", "0"]
    env = clean_env(PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_GUARD)
    assert out.returncode != 0
    ranks = {r: json.loads((side / f"rank{r}.json").read_text()) for r in range(3)}
    assert "NotADirectoryError" in ranks[0]["exception"] or "FileExistsError" in ranks[0]["exception"]
    for r in (1, 2):
        assert "nemo_safe.errors.RankZeroFailed" in ranks[r]["exception"], ranks[r]["exception"]
    assert not (log_dir / "run_0").exists()  # rank 0 failed before listing: nothing moved


def test_which_setups_share_log_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks share log_dir (and rank 0's listing is theirs) unless rank 0 alone dates a version."""
    from types import SimpleNamespace

    from nemo_safe.patches.nemo_logger_order import VERSION_ENV, _shares_log_dir

    monkeypatch.delenv(VERSION_ENV, raising=False)

    def logger(**kw: object) -> SimpleNamespace:
        return SimpleNamespace(**{"explicit_log_dir": None, "version": None, "use_datetime_version": True, **kw})

    assert _shares_log_dir(logger(), resume_if_exists=True)
    assert not _shares_log_dir(logger(), resume_if_exists=False)  # rank 0: name/<date>, the others: name/
    assert _shares_log_dir(logger(use_datetime_version=False), resume_if_exists=False)
    assert _shares_log_dir(logger(version="v1"), resume_if_exists=False)
    assert _shares_log_dir(logger(explicit_log_dir="/x"), resume_if_exists=False)
    monkeypatch.setenv(VERSION_ENV, "v2")
    assert _shares_log_dir(logger(), resume_if_exists=False)
