"""The per-rank log file's name under srun and mpirun (NeMo #8333; the upstream series' first patch).

Before ``fit()``, nothing exports ``LOCAL_RANK`` under srun or mpirun, so upstream NeMo names every task
of a node ``nemo_log_globalrank-<node*devices>_localrank-0.txt``: the tasks of one node write one file.
The upstream change takes ``LOCAL_RANK``, else ``trainer.local_rank``; the overlay exports that while
``exp_manager`` runs (:mod:`nemo_safe.patches.nemo_exp_manager` does), falling back to the launcher's
local rank where the trainer reports 0.
"""

from __future__ import annotations

import os
from typing import Any

from nemo_safe import cluster_identity

#: Launchers whose global rank NeMo reads (is_global_rank_zero) but whose local rank nobody exports
#: before fit(): there upstream names every task of a node after its first rank (NeMo #8333).
LOCAL_RANK_FIXED_FOR = ("slurm", "openmpi")
#: What NeMo's is_global_rank_zero() reads before NODE_RANK + LOCAL_RANK: where one of them is set, exporting
#: LOCAL_RANK changes the per-rank log file's name and logging.rank only.
GLOBAL_RANK_VARIABLES = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")


def _trainer_local_rank(trainer: Any) -> int:
    """``trainer.local_rank`` (Lightning's cluster environment: SLURM_LOCALID, ...), 0 where it has none."""
    try:
        rank = trainer.local_rank
    except Exception:  # a trainer-like object without one: upstream's default
        return 0
    return rank if isinstance(rank, int) and rank > 0 else 0


def _launcher_local_rank() -> int:
    """The local rank of a multi-process launcher whose global rank NeMo reads (srun, mpirun), else 0."""
    try:
        ident = cluster_identity.detect()
    except ValueError:  # unusable launcher variables: upstream's default
        return 0
    if ident.launcher not in LOCAL_RANK_FIXED_FOR or not ident.is_multi_process:
        return 0
    return ident.local_rank


def log_local_rank(trainer: Any) -> int | None:
    """The local rank to export as ``LOCAL_RANK`` while exp_manager runs, or None to leave the environment alone.

    Upstream (after the NeMo change "exp_manager: take the per-rank log file's local rank from the
    trainer") names the per-rank log file by ``LOCAL_RANK``, else ``trainer.local_rank``. So does this,
    and where the trainer reports 0 it takes the launcher's local rank: Lightning's single-device strategy
    reports 0 in every task of an srun step of one-device trainers, and Lightning does not detect mpirun
    without mpi4py. Only where ``is_global_rank_zero()`` does not read ``LOCAL_RANK`` (see
    :data:`GLOBAL_RANK_VARIABLES`), so the export changes the file name and ``logging.rank``, nothing else.
    """
    if "LOCAL_RANK" in os.environ or not any(name in os.environ for name in GLOBAL_RANK_VARIABLES):
        return None
    return _trainer_local_rank(trainer) or _launcher_local_rank() or None
