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
    seconds_to_sleep = check_resume_in_order(trainer, cfg, log_dir, Path(exp_dir) / Path(str(name)), unversioned)
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


def _class_methods(additions: str, class_name: str) -> str:
    source = (HERE / "nemo" / additions).read_text()
    lines = source.splitlines(keepends=True)
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == class_name)
    first = min([cls.body[0].lineno, *(d.lineno for d in getattr(cls.body[0], "decorator_list", []))])
    return "".join(lines[first - 1 : cls.end_lineno])


def _insert_test_methods(tree: Path, rel: str, additions: str, class_name: str, after: str = "test_resume") -> None:
    """Insert the methods of ``class_name`` in ``ci/upstream/nemo/<additions>`` into the same class of the
    upstream test file ``rel``, right after its method ``after``."""
    path = tree / rel
    lines = path.read_text().splitlines(keepends=True)
    cls = next(n for n in ast.parse("".join(lines)).body if isinstance(n, ast.ClassDef) and n.name == class_name)
    method = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == after), None)
    if method is None:
        raise EditError(f"{path}: no method {class_name}.{after}")
    methods = _class_methods(additions, class_name)
    path.write_text("".join(lines[: method.end_lineno]) + "\n" + methods + "".join(lines[method.end_lineno :]))


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
- The ranks meet in <exp_dir>/<name>/.exp_manager/ (explicit_log_dir/
  .exp_manager/), which does not depend on the version; a folder, since
  check_resume() never moves folders. Rank numbers are the trainer's
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
  check_resume() raised (the others
  then raise NeMo's own error from their own lookup), writes "done" with
  the tokens and ranks of the arrival files it sees and removes those.
  It also waits when nothing is to be moved: a marker published before the
  others arrived could not be told from an earlier run's.
- Lightning's own launcher: its main process (rank 0) runs exp_manager()
  before the other ranks exist and never waits; it exports
  NEMO_EXPM_RESUME_CHECKED=<its pid> (as it exports NEMO_EXPM_VERSION), and
  the ranks it starts in fit() go on at once when their parent is that pid.

Where nothing waits: one process, Lightning's launcher's main process,
ranks without a version of rank 0's, and rank 0 once every other rank
arrived. Fallbacks, never slower than today: a rank not released within
seconds_to_sleep keeps waiting only while rank 0 showed up (it cleared the
arrival files) or every other non-zero rank waits there too (the directory
is shared and rank 0 is late, #7460), and unless
rank 0's marker says it went on without this rank, up to 10 minutes with a
progress line every 30 s; otherwise (node-local or unshared folders, rank 0
done before this rank came) it carries on as before with one warning,
sleeping only what is left of seconds_to_sleep. Rank 0 waits at most
seconds_to_sleep, and only while some rank is missing. What stays on disk:
.exp_manager/done (a few bytes); arrival files are removed by rank 0 or,
on a fallback, by their rank. Windows-safe (os.replace, no links).

All in nemo/utils/exp_manager.py (a few lines in exp_manager(), 2 imports,
the rest new functions before check_resume()). No new package, thread or option.

Tested: tests/core/test_exp_manager.py, TestExpManager: seven single-process
tests play ranks with torchrun's variables (rank 0 moves and releases an
arrived rank; arrival files of a killed start-up do not count; a rank
released by rank 0; a stale marker does not release
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


NEMO = Series(
    project="nemo",
    distribution="nemo_toolkit",
    base_version="3.0.0",
    verified=("3.0.0", "2.7.3"),
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
        ),
    ),
)
