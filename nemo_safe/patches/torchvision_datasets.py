"""Every other torchvision dataset with a ``download`` method: one download per root.

In torchvision 0.29.1 every process that builds ``CIFAR10(root, download=True)``
(or SVHN, STL10, Omniglot, OxfordIIITPet, ...) downloads and extracts into the
same root at once: N times the bytes from a public mirror and N extractions into
one folder (vision #8707, #8709). nemo_safe's atomic files already keep every
file complete or absent; this patch makes one process per root, dataset
class and arguments do the download while the others wait and then load.

One generic wrapper, no per-class code: each covered class's ``__init__`` calls
``self.download()`` (or ``self._download()``) under ``if download:`` and then
checks the data with one method (``_check_integrity``, ``_check_exists``, ...),
see :data:`COVERED`. The wrapper runs the class's own download in a
:class:`~nemo_safe.single_flight.SingleFlight` in the dataset's root, one flight
per class *and* per the arguments the instance holds when it downloads (``split``,
``name``, ``background``, ...: SVHN's test split must not wait for, or fail with,
its train split); a waiter returns once no process is downloading any more *and*
that same check holds (a check that looks at one of several downloaded folders
must not release it early), or raises the leader's error. No head start for rank
0: a rank that downloads what rank 0 never asks for would wait for nothing.
Ranks whose arguments differ do not meet and download as upstream does (each
file still atomic). The gate decides class by class (:func:`class_verdict`: the class's
``__init__``, download method and check byte for byte in :data:`KNOWN_SOURCES`, in any
release's table, or an ``__init__`` that calls the download method and then the check); a class
that is neither keeps upstream's behaviour, with one warning naming it.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

from nemo_safe.patching import Replacements
from nemo_safe.single_flight import SingleFlight, lock_folder_usable, run_else_upstream
from nemo_safe.version_gate import DECLINED, STRUCTURE, UNREADABLE, VERIFIED, Verdict, init_downloads_then_checks

log = logging.getLogger(__name__)

MODULE = "torchvision.datasets"

#: Class -> (its download method, the check its ``__init__`` makes right after downloading). The MNIST
#: family has its own patch (:mod:`nemo_safe.patches.torchvision_mnist`).
COVERED: dict[str, tuple[str, str]] = {
    "CIFAR10": ("download", "_check_integrity"),
    "CIFAR100": ("download", "_check_integrity"),
    "CLEVRClassification": ("_download", "_check_exists"),
    "Caltech101": ("download", "_check_integrity"),
    "Caltech256": ("download", "_check_integrity"),
    "CelebA": ("download", "_check_integrity"),
    "Country211": ("_download", "_check_exists"),
    "DTD": ("_download", "_check_exists"),
    "EuroSAT": ("download", "_check_exists"),
    "FGVCAircraft": ("_download", "_check_exists"),
    "Flowers102": ("download", "_check_integrity"),
    "Food101": ("_download", "_check_exists"),
    "GTSRB": ("download", "_check_exists"),
    "Imagenette": ("_download", "_check_exists"),
    "Kitti": ("download", "_check_exists"),
    "MovingMNIST": ("download", "_check_exists"),
    "Omniglot": ("download", "_check_integrity"),
    "OxfordIIITPet": ("_download", "_check_exists"),
    "PCAM": ("_download", "_check_exists"),
    "PhotoTour": ("download", "_check_downloaded"),
    "RenderedSST2": ("_download", "_check_exists"),
    "SBU": ("download", "_check_integrity"),
    "SEMEION": ("download", "_check_integrity"),
    "STL10": ("download", "_check_integrity"),
    "SUN397": ("_download", "_check_exists"),
    "SVHN": ("download", "_check_integrity"),
    "WIDERFace": ("download", "_check_integrity"),
}

#: Classes with ``download=True`` that stay as upstream has them, and why (the README lists them).
NOT_COVERED: dict[str, str] = {
    "INaturalist": "its check is 'the root folder is not empty', which the lock folder would make true",
    "Kinetics": "downloads videos with its own pool of worker processes",
    "LFWPeople": "download=True raises: no longer downloadable",
    "LFWPairs": "download=True raises: no longer downloadable",
    "StanfordCars": "download=True raises: no longer downloadable",
    "Places365": "downloads inside __init__, not in a method that can be wrapped",
    "SBDataset": "downloads inside __init__, not in a method that can be wrapped",
    "VOCDetection": "downloads inside __init__, not in a method that can be wrapped",
    "VOCSegmentation": "downloads inside __init__, not in a method that can be wrapped",
    "USPS": "downloads inside __init__, not in a method that can be wrapped",
    "Middlebury2014Stereo": "downloads inside __init__, not in a method that can be wrapped",
}

#: sha256 (first 16 hex) of each covered class's ``__init__``, download method and check, as verified.
KNOWN_SOURCES: dict[str, dict[str, str]] = {
    "torchvision 0.29.1": {
        "CIFAR10": "76a1a7335b9ca402",
        "CIFAR100": "76a1a7335b9ca402",
        "CLEVRClassification": "bd8f51d03ba2b647",
        "Caltech101": "5b6aafdd79f5dbc7",
        "Caltech256": "3af14016cec5cfb5",
        "CelebA": "7f17426b3fe427c3",
        "Country211": "3961754d11bde4de",
        "DTD": "ef9ff04a9ce95714",
        "EuroSAT": "581619ba53dee845",
        "FGVCAircraft": "f5ef5466ab7d4190",
        "Flowers102": "12a8fd7ce5622751",
        "Food101": "4a104b92d39cbfdf",
        "GTSRB": "fef021e258fee295",
        "Imagenette": "9611039154ac3519",
        "Kitti": "3f003b120d86a90b",
        "MovingMNIST": "b872574f7010da14",
        "Omniglot": "c14012f6b3a2870a",
        "OxfordIIITPet": "a260d9cead31ee53",
        "PCAM": "8baeb212fddd8238",
        "PhotoTour": "cd05889529a2a5ae",
        "RenderedSST2": "4a6af48d7b9e5be3",
        "SBU": "f9a0cd90bb304956",
        "SEMEION": "19cc57a8f1a225fb",
        "STL10": "d2ff9c8d8c91b2dc",
        "SUN397": "6b95c169bd4e38bc",
        "SVHN": "2dd92834ed6b3ced",
        "WIDERFace": "cea49a7f5afcda1a",
    },
}

_warned: set[str] = set()


def _owner(cls: type, name: str) -> type:
    """The class that defines ``name`` for ``cls`` (CIFAR100 downloads with CIFAR10's method)."""
    return next(c for c in cls.__mro__ if name in c.__dict__)


def class_digest(cls: type, method: str, check: str) -> str:
    """What the wrapper relies on, upstream's versions (also when the wrapper is in place)."""
    parts = (cls.__init__, _owner(cls, method).__dict__[method], getattr(cls, check))
    text = "".join(inspect.getsource(inspect.unwrap(part)) for part in parts)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def class_verdict(cls: type, method: str, check: str, name: str) -> Verdict:
    """Verified where the class's parts are a verified release's byte for byte (in any release's table:
    classes change in different releases); recognised by structure where its ``__init__`` calls the download
    method and then the check (the wrapper runs the class's own download, whatever it prints or fetches);
    else declined."""
    try:
        found = class_digest(cls, method, check)
        for release, digests in KNOWN_SOURCES.items():
            if digests.get(name) == found:
                return Verdict(VERIFIED, release)
        if init_downloads_then_checks(cls, method, check):
            return Verdict(STRUCTURE, f"its __init__ calls self.{method}(), then self.{check}()")
    except UNREADABLE as exc:
        return Verdict(DECLINED, f"its sources cannot be read ({type(exc).__name__})")
    return Verdict(DECLINED, f"its __init__ does not call self.{method}() and then self.{check}()")


def verdicts(module: ModuleType) -> dict[str, Verdict]:
    """Each covered class's verdict (a class the module does not define is left out)."""
    out = {}
    for name, (method, check) in COVERED.items():
        cls = getattr(module, name, None)
        if isinstance(cls, type):
            out[name] = class_verdict(cls, method, check, name)
    return out


def recognised(module: ModuleType) -> tuple[str | None, dict[str, type]]:
    """The newest verified release any patched class matches, and the classes that are patched."""
    found = verdicts(module)
    classes = {name: getattr(module, name) for name, verdict in found.items() if verdict.patches}
    releases = [v.detail for v in found.values() if v.status == VERIFIED]
    return (max(releases) if releases else None), classes


def single_flight(original: Callable[[Any], None], check: str) -> Callable[[Any], None]:
    """The class's own download method, run by one process per root, class and arguments (see
    :func:`arguments_key`); the others wait until nobody downloads any more and ``self.<check>()``
    holds, or raise the leader's error."""

    def download(self: Any) -> None:
        root = getattr(self, "root", None)
        if not isinstance(root, str | os.PathLike):
            return original(self)  # no root to meet in (a class of another release): as upstream
        folder = os.path.abspath(os.path.expanduser(os.fspath(root)))
        try:
            os.makedirs(folder, exist_ok=True)  # upstream's download creates it anyway
        except OSError:
            return original(self)  # upstream's own outcome (and error)
        if not lock_folder_usable(folder):
            return original(self)  # a read-only root, another user's lock folder: as upstream
        name = type(self).__name__
        flight = SingleFlight(folder, f"download-{name}-{arguments_key(self)}", what=f"{name} download into {folder}")

        def done() -> bool:
            return not flight.leader_running() and bool(getattr(self, check)())

        run_else_upstream(flight, lambda: original(self), done)

    download.__wrapped__ = original  # type: ignore[attr-defined]
    download.__doc__ = original.__doc__
    return download


def arguments_key(dataset: Any) -> str:
    """12 hex of sha256 over the dataset's class (module and name: a user's subclass is another class) and
    every attribute it holds that JSON can spell (strings, numbers, paths, lists of them: the split,
    the name, the folders derived from them). Equal on every rank that builds the same dataset; callables
    and other objects (transforms, loaders) are left out, so they cannot tell equal ranks apart."""
    cls = type(dataset)
    spelled = {}
    for name, value in vars(dataset).items():
        try:
            spelled[name] = json.dumps(value, sort_keys=True, default=_path_or_refuse)
        except (TypeError, ValueError):
            continue
    text = f"{cls.__module__}.{cls.__qualname__}|" + json.dumps(spelled, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:12]


def _path_or_refuse(value: Any) -> str:
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(type(value).__name__)


def apply(module: ModuleType) -> Replacements | None:
    found = verdicts(module)
    classes = {name: getattr(module, name) for name, verdict in found.items() if verdict.patches}
    declined = sorted(name for name, verdict in found.items() if not verdict.patches)
    if declined and "declined" not in _warned:
        _warned.add("declined")
        log.warning(
            "nemo_safe: torchvision.datasets: left untouched, declined (verified on %s): %s; their downloads stay "
            "as upstream has them (every process downloads).",
            ", ".join(KNOWN_SOURCES),
            "; ".join(f"{name}: {found[name].detail}" for name in declined),
        )
    if not classes:
        return None
    changes = Replacements(f"one download per root for {len(classes)} dataset classes ({_summary(found)})")
    patched: set[type] = set()
    refused = {getattr(module, name) for name in declined}
    for name, cls in classes.items():
        method, check = COVERED[name]
        owner = _owner(cls, method)
        changes.expect(module, name)
        if owner in patched or owner in refused:
            continue  # patched already, or the class that defines it was declined: its method stays upstream's
        patched.add(owner)
        original = owner.__dict__[method]
        changes.set(owner, method, single_flight(original, check), original=original)
    return changes


def _summary(found: dict[str, Verdict]) -> str:
    """``27 verified on torchvision 0.29.1``, ``20 recognised by structure, 7 declined``, ..."""
    counts: dict[str, int] = {}
    for verdict in found.values():
        key = str(verdict) if verdict.status == VERIFIED else {STRUCTURE: "recognised by structure",
                                                                DECLINED: "declined"}[verdict.status]  # fmt: skip
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} {key}" for key, n in counts.items()) or "no covered class"


def describe(module: ModuleType) -> str:
    """The unpatched module (see :class:`~nemo_safe.patching.Patch`)."""
    return f"{_summary(verdicts(module))} of {len(COVERED)} classes: every process downloads"
