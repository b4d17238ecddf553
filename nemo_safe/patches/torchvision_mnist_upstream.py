# ruff: noqa: UP035  (torchvision's typing idiom: typing.Callable)
"""What the upstream pull request puts into ``torchvision/datasets/mnist.py``, verbatim.

``ci/make_patches.py`` copies this definition by name into torchvision 0.29.1's
``mnist.py`` (patch 0002 of ``patches/torchvision/``): ``@_download_once`` goes on the
``download`` of MNIST, EMNIST and QMNIST (FashionMNIST and KMNIST inherit MNIST's).

The overlay (:mod:`nemo_safe.patches.torchvision_mnist`) runs the same function with
``torchvision.datasets.mnist``'s globals, as they run there upstream; the ``_DownloadLock``
that ``_download_once`` calls by name is then a :class:`~nemo_safe.single_flight.SingleFlight`,
the overlay's subclass of upstream's :class:`~nemo_safe.download_lock._DownloadLock` (same
protocol; election by ``link(2)``, the job thread's progress, SIGTERM and logging added).
"""

import functools
import os
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # found in torchvision.datasets.mnist, where these functions run
    from torchvision.datasets.utils import _DownloadLock


def _download_once(download: Callable[[Any], None]) -> Callable[[Any], None]:
    @functools.wraps(download)  # one process downloads (see _DownloadLock); the others wait for the complete files
    def wrapper(self: Any) -> None:
        if self._check_exists():
            return
        with _DownloadLock(os.path.dirname(self.raw_folder)).hold(self._check_exists) as holding:
            if holding and not self._check_exists():
                download(self)

    return wrapper
