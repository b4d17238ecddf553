"""One implementation: what the upstream series carries is the code the overlay runs, not a copy of it.

For torchvision: the series' text of each function or class equals the overlay's source of it
(``patches/`` is generated from ``nemo_safe/`` and checked by ``make_patches.py --check``; this
test reads the committed patches themselves), and at run time the overlay executes those code
objects: a real single flight between two processes' worth of threads, profiled, runs
``_DownloadLock``'s own methods; MNIST's download wrapper and the atomic downloads are the
upstream functions' code objects. For NeMo: the series' text of each function of the resume ordering
equals ``nemo_resume_upstream``'s, and the overlay's exp_manager ordering runs those code objects
(``nemo_resume_core``); the real srun runs of it are in test_nemo_exp_manager.py and the matrix.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
import textwrap
import threading
import types
from pathlib import Path

import pytest

from nemo_safe import download_lock
from nemo_safe.patches import nemo_resume_core, nemo_resume_upstream, torchvision_mnist_upstream, torchvision_upstream
from nemo_safe.single_flight import SingleFlight
from nemo_safe.version_gate import STRUCTURE, VERIFIED

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
        while not waiter.locks.generations():  # the leader has won generation 0 (its lock folder alone is not that)
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


@pytest.mark.parametrize("name", [*nemo_resume_core.CORE, "_write_resume_state", "_resume_order_run"])
def test_the_nemo_series_carries_the_overlay_source(name: str) -> None:
    source = inspect.getsource(getattr(nemo_resume_upstream, name))
    added = _added_source("nemo", "nemo/utils/exp_manager.py")
    assert source in added, f"{name}: the series' text differs from nemo_resume_upstream's"


def test_exp_manager_ordering_runs_the_series_functions() -> None:
    """The overlay orders exp_manager with the series' code objects: get_log_dir's ordering is the series'
    _check_resume_in_order running in nemo.utils.exp_manager, and each function it calls by name is the
    series' too (or the overlay's helper around the series' writer, and exp_manager's own check_resume)."""
    exp_manager = pytest.importorskip("nemo.utils.exp_manager")  # nemo_safe is imported: it is patched now
    from nemo_safe.patches import nemo_exp_manager

    verdict = nemo_exp_manager.GATE.verdict(exp_manager)
    if verdict.status not in (VERIFIED, STRUCTURE):  # a release with the fix orders itself; one declined is upstream
        pytest.skip(f"the installed NeMo is not ordered by nemo_safe: {verdict}")
    order = inspect.getclosurevars(exp_manager.get_log_dir).nonlocals["order"]
    core = order.__wrapped__
    assert core.__code__ is nemo_resume_upstream._check_resume_in_order.__code__
    for name in nemo_resume_core.CORE:
        assert core.__globals__[name].__code__ is getattr(nemo_resume_upstream, name).__code__, name
    assert core.__globals__["check_resume"] is inspect.unwrap(exp_manager.check_resume)
    assert core.__globals__["logging"]._nemo is exp_manager.logging  # NeMo's logger: the waits speak NeMo's voice


def test_the_skipped_check_resume_call_is_the_one_the_series_makes() -> None:
    """The overlay skips exp_manager's ``check_resume(...)`` call because the series' core made it: the gate's
    text of that call (:data:`CHECK_RESUME_CALL`) and the core's ``run_check_resume`` pass the same arguments."""
    from nemo_safe.patches import nemo_exp_manager

    tree = ast.parse(textwrap.dedent(inspect.getsource(nemo_resume_upstream._check_resume_in_order)))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "check_resume"]
    assert len(calls) == 1, "the core calls check_resume in one place (run_check_resume)"
    call = calls[0]
    assert isinstance(call.args[1], ast.Name) and call.args[1].id == "directory"
    call.args[1] = ast.Name("log_dir")  # run_check_resume's parameter is the log_dir it is given
    assert ast.unparse(call) == nemo_exp_manager.CHECK_RESUME_CALL
