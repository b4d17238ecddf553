"""Every environment variable nemo_safe reads, judged one way: a value it cannot use gives one warning where it is
read and the safe choice (named in the warning), never an error that stops a job; ``nemo-safe doctor`` shows each
set variable with that verdict, so a bad value is found before a job starts."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import NamedTuple

from nemo_safe import node_copy, patching, single_flight, waiting

PREFIX = "NEMO_SAFE_"


class Setting(NamedTuple):
    name: str
    #: The value's text -> (what nemo_safe uses, described; what is wrong with the text, "" when nothing).
    judge: Callable[[str], tuple[str, str]]


def _seconds(default: float, minimum: float = 0.0, maximum: float = float("inf")) -> Callable[[str], tuple[str, str]]:
    def judge(raw: str) -> tuple[str, str]:
        value, problem = waiting.judge_seconds(raw, default, minimum, maximum)
        return f"{value:g} s", problem

    return judge


def _disable(raw: str) -> tuple[str, str]:
    off, problem = patching.judge_disable(raw)
    if off is True or off is False:
        return ("no library is patched" if off else "libraries are patched"), problem
    return f"every patch except {', '.join(sorted(off))}", problem


def _poll_max(raw: str) -> tuple[str, str]:
    value, problem = waiting.judge_seconds(raw, -1.0, waiting.POLL_MIN, waiting.POLL_MAX_SETTING_CEIL)
    if value < 0:  # the default depends on the job's size
        scaled = f"{waiting.POLL_MAX_FLOOR:g} to {waiting.POLL_MAX_CEIL:g} s by the job's size"
        return f"the default ({scaled})", problem and "not a finite, positive number of seconds; using the default"
    return f"{value:g} s", problem


#: What each means: the README's table of variables.
SETTINGS = (
    Setting(patching.DISABLE_ENV, _disable),
    Setting(waiting.TIMEOUT_ENV, _seconds(waiting.DEFAULT_TIMEOUT)),
    Setting(waiting.POLL_MAX_ENV, _poll_max),
    Setting(single_flight.STALE_AFTER_ENV, _seconds(single_flight.DEFAULT_STALE_AFTER, single_flight.MIN_STALE_AFTER)),
    Setting(node_copy.NODE_COPY_ENV, node_copy.judge_node_copy),
)
_BY_NAME = {setting.name: setting for setting in SETTINGS}
#: Variables of this repository's tooling (ci/), not read by the library.
TOOLING = ("NEMO_SAFE_CACHE", "NEMO_SAFE_PATCH_AUTHOR", "NEMO_SAFE_PYTHON", "NEMO_SAFE_SLURM_STATE")


class Verdict(NamedTuple):
    name: str
    raw: str
    used: str  # what nemo_safe uses ("" for an unknown name)
    problem: str  # "" when the value is fine


def verdicts(env: Mapping[str, str] | None = None) -> list[Verdict]:
    """A verdict for every ``NEMO_SAFE_*`` variable set in ``env`` (default: this process's), known or not."""
    env = os.environ if env is None else env
    out = []
    for name in sorted(n for n in env if n.startswith(PREFIX)):
        setting = _BY_NAME.get(name)
        if name in TOOLING:
            out.append(Verdict(name, env[name], "read by the repository's ci/ scripts, not by the library", ""))
            continue
        if setting is None:
            known = ", ".join(s.name for s in SETTINGS)
            out.append(Verdict(name, env[name], "", f"not a nemo_safe setting (a typo? known: {known})"))
            continue
        used, problem = setting.judge(env[name])
        out.append(Verdict(name, env[name], used, problem))
    return out
