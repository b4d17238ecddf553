"""The NeMo series: what each patch takes from nemo_safe and where it goes."""

from __future__ import annotations

import ast
from pathlib import Path

from series import HERE, Series, UpstreamPatch, _copy_tests
from source_edit import EditError, insert_before_def, replace_once

# --------------------------------------------------------------------------------------------- NeMo

#: The new functions of PR 2, verbatim: everything after the ``check_resume`` stand-in of this file.
RESUME_SOURCE = HERE / "nemo" / "exp_manager_resume.py"
RESUME_BEFORE_GET_LOG_DIR = "    log_dir, exp_dir, name, version = get_log_dir(\n"
RESUME_UNVERSIONED = (
    "    # Without any of these, get_log_dir() gives global rank 0 a new version and the other ranks none.\n"
    "    unversioned = trainer.logger is None and not (\n"
    "        cfg.explicit_log_dir or cfg.resume_if_exists or cfg.version or os.environ.get(NEMO_ENV_VARNAME_VERSION)\n"
    "    )\n"
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
    # Global rank 0 moves old files out of log_dir before the other ranks use it (#7460, #9952).
    seconds_to_sleep = check_resume_in_order(trainer, cfg, log_dir, unversioned)
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
    text = RESUME_SOURCE.read_text()
    stand_in = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == "check_resume")
    return "".join(text.splitlines(keepends=True)[stand_in.end_lineno :])


def _nemo_ordered_check_resume(tree: Path) -> None:
    path = tree / "nemo/utils/exp_manager.py"
    insert_before_def(path, "check_resume", _resume_definitions())
    replace_once(path, "import glob\n", "import glob\nimport json\n")
    replace_once(path, "import time\nimport warnings\n", "import time\nimport uuid\nimport warnings\n")
    replace_once(path, RESUME_BEFORE_GET_LOG_DIR, RESUME_UNVERSIONED + RESUME_BEFORE_GET_LOG_DIR)
    replace_once(path, RESUME_CALL_BEFORE, RESUME_CALL_AFTER)
    replace_once(path, RESUME_SLEEP_BEFORE, RESUME_SLEEP_AFTER)
    # After test_resume rather than at the end of the class, where PR 1 appends its tests: PR 2 applies alone.
    _insert_test_methods(
        tree, "tests/core/test_exp_manager.py", "tests/core/test_exp_manager_resume_order.py", "TestExpManager"
    )
    _copy_tests("nemo", tree, "tests/core/test_exp_manager_resume_race.py")


#: NeMo PR 3: exact-string edits of what PR 2 put into nemo/utils/exp_manager.py (old -> new, each found once).
LOG_DIR_EDITS = (
    (
        RESUME_CALL_AFTER,
        """\
    # Global rank 0 moves old files out of log_dir before the other ranks use it (#7460, #9952); the ranks it
    # releases take its log_dir, exp_dir, name and version (get_log_dir() gives a new version to rank 0 only, #8604).
    seconds_to_sleep, log_dir, exp_dir, name, version = check_resume_in_order(
        trainer, cfg, log_dir, exp_dir, name, version, unversioned
    )
""",
    ),
    (
        'NEMO_ENV_VARNAME_RESUME_CHECKED = "NEMO_EXPM_RESUME_CHECKED"\n',
        """\
NEMO_ENV_VARNAME_RESUME_CHECKED = "NEMO_EXPM_RESUME_CHECKED"
# The launcher's variables that are the same on every rank of a job: other jobs may meet in one <exp_dir>/<name>.
RESUME_ORDER_JOB_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID")
""",
    ),
    (
        '''\
def _check_resume_first(meeting_dir: Path, world_size: int, seconds_to_sleep: float, run_check_resume) -> None:
    """Global rank 0: wait up to seconds_to_sleep for the other ranks to arrive, run check_resume(), release them."""
''',
        '''\
def _check_resume_first(
    meeting_dir: Path, world_size: int, seconds_to_sleep: float, run_check_resume, log_dirs: dict
) -> None:
    """Global rank 0: wait up to seconds_to_sleep for the other ranks to arrive, run check_resume(), release them
    with log_dirs in the marker (its log_dir, exp_dir, name, version and job, for them to take)."""
''',
    ),
    (
        '            temporary = meeting_dir / f".done.{uuid.uuid4().hex}"\n',
        '            done.update(log_dirs)\n            temporary = meeting_dir / f".done.{uuid.uuid4().hex}"\n',
    ),
    (
        '''\
def _wait_for_rank_zero(meeting_dir: Path, rank: int, world_size: int, seconds_to_sleep: float) -> float:
    """A non-zero rank: wait until global rank 0 ran check_resume(). Returns the seconds still to sleep."""
''',
        '''\
def _wait_for_rank_zero(meeting_dir: Path, rank: int, world_size: int, seconds_to_sleep: float) -> tuple:
    """A non-zero rank: wait until global rank 0 ran check_resume(). Returns the seconds still to sleep and the
    marker of global rank 0 that released this rank ({} if none did)."""
''',
    ),
    (
        "            arrival.unlink(missing_ok=True)\n            return 0.0\n",
        "            arrival.unlink(missing_ok=True)\n            return 0.0, done\n",
    ),
    ("    return max(0.0, seconds_to_sleep - waited)\n", "    return max(0.0, seconds_to_sleep - waited), {}\n"),
    (
        '''\
def check_resume_in_order(trainer, cfg, log_dir: Path, unversioned: bool) -> float:
    """Run check_resume() on global rank 0 before the other ranks (#7460, #9952), which meet it in
    ``log_dir/.exp_manager/``. Returns the seconds a non-zero rank still has to sleep (seconds_to_sleep)."""
''',
        '''\
def check_resume_in_order(trainer, cfg, log_dir: Path, exp_dir: str, name: str, version: str, unversioned: bool):
    """Run check_resume() on global rank 0 before the other ranks (#7460, #9952), which meet it in
    ``log_dir/.exp_manager/`` (``<exp_dir>/<name>/.exp_manager/`` if unversioned) and, released by it, take its
    log_dir, exp_dir, name and version (#8604). Returns the seconds a non-zero rank still has to sleep
    (seconds_to_sleep) and the log_dir, exp_dir, name and version to use."""
''',
    ),
    (
        """\
        run_check_resume()  # a rank Lightning's launcher started in fit(), after global rank 0's check_resume()
        return 0.0
""",
        """\
        run_check_resume()  # a rank Lightning's launcher started in fit(), after global rank 0's check_resume()
        return 0.0, log_dir, exp_dir, name, version
""",
    ),
    (
        """\
    if world_size > 1 and external and not unversioned and (is_global_rank_zero() or trainer.global_rank > 0):
        meeting_dir = Path(log_dir) / RESUME_ORDER_DIR
""",
        """\
    job = [os.environ.get(variable) for variable in RESUME_ORDER_JOB_VARIABLES]
    if world_size > 1 and external and (is_global_rank_zero() or trainer.global_rank > 0):
        meeting_dir = Path(log_dir) / RESUME_ORDER_DIR
        if unversioned:  # only global rank 0's log_dir ends in a version (#8604); other jobs may share exp_dir/name
            job_key = uuid.uuid5(uuid.NAMESPACE_OID, json.dumps(job)).hex[:12]
            meeting_dir = Path(exp_dir) / Path(str(name)) / RESUME_ORDER_DIR / job_key
""",
    ),
    (
        "            _check_resume_first(meeting_dir, world_size, cfg.seconds_to_sleep, run_check_resume)\n",
        """\
            log_dirs = {"log_dir": str(log_dir), "exp_dir": exp_dir, "name": name, "version": version, "job": job}
            _check_resume_first(meeting_dir, world_size, cfg.seconds_to_sleep, run_check_resume, log_dirs)
""",
    ),
    ("        return cfg.seconds_to_sleep\n", "        return cfg.seconds_to_sleep, log_dir, exp_dir, name, version\n"),
    (
        """\
        seconds_to_sleep = _wait_for_rank_zero(meeting_dir, trainer.global_rank, world_size, seconds_to_sleep)
    run_check_resume()
    return seconds_to_sleep
""",
        """\
        seconds_to_sleep, done = _wait_for_rank_zero(meeting_dir, trainer.global_rank, world_size, seconds_to_sleep)
        if done.get("job") == job:  # released by global rank 0 of this job: log (and look for checkpoints) there
            log_dir, exp_dir, name, version = Path(done["log_dir"]), done["exp_dir"], done["name"], done["version"]
    run_check_resume()
    return seconds_to_sleep, log_dir, exp_dir, name, version
""",
    ),
)
#: ... and of the tests PR 2 added, which call the two functions whose results PR 3 extends.
LOG_DIR_TEST_EDITS = (
    (
        "        assert time.monotonic() - started < 10 and left == [0.0]\n",
        "        assert time.monotonic() - started < 10"
        ' and left[0][0] == 0.0 and left[0][1]["log_dir"] == str(tmp_path)\n',
    ),
    (
        "lambda: moved.append(True))\n",
        "lambda: moved.append(True), {})\n",
    ),
    (
        '        assert json.loads((meeting / "done").read_text()) == {"tokens": [], "ranks": []}\n',
        '        assert [json.loads((meeting / "done").read_text())[key] for key in ("tokens", "ranks")] == [[], []]\n',
    ),
)


def _nemo_log_dir_of_rank_zero(tree: Path) -> None:
    for old, new in LOG_DIR_EDITS:
        replace_once(tree / "nemo/utils/exp_manager.py", old, new)
    for old, new in LOG_DIR_TEST_EDITS:
        replace_once(tree / "tests/core/test_exp_manager.py", old, new)
    # PR 2's test that unversioned ranks do not meet gives way to PR 3's tests of what they do now.
    _replace_test_method(
        tree,
        "tests/core/test_exp_manager.py",
        "tests/core/test_exp_manager_log_dir.py",
        "TestExpManager",
        "test_resume_order_not_for_unversioned_ranks",
    )


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


def _replace_test_method(tree: Path, rel: str, additions: str, class_name: str, method: str) -> None:
    """Replace the method ``method`` of ``class_name`` in the upstream test file ``rel`` (decorators included) by
    the methods of ``class_name`` in ``ci/upstream/nemo/<additions>``."""
    lines, old = _method_of(tree / rel, class_name, method)
    first = min([old.lineno, *(d.lineno for d in old.decorator_list)])
    methods = _class_methods(additions, class_name)
    (tree / rel).write_text("".join(lines[: first - 1]) + methods + "".join(lines[old.end_lineno :]))


#: The local rank NeMo names the per-rank log file by (NeMo #8333): exp_manager.py, before and after.
LOG_RANK_BEFORE = (
    "    # Note: trainer.global_rank and trainer.is_global_zero are not set until trainer.fit, "
    "so have to hack around it\n"
    '    local_rank = int(os.environ.get("LOCAL_RANK", 0))\n'
)
LOG_RANK_AFTER = (
    "    # Before fit() nothing may have exported LOCAL_RANK yet (srun, #8333), but the trainer's cluster environment\n"
    "    # (SLURM, torchrun, ...) already knows the local rank. LOCAL_RANK still wins where it is set: single-device\n"
    "    # strategies report local (and global) rank 0 in every process, e.g. under torchrun with devices=1.\n"
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
    source = (HERE / "nemo" / additions).read_text()
    lines = source.splitlines(keepends=True)
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == class_name)
    first = min([cls.body[0].lineno, *(d.lineno for d in getattr(cls.body[0], "decorator_list", []))])
    path.write_text(text + "\n" + "".join(lines[first - 1 : cls.end_lineno]))


def _nemo_log_rank(tree: Path) -> None:
    replace_once(tree / "nemo/utils/exp_manager.py", LOG_RANK_BEFORE, LOG_RANK_AFTER)
    _append_test_methods(
        tree, "tests/core/test_exp_manager.py", "tests/core/test_exp_manager_additions.py", "TestExpManager"
    )


RESUME_MESSAGE = """
check_resume() lets global rank 0 move every regular file of log_dir (all
but TensorBoard event files) into run_N/, whatever resume_if_exists says,
while the other ranks already list and use that directory; they are held
back only by a fixed time.sleep(seconds_to_sleep) (5 s, #7498) at the end of
exp_manager(). When rank 0 reaches exp_manager() later than the others (a
slower node, a slow import), the other ranks return first: files vanish
under them (#7460) and files of the current run, such as the per-rank log
files, are archived into run_0 (#9952). #15592 proposed a flag to disable
the move instead (closed).

Let the other ranks wait for rank 0's check_resume() where that can help,
over the filesystem (exp_manager() runs before torch.distributed exists):
- Only with trainer.num_nodes * trainer.num_devices > 1 (the sleep's own
  condition) under a launcher that started every rank (torchrun, SLURM:
  creates_processes_externally), and only where the others' log_dir can be
  rank 0's: explicit_log_dir, resume_if_exists, or a version on every rank.
  Without them get_log_dir() gives rank 0 a new version folder and the
  others none (PR #8604), nothing they use is moved, and nothing changes.
- The ranks meet in <log_dir>/.exp_manager/, the same folder on every rank
  there (and not shared with another job that logs elsewhere under the same
  exp_dir and name); a folder, since check_resume() never moves folders.
  Rank numbers are the trainer's
  global_rank (correct before fit() under torchrun and SLURM); rank 0 is
  is_global_rank_zero(), the rank that moves.
- A non-zero rank creates arrived.<rank>.<random token> there and waits for
  rank 0's marker "done" (JSON, written to a temporary name and renamed)
  to list its token; a marker of an earlier run never does. Released, it
  runs its own check_resume() (the lookup) and skips the fixed sleep.
- Rank 0 first removes the arrival files it finds (those of a start-up
  that was killed must not count; a waiting rank whose file vanished
  arrives again), then waits until every other rank arrived or
  seconds_to_sleep passed, runs check_resume(), then, also when
  check_resume() raised (the others then raise NeMo's own error from their
  own lookup), writes "done" with the tokens and ranks of the arrival files
  it sees and removes those (if that fails, a warning: the others fall back).
  It also waits when nothing is to be moved: a marker published before the
  others arrived could not be told from an earlier run's.
- Lightning's own launcher: its main process (rank 0) runs exp_manager()
  before the other ranks exist and never waits; it exports
  NEMO_EXPM_RESUME_CHECKED=<its pid>:<log_dir> (as it exports
  NEMO_EXPM_VERSION), and the ranks it starts in fit() go on at once when
  their parent is that pid and their log_dir that log_dir.

Where nothing waits: one process, Lightning's launcher's main process,
ranks without a version of rank 0's, and rank 0 once every other rank
arrived. Fallbacks, never slower than today: a rank not released within
seconds_to_sleep keeps waiting only while rank 0 showed up (it cleared the
arrival files) or all other non-zero ranks, at least one, wait there too
(the directory is shared and rank 0 is late, #7460; listed every 10 s at
most), and unless
rank 0's marker says it went on without this rank, up to 10 minutes with a
progress line every 30 s; otherwise (node-local or unshared folders, rank 0
done before this rank came) it carries on as before with one warning,
sleeping only what is left of seconds_to_sleep; so does a rank that cannot
create its arrival file (a read-only log_dir). Rank 0 waits at most
seconds_to_sleep, and only while some rank is missing. What stays on disk:
.exp_manager/done (a few bytes); arrival files are removed by rank 0 or,
on a fallback, by their rank. Windows-safe (os.replace, no links).

All in nemo/utils/exp_manager.py (a few lines in exp_manager(), 2 imports,
the rest new functions before check_resume()). No new package, thread or option.

Tested: tests/core/test_exp_manager.py, TestExpManager: eight single-process
tests play ranks with torchrun's variables (rank 0 moves and releases an
arrived rank; arrival files of a killed start-up do not count; a rank
released by rank 0; two ranks not sharing the folder wait seconds_to_sleep
only; a stale marker does not release
and a missing rank 0 costs seconds_to_sleep; a marker saying rank 0 went
on stops the wait; Lightning's launcher: no wait, its ranks go on at once;
no meeting without a version), about 3 s together.
tests/core/test_exp_manager_resume_race.py starts 4 ranks with torchrun on
a log_dir holding 2000 old files and a last checkpoint, rank 0 entering
exp_manager() 6 s late (longer than seconds_to_sleep): no other rank may
see an old file after exp_manager() returned, run_0 must hold exactly the
old files and every rank must resume from the last checkpoint. It fails
before this change and passes after it on nemo_toolkit 3.0.0 and 2.7.3.
Also checked by hand: Trainer(strategy="ddp", devices=2, accelerator="cpu")
with fit(): the started rank leaves exp_manager() after 0.07 s, not 5 s.
"""


LOG_DIR_MESSAGE = """
Without explicit_log_dir, resume_if_exists, a version or a logger on the
trainer, get_log_dir() lets global rank 0 pick a new version (date and
time, or version_N) and export it as NEMO_EXPM_VERSION into its own
environment only. The ranks a launcher started (torchrun, SLURM) get no
version: rank 0 logs into <exp_dir>/<name>/<version>, every other rank into
<exp_dir>/<name> (its per-rank log file and whatever else it writes into
log_dir). #8604 ran into this with tests/core_ptl/check_for_ranks.py
(closed unmerged). The ranks Lightning's own launcher starts in fit() are
not affected: they inherit NEMO_EXPM_VERSION.

The previous change ("exp_manager: let global rank 0 move old log files
before the other ranks use log_dir", #7460, #9952) has the other ranks meet
global rank 0 and wait for its marker "done". Let the marker also carry
rank 0's log_dir, exp_dir, name and version, and let every rank it releases
take them: every rank logs into rank 0's folder, and its check_resume()
looks there too. A rank that is not released (say, it cannot see rank 0's
folder) keeps its own, as before.

The unversioned runs, which the previous change leaves out since nothing
of theirs is moved, now meet as well; nothing else changes for them:
- They meet in <exp_dir>/<name>/.exp_manager/<job>/, the same folder on
  every rank of the job whatever the version (the others' log_dir is
  <exp_dir>/<name>).
- Several jobs may share <exp_dir>/<name> (the default nemo_experiments/
  default, sweeps): <job> is a hash of the launcher's variables that are
  the same on every rank of one job and differ between jobs (MASTER_ADDR,
  MASTER_PORT, TORCHELASTIC_RUN_ID, SLURM_JOB_ID, SLURM_STEP_ID), so the
  ranks of one job neither release nor count those of another; the marker
  carries them too, and a rank takes the folder only from the rank 0 of
  its own job.
- Rank 0 has nothing to move (its version folder is new), so it only
  waits, at most seconds_to_sleep, until the others arrived. That is no
  slower than today: the others sleep seconds_to_sleep at the end of
  exp_manager() anyway and fit() starts when every rank is there; released,
  they skip that sleep. Rank 0 waits in vain only for ranks that cannot see
  its folder or that gave up before it came, at most seconds_to_sleep once
  at start-up, as for the runs the previous change orders.
- The other ranks wait as in the previous change: seconds_to_sleep, longer
  only while rank 0 showed up or every other non-zero rank waits in the
  same folder (rank 0 is late; fit() would wait for it anyway).
- Lightning's own launcher: unchanged (its main process does not meet; the
  ranks it starts find NEMO_EXPM_RESUME_CHECKED and NEMO_EXPM_VERSION).
What stays on disk: <exp_dir>/<name>/.exp_manager/<job>/done (a few
bytes per job).

All in nemo/utils/exp_manager.py; no new function, option or dependency.

Tested: tests/core/test_exp_manager.py, TestExpManager: four tests (five
cases) in place of test_resume_order_not_for_unversioned_ranks play
unversioned ranks with torchrun's variables: rank 1 released by a marker
carrying rank 0's log_dir logs there (before this change: into
exp_dir/default after the fixed sleep); another job's rank 0 (another
MASTER_PORT) meets in another folder and does not hand over its own, even
through a marker in this job's folder; global rank 0 waits
for rank 1 and releases it with its new version folder; rank 1 whose
rank 0 never comes keeps exp_dir/default after seconds_to_sleep. Three
tests of the previous change follow the new results and marker. About 8 s
together (two wait out seconds_to_sleep). The first fails before this
change and all pass after it on nemo_toolkit 3.0.0 and 2.7.3.
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
        for path in ("tests/__init__.py", "tests/core/__init__.py", "tests/core/test_exp_manager.py")
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
until trainer.fit") is replaced by why (3 of the lines added).

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
            "exp_manager: let global rank 0 move old log files before the other ranks use log_dir",
            RESUME_MESSAGE,
            _nemo_ordered_check_resume,
            tests=("tests/core/test_exp_manager.py", "tests/core/test_exp_manager_resume_race.py"),
            race_tests=(
                "tests/core/test_exp_manager_resume_race.py::test_check_resume_moves_old_files_before_other_ranks_continue",
            ),
            # Where the ranks cannot meet (rank 0 never comes, a node-local folder, rank 0 went on without this
            # rank), a rank carries on after seconds_to_sleep, as before this change.
            keeps_behaviour=tuple(
                f"tests/core/test_exp_manager.py::TestExpManager::{name}"
                for name in (
                    "test_resume_order_stale_marker_does_not_release",
                    "test_resume_order_two_ranks_not_sharing_the_folder",
                    "test_resume_order_rank_zero_went_on_without_rank",
                )
            ),
        ),
        UpstreamPatch(
            "exp-manager-log-dir-of-rank-zero",
            "exp_manager: give every rank global rank 0's log_dir",
            LOG_DIR_MESSAGE,
            _nemo_log_dir_of_rank_zero,
            tests=("tests/core/test_exp_manager.py",),
            race_tests=(
                "tests/core/test_exp_manager.py::TestExpManager::test_log_dir_unversioned_rank_takes_rank_zero_version",
            ),
            # A log_dir of another job in the same folder is not taken (each rank keeps its own, as before).
            keeps_behaviour=("tests/core/test_exp_manager.py::TestExpManager::test_log_dir_not_from_another_job",),
            requires=("exp-manager-ordered-check-resume",),
        ),
    ),
)
