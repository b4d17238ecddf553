"""Processes that download a dataset into the same folder take turns (``utils._DownloadLock``, MNIST family).

One process, no network, no real waiting: the other process is played by the test, which writes its lock file
(``.download.lock.<generation>``) and the files its download leaves, and time is a fake clock that the waiting
process's sleeps advance (``utils.time``); ``download_and_extract_archive`` is mocked.
"""

import contextlib
import json
import os
import types

import pytest
from torchvision.datasets import mnist, utils

N = 3  # images per split


def _idx(type_code, dims, item_size):
    header = bytes([0, 0, type_code, len(dims)]) + b"".join(d.to_bytes(4, "big") for d in dims)
    size = item_size
    for d in dims:
        size *= d
    return header + bytes(size)


IMAGES, LABELS = _idx(0x08, (N, 28, 28), 1), _idx(0x08, (N,), 1)
MNIST_RAW = {
    "train-images-idx3-ubyte": IMAGES,
    "train-labels-idx1-ubyte": LABELS,
    "t10k-images-idx3-ubyte": IMAGES,
    "t10k-labels-idx1-ubyte": LABELS,
}
#: class name -> (class, constructor arguments, the raw files its _check_exists wants)
DATASETS = {
    "MNIST": (mnist.MNIST, {}, MNIST_RAW),
    "FashionMNIST": (mnist.FashionMNIST, {}, MNIST_RAW),
    "KMNIST": (mnist.KMNIST, {}, MNIST_RAW),
    "EMNIST": (
        mnist.EMNIST,
        {"split": "digits"},
        {"emnist-digits-train-images-idx3-ubyte": IMAGES, "emnist-digits-train-labels-idx1-ubyte": LABELS},
    ),
    "QMNIST": (
        mnist.QMNIST,
        {"what": "train"},
        {"qmnist-train-images-idx3-ubyte": IMAGES, "qmnist-train-labels-idx2-int": _idx(0x0C, (N, 8), 4)},
    ),
}


def _write_lock(folder, generation, state, beat=0, **extra):
    with open(os.path.join(folder, f".download.lock.{generation}"), "w") as f:
        json.dump({"state": state, "beat": beat, "token": "other", **extra}, f)


class _OtherProcess:
    """The process holding the lock of ``folder``, played on the fake clock: each sleep of the waiting process
    advances the clock and calls :meth:`tick`, which beats (``beating``) and ends at ``finish_at``."""

    def __init__(self, folder, beating=True, finish_at=None, finish=None):
        self.folder, self.beating, self.finish_at, self.finish = str(folder), beating, finish_at, finish
        self.now, self.beat = 1000.0, 0
        os.makedirs(self.folder, exist_ok=True)
        self.write("running")

    def write(self, state, **extra):
        _write_lock(self.folder, 0, state, self.beat, **extra)

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds
        if self.finish_at is not None and self.now >= self.finish_at:
            self.finish_at = None
            self.finish(self)
        elif self.beating:
            self.beat += 1
            self.write("running")

    def install(self, mocker):
        clock = types.SimpleNamespace(monotonic=self.monotonic, sleep=self.sleep)
        mocker.patch.object(utils, "time", clock, create=True)
        return self


def _lock_files(folder):
    return sorted(name for name in os.listdir(folder) if name.startswith(".download.lock"))


def test_holder_writes_its_lock_and_removes_it_when_done(tmpdir):
    lock = utils._DownloadLock(str(tmpdir / "new"))
    with lock.hold(lambda: False) as holding:
        assert holding
        with open(tmpdir / "new" / ".download.lock.0") as f:
            assert json.load(f)["state"] == "running"
    assert _lock_files(tmpdir / "new") == []


def test_waiter_returns_once_the_holder_is_done(tmpdir, mocker):
    done = []

    def finish(other):
        done.append(True)
        os.remove(os.path.join(other.folder, ".download.lock.0"))

    other = _OtherProcess(tmpdir, finish_at=1100.0, finish=finish).install(mocker)
    with utils._DownloadLock(str(tmpdir)).hold(lambda: bool(done)) as holding:
        assert not holding
    assert other.now >= 1100.0  # it waited for the holder, which beat all along


def test_holder_whose_beat_stopped_is_taken_over(tmpdir, mocker):
    other = _OtherProcess(tmpdir, beating=False).install(mocker)  # killed: its lock stays as it was
    with utils._DownloadLock(str(tmpdir)).hold(lambda: False) as holding:
        assert holding
        assert _lock_files(tmpdir) == [".download.lock.0", ".download.lock.1"]
    assert utils._LOCK_STALE <= other.now - 1000.0 < utils._LOCK_STALE + 2
    assert _lock_files(tmpdir) == []


def test_beating_holder_is_not_taken_over(tmpdir, mocker):
    other = _OtherProcess(tmpdir, finish_at=1000.0 + 10 * utils._LOCK_STALE, finish=lambda o: o.write("abandoned"))
    other.install(mocker)
    with utils._DownloadLock(str(tmpdir)).hold(lambda: False) as holding:
        assert holding  # only once it was abandoned
        assert other.now >= 1000.0 + 10 * utils._LOCK_STALE


def test_holder_failure_reaches_the_processes_that_saw_it_running(tmpdir, mocker):
    def fail(other):
        other.write("failed", error_type="RuntimeError", error="Error downloading train-images-idx3-ubyte.gz")

    _OtherProcess(tmpdir, finish_at=1005.0, finish=fail).install(mocker)
    match = "failed: RuntimeError: Error downloading train-images-idx3-ubyte.gz"
    with pytest.raises(RuntimeError, match=match):
        with utils._DownloadLock(str(tmpdir)).hold(lambda: False):
            pass


def test_an_earlier_failure_does_not_fail_a_later_attempt(tmpdir):
    with pytest.raises(ValueError, match="boom"):
        with utils._DownloadLock(str(tmpdir)).hold(lambda: False):
            raise ValueError("boom")
    with open(tmpdir / ".download.lock.0") as f:
        record = json.load(f)
    assert (record["state"], record["error_type"], record["error"]) == ("failed", "ValueError", "boom")
    with utils._DownloadLock(str(tmpdir)).hold(lambda: False) as holding:  # did not see that holder: tries again
        assert holding
    assert _lock_files(tmpdir) == []


def test_interrupted_holder_is_taken_over_at_once(tmpdir, mocker):
    with pytest.raises(KeyboardInterrupt):
        with utils._DownloadLock(str(tmpdir)).hold(lambda: False):
            raise KeyboardInterrupt
    other = _OtherProcess(tmpdir / "unused", beating=False).install(mocker)
    with utils._DownloadLock(str(tmpdir)).hold(lambda: False) as holding:
        assert holding
    assert other.now == 1000.0  # no waiting at all


@pytest.mark.parametrize("fails", [True, False])
def test_holder_that_was_taken_over_publishes_nothing(tmpdir, fails):
    with contextlib.suppress(ValueError):
        with utils._DownloadLock(str(tmpdir)).hold(lambda: False):
            _write_lock(tmpdir, 1, "running")  # another process took over while this one stalled
            if fails:
                raise ValueError("too late")
    with open(tmpdir / ".download.lock.0") as f:
        assert json.load(f)["state"] == "running"  # neither "failed" written nor the locks removed
    assert _lock_files(tmpdir) == [".download.lock.0", ".download.lock.1"]


def test_holder_reads_its_lock_again_while_it_is_being_replaced(tmpdir, mocker):
    lock = utils._DownloadLock(str(tmpdir))
    assert lock._create(0)
    real_open, missing = open, [FileNotFoundError()]  # some FUSE mounts answer ENOENT during a rename

    def open_(*args, **kwargs):
        if missing:
            raise missing.pop()
        return real_open(*args, **kwargs)

    mocker.patch.object(utils, "open", open_, create=True)
    mocker.patch.object(utils.time, "sleep")
    assert lock._holds(0)


def test_waiting_ends_after_the_timeout_without_any_sign_of_progress(tmpdir, mocker):
    other = _OtherProcess(tmpdir, beating=False).install(mocker)
    mocker.patch.object(utils._DownloadLock, "_read", side_effect=OSError("stale file handle"))
    with pytest.raises(RuntimeError, match="No progress downloading into .* for 1800 s"):
        with utils._DownloadLock(str(tmpdir)).hold(lambda: False):
            pass
    assert utils._LOCK_TIMEOUT <= other.now - 1000.0 < utils._LOCK_TIMEOUT + 2


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_dataset_waits_for_another_process_downloading_it(tmpdir, mocker, name):
    cls, kwargs, raw = DATASETS[name]
    folder = tmpdir / name

    def finish(other):  # what the other process's download leaves
        os.makedirs(folder / "raw")
        for file, content in raw.items():
            with open(folder / "raw" / file, "wb") as f:
                f.write(content)
        os.remove(folder / ".download.lock.0")

    other = _OtherProcess(folder, finish_at=1030.0, finish=finish).install(mocker)
    download = mocker.patch.object(mnist, "download_and_extract_archive")
    try:
        loaded = len(cls(str(tmpdir), download=True, **kwargs))
    except (RuntimeError, OSError) as e:  # its own download was the mock: "Dataset not found", EMNIST's raw/gzip
        loaded = e
    assert download.call_count == 0, "downloaded while another process was downloading it"
    assert loaded == N and other.now >= 1030.0


def test_complete_dataset_takes_no_lock(tmpdir, mocker):
    os.makedirs(tmpdir / "MNIST" / "raw")
    for file, content in MNIST_RAW.items():
        with open(tmpdir / "MNIST" / "raw" / file, "wb") as f:
            f.write(content)
    lock = mocker.patch.object(mnist, "_DownloadLock")
    assert len(mnist.MNIST(str(tmpdir), download=True)) == N
    assert lock.call_count == 0
