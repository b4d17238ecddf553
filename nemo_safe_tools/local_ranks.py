"""Start N local processes as one job, with torchrun-style launcher variables.

Used where no launcher started us (``nemo-safe selftest``/``demo`` on one
machine): each child sees RANK / WORLD_SIZE / LOCAL_RANK / GROUP_RANK and a
fresh TORCHELASTIC_RUN_ID, so cluster_identity gives it a rank and a shared
attempt key.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Mapping, Sequence

from nemo_safe.cluster_identity import without_launchers


def job_env(world: int, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment minus every launcher's variables, plus the job-wide torchrun-style ones."""
    env = without_launchers(os.environ)
    env.update(
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        GROUP_RANK="0",
        TORCHELASTIC_RUN_ID=f"local-{secrets.token_hex(6)}",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
    )
    env.update(extra or {})
    return env


def start(
    args: Sequence[str], world: int, extra_env: Mapping[str, str] | None = None, stderr: int | None = subprocess.PIPE
) -> list[subprocess.Popen[str]]:
    """Start ``world`` copies of ``args``, rank r with RANK=LOCAL_RANK=r; stdout is piped."""
    env = job_env(world, extra_env)
    return [
        subprocess.Popen(
            list(args),
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        for r in range(world)
    ]
