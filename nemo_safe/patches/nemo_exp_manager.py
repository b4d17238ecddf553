"""NeMo ``exp_manager`` resume without the race, for nemo_toolkit 2.7.3 and 3.0.0.

Upstream ``check_resume`` lets global rank 0 move every regular file of
``log_dir`` into ``run_N/`` while the other ranks already list that directory
(NeMo #7460, #9952), and makes every non-zero rank sleep a fixed
``seconds_to_sleep`` (5 s) afterwards. Here:

* every rank arrives at a filesystem barrier in ``log_dir/.nemo_safe/`` (a
  hidden directory, which ``check_resume`` never moves) *before* rank 0 lists
  ``log_dir``, so no file of the current run can be archived;
* rank 0 runs the upstream ``check_resume`` (checkpoint lookup and the move),
  then the other ranks run it (lookup only); an exception on rank 0 reaches
  every rank as :class:`~nemo_safe.errors.RankZeroFailed`;
* the barrier is sized by ``trainer.num_nodes * trainer.num_devices`` and
  cross-checked with the launcher's world size;
* ranks the barrier ordered skip the fixed ``seconds_to_sleep``;
* under srun nothing exports ``LOCAL_RANK`` before ``fit()``, so upstream names
  every task of a node ``nemo_log_globalrank-<node*devices>_localrank-0.txt``;
  ``exp_manager`` runs with the launcher's local rank exported instead.

Without a multi-process launcher (one process, Lightning's own local launcher
before ``fit()``, an interactive SLURM shell) nothing changes.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import threading
import time as _time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from nemo_safe import cluster_identity
from nemo_safe.barrier import rank_zero_first
from nemo_safe.errors import ConfigurationError
from nemo_safe.patching import Patch, Replacements, Undo

log = logging.getLogger(__name__)

MODULE = "nemo.utils.exp_manager"
BARRIER_NAME = "exp_manager-check_resume"

#: sha256 of ``inspect.getsource(check_resume)`` of the upstream releases this patch was verified against.
KNOWN_CHECK_RESUME = {
    "94e2c781bf845d49cec69e7d680a47be842214549e3f7bb96fe408bbc7ea2d2b": "nemo_toolkit 2.7.3 / 3.0.0",
}


def source_digest(function: Callable[..., Any]) -> str:
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()


def recognise(module: ModuleType) -> str | None:
    """Which known upstream ``check_resume`` this module has, or None."""
    try:
        return KNOWN_CHECK_RESUME.get(source_digest(module.check_resume))
    except (AttributeError, OSError, TypeError):
        return None


class _SleepGate:
    """Stands in for the ``time`` module inside ``nemo.utils.exp_manager`` only.

    ``exp_manager`` ends with ``time.sleep(cfg.seconds_to_sleep)`` on non-zero
    ranks; after the barrier ordered this rank, that one sleep is skipped.
    """

    def __init__(self, real: ModuleType) -> None:
        self._real = real
        self._local = threading.local()

    def arm(self, armed: bool) -> None:
        self._local.armed = armed

    def sleep(self, seconds: float) -> None:
        if getattr(self._local, "armed", False):
            self._local.armed = False
            log.debug("nemo_safe: skipped exp_manager's %.1f s sleep; the barrier ordered this rank", seconds)
            return
        self._real.sleep(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _trainer_world_size(trainer: Any) -> int:
    return int(trainer.num_nodes) * int(trainer.num_devices)


def _launcher_count_hint(ident: cluster_identity.ClusterIdentity) -> str:
    if ident.launcher == "slurm":
        return "srun --nodes x --ntasks-per-node (SLURM_STEP_NUM_TASKS / SLURM_NTASKS)"
    if ident.launcher == "torchrun":
        return "torchrun --nnodes x --nproc-per-node (WORLD_SIZE)"
    return f"the {ident.launcher} launcher's task count"


def ordered_identity(trainer: Any) -> cluster_identity.ClusterIdentity | None:
    """The identity to order ``check_resume`` with, or None when there is nothing to order.

    Raises a clear error when the trainer and the launcher disagree on the world size.
    """
    ident = cluster_identity.detect()
    if ident.launcher == "none" or not ident.is_multi_process:
        return None
    world = _trainer_world_size(trainer)
    if world != ident.world_size:
        raise ConfigurationError(
            f"exp_manager: the trainer expects num_nodes={trainer.num_nodes} x devices={trainer.num_devices} = "
            f"{world} processes but {ident.launcher} started {ident.world_size} (this is rank {ident.rank}). "
            f"Make them match: set devices to the tasks per node and num_nodes to the nodes, or change "
            f"{_launcher_count_hint(ident)}."
        )
    return ident


def check_resume_in_order(
    check_resume: Callable[..., Any], trainer: Any, log_dir: Any, *args: Any, **kwargs: Any
) -> cluster_identity.ClusterIdentity | None:
    """Run ``check_resume`` on global rank 0 first and on the other ranks after it returned.

    Every rank arrives at a filesystem barrier in ``log_dir`` before rank 0 lists
    ``log_dir``, so rank 0 never archives a file of the current run, and no rank
    reads ``log_dir`` while rank 0 moves old files out of it. An exception on
    rank 0 reaches every rank. Returns the identity the ranks were ordered by,
    or None when there was nothing to order (one process, no launcher).
    """
    ident = ordered_identity(trainer)
    if ident is None or not log_dir:
        check_resume(trainer, log_dir, *args, **kwargs)
        return None
    root = Path(log_dir)
    if root.exists() and not os.access(root, os.W_OK):
        raise ConfigurationError(
            f"exp_manager: log_dir {root} is not writable from rank {ident.rank}; rank 0 must move old "
            "files there and every rank writes logs there. Fix its permissions or choose another exp_dir."
        )
    if ident.rank == 0:
        root.mkdir(parents=True, exist_ok=True)  # exp_manager creates it right after check_resume anyway
    # keep_parent: removing the hidden directory would make an entry vanish under ranks listing log_dir.
    with rank_zero_first(
        root, ident.world_size, BARRIER_NAME, rank=ident.rank, attempt_key=ident.attempt_key, keep_parent=True
    ):
        check_resume(trainer, log_dir, *args, **kwargs)
    return ident


def _make_safe_check_resume(original: Callable[..., Any], gate: _SleepGate) -> Callable[..., Any]:
    def check_resume(trainer: Any, log_dir: Any, *args: Any, **kwargs: Any) -> None:
        gate.arm(False)
        ident = check_resume_in_order(original, trainer, log_dir, *args, **kwargs)
        gate.arm(ident is not None and ident.rank != 0)

    check_resume.__wrapped__ = original  # type: ignore[attr-defined]
    check_resume.__doc__ = original.__doc__
    return check_resume


def local_rank_from_launcher() -> int:
    """``LOCAL_RANK``, or else the launcher's local rank.

    exp_manager runs before ``fit()``, and under ``srun`` nothing has exported
    ``LOCAL_RANK`` yet: taking 0 gives every task of a node the same global rank
    and the same ``nemo_log_globalrank-*_localrank-0.txt`` file.
    """
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    ident = cluster_identity.detect()
    return ident.local_rank if ident.launcher != "none" else 0


def _make_safe_exp_manager(original: Callable[..., Any]) -> Callable[..., Any]:
    def exp_manager(trainer: Any, cfg: Any = None) -> Any:
        ident = cluster_identity.detect()
        if "LOCAL_RANK" in os.environ or ident.launcher == "none" or not ident.is_multi_process:
            return original(trainer, cfg)
        os.environ["LOCAL_RANK"] = str(local_rank_from_launcher())  # upstream names its per-rank log file by it
        try:
            return original(trainer, cfg)
        finally:
            os.environ.pop("LOCAL_RANK", None)

    exp_manager.__wrapped__ = original  # type: ignore[attr-defined]
    exp_manager.__doc__ = original.__doc__
    return exp_manager


_warned: set[str] = set()


def apply(module: ModuleType) -> Undo | None:
    release = recognise(module)
    if release is None:
        digest = "unreadable"
        try:
            digest = source_digest(module.check_resume)[:16]
        except (AttributeError, OSError, TypeError):
            pass
        if digest not in _warned:
            _warned.add(digest)
            log.warning(
                "nemo_safe: %s.check_resume (source sha256 %s...) does not match a NeMo release nemo_safe "
                "knows (%s); it is left untouched, so exp_manager keeps upstream's resume race. "
                "Run `nemo-safe doctor` and report the NeMo version.",
                MODULE,
                digest,
                ", ".join(KNOWN_CHECK_RESUME.values()),
            )
        return None
    gate = _SleepGate(module.time if isinstance(module.time, ModuleType) else _time)
    changes = Replacements()
    changes.set(module, "check_resume", _make_safe_check_resume(module.check_resume, gate))
    changes.set(module, "exp_manager", _make_safe_exp_manager(module.exp_manager))
    changes.set(module, "time", gate)
    return changes.undo


def describe(module: ModuleType) -> str:
    release = recognise(module)
    if release is None:
        return "check_resume does not match a known release: left untouched (upstream race remains)"
    return f"check_resume matches {release}: barrier-ordered resume, no fixed sleep"


PATCH = Patch(MODULE, "nemo-exp-manager-resume", apply, describe)
