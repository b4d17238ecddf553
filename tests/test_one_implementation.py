"""One implementation: what the upstream series carries is the code the overlay runs, not a copy of it.

For torchvision: the series' text of each function or class equals the overlay's source of it
(``patches/`` is generated from ``nemo_safe/`` and checked by ``make_patches.py --check``; this
test reads the committed patches themselves), and at run time the overlay executes those code
objects: a real single flight between two processes' worth of threads, profiled, runs
``_DownloadLock``'s own methods; MNIST's download wrapper and the atomic downloads are the
upstream functions' code objects. (NeMo's ordering is not yet one implementation: issue 23.)
"""

from __future__ import annotations

import inspect
import re
import sys
import threading
import types
from pathlib import Path

import pytest

from nemo_safe import download_lock
from nemo_safe.patches import torchvision_mnist_upstream, torchvision_upstream
from nemo_safe.single_flight import SingleFlight

REPO = Path(__file__).resolve().parents[1]
#: The protocol every SingleFlight runs from _DownloadLock (the overlay overrides small methods around them).
PROTOCOL = ("hold", "_wait", "_finish", "_beat")


def _added_source(project: str, path: str) -> str:
    """The lines the committed series adds to ``path``, as one text."""
    added: list[str] = []
    for patch in sorted((REPO / "patches" / project).glob("*.patch")):
        current = None
        for line in patch.read_text().splitlines():
            if line.startswith("+++ "):
                current = line[len("+++ b/") :]
            elif current == path and line.startswith("+"):
                added.append(line[1:])
    return "\n".join(added) + "\n"


@pytest.mark.parametrize(
    ("module", "name", "target"),
    [
        (download_lock, "_DownloadLock", "torchvision/datasets/utils.py"),
        (torchvision_mnist_upstream, "_download_once", "torchvision/datasets/mnist.py"),
        *[
            (torchvision_upstream, n, "torchvision/datasets/utils.py")
            for n in ("_temp_sibling", "_replace", "_atomic_path", "_urlretrieve", "_publish_tree", "_atomic_extractor")
        ],
    ],
)
def test_the_series_carries_the_overlay_source(module: types.ModuleType, name: str, target: str) -> None:
    source = inspect.getsource(getattr(module, name))
    added = _added_source("torchvision", target)
    assert source in added, f"{name}: the series' text differs from {module.__name__}'s"


def test_single_flight_runs_the_upstream_lock_protocol(tmp_path: Path) -> None:
    """A leader and a waiter of a real SingleFlight (threads, the lock files on disk), profiled: the methods of
    PROTOCOL that run are _DownloadLock's code objects, and SingleFlight only adds around them."""
    assert issubclass(SingleFlight, download_lock._DownloadLock)
    protocol_codes = {getattr(download_lock._DownloadLock, n).__code__ for n in ("_wait", "_finish", "_beat")}
    protocol_codes.add(inspect.unwrap(download_lock._DownloadLock.hold).__code__)
    ran: set[types.CodeType] = set()
    release = threading.Event()

    def profile(frame: types.FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_code in protocol_codes:
            ran.add(frame.f_code)

    def job() -> None:
        release.wait(10)
        (tmp_path / "made").write_text("x")

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        leader = threading.Thread(target=SingleFlight(tmp_path, "job").run, args=(job, (tmp_path / "made").exists))
        leader.start()
        waiter = SingleFlight(tmp_path, "job")
        while not (tmp_path / ".nemo_safe").exists():  # the leader has won generation 0
            threading.Event().wait(0.01)
        threading.Timer(1.5, release.set).start()  # the leader beats at least once first
        waiter.run(lambda: pytest.fail("the waiter ran the job"), (tmp_path / "made").exists)
        leader.join(30)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    assert not leader.is_alive()
    names = {code.co_name for code in ran}
    assert names == set(PROTOCOL), names


def test_mnist_download_runs_the_upstream_wrapper() -> None:
    """The overlay's MNIST download wrapper is upstream's ``_download_once`` code object (with mnist's globals)."""
    mnist = pytest.importorskip("torchvision.datasets.mnist")
    from nemo_safe.patches import torchvision_mnist

    shared = torchvision_mnist.shared_functions(mnist)
    assert shared["_download_once"].__code__ is torchvision_mnist_upstream._download_once.__code__
    assert shared["_download_once"].__globals__["_DownloadLock"] is torchvision_mnist.download_lock
    assert re.search(r"_DownloadLock\(", inspect.getsource(torchvision_mnist_upstream._download_once))


def test_atomic_downloads_run_the_upstream_functions() -> None:
    utils = pytest.importorskip("torchvision.datasets.utils")
    from nemo_safe.patches import torchvision_downloads

    shared = torchvision_downloads.shared_functions(utils)
    for name in ("_urlretrieve", "_decompress", "_atomic_extractor"):
        assert shared[name].__code__ is getattr(torchvision_upstream, name).__code__, name
