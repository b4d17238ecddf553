# ruff: noqa: UP035  (torchvision's typing idiom: typing.Callable)
"""What the upstream pull request puts into ``torchvision/datasets/mnist.py``, verbatim.

``ci/make_patches.py`` copies these definitions by name into torchvision 0.29.1's
``mnist.py`` (patch 0002 of ``patches/torchvision/``): ``@_download_once`` goes on the
``download`` of MNIST, EMNIST and QMNIST (FashionMNIST and KMNIST inherit MNIST's), and
their ``_check_exists`` call ``_is_complete_idx`` instead of ``check_integrity``.

The overlay (:mod:`nemo_safe.patches.torchvision_mnist`) runs the same two functions with
``torchvision.datasets.mnist``'s globals, as they run there upstream, except that the
``_download_lock`` that ``_download_once`` calls by name is the overlay's: a
:class:`~nemo_safe.single_flight.SingleFlight` (heartbeat, takeover, the leader's
failure reaching every waiter) instead of upstream's lock file
(:func:`nemo_safe.patches.torchvision_upstream._download_lock`).
"""

import functools
import os
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # found in torchvision.datasets.mnist, where these functions run
    import torch
    from torchvision.datasets.mnist import SN3_PASCALVINCENT_TYPEMAP, get_int
    from torchvision.datasets.utils import _download_lock


def _download_once(download: Callable[[Any], None]) -> Callable[[Any], None]:
    # Processes downloading into the same root take turns (see _download_lock); the later ones then find the files.
    @functools.wraps(download)
    def wrapper(self: Any) -> None:
        if self._check_exists():
            return
        with _download_lock(os.path.dirname(self.raw_folder)):
            if not self._check_exists():
                download(self)

    return wrapper


def _is_complete_idx(path: str) -> bool:
    # Its size must match its IDX header, so that download=True replaces a raw file an interrupted download cut short.
    try:
        with open(path, "rb") as f:
            header = f.read(4)
            dims = [get_int(f.read(4)) for _ in range(header[3])]
            size = os.fstat(f.fileno()).st_size
    except (OSError, IndexError, ValueError):
        return False
    dtype = SN3_PASCALVINCENT_TYPEMAP.get(header[2])
    return dtype is not None and size == 4 + 4 * len(dims) + torch.Size(dims).numel() * dtype.itemsize
