"""sd-kernels: Triton kernels for Stable Diffusion in diffusers, as a drop-in, reversible patch.

    import sd_kernels
    sd_kernels.patch(pipe)            # route the UNet and VAE through our kernels
    with sd_kernels.patched(pipe): ...
    sd_kernels.unpatch(pipe)          # bit-identical to never patched
    sd_kernels.ops.group_norm(x, 32, w, b, activation="silu")

Submodules load on first use, so ``import sd_kernels`` stays cheap and does not import Triton
(TRITON_INTERPRET must be decided before Triton decorates our kernels).

Logging: every module logs under the ``sd_kernels`` logger, which has only a NullHandler, as a library
should: a program that configures no logging shows none of its messages (not even warnings). Call
``logging.basicConfig()``, or add a handler to ``logging.getLogger("sd_kernels")``, to see them; the
``sd-kernels`` command does so for warnings. ``sd_kernels.runtime.dispatch.fallbacks()`` counts the
kernels' fallbacks whatever the logging.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

logging.getLogger(__name__).addHandler(logging.NullHandler())

__version__ = "0.1.0"
__all__ = ["patch", "unpatch", "patched", "enable_context_parallel", "enable_split_decode", "offload_originals",
           "get_profile", "list_profiles", "generate_images", "ops", "reference", "models"]

_LAZY = {
    "patch": ("sd_kernels.patches", "patch"),
    "unpatch": ("sd_kernels.patches", "unpatch"),
    "patched": ("sd_kernels.patches", "patched"),
    "enable_context_parallel": ("sd_kernels.patches", "enable_context_parallel"),
    "enable_split_decode": ("sd_kernels.patches", "enable_split_decode"),
    "offload_originals": ("sd_kernels.patches", "offload_originals"),
    "get_profile": ("sd_kernels.profiles", "get_profile"),
    "list_profiles": ("sd_kernels.profiles", "list_profiles"),
    "generate_images": ("sd_kernels.apps.generate", "generate_images"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    if name in ("ops", "reference", "models", "profiles", "patches", "testing", "runtime", "analysis", "apps"):
        return importlib.import_module(f"sd_kernels.{name}")
    raise AttributeError(f"module 'sd_kernels' has no attribute {name!r}")
