"""Who am I in this job? Rank, world size and an attempt key, from launcher variables alone.

One class per launcher, each with ``detect()`` (modelled on Lightning's
``lightning/fabric/plugins/environments/``). Nothing here talks to other
processes: every rank of one attempt computes the same ``attempt_key`` from its
environment, and a requeued or restarted attempt gets a different one, so
barrier files of an earlier attempt can never be mistaken for this one's.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from nemo_safe.errors import ConfigurationError

#: Job names under which SLURM is an interactive allocation, not the launcher (as in Lightning).
INTERACTIVE_SLURM_JOB_NAMES = ("bash", "interactive")

_MAX_KEY_LEN = 120

#: The variables launchers set to place a process in a job (the launcher classes below read them):
#: a child job started from a rank must not inherit them, or it is taken for a rank of this job.
LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMIX_", "TORCHELASTIC_")
LAUNCHER_NAMES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip


def without_launchers(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without any launcher's variables (:data:`LAUNCHER_PREFIXES`, :data:`LAUNCHER_NAMES`)."""
    return {k: v for k, v in env.items() if not k.startswith(LAUNCHER_PREFIXES) and k not in LAUNCHER_NAMES}


@dataclass(frozen=True)
class ClusterIdentity:
    """This process's place in the job, as the launcher describes it."""

    launcher: str
    rank: int
    local_rank: int
    node_rank: int
    world_size: int
    attempt_key: str
    warnings: tuple[str, ...] = field(default=())
    #: The key names this attempt only. False under torchrun: its restarts keep the run id and
    #: the agent's store address, and nothing else every worker sees tells the rounds apart.
    attempt_unique: bool = True
    #: Processes of this job on this node, where the launcher says so together with a node index that is the
    #: same on every process of the node and differs between nodes (torchrun, srun; ``rank_zero_first(local=True)``
    #: groups by them); else None. Open MPI's and PMIx's NODE_RANK count processes on a node, not nodes.
    local_world_size: int | None = None

    @property
    def is_multi_process(self) -> bool:
        return self.world_size > 1

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """:meth:`Launcher.validate_settings` of the launcher that started this process."""
        LAUNCHERS_BY_NAME.get(self.launcher, Launcher).validate_settings(self, num_devices, num_nodes)


def sanitize_component(raw: str, max_len: int = _MAX_KEY_LEN) -> str:
    """Turn launcher-provided text into one safe path component.

    Keeps ``[A-Za-z0-9._-]``, replaces the rest with ``_``, never starts with a
    dot, and appends a short hash of the raw text whenever anything changed, so
    that two hostile values cannot collapse onto the same key.
    """
    clean = re.sub(r"[^A-Za-z0-9._-]", "_", raw)
    clean = re.sub(r"\.{2,}", "_", clean)
    if clean.startswith((".", "-")) or not clean:
        clean = "_" + clean
    if clean != raw or len(clean) > max_len:
        digest = hashlib.sha256(raw.encode("utf-8", "surrogateescape")).hexdigest()[:12]
        clean = f"{clean[: max_len - 13]}-{digest}"
    return clean


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None or value == "":
        if default is None:
            raise ConfigurationError(f"launcher variable {name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigurationError(
            f"launcher variable {name}={value!r} is not an integer; " "check the job script that exports it"
        ) from None


def _optional_int(env: Mapping[str, str], name: str) -> int | None:
    """A count only some uses need: absent or malformed is None (those uses say so), never an error here."""
    value = env.get(name, "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def _tasks_on_this_node(env: Mapping[str, str], node: int) -> int | None:
    """This node's entry of the step's task list (``2(x3),1`` = 2, 2, 2, 1). An uneven list is indexed by
    ``SLURM_NODEID`` only where the step spans the whole allocation (where no reading of that variable differs)."""
    counts: list[int] = []
    for part in env.get("SLURM_STEP_TASKS_PER_NODE", "").split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            return None
        counts += [int(match[1])] * int(match[2] or 1)
    if len(set(counts)) == 1:
        return counts[0] or None
    spans_allocation = env.get("SLURM_STEP_NUM_NODES") == env.get("SLURM_JOB_NUM_NODES") == str(len(counts))
    return (counts[node] or None) if spans_allocation and 0 <= node < len(counts) else None


def _key(*parts: object) -> str:
    return sanitize_component("-".join(str(p) for p in parts if p not in (None, "")))


class Launcher:
    """Base class: ``detect()`` says whether this launcher started us, ``identity()`` reads it,
    ``validate_settings()`` checks a trainer's process count against it."""

    name = "none"
    #: Where this launcher's process count is set, for the message of :meth:`validate_settings`.
    count_hint = "the launcher's task count"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        raise NotImplementedError

    @classmethod
    def identity(cls, env: Mapping[str, str]) -> ClusterIdentity:
        raise NotImplementedError

    @classmethod
    def _make(cls, rank: int, local_rank: int, node_rank: int, world_size: int, key: str) -> ClusterIdentity:
        """Build and validate an identity; launchers only say where the numbers come from."""
        if world_size < 1:
            raise ConfigurationError(f"{cls.name}: world size {world_size} must be at least 1")
        if not 0 <= rank < world_size:
            raise ConfigurationError(
                f"{cls.name}: rank {rank} is outside world size {world_size}; "
                "check the launcher variables of this process"
            )
        return ClusterIdentity(cls.name, rank, local_rank, node_rank, world_size, key)

    @classmethod
    def validate_settings(cls, identity: ClusterIdentity, num_devices: int, num_nodes: int) -> None:
        """Raise :class:`ConfigurationError` unless a trainer of ``num_nodes`` x ``num_devices`` processes
        is what this launcher started: ranks waiting for a world size the launcher did not start never meet."""
        expected = int(num_nodes) * int(num_devices)
        if expected != identity.world_size:
            raise ConfigurationError(
                f"the trainer expects num_nodes={num_nodes} x devices={num_devices} = {expected} processes but "
                f"{cls.name} started {identity.world_size} (this is rank {identity.rank}). Make them match: set "
                f"devices to the tasks per node and num_nodes to the nodes, or change {cls.count_hint}"
            )


class TorchElastic(Launcher):
    """torchrun / torch.distributed.elastic. Wins over SLURM: under srun+torchrun,
    SLURM_PROCID is the node index, not the rank.

    The key leaves out ``TORCHELASTIC_RESTART_COUNT``: each agent counts only its own
    workers' failures, so after one failure the nodes of one round disagree on it.
    """

    name = "torchrun"
    count_hint = "torchrun --nnodes x --nproc-per-node (WORLD_SIZE)"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))

    @classmethod
    def identity(cls, env: Mapping[str, str]) -> ClusterIdentity:
        key = _key(
            "torchrun",
            env.get("SLURM_CLUSTER_NAME"),
            env.get("SLURM_JOB_ID"),
            env.get("TORCHELASTIC_RUN_ID", "none"),
            f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}",
        )
        node_rank = _int(env, "GROUP_RANK", _int(env, "NODE_RANK", 0))
        ident = cls._make(_int(env, "RANK"), _int(env, "LOCAL_RANK"), node_rank, _int(env, "WORLD_SIZE"), key)
        # GROUP_RANK is the node index torchrun's rendezvous assigns; a look-alike launcher without it gives no nodes.
        local_size = _optional_int(env, "LOCAL_WORLD_SIZE") if env.get("GROUP_RANK", "").isdigit() else None
        return replace(ident, attempt_unique=False, local_world_size=local_size)


class Slurm(Launcher):
    """srun tasks. An allocation named ``bash``/``interactive`` is a shell, not a launcher."""

    name = "slurm"
    count_hint = "srun --nodes x --ntasks-per-node (SLURM_STEP_NUM_TASKS / SLURM_NTASKS)"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in INTERACTIVE_SLURM_JOB_NAMES

    @classmethod
    def identity(cls, env: Mapping[str, str]) -> ClusterIdentity:
        if env.get("SLURM_ARRAY_JOB_ID"):
            job = f"{env['SLURM_ARRAY_JOB_ID']}_{env.get('SLURM_ARRAY_TASK_ID', '')}"
        else:
            job = env.get("SLURM_JOB_ID", "")
        key = _key(
            "slurm",
            env.get("SLURM_CLUSTER_NAME"),
            job,
            "r" + env.get("SLURM_RESTART_COUNT", "0"),
            "s" + env.get("SLURM_STEP_ID", "batch"),
            env.get("SLURM_JOB_START_TIME"),
        )
        world = _int(env, "SLURM_STEP_NUM_TASKS", _int(env, "SLURM_NTASKS"))
        node = _int(env, "SLURM_NODEID", 0)
        ident = cls._make(_int(env, "SLURM_PROCID", 0), _int(env, "SLURM_LOCALID", 0), node, world, key)
        return replace(ident, local_world_size=_tasks_on_this_node(env, node))


class OpenMPI(Launcher):
    """mpirun from Open MPI."""

    name = "openmpi"
    count_hint = "mpirun -np (OMPI_COMM_WORLD_SIZE)"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env

    @classmethod
    def identity(cls, env: Mapping[str, str]) -> ClusterIdentity:
        job = (
            env.get("PMIX_NAMESPACE")
            or env.get("OMPI_MCA_ess_base_jobid")
            or env.get("OMPI_MCA_orte_ess_jobid")
            or env.get("OMPI_MCA_orte_hnp_uri", "")
        )
        return cls._make(
            _int(env, "OMPI_COMM_WORLD_RANK"),
            _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
            _int(env, "OMPI_COMM_WORLD_NODE_RANK", 0),
            _int(env, "OMPI_COMM_WORLD_SIZE"),
            _key("openmpi", job),
        )


class PMIx(Launcher):
    """A PMIx launcher (prrte, some srun --mpi=pmix set-ups without SLURM task variables)."""

    name = "pmix"
    count_hint = "the PMIx launcher's process count (PMIX_SIZE)"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return "PMIX_RANK" in env and "PMIX_NAMESPACE" in env

    @classmethod
    def identity(cls, env: Mapping[str, str]) -> ClusterIdentity:
        size = _int(env, "PMIX_SIZE", _int(env, "WORLD_SIZE", 0))
        if size == 0:
            raise ConfigurationError(
                "PMIx launcher detected (PMIX_RANK is set) but no world size: "
                "export WORLD_SIZE in the job script or pass world_size explicitly"
            )
        return cls._make(
            _int(env, "PMIX_RANK"),
            _int(env, "PMIX_LOCAL_RANK", 0),
            _int(env, "PMIX_NODE_RANK", 0),
            size,
            _key("pmix", env.get("PMIX_NAMESPACE")),
        )


class NoLauncher(Launcher):
    """A single process (or Lightning's own local launcher before ``fit()``)."""

    name = "none"
    count_hint = "the launch (one process here: start the others with srun or torchrun)"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return True

    @classmethod
    def identity(cls, env: Mapping[str, str]) -> ClusterIdentity:
        warnings: list[str] = []
        if "SLURM_NTASKS" in env:
            warnings.append(
                f"SLURM job named {env.get('SLURM_JOB_NAME')!r} is treated as an interactive "
                "shell, not as the launcher (as Lightning does); submit with -J <name> "
                "if this is a multi-task srun step"
            )
        return ClusterIdentity(cls.name, 0, 0, 0, 1, _key("local", os.getpid()), tuple(warnings), local_world_size=1)


#: Detection order: the first launcher whose ``detect()`` is true wins.
LAUNCHERS: tuple[type[Launcher], ...] = (TorchElastic, Slurm, OpenMPI, PMIx, NoLauncher)
LAUNCHERS_BY_NAME: dict[str, type[Launcher]] = {launcher.name: launcher for launcher in LAUNCHERS}


def detect(env: Mapping[str, str] | None = None) -> ClusterIdentity:
    """The identity of this process according to the first launcher that detects itself."""
    env = os.environ if env is None else env
    for launcher in LAUNCHERS:
        if launcher.detect(env):
            return launcher.identity(env)
    raise AssertionError("NoLauncher always detects")  # pragma: no cover
