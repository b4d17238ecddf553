"""The NeMo series: what each patch takes from nemo_safe and where it goes."""

from __future__ import annotations

import ast
from pathlib import Path

from series import HERE, Series, UpstreamPatch, _copy_tests
from source_edit import EditError, definitions, insert_before_def, overlay_file, replace_function, replace_once

# --------------------------------------------------------------------------------------------- NeMo

#: PR 2: what nemo_safe/patches/nemo_resume_upstream.py holds after its imports, verbatim, before check_resume().
RESUME_UPSTREAM = "patches.nemo_resume_upstream"
RESUME_IMPORTS = (
    ("import glob\n", "import contextlib\nimport glob\nimport itertools\nimport json\n"),
    ("import signal\n", "import signal\nimport socket\n"),
    ("import sys\n", "import sys\nimport threading\n"),
    ("import time\nimport warnings\n", "import time\nimport uuid\nimport warnings\n"),
    (
        "from typing import Any, Collection, Dict, List, Optional, Tuple, Union\n",
        "from typing import Any, Callable, Collection, Dict, List, Optional, Tuple, Union\n",
    ),
    (
        "from nemo.constants import NEMO_ENV_VARNAME_TESTING, NEMO_ENV_VARNAME_VERSION\n",
        "from nemo.constants import NEMO_ENV_VARNAME_RESUME_CHECKED, NEMO_ENV_VARNAME_TESTING, "
        "NEMO_ENV_VARNAME_VERSION\n",
    ),
)
RESUME_CONSTANT = (
    'NEMO_ENV_VARNAME_VERSION = "NEMO_EXPM_VERSION"  # Used for nemo.utils.exp_manager versioning\n',
    'NEMO_ENV_VARNAME_VERSION = "NEMO_EXPM_VERSION"  # Used for nemo.utils.exp_manager versioning\n'
    "# Set by global rank 0 of Lightning's own launcher once check_resume() ran, for the ranks it starts in fit()\n"
    'NEMO_ENV_VARNAME_RESUME_CHECKED = "NEMO_EXPM_RESUME_CHECKED"\n',
)
RESUME_CALL_BEFORE = """\
    check_resume(
        trainer,
        log_dir,
        cfg.resume_if_exists,
        cfg.resume_past_end,
        cfg.resume_ignore_no_checkpoint,
        cfg.checkpoint_callback_params.dirpath,
        cfg.resume_from_checkpoint,
    )
"""
RESUME_CALL_AFTER = """\
    # Global rank 0 moves old files out of log_dir before the other ranks use it (#7460, #9952); the ranks it
    # releases take its version (get_log_dir() gives a new version to rank 0 only, #8604).
    seconds_to_sleep, log_dir, version = _check_resume_in_order(trainer, cfg, log_dir, exp_dir, name, version)
"""
RESUME_SLEEP_BEFORE = """\
        # sleep other ranks so rank 0 can finish
        # doing the initialization such as moving files
        time.sleep(cfg.seconds_to_sleep)
"""
RESUME_SLEEP_AFTER = """\
        # sleep other ranks so rank 0 can finish
        # doing the initialization such as moving files (unless they waited for it already)
        time.sleep(seconds_to_sleep)
"""


def _resume_definitions() -> str:
    """Everything after the imports of the upstream module (its ``if TYPE_CHECKING:`` block), comments included."""
    path = overlay_file(RESUME_UPSTREAM)
    text = path.read_text()
    guard = next(n for n in ast.parse(text).body if isinstance(n, ast.If))
    return "".join(text.splitlines(keepends=True)[guard.end_lineno :]).strip("\n") + "\n"


def _nemo_ordered_check_resume(tree: Path) -> None:
    path = tree / "nemo/utils/exp_manager.py"
    insert_before_def(path, "check_resume", _resume_definitions())
    for old, new in RESUME_IMPORTS:
        replace_once(path, old, new)
    replace_once(tree / "nemo/constants.py", *RESUME_CONSTANT)
    replace_once(path, RESUME_CALL_BEFORE, RESUME_CALL_AFTER)
    replace_once(path, RESUME_SLEEP_BEFORE, RESUME_SLEEP_AFTER)
    # After test_resume rather than at the end of the class, where PR 1 appends its tests: PR 2 applies alone.
    _insert_test_methods(
        tree, "tests/core/test_exp_manager.py", "tests/core/test_exp_manager_resume_order.py", "TestExpManager"
    )
    _copy_tests("nemo", tree, "tests/core/test_exp_manager_resume_race.py")


def _class_methods(additions: str, class_name: str) -> str:
    source = (HERE / "nemo" / additions).read_text()
    lines = source.splitlines(keepends=True)
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == class_name)
    first = min([cls.body[0].lineno, *(d.lineno for d in getattr(cls.body[0], "decorator_list", []))])
    return "".join(lines[first - 1 : cls.end_lineno])


def _method_of(path: Path, class_name: str, name: str) -> tuple[list[str], ast.FunctionDef]:
    """The lines of the upstream test file ``path`` and the node of its method ``class_name.name``."""
    lines = path.read_text().splitlines(keepends=True)
    cls = next(n for n in ast.parse("".join(lines)).body if isinstance(n, ast.ClassDef) and n.name == class_name)
    method = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if method is None:
        raise EditError(f"{path}: no method {class_name}.{name}")
    return lines, method


def _insert_test_methods(tree: Path, rel: str, additions: str, class_name: str, after: str = "test_resume") -> None:
    """Insert the methods of ``class_name`` in ``ci/upstream/nemo/<additions>`` into the same class of the
    upstream test file ``rel``, right after its method ``after``."""
    lines, method = _method_of(tree / rel, class_name, after)
    methods = _class_methods(additions, class_name)
    (tree / rel).write_text("".join(lines[: method.end_lineno]) + "\n" + methods + "".join(lines[method.end_lineno :]))


#: The local rank NeMo names the per-rank log file by (NeMo #8333): exp_manager.py, before and after.
LOG_RANK_BEFORE = (
    "    # Note: trainer.global_rank and trainer.is_global_zero are not set until trainer.fit, "
    "so have to hack around it\n"
    '    local_rank = int(os.environ.get("LOCAL_RANK", 0))\n'
)
LOG_RANK_AFTER = (
    "    # Before fit(), LOCAL_RANK may be unset (srun, #8333) but the trainer's cluster environment "
    "knows the local rank.\n"
    "    # LOCAL_RANK wins where set: single-device strategies report local rank 0 in every process "
    "(torchrun, devices=1).\n"
    '    local_rank = int(os.environ.get("LOCAL_RANK", trainer.local_rank))\n'
)


def _append_test_methods(tree: Path, rel: str, additions: str, class_name: str) -> None:
    """Append the methods of ``class_name`` in ``ci/upstream/nemo/<additions>`` to the same class of the
    upstream test file ``rel``, whose last statement that class must be (NeMo keeps one test class per file)."""
    path = tree / rel
    text = path.read_text()
    last = ast.parse(text).body[-1]
    ends_with_class = isinstance(last, ast.ClassDef) and last.name == class_name
    if not ends_with_class or not text.endswith("\n") or text.endswith("\n\n"):
        raise EditError(f"{path}: expected to end with class {class_name} and one newline")
    path.write_text(text + "\n" + _class_methods(additions, class_name))


def _nemo_log_rank(tree: Path) -> None:
    replace_once(tree / "nemo/utils/exp_manager.py", LOG_RANK_BEFORE, LOG_RANK_AFTER)
    _append_test_methods(
        tree, "tests/core/test_exp_manager.py", "tests/core/test_exp_manager_additions.py", "TestExpManager"
    )


RESUME_MESSAGE = """
check_resume() lets global rank 0 move every regular file of log_dir (all
but TensorBoard event files) into run_N/, whatever resume_if_exists says,
while the other ranks already list and use that directory; they are held
back only by a fixed time.sleep(seconds_to_sleep) (5 s, #7498) at the end
of exp_manager(), after they wrote their per-rank log files into log_dir.
When rank 0 reaches exp_manager() later than the others (a slower node, a
slow import), files vanish under the other ranks (#7460) and files of the
current run, such as their per-rank log files, are archived into run_0
(#9952). #15592 proposed a flag to disable the move instead (closed). And
get_log_dir() gives global rank 0 a new version folder but the ranks a
launcher started none, so they log into <exp_dir>/<name> (#8604, closed
unmerged).

Let the other ranks wait for rank 0's check_resume() and take its
version, over the filesystem (exp_manager() runs before torch.distributed
exists):
- Where: trainer.num_nodes * trainer.num_devices > 1 (the fixed sleep's
  own condition), ranks started by torchrun or SLURM
  (creates_processes_externally), is_global_rank_zero() agreeing with
  trainer.global_rank. The ranks meet in
  <explicit_log_dir or exp_dir/name>/.exp_manager/<run>/, the same folder
  on every rank whatever the version. <run> hashes values that are equal
  on every rank of one run and differ between concurrent runs: under
  torchrun TORCHELASTIC_RUN_ID, MASTER_ADDR and MASTER_PORT (the store
  one agent binds; with a loopback address also the host name, as each
  node has its own), else SLURM_JOB_ID, SLURM_STEP_ID and
  SLURM_RESTART_COUNT (srun steps only); and which multi-rank
  exp_manager() call of the process it is (ranks call it alike). Under
  other launchers nothing changes, except Lightning's own (see below).
- Global rank 0 waits for nobody. It writes "state" (JSON, to a temporary
  name, then os.replace) saying that it checks, rewrites it every second
  from a thread while check_resume() runs, then writes how that ended:
  done, or its error, with its version; a success it rewrites every
  second for 120 s more (a rank that starts later tells it by its time;
  an error is not rewritten, so that a retry seconds later never takes it
  for its own run's).
- A non-zero rank reads "state" until rank 0 of this run is done, then
  takes rank 0's version (log_dir becomes <exp_dir>/<name>/<version>,
  built from its own exp_dir and name), runs its own check_resume() there
  (the lookup of the last checkpoint) and skips the fixed sleep. A state
  is this run's if it changed while the rank watched (only a live process
  changes it; a failed read is no change) or was written more than 5 s
  (clock skew) after this process started: a torchrun restart or a rerun
  in one SLURM step starts after every process of the earlier one ended,
  so an earlier run's state never releases anyone. A rerun that a shell
  runs as its last command (`python train.py; python train.py`) keeps the
  shell's process, started before the first run: its start is then taken
  as now minus the CPU time the thread spent, which is after that exec (a
  rank whose imports waited long on I/O sees rank 0's rewritten "done"
  a few seconds later than it could have).
- A rank that saw no rank 0 of this run within seconds_to_sleep carries on
  as today, with one warning: node-local or otherwise unshared exp_dirs
  keep working as they do, and no rank ever waits longer than today unless
  rank 0 of this run is seen working (fit() could not start before it
  anyway) or every other rank waits there too (below). A rank that starts
  up to 120 s after rank 0 finished still takes rank 0's rewritten "done"
  as this run's.

Review points on the earlier version (two PRs, arrival files and a "done"
marker), one by one:
- Rank 0's failure now reaches the others as soon as it is written: they
  run their own check_resume() (an error every rank meets, such as
  NotFoundError without a checkpoint, is NeMo's own on every rank, as
  today), then raise RuntimeError with rank 0's host, pid and error,
  instead of going on into fit() to hang at the rendezvous.
- Liveness is a heartbeat: while rank 0's state keeps changing the others
  wait, up to the strategy's process-group timeout (DDPStrategy(timeout=),
  30 min by default); once it has not changed for 120 s (killed, stopped,
  cut off from the folder; longer than NFS and FUSE attribute caches keep
  an old view) they carry on as today, with a warning: a rank 0 that
  recovers finds them in fit(), as it would today. A rank that was
  stopped itself (a suspended job) counts that time neither as rank 0's
  silence nor against the timeout; a read that hung counts only against the
  timeout (so reads that all hang end too); and a read that fails once rank
  0 was seen (a rename on a FUSE mount) is neither absence nor life. The 600 s cap and the 10 s
  re-listing are gone.
- A late or missing non-zero rank: rank 0 waits for nobody, so no rank
  delays it or makes the others give up.
- A rank 0 later than seconds_to_sleep: with more than 2 ranks, each
  waiting rank creates an empty rank<N>.<time> (its arrival) in the folder
  and removes it when it returns. A rank that saw no rank 0 by
  seconds_to_sleep lists the folder once: if every other non-zero rank of
  this run waits there too (records since this process started, less the 5
  s skew), rank 0 is late, not meeting elsewhere, and it keeps waiting, at
  most 120 s more; a "done" it cannot take as this run's is an earlier
  round's (a torchrun restart: the new round is ordered too), since this
  run's rank 0 keeps rewriting its own. That is the cost where rank 0 alone
  checks elsewhere (another working directory, or it could not write its
  state) or finished more than 120 s before every other rank started, the
  cases where a rank may wait longer than today for nothing. Arrival
  records are back for this only: nobody waits for them, and rank 0 never
  reads them. With 2 ranks nothing tells a late rank 0 from one that meets
  elsewhere: rank 1 carries on after seconds_to_sleep, as today (raise it
  where rank 0 is often that late).
- A state listed but not found by its name: a FUSE client may answer "no
  such file" for a while after a lookup found nothing (negative_timeout),
  so rank 1's first poll can hide a rank 0 that comes a second later. The
  same listing at seconds_to_sleep counts a state it lists but cannot
  stat as rank 0's presence: rank 1 keeps waiting, at most 120 s more,
  with any number of ranks. (Measured with rank 1 reading through a
  bindfs view caching failed lookups for 8 s: without this, rank 1 missed
  a rank 0 entering 4 s late and returned in the middle of its move.) An
  NFS client may show the same where its listing is fresher than its
  cached lookups; not measured. A state that exists but cannot be read
  (empty, another user's) is no such sign.
- One PR: the former PRs 2 and 3 are merged, so no API is added and then
  changed; every new name is private; the environment constant is in
  nemo/constants.py; exp_manager.py's typing (Dict, Optional, Tuple) and
  NeMo's logging (a line when a rank starts waiting, one every 30 s, one
  when released).
- Windows: os.replace() onto "state" while another rank reads it raises
  PermissionError there; it is retried (up to 5 s).
- Tests: no wall-clock assertions (waits run on an injected clock and
  sleep, the fixed sleep is recorded, not timed); the torchrun race test
  is marked integration.

Lightning's own launcher: its main process runs exp_manager() before the
other ranks exist; it exports NEMO_EXPM_RESUME_CHECKED=<its pid>:<call>
(as it exports NEMO_EXPM_VERSION), and the ranks it starts in fit() find
it and skip the sleep, whatever their log_dir. On by default where it
applies: those are the runs whose fixed sleep is meant to order rank 0's
move. What stays on disk: .exp_manager/<run>/state, a few hundred bytes
per run (a rank 0 that exits while it writes may leave a .state.<hex>
temporary, a killed waiting rank its empty rank<N>.<time>).

All in nemo/utils/exp_manager.py (a few lines in exp_manager(), 6
imports, new private functions before check_resume()) and one constant
in nemo/constants.py. No new package, option or dependency.

Tested: tests/core/test_exp_manager.py, TestExpManager: seventeen tests
play ranks with torchrun's variables, the other ranks as threads: rank 0
moves and releases rank 1; an unversioned rank 1 takes rank 0's version
folder and skips the sleep; rank 0's OSError reaches rank 1 as
RuntimeError; a NotFoundError rank 0 meets is rank 1's own NotFoundError;
a rank 0 that finished before rank 1 looked releases it at once; a beating
rank 0 is waited for past the silence limit, up to the timeout, then not;
a stopped one holds nobody after 120 s, nor do reads that all hang, after
the timeout, while a suspended job keeps waiting for rank 0 after it
resumes; rank 0 rewrites a successful "done" for _RESUME_ORDER_SILENCE s,
then stops, and an error not at all; a failed read after seconds_to_sleep
keeps rank 1 waiting for a rank 0 still checking; a state of an earlier
run releases nobody, even with a failed read in between; a rank 0 later
than seconds_to_sleep is waited for while every other rank waits (also
after an earlier round's "done"; not without them, nor for an earlier
run's record), for at most 120 s more, and so is one whose state is listed
but not found by its name; the start counted from a shell's exec; two
ranks not sharing the folder go on after seconds_to_sleep; Lightning's
launcher. All but the one for ranks not sharing the folder fail before
this change (most on importing the new helpers, which they drive directly
with a fake clock).
tests/core/test_exp_manager_resume_race.py starts 4 ranks with torchrun on
a log_dir holding 2000 old files and a last checkpoint, seconds_to_sleep
3 s, rank 0 entering exp_manager() 6 s late: run_0 must hold exactly the
old files (before this change the other ranks' log files, written 6 s
before the move, are archived too), no other rank may see an old file
after exp_manager() returned, and every rank must resume from the last
checkpoint. It fails before this change and passes after it on
nemo_toolkit 3.0.0 and 2.7.3.
"""


#: PR 3: what nemo_safe/patches/nemo_downloads_upstream.py holds (cloud.py gets the helpers and the function,
#: megatron_utils.py its _download).
DOWNLOADS_UPSTREAM = "patches.nemo_downloads_upstream"


def _nemo_atomic_downloads(tree: Path) -> None:
    cloud = tree / "nemo/utils/cloud.py"
    insert_before_def(
        cloud, "maybe_download_from_cloud", definitions(DOWNLOADS_UPSTREAM, ("_partial_path", "download_atomically"))
    )
    replace_function(
        cloud, "maybe_download_from_cloud", definitions(DOWNLOADS_UPSTREAM, ("maybe_download_from_cloud",))
    )
    replace_once(cloud, "import urllib.request\n", "import urllib.request\nimport uuid\n")
    megatron = tree / "nemo/collections/common/tokenizers/megatron_utils.py"
    replace_function(megatron, "_download", definitions(DOWNLOADS_UPSTREAM, ("_download",)))
    replace_once(megatron, "import shutil\nimport urllib.request\n", "")
    replace_once(
        megatron,
        "from nemo.utils import logging\n",
        "from nemo.utils import logging\nfrom nemo.utils.cloud import download_atomically\n",
    )
    _copy_tests("nemo", tree, "tests/utils/test_cloud_download.py")


DOWNLOADS_MESSAGE = """
Both write a download straight into a name other processes use:

- maybe_download_from_cloud() (ModelPT.from_pretrained of an NGC model)
  re-uses any file it finds at the destination and urlretrieve()s into
  the destination itself. Every rank of a job builds its model; a rank
  that starts while another downloads re-uses the partial file and fails
  restoring a truncated .nemo archive, and a download that breaks off
  leaves the truncated file for every later call. refresh_cache=True
  deletes the file and downloads into its name again: a rank that starts
  meanwhile re-uses that partial file too.
- megatron_utils._download() is rank-gated only once torch.distributed is
  initialized. Tokenizers are built before that (model construction), so
  every rank downloads into the same path + ".tmp" and moves it; the
  second to finish finds it gone and raises FileNotFoundError (#12420,
  closed as stale; workaround: pre-fill MEGATRON_CACHE).

Download into a temporary name of the calling process in the same
directory and publish it with os.replace() (download_atomically() in
nemo/utils/cloud.py): the final name holds a complete file or none, and
concurrent downloads never share a file. A refresh replaces the old file
whole instead of deleting it first (its "Deleting file" log line goes).
Nothing else changes: the retries, the other log lines, the return
values, the rank gate and barrier once torch.distributed exists. Several
ranks may still download the same file at once; each gets a complete one.

Tested: tests/utils/test_cloud_download.py against a local HTTP server.
test_broken_download_leaves_no_file_to_reuse breaks every response off
halfway and requires ValueError after the three attempts with nothing
left in the cache folder (before this change a half-size model.nemo stays
and is re-used by the next call); test_megatron_download_twice_at_once
_before_distributed runs two _download() calls of one file in two threads
(the server sends it in 0.1 s chunks) and requires both to succeed with
one complete file (before this change one raises FileNotFoundError);
test_download_and_reuse (download, re-use, refresh) passes before and
after. Together under 5 s after NeMo's import, CPU only. Verified on
nemo_toolkit 3.0.0; 2.x downloads with wget.download() instead of
urllib, so the change does not apply there as is.
"""


NEMO = Series(
    project="nemo",
    distribution="nemo_toolkit",
    base_version="3.0.0",
    verified=("3.0.0", "2.7.3"),
    # Both releases ship the same tests/core/test_exp_manager.py (taken from 2.7.3's wheel): run whole on the
    # base release; on 2.7.3 the series' own tests and its race tests unpatched (CI time).
    whole_files_on=("3.0.0",),
    # The package markers too: NeMo imports the module as tests.core.test_exp_manager, whose ExampleModel
    # restore_from() accepts only under its allowed "tests.core." prefix (3.0.0's wheel ships no tests/).
    upstream_files=tuple(
        (path, "nemo_toolkit", "2.7.3")
        for path in (
            "tests/__init__.py",
            "tests/core/__init__.py",
            "tests/core/test_exp_manager.py",
            "tests/utils/__init__.py",
        )
    ),
    patches=(
        UpstreamPatch(
            "exp-manager-log-local-rank",
            "exp_manager: take the per-rank log file's local rank from the trainer",
            """
exp_manager() names the per-rank log file
nemo_log_globalrank-<g>_localrank-<l>.txt with l = LOCAL_RANK (0 when
unset) and g = trainer.node_rank * trainer.num_devices + l, and sets
logging.rank = g. It runs before trainer.fit(), and under srun nothing has
exported LOCAL_RANK by then (#8333): every task of a node takes l = 0 and
the node's first global rank, so all tasks of a node append to one log
file (2 files for 2 nodes x 2 tasks), logging.rank is wrong on all but one
task per node, and log_local_rank_0_only (2.7.x) logs on every task.

The trainer knows the local rank already: Lightning picks its cluster
environment (TorchElastic, SLURM, ...) when the Trainer is constructed, and
the environment reads the launcher's variables. What a fresh Trainer
reports before fit() (Lightning 2.4, accelerator="cpu"; ranks 0..3 in
order; "2x2" is devices=2, num_nodes=2, strategy="ddp"):

  launcher (Trainer)            | env     | local   | global  | node    | names today -> after
  ------------------------------+---------+---------+---------+---------+----------------------------
  one process (defaults)        | single  | 0       | 0       | 0       | g0_l0 -> same
  Lightning's launcher, main    | Lightn. | 0       | 0       | 0       | g0_l0 -> same
    process before fit() (2x1)  |         |         |         |         |
  ... its child (LOCAL_RANK=1)  | Lightn. | 1       | 1       | 0       | g1_l1 -> same
  torchrun 2x2 (RANK, LOCAL_    | TorchE. | 0 1 0 1 | 0 1 2 3 | 0 0 1 1 | g0_l0 g1_l1 g2_l0 g3_l1
    RANK, GROUP_RANK, ...)      |         |         |         |         |   -> same
  srun -J train -N2             | SLURM   | 0 1 0 1 | 0 1 2 3 | 0 0 1 1 | g0_l0 g0_l0 g2_l0 g2_l0
    --ntasks-per-node=2 (2x2)   |         |         |         |         |   -> g0_l0 g1_l1 g2_l0 g3_l1
  same, --distribution=cyclic   | SLURM   | 0 0 1 1 | 0 1 2 3 | 0 1 0 1 | g0_l0 g2_l0 g0_l0 g2_l0
                                |         |         |         |         |   -> g0_l0 g2_l0 g1_l1 g3_l1
  srun -J bash (interactive:    | Lightn. | 0 0 0 0 | 0 0 0 0 | 0 0 0 0 | g0_l0 (x4) -> same
    Lightning ignores SLURM)    |         |         |         |         |
  srun + torchrun (2x2)         | TorchE. | as torchrun               | -> same
  torchrun --nproc-per-node=4,  | single  | 0 0 0 0 | 0 0 0 0 | 0 0 0 0 | g0_l0 g1_l1 g2_l2 g3_l3
    devices=1 (one-device jobs) |         |         |         |         |   -> same
  srun -n2, devices=1           | single  | 0 0     | 0 0     | 0 0     | g0_l0 (x2) -> same
  mpirun -np 4 (no mpi4py, 2x2) | Lightn. | 0 0 0 0 | 0 0 0 0 | 0 0 0 0 | g0_l0 (x4) -> same

(num_devices is the Trainer's devices in every row; srun -n4 without
--ntasks-per-node already fails in Trainer(), Lightning requires it.)

Take the local rank from the trainer where nothing has exported LOCAL_RANK:
local_rank = int(os.environ.get("LOCAL_RANK", trainer.local_rank)).
LOCAL_RANK keeps precedence because single-device strategies report local
(and global) rank 0 in every process: under torchrun with devices=1,
trainer.local_rank alone would put four processes into one file. For the
same reason the global rank stays computed from node_rank, num_devices and
the local rank rather than trainer.global_rank (which would be SLURM_PROCID
with cyclic task distribution, but 0 in every one-device process). No row
of the table gets a name worse than today's; the stale comment ("not set
until trainer.fit") is replaced by why (2 of the lines added).

Tested: tests/core/test_exp_manager.py, TestExpManager:
test_per_rank_log_file_under_srun sets the SLURM variables of task 3 of an
srun step of 2 nodes x 2 tasks (monkeypatch, NEMO_TESTING=1,
seconds_to_sleep=0; no SLURM needed) and requires exactly
nemo_log_globalrank-3_localrank-1.txt; before this change the task writes
nemo_log_globalrank-2_localrank-0.txt, the file of task 2.
test_per_rank_log_file_keeps_local_rank_env (torchrun variables, devices=1)
requires nemo_log_globalrank-2_localrank-2.txt, as before this change. Both
together take under 2 s on CPU. The first fails before this change and both
pass after it, on nemo_toolkit 3.0.0 and 2.7.3.
""",
            _nemo_log_rank,
            tests=("tests/core/test_exp_manager.py",),
            race_tests=("tests/core/test_exp_manager.py::TestExpManager::test_per_rank_log_file_under_srun",),
            # LOCAL_RANK, where a launcher exports it, still names the file (as before).
            keeps_behaviour=(
                "tests/core/test_exp_manager.py::TestExpManager::test_per_rank_log_file_keeps_local_rank_env",
            ),
        ),
        UpstreamPatch(
            "exp-manager-ordered-check-resume",
            "exp_manager: let global rank 0 check log_dir before the other ranks use it, and give them its log_dir",
            RESUME_MESSAGE,
            _nemo_ordered_check_resume,
            tests=("tests/core/test_exp_manager.py", "tests/core/test_exp_manager_resume_race.py"),
            race_tests=(
                "tests/core/test_exp_manager_resume_race.py::test_check_resume_moves_old_files_before_other_ranks_continue",
            ),
            # Where nothing shows that rank 0 shares the folder, a rank carries on after seconds_to_sleep, as before.
            keeps_behaviour=(
                "tests/core/test_exp_manager.py::TestExpManager::test_resume_order_two_ranks_not_sharing_the_folder",
            ),
        ),
        UpstreamPatch(
            "cloud-atomic-downloads",
            "utils: download through a temporary name and os.replace, so that no process uses a partial file",
            DOWNLOADS_MESSAGE,
            _nemo_atomic_downloads,
            tests=("tests/utils/test_cloud_download.py",),
            race_tests=(
                "tests/utils/test_cloud_download.py::test_broken_download_leaves_no_file_to_reuse",
                "tests/utils/test_cloud_download.py::test_megatron_download_twice_at_once_before_distributed",
            ),
            keeps_behaviour=("tests/utils/test_cloud_download.py::test_download_and_reuse",),
            # 2.x downloads with wget.download(): the change is written against 3.0's urllib code.
            releases=("3.0.0",),
        ),
    ),
)
