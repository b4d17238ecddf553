"""NeMo ``exp_manager`` start-up without the race, for nemo_toolkit 1.21.0-3.0.0 (see :data:`FACTS`).

``exp_manager()`` looks up ``get_log_dir``, ``check_resume`` and ``time`` as
module globals at call time, so replacing them in ``nemo.utils.exp_manager``
changes what it does:

* ``get_log_dir`` runs the upstream pull request's ordering
  (:mod:`~nemo_safe.patches.nemo_resume_core`: rank 0 first, everyone after
  it, every rank with rank 0's ``log_dir``), taking ``cfg`` from the
  ``exp_manager`` call it serves, where the launcher and the trainer agree on
  the ranks (:func:`~nemo_safe.patches.nemo_resume_order.launcher_agrees`);
  ``check_resume`` then skips the call the ordering already made;
* ``time`` becomes a stand-in whose ``sleep`` sleeps what the ordering left
  of upstream's fixed ``seconds_to_sleep`` (none on ranks that were ordered);
* ``exp_manager`` itself sets up the call and, where nothing exports
  ``LOCAL_RANK`` before ``fit()`` (srun, mpirun), runs with the trainer's local
  rank exported (else the launcher's): upstream names every task of a node
  ``nemo_log_globalrank-<node*devices>_localrank-0.txt`` (NeMo #8333; the
  upstream change takes ``LOCAL_RANK``, else ``trainer.local_rank``).

Without a multi-process launcher (one process, Lightning's own local launcher
before ``fit()``, an interactive SLURM shell) nothing changes.

A NeMo that carries the upstream ordering (NeMo pull request 2 of ``patches/nemo``:
``exp_manager()`` calls :data:`UPSTREAM_ORDERING`) is left to order itself; only
the local rank is still exported, for the one-device srun/mpirun case upstream's
``trainer.local_rank`` does not cover.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import logging
import os
import sys
import threading
import time as _time
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType, ModuleType
from typing import Any

from nemo_safe.patches import nemo_resume_core, nemo_resume_order
from nemo_safe.patches.nemo_log_names import log_local_rank
from nemo_safe.patching import Replacements
from nemo_safe.version_gate import FIXED, Fact, SourceGate, called_name, calls_in_order, function_tree
from nemo_safe.warn_once import warn_once

log = logging.getLogger(__name__)

MODULE = "nemo.utils.exp_manager"
#: sha256 of the sources of ``check_resume`` and ``get_log_dir`` of the releases the release sweep tests
#: (``ci/release_sweep.sh``); other releases are patched where every fact in :data:`FACTS` holds.
KNOWN_SOURCES = {
    "d7f0fe25e8b6a2d7c9672b6a8efdc2513842d88313200a86d16c84d458649457": "nemo_toolkit 2.7.3 / 3.0.0",
    "9a7a705b7cd588fa88fc1f5ea1003947b66a65dbb216b3f719366513fe00b8d8": "nemo_toolkit 2.0.0",
    "f7c7d50054aca96fa7babcc82aaad05bcd01113a727116903807c0766cbba982": "nemo_toolkit 2.3.3",
    "365e87e603aa21c54a9077160fd2da2409390f53f63c5c3b1c3e0516c0aa163e": "nemo_toolkit 1.23.0",
}
#: The call that gives non-zero ranks their fixed wait, which the patch cuts.
SLEEP_CALL = "time.sleep(cfg.seconds_to_sleep)"
#: exp_manager's ``check_resume`` call, the one the series' core makes (the overlay runs the core in its place).
CHECK_RESUME_CALL = (
    "check_resume(trainer, log_dir, cfg.resume_if_exists, cfg.resume_past_end, cfg.resume_ignore_no_checkpoint, "
    "cfg.checkpoint_callback_params.dirpath, cfg.resume_from_checkpoint)"
)
#: What NeMo pull request 2 of ``patches/nemo`` adds to ``nemo.utils.exp_manager`` and calls from
#: ``exp_manager()`` (tests/test_upstream_fixed.py checks that the series defines it).
UPSTREAM_ORDERING = "_check_resume_in_order"


def _calls_of(tree: ast.AST) -> list[tuple[str, ast.Call]]:
    return [(called_name(call), call) for call in calls_in_order(tree)]


def _takes_trainer_and_cfg(module: ModuleType) -> bool:
    return [a.arg for a in function_tree(module.exp_manager).args.args[:2]] == ["trainer", "cfg"]


def _get_log_dir_parameters(module: ModuleType) -> bool:
    return {"trainer", "explicit_log_dir"} <= set(inspect.signature(inspect.unwrap(module.get_log_dir)).parameters)


def _unpacks_four_parts(module: ModuleType) -> bool:
    """``log_dir, exp_dir, name, version = get_log_dir(...)``, once."""
    tree = function_tree(module.exp_manager)
    calls = [call for name, call in _calls_of(tree) if name == "get_log_dir"]
    assigned = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and called_name(node.value) == "get_log_dir"
    ]
    return (
        len(calls) == 1
        and len(assigned) == 1
        and assigned[0].value is calls[0]
        and ast.unparse(assigned[0].targets[0]) == "(log_dir, exp_dir, name, version)"
    )


def _is_sleep_call(name: str, call: ast.Call) -> bool:
    return name == "time.sleep" and len(call.args) == 1 and ast.unparse(call.args[0]) == "cfg.seconds_to_sleep"


def _calls_in_order(module: ModuleType) -> bool:
    """``get_log_dir``, then ``check_resume``, then the fixed sleep: each once, in that order, and no other
    ``time.sleep`` in the module (the stand-in for ``time`` cuts the fixed one only)."""
    sleeps = [
        call for name, call in _calls_of(ast.parse(inspect.getsource(module))) if name == "time.sleep"
    ]  # fmt: skip
    if len(sleeps) != 1:
        return False
    calls = _calls_of(function_tree(module.exp_manager))
    names = ["sleep" if _is_sleep_call(name, call) else name for name, call in calls]
    wanted = ["get_log_dir", "check_resume", "sleep"]
    if any(names.count(name) != 1 for name in wanted):
        return False
    return [names.index(name) for name in wanted] == sorted(names.index(name) for name in wanted)


def _check_resume_follows(module: ModuleType) -> bool:
    """The statement right after ``log_dir, ... = get_log_dir(...)`` is :data:`CHECK_RESUME_CALL`: running it
    from inside ``get_log_dir``, with exp_manager's ``cfg``, skips nothing between the two."""
    tree = function_tree(module.exp_manager)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        for first, second in itertools.pairwise(body) if isinstance(body, list) else ():
            if isinstance(first, ast.Assign) and called_name(first.value) == "get_log_dir":
                return ast.unparse(second) == CHECK_RESUME_CALL
    return False


def _move_is_rank_zero_only(module: ModuleType) -> bool:
    """Every ``move`` in ``check_resume`` sits under ``if is_global_rank_zero():`` (and there is one)."""
    tree = function_tree(module.check_resume)
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and called_name(node.test) == "is_global_rank_zero":
            guarded.update(id(call) for statement in node.body for call in ast.walk(statement))
    moves = [call for name, call in _calls_of(tree) if name in ("move", "shutil.move", "os.rename",
                                                                            "os.replace")]  # fmt: skip
    return bool(moves) and all(id(call) in guarded for call in moves)


def _module_globals(module: ModuleType) -> bool:
    return isinstance(getattr(module, "time", None), ModuleType | _SleepGate) and callable(
        getattr(module, "is_global_rank_zero", None)
    )


def _orders_itself(module: ModuleType) -> bool:
    """``exp_manager()`` calls the upstream ordering that ``nemo.utils.exp_manager`` itself defines."""
    ordering = vars(module).get(UPSTREAM_ORDERING)
    calls = {name for name, _ in _calls_of(function_tree(module.exp_manager))}
    return callable(ordering) and UPSTREAM_ORDERING in calls


#: What the patch relies on in ``nemo.utils.exp_manager`` (true from nemo_toolkit 1.21.0 on; 1.20.0 has no
#: fixed sleep and calls ``check_resume`` only when resuming).
FACTS = (
    Fact("exp_manager(trainer, cfg)", _takes_trainer_and_cfg),
    Fact("get_log_dir takes trainer and explicit_log_dir", _get_log_dir_parameters),
    Fact("exp_manager() unpacks log_dir, exp_dir, name, version from one get_log_dir() call", _unpacks_four_parts),
    Fact(f"exp_manager() calls get_log_dir, then check_resume, then {SLEEP_CALL}, each once", _calls_in_order),
    Fact(f"exp_manager() calls {CHECK_RESUME_CALL} right after get_log_dir", _check_resume_follows),
    Fact("check_resume moves old files only under `if is_global_rank_zero():`", _move_is_rank_zero_only),
    Fact("the module globals time and is_global_rank_zero", _module_globals),
)

GATE = SourceGate(
    MODULE,
    lambda module: [module.check_resume, module.get_log_dir],
    KNOWN_SOURCES,
    library="NeMo",
    unpatched="upstream's exp_manager runs (resume race remains)",
    consequence="exp_manager keeps upstream's resume race",
    facts=FACTS,
    by_facts=True,  # the patch wraps get_log_dir and check_resume, it never replaces their bodies
    fixed=Fact(f"exp_manager() calls its own {UPSTREAM_ORDERING}(): rank 0 moves old files first", _orders_itself),
)
source_digest, recognise = GATE.digest, GATE.recognise


_calls = threading.local()


class _SleepGate:
    """Stands in for the ``time`` module inside ``nemo.utils.exp_manager`` only."""

    def __init__(self, real: ModuleType) -> None:
        self._real = real

    def sleep(self, seconds: float) -> None:
        stack = getattr(_calls, "stack", None)
        left = stack[-1].sleep_left if stack else None
        if left is not None:  # the one fixed sleep (a gate fact): what the ordering left of it, never more
            stack[-1].sleep_left = None
            if left < seconds:
                log.debug("nemo_safe: exp_manager's %.1f s sleep cut to %.1f s: rank 0 was waited for", seconds, left)
            seconds = min(seconds, left)
        self._real.sleep(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@dataclass
class _Call:
    """One ``exp_manager`` call: its code (to find its ``cfg``) and what the ordering did."""

    code: CodeType
    is_global_rank_zero: Callable[[], bool]
    planned: bool = False
    #: The ordering ran ``check_resume``: exp_manager's own call right after ``get_log_dir`` is skipped.
    checked: bool = False
    #: What the ordering left of the fixed ``seconds_to_sleep`` (None: upstream's sleep as it is).
    sleep_left: float | None = None


def _make_get_log_dir(original: Callable[..., Any], order: nemo_resume_core.Order) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def get_log_dir(*args: Any, **kwargs: Any) -> Any:
        own = original(*args, **kwargs)
        stack = getattr(_calls, "stack", None)
        if not stack or stack[-1].planned:
            return own  # not inside exp_manager (or a second call in one): upstream's answer
        call = stack[-1]
        call.planned = True
        trainer = signature.bind(*args, **kwargs).arguments["trainer"]
        if nemo_resume_order.launcher_agrees(trainer, call.is_global_rank_zero) is None:
            return own
        caller = sys._getframe(1)
        cfg = caller.f_locals.get("cfg") if caller.f_code is call.code else None
        if cfg is None:  # exp_manager wrapped by something that hides its frame: nothing to order with
            warn_once(log, "cfg", "nemo_safe: exp_manager: get_log_dir was not called by exp_manager itself "
                      "(is exp_manager wrapped?); running as upstream NeMo does")  # fmt: skip
            return own
        log_dir, exp_dir, name, version = own
        call.sleep_left, log_dir, version = order(trainer, cfg, log_dir, exp_dir, name, version)
        call.checked = True
        return log_dir, exp_dir, name, version

    get_log_dir.__wrapped__ = original  # type: ignore[attr-defined]
    get_log_dir.__doc__ = original.__doc__
    return get_log_dir


def _make_check_resume(original: Callable[..., Any]) -> Callable[..., Any]:
    def check_resume(*args: Any, **kwargs: Any) -> Any:
        stack = getattr(_calls, "stack", None)
        if stack and stack[-1].checked:
            stack[-1].checked = False  # exp_manager's own call: the ordering ran it already, with these arguments
            return None
        return original(*args, **kwargs)

    check_resume.__wrapped__ = original  # type: ignore[attr-defined]
    check_resume.__doc__ = original.__doc__
    return check_resume


def _make_exp_manager(original: Callable[..., Any], module: ModuleType) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def exp_manager(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs).arguments
        except TypeError:
            return original(*args, **kwargs)  # upstream's own error
        stack = _calls.__dict__.setdefault("stack", [])
        stack.append(_Call(inspect.unwrap(original).__code__, module.is_global_rank_zero))
        local_rank = log_local_rank(bound["trainer"])
        if local_rank is not None:
            os.environ["LOCAL_RANK"] = str(local_rank)  # upstream names its per-rank log file by it
        try:
            return original(*args, **kwargs)
        finally:
            stack.pop()
            if local_rank is not None:
                os.environ.pop("LOCAL_RANK", None)

    exp_manager.__wrapped__ = original  # type: ignore[attr-defined]
    exp_manager.__doc__ = original.__doc__
    return exp_manager


def apply(module: ModuleType) -> Replacements | None:
    verdict = GATE.verdict(module)
    GATE.note(module, verdict)
    if verdict.status == FIXED:
        changes = Replacements(f"{verdict}: only the per-rank log file's local rank (srun, mpirun)")
        changes.set(module, "exp_manager", _make_exp_manager(module.exp_manager, module))
        return changes
    if not verdict.patches:
        return None
    changes = Replacements(f"{verdict}: rank 0 first, rank 0's log_dir on every rank, no fixed sleep")
    order = nemo_resume_core.bind(module, module.check_resume)
    changes.set(module, "get_log_dir", _make_get_log_dir(module.get_log_dir, order))
    changes.set(module, "check_resume", _make_check_resume(module.check_resume))
    changes.set(module, "exp_manager", _make_exp_manager(module.exp_manager, module))
    changes.set(module, "time", _SleepGate(module.time if isinstance(module.time, ModuleType) else _time))
    return changes


describe = GATE.describe
