"""exp_manager's resume ordering is NeMo pull request 2's own code: the overlay runs its code objects.

Rank 0 first, everyone after it with rank 0's ``log_dir``: that is ``_check_resume_in_order`` and the
functions it calls in :mod:`nemo_safe.patches.nemo_resume_upstream`, which ``ci/make_patches.py`` copies
into ``nemo/utils/exp_manager.py`` for the upstream series. The overlay runs those code objects bound to
``nemo.utils.exp_manager``'s globals (:func:`~nemo_safe.patches.upstream_code.run_in`), so what overlay
users run is what the series proposes, and there is one implementation to fix (issue 23).

Around that core, only what the pull request needs no help with upstream:

* **Where it runs.** The series' ``exp_manager()`` calls the core in place of ``check_resume``; an
  installed NeMo calls ``get_log_dir`` and then ``check_resume``. :mod:`~nemo_safe.patches.nemo_exp_manager`
  runs the core from inside ``get_log_dir`` (where rank 0's ``log_dir`` can still become everyone's) with
  the arguments of the ``check_resume`` call that follows (a gate fact), and skips that call.
* **Which run.** The series knows torchrun and SLURM steps; under another launcher nemo_safe recognises
  (Open MPI, PMIx) the run is its :attr:`~nemo_safe.cluster_identity.ClusterIdentity.attempt_key`.
* **A stuck rank 0** (its check shows no I/O, CPU, sleep or Python step for 10 s: a hung NFS move) stops
  beating, so the others carry on as upstream after the series' 120 s of silence, not after its 30 min.
* **SIGTERM** (``scancel``, preemption) on rank 0 while it checks: its state says done, with that error,
  before it dies of the signal (:mod:`nemo_safe.term_signal`), so the others stop waiting now instead of
  after the series' 120 s of silence.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from nemo_safe import cluster_identity, log_output, term_signal, wait_lines
from nemo_safe.patches import nemo_resume_upstream, upstream_code
from nemo_safe.thread_progress import PROGRESS_LIMIT, ThreadProgress
from nemo_safe.warn_once import warn_once

log = logging.getLogger(__name__)

#: The functions of the series the overlay runs (the ones ``_check_resume_in_order`` calls by name).
CORE = (
    "_check_resume_in_order",
    "_check_resume_first",
    "_wait_for_rank_zero",
    "_rank_zero_is_late",
    "_read_resume_state",
)
#: The variable the series adds to ``nemo/constants.py`` (an installed NeMo has no such constant).
RESUME_CHECKED_VARIABLE = "NEMO_EXPM_RESUME_CHECKED"

Order = Callable[[Any, Any, Path, str, str, Any], tuple[float, Path, Any]]


def _resume_order_run() -> list[Any] | None:
    """The series' run (torchrun, a SLURM step), else the attempt of the launcher nemo_safe detects."""
    run = nemo_resume_upstream._resume_order_run()
    if run is not None:
        return run
    ident = cluster_identity.detect()
    return [ident.attempt_key] if ident.launcher != "none" else None


class _RankZeroStates:
    """The states rank 0's core writes: a beat only while its check advances, and SIGTERM's final one."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # the beat thread writes too; SIGTERM's handler runs in the main thread
        self._last: dict[Path, dict[str, Any]] = {}  # per state file: an earlier call may still republish its own
        self._closed = False
        self._checking = ThreadProgress()  # the thread that runs check_resume
        self._advanced = time.monotonic()

    def write(self, path: Path, state: dict[str, Any]) -> None:
        with self._lock:
            if self._closed or self._stuck(state):
                return  # a beat after SIGTERM's final state, or one of a check that no longer advances
            nemo_resume_upstream._write_resume_state(path, state)
            self._last[path] = state

    def _stuck(self, state: dict[str, Any]) -> bool:
        """A beat of a check with no I/O, CPU, sleep or Python step for PROGRESS_LIMIT s (a hung NFS move): left
        out, so that the others see silence and carry on after the series' limit instead of its 30 min."""
        if state.get("phase") != "checking" or not state.get("beat"):
            return False
        now = time.monotonic()
        if self._checking.advanced():
            self._advanced = now
        if now - self._advanced < PROGRESS_LIMIT:
            return False
        warn_once(log, "stuck", "nemo_safe: exp_manager: global rank 0's check_resume has not advanced for %.0f s "
                  "(a hung filesystem call?); the other ranks carry on without it once its beat is silent", now -
                  self._advanced)  # fmt: skip
        return True

    def killed(self) -> None:
        """SIGTERM while rank 0 checks: done, with that error (a lost write leaves the series' silence rule)."""
        if not self._lock.acquire(timeout=2.0):
            return
        try:
            checking = [(path, state) for path, state in self._last.items() if state.get("phase") == "checking"]
            if self._closed or not checking:
                return
            self._closed = True
            path, state = checking[-1]
            error = "killed by SIGTERM (scancel, preemption or its launcher's teardown)"
            nemo_resume_upstream._write_resume_state(path, {**state, "time": time.time(), "phase": "done",
                                                            "error": error})  # fmt: skip
        finally:
            self._lock.release()


class _NemoVoice:
    """NeMo's ``logging`` for the series' code, heard where NeMo would not print it. NeMo removes its stream
    handlers on every rank but 0 (unless ``NEMO_TESTING`` is set), so a waiting rank's lines went nowhere (issue
    24). Where NeMo prints nothing: if the program configured logging, the line goes to nemo_safe's logger (the
    program's handlers and levels decide); else it is printed to standard error in NeMo's own format
    (``[NeMo I ...]``): warnings on every rank, info lines where this rank speaks for its node (local ranks 0
    and 1, :mod:`nemo_safe.wait_lines`) and nemo_safe is not silenced, so thousands of ranks print a few lines
    per node."""

    def __init__(self, nemo_logging: Any) -> None:
        self._nemo = nemo_logging

    def info(self, message: str, *args: Any, **kwargs: Any) -> None:
        self._nemo.info(message, *args, **kwargs)
        if wait_lines.speaks_for_its_node():
            _say_where_nemo_does_not(logging.INFO, message, args)

    def warning(self, message: str, *args: Any, **kwargs: Any) -> None:
        self._nemo.warning(message, *args, **kwargs)
        _say_where_nemo_does_not(logging.WARNING, message, args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._nemo, name)


def _nemo_prints(level: int) -> bool:
    """Whether NeMo's logger prints (or, by its verbosity, drops) a record of ``level`` itself: a stream handler
    (a subclass too, e.g. tqdm's redirect; not its per-rank log file) or a level above ``level``."""
    nemo_logger = logging.getLogger("nemo_logger")
    streams = [h for h in nemo_logger.handlers if isinstance(h, logging.StreamHandler)]
    return not nemo_logger.isEnabledFor(level) or any(not isinstance(h, logging.FileHandler) for h in streams)


def _say_where_nemo_does_not(level: int, message: str, args: tuple[Any, ...]) -> None:
    if _nemo_prints(level):
        return
    try:
        text = message % args if args else message
    except (TypeError, ValueError):  # NeMo's own call would have printed the error; the line stays as written
        text = message
    if log_output.configured_elsewhere(log):
        log.log(level, "nemo_safe: exp_manager: %s", text)
        return
    if level < logging.WARNING and log_output.silenced(log):
        return
    caller = sys._getframe(2)  # the series' line that logged, as NeMo's own record names it
    record = logging.getLogger("nemo_logger").makeRecord(
        "nemo_logger", level, caller.f_code.co_filename, caller.f_lineno, text, (), None, caller.f_code.co_name
    )
    try:
        line = _nemo_formatter().format(record)
    except Exception:  # a formatter that fails must not fail the job either
        return
    log_output.write_line(line)


def _nemo_formatter() -> logging.Formatter:
    try:
        from nemo.utils.formatters.base import BaseNeMoFormatter

        return BaseNeMoFormatter()  # type: ignore[no-any-return]
    except Exception:  # a NeMo without it: the same shape
        return logging.Formatter("[NeMo %(levelname).1s %(asctime)s %(module)s:%(lineno)d] %(message)s")


def bind(module: ModuleType, check_resume: Callable[..., Any]) -> Order:
    """The series' ``_check_resume_in_order`` running in ``module`` (``nemo.utils.exp_manager``) with its
    original ``check_resume``; rank 0's states go through a per-call :class:`_RankZeroStates`."""
    current: list[_RankZeroStates] = [_RankZeroStates()]
    helpers = {
        "check_resume": check_resume,
        "logging": _NemoVoice(module.logging),
        "NEMO_ENV_VARNAME_RESUME_CHECKED": RESUME_CHECKED_VARIABLE,
        "_resume_order_run": _resume_order_run,
        "_write_resume_state": lambda path, state: current[0].write(path, state),
    }
    core = upstream_code.run_in(nemo_resume_upstream, module, CORE, helpers)["_check_resume_in_order"]

    def check_resume_in_order(trainer: Any, cfg: Any, log_dir: Path, exp_dir: str, name: str, version: Any) -> Any:
        if not module.is_global_rank_zero():  # a waiting rank keeps SIGTERM fatal (it also ends a hung NFS call)
            return core(trainer, cfg, log_dir, exp_dir, name, version)
        states = current[0] = _RankZeroStates()
        with term_signal.released_on_sigterm(states.killed):
            return core(trainer, cfg, log_dir, exp_dir, name, version)

    check_resume_in_order.__wrapped__ = core  # type: ignore[attr-defined]
    return check_resume_in_order
