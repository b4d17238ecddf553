"""Cluster identity from launcher variables: a table of real-world environments."""

from __future__ import annotations

import os

import pytest

from nemo_safe.cluster_identity import detect, sanitize_component
from nemo_safe.errors import ConfigurationError

SLURM = {
    "SLURM_NTASKS": "8",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_JOB_ID": "1234",
    "SLURM_STEP_ID": "0",
    "SLURM_JOB_NAME": "train",
    "SLURM_CLUSTER_NAME": "c1",
}
TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "16",
    "LOCAL_RANK": "3",
    "GROUP_RANK": "0",
    "TORCHELASTIC_RUN_ID": "abc",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "MASTER_ADDR": "n1",
    "MASTER_PORT": "29500",
}
OMPI = {
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_NODE_RANK": "2",
    "PMIX_NAMESPACE": "prterun-n1-123@1",
    "PMIX_RANK": "2",
}

# (case, env, launcher, rank, local_rank, node_rank, world_size)
TABLE = [
    ("nothing", {}, "none", 0, 0, 0, 1),
    ("slurm srun task", SLURM, "slurm", 5, 1, 1, 8),
    ("slurm step smaller than allocation", {**SLURM, "SLURM_NTASKS": "16"}, "slurm", 5, 1, 1, 8),
    ("slurm without step count", {k: v for k, v in SLURM.items() if k != "SLURM_STEP_NUM_TASKS"}, "slurm", 5, 1, 1, 8),
    ("interactive slurm named bash", {**SLURM, "SLURM_JOB_NAME": "bash"}, "none", 0, 0, 0, 1),
    ("interactive slurm named interactive", {**SLURM, "SLURM_JOB_NAME": "interactive"}, "none", 0, 0, 0, 1),
    ("torchrun", TORCHRUN, "torchrun", 3, 3, 0, 16),
    (
        "torchrun under srun wins over SLURM_PROCID=node index",
        {**SLURM, "SLURM_PROCID": "1", **TORCHRUN, "RANK": "12", "GROUP_RANK": "1"},
        "torchrun",
        12,
        3,
        1,
        16,
    ),
    ("open mpi", OMPI, "openmpi", 2, 0, 2, 4),
    ("pmix only", {"PMIX_RANK": "1", "PMIX_NAMESPACE": "ns", "PMIX_SIZE": "2"}, "pmix", 1, 0, 0, 2),
]


@pytest.mark.parametrize("case,env,launcher,rank,local,node,world", TABLE, ids=[t[0] for t in TABLE])
def test_identity_table(case, env, launcher, rank, local, node, world) -> None:
    ident = detect(env)
    assert (ident.launcher, ident.rank, ident.local_rank, ident.node_rank, ident.world_size) == (
        launcher,
        rank,
        local,
        node,
        world,
    )
    assert os.sep not in ident.attempt_key and not ident.attempt_key.startswith(".")


def test_interactive_slurm_warns() -> None:
    ident = detect({**SLURM, "SLURM_JOB_NAME": "bash"})
    assert ident.warnings and "-J" in ident.warnings[0]


def _key(env: dict[str, str]) -> str:
    return detect(env).attempt_key


def test_key_is_the_same_on_every_rank_of_an_attempt() -> None:
    keys = {_key({**SLURM, "SLURM_PROCID": str(r), "SLURM_NODEID": str(r // 4)}) for r in range(8)}
    assert len(keys) == 1
    keys = {_key({**TORCHRUN, "RANK": str(r), "LOCAL_RANK": str(r % 8)}) for r in range(16)}
    assert len(keys) == 1


@pytest.mark.parametrize(
    "change",
    [
        {"SLURM_RESTART_COUNT": "1"},  # requeue keeps the job id, step ids restart at 0
        {"SLURM_STEP_ID": "1"},
        {"SLURM_JOB_ID": "1235"},
        {"SLURM_CLUSTER_NAME": "c2"},
        {"SLURM_JOB_START_TIME": "1764000000"},
        {"SLURM_ARRAY_JOB_ID": "1200", "SLURM_ARRAY_TASK_ID": "7"},
    ],
)
def test_slurm_key_differs_between_attempts(change: dict[str, str]) -> None:
    assert _key({**SLURM, **change}) != _key(SLURM)


def test_array_tasks_differ() -> None:
    base = {**SLURM, "SLURM_ARRAY_JOB_ID": "1200"}
    assert _key({**base, "SLURM_ARRAY_TASK_ID": "1"}) != _key({**base, "SLURM_ARRAY_TASK_ID": "2"})


@pytest.mark.parametrize(
    "change",
    [
        {"TORCHELASTIC_RUN_ID": "other"},
        {"MASTER_PORT": "29501"},
    ],
)
def test_torchrun_key_differs_between_jobs(change: dict[str, str]) -> None:
    assert _key({**TORCHRUN, **change}) != _key(TORCHRUN)


def test_torchrun_key_ignores_restart_counts() -> None:
    """Each elastic agent counts only its own workers' failures: after one failure the nodes of
    one round disagree on TORCHELASTIC_RESTART_COUNT, so it must not decide where ranks meet.
    Rounds share the key; the barrier's sessions and nonces keep them apart."""
    counts = {_key({**TORCHRUN, "RANK": str(r), "TORCHELASTIC_RESTART_COUNT": str(r % 2)}) for r in range(4)}
    assert len(counts) == 1
    assert not detect(TORCHRUN).attempt_unique and detect(SLURM).attempt_unique


@pytest.mark.parametrize("hostile", ["../../x", "/etc/passwd", "..", ".hidden", "a/b\x00c", "x" * 500, "ä b"])
def test_hostile_values_stay_one_safe_component(hostile: str) -> None:
    key = _key({**SLURM, "SLURM_JOB_ID": hostile})
    assert "/" not in key and "\x00" not in key and ".." not in key and not key.startswith(".")
    assert len(key) <= 120
    assert key != _key({**SLURM, "SLURM_JOB_ID": hostile + "1"})


def test_sanitize_keeps_plain_values() -> None:
    assert sanitize_component("slurm-c1-1234-r0-s0") == "slurm-c1-1234-r0-s0"


@pytest.mark.parametrize("hostile", ["../../x", "..", ".hidden", "-rf", "", "a/b\x00c", "x" * 500])
def test_sanitize_component_alone(hostile: str) -> None:
    """The keys above all start with the launcher's name, so the leading-dot rule is tested here directly."""
    clean = sanitize_component(hostile)
    assert clean and not clean.startswith((".", "-")) and ".." not in clean, clean
    assert "/" not in clean and "\x00" not in clean and len(clean) <= 120, clean
    assert clean != sanitize_component(hostile + "1")


@pytest.mark.parametrize(
    "env,needle",
    [
        ({**SLURM, "SLURM_PROCID": "x"}, "SLURM_PROCID='x'"),
        ({**SLURM, "SLURM_PROCID": "9"}, "rank 9 is outside world size 8"),
        ({**TORCHRUN, "WORLD_SIZE": "0"}, "world size 0"),
        ({"PMIX_RANK": "0", "PMIX_NAMESPACE": "ns"}, "export WORLD_SIZE"),
    ],
)
def test_bad_values_are_clear_errors(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigurationError, match=None) as info:
        detect(env)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    ("env", "hint"), [(SLURM, "srun --nodes x --ntasks-per-node"), (TORCHRUN, "torchrun --nnodes x --nproc-per-node")]
)
def test_validate_settings_checks_the_trainer_against_the_launcher(env: dict[str, str], hint: str) -> None:
    """A trainer's num_nodes x devices must be the launcher's world size: ranks waiting for processes the
    launcher never started would never meet. The message says both counts, this rank and what to change."""
    ident = detect(env)
    world = ident.world_size
    ident.validate_settings(num_devices=world // 2, num_nodes=2)
    ident.validate_settings(num_devices=world, num_nodes=1)
    with pytest.raises(ConfigurationError) as info:
        ident.validate_settings(num_devices=world, num_nodes=2)
    message = str(info.value)
    assert f"num_nodes=2 x devices={world} = {2 * world} processes" in message
    assert f"{ident.launcher} started {world} (this is rank {ident.rank})" in message
    assert hint in message


# (case, env, processes on this node as the launcher says; None: it does not)
STEP = {**SLURM, "SLURM_STEP_NUM_NODES": "2", "SLURM_JOB_NUM_NODES": "2"}
LOCAL_SIZES = [
    ("nothing", {}, 1),
    ("slurm step", {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}, 4),
    ("slurm even step on some nodes of the allocation", {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "4"}, 4),
    ("slurm uneven, node 1", {**STEP, "SLURM_STEP_TASKS_PER_NODE": "5,3"}, 3),
    (
        "slurm compressed, node 1",
        {**STEP, "SLURM_STEP_TASKS_PER_NODE": "2,6(x2)", "SLURM_STEP_NUM_NODES": "3", "SLURM_JOB_NUM_NODES": "3"},
        6,
    ),  # fmt: skip
    # An uneven step on fewer nodes than the allocation: nemo_safe does not rely on SLURM_NODEID indexing it.
    (
        "slurm uneven step on some nodes",
        {**STEP, "SLURM_STEP_TASKS_PER_NODE": "5,3", "SLURM_JOB_NUM_NODES": "4"},
        None,
    ),  # fmt: skip
    ("slurm allocation's list only", {**SLURM, "SLURM_TASKS_PER_NODE": "4(x2)"}, None),
    ("slurm without a list", SLURM, None),
    ("slurm list malformed", {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "4(2)"}, None),
    ("torchrun", {**TORCHRUN, "LOCAL_WORLD_SIZE": "8"}, 8),
    ("torchrun without LOCAL_WORLD_SIZE", TORCHRUN, None),
    ("torchrun LOCAL_WORLD_SIZE not a number", {**TORCHRUN, "LOCAL_WORLD_SIZE": "eight"}, None),
    # deepspeed-style: torchrun's variables without GROUP_RANK, so nothing numbers the nodes
    (
        "torchrun look-alike without GROUP_RANK",
        {k: v for k, v in {**TORCHRUN, "LOCAL_WORLD_SIZE": "8"}.items() if k != "GROUP_RANK"},
        None,
    ),  # fmt: skip
    # Open MPI's and PMIx's NODE_RANK count the processes on a node across jobs, not the nodes
    ("open mpi", {**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, None),
    (
        "pmix",
        {"PMIX_RANK": "1", "PMIX_NAMESPACE": "ns", "PMIX_SIZE": "4", "PMIX_LOCAL_SIZE": "2", "PMIX_NODE_RANK": "0"},
        None,
    ),  # fmt: skip
]


@pytest.mark.parametrize("case,env,size", LOCAL_SIZES, ids=[t[0] for t in LOCAL_SIZES])
def test_local_world_size(case: str, env: dict[str, str], size: int | None) -> None:
    """The node's process count for ``rank_zero_first(local=True)``, given only with a node index that numbers
    nodes; a missing or odd one is None (that form then refuses), never an error for anything else."""
    assert detect(env).local_world_size == size
