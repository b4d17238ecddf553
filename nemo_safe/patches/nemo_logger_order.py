"""NeMo 2.x ``NeMoLogger.setup`` on a resumed job: rank 0 archives the earlier run before any rank opens its log.

Upstream (nemo_toolkit 2.0-2.7, ``nemo/lightning/nemo_logger.py``), every rank runs
``NeMoLogger.setup`` with no ordering: ``_setup_files_to_move`` lists the regular files of
``log_dir`` into ``AppState.files_to_move``, then ``_setup_file_logging`` opens this rank's
``nemo_log_globalrank-G_localrank-L.txt`` (append). Much later, global rank 0 alone moves *its*
list into ``log_dir/run_N`` in ``ModelCheckpoint.on_train_start``. So a rank whose log file is
left from the earlier run appends this run's lines to it and sees them archived, and a rank that
opened a fresh log before rank 0 listed ``log_dir`` sees it archived too (docs/nemo.md).

Here, under a multi-process launcher and where the ranks share ``log_dir`` (``resume_if_exists``,
an explicit ``version``, ``explicit_log_dir``, or no dated version) and the trainer holds NeMo's
``ModelCheckpoint`` (the only reader of ``files_to_move``):

* rank 0 opens a :class:`~nemo_safe.barrier.Barrier` (as ``exp_manager``'s, through
  :class:`~nemo_safe.patches.nemo_resume_order.ResumeOrder`), runs its ``setup`` and, right after
  its listing, moves the listed files into ``run_N`` with upstream's own lines
  (:func:`move_to_new_run_dir`), then empties ``files_to_move`` so that ``on_train_start`` moves
  nothing a second time; then it opens its log and publishes how its ``setup`` ended;
* the other ranks wait for that before running their ``setup``; a failure of rank 0 reaches them
  as :class:`~nemo_safe.errors.RankZeroFailed` (after NeMo's own error, where theirs is the same);
  a rank that sees no rank 0 within :data:`GRACE` (or a stalled one) carries on as upstream, with
  one warning (where every other rank is there, after 120 s more: rank 0 is taken for late).

With ``resume_if_exists=False`` and a dated version (the default) rank 0 alone logs into a fresh
``log_dir/name/<date>`` and the others into ``log_dir/name``: rank 0 lists nothing of theirs,
nothing needs ordering, and upstream runs untouched (no wait). One process, no launcher, a Fabric
``setup``: upstream untouched.
"""

from __future__ import annotations

import ast
import inspect
import logging
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from nemo_safe.patches import nemo_resume_order
from nemo_safe.patching import Replacements
from nemo_safe.version_gate import Fact, SourceGate, called_name, calls_in_order, function_tree

log = logging.getLogger(__name__)

MODULE = "nemo.lightning.nemo_logger"
BARRIER_NAME = "nemo_logger"
#: How long a non-zero rank waits for any sign of rank 0 before carrying on as upstream (the rule of
#: exp_manager's ordering, whose grace is upstream's own sleep; NeMoLogger has none). Rank 0 is needed
#: by the next collective step anyway (``init_process_group`` in ``fit``), so a rank 0 that arrives
#: within it costs nothing; one that never does (node-local log dirs under srun) costs this once
#: (and 120 s more where every other rank but rank 0 meets in one folder).
GRACE = 10.0
#: The environment variable NeMo's ``setup`` reads the version from (``nemo.constants``).
VERSION_ENV = "NEMO_EXPM_VERSION"

#: sha256 of NeMoLogger.setup, NeMoLogger._setup_files_to_move and ModelCheckpoint.on_train_start of the
#: releases the tests ran on; other releases are patched where every fact in :data:`FACTS` holds.
KNOWN_SOURCES = {
    "9cfae967b144c18adf647f7bc5c7d0bbe0a2c5903cdd0f26f35a2acf2c117630": "nemo_toolkit 2.3.3 / 2.7.3",
    "bbeb6d9757e4bccac9836bb90245d95e7a51263cb482f7f0ebd23dffd58351a3": "nemo_toolkit 2.0.0",
}


def move_to_new_run_dir(log_dir: Any, files_to_move: list[Any]) -> None:
    """Upstream's move of the earlier run's files, line for line: ``ModelCheckpoint.on_train_start``,
    ``nemo/lightning/pytorch/callbacks/model_checkpoint.py`` (nemo_toolkit 2.7.3 lines 156-167, 2.0.0
    lines 121-132): ``run_N`` with N the number of existing ``run_*`` directories, created and filled
    only if it does not exist. The gate checks that the installed ``on_train_start`` holds this very
    ``if`` block (:func:`_moves_like_upstream`)."""
    if len(files_to_move) > 0:
        # Move old files to a new folder
        other_run_dirs = Path(log_dir).glob("run_*")
        run_count = 0
        for fold in other_run_dirs:
            if fold.is_dir():
                run_count += 1
        new_run_dir = Path(Path(log_dir) / f"run_{run_count}")
        if not new_run_dir.exists():
            new_run_dir.mkdir()
            for _file in files_to_move:
                shutil.move(str(_file), str(new_run_dir))


# -- the gate ---------------------------------------------------------------------------------


def _names(function: object) -> list[str]:
    return [called_name(call) for call in calls_in_order(function_tree(function))]


def _setup_signature(module: ModuleType) -> bool:
    parameters = list(inspect.signature(inspect.unwrap(module.NeMoLogger.setup)).parameters)
    return parameters[:3] == ["self", "trainer", "resume_if_exists"]


def _lists_before_logging(module: ModuleType) -> bool:
    """``self._setup_files_to_move(...)`` once, and after it ``self._setup_file_logging(...)`` once."""
    names = _names(module.NeMoLogger.setup)
    listing, logging_ = "self._setup_files_to_move", "self._setup_file_logging"
    if names.count(listing) != 1 or names.count(logging_) != 1:
        return False
    return names.index(listing) < names.index(logging_)


def _listing_sets_files_to_move(module: ModuleType) -> bool:
    """``_setup_files_to_move(self, log_dir, app_state)`` assigns ``app_state.files_to_move``."""
    function = module.NeMoLogger._setup_files_to_move
    if list(inspect.signature(inspect.unwrap(function)).parameters) != ["self", "log_dir", "app_state"]:
        return False
    for node in ast.walk(function_tree(function)):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if ast.unparse(target) == "app_state.files_to_move":
                    return True
    return False


def _version_inputs(module: ModuleType) -> bool:
    """``setup`` decides the shared ``log_dir`` from what :func:`_shares_log_dir` reads."""
    source = ast.unparse(function_tree(module.NeMoLogger.setup))
    needed = ("self.explicit_log_dir", "self.version", "NEMO_ENV_VARNAME_VERSION", "resume_if_exists",
              "self.use_datetime_version", "is_global_rank_zero()")  # fmt: skip
    return all(name in source for name in needed)


def _move_block(function: object) -> ast.If | None:
    for node in ast.walk(function_tree(function)):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "len(files_to_move) > 0":
            return node
    return None


def _moves_like_upstream(module: ModuleType) -> bool:
    """``ModelCheckpoint.on_train_start`` takes ``files_to_move = app_state.files_to_move``, ``log_dir =
    app_state.log_dir`` and moves them with the ``if`` block of :func:`move_to_new_run_dir`, which does
    nothing for an empty list."""
    on_train_start = module.ModelCheckpoint.on_train_start
    source = ast.unparse(function_tree(on_train_start))
    if "files_to_move = app_state.files_to_move" not in source or "log_dir = app_state.log_dir" not in source:
        return False
    theirs, ours = _move_block(on_train_start), _move_block(move_to_new_run_dir)
    return theirs is not None and ours is not None and ast.dump(theirs) == ast.dump(ours)


def _module_globals(module: ModuleType) -> bool:
    return isinstance(getattr(module, "ModelCheckpoint", None), type) and isinstance(
        getattr(getattr(module, "pl", None), "Trainer", None), type
    )


#: What the patch relies on in ``nemo.lightning.nemo_logger`` (nemo_toolkit 2.0-2.7; NeMo 3.0 has no module).
FACTS = (
    Fact("the module globals ModelCheckpoint (NeMo's) and pl (lightning.pytorch)", _module_globals),
    Fact("NeMoLogger.setup(self, trainer, resume_if_exists, ...)", _setup_signature),
    Fact(
        "NeMoLogger.setup calls self._setup_files_to_move, then self._setup_file_logging, each once",
        _lists_before_logging,
    ),  # fmt: skip
    Fact(
        "NeMoLogger._setup_files_to_move(self, log_dir, app_state) sets app_state.files_to_move",
        _listing_sets_files_to_move,
    ),  # fmt: skip
    Fact(
        "NeMoLogger.setup picks the version from explicit_log_dir, version, NEMO_EXPM_VERSION, "
        "resume_if_exists and use_datetime_version",
        _version_inputs,
    ),  # fmt: skip
    Fact(
        "ModelCheckpoint.on_train_start moves app_state.files_to_move into run_N with the lines nemo_safe runs "
        "early, and nothing when the list is empty",
        _moves_like_upstream,
    ),  # fmt: skip
)

GATE = SourceGate(
    MODULE,
    lambda module: [
        module.NeMoLogger.setup,
        module.NeMoLogger._setup_files_to_move,
        module.ModelCheckpoint.on_train_start,
    ],
    KNOWN_SOURCES,
    library="NeMo",
    unpatched="upstream's NeMoLogger.setup runs (current-run logs of a resumed job are archived into run_N)",
    consequence="NeMoLogger keeps archiving current-run logs of resumed jobs into run_N",
    facts=FACTS,
    by_facts=True,  # wraps setup and _setup_files_to_move; the move it runs early is checked line for line
)
source_digest, recognise = GATE.digest, GATE.recognise


# -- the patch --------------------------------------------------------------------------------


@dataclass
class _Call:
    """One ordered ``setup`` call of one rank; ``archive``: rank 0, move the listed files right away."""

    logger: Any
    trainer: Any
    archive: bool


_calls = threading.local()


def _current(logger: Any) -> _Call | None:
    stack = getattr(_calls, "stack", None)
    return stack[-1] if stack and stack[-1].logger is logger else None


def _consumes_files_to_move(module: ModuleType, callback: Any) -> bool:
    """NeMo's ``ModelCheckpoint`` with upstream's ``on_train_start``: what moves ``files_to_move``."""
    checkpoint = module.ModelCheckpoint
    return isinstance(callback, checkpoint) and inspect.unwrap(type(callback).on_train_start) is inspect.unwrap(
        checkpoint.on_train_start
    )


def _shares_log_dir(logger: Any, resume_if_exists: bool) -> bool:
    """Whether every rank's ``setup`` computes the same ``log_dir`` (what rank 0 lists is also theirs).

    As ``setup`` decides: ``explicit_log_dir``; else a version from the logger or ``NEMO_EXPM_VERSION``;
    else none with ``resume_if_exists``; else rank 0 alone dates a fresh one (``use_datetime_version``),
    and without it nobody has one."""
    if logger.explicit_log_dir:
        return True
    if logger.version or os.environ.get(VERSION_ENV):
        return True
    return bool(resume_if_exists) or not logger.use_datetime_version


def _meeting_parts(logger: Any) -> tuple[tuple[Any, ...], Any]:
    """``(log_dir, exp_dir, name, version)`` as far as every rank computes them alike, and the explicit dir."""
    if logger.explicit_log_dir:
        explicit = logger.explicit_log_dir
        return (Path(explicit), str(explicit), "", ""), explicit
    exp_dir = logger.log_dir if logger.log_dir is not None else str(Path.cwd() / "nemo_experiments")
    name = logger.name or "default"
    version = logger.version or os.environ.get(VERSION_ENV) or None
    return (Path(exp_dir) / str(name), exp_dir, name, version), None


def _order_for(module: ModuleType, logger: Any, trainer: Any, resume_if_exists: bool) -> Any:
    if not isinstance(trainer, module.pl.Trainer) or not _shares_log_dir(logger, resume_if_exists):
        return None
    if not any(_consumes_files_to_move(module, cb) for cb in [logger.ckpt, *trainer.callbacks]):
        return None  # nothing moves files_to_move: upstream archives nothing, nothing to order
    from nemo.utils.get_rank import is_global_rank_zero

    return nemo_resume_order.resume_order_for(
        trainer, is_global_rank_zero, GRACE, what="NeMoLogger.setup", barrier_name=BARRIER_NAME
    )


def _make_setup(original: Callable[..., Any], module: ModuleType) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def setup(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # upstream's own error
        bound.apply_defaults()
        logger, trainer = bound.arguments["self"], bound.arguments["trainer"]
        order = _order_for(module, logger, trainer, bound.arguments["resume_if_exists"])
        if order is None:
            return original(*args, **kwargs)
        parts, explicit = _meeting_parts(logger)
        order.agree_log_dir(parts, explicit)  # rank 0 opens the barrier; the others wait for its outcome
        stack = _calls.__dict__.setdefault("stack", [])
        stack.append(_Call(logger, trainer, archive=order.barrier is not None))
        try:
            return order.run(original, *args, **kwargs)  # rank 0 publishes how its setup ended
        finally:
            stack.pop()

    setup.__wrapped__ = original  # type: ignore[attr-defined]
    setup.__doc__ = original.__doc__
    return setup


def _make_setup_files_to_move(original: Callable[..., Any], module: ModuleType) -> Callable[..., Any]:
    def _setup_files_to_move(self: Any, log_dir: Any, app_state: Any) -> Any:
        result = original(self, log_dir, app_state)
        call = _current(self)
        if call is not None and call.archive:
            call.archive = False
            if any(_consumes_files_to_move(module, cb) for cb in call.trainer.callbacks):
                # What on_train_start would move, moved now: before this rank opens its log file
                # (next in setup) and before any other rank runs its setup (they wait for ours).
                move_to_new_run_dir(log_dir, list(app_state.files_to_move))
                app_state.files_to_move = []
        return result

    _setup_files_to_move.__wrapped__ = original  # type: ignore[attr-defined]
    _setup_files_to_move.__doc__ = original.__doc__
    return _setup_files_to_move


def apply(module: ModuleType) -> Replacements | None:
    verdict = GATE.verdict(module)
    GATE.note(module, verdict)
    if not verdict.patches:
        return None
    cls = module.NeMoLogger
    changes = Replacements(f"{verdict}: rank 0 archives the earlier run into run_N before any rank opens its log")
    changes.set(cls, "setup", _make_setup(cls.setup, module))
    changes.set(cls, "_setup_files_to_move", _make_setup_files_to_move(cls._setup_files_to_move, module))
    return changes


describe = GATE.describe
