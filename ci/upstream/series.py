"""The two upstream patch series: what each patch takes from nemo_safe and where it goes.

Each patch is a commit message plus a function that edits a pristine release tree
(see ``source_edit``); ``make_patches.py`` runs them in order on the release and
turns the commits into ``git format-patch`` files. Test files come verbatim from
``ci/upstream/<project>/`` (upstream test layout); code comes from ``nemo_safe/``.
"""

from __future__ import annotations

import ast
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from source_edit import (
    constant,
    decorate_method,
    definitions,
    insert_before_def,
    module_source,
    overlay_file,
    rename,
    replace_function,
    replace_once,
    tidy_new_module,
    without_module_indirection,
)

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class UpstreamPatch:
    slug: str
    subject: str
    body: str
    apply: Callable[[Path], None]

    def message(self, signoff: str) -> str:
        return f"{self.subject}\n\n{self.body.strip()}\n\nSigned-off-by: {signoff}\n"


@dataclass(frozen=True)
class Series:
    project: str
    distribution: str
    #: The release the series is generated against; verified against all of ``verified``.
    base_version: str
    verified: tuple[str, ...]
    patches: tuple[UpstreamPatch, ...]


def _copy_tests(project: str, tree: Path, *relative: str) -> None:
    for rel in relative:
        target = tree / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(HERE / project / rel, target)


def _overlay_imports(module: str, used_in: str, package: str, width: int) -> str:
    """The overlay module's ``from nemo_safe... import`` lines, cut to the names ``used_in``
    needs, pointing at ``package`` instead."""
    lines = []
    for node in ast.parse(overlay_file(module).read_text()).body:
        if not (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nemo_safe")):
            continue
        names = sorted(a.name for a in node.names if re.search(rf"\b{a.name}\b", used_in))
        if names:
            target = package + node.module[len("nemo_safe") :]
            line = f"from {target} import {', '.join(names)}\n"
            if len(line) > width + 1:  # black's wrapping
                line = f"from {target} import (\n" + "".join(f"    {n},\n" for n in names) + ")\n"
            lines.append(line)
    return "".join(sorted(lines))


def _write_package(tree: Path, package: Path, modules: dict[str, str], renames: dict[str, str], width: int) -> None:
    """Write the cut-down overlay modules (``name -> source``) as a package and tidy them."""
    (tree / package).mkdir(parents=True, exist_ok=True)
    for name, source in modules.items():
        path = tree / package / f"{name}.py"
        path.write_text(rename(source, renames))
        tidy_new_module(path, width)


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

# ---------------------------------------------------------------------------------------- torchvision

TV_WIDTH = 120  # torchvision's black line length
TV_PACKAGE = Path("torchvision/datasets/_safe_download")
TV_RENAMES = {
    "Exceptions raised by nemo_safe.": "Exceptions raised by torchvision's dataset downloads.",
    "every error nemo_safe raises": "every error of a dataset download",
    "~nemo_safe.": "~torchvision.datasets._safe_download.",
    "NemoSafeError": "DownloadError",
    ".nemo_safe": ".torchvision_download",
    "NEMO_SAFE_BARRIER_TIMEOUT": "TORCHVISION_DOWNLOAD_TIMEOUT",
    "NEMO_SAFE_STALE_AFTER": "TORCHVISION_DOWNLOAD_STALE_AFTER",
    "NEMO_SAFE_": "TORCHVISION_",
    "nemo_safe: ": "",
    "nemo_safe-": "torchvision-",
    "nemo_safe": "torchvision",
}
TV_INIT = '''"""Dataset files that stay correct when several processes download them at once.

``atomic_files``: files are written under a temporary name and renamed into place when
complete. ``single_flight``: one process downloads into a dataset folder while the others
wait (used by the MNIST family through ``mnist_download``).
"""
'''
TV_ERRORS_1 = (
    "NemoSafeError",
    "DownloadIncomplete",
    "_typed",
    "_download_incomplete_class",
    "download_incomplete",
    "_rebuild_download_incomplete",
    "ChecksumMismatch",
    "UnsafeArchivePath",
)
TV_ERRORS_2 = (*TV_ERRORS_1, "ConfigurationError", "LeaderFailed", "LeaderDeposed", "WaitTimeout")


def without_leader_check(code: str) -> str:
    """The overlay's functions without their ``check_still_leading`` calls (a single-flight concept)."""
    return re.sub(r"^[ \t]*check_still_leading\([^)]*\)[^\n]*\n", "", code, flags=re.M)


def _tv_atomic(tree: Path) -> None:
    modules = {
        "__init__": TV_INIT,
        "errors": module_source("errors", keep=TV_ERRORS_1),
        "atomic_files": module_source("atomic_files"),
        "archive_members": module_source("archive_members"),
    }
    _write_package(tree, TV_PACKAGE, modules, TV_RENAMES, TV_WIDTH)
    path = tree / "torchvision/datasets/utils.py"
    module = "patches.torchvision_downloads"
    retrieve = definitions(module, ("urlretrieve",)).replace("def urlretrieve(", "def _urlretrieve(", 1)
    decompress = definitions(module, ("decompress",)).replace("def decompress(", "def _decompress(", 1)
    extractor = definitions(module, ("extract_tar_checked", "extract_zip_listed", "atomic_extractor"))
    for name in ("extract_tar_checked", "extract_zip_listed", "atomic_extractor"):
        extractor = re.sub(rf"\b{name}\b", f"_{name}", extractor)
    # The single flight (and its deposed-leader check) comes with the next patch, for MNIST only.
    retrieve, decompress, extractor = (without_leader_check(c) for c in (retrieve, decompress, extractor))
    retrieve, decompress = (rename(without_module_indirection(c), TV_RENAMES) for c in (retrieve, decompress))
    replace_function(path, "_urlretrieve", retrieve)
    replace_function(path, "_decompress", decompress, keep_head=True)
    replace_once(path, "_ARCHIVE_EXTRACTORS: dict[", rename(extractor, TV_RENAMES) + "\n\n_ARCHIVE_EXTRACTORS: dict[")
    replace_once(
        path,
        '    ".tar": _extract_tar,\n    ".zip": _extract_zip,\n',
        '    ".tar": _atomic_extractor(_extract_tar_checked, _extract_tar),\n'
        '    ".zip": _atomic_extractor(_extract_zip_listed(_extract_zip), _extract_zip),\n',
    )
    replace_once(
        path,
        "            _urlretrieve(url, fpath)\n        except (urllib.error.URLError, OSError) as e:",
        "            _urlretrieve(url, fpath, md5=md5)\n        except (urllib.error.URLError, OSError) as e:",
    )
    replace_once(
        path,
        "                _urlretrieve(url, fpath)\n            else:",
        "                _urlretrieve(url, fpath, md5=md5)\n            else:",
    )
    replace_once(
        path,
        "import bz2\nimport gzip\nimport hashlib\nimport lzma\n",
        "import bz2\nimport functools\nimport gzip\nimport hashlib\nimport http.client\nimport lzma\n",
    )
    replace_once(path, "import re\nimport tarfile\n", "import re\nimport shutil\nimport tarfile\n")
    imports = _overlay_imports(module, retrieve + decompress + extractor, "._safe_download", TV_WIDTH)
    anchor = (
        "from .._internally_replaced_utils import _download_file_from_remote_location, _is_remote_location_available\n"
    )
    replace_once(path, anchor, anchor + imports)
    _copy_tests("torchvision", tree, "test/test_datasets_utils_atomic.py")


def _tv_single_flight(tree: Path) -> None:
    modules = {
        "errors": module_source("errors", keep=TV_ERRORS_2),
        "waiting": module_source("waiting"),
        "cluster_identity": module_source("cluster_identity"),
        "idx_files": module_source("idx_files"),
        "single_flight": module_source("single_flight"),
        "mnist_download": module_source(
            "patches.torchvision_mnist",
            keep=(
                "log",
                "_warned",
                "raw_files",
                "preferred_leader",
                "validating_check_exists",
                "single_flight_download",
            ),
        ),
    }
    _write_package(tree, TV_PACKAGE, modules, TV_RENAMES, TV_WIDTH)
    path = tree / "torchvision/datasets/mnist.py"
    anchor = (
        "from .utils import _flip_byte_order, check_integrity, download_and_extract_archive, extract_archive, "
        "verify_str_arg\n"
    )
    replace_once(
        path,
        anchor,
        "from ._safe_download.mnist_download import single_flight_download, validating_check_exists\n" + anchor,
    )
    # The classes whose own methods the overlay replaces (FashionMNIST and KMNIST inherit MNIST's).
    for cls in constant("patches.torchvision_mnist", "CLASSES"):
        decorate_method(path, cls, "_check_exists", "validating_check_exists")
        decorate_method(path, cls, "download", "single_flight_download")
    _copy_tests("torchvision", tree, "test/test_datasets_download_race.py")


TORCHVISION = Series(
    project="torchvision",
    distribution="torchvision",
    base_version="0.29.1",
    verified=("0.29.1",),
    patches=(
        UpstreamPatch(
            "datasets-atomic-files",
            "datasets: publish downloaded, decompressed and extracted files atomically",
            """
_urlretrieve() opens the final path with "wb" and streams into it, and
_decompress() opens the final raw file with "wb" before decompressing, as
do the tar and zip extractors. A second process building the same dataset
(every rank of a DDP job with download=True, see pytorch/tutorials#3065,
pytorch/examples#1403, pytorch/pytorch#68320 and the warning added for
#8707), or a download that breaks off, or a killed process, leaves an empty,
truncated or mixed file under the final name, and later runs fail on it with
"File not found or corrupted." or crash while loading.

Write every such file under a temporary sibling name that carries the
writer's host and pid (.tmp.<name>~<host>~<pid>~<random>) and rename it
into place only when it is complete: all Content-Length bytes arrived and,
when download_url() was given an md5, the md5 matches (download_url() now
passes it to _urlretrieve()). Same-directory rename is atomic on local
filesystems, NFS, Lustre and GPFS, so a reader sees no file or a complete
one. Extraction goes into a temporary folder inside the destination and is
renamed file by file. Temporaries of dead writers on the same host are
removed on the next write into that directory. A broken-off download raises
DownloadIncomplete and a wrong md5 ChecksumMismatch, both RuntimeErrors, so
the mirror loops of the datasets go on to the next mirror as before.

Tested: test/test_datasets_utils_atomic.py serves files from a local HTTP
server on 127.0.0.1: a connection dropped mid-file and bytes with a wrong
md5 must leave no file under the final name (both fail before this change),
a good download and an extraction must leave the files and no temporaries.
""",
            _tv_atomic,
        ),
        UpstreamPatch(
            "mnist-single-flight",
            "datasets: download the MNIST family once per root across processes",
            """
With download=True every process that builds MNIST (and FashionMNIST,
KMNIST, EMNIST, QMNIST) downloads and extracts the same files at once, as
the FSDP tutorial's mp.spawn workers do (pytorch/tutorials#3065,
pytorch/examples#1403); EMNIST even removes raw/gzip while other processes
still extract from it. _check_exists() only tests that the raw files exist,
so an empty or truncated raw file left by a killed process crashes every
later load instead of being rebuilt.

download() now runs through a single flight in root/<Class>/: the first
process to create .torchvision_download/download.<generation> with link(2)
(atomic on local disks, NFS, Lustre and GPFS; no file locks) downloads and
extracts, the others wait and load the result. The leader rewrites its lock
every second with a growing beat, so a killed leader is replaced after
TORCHVISION_DOWNLOAD_STALE_AFTER seconds (30) without trusting mtimes or
other hosts' clocks, or after 3 s when it ran on this host and its pid is
gone; an error of the leader reaches every waiting process with its message.
Rank 0 (or local rank 0, from the launcher's variables or an initialized
process group) gets a short head start; with no rank known, correctness does
not depend on who leads. _check_exists() also checks each raw IDX file's
size against its header, so download=True rebuilds a truncated file.

Tested: test/test_datasets_download_race.py serves MNIST-format files from a
throttled HTTP server on 127.0.0.1 and starts 4 processes with torchrun, rank
i starting i * 1.5 s late while the largest file takes 2 s: every process
must load the right data and each file must be served once. Before this
change later ranks truncate the file earlier ranks are still writing and
fail with "File not found or corrupted." or load wrong data.
""",
            _tv_single_flight,
        ),
    ),
)

ALL = (NEMO, TORCHVISION)
