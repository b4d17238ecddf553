"""The NeMo series: what each patch takes from nemo_safe and where it goes."""

from __future__ import annotations

import re
from pathlib import Path

from series import Series, UpstreamPatch, _copy_tests, _overlay_imports, _write_package
from source_edit import (
    definitions,
    insert_before_def,
    module_source,
    rename,
    replace_once,
    tidy_new_module,
)

# --------------------------------------------------------------------------------------------- NeMo

NEMO_WIDTH = 119  # NeMo's black/isort line length
NEMO_LICENSE = """\
# Copyright (c) 2025, NVIDIA CORPORATION.  All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

"""
NEMO_BARRIER = Path("nemo/utils/fs_barrier")
NEMO_RENAMES = {
    "Exceptions raised by nemo_safe.": "Exceptions raised by NeMo's filesystem barrier.",
    "every error nemo_safe raises": "every error of the filesystem barrier",
    "~nemo_safe.": "~nemo.utils.fs_barrier.",
    "NemoSafeError": "FilesystemBarrierError",
    ".nemo_safe": ".nemo_barrier",
    "NEMO_SAFE_POLL_MAX": "NEMO_BARRIER_POLL_MAX",
    "NEMO_SAFE_": "NEMO_",
    "nemo_safe: ": "",
    "nemo_safe-": "nemo-",
    "given to nemo_safe": "given to the barrier",
    "nemo_safe refuses": "NeMo refuses",
}
NEMO_ERRORS = (
    "NemoSafeError",
    "ConfigurationError",
    "UnsafeBarrierPath",
    "BarrierTimeout",
    "RankZeroAbsent",
    "RankZeroFailed",
)
NEMO_INIT = '''"""A barrier over a shared directory that works before ``torch.distributed`` is initialized.

``rank_zero_first(directory, world_size)`` runs its body on global rank 0 first and on
every other rank after rank 0's body returned; ranks come from the launcher's
environment (torchrun, SLURM, Open MPI, PMIx). See ``barrier.py`` for the protocol.
"""

from nemo.utils.fs_barrier.barrier import Barrier, Outcome, rank_zero_first
from nemo.utils.fs_barrier.barrier_channels import FileChannel, StoreChannel
from nemo.utils.fs_barrier.cluster_identity import ClusterIdentity, detect
from nemo.utils.fs_barrier.errors import (
    BarrierTimeout,
    ConfigurationError,
    FilesystemBarrierError,
    RankZeroAbsent,
    RankZeroFailed,
    UnsafeBarrierPath,
)

__all__ = [
    "Barrier",
    "BarrierTimeout",
    "ClusterIdentity",
    "ConfigurationError",
    "FileChannel",
    "FilesystemBarrierError",
    "Outcome",
    "RankZeroAbsent",
    "RankZeroFailed",
    "StoreChannel",
    "UnsafeBarrierPath",
    "detect",
    "rank_zero_first",
]
'''


def _nemo_barrier(tree: Path) -> None:
    modules = {
        "errors": module_source("errors", keep=NEMO_ERRORS),
        "atomic_files": module_source(
            "atomic_files",
            keep=(
                "TMP_PREFIX",
                "_FLAGS",
                "_OPEN_READ",
                "_OPEN_NEW",
                "temp_name",
                "publish",
                "T",
                "ESTALE_RETRIES",
                "_again_on_estale",
                "_read_whole",
                "read_if_exists",
                "listdir_if_exists",
                "unlink_if_exists",
            ),
        ),
        "waiting": module_source("waiting"),
        "cluster_identity": module_source("cluster_identity"),
        "barrier_channels": module_source("barrier_channels"),
        "barrier": module_source("barrier"),
    }
    # NeMo imports absolutely.
    modules = {n: re.sub(r"^from \.(\w*) import", _absolute_nemo, s, flags=re.M) for n, s in modules.items()}
    modules = {n: NEMO_LICENSE + s for n, s in modules.items()}
    _write_package(tree, NEMO_BARRIER, modules, NEMO_RENAMES, NEMO_WIDTH)
    init = tree / NEMO_BARRIER / "__init__.py"
    init.write_text(NEMO_LICENSE + NEMO_INIT)
    tidy_new_module(init, NEMO_WIDTH)
    _copy_tests("nemo", tree, "tests/core/test_fs_barrier.py")


def _absolute_nemo(match: re.Match[str]) -> str:
    module = match.group(1)
    return f"from nemo.utils.fs_barrier{'.' + module if module else ''} import"


EXP_MANAGER_DEFINITIONS = (
    "BARRIER_NAME",
    "_warned",
    "_warned_lock",
    "warn_once",
    "_trainer_world_size",
    "_launcher_count_hint",
    "meeting_dir",
    "ResumeOrder",
    "resume_order_for",
    "_store_reachable",
    "STORE_PROBE_SECONDS",
    "_store_answers",
)
#: NeMo logs through its own ``nemo.utils.logging``, which exp_manager.py imports as ``logging``.
NEMO_LOGGING = {"log.warning(": "logging.warning("}


def _nemo_exp_manager(tree: Path) -> None:
    path = tree / "nemo/utils/exp_manager.py"
    module = "patches.nemo_resume_order"
    raw = definitions(module, EXP_MANAGER_DEFINITIONS)
    insert_before_def(path, "check_resume", rename(raw, {**NEMO_RENAMES, **NEMO_LOGGING}))
    imports = rename(_overlay_imports(module, raw, "nemo.utils.fs_barrier", NEMO_WIDTH), NEMO_RENAMES)
    replace_once(
        path,
        "from nemo.utils.exceptions import NeMoBaseException\n",
        "from nemo.utils.exceptions import NeMoBaseException\n" + imports,
    )
    replace_once(path, "import sys\nimport time\n", "import sys\nimport threading\nimport time\n")
    replace_once(path, "import signal\nimport subprocess\n", "import signal\nimport socket\nimport subprocess\n")
    replace_once(
        path,
        "from collections import defaultdict\n",
        "from collections import defaultdict\nfrom collections.abc import Callable\n",
    )
    replace_once(
        path,
        "    log_dir, exp_dir, name, version = get_log_dir(\n",
        "    # Global rank 0 first, everyone after it, every rank with rank 0's log_dir (#7460, #9952, PR #8604).\n"
        "    resume_order = resume_order_for(trainer, is_global_rank_zero, cfg.seconds_to_sleep)\n"
        "    log_dir, exp_dir, name, version = get_log_dir(\n",
    )
    replace_once(
        path,
        "    check_resume(\n        trainer,\n        log_dir,\n",
        "    if resume_order is not None:\n"
        "        parts = resume_order.agree_log_dir((log_dir, exp_dir, name, version), cfg.explicit_log_dir)\n"
        "        log_dir, exp_dir, name, version = parts\n"
        "        run_check_resume = functools.partial(resume_order.check_resume, check_resume)\n"
        "    else:\n"
        "        run_check_resume = check_resume\n"
        "    run_check_resume(\n        trainer,\n        log_dir,\n",
    )
    replace_once(path, "import glob\n", "import functools\nimport glob\n")
    replace_once(
        path,
        "        # sleep other ranks so rank 0 can finish\n"
        "        # doing the initialization such as moving files\n"
        "        time.sleep(cfg.seconds_to_sleep)\n",
        "        # sleep other ranks so rank 0 can finish doing the initialization such as moving files,\n"
        "        # unless they waited for it already\n"
        "        seconds = cfg.seconds_to_sleep\n"
        "        time.sleep(seconds if resume_order is None else resume_order.sleep_left(seconds))\n",
    )
    _copy_tests("nemo", tree, "tests/core/test_exp_manager_resume_race.py")


def _nemo_local_rank(tree: Path) -> None:
    path = tree / "nemo/utils/exp_manager.py"
    code = definitions("patches.nemo_exp_manager", ("LOCAL_RANK_FIXED_FOR", "local_rank_from_launcher"))
    insert_before_def(path, "exp_manager", rename(code, NEMO_RENAMES))
    replace_once(
        path,
        '    local_rank = int(os.environ.get("LOCAL_RANK", 0))\n',
        "    local_rank = local_rank_from_launcher()\n",
    )
    _copy_tests("nemo", tree, "tests/core/test_exp_manager_srun_log_names.py")


NEMO = Series(
    project="nemo",
    distribution="nemo_toolkit",
    base_version="3.0.0",
    verified=("3.0.0", "2.7.3"),
    patches=(
        UpstreamPatch(
            "utils-fs-barrier",
            "utils: add a filesystem barrier that works before torch.distributed is initialized",
            """
exp_manager() runs before trainer.fit(), i.e. before torch.distributed is
initialized, so it cannot use torch.distributed.barrier() to order work
between ranks; #7497 proposed initializing the process group inside
exp_manager and was declined because it forces distributed on one GPU.

Add nemo.utils.fs_barrier: rank_zero_first(directory, world_size) runs its
body on global rank 0 first and on every other rank after rank 0's body
returned, using only atomic create/rename in a hidden subdirectory of a
shared directory (no flock: it is node-local or a no-op on many NFS, Lustre
and GPFS mounts). The same protocol also runs over torchrun's agent store
(StoreChannel: every worker reaches it before init_process_group, whatever
filesystem its node logs to). Ranks and an attempt key come from the
launcher's environment (torchrun, SLURM, Open MPI, PMIx; one class per
launcher, as Lightning's cluster environments); torchrun's key leaves out
TORCHELASTIC_RESTART_COUNT, which each agent counts for its own workers only.
A missing rank makes rank 0 time out naming the missing ranks, an exception
on rank 0 reaches every rank as RankZeroFailed, records of an earlier
attempt can never release a rank (sessions and nonces), and a successful
barrier leaves no files. Barrier.open() lets rank 0 go on without waiting and
accepts later ranks in the background; Barrier.wait(grace=...) raises
RankZeroAbsent when rank 0 shows no sign within the grace and not every other
rank is present (the ranks do not share the directory). Waiters poll with a
jittered backoff whose cap grows with the world size, and log a progress
line at most every 5 s. NEMO_BARRIER_TIMEOUT (default 1800 s) bounds the wait.

Tested: tests/core/test_fs_barrier.py starts 4 processes with torchrun;
rank 0 enters late and writes a file inside the barrier, every other rank
must see it complete; a rank that never arrives makes every rank fail with
its number. The same code is the barrier of the nemo_safe overlay, tested
there under torchrun and a two-node srun, on local disks and on a FUSE
mount with NFS-like attribute and negative-lookup caching.
""",
            _nemo_barrier,
        ),
        UpstreamPatch(
            "exp-manager-ordered-check-resume",
            "exp_manager: move old log files before the other ranks use log_dir",
            """
check_resume() lets global rank 0 move every regular file of log_dir into
run_N/ while the other ranks already list and use that directory; they only
sleep a fixed seconds_to_sleep (5 s) at the end of exp_manager(). When rank 0
reaches exp_manager() later than the others (a slower node, a slow import),
the other ranks return before the move: files vanish under them (#7460) and
files of the current run are archived into run_0 (#9952).

Order exp_manager's start-up: global rank 0 first, every other rank after
it, and every rank with rank 0's log_dir. Ranks meet where every rank of the
attempt is guaranteed to agree: under torchrun in the elastic agent's store,
elsewhere (srun, mpirun) in the hidden .nemo_barrier/ of exp_dir/name (or
explicit_log_dir), the part of log_dir that does not depend on the version
rank 0 picked (PR #8604: the other ranks get no version at all today). Rank 0
never waits: it runs check_resume() (lookup and move) and publishes how it
ended together with its log_dir. The other ranks wait for rank 0 only, take
its log_dir and run the lookup; if rank 0 failed they run it too, so that
they raise NeMo's own error where rank 0's was the same. They skip the fixed
sleep. Never worse than before: over a directory, a rank that saw no sign of
rank 0 within seconds_to_sleep and does not see every other rank there either
(node-local disks, another working directory) carries on exactly as before,
with one warning; so does every rank where is_global_rank_zero() and the
launcher disagree, and nothing changes without a multi-process launcher (one
process, Lightning's own local launcher before fit()). The trainer's
num_nodes x devices is cross-checked with the launcher's world size.

Tested: tests/core/test_exp_manager_resume_race.py starts 4 ranks with
torchrun on a log_dir holding 2000 old files and a last checkpoint, rank 0
entering exp_manager() 6 s late (longer than seconds_to_sleep, so without
this change the failure is certain): every other rank must see no old file
after exp_manager() returned, run_0 must hold exactly the old files, and
every rank must resume from the last checkpoint. Fails before this change,
passes after it, on nemo_toolkit 3.0.0 and 2.7.3.
""",
            _nemo_exp_manager,
        ),
        UpstreamPatch(
            "exp-manager-local-rank-under-srun",
            "exp_manager: take the local rank from the launcher when LOCAL_RANK is unset",
            """
exp_manager() computes global_rank = node_rank * num_devices + LOCAL_RANK,
with LOCAL_RANK defaulting to 0. It runs before trainer.fit(), and under
srun nothing has exported LOCAL_RANK yet (Lightning's SLURM environment
reads SLURM_LOCALID and exports nothing before fit()), so every task of a
node gets the node's first global rank: the per-rank log files
nemo_log_globalrank-<g>_localrank-<l>.txt of all tasks of a node collapse
into one file that they all append to, and logging.rank is wrong on all but
one task of each node.

Use LOCAL_RANK when it is set (torchrun, Lightning's own launcher) and the
launcher's local rank otherwise (SLURM_LOCALID, OMPI_COMM_WORLD_LOCAL_RANK,
...), through nemo.utils.fs_barrier's launcher detection. One process
without a launcher: 0, as before.

Tested: tests/core/test_exp_manager_srun_log_names.py runs exp_manager in
a real srun step of 2 nodes x 2 tasks (skipped where no SLURM cluster
answers) and requires 4 distinct per-rank log files; before this change
there are 2.
""",
            _nemo_local_rank,
        ),
    ),
)
