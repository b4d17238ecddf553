"""The library patches nemo_safe applies: one module per patched library function.

This registry is all ``import nemo_safe`` loads: a patch's own module (and what it imports,
such as ``urllib.request`` for the download patches) is imported only when the library it
patches is, through :func:`nemo_safe.patching.deferred`. Importing this package imports none
of the patched libraries.
"""

from __future__ import annotations

from nemo_safe.lazy_attributes import module_getattr
from nemo_safe.patching import Patch, deferred

#: A patch module on first use (``nemo_safe.patches.torch_hub``), also before its library is imported.
__getattr__ = module_getattr(__name__, globals())


def _patch(module: str, name: str, implementation: str, apply: str, describe: str) -> Patch:
    return Patch(module, name, *deferred(f"{__name__}.{implementation}", apply, describe))


#: In the order they are applied; a module's patches follow the patches of the modules it imports.
ALL: tuple[Patch, ...] = (
    _patch("nemo.utils.exp_manager", "nemo-exp-manager-resume", "nemo_exp_manager", "apply", "describe"),
    _patch("nemo.lightning.nemo_logger", "nemo-logger-resume-order", "nemo_logger_order", "apply", "describe"),
    _patch("nemo.utils.cloud", "nemo-cloud-single-flight", "nemo_downloads", "apply_cloud", "describe_cloud"),
    _patch("nemo.core.classes.common", "nemo-cloud-binding-common", "nemo_downloads", "apply_cloud_binding",
           "describe_cloud_binding"),
    _patch("nemo.collections.common.tokenizers.megatron_utils", "nemo-megatron-single-flight", "nemo_downloads",
           "apply_megatron", "describe_megatron"),
    _patch("torchvision.datasets.utils", "torchvision-atomic-downloads", "torchvision_downloads", "apply_utils",
           "describe_utils"),
    _patch("torchvision.datasets", "torchvision-download-url-bindings", "torchvision_downloads", "apply_bindings",
           "describe_bindings"),
    _patch("torchvision.datasets.mnist", "torchvision-mnist-single-flight", "torchvision_mnist", "apply", "describe"),
    _patch("torchvision.datasets", "torchvision-datasets-single-flight", "torchvision_datasets", "apply", "describe"),
    _patch("torch.hub", "torch-hub-single-flight", "torch_hub", "apply", "describe"),
)  # fmt: skip
