"""The torchvision series: what each patch takes from nemo_safe and where it goes."""

from __future__ import annotations

import re
from pathlib import Path

from series import Series, UpstreamPatch, _copy_tests, _overlay_imports, _write_package
from source_edit import (
    constant,
    decorate_method,
    definitions,
    module_source,
    rename,
    replace_function,
    replace_once,
    without_module_indirection,
)

# ---------------------------------------------------------------------------------------- torchvision

TV_WIDTH = 120  # torchvision's black line length
TV_PACKAGE = Path("torchvision/datasets/_safe_download")
TV_RENAMES = {
    "Exceptions raised by nemo_safe.": "Exceptions raised by torchvision's dataset downloads.",
    "every error nemo_safe raises": "every error of a dataset download",
    "~nemo_safe.": "~torchvision.datasets._safe_download.",
    "NemoSafeError": "DownloadError",
    ".nemo_safe": ".torchvision_download",
    "NEMO_SAFE_BARRIER_TIMEOUT": "TORCHVISION_DOWNLOAD_TIMEOUT",
    "NEMO_SAFE_STALE_AFTER": "TORCHVISION_DOWNLOAD_STALE_AFTER",
    "NEMO_SAFE_": "TORCHVISION_",
    "nemo_safe: ": "",
    "nemo_safe-": "torchvision-",
    "nemo_safe": "torchvision",
}
TV_INIT = '''"""Dataset files that stay correct when several processes download them at once.

``atomic_files``: files are written under a temporary name and renamed into place when
complete. ``single_flight``: one process downloads into a dataset folder while the others
wait (used by the MNIST family through ``mnist_download``).
"""
'''
TV_ERRORS_1 = (
    "NemoSafeError",
    "DownloadIncomplete",
    "_typed",
    "_download_incomplete_class",
    "download_incomplete",
    "_rebuild_download_incomplete",
    "ChecksumMismatch",
    "UnsafeArchivePath",
)
TV_ERRORS_2 = (*TV_ERRORS_1, "ConfigurationError", "LeaderFailed", "LeaderDeposed", "WaitTimeout")


def without_leader_check(code: str) -> str:
    """The overlay's functions without their ``check_still_leading`` calls (a single-flight concept)."""
    return re.sub(r"^[ \t]*check_still_leading\([^)]*\)[^\n]*\n", "", code, flags=re.M)


def _tv_atomic(tree: Path) -> None:
    modules = {
        "__init__": TV_INIT,
        "errors": module_source("errors", keep=TV_ERRORS_1),
        "atomic_files": module_source("atomic_files"),
        "archive_members": module_source("archive_members"),
    }
    _write_package(tree, TV_PACKAGE, modules, TV_RENAMES, TV_WIDTH)
    path = tree / "torchvision/datasets/utils.py"
    module = "patches.torchvision_downloads"
    retrieve = definitions(module, ("urlretrieve",)).replace("def urlretrieve(", "def _urlretrieve(", 1)
    decompress = definitions(module, ("decompress",)).replace("def decompress(", "def _decompress(", 1)
    extractor = definitions(module, ("extract_tar_checked", "extract_zip_listed", "atomic_extractor"))
    for name in ("extract_tar_checked", "extract_zip_listed", "atomic_extractor"):
        extractor = re.sub(rf"\b{name}\b", f"_{name}", extractor)
    # The single flight (and its deposed-leader check) comes with the next patch, for MNIST only.
    retrieve, decompress, extractor = (without_leader_check(c) for c in (retrieve, decompress, extractor))
    retrieve, decompress = (rename(without_module_indirection(c), TV_RENAMES) for c in (retrieve, decompress))
    replace_function(path, "_urlretrieve", retrieve)
    replace_function(path, "_decompress", decompress, keep_head=True)
    replace_once(path, "_ARCHIVE_EXTRACTORS: dict[", rename(extractor, TV_RENAMES) + "\n\n_ARCHIVE_EXTRACTORS: dict[")
    replace_once(
        path,
        '    ".tar": _extract_tar,\n    ".zip": _extract_zip,\n',
        '    ".tar": _atomic_extractor(_extract_tar_checked, _extract_tar),\n'
        '    ".zip": _atomic_extractor(_extract_zip_listed(_extract_zip), _extract_zip),\n',
    )
    replace_once(
        path,
        "            _urlretrieve(url, fpath)\n        except (urllib.error.URLError, OSError) as e:",
        "            _urlretrieve(url, fpath, md5=md5)\n        except (urllib.error.URLError, OSError) as e:",
    )
    replace_once(
        path,
        "                _urlretrieve(url, fpath)\n            else:",
        "                _urlretrieve(url, fpath, md5=md5)\n            else:",
    )
    replace_once(
        path,
        "import bz2\nimport gzip\nimport hashlib\nimport lzma\n",
        "import bz2\nimport functools\nimport gzip\nimport hashlib\nimport http.client\nimport lzma\n",
    )
    replace_once(path, "import re\nimport tarfile\n", "import re\nimport shutil\nimport tarfile\n")
    imports = _overlay_imports(module, retrieve + decompress + extractor, "._safe_download", TV_WIDTH)
    anchor = (
        "from .._internally_replaced_utils import _download_file_from_remote_location, _is_remote_location_available\n"
    )
    replace_once(path, anchor, anchor + imports)
    _copy_tests("torchvision", tree, "test/test_datasets_utils_atomic.py")


def _tv_single_flight(tree: Path) -> None:
    modules = {
        "errors": module_source("errors", keep=TV_ERRORS_2),
        "waiting": module_source("waiting"),
        "cluster_identity": module_source("cluster_identity"),
        "idx_files": module_source("idx_files"),
        "single_flight": module_source("single_flight"),
        "mnist_download": module_source(
            "patches.torchvision_mnist",
            keep=(
                "log",
                "_warned",
                "raw_files",
                "preferred_leader",
                "validating_check_exists",
                "single_flight_download",
            ),
        ),
    }
    _write_package(tree, TV_PACKAGE, modules, TV_RENAMES, TV_WIDTH)
    path = tree / "torchvision/datasets/mnist.py"
    anchor = (
        "from .utils import _flip_byte_order, check_integrity, download_and_extract_archive, extract_archive, "
        "verify_str_arg\n"
    )
    replace_once(
        path,
        anchor,
        "from ._safe_download.mnist_download import single_flight_download, validating_check_exists\n" + anchor,
    )
    # The classes whose own methods the overlay replaces (FashionMNIST and KMNIST inherit MNIST's).
    for cls in constant("patches.torchvision_mnist", "CLASSES"):
        decorate_method(path, cls, "_check_exists", "validating_check_exists")
        decorate_method(path, cls, "download", "single_flight_download")
    _copy_tests("torchvision", tree, "test/test_datasets_download_race.py")


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
_urlretrieve() opens the final path with "wb" and streams into it, and
_decompress() opens the final raw file with "wb" before decompressing, as
do the tar and zip extractors. A second process building the same dataset
(every rank of a DDP job with download=True, see pytorch/tutorials#3065,
pytorch/examples#1403, pytorch/pytorch#68320 and the warning added for
#8707), or a download that breaks off, or a killed process, leaves an empty,
truncated or mixed file under the final name, and later runs fail on it with
"File not found or corrupted." or crash while loading.

Write every such file under a temporary sibling name that carries the
writer's host and pid (.tmp.<name>~<host>~<pid>~<random>) and rename it
into place only when it is complete: all Content-Length bytes arrived and,
when download_url() was given an md5, the md5 matches (download_url() now
passes it to _urlretrieve()). Same-directory rename is atomic on local
filesystems, NFS, Lustre and GPFS, so a reader sees no file or a complete
one. Extraction goes into a temporary folder inside the destination and is
renamed file by file. Temporaries of dead writers on the same host are
removed on the next write into that directory. A broken-off download raises
DownloadIncomplete and a wrong md5 ChecksumMismatch, both RuntimeErrors, so
the mirror loops of the datasets go on to the next mirror as before.

Tested: test/test_datasets_utils_atomic.py serves files from a local HTTP
server on 127.0.0.1: a connection dropped mid-file and bytes with a wrong
md5 must leave no file under the final name (both fail before this change),
a good download and an extraction must leave the files and no temporaries.
""",
            _tv_atomic,
        ),
        UpstreamPatch(
            "mnist-single-flight",
            "datasets: download the MNIST family once per root across processes",
            """
With download=True every process that builds MNIST (and FashionMNIST,
KMNIST, EMNIST, QMNIST) downloads and extracts the same files at once, as
the FSDP tutorial's mp.spawn workers do (pytorch/tutorials#3065,
pytorch/examples#1403); EMNIST even removes raw/gzip while other processes
still extract from it. _check_exists() only tests that the raw files exist,
so an empty or truncated raw file left by a killed process crashes every
later load instead of being rebuilt.

download() now runs through a single flight in root/<Class>/: the first
process to create .torchvision_download/download.<generation> with link(2)
(atomic on local disks, NFS, Lustre and GPFS; no file locks) downloads and
extracts, the others wait and load the result. The leader rewrites its lock
every second with a growing beat, so a killed leader is replaced after
TORCHVISION_DOWNLOAD_STALE_AFTER seconds (30) without trusting mtimes or
other hosts' clocks, or after 3 s when it ran on this host and its pid is
gone; an error of the leader reaches every waiting process with its message.
Rank 0 (or local rank 0, from the launcher's variables or an initialized
process group) gets a short head start; with no rank known, correctness does
not depend on who leads. _check_exists() also checks each raw IDX file's
size against its header, so download=True rebuilds a truncated file.

Tested: test/test_datasets_download_race.py serves MNIST-format files from a
throttled HTTP server on 127.0.0.1 and starts 4 processes with torchrun, rank
i starting i * 1.5 s late while the largest file takes 2 s: every process
must load the right data and each file must be served once. Before this
change later ranks truncate the file earlier ranks are still writing and
fail with "File not found or corrupted." or load wrong data.
""",
            _tv_single_flight,
        ),
    ),
)
