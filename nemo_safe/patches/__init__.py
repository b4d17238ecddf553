"""The library patches nemo_safe applies: one module per patched library function.

Importing this package imports none of the patched libraries.
"""

from __future__ import annotations

from nemo_safe.patches import (
    nemo_exp_manager,
    torch_hub,
    torchvision_datasets,
    torchvision_downloads,
    torchvision_mnist,
)
from nemo_safe.patching import Patch

ALL: tuple[Patch, ...] = (
    nemo_exp_manager.PATCH,
    *torchvision_downloads.PATCHES,
    torchvision_mnist.PATCH,
    *torchvision_datasets.PATCHES,
    *torch_hub.PATCHES,
)
