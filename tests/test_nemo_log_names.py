"""Which local rank nemo_safe exports while exp_manager runs, so that upstream names each task's per-rank log file
``nemo_log_globalrank-<g>_localrank-<l>.txt`` after that task (NeMo #8333), with real Lightning Trainers.

Upstream's fix takes ``LOCAL_RANK``, else ``trainer.local_rank``; the overlay takes the same value and, where the
trainer reports 0, the launcher's (one-device trainers under srun, mpirun without mpi4py). One process per case
is not needed: Lightning reads the variables when the Trainer is constructed.
"""

from __future__ import annotations

import os

import pytest

from nemo_safe.cluster_identity import LAUNCHER_NAMES, LAUNCHER_PREFIXES
from nemo_safe.patches.nemo_log_names import log_local_rank

TWO_BY_TWO = {"devices": 2, "num_nodes": 2, "strategy": "ddp"}


def _slurm(rank: int, name: str = "train", per_node: int = 2, tasks: int = 4) -> dict[str, str]:
    return {
        "SLURM_JOB_NAME": name,
        "SLURM_JOB_ID": "77",
        "SLURM_NODELIST": "node[1-2]",
        "SLURM_NTASKS": str(tasks),
        "SLURM_NTASKS_PER_NODE": str(per_node),
        "SLURM_PROCID": str(rank),
        "SLURM_NODEID": str(rank // per_node),
        "SLURM_LOCALID": str(rank % per_node),
    }


CASES = {
    # name: (launcher variables, Trainer arguments, exported local rank)
    "one process": ({}, {}, None),
    "Lightning's launcher before fit()": ({}, {"devices": 2, "strategy": "ddp"}, None),
    "Lightning's child": ({"LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2"}, {"devices": 2}, None),
    "torchrun": (
        {"RANK": "3", "LOCAL_RANK": "1", "GROUP_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"},
        TWO_BY_TWO,
        None,
    ),
    "srun task 3 of 2x2": (_slurm(3), TWO_BY_TWO, 1),
    "srun task 2 of 2x2": (_slurm(2), TWO_BY_TWO, None),
    "srun -J bash (interactive)": (_slurm(3, name="bash"), TWO_BY_TWO, None),
    # Lightning's single-device strategy reports 0 in every task; the launcher's rank keeps the names apart.
    "srun one-device tasks": (_slurm(1, per_node=2, tasks=2), {"devices": 1}, 1),
    # Lightning needs mpi4py to detect mpirun; without it the trainer reports 0.
    "mpirun rank 3": (
        {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
        TWO_BY_TWO,
        1,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_exported_local_rank(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning.pytorch as pl

    for name in list(os.environ):
        if name.startswith(LAUNCHER_PREFIXES) or name in LAUNCHER_NAMES:
            monkeypatch.delenv(name)
    env, trainer_kwargs, expected = CASES[case]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, **trainer_kwargs)
    assert log_local_rank(trainer) == expected


def test_trainer_wins_over_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster environment of the user's own (a Trainer plugin) under srun: the trainer's local rank, as upstream."""

    class Trainer:
        local_rank = 3

    for name, value in _slurm(1).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert log_local_rank(Trainer()) == 3


def test_left_alone_where_nemo_would_read_local_rank_for_rank_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """No RANK / SLURM_PROCID / OMPI_COMM_WORLD_RANK: is_global_rank_zero() would read LOCAL_RANK, so no export."""

    class Trainer:
        local_rank = 1

    for name in list(os.environ):
        if name.startswith(LAUNCHER_PREFIXES) or name in LAUNCHER_NAMES:
            monkeypatch.delenv(name)
    assert log_local_rank(Trainer()) is None
