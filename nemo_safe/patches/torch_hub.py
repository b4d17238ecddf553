"""torch.hub downloads (pretrained weights): one download per destination file at a time.

Why: ``resnet50(weights=...)``, every torchvision model builder and ``torch.hub.load``'s
checkpoints go through ``torch.hub.load_state_dict_from_url``, which downloads with
``download_url_to_file`` whenever the file is missing from the hub folder
(``$TORCH_HOME/hub/checkpoints``). Every rank of a job does that at once into the same
folder (pytorch/pytorch#68320): N ranks fetch the same file N times, over a site's
shared uplink and into one (often network) filesystem.

What changes: the module attribute ``torch.hub.download_url_to_file``, which
``load_state_dict_from_url`` looks up as a module global at call time (torchvision's
``WeightsEnum.get_state_dict`` calls ``load_state_dict_from_url``), runs upstream's
function inside :class:`~nemo_safe.single_flight.SingleFlight` in the destination's
folder, one flight per destination file (no head start for rank 0: a rank that fetches a file
rank 0 never asks for would wait for nothing). A process that finds another process's download
of the same file *running* waits for it and returns without downloading (over an existing file:
once the downloader has replaced it), after checking its own ``hash_prefix`` as upstream would;
if that download fails (a wrong hash prefix, a broken connection), it raises
:class:`~nemo_safe.errors.LeaderFailed` with the downloader's message, the downloader raises
upstream's own error.

What does not change: a caller that finds no download of that file running downloads,
also over an existing file (upstream overwrites it); upstream's function does the
download itself (its temporary ``.partial`` file, its hash check, its move into place).
Where the destination folder is missing or cannot hold the lock (not writable), upstream's
function is called directly and raises its own error. Only the download is made single-flight:
what callers do with the file afterwards is upstream's (``torch.hub.load``'s repository archive,
also fetched through this function, is still extracted, removed and moved into ``hub/`` by every
process, and a legacy zip checkpoint is still extracted by every process that loads it).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import os
import re
from collections.abc import Callable
from types import ModuleType
from typing import Any

from nemo_safe.patching import Replacements
from nemo_safe.single_flight import SingleFlight, lock_folder_usable, run_else_upstream
from nemo_safe.version_gate import Fact, SourceGate, called_name, calls_in_order, function_tree

log = logging.getLogger(__name__)

MODULE = "torch.hub"
#: The function replaced, and the caller whose behaviour depends on it (both are in the version gate).
FUNCTIONS = ("download_url_to_file", "load_state_dict_from_url")

KNOWN_SOURCES = {
    "448ef9251270f2c6f29fdc3d976aec38939a034a052bc409d07aefae7a421617": "torch 2.14.1",
}

#: Longest flight name taken from a file name; longer ones are cut and get a hash of the full name.
MAX_NAME = 100
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def _download_parameters(module: ModuleType) -> bool:
    """The wrapper reads ``url``, ``dst`` and ``hash_prefix`` from the call, bound to upstream's signature."""
    parameters = list(inspect.signature(inspect.unwrap(module.download_url_to_file)).parameters.values())
    return [p.name for p in parameters[:4]] == ["url", "dst", "hash_prefix", "progress"]


def _loads_through_module_global(module: ModuleType) -> bool:
    """``load_state_dict_from_url`` calls ``download_url_to_file`` by its module-global name."""
    calls = calls_in_order(function_tree(module.load_state_dict_from_url))
    return any(called_name(call) == "download_url_to_file" for call in calls)


#: What the patch relies on in ``torch.hub`` (it wraps ``download_url_to_file``, never replaces its body).
FACTS = (
    Fact("download_url_to_file(url, dst, hash_prefix, progress)", _download_parameters),
    Fact("load_state_dict_from_url calls the module global download_url_to_file", _loads_through_module_global),
)

GATE = SourceGate(
    MODULE,
    lambda module: [getattr(module, name) for name in FUNCTIONS],
    KNOWN_SOURCES,
    library="torch",
    unpatched="downloads as upstream does (every process that misses a file in the hub folder)",
    consequence="pretrained-weight downloads stay as upstream has them (every process downloads)",
    facts=FACTS,
    by_facts=True,
)
source_digest, recognise = GATE.digest, GATE.recognise


def flight_name(dst: str) -> str:
    """``download-<file name>``, made of safe characters and at most about :data:`MAX_NAME` long;
    a short hash of the full file name is added when it had to be cut or changed."""
    base = os.path.basename(dst)
    safe = _UNSAFE.sub("_", base).lstrip(".") or "_"
    if safe != base or len(safe) > MAX_NAME:
        digest = hashlib.sha256(base.encode("utf-8", "surrogateescape")).hexdigest()[:12]
        safe = f"{safe[:MAX_NAME]}~{digest}"
    return "download-" + safe


def _stat_key(path: str) -> tuple[int, ...] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def single_flight_download(original: Callable[..., None]) -> Callable[..., None]:
    """``download_url_to_file`` that runs ``original`` once per destination file at a time."""

    signature = inspect.signature(original)

    @functools.wraps(original)
    def download_url_to_file(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # upstream's own error
        bound.apply_defaults()
        url, dst, hash_prefix = bound.arguments["url"], bound.arguments["dst"], bound.arguments["hash_prefix"]
        path = os.path.abspath(os.path.expanduser(os.fspath(dst)))
        directory = os.path.dirname(path)
        if not lock_folder_usable(directory):
            return original(*args, **kwargs)
        # No head start for rank 0 (none of the flights gives one): a rank that downloads a file rank 0 never asks for
        # (its own shard, an evaluation on one rank) would wait for nothing.
        flight = SingleFlight(directory, flight_name(path), what=f"download of {url} to {path}")
        before = _stat_key(path)  # an existing file counts as done only once another process replaced it
        saw_running = False
        result: list[Any] = []

        def done() -> bool:
            nonlocal saw_running
            running = flight.leader_running()
            saw_running = saw_running or running
            if not saw_running or running:
                return False
            now = _stat_key(path)
            return now is not None and now != before

        downloaded_here = run_else_upstream(flight, lambda: result.append(original(*args, **kwargs)), done)
        if not downloaded_here and hash_prefix is not None:
            _check_hash(path, hash_prefix)
        return result[0] if result else None

    return download_url_to_file


def _check_hash(path: str, hash_prefix: str) -> None:
    """Upstream's check of the caller's own ``hash_prefix``, for a file another process downloaded
    (with its own prefix, possibly another one): the same error as upstream's."""
    sha256 = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha256.update(block)
    digest = sha256.hexdigest()
    if digest[: len(hash_prefix)] != hash_prefix:
        raise RuntimeError(f'invalid hash value (expected "{hash_prefix}", got "{digest}")')


def apply(module: ModuleType) -> Replacements | None:
    verdict = GATE.verdict(module)
    GATE.note(module, verdict)
    if not verdict.patches:
        return None
    changes = Replacements(f"{verdict}: one download per destination file at a time")
    changes.set(module, "download_url_to_file", single_flight_download(module.download_url_to_file))
    return changes


describe = GATE.describe
