"""NeMo ``exp_manager`` start-up without the race, for nemo_toolkit 2.7.3 and 3.0.0.

``exp_manager()`` looks up ``get_log_dir``, ``check_resume`` and ``time`` as
module globals at call time, so replacing them in ``nemo.utils.exp_manager``
changes what it does:

* ``get_log_dir`` and ``check_resume`` go through
  :class:`~nemo_safe.patches.nemo_resume_order.ResumeOrder`: rank 0 first,
  everyone after it, every rank with rank 0's ``log_dir``;
* ``time`` becomes a stand-in whose ``sleep`` skips upstream's fixed
  ``seconds_to_sleep`` on ranks that were ordered (and counts what a rank
  already waited where it could not be);
* ``exp_manager`` itself sets up the call and, where nothing exports
  ``LOCAL_RANK`` before ``fit()`` (srun, mpirun), runs with the trainer's local
  rank exported (else the launcher's): upstream names every task of a node
  ``nemo_log_globalrank-<node*devices>_localrank-0.txt`` (NeMo #8333; the
  upstream change takes ``LOCAL_RANK``, else ``trainer.local_rank``).

Without a multi-process launcher (one process, Lightning's own local launcher
before ``fit()``, an interactive SLURM shell) nothing changes.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import time as _time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from nemo_safe.patches import nemo_resume_order
from nemo_safe.patches.nemo_log_names import log_local_rank
from nemo_safe.patches.nemo_resume_order import ResumeOrder
from nemo_safe.patching import Replacements, SourceGate

log = logging.getLogger(__name__)

MODULE = "nemo.utils.exp_manager"
#: sha256 of the sources of ``check_resume`` and ``get_log_dir`` of the releases this patch was verified against.
KNOWN_SOURCES = {
    "d7f0fe25e8b6a2d7c9672b6a8efdc2513842d88313200a86d16c84d458649457": "nemo_toolkit 2.7.3 / 3.0.0",
}
#: What ``exp_manager()`` must do, in this order, for the replaced globals to take effect.
EXP_MANAGER_CALLS = ("get_log_dir(", "check_resume(", "time.sleep(cfg.seconds_to_sleep)")


def _source(function: Callable[..., Any]) -> str:
    """The upstream source, also when nemo_safe's wrapper is installed in its place."""
    return inspect.getsource(inspect.unwrap(function))


def _calls_in_order(module: ModuleType) -> bool:
    """``exp_manager()`` calls what the patch replaces in the order it relies on."""
    body = _source(module.exp_manager)
    positions = [body.find(call) for call in EXP_MANAGER_CALLS]
    return -1 not in positions and positions == sorted(positions)


GATE = SourceGate(
    MODULE,
    lambda module: [module.check_resume, module.get_log_dir],
    KNOWN_SOURCES,
    library="NeMo",
    unpatched="upstream's exp_manager runs (resume race remains)",
    consequence="exp_manager keeps upstream's resume race",
    also=_calls_in_order,
)
source_digest, recognise = GATE.digest, GATE.recognise


_calls = threading.local()


class _SleepGate:
    """Stands in for the ``time`` module inside ``nemo.utils.exp_manager`` only."""

    def __init__(self, real: ModuleType) -> None:
        self._real = real

    def sleep(self, seconds: float) -> None:
        order = _current()
        if order is not None:
            left = order.sleep_left(seconds)
            if left < seconds:
                log.debug("nemo_safe: exp_manager's %.1f s sleep cut to %.1f s: rank 0 was waited for", seconds, left)
            seconds = left
        self._real.sleep(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@dataclass
class _Call:
    """One ``exp_manager`` call: what the wrapper knows (``seconds_to_sleep``) and the ordering, if any."""

    grace: float
    is_global_rank_zero: Callable[[], bool]
    order: ResumeOrder | None = None
    planned: bool = False


def _current() -> ResumeOrder | None:
    stack = getattr(_calls, "stack", None)
    return stack[-1].order if stack else None


def _make_get_log_dir(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def get_log_dir(*args: Any, **kwargs: Any) -> Any:
        own = original(*args, **kwargs)
        stack = getattr(_calls, "stack", None)
        if not stack or stack[-1].planned:
            return own  # not inside exp_manager (or a second call in one): upstream's answer
        call = stack[-1]
        call.planned = True
        bound = signature.bind(*args, **kwargs).arguments
        call.order = nemo_resume_order.resume_order_for(bound["trainer"], call.is_global_rank_zero, call.grace)
        if call.order is None:
            return own
        return call.order.agree_log_dir(own, bound.get("explicit_log_dir"))

    get_log_dir.__wrapped__ = original  # type: ignore[attr-defined]
    get_log_dir.__doc__ = original.__doc__
    return get_log_dir


def _make_check_resume(original: Callable[..., Any]) -> Callable[..., Any]:
    def check_resume(*args: Any, **kwargs: Any) -> Any:
        order = _current()
        if order is None:
            return original(*args, **kwargs)
        return order.check_resume(original, *args, **kwargs)

    check_resume.__wrapped__ = original  # type: ignore[attr-defined]
    check_resume.__doc__ = original.__doc__
    return check_resume


def _make_exp_manager(original: Callable[..., Any], module: ModuleType) -> Callable[..., Any]:
    def exp_manager(trainer: Any, cfg: Any = None) -> Any:
        stack = _calls.__dict__.setdefault("stack", [])
        stack.append(_Call(nemo_resume_order.seconds_to_sleep(cfg), module.is_global_rank_zero))
        local_rank = log_local_rank(trainer)
        if local_rank is not None:
            os.environ["LOCAL_RANK"] = str(local_rank)  # upstream names its per-rank log file by it
        error: BaseException | None = None
        try:
            return original(trainer, cfg)
        except BaseException as exc:
            error = exc
            raise
        finally:
            call = stack.pop()
            if call.order is not None:
                try:
                    call.order.close(error)
                except Exception as close_error:  # never hide NeMo's own exception behind ours
                    log.warning("nemo_safe: exp_manager: could not tell the other ranks how rank 0 ended: %s",
                                close_error)  # fmt: skip
            if local_rank is not None:
                os.environ.pop("LOCAL_RANK", None)

    exp_manager.__wrapped__ = original  # type: ignore[attr-defined]
    exp_manager.__doc__ = original.__doc__
    return exp_manager


def apply(module: ModuleType) -> Replacements | None:
    release = recognise(module)
    if release is None:
        GATE.warn_unknown(module)
        return None
    changes = Replacements(f"matches {release}: rank 0 first, rank 0's log_dir on every rank, no fixed sleep")
    changes.set(module, "get_log_dir", _make_get_log_dir(module.get_log_dir))
    changes.set(module, "check_resume", _make_check_resume(module.check_resume))
    changes.set(module, "exp_manager", _make_exp_manager(module.exp_manager, module))
    changes.set(module, "time", _SleepGate(module.time if isinstance(module.time, ModuleType) else _time))
    return changes


describe = GATE.describe
