"""NeMo's own start-up downloads: one download per destination file across processes, published whole.

Why: every rank of a job builds its model, and building downloads.
``nemo.utils.cloud.maybe_download_from_cloud`` (``ModelPT.from_pretrained`` from NGC)
re-uses any file it finds at the destination and ``urlretrieve``s straight into it, so a
rank that starts while another downloads restores a truncated ``.nemo``, and two ranks
write one file. ``megatron_utils._download`` (Megatron BERT / GPT-2 vocab and merges files)
is rank-gated only once ``torch.distributed`` exists; before that, every rank downloads into
the same ``path + ".tmp"`` and moves it, and ranks die with ``FileNotFoundError``
(NVIDIA/NeMo#12420).

What changes: both functions run the upstream pull request's versions
(:mod:`~nemo_safe.patches.nemo_downloads_upstream`: a temporary name per download, then
``os.replace``, also over the old file of a refresh) inside a
:class:`~nemo_safe.single_flight.SingleFlight` in the destination's folder, one flight per file:
one process downloads, the others wait for the complete file (or get the downloader's failure as
:class:`~nemo_safe.errors.LeaderFailed`). ``refresh_cache=True`` downloads once for the ranks
that ask together: a file replaced after a call began (``os.replace`` gives it a new inode) is
that call's refresh; a call that begins after it downloads again, as upstream's does.
``nemo.core.classes.common``'s ``from nemo.utils.cloud import maybe_download_from_cloud``
binding is rebound (a module imported after the patch binds the patched function itself).
Releases 1.23 to 2.7.3 download with ``wget.download``; there the same functions run with
:func:`wget_download_atomically`.

What does not change: once ``torch.distributed`` is initialized, ``_download`` keeps upstream's
rank gate and barrier (with the atomic download). Where the destination folder cannot hold the
lock, upstream's own function runs. Hugging Face downloads of ``from_pretrained`` go through
``huggingface_hub``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from nemo_safe.patches import nemo_downloads_upstream as upstream
from nemo_safe.patches.torch_hub import flight_name
from nemo_safe.patches.torchvision_downloads import temp_sibling
from nemo_safe.patches.upstream_code import run_in
from nemo_safe.patching import Replacements
from nemo_safe.single_flight import SingleFlight, lock_folder_usable, run_else_upstream
from nemo_safe.version_gate import Fact, SourceGate

log = logging.getLogger(__name__)

CLOUD_MODULE = "nemo.utils.cloud"
MEGATRON_MODULE = "nemo.collections.common.tokenizers.megatron_utils"

#: 1.23.0 to 2.7.3 download with ``wget.download`` (the one difference from 3.0.0): the pull request's function runs
#: there with :func:`wget_download_atomically`, which keeps wget's URL quoting and progress bar.
KNOWN_CLOUD = {
    "503c233163622da63379316674c382000230ed7e2748e02372db362e7e5123fd": "nemo_toolkit 3.0.0",
    "1aa1d6e552d840049ddc47c58fad1946e0473dce9549e65b491f07232b4db177": "nemo_toolkit 1.23.0 / 2.7.3",
}
CLOUD_SHAPES = {
    "c4abb6becab1119bc9e1f6bc37fbb7164c24a012740968f71ad91caecda0905b": "nemo_toolkit 3.0.0",
    "ec27663b912006585140294c13d0fde6b2a7a62757a1afb49af8f2885614fe68": "nemo_toolkit 1.23.0 / 2.7.3",
}
#: 1.23.0 keeps ``_download`` in ``nemo.collections.nlp.modules.common.megatron.megatron_utils``: not patched.
KNOWN_MEGATRON = {
    "c769512d47600d75d6919de7477af80a3aea7c47b6c2f4c97cf1bdee2bb84087": "nemo_toolkit 3.0.0",
    "08940d6e4def8b5718d3106d132a6de1a9f238a9570036a0258563d2d37289f5": "nemo_toolkit 2.7.3",
}
MEGATRON_SHAPES = {
    "faf447c60f525fd9acda29fc17333849368f6a1cea9653b50596877607abfa9d": "nemo_toolkit 3.0.0",
    "6dfc02be95b000f62ceae9e97094b76eb39e372457318a87cfb8d3358d2fcb12": "nemo_toolkit 2.7.3",
}


def _cloud_signature(module: ModuleType) -> bool:
    parameters = inspect.signature(inspect.unwrap(module.maybe_download_from_cloud)).parameters
    return list(parameters) == ["url", "filename", "subfolder", "cache_dir", "refresh_cache"]


def _megatron_signature(module: ModuleType) -> bool:
    parameters = inspect.signature(inspect.unwrap(module._download)).parameters
    return list(parameters) == ["path", "url"] and isinstance(getattr(module, "MEGATRON_CACHE", None), str)


CLOUD_GATE = SourceGate(
    CLOUD_MODULE,
    lambda module: [module.maybe_download_from_cloud],
    KNOWN_CLOUD,
    library="nemo_toolkit",
    unpatched="as upstream: every process downloads a file it misses, into its final name (partial files re-used)",
    consequence="NGC downloads of from_pretrained stay as upstream has them (every rank downloads)",
    facts=(Fact("maybe_download_from_cloud(url, filename, subfolder, cache_dir, refresh_cache)", _cloud_signature),),
    shapes=CLOUD_SHAPES,
    fixed=Fact("nemo/utils/cloud.py defines download_atomically (the upstream fix)",
               lambda module: callable(getattr(module, "download_atomically", None))),
)  # fmt: skip
MEGATRON_GATE = SourceGate(
    MEGATRON_MODULE,
    lambda module: [module._download],
    KNOWN_MEGATRON,
    library="nemo_toolkit",
    unpatched="as upstream: before torch.distributed exists every process downloads into one .tmp file",
    consequence="Megatron vocab and merges downloads stay as upstream has them (ranks may fail, NeMo #12420)",
    facts=(Fact("_download(path, url) and MEGATRON_CACHE", _megatron_signature),),
    shapes=MEGATRON_SHAPES,
    fixed=Fact("megatron_utils calls download_atomically (the upstream fix)",
               lambda module: "download_atomically" in inspect.getsource(inspect.unwrap(module._download))),
)  # fmt: skip


def _identity(path: Path | str) -> tuple[int, int, int, int] | None:
    """What tells a replaced file from the one that was there: ``os.replace`` gives a refresh a new inode."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


def single_flight_cloud(original: Callable[..., Any], pull_request: Callable[..., Any]) -> Callable[..., Any]:
    """``maybe_download_from_cloud`` that runs the pull request's function once per destination file at a time."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def maybe_download_from_cloud(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            location = Path.joinpath(Path.home(), ".cache/torch/NeMo") if a["cache_dir"] is None else a["cache_dir"]
            destination = location if a["subfolder"] is None else Path.joinpath(location, a["subfolder"])
            os.makedirs(destination, exist_ok=True)
            destination_file = Path.joinpath(destination, a["filename"])
            folder = os.path.dirname(os.path.abspath(destination_file))
        except (TypeError, AttributeError, OSError):
            return original(*args, **kwargs)  # its own error, as upstream's
        if not bound.arguments["refresh_cache"] and os.path.isfile(destination_file):
            return pull_request(*args, **kwargs)  # re-used, as upstream re-uses a file
        if not lock_folder_usable(folder):
            return original(*args, **kwargs)
        # A refresh is done once the file was replaced after this call began (by this process or by the one that
        # did it for the job's ranks that asked at the same time); a rank that asks later downloads again.
        before = _identity(destination_file) if bound.arguments["refresh_cache"] else None

        def done() -> bool:
            return os.path.isfile(destination_file) and (before is None or _identity(destination_file) != before)

        flight = SingleFlight(folder, flight_name(str(destination_file)),
                              what=f"download of {a['url']}{a['filename']} to {destination_file}")  # fmt: skip
        result: list[Any] = []
        run_else_upstream(flight, lambda: result.append(pull_request(*args, **kwargs)), done)
        return result[0] if result else destination_file  # a waiter: what upstream's own download returns

    return maybe_download_from_cloud


def single_flight_megatron(original: Callable[..., Any], pull_request: Callable[..., Any]) -> Callable[..., Any]:
    """``_download`` that runs the pull request's function once per file at a time before ``torch.distributed``."""

    @functools.wraps(original)
    def _download(path: str, url: str) -> Any:
        import torch  # megatron_utils imported it already

        if url is None or os.path.exists(path) or torch.distributed.is_initialized():
            return pull_request(path, url)  # upstream's rank gate and barrier once a process group exists
        folder = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError:
            return original(path, url)
        if not lock_folder_usable(folder):
            return original(path, url)
        flight = SingleFlight(folder, flight_name(path), what=f"download of {url} to {path}")
        run_else_upstream(flight, lambda: pull_request(path, url), lambda: os.path.exists(path))
        return path

    return _download


def wget_download_atomically(url: str, path: str) -> None:
    """The pull request's ``download_atomically`` for releases that download with ``wget.download`` (1.23, 2.x):
    wget's URL quoting and progress bar kept. wget writes a temporary file of its own next to the name it is
    given, so it gets a private folder (named by its writer: removed on SIGTERM, swept once the writer is gone),
    whose one file is published with ``os.replace``."""
    import wget  # those releases import it themselves

    private = temp_sibling(path)
    os.mkdir(private)
    try:
        wget.download(url, out=os.path.join(private, "download"))
        os.replace(os.path.join(private, "download"), path)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _downloads_with_wget(function: Callable[..., Any]) -> bool:
    return "wget.download(" in inspect.getsource(inspect.unwrap(function))


def _pull_request(module: ModuleType, name: str) -> Callable[..., Any]:
    """The pull request's ``name`` running in ``module``; its temporary files named by their writer, removed when
    SIGTERM ends a download, swept once their writer is gone (:func:`~nemo_safe.atomic_files.sibling_temp`)."""
    if _downloads_with_wget(getattr(module, name)):
        return run_in(upstream, module, [name], {"download_atomically": wget_download_atomically})[name]
    return run_in(upstream, module, ["download_atomically", name], {"_partial_path": temp_sibling})[name]


def apply_cloud(module: ModuleType) -> Replacements | None:
    verdict = CLOUD_GATE.verdict(module)
    CLOUD_GATE.note(module, verdict)
    if not verdict.patches:
        return None
    original = module.maybe_download_from_cloud
    changes = Replacements(f"{verdict}: one download per destination file, published whole")
    patched = single_flight_cloud(original, _pull_request(module, "maybe_download_from_cloud"))
    patched.__nemo_safe__ = True  # type: ignore[attr-defined]
    changes.set(module, "maybe_download_from_cloud", patched)
    return changes


def apply_cloud_binding(module: ModuleType) -> Replacements | None:
    """Rebind ``maybe_download_from_cloud`` in a module that imported it by name before the patch."""
    cloud = sys.modules.get(CLOUD_MODULE)
    patched = getattr(cloud, "maybe_download_from_cloud", None)
    if not getattr(patched, "__nemo_safe__", False):
        return None
    bound = getattr(module, "maybe_download_from_cloud", None)
    if bound is not patched.__wrapped__ and bound is not patched:  # type: ignore[union-attr]
        return None
    changes = Replacements(f"{module.__name__} calls the single-flight maybe_download_from_cloud")
    changes.set(module, "maybe_download_from_cloud", patched, original=patched.__wrapped__)  # type: ignore[union-attr]
    return changes


def apply_megatron(module: ModuleType) -> Replacements | None:
    verdict = MEGATRON_GATE.verdict(module)
    MEGATRON_GATE.note(module, verdict)
    if not verdict.patches:
        return None
    changes = Replacements(f"{verdict}: one download per file before torch.distributed, published whole")
    changes.set(module, "_download", single_flight_megatron(module._download, _pull_request(module, "_download")))
    return changes


describe_cloud, describe_megatron = CLOUD_GATE.describe, MEGATRON_GATE.describe


def describe_cloud_binding(module: ModuleType) -> str:
    if not getattr(getattr(sys.modules.get(CLOUD_MODULE), "maybe_download_from_cloud", None), "__nemo_safe__", False):
        return "nemo-cloud-single-flight is not in place: this module calls upstream's maybe_download_from_cloud"
    return "not applied: this module keeps the maybe_download_from_cloud it imported"
