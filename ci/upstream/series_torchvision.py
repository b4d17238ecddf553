"""The torchvision series: what each patch takes from nemo_safe and where it goes."""

from __future__ import annotations

from pathlib import Path

from series import Series, UpstreamPatch, _copy_tests
from source_edit import (
    constant,
    decorate_method,
    definitions,
    insert_before_def,
    replace_function,
    replace_once,
)

# ---------------------------------------------------------------------------------------- torchvision

TV_WIDTH = 120  # torchvision's black line length
#: Patch 1: what nemo_safe/patches/torchvision_upstream.py holds, verbatim, and where it goes in utils.py.
TV_UPSTREAM = "patches.torchvision_upstream"
TV_HELPERS_BEFORE_URLRETRIEVE = ("_temp_sibling", "_replace", "_atomic_path")
TV_HELPERS_BEFORE_EXTRACTORS = ("_publish_tree", "_atomic_extractor")
#: Patch 2: the lock (utils.py, from download_lock.py: the class every SingleFlight of the overlay is) and what
#: mnist.py gets (torchvision_mnist_upstream.py).
TV_LOCK_MODULE = "download_lock"
TV_LOCK = ("_LOCK_BEAT", "_DownloadLock")
TV_MNIST_UPSTREAM = "patches.torchvision_mnist_upstream"
TV_MNIST = ("_download_once",)


def _tv_atomic(tree: Path) -> None:
    path = tree / "torchvision/datasets/utils.py"
    insert_before_def(path, "_urlretrieve", definitions(TV_UPSTREAM, TV_HELPERS_BEFORE_URLRETRIEVE))
    replace_function(path, "_urlretrieve", definitions(TV_UPSTREAM, ("_urlretrieve",)))
    replace_function(path, "_decompress", definitions(TV_UPSTREAM, ("_decompress",)), keep_head=True)
    replace_once(
        path,
        "\n\n_ARCHIVE_EXTRACTORS: dict[",
        "\n\n" + definitions(TV_UPSTREAM, TV_HELPERS_BEFORE_EXTRACTORS) + "\n\n_ARCHIVE_EXTRACTORS: dict[",
    )
    replace_once(
        path,
        '    ".tar": _extract_tar,\n    ".zip": _extract_zip,\n',
        '    ".tar": _atomic_extractor(_extract_tar),\n    ".zip": _atomic_extractor(_extract_zip),\n',
    )
    for indent, after in (
        ("            ", "\n        except (urllib.error.URLError, OSError) as e:"),
        ("                ", "\n            else:"),
    ):
        replace_once(
            path, f"{indent}_urlretrieve(url, fpath){after}", f"{indent}_urlretrieve(url, fpath, md5=md5){after}"
        )
    # The md5 is checked once, by _urlretrieve() while the file arrives (before it is published).
    replace_once(
        path,
        "    # check integrity of downloaded file\n    if not check_integrity(fpath, md5):\n",
        "    # check integrity of downloaded file\n"
        "    if not check_integrity(fpath, md5 if _is_remote_location_available() else None):\n",
    )
    replace_once(path, "import bz2\nimport gzip\n", "import bz2\nimport contextlib\nimport functools\nimport gzip\n")
    replace_once(path, "import re\nimport tarfile\n", "import re\nimport shutil\nimport tarfile\n")
    replace_once(path, "from collections.abc import Iterable\n", "from collections.abc import Iterable, Iterator\n")
    _copy_tests("torchvision", tree, "test/test_datasets_utils_atomic.py")


def _tv_download_once(tree: Path) -> None:
    utils, mnist = tree / "torchvision/datasets/utils.py", tree / "torchvision/datasets/mnist.py"
    insert_before_def(utils, "iterable_to_str", definitions(TV_LOCK_MODULE, TV_LOCK))
    replace_once(utils, "import hashlib\n", "import hashlib\nimport json\n")
    replace_once(
        utils, "import tarfile\nimport urllib\n", "import tarfile\nimport threading\nimport time\nimport urllib\n"
    )
    anchor = "\n\nclass MNIST(VisionDataset):"
    replace_once(mnist, anchor, "\n\n" + definitions(TV_MNIST_UPSTREAM, TV_MNIST) + anchor)
    # The classes with a download of their own (FashionMNIST and KMNIST inherit MNIST's).
    for cls in constant("patches.torchvision_mnist", "CLASSES"):
        decorate_method(mnist, cls, "download", "_download_once")
    replace_once(mnist, "import codecs\nimport os\n", "import codecs\nimport functools\nimport os\n")
    replace_once(
        mnist,
        "from .utils import _flip_byte_order, check_integrity, download_and_extract_archive, extract_archive, "
        "verify_str_arg\n",
        "from .utils import (\n    _DownloadLock,\n    _flip_byte_order,\n    check_integrity,\n"
        "    download_and_extract_archive,\n    extract_archive,\n    verify_str_arg,\n)\n",
    )
    _copy_tests("torchvision", tree, "test/test_datasets_download_lock.py", "test/test_datasets_download_race.py")


TORCHVISION = Series(
    project="torchvision",
    distribution="torchvision",
    base_version="0.29.1",
    verified=("0.29.1",),
    patches=(
        UpstreamPatch(
            "datasets-atomic-files",
            "datasets: publish downloaded, decompressed and extracted files atomically",
            """
_urlretrieve() opens the final path with "wb" and streams the response
into it, _decompress() opens the final file with "wb" before
decompressing, and the tar and zip extractors write in place. So while a
file is being written, every other process sees it under its final name,
empty or partial. With download=True on every rank of a DDP job (see the
warning added in #8707/#8709, pytorch/tutorials#3065/#3066,
pytorch/examples#1403/#1411 and pytorch/pytorch#68320), a rank that finds
the file present loads it half-written, or truncates it for the rank still
writing it. A download that breaks off, or a killed process, leaves a
partial file that the next run takes as present; when the server closes
the connection early and no md5 is given, download_url() even returns
normally with a truncated file.

Write each of these files under a hidden temporary name in the same
directory (.<name>.<pid>.<random>.partial, unique per process and call)
and os.replace() it into place only when it is complete, so a reader sees
no file or the whole file. The temporary is removed on any error. Tar and
zip archives are extracted into such a temporary folder next to the
destination (in its parent), then each file is moved into place (new
directories are created with the default mode, not the archive's). Where
a folder cannot be moved from the parent into the destination (a
read-only parent, another filesystem or mount: tried by renaming the
empty folder in and back), the folder is made inside the destination.

_urlretrieve() now checks that all Content-Length bytes arrived; a short
body raises urllib.error.ContentTooShortError, urllib's own error for this
(a URLError, so download_url()'s https-to-http retry and the mirror loops
treat it as any connection error). Errors raised while reading the body
propagate unchanged. download_url() passes its md5 to _urlretrieve(),
which computes it over the bytes as they arrive and checks it before
publishing: a mismatch raises RuntimeError("File not found or
corrupted.") as before, but no longer leaves the wrong file behind. The
file is not read back to check it again, so the md5 costs no extra pass
over the file (download_url() still checks after
_download_file_from_remote_location()).

Review points, one by one:
- Leftovers of killed writers: nothing is listed or swept on the download
  path (whether a writer on another host is alive cannot be told from a
  file name). A killed download leaves its hidden .partial file next to
  the final name, never taken for the dataset file (DatasetFolder does
  not list it: no image suffix). A killed extraction leaves its folder
  next to the destination, so nothing that lists the destination sees it
  (ImageFolder would take a folder inside it for a class and shift every
  label); only the fallback above makes it inside. Where the destination's
  parent is itself a dataset root, that folder is listed there: ImageNet's
  parse_train_archive() extracts each class archive into train/<wnid>, so
  a kill mid-extraction leaves train/.<wnid>.<pid>.<hex>.partial, which
  ImageFolder takes for a class (ImageNet then fails with a KeyError on
  it; today such a kill leaves a silently incomplete class folder). A
  find_classes() that skipped dot-folders would cure both; not done here.
- Atomic per file, not per tree: a process may see some members of an
  archive published and others not yet. A folder rename cannot merge into
  an existing destination; datasets check for their whole tree
  (_check_exists, _check_integrity), and the next commit makes the MNIST
  family download and extract once.
- Windows: os.replace() onto a file another process has open raises
  PermissionError there. _replace() then writes the new content over it
  in place, as torchvision writes every file today: that reader may see
  it partly written, as it may today, but a file that failed its md5 is
  never kept (keeping the file there, as an earlier version did, let
  download_url() return a stale one). Elsewhere the error is raised as
  before. Nothing POSIX-only is used
  (os.replace, os.rename, os.makedirs, shutil.rmtree).
- gdown and the remote-location hook are left as they are:
  download_file_from_google_drive() hands the path to gdown, which already
  writes <name>XXXXXXXX.part in the same folder and moves it into place
  (gdown 6.5.1 checked), so no partial file is ever under the final name;
  _download_file_from_remote_location() is an empty function in every
  release (_is_remote_location_available() returns False), a hook for
  builds that replace torchvision/_internally_replaced_utils.py.

All in torchvision/datasets/utils.py.

Tested: test/test_datasets_utils_atomic.py (tmpdir and mocker, as
test_datasets_utils.py), with urllib.request.urlopen mocked (no network,
one process, under five seconds): a body shorter
than its Content-Length, a connection reset mid-body and a wrong md5 must
raise (ContentTooShortError, ConnectionResetError, RuntimeError) and
leave no file; while a file is downloaded, decompressed or extracted from
a tar or zip archive, the final path must never hold a partial file (the
fake response, the decompressor and the archive copy look at it on every
read); a truncated archive must leave nothing in the destination; the
md5 is computed without reading the file back (calculate_md5 is never
called); _replace() writes over a file it may not replace on Windows
(os mocked), as before this change. Before this change those
fail (the first eight on their assertions). Behaviour kept, and checked:
a good download, an extraction into an existing folder, into the working
directory, and with the fallback inside the destination (mkdir or rename
refused) leave exactly the expected files, and an extraction in progress
shows nothing but members in the destination.
""",
            _tv_atomic,
            tests=("test/test_datasets_utils_atomic.py",),
            race_tests=tuple(
                f"test/test_datasets_utils_atomic.py::{name}"
                for name in (
                    "test_download_url_short_body_raises_and_publishes_nothing",
                    "test_download_url_read_error_propagates_and_publishes_nothing",
                    "test_download_url_wrong_md5_raises_and_publishes_nothing",
                    "test_download_url_never_shows_a_partial_file",
                    "test_decompress_never_shows_a_partial_file",
                    "test_extract_tar_never_shows_a_partial_file",
                    "test_extract_zip_never_shows_a_partial_file",
                    "test_failed_extraction_publishes_nothing",
                )
            ),
            keeps_behaviour=tuple(
                f"test/test_datasets_utils_atomic.py::{name}"
                for name in (
                    "test_download_url_complete_file_is_published",
                    "test_extract_archive_into_existing_destination",
                    "test_extract_archive_without_a_folder_extracts_into_the_working_directory",
                    "test_download_url_with_a_long_file_name",
                    # Before this change too, an extraction in progress showed only members in the destination.
                    "test_extraction_in_progress_lists_nothing_else_in_the_destination",
                    "test_extraction_stages_inside_the_destination_where_next_to_it_fails",
                )
            ),
        ),
        UpstreamPatch(
            "mnist-download-once",
            "datasets: download the MNIST family once per root across processes",
            """
With download=True every process that builds MNIST (or FashionMNIST,
KMNIST, EMNIST, QMNIST) downloads and extracts the same files into the
same root at once: every rank of a DDP job, as the FSDP tutorial's
mp.spawn workers do (pytorch/tutorials#3065/#3066, pytorch/examples
#1403/#1411; the documentation only warns about it since #8707/#8709).
Before the previous commit they overwrote each other's files; with it,
the files are safe but every process still fetches the whole dataset, and
EMNIST removes raw/gzip while other processes may still extract from it.

download() of MNIST, EMNIST and QMNIST (FashionMNIST and KMNIST inherit
MNIST's) is wrapped by _download_once: if _check_exists(), return; else
hold utils._DownloadLock(root/<Class>) with _check_exists as "done". The
first process downloads; the others wait until _check_exists() holds.

The lock (utils._DownloadLock) is a file <folder>/.download.lock.<n>:
- Creating generation n with os.open(O_CREAT | O_EXCL) elects its
  holder; exactly one process wins it (local disks, NFSv3+, Windows).
  No fcntl/flock, no hard links, no threads in the waiters.
- Liveness is a heartbeat, not a fixed cap or the folder's file sizes:
  the holder rewrites its lock (temporary file + os.replace) every
  second with a growing beat. Waiters count silence only between their
  own timely reads, so their own stalls, or reads that fail (an NFS
  failover), are not taken for the holder's. A holder whose beat stopped
  for 15 s (killed, stopped, its host gone) is taken over; one that
  beats is never taken over, however long it downloads.
- Takeover is atomic: a waiter creates generation n+1 with O_EXCL, so
  exactly one process takes over, and nothing is ever deleted to steal a
  lock. A holder checks that it still holds its generation (its token,
  and no newer generation) before it publishes any outcome: one taken
  over while stalled publishes nothing (its files are whole anyway, by
  the previous commit). A lock that reads as missing is read again three
  times within 70 ms: a path-based FUSE mount answers ENOENT for a file
  while a beat's rename replaces it, which made a healthy holder think it
  was taken over (nemo_safe's overlay met it in its tests).
- The holder's error (type and message) is written into its lock. Only
  processes that saw that holder running raise it (RuntimeError naming
  the folder and the error), within one poll; a process that arrives
  later, or retries after the error, is a new attempt and takes over.
  Ctrl-C marks the lock abandoned: the next process takes over at once.
- A waiter gives up after _LOCK_TIMEOUT (30 min) without any sign of
  progress (a listing or read of the lock that keeps failing).
- On success the holder removes its generation and older ones, the
  oldest first; removing or writing that fails (a full disk; on Windows,
  a waiter reading the lock at that moment) is not an error: the others
  then see the beat stop and take over, and find the dataset complete.
Waiters poll with exponential back-off (10 ms to 1 s). No logging and no
launcher detection (RANK, SLURM_PROCID, ...): it does not need to know
how many processes there are or which rank downloads, and it also covers
processes started with mp.spawn before init_process_group and roots
shared by several jobs. A holder that beats but never finishes (stuck in
urlopen without a timeout) keeps the others waiting as long as it lives:
the library cannot tell a stuck call from a slow one without measuring
its thread, which nemo_safe's overlay does on top of this class.

This is on by default: it only acts with download=True when the files
are missing, where the alternative is N concurrent downloads of the same
data; when the dataset is complete, download() returns before touching
the lock, so read-only roots keep working.

The same class is what every download of nemo_safe (an overlay that
brings this series to released torchvision) waits on and leads with, as
a subclass that adds what a package can (election by link(2), the job
thread's progress, SIGTERM, logging): the code has that use already.

In torchvision/datasets/utils.py and mnist.py.

Tested: test/test_datasets_download_lock.py, one process, no real
waiting (a fake clock stands in for utils.time; the other process is
played by the test, writing its lock and files as the clock advances):
the holder's lock and its removal; a waiter returns when the holder is
done; a holder whose beat stopped is taken over after _LOCK_STALE, one
that beats is not; the holder's error reaches a waiter that saw it
running, an earlier failure does not fail a later attempt; an
interrupted holder is taken over at once; a holder taken over while it
stalled writes no outcome and removes nothing; a holder whose lock
reads as missing once still holds it; the wait ends after
_LOCK_TIMEOUT without progress; each of the five classes waits for the
other process's download instead of downloading
(download_and_extract_archive mocked); a complete dataset takes no lock.
test/test_datasets_download_race.py serves MNIST-format files from a
throttled HTTP server on 127.0.0.1 and starts 4 processes with torchrun,
rank i starting i * 1.5 s late while the largest file takes 2 s: every
process must load the right data and each file must be served once.
Before this change the race test and the five waiting tests fail.
""",
            _tv_download_once,
            tests=("test/test_datasets_download_lock.py", "test/test_datasets_download_race.py"),
            race_tests=(
                "test/test_datasets_download_race.py::test_mnist_download_from_concurrent_processes",
                "test/test_datasets_download_lock.py::test_dataset_waits_for_another_process_downloading_it",
            ),
            requires=("datasets-atomic-files",),
        ),
    ),
)
