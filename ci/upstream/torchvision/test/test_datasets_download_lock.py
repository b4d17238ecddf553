"""Processes that download a dataset into the same folder take turns (``utils._download_lock``, MNIST family).

One process, no network: the other process is played by the test, which writes the lock file itself (its token
line, later an error line) and the files a download would leave; ``download_and_extract_archive`` is mocked.
"""

import os
import threading
import time
from unittest import mock

import pytest
from torchvision.datasets import mnist, utils

LOCK = ".download.lock"
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


class _Background(threading.Thread):
    """Runs ``target`` in a thread, as the process that waits for the lock; keeps its result or error."""

    def __init__(self, target):
        super().__init__(daemon=True)
        self._target_fn, self.result, self.error, self.finished_at = target, None, None, None

    def run(self):
        try:
            self.result = self._target_fn()
        except Exception as e:
            self.error = e
        self.finished_at = time.monotonic()

    def outcome(self, timeout=10):
        self.join(timeout)
        assert not self.is_alive(), f"still waiting after {timeout} s"
        if self.error is not None:
            raise self.error
        return self.result


def _entering(folder, entered, **kwargs):
    def take():
        with utils._download_lock(str(folder), **kwargs):
            entered.set()

    return _Background(take)


def test_lock_held_by_another_process_is_waited_for(tmp_path):
    lock = tmp_path / LOCK
    lock.write_text("another-process\n")
    entered = threading.Event()
    waiter = _entering(tmp_path, entered)
    waiter.start()
    assert not entered.wait(1.0), "entered while another process holds the lock"
    lock.unlink()
    waiter.outcome()
    assert entered.is_set()
    assert not lock.exists(), "the holder removes its lock"


def test_lock_file_holds_a_token_while_held(tmp_path):
    with utils._download_lock(str(tmp_path / "new")):
        token = (tmp_path / "new" / LOCK).read_text()
        assert len(token) > 8 and token.endswith("\n")
    assert os.listdir(tmp_path / "new") == []


def test_abandoned_lock_is_taken_over(tmp_path):
    (tmp_path / LOCK).write_text("killed-process\n")  # and nothing changes in the folder
    entered = threading.Event()
    _entering(tmp_path, entered, stale=0.5).start()
    assert entered.wait(10), "an abandoned lock was not taken over"
    time.sleep(0.1)
    assert not (tmp_path / LOCK).exists()


def test_download_in_progress_keeps_its_lock(tmp_path):
    (tmp_path / LOCK).write_text("downloading-process\n")
    partial = tmp_path / "raw" / ".train-images-idx3-ubyte.gz.123.abcd.partial"
    partial.parent.mkdir()
    entered = threading.Event()
    waiter = _entering(tmp_path, entered, stale=0.5)
    waiter.start()
    with open(partial, "wb") as f:
        for _ in range(20):  # 2 s of a growing download, far longer than ``stale``
            f.write(b"x" * 1000)
            f.flush()
            assert not entered.wait(0.1), "took over the lock of a download in progress"
    stopped = time.monotonic()
    waiter.outcome()  # the download stopped growing: its process is taken for dead
    assert waiter.finished_at - stopped >= 0.5


def test_holder_failure_reaches_the_processes_waiting_for_it(tmp_path):
    lock = tmp_path / LOCK
    lock.write_text("holder\n")
    waiter = _entering(tmp_path, threading.Event())
    waiter.start()
    time.sleep(0.5)
    with open(lock, "a") as f:
        f.write("RuntimeError: Error downloading train-images-idx3-ubyte.gz")
    with pytest.raises(RuntimeError, match="failed: RuntimeError: Error downloading train-images-idx3-ubyte.gz"):
        waiter.outcome()


def test_failure_is_recorded_but_does_not_fail_later_attempts(tmp_path):
    with pytest.raises(ValueError, match="boom"):
        with utils._download_lock(str(tmp_path)):
            raise ValueError("boom")
    assert (tmp_path / LOCK).read_text().endswith("\nValueError: boom")
    with utils._download_lock(str(tmp_path)):  # did not see that holder: tries again, does not raise
        pass
    assert not (tmp_path / LOCK).exists()


def test_waiting_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(utils, "_DOWNLOAD_LOCK_TIMEOUT", 0.5)
    (tmp_path / LOCK).write_text("hung-process\n")
    with pytest.raises(RuntimeError, match=f"No progress downloading into .* for 0.5 s; is .*{LOCK}"):
        with utils._download_lock(str(tmp_path)):
            pass


def test_waiting_is_bounded_by_silence_not_by_a_slow_download(tmp_path, monkeypatch):
    monkeypatch.setattr(utils, "_DOWNLOAD_LOCK_TIMEOUT", 1.0)
    (tmp_path / LOCK).write_text("slow-process\n")

    def slow_holder():  # downloads for 2 s, growing its file all the while, then releases the lock
        for size in range(1, 9):
            (tmp_path / "part").write_bytes(b"x" * size)
            time.sleep(0.25)
        (tmp_path / LOCK).unlink()

    holder = threading.Thread(target=slow_holder)
    holder.start()
    with utils._download_lock(str(tmp_path)):
        assert (tmp_path / "part").read_bytes() == b"x" * 8
    holder.join()


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_dataset_waits_for_another_process_downloading_it(tmp_path, name):
    cls, kwargs, raw = DATASETS[name]
    folder = tmp_path / name
    folder.mkdir()
    (folder / LOCK).write_text("another-process\n")
    with mock.patch.object(mnist, "download_and_extract_archive") as download:
        loading = _Background(lambda: cls(str(tmp_path), download=True, **kwargs))
        loading.start()
        time.sleep(1.0)
        assert download.call_count == 0 and loading.is_alive(), "did not wait for the process downloading it"
        (folder / "raw").mkdir()
        for file, content in raw.items():  # what the other process's download leaves
            (folder / "raw" / file).write_bytes(content)
        (folder / LOCK).unlink()
        assert len(loading.outcome()) == N
    assert download.call_count == 0


def test_truncated_raw_file_is_downloaded_again(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for file, content in MNIST_RAW.items():
        (raw / file).write_bytes(content)
    (raw / "train-images-idx3-ubyte").write_bytes(IMAGES[:1000])  # left by an interrupted download

    def download_and_extract_archive(url, download_root, filename, md5):
        file = filename[: -len(".gz")]
        with open(os.path.join(download_root, file), "wb") as f:
            f.write(MNIST_RAW[file])

    with mock.patch.object(mnist, "download_and_extract_archive", side_effect=download_and_extract_archive):
        assert len(mnist.MNIST(str(tmp_path), download=True)) == N
    assert not (tmp_path / "MNIST" / LOCK).exists()


def test_complete_dataset_takes_no_lock(tmp_path):
    (tmp_path / "MNIST" / "raw").mkdir(parents=True)
    for file, content in MNIST_RAW.items():
        (tmp_path / "MNIST" / "raw" / file).write_bytes(content)
    with mock.patch.object(utils, "_download_lock") as lock, mock.patch.object(mnist, "_download_lock", lock):
        assert len(mnist.MNIST(str(tmp_path), download=True)) == N
    assert lock.call_count == 0
